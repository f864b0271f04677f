"""The Wan recipe across process layouts, through real launches of train.py (gloo, 2 ranks), on tiny
diffusers Wan folders (tests/wan_tiny.py): A14B with both experts (each sample's timestep picks its
expert; a rank without a sample of an expert runs a zero-weight stand-in) and Wan 2.1 I2V (each clip's
precomputed condition latent on the channels and its CLIP image rows through image_dim). A T2V folder
of one part is not run apart: each A14B expert is that model, and one part is what every other
recipe's exactness tests train.

- 2 data-parallel ranks train what one process trains with 2 micro-batches a step: the same samples
  at every step, the same noise, the loss within floating-point noise (the same sums reduced in
  another order; launch_utils.assert_continues_the_run's default, as the other recipes' tests);
- SIGKILL of the running 2-rank job, then a relaunch, ends bit-identical to the uninterrupted run:
  weights of both experts, per-step losses, and the samples each rank trained (A14B: its resume is
  T2V's plus the second expert's checkpoint, optimizer and samples, so T2V's kill is not run apart);
- elastic: the 2-rank run's checkpoint continues on one process (2 micro-batches a step, the same 2
  data shards), each step training the samples the 2-rank run trained with its loss.

Runs are compared with each other only (never with recorded sample ids or losses).
"""

from __future__ import annotations

import csv
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from wan_tiny import clip_geometry, write_wan_folder

from launch_utils import (assert_continues_the_run, consumed, consumed_per_step, kill_after_step, launch,
                          logged_rows, loss_per_step, run_to_end)
from pan.checkpoint import layout
from pan.checkpoint.consolidate import consolidated_weights
from pan.config import load_job_config
from pan.data.precompute import main as precompute_main
from pan.data.synth import synth_dataset
from pan.recipes.wan.folder import read_folder
from pan.recipes.wan.precompute import CONDITION, IMAGE_EMBEDS
from pan.trainer import build_trainer

pytest.importorskip("diffusers")

MAX_STEPS = 6
SAVE_INTERVAL = 2
NUM_CLIPS = 8


def write_config(path: Path, folder: Path, data: Path, out: Path, accumulation: int = 1) -> Path:
    """A run of MAX_STEPS steps on `folder`'s precomputed clips, 2 clips a micro-batch, fp32."""
    geometry = clip_geometry(folder)
    cfg = {"recipe": "wan",
           "model": {"model_path": str(folder)},
           "data": {"video_csv_paths": [str(data)], "resolution_buckets": [f"{geometry['size']}x{geometry['size']}"],
                    "min_frames": geometry["frames"], "max_frames": geometry["frames"],
                    "max_tokens_per_batch": 2 * geometry["tokens"], "max_samples_per_batch": 2,
                    "packed_dataloader_num_workers": 0},
           "training": {"dtype": "fp32", "learning_rate": 1e-3, "max_steps": MAX_STEPS,
                        "gradient_accumulation_steps": accumulation},
           "output": {"output_dir": str(out), "save_interval": SAVE_INTERVAL, "save_total_limit": MAX_STEPS,
                      "log_interval": 1, "progress_bar": False}}
    path.write_text(yaml.safe_dump(cfg))
    return path


def final_weights(output_dir: Path, parts: tuple[str, ...]) -> dict[str, dict[str, torch.Tensor]]:
    final = output_dir / layout.checkpoint_name(MAX_STEPS)
    assert layout.verify_checkpoint(final) is None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {part: consolidated_weights(final / part) for part in parts}


def train_in_process(config: Path, *extra: str) -> None:
    trainer = build_trainer(load_job_config(["--config", str(config), *extra], warn=lambda m: None))
    trainer.fit()
    trainer.close()


_straight: dict[str, dict] = {}


def straight_run(variant: str, tmp_path_factory) -> dict:
    """A variant's folder and clips (precomputed) and its uninterrupted 2-rank run (made once)."""
    if variant not in _straight:
        root = tmp_path_factory.mktemp(f"wan_{variant}")
        folder = write_wan_folder(root / "model", variant)
        geometry = clip_geometry(folder)
        clips = synth_dataset(root / "clips", num_train=NUM_CLIPS, num_heldout=0, size=geometry["size"],
                              num_frames=geometry["frames"])["train_csv"]
        config = write_config(root / "pre.yaml", folder, clips, root / "unused")
        assert precompute_main(["--config", str(config), "--out", str(root / "pre")]) == 0
        data = root / "pre" / "train.csv"
        straight, log = root / "straight", root / "train.log"
        run_to_end(write_config(root / "straight.yaml", folder, data, straight), log, timeout=300)
        _straight[variant] = dict(variant=variant, root=root, folder=folder, data=data, straight=straight, log=log,
                                  parts=read_folder(folder).experts)
    return _straight[variant]


@pytest.fixture(scope="module", params=["a14b", "i2v"])
def runs(request, tmp_path_factory) -> dict:
    return straight_run(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> dict:
    """The A14B run again, SIGKILLed once step 3 is logged (after checkpoint-2) and relaunched to the
    end: both experts' checkpoints, optimizers and the expert each sample's timestep picked."""
    runs = straight_run("a14b", tmp_path_factory)
    root, log = runs["root"], runs["root"] / "killed.log"
    out = root / "killed"
    config = write_config(root / "killed.yaml", runs["folder"], runs["data"], out)
    kill_after_step(launch(config, log), out, step=SAVE_INTERVAL + 1, log=log)
    run_to_end(config, log, timeout=300)
    assert log.read_text().count(f"resuming from {layout.checkpoint_name(SAVE_INTERVAL)}") == 1, log.read_text()[-3000:]
    return {**runs, "killed": out}


def test_two_ranks_train_what_one_process_trains(runs):
    """2 ranks x 1 micro-batch = 1 process x 2 micro-batches: the same samples and losses every step."""
    one = runs["root"] / "one"
    train_in_process(write_config(runs["root"] / "one.yaml", runs["folder"], runs["data"], one, accumulation=2))
    assert sorted(consumed(runs["straight"])) == ["0.txt", "1.txt"] and sorted(consumed(one)) == ["0.txt"]
    assert_continues_the_run(runs["straight"], one, first_step=1, last_step=MAX_STEPS)
    if runs["variant"] == "a14b":   # both experts trained in the run (else the stand-ins were never tested)
        rows = (runs["straight"] / "metrics.jsonl").read_text()
        assert all(f'"samples/{part}"' in rows for part in runs["parts"])
    if runs["variant"] == "i2v":    # the rows carry the condition latent and the CLIP rows the model takes
        row = next(csv.DictReader(open(runs["data"])))
        with safe_open(str(runs["data"].parent / row["latent_path"]), "pt") as f:
            assert {CONDITION, IMAGE_EMBEDS} <= set(f.keys())
            assert f.get_slice(IMAGE_EMBEDS).get_shape()[-1] == read_folder(runs["folder"]).transformer.image_dim


def test_sigkill_and_resume_equal_the_uninterrupted_run_to_the_bit(killed):
    straight, resumed, parts = killed["straight"], killed["killed"], killed["parts"]
    assert len(parts) == 2
    a, b = final_weights(straight, parts), final_weights(resumed, parts)
    for part in parts:
        assert a[part].keys() == b[part].keys()
        assert all(torch.equal(a[part][k], b[part][k]) for k in a[part]), part
    assert loss_per_step(straight) == loss_per_step(resumed)
    assert sorted(loss_per_step(resumed)) == list(range(1, MAX_STEPS + 1))
    a_rows, b_rows = logged_rows(straight), logged_rows(resumed)   # each expert's loss and samples, by step
    keys = [f"{what}/{part}" for part in parts for what in ("loss", "samples")]
    assert any(key in a_rows[step] for step in a_rows for key in keys)
    assert all(a_rows[step].get(key) == b_rows[step].get(key) for step in a_rows for key in keys)
    assert consumed_per_step(straight) == consumed_per_step(resumed)
    # per rank, step by step (a step trained again after the kill: its last line)
    assert consumed(straight) == consumed(resumed)


def test_two_ranks_continue_on_one_process(runs, tmp_path):
    """Elastic: the 2-rank run's checkpoint-2 continues on one process with 2 micro-batches a step,
    each step training the 2-rank run's samples with its loss; nothing lost or trained twice."""
    out = tmp_path / "elastic"
    start = layout.checkpoint_name(SAVE_INTERVAL)
    shutil.copytree(runs["straight"] / start, out / start)
    train_in_process(write_config(tmp_path / "elastic.yaml", runs["folder"], runs["data"], out, accumulation=2))
    assert_continues_the_run(runs["straight"], out, first_step=SAVE_INTERVAL + 1, last_step=MAX_STEPS)

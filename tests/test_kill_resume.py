"""A 2-process training SIGKILLed at random moments (one of them inside a checkpoint save) and
relaunched until done ends bit-identical to an uninterrupted run: same final weights, EMA, data
cursors, per-step losses, and the same samples consumed by each data-parallel rank in the same order.
So does one stopped by SIGTERM (as Slurm preempts), which saves where it stopped and repeats nothing.

Two layouts of 2 processes: 2 data-parallel ranks, and 1 data-parallel rank split over 2 cp ranks.
Each layout trains one uninterrupted reference run and one killed run (module-scoped fixture), which
every assertion below compares.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml

from dist_utils import free_port
from launch_utils import assert_continues_the_run
from pan.checkpoint import layout
from pan.checkpoint.consolidate import consolidated_weights
from pan.data.synth import synth_dataset

ROOT = Path(__file__).resolve().parents[1]
MAX_STEPS = 10
SAVE_INTERVAL = 2
LAYOUTS = {"dp2": {"cp_size": 1}, "cp2": {"cp_size": 2}}  # the `distributed` section of each


def tiny_config(path: Path, data_csv: Path, output_dir: Path, distributed: dict,
                save_interval: int = SAVE_INTERVAL, workers: int = 0, keep: int = 2) -> Path:
    """The demo recipe shrunk to seconds: 1 joint block of width 32, 16x16 clips of 5 frames."""
    cfg = {
        "model": {"transformer_config_overrides": {
            "in_channels": 3, "out_channels": 3, "patch_size": [1, 4, 4], "hidden_size": 32,
            "num_attention_heads": 2, "num_layers": 1, "num_single_layers": 0, "num_refiner_layers": 1,
            "mlp_ratio": 2.0, "text_mlp_ratio": 2.0, "refiner_mlp_ratio": 2.0, "text_embed_dim": 384,
            "rope_axes_dim": [4, 6, 6]},
            "text_encoder_path": "minilm", "text_encoder_hidden_state_skip_layer": 0, "vae_type": "identity"},
        "training": {"learning_rate": 1e-3, "warmup_steps": 2, "lr_scheduler_type": "cosine",
                     "max_steps": MAX_STEPS, "use_muon": True, "dtype": "fp32", "ema_decay": 0.9},
        "data": {"video_csv_paths": [str(data_csv)], "resolution_buckets": ["16x16"], "min_frames": 5,
                 "max_frames": 5, "max_tokens_per_batch": 240, "max_samples_per_batch": 4,
                 "packed_dataloader_num_workers": workers},
        "tasks": {"conditioning_schema": "none", "cfg_drop_prob": 0.1},
        "distributed": distributed,
        "output": {"output_dir": str(output_dir), "save_interval": save_interval, "save_total_limit": keep,
                   "log_interval": 1, "report_to": "none", "validation_interval": 0},
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


class Job:
    """The ranks of one launch (two unless told), started as torchrun would start them (RANK, ...);
    without torchrun's agent in between, a SIGKILL reaches exactly the training processes. Each rank
    leads its own process group (it and its decoding workers), which `signal_rank` signals."""

    def __init__(self, config: Path, log: Path, world: int = 2):
        port = str(free_port())
        self.procs = []
        for rank in range(world):
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TQDM_DISABLE": "1",
                   "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                   "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
            with open(log, "a") as out:
                self.procs.append(subprocess.Popen(
                    [sys.executable, str(ROOT / "train.py"), "--config", str(config)],
                    cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))

    def running(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def wait(self, timeout: float) -> list[int]:
        return [p.wait(timeout=timeout) for p in self.procs]

    def signal_rank(self, rank: int, sig: int) -> None:
        os.killpg(self.procs[rank].pid, sig)

    def kill(self) -> None:
        for p in self.procs:
            p.send_signal(signal.SIGKILL)
        self.wait(timeout=60)


def tail(log: Path) -> str:
    return log.read_text()[-3000:]


def logged_steps(output_dir: Path) -> list[dict]:
    path = output_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # the line being written when the process was killed
            pass
    return rows


def last_logged_step(output_dir: Path, skip: int = 0) -> int:
    """The highest step among the logged rows after the first `skip` (0: none logged)."""
    return max((r["step"] for r in logged_steps(output_dir)[skip:]), default=0)


def wait_until(condition, job: Job, log: Path, poll: float, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert job.running(), tail(log)
        assert time.time() < deadline, tail(log)
        time.sleep(poll)


def final_state(output_dir: Path) -> dict:
    final = output_dir / layout.checkpoint_name(MAX_STEPS)
    assert layout.verify_checkpoint(final) is None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {"weights": consolidated_weights(final / layout.TRANSFORMER),
                "ema": consolidated_weights(final / layout.EMA),
                "cursors": {p.name: json.loads(p.read_text()) for p in (final / layout.DATALOADER).iterdir()},
                "train_state": torch.load(final / layout.TRAINING_STATE, weights_only=True)["train_state"]}


def last_loss_per_step(rows: list[dict]) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in rows}  # a re-run step's last row wins


def consumed_ids(output_dir: Path) -> dict[str, list[str]]:
    """Per data-parallel rank file, the sample ids of steps 1..MAX_STEPS in step order, each step
    taken from its last line (a step re-trained after a resume is the one that counted)."""
    per_rank = {}
    for path in sorted((output_dir / "consumed").glob("*.txt")):
        last_line_of_step: dict[int, list[str]] = {}
        for line in path.read_text().splitlines():
            step, *ids = line.split()
            last_line_of_step[int(step)] = ids
        steps = sorted(last_line_of_step)
        assert steps == list(range(1, MAX_STEPS + 1)), (path.name, steps)
        per_rank[path.name] = [i for step in range(1, MAX_STEPS + 1) for i in last_line_of_step[step]]
    return per_rank


@dataclass
class Runs:
    straight: Path
    killed: Path
    log: Path
    dp_ranks: int
    killed_inside_save: bool  # the first kill left a checkpoint-N.tmp behind (it hit a save)
    save_step: int            # the step of that save
    data_csv: Path
    distributed: dict


@dataclass
class Stopped:
    dir: Path
    log: Path
    exit_codes: list[int]     # of the launch that got the SIGTERM
    checkpoints: list[str]    # complete checkpoints when it had exited


def kill_inside_save(config: Path, output_dir: Path, log: Path, rng: random.Random) -> tuple[bool, int]:
    """Launch a fresh run and SIGKILL it a moment after checkpoint-S.tmp appears (S: 4 or 6), while
    the save of step S is being written. Returns whether the kill landed inside it, and S."""
    save_step = rng.choice([2 * SAVE_INTERVAL, 3 * SAVE_INTERVAL])
    tmp = output_dir / f"{layout.checkpoint_name(save_step)}.tmp"
    job = Job(config, log)
    wait_until(tmp.exists, job, log, poll=0.002)
    time.sleep(rng.uniform(0.0, 0.05))  # a save takes ~0.2-0.5 s here
    job.kill()
    # A save that finished has renamed its .tmp away; one that was cut leaves it (the next launch
    # removes it and resumes from the previous checkpoint).
    landed = tmp.exists() and not (output_dir / layout.checkpoint_name(save_step)).exists()
    return landed, save_step


def kill_after_step(config: Path, output_dir: Path, log: Path, rng: random.Random, target: int) -> None:
    """Relaunch and SIGKILL once this launch has logged step `target`, a random moment later."""
    seen = len(logged_steps(output_dir))
    job = Job(config, log)
    wait_until(lambda: last_logged_step(output_dir, skip=seen) >= target, job, log, poll=0.05)
    time.sleep(rng.uniform(0.0, 0.3))
    assert job.running()  # killed mid-run, not after the end
    job.kill()


@pytest.fixture(scope="module")
def data_csv(tmp_path_factory) -> Path:
    data = synth_dataset(tmp_path_factory.mktemp("data"), num_train=24, num_heldout=0, size=16, num_frames=5)
    return data["train_csv"]


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def runs(request, data_csv, tmp_path_factory) -> Runs:
    """The uninterrupted reference run and the killed-twice-and-resumed run of one layout."""
    root = tmp_path_factory.mktemp(request.param)
    distributed = LAYOUTS[request.param]
    straight_dir, killed_dir, log = root / "straight", root / "killed", root / "train.log"

    job = Job(tiny_config(root / "straight.yaml", data_csv, straight_dir, distributed), log)
    assert job.wait(timeout=300) == [0, 0], tail(log)

    config = tiny_config(root / "killed.yaml", data_csv, killed_dir, distributed)
    rng = random.Random(request.param)  # each layout its own (reproducible) kill moments
    landed, save_step = kill_inside_save(config, killed_dir, log, rng)
    kill_after_step(config, killed_dir, log, rng, target=rng.randint(save_step + 1, MAX_STEPS - 3))
    job = Job(config, log)
    assert job.wait(timeout=300) == [0, 0], tail(log)
    assert log.read_text().count("resuming from checkpoint-") == 2, tail(log)
    return Runs(straight_dir, killed_dir, log, 2 // distributed["cp_size"], landed, save_step, data_csv,
                distributed)


@pytest.fixture(scope="module")
def stopped(runs) -> Stopped:
    """Rank 1 and its decoding worker (every process of it, as Slurm signals a job step) get SIGTERM
    once step 2 is logged; then the same launch again, to the end. save_interval lies beyond the
    run, so the checkpoint the stop leaves is the stop's own."""
    root = runs.straight.parent
    out, log = root / "stopped", root / "stopped.log"
    config = tiny_config(root / "stopped.yaml", runs.data_csv, out, runs.distributed,
                         save_interval=10 * MAX_STEPS, workers=1)
    job = Job(config, log)
    wait_until(lambda: last_logged_step(out) >= 2, job, log, poll=0.01)
    job.signal_rank(1, signal.SIGTERM)
    codes = job.wait(timeout=120)
    complete = [p.name for p in sorted(out.glob("checkpoint-*")) if layout.verify_checkpoint(p) is None]
    assert Job(config, log).wait(timeout=300) == [0, 0], tail(log)
    return Stopped(out, log, codes, complete)


def test_a_kill_landed_inside_a_save(runs):
    assert runs.killed_inside_save, f"checkpoint-{runs.save_step} was complete before the kill"
    # ...and the relaunch cleaned up what the cut save left.
    assert f"removing checkpoint-{runs.save_step}.tmp (left by an interrupted save)" in runs.log.read_text()
    assert not list(runs.killed.glob("checkpoint-*.tmp"))


def test_resumed_run_ends_with_bit_identical_weights_ema_and_cursors(runs):
    straight, resumed = final_state(runs.straight), final_state(runs.killed)
    for part in ("weights", "ema"):
        assert straight[part].keys() == resumed[part].keys()
        for name in straight[part]:
            assert torch.equal(straight[part][name], resumed[part][name]), (part, name)
    assert straight["cursors"] == resumed["cursors"] and len(resumed["cursors"]) == runs.dp_ranks
    assert straight["train_state"] == resumed["train_state"]


def test_resumed_run_logs_the_same_loss_at_every_step(runs):
    straight = last_loss_per_step(logged_steps(runs.straight))
    assert sorted(straight) == list(range(1, MAX_STEPS + 1))
    assert straight == last_loss_per_step(logged_steps(runs.killed))


def test_resumed_run_consumes_the_same_samples_in_the_same_order(runs):
    straight, resumed = consumed_ids(runs.straight), consumed_ids(runs.killed)
    lines = sum(len((runs.straight / "consumed" / name).read_text().splitlines()) for name in straight)
    assert len(straight) == runs.dp_ranks
    assert lines == MAX_STEPS * runs.dp_ranks  # the reference run trained each step once
    assert straight == resumed  # no sample lost, repeated or reordered by the kills
    assert all(len(ids) >= MAX_STEPS for ids in straight.values())


def test_sigterm_saves_the_step_it_stopped_at_and_exits_143(stopped):
    assert stopped.exit_codes == [143, 143], tail(stopped.log)  # 128 + SIGTERM, on both ranks
    assert len(stopped.checkpoints) == 1, stopped.checkpoints
    step = int(stopped.checkpoints[0].removeprefix("checkpoint-"))
    assert 2 <= step < MAX_STEPS  # usually 4: the signal lands in a step, the sums of the next carry it
    text = stopped.log.read_text()
    assert f"stopped by SIGTERM after step {step}" in text
    assert f"resuming from checkpoint-{step}" in text


def test_sigterm_stopped_run_trains_each_step_once_and_ends_bit_identical(runs, stopped):
    for path in (stopped.dir / "consumed").glob("*.txt"):
        steps = [int(line.split()[0]) for line in path.read_text().splitlines()]
        assert steps == list(range(1, MAX_STEPS + 1)), path.name  # nothing lost, nothing trained twice
    assert consumed_ids(stopped.dir) == consumed_ids(runs.straight)
    straight, resumed = final_state(runs.straight), final_state(stopped.dir)
    for part in ("weights", "ema"):
        for name in straight[part]:
            assert torch.equal(straight[part][name], resumed[part][name]), (part, name)
    assert straight["cursors"] == resumed["cursors"]


def test_a_checkpoint_of_two_ranks_continues_on_one_exactly(runs, tmp_path):
    """Elastic resume: the dp2 run's checkpoint-8 continues on one process with twice the
    accumulation (the same 2 data shards): each step trains the samples the two-rank run trained,
    with the same noise; model and optimizer reshard through DCP; the loss is the two-rank run's."""
    from pan.config import load_job_config
    from pan.logging import get_logger
    from pan.trainer import build_trainer

    if runs.dp_ranks != 2:  # (the cp2 layout's run has one data-parallel rank)
        pytest.skip("continues the run of 2 data-parallel ranks")
    out = tmp_path / "elastic"
    shutil.copytree(runs.straight / "checkpoint-8", out / "checkpoint-8")
    config = tiny_config(tmp_path / "elastic.yaml", runs.data_csv, out, {"cp_size": 1})
    job = load_job_config(["--config", str(config), "--gradient_accumulation_steps", "2"], warn=lambda m: None)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    get_logger().addHandler(handler)
    try:
        build_trainer(job).fit()
    finally:
        get_logger().removeHandler(handler)
    assert any("each of the 2 data shards continues exactly" in r.getMessage() for r in records)
    assert_continues_the_run(runs.straight, out, first_step=9, last_step=MAX_STEPS)


def test_a_checkpoint_of_two_ranks_continues_on_one_cp_group_of_two(runs, tmp_path):
    """The same continuation on two processes that form one context-parallel group (dp 1, 2
    micro-batches a step): only its cp rank 0 reads data, both old ranks' shards."""
    if runs.dp_ranks != 2:
        pytest.skip("continues the run of 2 data-parallel ranks")
    out = tmp_path / "elastic_cp"
    shutil.copytree(runs.straight / "checkpoint-8", out / "checkpoint-8")
    config = tiny_config(tmp_path / "elastic_cp.yaml", runs.data_csv, out, {"cp_size": 2})
    cfg = yaml.safe_load(config.read_text())
    cfg["training"]["gradient_accumulation_steps"] = 2
    config.write_text(yaml.safe_dump(cfg))
    log = tmp_path / "elastic_cp.log"
    assert Job(config, log).wait(timeout=300) == [0, 0], tail(log)
    assert "resuming from checkpoint-8" in log.read_text()
    assert "each of the 2 data shards continues exactly" in log.read_text()
    assert sorted(p.name for p in (out / "consumed").iterdir()) == ["0.txt"]  # one data-parallel rank
    assert_continues_the_run(runs.straight, out, first_step=9, last_step=MAX_STEPS)

"""A 2-rank training SIGKILLed at random moments and relaunched until done ends bit-identical to an
uninterrupted run: same final weights, EMA, data cursors, per-step losses and samples seen."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch
import yaml

from dist_utils import free_port
from pan.checkpoint import dcp as layout
from pan.checkpoint.export import consolidated_weights
from pan.data.synth import synth_dataset

ROOT = Path(__file__).resolve().parents[1]
MAX_STEPS = 10


def tiny_config(path: Path, data_csv: Path, output_dir: Path) -> Path:
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
                 "packed_dataloader_num_workers": 0},
        "tasks": {"conditioning_schema": "none", "cfg_drop_prob": 0.1},
        "output": {"output_dir": str(output_dir), "save_interval": 2, "save_total_limit": 2,
                   "log_interval": 1, "report_to": "none", "validation_interval": 0},
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


class Job:
    """The two ranks of one launch, started as torchrun would start them (RANK, WORLD_SIZE, ...);
    without torchrun's agent in between, a SIGKILL reaches exactly the training processes."""

    def __init__(self, config: Path, log: Path):
        port = str(free_port())
        self.procs = []
        for rank in range(2):
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TQDM_DISABLE": "1",
                   "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                   "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
            with open(log, "a") as out:
                self.procs.append(subprocess.Popen(
                    [sys.executable, str(ROOT / "train.py"), "--config", str(config)],
                    cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT))

    def running(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def wait(self, timeout: float) -> list[int]:
        return [p.wait(timeout=timeout) for p in self.procs]

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


def test_sigkilled_training_resumes_to_bit_identical_weights_and_data(tmp_path):
    data = synth_dataset(tmp_path / "data", num_train=24, num_heldout=0, size=16, num_frames=5)
    straight_dir, killed_dir = tmp_path / "straight", tmp_path / "killed"

    log = tmp_path / "train.log"
    job = Job(tiny_config(tmp_path / "straight.yaml", data["train_csv"], straight_dir), log)
    assert job.wait(timeout=300) == [0, 0], tail(log)

    config = tiny_config(tmp_path / "killed.yaml", data["train_csv"], killed_dir)
    rng = random.Random(0)
    first = rng.randint(2, 5)
    for target in (first, rng.randint(first + 1, MAX_STEPS - 3)):
        # SIGKILL once this launch has logged step `target`, a random moment later (saves included).
        seen = len(logged_steps(killed_dir))
        job = Job(config, log)
        deadline = time.time() + 300
        while max((r["step"] for r in logged_steps(killed_dir)[seen:]), default=0) < target:
            assert job.running(), tail(log)
            assert time.time() < deadline, tail(log)
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 0.3))
        assert job.running()  # killed mid-run, not after the end
        job.kill()
    job = Job(config, log)
    assert job.wait(timeout=300) == [0, 0], tail(log)
    assert log.read_text().count("resuming from checkpoint-") == 2

    straight, resumed = final_state(straight_dir), final_state(killed_dir)
    for part in ("weights", "ema"):
        assert straight[part].keys() == resumed[part].keys()
        for name in straight[part]:
            assert torch.equal(straight[part][name], resumed[part][name]), (part, name)
    assert straight["cursors"] == resumed["cursors"] and len(resumed["cursors"]) == 2
    assert straight["train_state"] == resumed["train_state"]
    assert last_loss_per_step(logged_steps(straight_dir)) == last_loss_per_step(logged_steps(killed_dir))

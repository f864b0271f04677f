"""The real launcher end to end: `torchrun --nproc_per_node 2 train.py --config config/tiny_cpu.yaml`
trains on a tiny synthetic dataset (2 data-parallel ranks, or 1 split over 2 cp ranks) and its
logged loss falls."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pan.checkpoint import layout
from pan.data.synth import synth_dataset

ROOT = Path(__file__).resolve().parents[1]
STEPS = 30
LOG_INTERVAL = 5  # each logged loss is the mean of 5 steps: flow-matching losses are noisy


@pytest.fixture(scope="module")
def train_csv(tmp_path_factory) -> Path:
    data = synth_dataset(tmp_path_factory.mktemp("synth"), num_train=16, num_heldout=2, size=32,
                         num_frames=5)
    return data["train_csv"]


@pytest.mark.parametrize("cp_size", [1, 2], ids=["dp2", "cp2"])
def test_torchrun_tiny_cpu_run_lowers_the_loss(tmp_path, train_csv, cp_size):
    output_dir = tmp_path / "run"
    command = ["torchrun", "--standalone", "--nproc_per_node", "2", "train.py",
               "--config", "config/tiny_cpu.yaml", "--video_csv_paths", str(train_csv),
               "--output_dir", str(output_dir), "--max_steps", str(STEPS), "--log_interval",
               str(LOG_INTERVAL), "--save_interval", str(STEPS), "--cp_size", str(cp_size)]
    # torchrun from this interpreter's environment; one thread per rank (2 ranks share 2 cores).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TQDM_DISABLE": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(LOG_INTERVAL, STEPS + 1, LOG_INTERVAL))
    first, last = rows[0]["loss"], rows[-1]["loss"]
    assert last < 0.8 * first, [round(r["loss"], 4) for r in rows]

    meta = layout.read_json(output_dir / layout.checkpoint_name(STEPS) / layout.META)
    assert (meta["world_size"], meta["cp_size"], meta["dp_size"]) == (2, cp_size, 2 // cp_size)
    # Every data-reading rank logged each step once: 2 dp ranks, or cp rank 0 of the one group.
    consumed = sorted(p.name for p in (output_dir / "consumed").iterdir())
    assert consumed == [f"{r}.txt" for r in range(2 // cp_size)]

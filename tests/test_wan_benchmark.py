"""`benchmarks/wan_step.py --quick` (pan's Wan step against diffusers' WanTransformer3DModel) runs whole as
a user runs it: both cases, the table printed, the JSON written, and pan's loss and gradients equal
diffusers' to fp32 rounding on the same inputs (`same`) and on the mixed-length clips diffusers takes
one length at a time (`mixed`). Speed is the real run's (docs/wan.md), never asserted here."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# fp32 rounding of the same sums in another order: measured <= 2.2e-6 (gradients) on the quick config
FP32_TOL = 1e-4

pytest.importorskip("diffusers")


def test_wan_step_benchmark_quick_mode_prints_its_table_and_writes_json(tmp_path):
    out = tmp_path / "wan_step.json"
    run = subprocess.run([sys.executable, "benchmarks/wan_step.py", "--quick", "--out", str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=600, check=False,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert "diffusers/pan_cpu" in run.stdout and "diffusers_padded/pan_cpu" in run.stdout
    same, mixed = json.loads(out.read_text())["rows"]
    assert (same["case"], mixed["case"]) == ("same", "mixed")
    assert mixed["padded_tokens"] > mixed["video_tokens"] and same["padded_tokens"] == same["video_tokens"]
    for row in (same, mixed):
        assert row["loss_rel_diff"] <= FP32_TOL and row["grad_max_rel_diff"] <= FP32_TOL, row
    assert {"pan", "diffusers"} == set(same["times"])
    assert {"pan", "diffusers_padded", "diffusers_per_length"} == set(mixed["times"])

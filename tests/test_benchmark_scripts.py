"""Every benchmark starts both ways a user runs it: `python benchmarks/X.py` and
`python -m benchmarks.X` (measurements themselves belong in benchmarks/, never in tests); one with a
quick mode (benchmarks/lora.py --quick) also runs whole."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for p in (ROOT / "benchmarks").glob("*.py") if p.stem not in ("__init__", "common"))

# `python benchmarks/X.py --help` and `python -m benchmarks.X --help` for every X, each way in one
# interpreter (a torch import per benchmark saved): as scripts, with the benchmarks folder first on
# sys.path and the current folder off it (-P), as `python benchmarks/X.py` has it, so a script that
# imports `benchmarks.` without its fallback fails here as it would there; as modules, with the
# repository root on sys.path. Prints each one's exit code and the start of what it printed.
RUN_EACH = """
import contextlib, io, os, runpy, sys
how, names = sys.argv[1], sys.argv[2:]
if how == "script":
    sys.path.insert(0, os.path.abspath("benchmarks"))
for name in names:
    sys.argv = [name, "--help"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            if how == "script":
                runpy.run_path(name, run_name="__main__")
            else:
                runpy.run_module(name, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code or 0
    print(name, code, repr(out.getvalue()[:6]))
"""


@pytest.mark.parametrize("how", ["script", "module"])
def test_every_benchmark_starts_as_a_script_and_as_a_module(how):
    names = [f"benchmarks/{p.name}" if how == "script" else f"benchmarks.{p.stem}" for p in SCRIPTS]
    flags = ["-P"] if how == "script" else []
    run = subprocess.run([sys.executable, *flags, "-c", RUN_EACH, how, *names], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.splitlines() == [f"{name} 0 'usage:'" for name in names], run.stderr[-2000:]


def test_lora_benchmark_quick_mode_prints_its_table_and_writes_json(tmp_path):
    """`benchmarks/lora.py --quick`: both modes of a tiny Pyramid-Flow DiT trained by the real trainer,
    the table printed and the JSON written; the adapters are what LoRA trains and saves, and the
    memory estimate is within 20% of the measured peak in both modes (the goals' ratios need the full
    size: the real run)."""
    out = tmp_path / "lora.json"
    run = subprocess.run([sys.executable, "benchmarks/lora.py", "--quick", "--out", str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=600, check=False,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert "lora/full: peak memory" in run.stdout and "checkpoint_MiB" in run.stdout
    full, lora = json.loads(out.read_text())["rows"]
    assert (full["mode"], lora["mode"]) == ("full", "lora r16")
    assert full["trained_M"] == full["params_M"] and lora["trained_M"] < full["trained_M"]
    assert lora["checkpoint_MiB"] < full["checkpoint_MiB"]
    assert all(abs(row["estimate/peak"] - 1) <= 0.2 for row in (full, lora)), (full, lora)

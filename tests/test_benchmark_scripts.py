"""Every benchmark starts both ways a user runs it: `python benchmarks/X.py` and
`python -m benchmarks.X` (measurements themselves belong in benchmarks/, never in tests)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for p in (ROOT / "benchmarks").glob("*.py") if p.stem not in ("__init__", "common"))


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_benchmark_starts_as_a_script_and_as_a_module(script):
    for command in ([sys.executable, str(script.relative_to(ROOT)), "--help"],
                    [sys.executable, "-m", f"benchmarks.{script.stem}", "--help"]):
        run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0 and run.stdout.startswith("usage:"), (command, run.stderr[-2000:])

"""Every benchmark starts both ways a user runs it: `python benchmarks/X.py` and
`python -m benchmarks.X` (measurements themselves belong in benchmarks/, never in tests)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for p in (ROOT / "benchmarks").glob("*.py") if p.stem not in ("__init__", "common"))

# `python -m benchmarks.X --help` for every X in one interpreter: as modules they all import with
# the same sys.path (the repository root), so one process stands for one each and saves a torch
# import per benchmark. Prints each module's exit code and the start of what it printed.
AS_MODULES = """
import contextlib, io, runpy, sys
for name in sys.argv[1:]:
    sys.argv = [name, "--help"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_module(name, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code or 0
    print(name, code, repr(out.getvalue()[:6]))
"""


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_benchmark_starts_as_a_script(script):
    command = [sys.executable, str(script.relative_to(ROOT)), "--help"]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.startswith("usage:"), (command, run.stderr[-2000:])


def test_every_benchmark_starts_as_a_module():
    names = [f"benchmarks.{p.stem}" for p in SCRIPTS]
    run = subprocess.run([sys.executable, "-c", AS_MODULES, *names], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.splitlines() == [f"{name} 0 'usage:'" for name in names], run.stderr[-2000:]

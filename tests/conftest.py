"""The suite runs on the CPU, also where GPUs are visible.

Its references are CPU results (gloo process groups, bit-exact comparisons with one CPU process), and
a GPU machine would otherwise put every `init_world()` of a test, and every train.py a test starts,
on cuda:LOCAL_RANK under NCCL. So GPUs are hidden from this process and every process it starts,
unless PAN_TEST_CUDA=1: then the CUDA tests of tests/test_gpu_paths.py run on the GPU (as
benchmarks/gpu_session.sh does); run only those that way.

Test files run in parallel (`make test`: pytest-xdist, one whole file per worker), so a test must not
depend on the order of files or on another file's state.
"""

import os
import shutil
import tempfile

if os.environ.get("PAN_TEST_CUDA") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

# `pan check` wraps its table to the terminal's width; the tests' expectations are written for 100
# columns, wherever they run (a terminal, a pipe, an xdist worker).
os.environ["COLUMNS"] = "100"


def pytest_configure(config):
    """Traced steps (`pan.estimate.trace.cached_trace_step`) are kept on disk for this run only, in
    a folder the xdist workers and every process they start share (they inherit the environment):
    no test reads a trace an earlier run of the suite left."""
    if hasattr(config, "workerinput") or "PAN_CACHE_DIR" in os.environ:
        return
    config._pan_cache = tempfile.mkdtemp(prefix="pan-test-cache-")
    os.environ["PAN_CACHE_DIR"] = config._pan_cache


def pytest_unconfigure(config):
    if getattr(config, "_pan_cache", None):
        shutil.rmtree(config._pan_cache, ignore_errors=True)

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


# The files that took longest (summed test time, measured 2026-12-07 on the 2-core machine), longest
# first. They run first: each xdist worker takes the next whole file when it is free (`make test`
# passes --no-loadscope-reorder, else xdist would order files by their number of tests), so the
# suite does not end with one worker running a long file while the other idles. Files not listed
# keep their collection order after these; a stale list costs time, never a result.
LONGEST_FIRST = ("test_pyramid_flow_recipe", "test_lease", "test_lora", "test_kill_resume", "test_launch_scripts",
                 "test_wan_exactness", "test_golden", "test_causal_vae_recipe", "test_lora_memory",
                 "test_benchmark_scripts", "test_startup_sigterm", "test_pyramid_flow_ar", "test_wan_check",
                 "test_estimate", "test_parallel_exactness", "test_refusal_parity", "test_watchdog",
                 "test_elastic_resume", "test_pyramid_fixture_sets", "test_data_s3")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))   # stable: files keep their own order

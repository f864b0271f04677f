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

if os.environ.get("PAN_TEST_CUDA") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

# `pan check` wraps its table to the terminal's width; the tests' expectations are written for 100
# columns, wherever they run (a terminal, a pipe, an xdist worker).
os.environ["COLUMNS"] = "100"

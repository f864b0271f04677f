"""The suite runs on the CPU, also where GPUs are visible.

Its references are CPU results (gloo process groups, bit-exact comparisons with one CPU process), and
a GPU machine would otherwise put every `init_world()` of a test, and every train.py a test starts,
on cuda:LOCAL_RANK under NCCL. So GPUs are hidden from this process and every process it starts,
unless PAN_TEST_CUDA=1: then the CUDA tests of tests/test_gpu_paths.py run on the GPU (as
benchmarks/gpu_session.sh does); run only those that way.
"""

import os

if os.environ.get("PAN_TEST_CUDA") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

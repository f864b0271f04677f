"""Parallelism applied to single-device models from outside: device mesh, FSDP2/HSDP, Ulysses CP.

The trainer uses only what this module exports.
"""

from pan.parallel.mesh import build_mesh, context_parallel_for  # noqa: F401
from pan.parallel.fsdp import (clip_grad_norm, materialize_and_init, parallelize_model,  # noqa: F401
                               set_gradient_sync)

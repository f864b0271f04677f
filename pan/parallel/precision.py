"""pan's compute precision, written once: bf16 compute is bf16 autocast over the weights as they are
(fp32 master weights in training, bf16 weights when sampling); fp32 is no autocast at all.

Every forward that computes in the run's precision enters it here: the train step
(`pan.task.StepContext.autocast`), validation, FSDP's forwards (`pan.parallel.fsdp.autocast_forward`),
`pan sample`, and the estimate's traced step.
"""

from __future__ import annotations

import contextlib

import torch


def is_bf16(dtype: str | torch.dtype) -> bool:
    """Whether `dtype` (the config's `dtype` key, "bf16" or "fp32", or a torch dtype) computes in bf16."""
    return dtype == "bf16" or dtype == torch.bfloat16


def autocast_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """The dtype matmuls and attention compute in under `dtype`'s autocast."""
    return torch.bfloat16 if is_bf16(dtype) else torch.float32


def compute_precision(dtype: str | torch.dtype, device_type: str, *, weight_cache: bool | None = False,
                      fp32_disables: bool = False):
    """The context a forward (and its backward) computes in: under bf16, bf16 autocast on
    `device_type`; under fp32, nothing, or with `fp32_disables` a disabled autocast (which also
    switches off an autocast around it).

    Autocast's weight-cast cache is off by default (the validated eager mode): FSDP frees the
    unsharded weights after each block, so a cached cast would keep a stale copy alive.
    `weight_cache=None` leaves it as torch has it (on, unless switched off globally)."""
    if fp32_disables:
        return torch.autocast(device_type, dtype=torch.bfloat16, enabled=is_bf16(dtype), cache_enabled=weight_cache)
    if not is_bf16(dtype):
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=torch.bfloat16, cache_enabled=weight_cache)

"""`attention_backend: auto` in a run: each part's `auto` attention becomes one backend for the rest
of the run, the same on every rank.

The run's choice is the one it made before (kept in the checkpoint's train state, so that a resumed
run computes with the same kernels, to the bit), or else, once a step has run, the fastest on rank
0's first pack: rank 0 times the exact backends on the attention calls its modules recorded
(`pan.models.attention.measure_backends`) and broadcasts its choice. Every rank takes rank 0's
choice: ranks on other kernels would compute other bits.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from pan.logging import get_logger
from pan.models.attention import auto_attention, auto_candidates, describe, fastest, measure_backends
from pan.parallel.precision import autocast_dtype


def settle_auto_attention(models: dict[str, nn.Module], world, dtype: str, chosen: dict[str, str],
                          measure: bool = True) -> bool:
    """Turn each part's `auto` attention into one backend for the rest of the run: the one the
    run chose before (`chosen`: part name -> backend, the train state's, kept in the checkpoint),
    or else, with `measure` once a step has run, the fastest on rank 0's first pack. Every rank
    takes rank 0's choice. `models`: part name -> its model; `world`: this process (its device,
    whether it is rank 0); `dtype`: the run's (`bf16` or `fp32`). Records each choice in `chosen`
    and logs it; returns whether no part's attention is left on `auto` (then nothing is left to
    settle)."""
    log = get_logger()
    settled = True
    for name, model in models.items():
        modules = auto_attention(model)
        if not modules:
            continue
        choice, how = chosen.get(name), "kept from the checkpoint"
        if choice is not None and choice not in auto_candidates(world.device, autocast_dtype(dtype)):
            log.warning("attention_backend auto: the checkpoint's choice for %s, %s, cannot run on "
                        "%s; measuring again (the kernels, and so the bits, change)", name, choice,
                        world.device)
            choice = None
        if choice is None and measure:
            choice, how = measure_attention(modules, world)
        if choice is None:
            settled = False
            continue
        for module in modules:
            module.backend, module.first_call = choice, None
        chosen[name] = choice
        log.info("attention_backend auto of %s: %s (%s)", name, choice, how)
    return settled


def measure_attention(modules: list, world) -> tuple[str | None, str]:
    """Rank 0 times the exact backends on the attention calls its modules recorded in the last
    step (forward and backward); every rank gets its choice (None: nothing was recorded)."""
    result: tuple[str | None, str] = (None, "")
    if world.is_main:
        calls = [m.first_call for m in modules if m.first_call is not None]
        if calls:
            times = measure_backends(calls)
            try:
                result = (fastest(times), "the fastest on rank 0's first pack, forward and backward of "
                          f"its {len(calls)} attention calls: {describe(times)}")
            except RuntimeError as e:
                result = ("", str(e))
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [result]
        dist.broadcast_object_list(box, src=0)
        result = box[0]
    if result[0] == "":
        raise RuntimeError(result[1])
    return result

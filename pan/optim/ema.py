"""Exponential moving average of the weights (`ema_decay`), for sampling and export.

    ema <- decay * ema + (1 - decay) * weight        after every optimizer step

Build it after the model is parallelised: the shadow copies then have the parameters' layout (FSDP2
DTensor shards stay shards, so the EMA costs one more copy of this rank's shard, not of the model),
and the update is a purely local elementwise op.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from pan.parallel.names import unwrapped_name


def _local(t: Tensor) -> Tensor:
    """This rank's data of a (possibly sharded) tensor."""
    return t.to_local() if isinstance(t, DTensor) else t


class EMA:
    """Shadow weights of `model`'s trainable parameters, keyed by the unwrapped model's parameter
    names (so checkpoints and exports do not depend on activation checkpointing or compile)."""

    def __init__(self, model: nn.Module, decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"EMA decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.params = {unwrapped_name(n): p for n, p in model.named_parameters() if p.requires_grad}
        self.shadow = {n: p.detach().clone() for n, p in self.params.items()}

    @torch.no_grad()
    def update(self) -> None:
        """Move the shadow weights towards the current weights (call after each optimizer step)."""
        shadow = [_local(self.shadow[n]) for n in self.params]
        current = [_local(p.detach()) for p in self.params.values()]
        torch._foreach_lerp_(shadow, current, 1.0 - self.decay)

    @torch.no_grad()
    def _swap(self) -> None:
        # One tensor at a time, so swapping costs one parameter's worth of extra memory.
        for name, p in self.params.items():
            weight, shadow = _local(p.detach()), _local(self.shadow[name])
            held = weight.clone()
            weight.copy_(shadow)
            shadow.copy_(held)

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """Run the model with the EMA weights inside the block (e.g. to sample); restored after."""
        self._swap()
        try:
            yield
        finally:
            self._swap()

    def state_dict(self) -> dict[str, Tensor]:
        """Shadow weights by parameter name (DTensors when sharded, so DCP can save them)."""
        return dict(self.shadow)

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        missing, unexpected = set(self.shadow) - set(state), set(state) - set(self.shadow)
        if missing or unexpected:
            raise ValueError(f"EMA state does not match the model: missing {sorted(missing)[:5]}, "
                             f"unexpected {sorted(unexpected)[:5]}")
        for name, value in state.items():
            self.shadow[name].copy_(value)

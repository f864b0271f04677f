"""Random numbers for pyramid flow matching (`pan.diffusion.pyramid_schedule` has the math).

Randomness. Every function that draws takes a `Draws` (`rand(shape)`, `randn(shape)`); the default
`GeneratorDraws` reads one `torch.Generator`, whose state a recipe saves for an exact resume. The
draw order is the original's, so replaying its recorded draws reproduces its outputs bit for bit.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch
from torch import Tensor


class Draws(Protocol):
    """A source of random numbers, consumed in a fixed order (float32 tensors)."""

    def rand(self, shape: Sequence[int]) -> Tensor: ...   # U[0, 1)

    def randn(self, shape: Sequence[int]) -> Tensor: ...  # N(0, 1)


class GeneratorDraws:
    """Draws from one `torch.Generator`, on its device. Save `generator.get_state()` to resume exactly.

    `stage_timestep_sampling: flow` draws through `pan.diffusion.flow`, which needs a CPU generator.
    """

    def __init__(self, generator: torch.Generator):
        self.generator = generator

    def rand(self, shape: Sequence[int]) -> Tensor:
        return torch.rand(tuple(shape), generator=self.generator, device=self.generator.device)

    def randn(self, shape: Sequence[int]) -> Tensor:
        return torch.randn(tuple(shape), generator=self.generator, device=self.generator.device)


class PerSampleDraws:
    """Draws for a batch whose row i (the leading dimension) comes from generator i: samples drawn
    together get exactly the numbers each would draw alone from its own generator (a validation
    prompt keeps its seed's noise whatever batch it is sampled in)."""

    def __init__(self, generators: Sequence[torch.Generator]):
        self.draws = [GeneratorDraws(g) for g in generators]

    def _rows(self, shape: Sequence[int], draw) -> Tensor:
        if shape[0] != len(self.draws):
            raise ValueError(f"a draw of {shape[0]} rows from {len(self.draws)} per-sample generators")
        return torch.cat([draw(d, (1, *shape[1:])) for d in self.draws])

    def rand(self, shape: Sequence[int]) -> Tensor:
        return self._rows(shape, GeneratorDraws.rand)

    def randn(self, shape: Sequence[int]) -> Tensor:
        return self._rows(shape, GeneratorDraws.randn)

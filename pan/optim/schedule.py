"""Learning-rate schedule (warmup, then constant / cosine / linear decay to a floor) and clipping.

`step` counts optimizer steps already taken (0 for the first update), with W = `warmup_steps`,
D = `lr_decay_steps` (or max_steps - W when unset), peak = `learning_rate`,
floor = `lr_decay_floor_ratio` * peak:

    step < W:       peak * (step + 1) / W                  (linear from 0; the first update is not wasted)
    step >= W:      p = min((step - W) / D, 1)
                    constant: peak
                    linear:   floor + (peak - floor) * (1 - p)
                    cosine:   floor + (peak - floor) * (1 + cos(pi p)) / 2

and the lr stays at the floor once the decay is over.
"""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING

from torch.optim.lr_scheduler import LambdaLR

if TYPE_CHECKING:
    from pan.optim.config import OptimConfig


def decay_steps(cfg: "OptimConfig", max_steps: int) -> int:
    """Length of the decay phase: `lr_decay_steps`, or the rest of the run after warmup."""
    return cfg.lr_decay_steps if cfg.lr_decay_steps is not None else max(max_steps - cfg.warmup_steps, 0)


def lr_at(step: int, cfg: "OptimConfig", max_steps: int) -> float:
    """The learning rate of optimizer step `step` (see the module docstring)."""
    peak = cfg.learning_rate
    if step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    if cfg.lr_scheduler_type == "constant":
        return peak
    length = decay_steps(cfg, max_steps)
    progress = min((step - cfg.warmup_steps) / length, 1.0) if length > 0 else 1.0
    floor = cfg.lr_decay_floor_ratio * peak
    if cfg.lr_scheduler_type == "linear":
        return floor + (peak - floor) * (1.0 - progress)
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


class LRSchedulers:
    """One `LambdaLR` per optimizer of an `OptimizerSet`, stepped together after each optimizer step.

    Each group's lr is `learning_rate` times lr_at(step) / learning_rate, so Muon's per-matrix RMS
    factor and any per-group lr stay proportional. `state_dict()` holds the step count for checkpoints.
    """

    def __init__(self, optimizers, cfg: "OptimConfig", max_steps: int):
        def multiplier(step: int) -> float:
            return lr_at(step, cfg, max_steps) / cfg.learning_rate

        self.schedulers = {name: LambdaLR(opt, multiplier) for name, opt in optimizers.by_name.items()}

    def step(self) -> None:
        with warnings.catch_warnings():
            # The schedule follows the step count, also over steps skipped for a non-finite loss
            # (which call no optimizer.step(); torch warns about exactly that order).
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step()`")
            for scheduler in self.schedulers.values():
                scheduler.step()

    def get_last_lr(self) -> list[float]:
        """[the base learning rate now in force] (before Muon's per-matrix factor), as LambdaLR's."""
        return [next(iter(self.schedulers.values())).get_last_lr()[0]]

    def state_dict(self) -> dict:
        return {name: s.state_dict() for name, s in self.schedulers.items()}

    def load_state_dict(self, state: dict) -> None:
        if set(state) != set(self.schedulers):
            raise ValueError(f"scheduler state holds {sorted(state)}, this run has {sorted(self.schedulers)}"
                             " (was use_muon changed between runs?)")
        for name, s in self.schedulers.items():
            s.load_state_dict(state[name])

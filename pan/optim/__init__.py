"""Optimisers: Muon + AdamW parameter split, learning-rate schedules, gradient clipping, weight EMA."""

from pan.optim.builder import (OptimConfig, OptimizerSet, build_optimizer, build_scheduler,
                               split_parameters)
from pan.optim.ema import EMA
from pan.optim.muon import Muon, newton_schulz
from pan.optim.schedule import LRSchedulers, lr_at

__all__ = ["OptimConfig", "OptimizerSet", "build_optimizer", "build_scheduler", "split_parameters",
           "EMA", "Muon", "newton_schulz", "LRSchedulers", "lr_at"]

"""Optimisers: Muon + AdamW parameter split, learning-rate schedules, gradient clipping, weight EMA."""

from pan.optim.builder import OptimizerSet, build_optimizer, build_scheduler, split_parameters
from pan.optim.config import OptimConfig, prefixed_optim_config
from pan.optim.ema import EMA
from pan.optim.muon import Muon, newton_schulz
from pan.optim.schedule import LRSchedulers, lr_at

__all__ = ["OptimConfig", "OptimizerSet", "build_optimizer", "build_scheduler", "split_parameters", "prefixed_optim_config",
           "EMA", "Muon", "newton_schulz", "LRSchedulers", "lr_at"]

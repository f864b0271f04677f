"""The toy GAN's keys: its model and data, and the discriminator's own optimizer keys."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pan.checkpoint.manager import CheckpointConfig
from pan.config import JobConfig
from pan.config.core import knob
from pan.runtime.metrics import MetricsConfig
from pan.runtime.watchdog_config import WatchdogConfig
from pan.optim import OptimConfig, prefixed_optim_config
from pan.parallel.dims import ParallelConfig
from pan.trainer import TrainerConfig

@dataclass(kw_only=True)
class ToyConfig:
    SECTION: ClassVar[str] = "model"

    toy_width: int = knob(16, "hidden width of the generator and the discriminator", ge=1)
    toy_samples: int = knob(40, "real samples in the data set", ge=1)
    toy_batch: int = knob(3, "samples per micro-batch and data-parallel rank", ge=1)
    toy_discriminator: bool = knob(True, "train the discriminator part (false: the generator alone)")
    toy_step_sleep: float = knob(0.0, "seconds to sleep in each step (gives a kill test time)", ge=0)
    toy_sleep_first_run_only: bool = knob(False, "sleep only in a Slurm job's first run (SLURM_RESTART_COUNT "
                                                 "unset or 0): a requeued run finishes fast")


DiscOptimConfig = prefixed_optim_config(
    "disc_", "discriminator", "the discriminator's optimizer keys", learning_rate=3e-3,
    adam_beta1=0.5, adam_beta2=0.9, use_muon=False, max_grad_norm=0.0)


@dataclass(kw_only=True)
class ToyGanJobConfig(JobConfig):
    toy: ToyConfig = knob(ToyConfig(), "")
    trainer: TrainerConfig = knob(TrainerConfig(dtype="fp32"), "")
    watchdog: WatchdogConfig = knob(WatchdogConfig(), "")
    optim: OptimConfig = knob(OptimConfig(), "")
    disc_optim: DiscOptimConfig = knob(DiscOptimConfig(), "")
    parallel: ParallelConfig = knob(ParallelConfig(), "")
    checkpoint: CheckpointConfig = knob(CheckpointConfig(), "")
    logging: MetricsConfig = knob(MetricsConfig(), "")

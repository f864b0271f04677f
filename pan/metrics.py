"""Training metrics: the console log, a progress bar, and `report_to` backends."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from pan.config.core import knob


@dataclass(kw_only=True)
class MetricsConfig:
    SECTION: ClassVar[str] = "output"

    log_interval: int = knob(10, "log loss, grad norm, lr, throughput and MFU every this many steps",
                             ge=1)
    report_to: Literal["none", "wandb", "tensorboard"] = knob(
        "none", "where metrics also go: wandb (WANDB_PROJECT / WANDB_RUN_ID / WANDB_API_KEY from the "
                "environment) or tensorboard (output_dir/tensorboard)")
    progress_bar: bool = knob(True, "show a progress bar on the console (rank 0)")

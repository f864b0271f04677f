"""Checkpoint folders of a run: `output_dir/checkpoint-N/`, written atomically, pruned, resumed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pan.config.core import knob


@dataclass(kw_only=True)
class CheckpointConfig:
    SECTION: ClassVar[str] = "output"

    output_dir: str = knob("runs/default", "the run's directory: checkpoints, logs, samples, "
                           "config.yaml; a run resumes from the latest checkpoint here", non_empty=True)
    save_interval: int = knob(1000, "write checkpoint-N/ every this many steps (and at the last step)",
                              ge=1)
    save_total_limit: int | None = knob(
        None, "keep at most this many complete checkpoints, deleting the oldest (null: keep all)", ge=1)

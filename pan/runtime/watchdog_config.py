"""The watchdog's keys, beside it (pan/runtime/watchdog.py), in a module of their own: train.py
imports the watchdog before anything else (the standard library only), and a config class needs
pan's config machinery."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pan.config.core import knob


@dataclass(kw_only=True)
class WatchdogConfig:
    """The hang watchdog's limits and the launcher watch (train() reads them; listed with the
    trainer's keys)."""
    SECTION: ClassVar[str] = "training"
    TRAINING_ONLY: ClassVar[bool] = True  # not checked where a trained model is only used (pan sample)

    watchdog: bool = knob(
        True, "declare a hang when a step, save or validation runs far longer than usual: every rank "
              "then writes its Python stacks to the log and the run exits 3 (pan/runtime/watchdog.py)")
    watchdog_factor: float = knob(
        10.0, "a phase (step, save, validation) is hung after this many times the median of its "
              "recent runs (never before watchdog_min_timeout)", gt=1)
    watchdog_min_timeout: float = knob(
        300.0, "seconds: no phase is declared hung sooner, however fast its median", gt=0)
    watchdog_first_timeout: float = knob(
        1800.0, "seconds allowed to the first run of each phase in a launch (no median yet: "
                "compilation, the first save, data that is read again after a resume)", gt=0)
    watchdog_startup_timeout: float = knob(
        1200.0, "seconds allowed to a launch's start-up, everything before its first step (the "
                "rendezvous, the lease, resuming or warm-starting from a checkpoint, building and "
                "loading the models, the data loader); longer is a hang, ended like one (every rank's "
                "Python stacks, exit 3). Keep it below the process group's timeout (1800 s, "
                "process_group_timeout where the recipe has it), which would end a start-up stuck in "
                "a collective without the stacks", gt=0)
    exit_when_launcher_dies: bool = knob(
        True, "a rank whose launcher (torchrun, srun, the parent process) is gone stops at once "
              "(exit 1, one log line) instead of training on or waiting forever, also while it "
              "starts; train.py watches from its first line, false stops the watch once the config "
              "is read")

"""One logger for pan, prefixed with the rank; only rank 0 logs at INFO unless PAN_LOG_ALL_RANKS=1."""

from __future__ import annotations

import logging
import os
import sys

_LOGGER_NAME = __package__  # "pan": the package's own logger (a name, not a recipe)


class _CurrentStderr(logging.StreamHandler):
    """A handler writing to whatever sys.stderr is when it writes (a redirected or captured
    stream), never to one replaced and closed since the logger was made."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def get_logger() -> logging.Logger:
    logger = logging.getLogger(_LOGGER_NAME)
    if not logger.handlers:
        rank = int(os.environ.get("RANK", "0"))
        handler = _CurrentStderr()
        prefix = f"[pan r{rank}]" if "RANK" in os.environ else "[pan]"
        handler.setFormatter(logging.Formatter(f"{prefix} %(asctime)s %(levelname)s %(message)s",
                                               datefmt="%H:%M:%S"))
        logger.addHandler(handler)
        quiet = rank != 0 and os.environ.get("PAN_LOG_ALL_RANKS") != "1"
        logger.setLevel(logging.WARNING if quiet else logging.INFO)
        logger.propagate = False
    return logger


def quiet_library_progress_bars(on_a_terminal_too: bool = False) -> None:
    """Off a terminal (a pipe, Slurm's output file, tee), the progress bars of transformers and
    diffusers (loading and writing weights) would interleave their carriage returns with pan's log
    lines: switch them off there. On a terminal they stay, unless `on_a_terminal_too` (`pan sample`:
    the bars while loading its frozen encoders say nothing its own lines do not)."""
    import sys

    if sys.stderr.isatty() and not on_a_terminal_too:
        return
    import importlib.util

    for name in ("transformers", "diffusers"):
        if importlib.util.find_spec(name) is not None:
            __import__(f"{name}.utils.logging", fromlist=["disable_progress_bar"]).disable_progress_bar()

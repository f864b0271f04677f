"""One logger for pan, prefixed with the rank; only rank 0 logs at INFO unless PAN_LOG_ALL_RANKS=1."""

from __future__ import annotations

import logging
import os

_LOGGER_NAME = "pan"


def get_logger() -> logging.Logger:
    logger = logging.getLogger(_LOGGER_NAME)
    if not logger.handlers:
        rank = int(os.environ.get("RANK", "0"))
        handler = logging.StreamHandler()
        prefix = f"[pan r{rank}]" if "RANK" in os.environ else "[pan]"
        handler.setFormatter(logging.Formatter(f"{prefix} %(asctime)s %(levelname)s %(message)s",
                                               datefmt="%H:%M:%S"))
        logger.addHandler(handler)
        quiet = rank != 0 and os.environ.get("PAN_LOG_ALL_RANKS") != "1"
        logger.setLevel(logging.WARNING if quiet else logging.INFO)
        logger.propagate = False
    return logger

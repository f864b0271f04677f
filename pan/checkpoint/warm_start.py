"""Warm start: transformer weights from a plain state dict or from another run's checkpoint."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pan.config.core import knob, require


@dataclass(kw_only=True)
class WarmStartConfig:
    SECTION: ClassVar[str] = "model"

    pretrained_transformer_path: str | None = knob(
        None, "weights to start from while output_dir has no checkpoint: a .pt/.safetensors state "
              "dict, a directory holding model_state.pt, or a checkpoint-N/ (or its transformer/) "
              "directory of another run")
    load_transformer_weights: bool = knob(
        False, "load pretrained_transformer_path (true) or start from random init (false)")

    def check(self, job) -> None:
        require(not (self.pretrained_transformer_path and not self.load_transformer_weights),
                "pretrained_transformer_path",
                f"is set ({self.pretrained_transformer_path}) but load_transformer_weights is false, "
                "so it would be silently ignored. For a from-scratch run set "
                "pretrained_transformer_path: null; to warm start set load_transformer_weights: true.")
        require(not (self.load_transformer_weights and not self.pretrained_transformer_path),
                "load_transformer_weights",
                "is true but pretrained_transformer_path is not set: name the weights to load, or set "
                "load_transformer_weights: false.")

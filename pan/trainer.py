"""The one training loop: build, step, log, validate, save."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from pan.config.core import knob, require


@dataclass(kw_only=True)
class TrainerConfig:
    SECTION: ClassVar[str] = "training"

    max_steps: int = knob(1000, "optimizer steps to train for", ge=1)
    gradient_accumulation_steps: int = knob(
        1, "packed micro-batches per optimizer step; k micro-batches of b give the update of one "
           "batch of k*b", ge=1)
    seed: int = knob(0, "seed of model init, data order, timesteps and noise", ge=0)
    dtype: Literal["fp32", "bf16"] = knob(
        "bf16", "compute dtype: bf16 autocast with fp32 master weights, or fp32 throughout (use fp32 "
                "on CPU: bf16 matmuls there are ~90x slower)")
    legacy_eager_mode: bool = knob(
        True, "the validated eager execution (side-stream input copies, tensor learning rates, "
              "capturable optimizers, no autocast cache, FSDP resharding); must stay true")
    compile_transformer: bool = knob(False, "torch.compile each transformer block")
    max_nonfinite_steps: int = knob(
        5, "stop the run after this many consecutive steps with a NaN/inf loss or gradient (each "
           "such step is skipped)", ge=1)

    def check(self, job) -> None:
        require(self.legacy_eager_mode, "legacy_eager_mode",
                "false is not supported: the validated eager mode is the only execution mode (there "
                "is no CUDA-graph mode). Remove the key or set legacy_eager_mode: true.")

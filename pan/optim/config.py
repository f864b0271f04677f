"""Optimiser, learning-rate schedule, clipping and EMA keys of one trainable part.

`OptimConfig` holds the keys of a run's main part (the transformer). A recipe that trains more
parts gives each its own keys with `prefixed_optim_config("disc_", ...)`: a component with the
same knobs spelled `disc_learning_rate`, `disc_adam_beta1`, ..., whose `optim()` is the
`OptimConfig` the optimizer builder reads. Formulas of the schedule: pan/optim/schedule.py.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pan.config.core import knob, reject_unused
from pan.logging import get_logger


@dataclass(kw_only=True)
class OptimConfig:
    """Optimiser, learning-rate schedule, clipping and EMA of the main part."""

    SECTION: ClassVar[str] = "training"
    TRAINING_ONLY: ClassVar[bool] = True  # not checked where a trained model is only used (pan sample)

    learning_rate: float = knob(1e-4, "peak learning rate, shared by AdamW and Muon (Muon scales it "
                                "per matrix by 0.2 sqrt(max(rows, cols)) to match AdamW's update RMS)",
                                gt=0)
    weight_decay: float = knob(0.01, "decoupled weight decay of matrices (never of norms and biases)",
                               ge=0)
    warmup_steps: int = knob(0, "steps of linear warmup from 0 to learning_rate", ge=0)
    lr_scheduler_type: Literal["constant", "cosine", "linear"] = knob(
        "constant", "learning-rate shape after warmup")
    lr_decay_steps: int | None = knob(None, "length of the decay after warmup; null = until max_steps "
                                      "(cosine/linear only)", gt=0)
    lr_decay_floor_ratio: float = knob(0.0, "final learning rate as a fraction of learning_rate "
                                       "(cosine/linear only)", ge=0, le=1)
    max_grad_norm: float = knob(1.0, "clip the global gradient L2 norm to this; 0 = no clipping (the "
                                "norm is still logged)", ge=0)
    use_muon: bool = knob(True, "Muon for hidden 2-D matrices, AdamW for the rest; false = AdamW for all")
    adam_beta1: float = knob(0.9, "AdamW beta1", ge=0, lt=1)
    adam_beta2: float = knob(0.95, "AdamW beta2", ge=0, lt=1)
    adam_eps: float = knob(1e-8, "AdamW epsilon", gt=0)
    adamw_implementation: Literal["auto", "for-loop", "foreach", "fused"] = knob(
        "auto", "how torch's AdamW runs: auto (torch's choice: foreach on CUDA, for-loop on CPU), for-loop, "
        "foreach (bitwise the for-loop's), fused (one kernel: 3.4x faster than for-loop for 1.8M "
        "parameters on a 2-core CPU; rounds differently, so weights differ in the last bits)")
    muon_momentum: float = knob(0.95, "Muon momentum (Nesterov)", ge=0, lt=1)
    ema_decay: float = knob(0.0, "decay of the EMA of the weights, updated each step; 0 = no EMA", ge=0,
                            lt=1)

    def optim(self) -> OptimConfig:
        return self

    def check(self, job) -> None:
        check_optim(self, job, "")


def check_optim(cfg: OptimConfig, job, prefix: str) -> None:
    """Cross-key rules of one part's optimizer keys (`prefix`: how that part spells them)."""
    decays = cfg.lr_scheduler_type != "constant"
    for key, in_use, when in (
            ("lr_decay_steps", decays, "applies only to lr_scheduler_type cosine or linear"),
            ("lr_decay_floor_ratio", decays, "applies only to lr_scheduler_type cosine or linear"),
            ("muon_momentum", cfg.use_muon, "applies only with use_muon: true")):
        reject_unused(cfg, job, key, in_use, when, name=prefix + key)
    max_steps = job.trainer.max_steps
    if cfg.warmup_steps > max_steps:
        # A short smoke test of a production config (--max_steps 2) is legitimate: say it, go on.
        get_logger().warning("%swarmup_steps is %d but the run has only max_steps %d: the learning "
                             "rate stays below %slearning_rate for the whole run.", prefix,
                             cfg.warmup_steps, max_steps, prefix)


def prefixed_optim_config(prefix: str, section: str, doc: str, **defaults: Any) -> type:
    """A component class with every `OptimConfig` knob renamed `<prefix><key>` (defaults changed by
    `defaults`, given by unprefixed key): the optimizer keys of a recipe's second part."""
    fields = []
    types = typing.get_type_hints(OptimConfig)  # real types: this module's annotations are strings
    for f in dataclasses.fields(OptimConfig):
        default = defaults.pop(f.name, f.default)
        meta = dict(f.metadata)
        fields.append((prefix + f.name, types[f.name], knob(default, meta.pop("help"), **meta)))
    if defaults:
        raise TypeError(f"not OptimConfig keys: {sorted(defaults)}")

    def optim(self) -> OptimConfig:
        return OptimConfig(**{f.name: getattr(self, prefix + f.name) for f in dataclasses.fields(OptimConfig)})

    def check(self, job) -> None:
        check_optim(self.optim(), job, prefix)

    cls = dataclasses.make_dataclass(
        f"{prefix.strip('_').title()}OptimConfig", fields, kw_only=True,
        namespace={"SECTION": section, "TRAINING_ONLY": True, "__doc__": doc, "optim": optim, "check": check,
                   "__annotations__": {"SECTION": ClassVar[str], "TRAINING_ONLY": ClassVar[bool]}})
    return cls

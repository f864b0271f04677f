"""Optimiser keys and the Muon / AdamW parameter split.

Muon takes the hidden 2-D weight matrices (attention and MLP weights of the blocks and refiner);
AdamW takes everything else: embeddings, the timestep MLP, the text input projection, modulation,
the final projection, norms and biases. The model says which parameters are hidden matrices through
`model.hidden_matrices() -> {name: row splits}` (row counts of the matrices fused in one parameter,
e.g. (d, d, d) for q/k/v; Muon orthogonalises each block on its own) or, more simply,
`model.muon_param_names() -> set[str]`. Names are as the unwrapped model's `named_parameters()`
spells them (activation-checkpoint and compile wrappers are seen through). A model declaring neither
gets Muon on every 2-D parameter. Weight decay applies to matrices only (ndim >= 2), never to norms,
biases or other vectors. With `use_muon: false` AdamW takes everything.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar, Literal

import torch
from torch import nn

from pan.config.core import ConfigError, knob
from pan.optim.muon import Muon
from pan.optim.schedule import LRSchedulers


@dataclass(kw_only=True)
class OptimConfig:
    """Optimiser, learning-rate schedule, clipping and EMA (formulas in pan/optim/schedule.py)."""

    SECTION: ClassVar[str] = "training"

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
    muon_momentum: float = knob(0.95, "Muon momentum (Nesterov)", ge=0, lt=1)
    ema_decay: float = knob(0.0, "decay of the EMA of the weights, updated each step; 0 = no EMA", ge=0,
                            lt=1)

    def check(self, job) -> None:
        decays = self.lr_scheduler_type != "constant"
        _reject_unused(self, job, "lr_decay_steps", decays, "applies only to lr_scheduler_type cosine "
                       "or linear")
        _reject_unused(self, job, "lr_decay_floor_ratio", decays, "applies only to lr_scheduler_type "
                       "cosine or linear")
        _reject_unused(self, job, "muon_momentum", self.use_muon, "applies only with use_muon: true")
        max_steps = job.trainer.max_steps
        if self.warmup_steps > max_steps:
            raise ConfigError("warmup_steps", f"is {self.warmup_steps} but the run has only max_steps "
                              f"{max_steps}, so the learning rate never reaches learning_rate. Lower "
                              f"warmup_steps or raise max_steps.")


def _reject_unused(cfg, job, key: str, in_use: bool, when: str) -> None:
    """Refuse a key the user set to a non-default value where it would change nothing."""
    default = next(f.default for f in fields(cfg) if f.name == key)
    if not in_use and key in job.explicit_keys and getattr(cfg, key) != default:
        raise ConfigError(key, f"is set to {getattr(cfg, key)!r} but {when}, so it would be "
                               f"ignored. Remove it, or choose the mode it belongs to.")


class OptimizerSet:
    """The run's optimizers (Muon and/or AdamW) stepped as one.

    `optimizers` is the list of real `torch.optim.Optimizer`s (for DCP's get/set_optimizer_state_dict);
    `by_name` maps "muon" / "adamw" to them.
    """

    def __init__(self, by_name: dict[str, torch.optim.Optimizer]):
        self.by_name = by_name
        self.optimizers = list(by_name.values())

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {name: opt.state_dict() for name, opt in self.by_name.items()}

    def load_state_dict(self, state: dict) -> None:
        if set(state) != set(self.by_name):
            raise ValueError(f"optimizer state holds {sorted(state)}, this run has {sorted(self.by_name)}"
                             " (was use_muon changed between runs?)")
        for name, opt in self.by_name.items():
            opt.load_state_dict(state[name])


# Wrappers applied from outside (activation checkpointing, torch.compile) insert these into parameter
# names; the model's own names (from muon_param_names) do not have them.
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def model_name(name: str) -> str:
    """A parameter's name as the unwrapped model spells it."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def declared_hidden_matrices(model: nn.Module) -> dict[str, tuple[int, ...] | None] | None:
    """The model's own list of hidden matrices, {name: row splits or None}, if it declares one.

    `hidden_matrices()` maps each name to the row counts of the matrices stacked in it (one entry:
    a plain matrix); `muon_param_names()` is a plain set of names. None: the model declares neither.
    """
    if hasattr(model, "hidden_matrices"):
        return {n: (tuple(rows) if len(rows) > 1 else None) for n, rows in model.hidden_matrices().items()}
    if hasattr(model, "muon_param_names"):
        return dict.fromkeys(model.muon_param_names())
    return None


def muon_matrices(model: nn.Module) -> tuple[dict[str, tuple[int, ...] | None], str]:
    """{name (as in model.named_parameters()): row splits or None} for Muon, and the rule used."""
    params = {name: p for name, p in model.named_parameters()}
    declared = declared_hidden_matrices(model)
    if declared is None:
        return {n: None for n, p in params.items() if p.ndim == 2}, "every 2-D parameter (the model " \
            "declares no hidden_matrices())"
    chosen = {n: declared[model_name(n)] for n in params if model_name(n) in declared}
    unknown = sorted(set(declared) - {model_name(n) for n in chosen})
    if unknown:
        raise ValueError(f"the model declares hidden matrices it does not have: {unknown[:5]}")
    not_matrices = sorted(n for n in chosen if params[n].ndim != 2)
    if not_matrices:
        raise ValueError(f"the model declares non-2-D parameters as hidden matrices: {not_matrices[:5]}")
    return chosen, "the model's hidden matrices"


NamedParams = list[tuple[str, nn.Parameter]]


def split_parameters(model: nn.Module, use_muon: bool
                     ) -> tuple[dict[str, NamedParams], dict[str, tuple[int, ...] | None], str]:
    """Group trainable parameters into "muon", "adamw_decay" (matrices) and "adamw_no_decay";
    also return the row splits of the Muon matrices and the rule that chose them."""
    splits, rule = muon_matrices(model) if use_muon else ({}, "use_muon: false, AdamW for all")
    groups: dict[str, NamedParams] = {"muon": [], "adamw_decay": [], "adamw_no_decay": []}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if name in splits:
            groups["muon"].append((name, p))
        elif p.ndim >= 2:
            groups["adamw_decay"].append((name, p))
        else:
            groups["adamw_no_decay"].append((name, p))
    return groups, splits, rule


def split_report(groups: dict[str, NamedParams], rule: str, cfg: OptimConfig) -> str:
    """A small table of the split, printed at start-up."""
    decay = {"muon": cfg.weight_decay, "adamw_decay": cfg.weight_decay, "adamw_no_decay": 0.0}
    lines = [f"optimizer split (Muon on {rule}):",
             f"  {'group':<16}{'tensors':>8}{'parameters':>16}{'weight decay':>14}"]
    for name, members in groups.items():
        count = sum(p.numel() for _, p in members)
        lines.append(f"  {name:<16}{len(members):>8}{count:>16,}{decay[name]:>14g}")
    total = sum(p.numel() for members in groups.values() for _, p in members)
    lines.append(f"  {'total':<16}{sum(map(len, groups.values())):>8}{total:>16,}")
    return "\n".join(lines)


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> tuple[OptimizerSet, str]:
    """Muon + AdamW (or AdamW alone) over `model`'s trainable parameters, and a report of the split.

    Build it after parallelising the model (FSDP2), so the optimizers hold the sharded parameters.
    """
    groups, splits, rule = split_parameters(model, cfg.use_muon)
    by_name: dict[str, torch.optim.Optimizer] = {}
    if groups["muon"]:
        by_splits: dict[tuple[int, ...] | None, list[nn.Parameter]] = {}
        for name, p in groups["muon"]:
            by_splits.setdefault(splits[name], []).append(p)
        by_name["muon"] = Muon([{"params": ps, "row_splits": rows} for rows, ps in by_splits.items()],
                               lr=cfg.learning_rate, weight_decay=cfg.weight_decay,
                               momentum=cfg.muon_momentum)
    adamw_groups = [{"params": [p for _, p in groups["adamw_decay"]], "weight_decay": cfg.weight_decay},
                    {"params": [p for _, p in groups["adamw_no_decay"]], "weight_decay": 0.0}]
    adamw_groups = [g for g in adamw_groups if g["params"]]
    if adamw_groups:
        by_name["adamw"] = torch.optim.AdamW(adamw_groups, lr=cfg.learning_rate,
                                             betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
    if not by_name:
        raise ValueError("the model has no trainable parameters")
    for opt in by_name.values():
        create_state(opt)
    return OptimizerSet(by_name), split_report(groups, rule, cfg)


@torch.no_grad()
def create_state(opt: torch.optim.Optimizer) -> None:
    """Create every parameter's state now, exactly as a lazy first step would (zeros, step 0).

    Optimizers create state on a parameter's first gradient, and DCP saves only the state that
    exists. Some parameters never get a gradient (the last double-stream block's text branch after
    attention feeds nothing), so without this a checkpoint lacks their state while a fresh optimizer
    being resumed (which DCP fills completely) expects it, and the resume fails.
    """
    params = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
    lrs = [g["lr"] for g in opt.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in opt.param_groups:
        g["lr"] = 0.0  # a step of zeros at lr 0 leaves every parameter as it was
    opt.step()
    for g, lr in zip(opt.param_groups, lrs):
        g["lr"] = lr
    for p in params:
        p.grad = None
        if "step" in opt.state[p]:  # AdamW counts steps for its bias correction: start from 0
            opt.state[p]["step"].zero_()


def build_scheduler(optimizers: OptimizerSet, cfg: OptimConfig, max_steps: int) -> LRSchedulers:
    """The learning-rate schedule (pan/optim/schedule.py) over every optimizer of the set.

    Step it once after each optimizer step; `state_dict()` goes into checkpoints.
    """
    return LRSchedulers(optimizers, cfg, max_steps)

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

import torch
from torch import nn

from pan.optim.config import OptimConfig
from pan.optim.muon import Muon
from pan.optim.schedule import LRSchedulers
from pan.parallel.names import unwrapped_name


# `adamw_implementation` -> torch.optim.AdamW's arguments (None: torch decides by device)
ADAMW_IMPLEMENTATIONS: dict[str, dict[str, bool | None]] = {
    "auto": {"foreach": None, "fused": None}, "for-loop": {"foreach": False, "fused": False},
    "foreach": {"foreach": True, "fused": False}, "fused": {"foreach": False, "fused": True}}


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
    chosen = {n: declared[unwrapped_name(n)] for n in params if unwrapped_name(n) in declared}
    unknown = sorted(set(declared) - {unwrapped_name(n) for n in chosen})
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
                                             betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                                             **ADAMW_IMPLEMENTATIONS[cfg.adamw_implementation])
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

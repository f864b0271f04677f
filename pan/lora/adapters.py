"""LoRA: low-rank adapters trained on a frozen base, for the DiT recipes (the `lora` section).

`peft` injects the adapters into pan's own single-device model after its base weights are loaded
and before it is parallelised, so FSDP2/HSDP, activation checkpointing, compile and Ulysses context
parallel see an ordinary model whose only trainable tensors are the adapters:

    model = materialize_and_init(...)         # the model, then its base weights loaded
    reference = add_adapters(model, cfg, seed, base_source)
    model = parallelize_model(model, ...)     # frozen base + fp32 adapters sharded together

A target linear `blocks.3.attn.to_q` becomes a peft layer: its weight is then named
`blocks.3.attn.to_q.base_layer.weight` and its adapters `...to_q.lora_A.default.weight` (r x in)
and `...to_q.lora_B.default.weight` (out x r); the layer computes base(x) + scale * B(A(x)) with
scale = lora_alpha / lora_rank. Only the adapters are in the optimizer, get gradients and are saved;
a checkpoint records the base they were trained on (`reference`) and a resume checks it.
"""

from __future__ import annotations

import dataclasses
import re
import zlib
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import Tensor, nn

from pan.config.core import ConfigError, knob, require

ADAPTER = "default"  # peft's adapter name: the one adapter a run trains
LORA_KEY = re.compile(r"\.lora_(A|B)\.default\.weight$")
BASE_LAYER = ".base_layer"


@dataclass(kw_only=True)
class LoraConfig:
    SECTION: ClassVar[str] = "lora"

    lora_rank: int = knob(0, "rank r of every adapter (B @ A, B: out x r, A: r x in); 0 = no LoRA: "
                             "every weight trains (full fine-tuning)", ge=0)
    lora_alpha: float | None = knob(
        None, "the adapters' update is scaled by lora_alpha / lora_rank; null = lora_rank (scale 1)", gt=0)
    lora_dropout: float = knob(
        0.0, "dropout on each adapter's input (a resume then repeats the step only up to the dropout's "
             "draws on another layout)", ge=0.0, lt=1.0)
    lora_target_modules: list[str] | None = knob(
        None, "the linears that get adapters, by their name inside a block (`pan check` lists them; a "
              "wrong name is refused with the list); null = the attention q/k/v/out projections and "
              "MLP linears of every block (the model's hidden matrices)")
    lora_init: Literal["default", "gaussian", "pissa"] = knob(
        "default", "adapter init: default (A Kaiming-uniform, B zero: training starts from the base "
                   "exactly), gaussian (A normal with std 1/r, B zero), pissa (A and B from the base "
                   "weight's top-r singular vectors, the base keeps the residual)")
    lora_base_dtype: Literal["auto", "fp32", "bf16"] = knob(
        "auto", "dtype the frozen base is held in: auto = the training dtype; bf16 halves the base's "
                "memory (adapters and their optimizer state stay fp32); needs dtype: bf16")

    @property
    def enabled(self) -> bool:
        return self.lora_rank > 0

    @property
    def scale(self) -> float:
        return (self.lora_alpha if self.lora_alpha is not None else self.lora_rank) / self.lora_rank

    def base_dtype(self, training_dtype: str) -> torch.dtype:
        name = training_dtype if self.lora_base_dtype == "auto" else self.lora_base_dtype
        return torch.bfloat16 if name == "bf16" else torch.float32

    def check(self, job) -> None:
        if not self.enabled:
            changed = [f.name for f in dataclasses.fields(self) if f.name != "lora_rank"
                       and f.name in job.explicit_keys and getattr(self, f.name) != f.default]
            require(not changed, changed[0] if changed else "lora_rank",
                    f"is set but lora_rank is 0 (LoRA off), so it would change nothing. Set lora_rank "
                    f"(e.g. 16) to train adapters, or remove {', '.join(changed)}.")
            return
        require(self.lora_base_dtype != "bf16" or job.trainer.dtype == "bf16", "lora_base_dtype",
                "is bf16 but dtype is fp32: a bf16 base needs bf16 compute (autocast). Set dtype: bf16, "
                "or lora_base_dtype: auto.")
        require(not job.optim.use_muon, "use_muon",
                "is true, but with LoRA only the low-rank adapters train, and Muon orthogonalises whole "
                "hidden matrices: set use_muon: false (the adapters train with AdamW).")
        candidates = getattr(job, "lora_candidates", None)
        if self.lora_target_modules is not None and candidates is not None:
            check_targets(self.lora_target_modules, candidates())


def check_targets(targets: list[str], candidates: list[str]) -> None:
    """Refuse a target name the model does not have, listing the names it has."""
    unknown = [t for t in targets if t not in candidates]
    if unknown:
        raise ConfigError("lora_target_modules",
                          f"has {unknown}, which no block of this model has. Choose from the linears of "
                          f"its blocks: {', '.join(candidates)}.")
    require(bool(targets), "lora_target_modules", "is empty: name at least one linear, or null for the default.")


# ------------------------------------------------------------------------------------------------
# Which linears: names inside a block
# ------------------------------------------------------------------------------------------------

def _blocks_by_name(model: nn.Module) -> dict[str, nn.Module]:
    """The model's declared blocks (`fsdp_blocks()`, pan/task.py) by their module name."""
    wanted = {id(b) for b in model.fsdp_blocks()}
    return {name: m for name, m in model.named_modules() if id(m) in wanted}


def block_linears(model: nn.Module) -> dict[str, list[str]]:
    """{name inside a block: the full module names of that linear in every block that has it}."""
    found: dict[str, list[str]] = {}
    for block_name, block in _blocks_by_name(model).items():
        for inner, module in block.named_modules():
            if isinstance(module, nn.Linear) and inner:
                found.setdefault(inner, []).append(f"{block_name}.{inner}")
    return found


def candidate_names(model: nn.Module) -> list[str]:
    """The names `lora_target_modules` may use for this model, in block order."""
    return list(block_linears(model))


def default_targets(model: nn.Module) -> list[str]:
    """The attention q/k/v/out projections and MLP linears: the linears whose weights the model
    declares as its hidden matrices (modulation, embeddings and the output layer are not)."""
    hidden = set(model.hidden_matrices()) if hasattr(model, "hidden_matrices") else None
    names = []
    for inner, full in block_linears(model).items():
        if hidden is None or any(f"{name}.weight" in hidden for name in full):
            names.append(inner)
    return names


def target_modules(model: nn.Module, cfg: LoraConfig) -> list[str]:
    """The full module names that get adapters (raises ConfigError for an unknown name)."""
    by_inner = block_linears(model)
    chosen = cfg.lora_target_modules if cfg.lora_target_modules is not None else default_targets(model)
    check_targets(chosen, list(by_inner))
    return [full for inner in chosen for full in by_inner[inner]]


# ------------------------------------------------------------------------------------------------
# Injection
# ------------------------------------------------------------------------------------------------

def peft_config(cfg: LoraConfig, targets: list[str], *, init: str | None = None):
    """peft's LoraConfig for this run's adapters (what `pan export --format peft` writes, too)."""
    from peft import LoraConfig as PeftLoraConfig  # lazy: only LoRA runs import peft

    init_value = {"default": True, "gaussian": "gaussian", "pissa": "pissa"}[init or cfg.lora_init]
    return PeftLoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha or cfg.lora_rank,
                          lora_dropout=cfg.lora_dropout, target_modules=targets,
                          init_lora_weights=init_value, bias="none")


def base_fingerprint(model: nn.Module) -> str:
    """CRC32 of every base tensor's bytes with its name and shape: which base the adapters were
    trained on (computed before the adapters exist; the model's tensors must be real)."""
    return state_fingerprint(model.state_dict())


def state_fingerprint(state: dict[str, Tensor]) -> str:
    """`base_fingerprint` of a state dict (the base's tensors under the plain model's names)."""
    crc = 0
    for name, t in sorted(state.items()):
        crc = zlib.crc32(f"{name}{tuple(t.shape)}{t.dtype}".encode(), crc)
        data = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        crc = zlib.crc32(data, crc)
    return f"{crc:08x}"


def add_adapters(model: nn.Module, cfg: LoraConfig, seed: int, training_dtype: str,
                 base_source: str | None) -> dict:
    """Inject the adapters into `model` (in place; its base weights loaded), freeze the base at its
    dtype, and return the reference a checkpoint records: rank, alpha, targets, init and the base
    (where it came from and its fingerprint)."""
    from peft import inject_adapter_in_model  # lazy: only LoRA runs import peft

    targets = target_modules(model, cfg)
    meta = any(p.is_meta for p in model.parameters())
    fingerprint = None if meta else base_fingerprint(model)
    # A private RNG stream: the adapters' init is a function of the seed alone, equal on every rank.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 7919)
        inject_adapter_in_model(peft_config(cfg, targets, init="default" if meta else None), model,
                                adapter_name=ADAPTER)
    base_dtype = cfg.base_dtype(training_dtype)
    for name, p in model.named_parameters():
        p.requires_grad_(bool(LORA_KEY.search(name)))
        # The base's matrices in base_dtype; its vectors (norm scales, biases: a sliver of the
        # memory) stay fp32, so norms keep their fused fp32 kernels.
        if not p.requires_grad and p.ndim >= 2 and p.dtype != base_dtype:
            p.data = p.data.to(base_dtype)
    return {"rank": cfg.lora_rank, "alpha": cfg.lora_alpha or cfg.lora_rank, "init": cfg.lora_init,
            "dropout": cfg.lora_dropout, "targets": targets, "base_source": base_source,
            "base_fingerprint": fingerprint}


def reference_differences(saved: dict, current: dict) -> list[str]:
    """What differs between a checkpoint's LoRA reference and this run's. The base is compared by
    its fingerprint (where both have one: a plan on the meta device has none), not by its path: the
    same weights moved elsewhere are the same base."""
    out = [f"{what}: checkpoint {saved.get(key)!r}, this run {current.get(key)!r}"
           for key, what in (("rank", "lora_rank"), ("alpha", "lora_alpha"), ("init", "lora_init"))
           if saved.get(key) != current.get(key)]
    if sorted(saved.get("targets", [])) != sorted(current.get("targets", [])):
        out.append(f"lora_target_modules: {len(saved.get('targets', []))} linears in the checkpoint, "
                   f"{len(current.get('targets', []))} in this run")
    old, new = saved.get("base_fingerprint"), current.get("base_fingerprint")
    if old and new and old != new:
        out.append(f"the base: the adapters were trained on {saved.get('base_source')} (fingerprint {old}), "
                   f"this run's base is {current.get('base_source')} (fingerprint {new})")
    return out


# ------------------------------------------------------------------------------------------------
# Adapter tensors: peft's names, and merging into the base
# ------------------------------------------------------------------------------------------------

def adapter_pairs(adapters: dict[str, Tensor]) -> dict[str, tuple[Tensor, Tensor]]:
    """{module name: (A, B)} from a state dict of adapters (pan's names, with `.default.`)."""
    pairs: dict[str, dict[str, Tensor]] = {}
    for key, t in adapters.items():
        m = LORA_KEY.search(key)
        if m is not None:
            pairs.setdefault(key[:m.start()], {})[m.group(1)] = t
    broken = sorted(name for name, ab in pairs.items() if set(ab) != {"A", "B"})
    if broken:
        raise ValueError(f"adapters without both lora_A and lora_B: {broken[:3]}")
    return {name: (ab["A"], ab["B"]) for name, ab in pairs.items()}


def merged_state(base: dict[str, Tensor], adapters: dict[str, Tensor], scale: float) -> dict[str, Tensor]:
    """The base's state dict with every adapted weight replaced by W + scale * (B @ A), in fp32."""
    out = dict(base)
    for module, (a, b) in adapter_pairs(adapters).items():
        key = f"{module}.weight"
        if key not in base:
            raise KeyError(f"the base has no {key} for the adapter of {module}")
        w = base[key].float()
        out[key] = (w + scale * (b.float() @ a.float())).to(base[key].dtype)
    return out


def peft_names(adapters: dict[str, Tensor]) -> dict[str, Tensor]:
    """Adapters under the names peft's `save_pretrained` writes (`base_model.model.<module>.lora_A
    .weight`), which `PeftModel.from_pretrained` loads."""
    return {"base_model.model." + k.replace(f".{ADAPTER}.weight", ".weight"): v
            for k, v in adapters.items() if LORA_KEY.search(k)}


def base_names(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """A LoRA model's base tensors under the plain model's names (no `.base_layer`, no adapters)."""
    return {k.replace(BASE_LAYER, ""): v for k, v in state.items() if not LORA_KEY.search(k)}


def from_peft_names(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """The inverse of `peft_names`: adapters of a peft folder under pan's names (with `.default.`)."""
    out = {}
    for key, t in state.items():
        name = key.removeprefix("base_model.model.")
        m = re.search(r"\.lora_(A|B)\.weight$", name)
        if m is None:
            raise ValueError(f"{key} is not a LoRA adapter weight (lora_A / lora_B)")
        out[f"{name[:m.start()]}.lora_{m.group(1)}.{ADAPTER}.weight"] = t
    return out


# ------------------------------------------------------------------------------------------------
# A run that trains nothing: adapters without a gradient
# ------------------------------------------------------------------------------------------------

def zero_base_layers(model: nn.Module, reduce, rename=lambda name: name) -> list[str]:
    """The module names of the base's weight matrices that are zero everywhere, over every rank's
    shard (`reduce`: host numbers summed over the ranks, `pan.task.global_sums`; every rank calls it;
    `rename`: a parameter's name as the unwrapped model spells it, `pan.parallel.names.unwrapped_name`)."""
    from torch.distributed.tensor import DTensor  # lazy: a plain model needs no torch.distributed

    names, nonzero = [], []
    for name, p in model.named_parameters():
        if p.requires_grad or p.ndim < 2 or LORA_KEY.search(name):
            continue
        local = p.to_local() if isinstance(p, DTensor) else p
        names.append(rename(name).removesuffix(".weight").replace(BASE_LAYER, ""))
        nonzero.append(float(bool(local.detach().ne(0).any())))
    summed = reduce(nonzero) if nonzero else []
    return [name for name, count in zip(names, summed) if count == 0]


def untrained_adapters_warning(model: nn.Module, step: int, reduce, rename=lambda name: name) -> str:
    """What to say when every adapter's gradient is 0 at `step` (the run would train nothing): which
    of the base's layers are zero, and what to do. A model initialised to predict 0 (Pyramid-Flow's
    init, AdaLN-Zero: zero output layer and modulation), not trained, stops every gradient before it
    reaches a block's adapters. Zero layers inside the blocks can be trained by naming them in
    lora_target_modules; the ones outside (the output layer) only by full training. `reduce` and
    `rename` as `zero_base_layers` takes them."""
    zero = zero_base_layers(model, reduce, rename)
    blocks = [rename(b) for b in _blocks_by_name(model)] if hasattr(model, "fsdp_blocks") else []
    block_of = {n: next((b for b in blocks if n.startswith(b + ".")), None) for n in zero}
    outside = [n for n in zero if block_of[n] is None]
    inside = sorted({n.removeprefix(block_of[n] + ".") for n in zero if block_of[n] is not None})
    head = f"every LoRA adapter's gradient is 0 at step {step}, so this run trains nothing"
    if not zero:
        return (f"{head}, though no layer of the base is zero: the adapted linears (lora_target_modules) may not "
                "be on the path to the loss.")

    def listed(names: list[str]) -> str:
        return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")

    layers = " and ".join(part for part in (f"{listed(outside)} (outside its blocks)" if outside else "",
                                             f"{listed(inside)} (in its blocks)" if inside else "") if part)
    verb = "is" if len(outside) + len(inside) == 1 else "are"
    linears = {rename(inner).replace(BASE_LAYER, "") for inner in block_linears(model)} if blocks else set()
    targets = [n for n in inside if n in linears]   # what lora_target_modules can name
    ways = [f"{', '.join(targets[:4])} by adding {'it' if len(targets) == 1 else 'them'} to lora_target_modules"
            if targets else "",
            f"{'the others' if targets else 'them'} by full training (lora_rank: 0): lora_target_modules "
            "names the linears inside the blocks only" if outside or len(targets) < len(inside) else ""]
    return (f"{head}: the base's {layers} {verb} zero, so no gradient reaches the adapters (a model initialised "
            "to predict 0, not trained?). Start from a base whose output layers are not zero (a trained "
            f"checkpoint), or train the zero layers: {'; '.join(w for w in ways if w)}.")

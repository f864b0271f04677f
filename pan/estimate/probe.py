"""What a recipe tells the estimate (its `probe` hook: the largest micro-batch and how its step
runs), and the byte counts probes and the estimate share: a part's training state, the frozen
modules a recipe loads, the data loader's samples in flight."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from pan.encoders import vae
from pan.models.causal_vae import CausalVideoVAE
from pan.optim.builder import split_parameters
from pan.parallel.fsdp import declared_blocks
from pan.recipe import get_recipe

# ================================================================================================
# What a recipe tells the estimate
# ================================================================================================

@dataclass
class Phase:
    """One backward pass of a train step: `loss(models)` builds this rank's micro-batch on fake
    tensors and returns the loss whose gradients train `part` (the other parts stay frozen)."""
    part: str
    loss: Callable[[dict[str, nn.Module]], Tensor]


@dataclass
class Probe:
    """A recipe's largest micro-batch on one rank and how its step runs it."""
    phases: list[Phase]
    tokens: int                      # tokens of the rank's micro-batch (the recipe's unit)
    samples: int
    flops: float                     # the recipe's exact training FLOPs of that micro-batch, this rank
    frozen: dict[str, int] = field(default_factory=dict)   # frozen encoder -> bytes on this rank
    loader: int = 0                  # host bytes of the data loader's samples in flight
    online_text: bool = False        # whether captions are encoded during training (the encoder is loaded)
    describe: str = ""               # the micro-batch in words
    helpers: dict[str, nn.Module] = field(default_factory=dict)  # frozen meta modules the losses use
                                     # (LPIPS, the VAE's discriminator copy), given to them fake by name


ProbeFn = Callable[[object], Probe]   # a recipe's `probe` hook: (a Preflight) -> Probe


def probe_of(recipe: str) -> ProbeFn | None:
    """The recipe's probe (its `probe` hook, pan/recipe.py); None when it declares none."""
    return get_recipe(recipe).hook("probe")


# ================================================================================================
# Bytes: a part's training state, frozen modules, the data loader
# ================================================================================================

# Bytes per parameter of an fp32 master weight, moment or EMA copy.
FP32_BYTES = 4


def state_bytes(model: torch.nn.Module, optim) -> dict[str, int]:
    """Bytes of a part's training state by kind, whole (unsharded), for its OptimConfig `optim`.

    The trained weights are fp32 master copies (4 B per parameter whatever the compute dtype).
    AdamW keeps two fp32 moments (8 B per parameter), Muon one fp32 momentum buffer (4 B); the
    split is the optimizer's own, over the trainable parameters. An EMA adds another fp32 copy of
    those. Frozen parameters (a LoRA part's base) count once, at their own dtype (`frozen`): no
    master copy, gradient, optimizer state or EMA.
    """
    groups, _, _ = split_parameters(model, optim.use_muon)
    muon = sum(p.numel() for _, p in groups["muon"])
    trained = sum(p.numel() for members in groups.values() for _, p in members)
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    return {"weights": FP32_BYTES * trained, "frozen": frozen, "muon": FP32_BYTES * muon,
            "adamw": 2 * FP32_BYTES * (trained - muon),
            "ema": FP32_BYTES * trained if optim.ema_decay > 0 else 0}


def unit_sizes(model: nn.Module) -> tuple[list[int], int]:
    """Parameters of each FSDP unit of a part: of each declared block, and the root's own."""
    blocks = [sum(p.numel() for p in b.parameters()) for b in declared_blocks(model)]
    return blocks, sum(p.numel() for p in model.parameters()) - sum(blocks)


def largest_batch(data, tokens_of: Callable[[int, int, int], int], images: bool = False
                  ) -> list[tuple[int, int, int]]:
    """Clips (frames, H, W) of the fullest micro-batch the data keys allow one rank: the largest clip
    that fits what is left of max_tokens_per_batch, again and again, up to max_samples_per_batch."""
    heights_widths = data.buckets()
    shapes = {(f, h, w) for h, w in heights_widths for f in data.frame_count_range()}
    if images:
        shapes |= {(1, h, w) for h, w in heights_widths}
    sized = sorted(((tokens_of(*s), s) for s in shapes), reverse=True)
    left, clips = data.max_tokens_per_batch, []
    while len(clips) < data.max_samples_per_batch:
        fit = next(((tokens, shape) for tokens, shape in sized if tokens <= left), None)
        if fit is None:
            break
        clips.append(fit[1])
        left -= fit[0]
    return clips


def loader_bytes(data, clips: list[tuple[int, int, int]], channels: int = 3) -> int:
    """Host bytes of decoded uint8 samples in flight: the packer's lookahead, and each decoding
    worker's prefetched share (prefetch_factor batches of max_samples_per_batch in all); and each
    decoding process's sample cache (`sample_cache_mb`, held in full)."""
    sample = max(f * h * w * channels for f, h, w in clips)
    in_flight = data.packing_lookahead + len(clips)
    if data.packed_dataloader_num_workers:
        in_flight += data.packed_dataloader_prefetch_factor * data.max_samples_per_batch
    caches = max(1, data.packed_dataloader_num_workers)
    return in_flight * sample + caches * int(data.sample_cache_mb * 2**20)


def run_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def module_bytes(build: Callable[[], nn.Module], dtype: torch.dtype) -> int:
    """Bytes of a module's parameters and buffers in `dtype`, built on the meta device."""
    with torch.device("meta"):
        module = build()
    return sum(t.numel() for t in (*module.parameters(), *module.buffers())) * dtype.itemsize


def frozen_vae_bytes(cfg, dtype: torch.dtype) -> int:
    """The frozen VAE of a DiT recipe (`vae_type`), as `pan.encoders.vae.build_vae` loads it."""
    if cfg.vae_type == "identity":
        return 0
    if cfg.vae_type == "diffusers":
        cls = vae.diffusers_class(cfg.vae_class)
        return module_bytes(lambda: cls.from_config(cls.load_config(str(vae.vae_dir(cfg)))), dtype)
    config = vae.causal_vae_config(cfg)
    return module_bytes(lambda: CausalVideoVAE(config), dtype)


@functools.cache   # building even a meta model imports its modeling code: once per process
def hf_model_bytes(model_dir, dtype: torch.dtype) -> int:
    """A Hugging Face model's bytes in `dtype`, from its config.json alone."""
    from transformers import AutoConfig, AutoModel

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    return module_bytes(lambda: AutoModel.from_config(config), dtype)

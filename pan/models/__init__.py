"""Single-device models. Parallelism (FSDP2, context parallel, activation checkpointing) is applied
from `pan.parallel`, from outside."""

from pan.models.attention import ATTENTION_BACKENDS, InnerAttention, attention, set_attention_backend
from pan.models.packing import AttnSegments, PackInfo, patchify, unpatchify
from pan.models.pan_dit import LEGACY_NAMES, PanDiTConfig, PanVideoDiffusionTransformer

__all__ = [
    "ATTENTION_BACKENDS", "AttnSegments", "InnerAttention", "LEGACY_NAMES", "PackInfo", "PanDiTConfig",
    "PanVideoDiffusionTransformer", "attention", "patchify", "set_attention_backend", "unpatchify",
]

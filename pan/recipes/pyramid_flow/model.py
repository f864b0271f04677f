"""The `pyramid_flow` recipes' DiT: a released Pyramid-Flow model (miniFLUX or SD3 MMDiT, built from
its variant's config.json and loaded from its weights) or pan's own transformer behind the released
models' interface. Both Pyramid-Flow recipes build it here.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from pan.models.attention import set_attention_backend
from pan.models.packing import PackInfo, SampleLayout, patchify, unpatchify
from pan.models.pan_dit import PanDiTConfig, PanVideoDiffusionTransformer
from pan.models.pyramid_dit import pyramid_sample_layout, trained_rows
from pan.models.pyramid_io import read_weights
from pan.recipes.pyramid_flow.config import PyramidJobConfig, dit_class, dit_config, variant_folder


class PanForPyramid(nn.Module):
    """PanVideoDiffusionTransformer with the interface of the released Pyramid-Flow DiTs: timesteps
    on the 0..1000 scale (pan's model takes sigma in [0, 1]); no pooled text (Pan has none)."""

    def __init__(self, config: PanDiTConfig, use_temporal_causal: bool, interp_condition_pos: bool):
        super().__init__()

        self.dit = PanVideoDiffusionTransformer(config, zero_init_modulation=True)
        self.patch = tuple(config.patch_size)
        self.use_temporal_causal, self.interp_condition_pos = use_temporal_causal, interp_condition_pos

    @property
    def num_attention_heads(self) -> int:
        return self.dit.config.num_attention_heads

    def patch_grid(self, latent_shape) -> tuple[int, int, int]:
        _, t, h, w = latent_shape
        return t // self.patch[0], h // self.patch[1], w // self.patch[2]

    def patchify(self, latent: Tensor) -> Tensor:
        return patchify(latent, self.patch)

    def target_tokens(self, latent: Tensor) -> Tensor:
        return self.patchify(latent)

    def unpatchify(self, tokens: Tensor, grid) -> Tensor:
        return unpatchify(tokens, grid, self.patch)

    def sample_layout(self, grids, text_len: int) -> SampleLayout:
        return pyramid_sample_layout(grids, text_len, self.use_temporal_causal, self.interp_condition_pos)

    def forward(self, x: Tensor, timesteps: Tensor, text: Tensor, pooled: Tensor, pack: PackInfo,
                trained_only: bool = False) -> Tensor:
        out = self.dit(x, timesteps / 1000.0, text, pack)
        return trained_rows(out, pack) if trained_only else out

    def init_weights(self) -> None:
        self.dit.init_weights()

    def fsdp_blocks(self) -> list[nn.Module]:
        return self.dit.fsdp_blocks()

    def hidden_matrices(self) -> dict[str, tuple[int, ...]]:
        return {f"dit.{name}": rows for name, rows in self.dit.hidden_matrices().items()}

    def forward_flops(self, pack: PackInfo, trained_only: bool = False) -> int:
        return self.dit.forward_flops(pack)       # every row is computed with `trained_only` too


def build_dit(job: PyramidJobConfig) -> nn.Module:
    """The DiT on the meta device (the trainer initialises it, or loads its released weights)."""
    m = job.model
    with torch.device("meta"):
        if m.model_name == "pan":  # the released models' switches, on unless the run says otherwise
            switches = {"use_temporal_causal": True, "interp_condition_pos": True} | m.switches()
            model = PanForPyramid(m.transformer_config_overrides, **switches)
        else:
            # The run's enable_gradient_checkpointing decides whether blocks are checkpointed (the
            # variant's use_gradient_checkpointing was the original's command-line flag); the
            # variant's gradient_checkpointing_ratio decides which (pan.parallel.fsdp).
            config = dataclasses.replace(dit_config(m), use_gradient_checkpointing=
                                         job.parallel.enable_gradient_checkpointing)
            model = dit_class(m.model_name)(config)
    if m.attention_backend is not None:
        set_attention_backend(model, m.attention_backend)
    return model


def released_weights(job: PyramidJobConfig) -> dict[str, Tensor]:
    return read_weights(variant_folder(job.model))

"""PanVideoDiffusionTransformer: the flow-matching MMDiT of Pan, on packed variable-length batches.

Architecture of the released Pan 29B transformer (HunyuanVideo-like MMDiT): patch embedding,
sinusoidal timestep MLP, a caption refiner, double-stream blocks (video AdaLN-Zero from the timestep,
text modulated by a static table, joint attention per sample with 3-D RoPE on video tokens),
optional single-stream blocks, and an AdaLN-continuous output layer. Inputs are packed: all video
tokens of the batch in one [Nv, C] tensor, all caption rows in one [Nt, D] tensor, plus a `PackInfo`.

References: DiT (Peebles & Xie, 2023) for AdaLN-Zero and the init; SD3 (Esser et al., 2024) for
the MMDiT block; HunyuanVideo (Kong et al., 2024) for the refiner and single-stream block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pan.config.core import ConfigError, knob
from pan.models.attention import AttentionBackend, set_attention_backend
from pan.models.layers import DoubleStreamBlock, FinalLayer, RefinerBlock, SingleStreamBlock, TimestepEmbedder
from pan.models.norm import RMSNorm
from pan.models.packing import PackInfo
from pan.models.rope import rope_frequencies

CONFIG_KEY = "transformer_config_overrides"

# Older (HunyuanVideo-style) spellings of the keys below; the config loader translates them.
LEGACY_NAMES: dict[str, str] = {
    "heads_num": "num_attention_heads",
    "mm_double_blocks_depth": "num_layers",
    "mm_single_blocks_depth": "num_single_layers",
    "rope_dim_list": "rope_axes_dim",
    "mlp_width_ratio": "mlp_ratio",
    "text_states_dim": "text_embed_dim",
}


@dataclass(kw_only=True)
class PanDiTConfig:
    """Every constructor argument of the transformer; defaults are the released 29B model."""
    LEGACY_NAMES: ClassVar[dict[str, str]] = LEGACY_NAMES  # read by the config loader
    SECTION: ClassVar[str] = "model"

    in_channels: int = knob(97, "input channels per latent voxel (48 noisy + 48 condition + 1 mask)", ge=1)
    out_channels: int = knob(48, "output channels per latent voxel (the velocity)", ge=1)
    patch_size: list[int] = knob([1, 2, 2], "patch (t, h, w) in latent voxels", length=3, ge=1)
    hidden_size: int = knob(4096, "transformer width", ge=1)
    num_attention_heads: int = knob(32, "attention heads; head dim = hidden_size / heads", ge=1)
    num_layers: int = knob(44, "double-stream (MMDiT) blocks", ge=0)
    num_single_layers: int = knob(0, "single-stream blocks after the double-stream ones", ge=0)
    num_refiner_layers: int = knob(4, "caption refiner blocks", ge=0)
    mlp_ratio: float = knob(8.0, "MLP inner size / hidden, video stream (and single blocks)", gt=0)
    text_mlp_ratio: float = knob(4.0, "MLP inner size / hidden, text stream", gt=0)
    refiner_mlp_ratio: float = knob(4.0, "SwiGLU inner size / hidden, caption refiner", gt=0)
    text_embed_dim: int = knob(4096, "width of the text encoder features", ge=1)
    rope_axes_dim: list[int] = knob([16, 56, 56], "RoPE dims of the (t, h, w) axes; sum = head dim",
                                    length=3, ge=2)
    rope_theta: float = knob(256.0, "RoPE base", gt=0)
    rope_frame_scale: float = knob(16 / 24, "RoPE frame-axis positions are multiplied by this", gt=0)
    norm_eps: float = knob(1e-6, "epsilon of every LayerNorm and RMSNorm", gt=0)
    timestep_freq_dim: int = knob(256, "sinusoidal timestep features before the timestep MLP", ge=2)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def patch_volume(self) -> int:
        pt, ph, pw = self.patch_size
        return pt * ph * pw

    def check(self, job=None) -> None:
        """Cross-key rules (`job` is unused: the architecture depends on nothing else)."""
        key = lambda name: f"{CONFIG_KEY}.{name}"  # noqa: E731
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(key("num_attention_heads"),
                              f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                              f"{self.num_attention_heads}; pick a head count that divides it.")
        if any(d % 2 for d in self.rope_axes_dim) or sum(self.rope_axes_dim) != self.head_dim:
            raise ConfigError(key("rope_axes_dim"),
                              f"{self.rope_axes_dim} must be even numbers summing to the head dim "
                              f"{self.head_dim} (hidden_size / num_attention_heads).")
        if self.timestep_freq_dim % 2:
            raise ConfigError(key("timestep_freq_dim"),
                              f"must be even (cos and sin halves), got {self.timestep_freq_dim}.")
        if self.num_layers + self.num_single_layers == 0:
            raise ConfigError(key("num_layers"), "num_layers and num_single_layers are both 0; the "
                                                 "model needs at least one block.")
        if min(self.patch_size) < 1:
            raise ConfigError(key("patch_size"), f"must be positive, got {self.patch_size}.")


class PanVideoDiffusionTransformer(nn.Module):
    """Flow-matching MMDiT on packed video + caption tokens.

    Build on the meta device, parallelize from outside, then `to_empty` and `init_weights()`.
    `attention_backend` (see `pan.models.attention.ATTENTION_BACKENDS`) sets every block's `inner_attention`; change it later
    with `pan.models.attention.set_attention_backend`.
    """

    def __init__(self, config: PanDiTConfig, zero_init_modulation: bool = True,
                 attention_backend: AttentionBackend = "auto"):
        super().__init__()
        config.check()
        self.config = config
        self.zero_init_modulation = zero_init_modulation
        c, d = config, config.hidden_size
        self.patch_embed = nn.Linear(c.in_channels * c.patch_volume, d)
        self.time_embed = TimestepEmbedder(d, c.timestep_freq_dim)
        self.text_norm = RMSNorm(c.text_embed_dim, eps=c.norm_eps)
        self.text_proj = nn.Linear(c.text_embed_dim, d)
        self.refiner = nn.ModuleList(RefinerBlock(d, c.num_attention_heads, c.refiner_mlp_ratio, c.norm_eps)
                                     for _ in range(c.num_refiner_layers))
        self.context_type = nn.Parameter(torch.empty(d))
        self.blocks = nn.ModuleList(
            DoubleStreamBlock(d, c.num_attention_heads, c.mlp_ratio, c.text_mlp_ratio, c.norm_eps)
            for _ in range(c.num_layers))
        self.single_blocks = nn.ModuleList(
            SingleStreamBlock(d, c.num_attention_heads, c.mlp_ratio, c.norm_eps)
            for _ in range(c.num_single_layers))
        self.final = FinalLayer(d, c.out_channels * c.patch_volume, c.norm_eps)
        set_attention_backend(self, attention_backend)
        if self.context_type.device.type != "meta":
            self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """DiT-style init: xavier linears, zero biases; zeroed modulation and output when asked."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.RMSNorm):
                nn.init.ones_(module.weight)
        nn.init.normal_(self.time_embed.fc1.weight, std=0.02)
        nn.init.normal_(self.time_embed.fc2.weight, std=0.02)
        nn.init.zeros_(self.context_type)
        for block in self.blocks:
            if self.zero_init_modulation:
                nn.init.zeros_(block.text_mod)
            else:
                nn.init.normal_(block.text_mod, std=0.02)
        if self.zero_init_modulation:
            # AdaLN-Zero: every gate is 0, so each block starts as the identity and the output is 0.
            for linear in self._modulation_linears() + [self.final.proj]:
                nn.init.zeros_(linear.weight)
                nn.init.zeros_(linear.bias)

    def forward(self, x: Tensor, timesteps: Tensor, text: Tensor, pack: PackInfo) -> Tensor:
        """x [Nv, in_channels * patch volume], timesteps = sigma in [0, 1] [B], text [Nt, text_embed_dim]
        -> [Nv, out_channels * patch volume]. Rows are this process's share given by `pack`."""
        c = self.config
        temb_act = F.silu(self.time_embed(timesteps * 1000))                 # [B, D]
        vid = self.patch_embed(x)                                             # [Nv, D]
        txt = self.text_proj(self.text_norm(text))                            # [Nt, D]
        for block in self.refiner:
            txt = block(txt, pack)
        txt = txt + self.context_type
        rope = rope_frequencies(pack.video_pos, c.rope_axes_dim, c.rope_theta, c.rope_frame_scale)
        for block in self.blocks:
            vid, txt = block(vid, txt, temb_act, rope, pack)
        if len(self.single_blocks):
            h = torch.cat([vid, txt])                                         # [L, D] stream order
            for block in self.single_blocks:
                h = block(h, temb_act, rope, pack)
            vid = h[:pack.num_video_tokens]
        return self.final(vid, temb_act, pack)                                # [Nv, out * p]

    def fsdp_blocks(self) -> list[nn.Module]:
        """The refiner, double-stream and single-stream blocks, in forward order (the units of
        FSDP, activation checkpointing and compile)."""
        return [*self.refiner, *self.blocks, *self.single_blocks]

    # ------------------------------------------------------------------------------------------
    # Optimizer split and FLOPs
    # ------------------------------------------------------------------------------------------

    def hidden_matrices(self) -> dict[str, tuple[int, ...]]:
        """Hidden 2-D matrices (for Muon) by parameter name -> the row blocks they stack.

        These are the attention and MLP weights of the refiner and of every block. Fused weights
        stack several matrices along rows (q/k/v; SwiGLU W1/W3; the single block's q/k/v/MLP-in);
        an optimizer that orthogonalises per matrix splits them with these sizes. Every other
        parameter (embeddings, timestep MLP, text projection, modulation linears and tables, the
        output layer, norms, biases, context vector) is not a hidden matrix (AdamW).
        """
        d = self.config.hidden_size
        modulation = set(self._modulation_linears())
        out: dict[str, tuple[int, ...]] = {}
        for prefix in ("refiner", "blocks", "single_blocks"):
            for name, module in getattr(self, prefix).named_modules(prefix=prefix):
                if not isinstance(module, nn.Linear) or module in modulation:
                    continue
                leaf = name.rsplit(".", 1)[-1]
                rows = module.out_features
                splits = {"qkv": (d, d, d), "w13": (rows // 2, rows // 2),
                          "linear1": (d, d, d, rows - 3 * d)}.get(leaf, (rows,))
                out[f"{name}.weight"] = splits
        return out

    def _modulation_linears(self) -> list[nn.Linear]:
        """Linears of SiLU(temb) that produce shift/scale/gate vectors."""
        return ([b.video_mod for b in self.blocks] + [b.mod for b in self.single_blocks]
                + [self.final.mod])

    def forward_flops(self, pack: PackInfo) -> int:
        """Exact matmul + attention FLOPs of one forward over the whole packed batch (all cp ranks).

        Each token goes through its own stream's weights only; modulation runs once per sample;
        attention costs 4 * Ls^2 * D per segment (QK^T and AV, summed over heads). Norms and
        elementwise ops are not counted. A training step is 3x this (backward = 2x forward).
        """
        c, d = self.config, self.config.hidden_size
        nv, nt, b = sum(pack.video_lens), sum(pack.text_lens), pack.num_samples
        joint_attn = 4 * d * sum(n * n for n in pack.joint.seqlens)
        text_attn = 4 * d * sum(n * n for n in pack.text.seqlens)
        mlp = lambda ratio: 2 * d * int(d * ratio)  # noqa: E731  (per token, two linears)
        flops = 2 * nv * c.in_channels * c.patch_volume * d                    # patch embed
        flops += 2 * b * (c.timestep_freq_dim * d + d * d)                     # timestep MLP
        flops += 2 * nt * c.text_embed_dim * d                                  # text projection
        refiner = 2 * nt * (4 * d * d + 3 * d * int(d * c.refiner_mlp_ratio)) + text_attn
        double = (2 * b * d * 6 * d                                            # video modulation
                  + 2 * nv * (4 * d * d + mlp(c.mlp_ratio))
                  + 2 * nt * (4 * d * d + mlp(c.text_mlp_ratio)) + joint_attn)
        single_mlp = int(d * c.mlp_ratio)
        single = (2 * b * d * 3 * d
                  + 2 * (nv + nt) * (d * (3 * d + single_mlp) + (d + single_mlp) * d) + joint_attn)
        final = 2 * b * d * 2 * d + 2 * nv * d * c.out_channels * c.patch_volume
        return (flops + c.num_refiner_layers * refiner + c.num_layers * double
                + c.num_single_layers * single + final)

"""PyramidDiffusionMMDiT (Pyramid-Flow's SD3-based DiT) on pan's packed variable-length batches.

The released model, parameter for parameter (checkpoint key names, see `pan.models.pyramid_io`):
an SD3 MMDiT, i.e. only double-stream blocks (the last one `context_pre_only`: the caption stream is
read, never written), per-head QK RMSNorm (eps 1e-5, quirk M4), and an AdaLN-continuous output.
Positions: space through the saved 2-D sin-cos table, centre-cropped to a clip's token grid and
added after the patch projection (M1); a history clip positioned on a reference grid (`Clip.ref_hw`)
takes the reference grid's crop bilinearly resized to its own grid (M2); time through a RoPE over
the whole head dim driven by the frame index (captions are frame 0, so not rotated).

Inputs as in `pan.models.pyramid_flux`: x [Nv, C * p * p] patch tokens ((c, p1, p2) inside a token,
the flattening of the original's Conv2d kernel), timesteps [B] on the 0..1000 scale, the valid caption
rows [Nt, joint_attention_dim], pooled text [B, pooled_projection_dim], and the pack.

References: Scaling Rectified Flow Transformers (Esser et al., 2024); Pyramidal Flow Matching
(Jin et al., 2024).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pan.config.core import ConfigError, knob
from pan.models.attention import set_attention_backend
from pan.models.packing import PackInfo, patchify
from pan.models.pyramid_blocks import (
    FinalNorm,
    JointAttention,
    JointBlock,
    TimeTextEmbedding,
    attention_backend,
    attention_flops,
    joint_block_flops,
)
from pan.models.pyramid_dit import ROPE_THETA, PyramidDiT, PyramidRuntimeKeys, joint_positions, trained_rows
from pan.models.rope import rope_frequencies


@dataclass(kw_only=True)
class PyramidMMDiTConfig(PyramidRuntimeKeys):
    """The keys of a released `PyramidDiffusionMMDiT` config.json, same names and meaning.

    Defaults: the original constructor's where they describe a working model (SD3-medium sizes), and
    the values its training path forces where they do not (positional embeddings, masks, flags).
    A released folder's config.json sets every key.
    """
    sample_size: int = knob(128, "latent size the sin-cos table is scaled for: its base grid is "
                                 "sample_size // patch_size", ge=1)
    patch_size: int = knob(2, "patch height and width (the Conv2d patch projection)", ge=1)
    in_channels: int = knob(16, "latent channels", ge=1)
    num_layers: int = knob(24, "MMDiT blocks (the last one is context_pre_only)", ge=1)
    attention_head_dim: int = knob(64, "head dim", ge=2)
    num_attention_heads: int = knob(24, "attention heads; hidden size = heads x head dim", ge=1)
    caption_projection_dim: int = knob(1536, "caption stream width: must equal the hidden size (the "
                                             "original's default 1152 does not fit its 24 x 64 heads)", ge=1)
    pooled_projection_dim: int = knob(2048, "width of the pooled text feature (CLIP-L + CLIP-G)", ge=1)
    pos_embed_max_size: int = knob(192, "side of the square sin-cos table (token grids up to this)", ge=1)
    max_num_frames: int = knob(200, "size of the sin-cos temporal table of temp_pos_embed_type 'sincos' "
                                    "(not supported); not read with RoPE time, kept so the folder "
                                    "round-trips", ge=1)
    qk_norm: str = knob("rms_norm", "per-head norm of q and k: 'rms_norm' (the only one supported)")
    pos_embed_type: str = knob("sincos", "spatial positions: 'sincos' (the original raises on 'rope': M1)")
    temp_pos_embed_type: str = knob("rope", "temporal positions: 'rope' over the whole head dim")
    add_temp_pos_embed: bool = knob(True, "temporal positions on (must be true: the original forces it)")
    joint_attention_dim: int = knob(4096, "width of the caption features (T5)", ge=1)
    use_t5_mask: bool = knob(True, "padded caption rows never attended (must be true: pan drops them, and "
                                   "the original masks them whatever this says)")

    @property
    def hidden_size(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    def check(self) -> None:
        fixed = {"qk_norm": ("rms_norm", "the only per-head norm pan implements for this model"),
                 "pos_embed_type": ("sincos", "the original raises NotImplementedError on 'rope' (M1)"),
                 "temp_pos_embed_type": ("rope", "the original's training path forces it"),
                 "add_temp_pos_embed": (True, "the original's training path forces it"),
                 "use_t5_mask": (True, "pan drops padded caption rows, and the original masks them "
                                       "whatever this key says")}
        for key, (value, why) in fixed.items():
            if getattr(self, key) != value:
                raise ConfigError(key, f"is {getattr(self, key)!r}; only {value!r} is supported ({why}).")
        if self.caption_projection_dim != self.hidden_size:
            raise ConfigError("caption_projection_dim",
                              f"{self.caption_projection_dim} must equal num_attention_heads x "
                              f"attention_head_dim = {self.hidden_size} (both streams share the blocks' width).")
        if self.attention_head_dim % 2:
            raise ConfigError("attention_head_dim", f"{self.attention_head_dim} must be even (temporal RoPE).")
        if self.sample_size < self.patch_size:
            raise ConfigError("sample_size", f"{self.sample_size} is smaller than patch_size {self.patch_size}.")


def sincos_table(dim: int, size: int, base_size: int) -> Tensor:
    """[size * size, dim] float32 2-D sin-cos table, rows in (h, w) order, as the original builds it:
    coordinates i / (size / base_size) (in float32), the first half of the channels encodes w and the
    second half h, each as [sin, cos] over frequencies 10000^(-k / (dim / 4))."""
    coord = (torch.arange(size, dtype=torch.float32) / (size / base_size)).double()
    h, w = torch.meshgrid(coord, coord, indexing="ij")                     # [size, size]

    def axis(pos: Tensor, d: int) -> Tensor:
        omega = 1.0 / 10000 ** (torch.arange(d // 2, dtype=torch.float64) / (d / 2))
        angle = pos.reshape(-1, 1) * omega                                  # [size^2, d/2]
        return torch.cat([angle.sin(), angle.cos()], dim=1)

    return torch.cat([axis(w, dim // 2), axis(h, dim // 2)], dim=1).float()


class PatchEmbed(nn.Module):
    """Patch projection (`proj`, the original's Conv2d, applied as a Linear on (c, p1, p2) tokens)
    plus the sin-cos table rows of each token's position (`pos_embed`, a saved buffer)."""

    def __init__(self, in_channels: int, hidden: int, patch: int, table_size: int, base_size: int):
        super().__init__()
        self.table_size, self.base_size = table_size, base_size
        self.proj = nn.Conv2d(in_channels, hidden, kernel_size=patch, stride=patch)
        self.register_buffer("pos_embed", torch.empty(1, table_size * table_size, hidden))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        weight = self.proj.weight
        nn.init.xavier_uniform_(weight.view(weight.shape[0], -1))  # as a Linear, not a conv
        nn.init.zeros_(self.proj.bias)
        self.pos_embed.copy_(sincos_table(weight.shape[0], self.table_size, self.base_size)[None])

    def forward(self, x: Tensor, pack: PackInfo) -> Tensor:
        # x [Nv, C * p * p] -> [Nv, D]
        tokens = F.linear(x, self.proj.weight.flatten(1), self.proj.bias)
        return tokens + self.position_rows(pack).to(tokens.dtype)

    @torch.no_grad()
    def position_rows(self, pack: PackInfo) -> Tensor:
        """[Nv, D] table row of each local video token: one table per distinct clip grid, gathered."""
        tables, index, offsets, size = [], [], {}, 0
        for layout in pack.layouts:
            for clip in layout.clips:
                t, h, w = clip.grid
                key = (h, w, tuple(clip.ref_hw) if clip.ref_hw is not None else (h, w))
                if key not in offsets:
                    offsets[key], size = size, size + h * w
                    tables.append(self.clip_table((h, w), key[2]))
                index.append(torch.arange(h * w).repeat(t) + offsets[key])
        index = torch.cat(index).to(pack.video_index.device).index_select(0, pack.video_index)
        return torch.cat(tables).index_select(0, index.to(self.pos_embed.device))

    def clip_table(self, hw: tuple[int, int], ref_hw: tuple[int, int]) -> Tensor:
        """[h * w, D]: the centre crop of the reference grid, resized (bilinear) to the clip's grid."""
        m, (rh, rw) = self.table_size, ref_hw
        if max(rh, rw) > m:
            raise ValueError(f"a {rh} x {rw} token grid does not fit the {m} x {m} position table "
                             "(pos_embed_max_size).")
        top, left = (m - rh) // 2, (m - rw) // 2
        crop = self.pos_embed.reshape(m, m, -1)[top:top + rh, left:left + rw]    # [rh, rw, D]
        if (rh, rw) != tuple(hw):
            crop = F.interpolate(crop.permute(2, 0, 1)[None], size=tuple(hw), mode="bilinear")[0]
            crop = crop.permute(1, 2, 0)
        return crop.reshape(hw[0] * hw[1], -1)


class MMDiTAttention(JointAttention):
    """The joint attention under the MMDiT checkpoint's names for the caption QK norms."""
    CONTEXT_NORMS: ClassVar[tuple[str, str]] = ("norm_add_q", "norm_add_k")


class PyramidMMDiT(PyramidDiT):
    """Pyramid-Flow's SD3-MMDiT on packed video + caption tokens.

    Build on the meta device, parallelize from outside, then `to_empty` and `init_weights()`; or
    `pan.models.pyramid_io.load_pretrained(folder, PyramidMMDiT)`.
    """
    RELEASED_CLASS_NAME: ClassVar[str] = "PyramidDiffusionMMDiT"
    config_class: ClassVar[type] = PyramidMMDiTConfig
    BLOCK_LISTS: ClassVar[tuple[str, ...]] = ("transformer_blocks",)

    def __init__(self, config: PyramidMMDiTConfig):
        super().__init__()
        config.check()
        self.config = config
        c, d = config, config.hidden_size
        self.pos_embed = PatchEmbed(c.in_channels, d, c.patch_size, c.pos_embed_max_size,
                                    c.sample_size // c.patch_size)
        self.time_text_embed = TimeTextEmbedding(d, c.pooled_projection_dim)
        self.context_embedder = nn.Linear(c.joint_attention_dim, c.caption_projection_dim)
        self.transformer_blocks = nn.ModuleList(
            JointBlock(d, c.num_attention_heads, qk_eps=1e-5, context_pre_only=i == c.num_layers - 1,
                       attention=MMDiTAttention) for i in range(c.num_layers))
        self.norm_out = FinalNorm(d)
        self.proj_out = nn.Linear(d, c.patch_size ** 2 * c.in_channels)
        set_attention_backend(self, "auto" if c.use_flash_attn else "sdpa")
        if self.proj_out.weight.device.type != "meta":
            self.init_weights()

    @property
    def latent_channels(self) -> int:
        return self.config.in_channels

    # --------------------------------------------------------------------------------------------
    # Tokens and layouts
    # --------------------------------------------------------------------------------------------

    def patch_grid(self, latent_shape) -> tuple[int, int, int]:
        """Post-patch (t, h, w) of a [C, T, H, W] latent: (T, H/p, W/p)."""
        _, t, h, w = latent_shape
        p = self.config.patch_size
        return t, h // p, w // p

    def patchify(self, latent: Tensor) -> Tensor:
        """[C, T, H, W] latent -> [T*h*w, C*p*p] tokens, (t, h, w) order, (c, p1, p2) inside a token."""
        p = self.config.patch_size
        return patchify(latent, (1, p, p))

    def unpatchify(self, tokens: Tensor, grid: tuple[int, int, int]) -> Tensor:
        """Model output [t*h*w, C*p*p] -> [C, t, h*p, w*p]. The output is (p1, p2, c) inside a token,
        unlike the input (the original's proj_out layout)."""
        p = self.config.patch_size
        t, h, w = grid
        x = tokens.reshape(t, h, w, p, p, -1).permute(5, 0, 1, 3, 2, 4)
        return x.reshape(-1, t, h * p, w * p)

    def target_tokens(self, latent: Tensor) -> Tensor:
        """[C, T, H, W] -> [T*h*w, C*p*p] in the output's token layout (inverse of `unpatchify`): the
        form a token-wise loss compares the model output with."""
        p = self.config.patch_size
        c, t, h, w = latent.shape
        x = latent.reshape(c, t, h // p, p, w // p, p).permute(1, 2, 4, 3, 5, 0)
        return x.reshape(t * (h // p) * (w // p), p * p * c)

    # --------------------------------------------------------------------------------------------
    # Forward
    # --------------------------------------------------------------------------------------------

    def forward(self, x: Tensor, timesteps: Tensor, text: Tensor, pooled: Tensor, pack: PackInfo,
                trained_only: bool = False) -> Tensor:
        """x [Nv, C*p*p] patch tokens, timesteps [B] (0..1000), text [Nt, joint_attention_dim] (valid
        caption rows only), pooled [B, pooled_projection_dim] -> [Nv, C*p*p]; `trained_only`: the
        trained rows' predictions only [n, C*p*p] (computed for every row, then kept)."""
        c = self.config
        temb_act = self.conditioning(timesteps, pooled, pack)                        # [B, D]
        vid = self.pos_embed(x, pack)                                                # [Nv, D]
        txt = self.context_embedder(text)                                            # [Nt, D]
        frames = joint_positions(pack)[:, :1]                                        # [L, 1] (t only)
        rope = rope_frequencies(frames, [c.attention_head_dim], ROPE_THETA, 1.0)     # [L, d/2]
        for block in self.transformer_blocks:
            vid, txt = block(vid, txt, temb_act, rope, pack)
        if trained_only:
            vid = trained_rows(vid, pack)
        return self.output(vid, temb_act, pack, trained_only)                        # [Nv or n, C*p*p]

    # --------------------------------------------------------------------------------------------
    # Init, FLOPs
    # --------------------------------------------------------------------------------------------

    @torch.no_grad()
    def init_weights(self) -> None:
        """The original's init (zeroed AdaLN modulation and output), and the sin-cos table."""
        super().init_weights()
        self.pos_embed.reset_parameters()

    def forward_flops(self, pack: PackInfo, trained_only: bool = False) -> int:
        """Exact matmul + attention FLOPs of one forward over the whole pack (all cp ranks), counted as
        in `PyramidFluxTransformer.forward_flops` (the last block computes caption q/k/v only). With
        `trained_only` every block still computes every row; the output layer the trained ones."""
        c, d = self.config, self.config.hidden_size
        nv, nt, b = sum(pack.video_lens), sum(pack.text_lens), pack.num_samples
        attention = attention_flops(pack.joint, d, attention_backend(self))
        unread = (nv - sum(pack.trained_counts)) if trained_only else 0   # rows the output layer skips
        return self.edge_flops(pack) - 2 * unread * d * c.in_channels * c.patch_size ** 2 + sum(
            joint_block_flops(d, nv, nt, b, attention, context_pre_only=i == c.num_layers - 1)
            for i in range(c.num_layers))

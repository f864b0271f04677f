"""PyramidFluxTransformer (Pyramid-Flow's miniFLUX DiT) on pan's packed variable-length batches.

The released model, parameter for parameter (names are the checkpoint's keys, so loading and
exporting are the identity on the state dict, see `pan.models.pyramid_io`): FLUX double-stream
blocks (video and caption streams with their own weights, one joint attention per sample) followed
by single-stream blocks over the joint sequence, 3-D RoPE over (t, h, w) with per-head QK RMSNorm,
and an AdaLN-continuous output layer. The timestep (0..1000 scale) and the pooled text feature of a
sample give its conditioning vector `temb`, which modulates both streams of that sample only.

Inputs are packed like pan's own model: all video tokens of the batch (this process's rows) in one
[Nv, in_channels] tensor, the valid caption rows in one [Nt, joint_attention_dim] tensor, sample
after sample, plus a `PackInfo` whose layouts carry the clips (history clips positioned on the last
clip's grid through `Clip.ref_hw`) and the attention rule (`block_causal`: the original's temporal
mask, captions being frame 0). Padded caption rows are not passed at all: the original never lets a
valid token attend to one, so dropping them leaves every output unchanged.

Here: the single-stream blocks (flux only) and the model. What the SD3-MMDiT variant
(`pan.models.pyramid_mmdit`) shares with it: the layers and the double-stream block in
`pan.models.pyramid_blocks`, the config keys, layout rules and the frame around the blocks in
`pan.models.pyramid_dit`.

Shapes: B = samples, Nv / Nt = video / caption rows held by this process, L = Nv + Nt (joint order:
each sample's [video; caption] rows, samples in order), D = hidden size, H = heads, d = head dim.

References: FLUX.1 (Black Forest Labs, 2024); Pyramidal Flow Matching (Jin et al., 2024).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch.nn.functional as F
from torch import Tensor, nn

from pan.config.core import ConfigError, knob
from pan.models.attention import InnerAttention, set_attention_backend
from pan.models.layers import (Samples, adaln_vectors, from_joint, gated_residual, layer_norm, like_v, linear_of_cat,
                               modulate, to_joint)
from pan.models.norm import RMSNorm
from pan.models.packing import AttnSegments, PackInfo
from pan.models.pyramid_blocks import (NORM_EPS, FinalNorm, JointBlock, Modulation, TimeTextEmbedding,
                                       attention_backend, attention_flops, joint_block_flops, split_heads)
from pan.models.pyramid_dit import (ROPE_THETA, PyramidDiT, PyramidRuntimeKeys, joint_counts, joint_positions,
                                    joint_samples, trained_rows, video_samples)
from pan.models.rope import apply_rope, rope_frequencies


# ------------------------------------------------------------------------------------------------
# Single-stream blocks (flux only)
# ------------------------------------------------------------------------------------------------

class SingleAttention(nn.Module):
    """q/k/v projections with per-head RMSNorm (no output projection: the block's proj_out mixes the
    attention output with the MLP branch)."""

    def __init__(self, hidden: int, heads: int, eps: float):
        super().__init__()
        self.heads = heads
        self.to_q, self.to_k, self.to_v = (nn.Linear(hidden, hidden) for _ in range(3))
        self.norm_q = RMSNorm(hidden // heads, eps=eps)
        self.norm_k = RMSNorm(hidden // heads, eps=eps)
        self.inner_attention = InnerAttention()

    def forward(self, x: Tensor, rope: Tensor, segments: AttnSegments) -> Tensor:
        # x [L, D] normalised and modulated, joint order; rope [L, d/2]. Segments asked by some rows
        # only (`query_rows`): queries and outputs [Lq, ...] of those rows.
        rows = segments.query_rows
        xq, rope_q = (x, rope) if rows is None else (x.index_select(0, rows), rope.index_select(0, rows))
        q = apply_rope(self.norm_q(split_heads(self.to_q(xq), self.heads)), rope_q)          # [Lq, H, d]
        k = apply_rope(self.norm_k(split_heads(self.to_k(x), self.heads)), rope)             # [L, H, d]
        v = split_heads(self.to_v(x), self.heads)
        q, k = like_v(v, q, k)
        return self.inner_attention(q, k, v, segments).flatten(1)                             # [Lq, D]


class SingleBlock(nn.Module):
    """FLUX single-stream block over the joint sequence: one modulated LayerNorm feeds attention and a
    GELU MLP in parallel; proj_out maps [attention; MLP] back, gated per sample."""

    def __init__(self, hidden: int, heads: int, mlp_ratio: int = 4):
        super().__init__()
        self.norm = Modulation(hidden, 3)
        self.proj_mlp = nn.Linear(hidden, hidden * mlp_ratio)
        self.proj_out = nn.Linear(hidden * (1 + mlp_ratio), hidden)
        self.attn = SingleAttention(hidden, heads, eps=1e-6)

    def forward(self, h: Tensor, temb_act: Tensor, rope: Tensor, sample_of_row: Tensor, pack: PackInfo,
                trained: AttnSegments | None = None) -> Tensor:
        # h [L, D] joint order, sample_of_row [L] -> [L, D]; `trained` (the last block, when only the
        # trained video rows are read: `pack.trained_joint`): [n, D] of those rows, which alone get
        # queries, MLP and output (every row still gives keys and values)
        samples = Samples.of(lambda: joint_counts(pack), sample_of_row)
        shift, scale, gate = adaln_vectors(self.norm(temb_act), 3).chunk(3, dim=-1)            # [B, D]
        x = modulate(layer_norm(h, NORM_EPS), shift, scale, samples)
        segments, x_out = pack.joint, x
        if trained is not None:
            segments = trained
            h, x_out = (t.index_select(0, trained.query_rows) for t in (h, x))
            samples = video_samples(pack, trained_only=True)
        mlp = F.gelu(self.proj_mlp(x_out), approximate="tanh")
        out = linear_of_cat(self.proj_out, self.attn(x, rope, segments), mlp)
        return gated_residual(h, gate, out, samples)


# ------------------------------------------------------------------------------------------------
# The flux model
# ------------------------------------------------------------------------------------------------

@dataclass(kw_only=True)
class PyramidFluxConfig(PyramidRuntimeKeys):
    """The keys of a released `PyramidFluxTransformer` config.json, same names and meaning.

    Defaults are the original constructor's (a released folder's config.json sets every key).
    """
    patch_size: int = knob(1, "proj_out has patch_size^2 * in_channels outputs; only 1 works, since "
                              "tokens are always 2x2 patches (quirk F1)", ge=1)
    in_channels: int = knob(64, "values per token = 4 x latent channels (2x2 patch, (p1 p2 c) order)", ge=4)
    num_layers: int = knob(19, "double-stream blocks", ge=0)
    num_single_layers: int = knob(38, "single-stream blocks", ge=0)
    attention_head_dim: int = knob(64, "head dim", ge=2)
    num_attention_heads: int = knob(24, "attention heads; hidden size = heads x head dim", ge=1)
    joint_attention_dim: int = knob(4096, "width of the caption features (T5)", ge=1)
    pooled_projection_dim: int = knob(768, "width of the pooled text feature (CLIP)", ge=1)
    axes_dims_rope: list[int] = knob([16, 24, 24], "RoPE dims of the (t, h, w) axes; even, summing to the "
                                                   "head dim (the original's loader forced [16, 24, 24]: F2)",
                                     length=3, ge=2)

    @property
    def hidden_size(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    def check(self) -> None:
        if self.patch_size != 1:
            raise ConfigError("patch_size", f"is {self.patch_size}, but the model always cuts 2x2 patches and "
                                            "its output must be in_channels wide per token: only 1 works.")
        if self.in_channels % 4:
            raise ConfigError("in_channels", f"{self.in_channels} is not 4 x the latent channels (tokens are "
                                             "2x2 patches of the latent).")
        if any(d % 2 for d in self.axes_dims_rope) or sum(self.axes_dims_rope) != self.attention_head_dim:
            raise ConfigError("axes_dims_rope", f"{self.axes_dims_rope} must be even numbers summing to "
                                                f"attention_head_dim {self.attention_head_dim}.")


class PyramidFluxTransformer(PyramidDiT):
    """Pyramid-Flow's miniFLUX DiT on packed video + caption tokens.

    Build on the meta device, parallelize from outside, then `to_empty` and `init_weights()`; or
    `pan.models.pyramid_io.load_pretrained(folder, PyramidFluxTransformer)`.
    """
    RELEASED_CLASS_NAME: ClassVar[str] = "PyramidFluxTransformer"
    config_class: ClassVar[type] = PyramidFluxConfig
    BLOCK_LISTS: ClassVar[tuple[str, ...]] = ("transformer_blocks", "single_transformer_blocks")

    def __init__(self, config: PyramidFluxConfig):
        super().__init__()
        config.check()
        self.config = config
        c, d = config, config.hidden_size
        self.time_text_embed = TimeTextEmbedding(d, c.pooled_projection_dim)
        self.context_embedder = nn.Linear(c.joint_attention_dim, d)
        self.x_embedder = nn.Linear(c.in_channels, d)
        self.transformer_blocks = nn.ModuleList(
            JointBlock(d, c.num_attention_heads, qk_eps=1e-6) for _ in range(c.num_layers))
        self.single_transformer_blocks = nn.ModuleList(
            SingleBlock(d, c.num_attention_heads) for _ in range(c.num_single_layers))
        self.norm_out = FinalNorm(d)
        self.proj_out = nn.Linear(d, c.patch_size ** 2 * c.in_channels)
        set_attention_backend(self, "auto" if c.use_flash_attn else "sdpa")
        if self.x_embedder.weight.device.type != "meta":
            self.init_weights()

    @property
    def latent_channels(self) -> int:
        return self.config.in_channels // 4

    # --------------------------------------------------------------------------------------------
    # Tokens and layouts
    # --------------------------------------------------------------------------------------------

    def patch_grid(self, latent_shape) -> tuple[int, int, int]:
        """Post-patch (t, h, w) of a [C, T, H, W] latent: (T, H/2, W/2)."""
        _, t, h, w = latent_shape
        return t, h // 2, w // 2

    def patchify(self, latent: Tensor) -> Tensor:
        """[C, T, H, W] latent -> [T*h*w, 4C] tokens, (t, h, w) order; (p1 p2 c) inside a token (F1)."""
        c, t, h, w = latent.shape
        if h % 2 or w % 2:
            raise ValueError(f"latent {tuple(latent.shape)}: height and width must be even (2x2 patches).")
        x = latent.reshape(c, t, h // 2, 2, w // 2, 2).permute(1, 2, 4, 3, 5, 0)
        return x.reshape(t * (h // 2) * (w // 2), 4 * c)

    def unpatchify(self, tokens: Tensor, grid: tuple[int, int, int]) -> Tensor:
        """Inverse of `patchify`: [t*h*w, 4C] -> [C, t, 2h, 2w]."""
        t, h, w = grid
        c = tokens.shape[1] // 4
        x = tokens.reshape(t, h, w, 2, 2, c).permute(5, 0, 1, 3, 2, 4)
        return x.reshape(c, t, 2 * h, 2 * w)

    def target_tokens(self, latent: Tensor) -> Tensor:
        """[C, T, H, W] -> tokens in the output's layout (the input's here: (p1 p2 c)), the form a
        token-wise loss compares the model output with."""
        return self.patchify(latent)

    # --------------------------------------------------------------------------------------------
    # Forward
    # --------------------------------------------------------------------------------------------

    def forward(self, x: Tensor, timesteps: Tensor, text: Tensor, pooled: Tensor, pack: PackInfo,
                trained_only: bool = False) -> Tensor:
        """x [Nv, in_channels] patch tokens, timesteps [B] (0..1000), text [Nt, joint_attention_dim]
        (valid caption rows only), pooled [B, pooled_projection_dim] -> [Nv, in_channels].

        `trained_only`: the predictions of the trained video rows only ([n, in_channels], stream
        order: each sample's last clip), all a loss or sampler reads. The last single-stream block
        then works for those rows alone (queries, MLP and output of history and caption rows are
        never read); under context parallel every row is computed and the trained ones kept."""
        c = self.config
        temb_act = self.conditioning(timesteps, pooled, pack)                        # [B, D]
        vid = self.x_embedder(x)                                                     # [Nv, D]
        txt = self.context_embedder(text)                                            # [Nt, D]
        rope = rope_frequencies(joint_positions(pack), c.axes_dims_rope, ROPE_THETA, 1.0)  # [L, d/2]
        for block in self.transformer_blocks:
            vid, txt = block(vid, txt, temb_act, rope, pack)
        h = to_joint(vid, txt, pack)                                                 # [L, D]
        samples = joint_samples(pack)
        blocks = list(self.single_transformer_blocks)
        # the trained rows' schedule: host work, built here once per pack, never in a compiled block
        trained = pack.trained_joint if trained_only and pack.cp_size == 1 and blocks else None
        for i, block in enumerate(blocks):
            h = block(h, temb_act, rope, samples, pack, trained=trained if i == len(blocks) - 1 else None)
        if trained is not None:
            return self.output(h, temb_act, pack, trained_only=True)                 # [n, in_channels]
        vid = from_joint(h, pack)[0]                                                 # [Nv, D]
        if trained_only:
            vid = trained_rows(vid, pack)
        return self.output(vid, temb_act, pack, trained_only)                        # [Nv or n, in_channels]

    # --------------------------------------------------------------------------------------------
    # FLOPs
    # --------------------------------------------------------------------------------------------

    def forward_flops(self, pack: PackInfo, trained_only: bool = False) -> int:
        """Exact matmul + attention FLOPs of one forward over the whole pack (all cp ranks).

        Per token its own stream's linears; modulation once per sample; attention 4 * D per (query,
        key) pair the attention backend computes (`attention_flops`: all Ls^2 for sdpa, only the
        block-causal rule's allowed pairs for the backends that skip masked blocks). Norms, RoPE and
        element-wise work are not counted. A training step is about 3x this. `trained_only`: the
        forward that predicts the trained rows only without context parallel (the last single-stream
        block's queries, MLP and output, and the output layer, for those rows alone).
        """
        c, d, backend = self.config, self.config.hidden_size, attention_backend(self)
        nv, nt, b = sum(pack.video_lens), sum(pack.text_lens), pack.num_samples
        attention = attention_flops(pack.joint, d, backend)
        flops = c.num_layers * joint_block_flops(d, nv, nt, b, attention, context_pre_only=False)
        single = 2 * (nv + nt) * (3 * d * d + 4 * d * d + 5 * d * d) + 2 * b * d * 3 * d + attention
        flops += self.edge_flops(pack) + c.num_single_layers * single
        if not trained_only:
            return flops
        n = sum(pack.trained_counts)
        flops -= 2 * (nv - n) * d * c.in_channels                    # the output layer: trained rows only
        if c.num_single_layers:                                       # the last block: rows nobody reads
            flops -= 2 * (nv + nt - n) * (d * d + 4 * d * d + 5 * d * d)   # skip their q, MLP and proj_out
            flops -= attention - attention_flops(pack.trained_joint, d, backend)
        return flops

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

Also home of the pieces the SD3-MMDiT variant (`pan.models.pyramid_mmdit`) shares: the timestep +
pooled-text embedding, AdaLN modulation linears, the GELU feed-forward, the joint attention and the
double-stream block, and the config/layout rules common to both released models.

Shapes: B = samples, Nv / Nt = video / caption rows held by this process, L = Nv + Nt (joint order:
each sample's [video; caption] rows, samples in order), D = hidden size, H = heads, d = head dim.

References: FLUX.1 (Black Forest Labs, 2024); Pyramidal Flow Matching (Jin et al., 2024).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pan.config.core import ConfigError, knob
from pan.models.attention import InnerAttention, set_attention_backend
from pan.models.layers import (Samples, adaln_vectors, from_joint, gated_residual, layer_norm, like_v, linear_of_cat,
                               modulate, to_joint)
from pan.models.norm import RMSNorm
from pan.models.packing import AttnSegments, PackInfo, SampleLayout
from pan.models.rope import apply_rope, rope_frequencies

ROPE_THETA = 10000.0          # hard-coded in the original (not a config key)
TIMESTEP_FEATURES = 256       # sinusoidal timestep features before the timestep MLP
NORM_EPS = 1e-6               # every LayerNorm of both released models


# ------------------------------------------------------------------------------------------------
# Config rules shared by both released models
# ------------------------------------------------------------------------------------------------

@dataclass(kw_only=True)
class PyramidRuntimeKeys:
    """Keys of the released config.json that the original sets from its training command line
    (ignoring the file, quirk F2). pan reads them from the file and honours each one."""
    use_flash_attn: bool = knob(False, "attention backend the blocks start with: true = 'auto' (pan's "
                                       "fastest exact kernels, by measurement; the block-causal mask is never dropped, "
                                       "unlike the original's flash path), false = 'sdpa' (one masked "
                                       "SDPA call per sequence, the original's other path)")
    use_temporal_causal: bool = knob(True, "block-causal attention over latent frames (captions are frame "
                                           "0); forward refuses packs built with another rule")
    interp_condition_pos: bool = knob(True, "history clips take positions interpolated onto the last "
                                            "clip's grid (Clip.ref_hw); forward refuses packs that differ")
    use_gradient_checkpointing: bool = knob(False, "checkpoint the blocks `checkpointed_blocks()` names")
    gradient_checkpointing_ratio: float = knob(0.6, "fraction of each block list (first blocks first) "
                                                    "that `checkpointed_blocks()` names", ge=0, le=1)


def check_layouts(pack: PackInfo, use_temporal_causal: bool, interp_condition_pos: bool) -> None:
    """Refuse a pack whose attention rule or history positions are not the ones the config names.

    The rule and the positions travel with the pack (the data side builds them, see
    `pyramid_sample_layout`); the model's config says which ones it was trained with.
    """
    rule = "block_causal" if use_temporal_causal else "full"
    for i, layout in enumerate(pack.layouts):
        if layout.attention != rule:
            raise ValueError(f"sample {i} has the {layout.attention!r} attention rule but the model's "
                             f"use_temporal_causal={use_temporal_causal} needs {rule!r}; build the layouts "
                             "with the model's `sample_layout`.")
        last_hw = tuple(layout.clips[-1].grid[1:])
        for j, clip in enumerate(layout.clips):
            own_hw = tuple(clip.grid[1:])
            ref = None if clip.ref_hw is None or tuple(clip.ref_hw) == own_hw else tuple(clip.ref_hw)
            expected = last_hw if interp_condition_pos and own_hw != last_hw else None
            if ref != expected:
                raise ValueError(f"sample {i} clip {j} (grid {clip.grid}) is positioned on {ref or own_hw} "
                                 f"but interp_condition_pos={interp_condition_pos} needs {expected or own_hw}; "
                                 "build the layouts with the model's `sample_layout`.")


def pyramid_sample_layout(grids, text_len: int, use_temporal_causal: bool, interp_condition_pos: bool
                          ) -> SampleLayout:
    """One Pyramid-Flow sample: clips oldest first (post-patch grids), the last one trained.

    History clips (all but the last) are conditioning only; with interp_condition_pos they are
    positioned on the last clip's grid, as the original does.
    """
    grids = [tuple(int(n) for n in g) for g in grids]
    return SampleLayout.stacked(grids, text_len,
                                ref_hw=grids[-1][1:] if interp_condition_pos else None,
                                trained=tuple(i == len(grids) - 1 for i in range(len(grids))),
                                attention="block_causal" if use_temporal_causal else "full")


def first_blocks(blocks: nn.ModuleList, ratio: float) -> list[nn.Module]:
    """The first round(ratio * n) blocks of a list (the original picks `i <= int(n * ratio)` in
    flux and, inverted, `i >= int(n * ratio)` in MMDiT: quirk M5; pan uses one rule for both)."""
    return list(blocks)[:round(ratio * len(blocks))]


def joint_positions(pack: PackInfo) -> Tensor:
    """[L, 3] float64 (t, h, w) RoPE positions in joint order; caption rows are 0 (not rotated)."""
    video = pack.video_pos.to(torch.float64)
    return to_joint(video, video.new_zeros(pack.num_text_tokens, 3), pack)


def joint_samples(pack: PackInfo) -> Tensor:
    """[L] int64 sample of each joint row."""
    return to_joint(pack.video_sample, pack.text_sample, pack)


def joint_counts(pack: PackInfo) -> tuple[int, ...]:
    return tuple(v + t for v, t in zip(pack.video_counts, pack.text_counts))


def video_samples(pack: PackInfo, trained_only: bool = False) -> Samples:
    """The sample of each local video row, or of each trained one."""
    if trained_only:
        return Samples.of(lambda: pack.trained_counts, pack.video_sample.index_select(0, pack.video_trained_rows))
    return Samples.of(lambda: pack.video_counts, pack.video_sample)


def trained_rows(vid: Tensor, pack: PackInfo) -> Tensor:
    """The trained rows (stream order) of per-video-row values [Nv, ...]."""
    return vid if len(pack.video_trained_rows) == len(vid) else vid.index_select(0, pack.video_trained_rows)


# ------------------------------------------------------------------------------------------------
# Layers shared by both released models (names are the checkpoint's)
# ------------------------------------------------------------------------------------------------

def timestep_features(timesteps: Tensor, dim: int = TIMESTEP_FEATURES) -> Tensor:
    """[B] timesteps (0..1000 scale) -> [B, dim] sinusoidal features, cosines first (quirk F3)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=timesteps.device)
                      / half)
    args = timesteps.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class TwoLayerMLP(nn.Module):
    """linear_1 -> SiLU -> linear_2."""

    def __init__(self, in_features: int, hidden: int):
        super().__init__()
        self.linear_1 = nn.Linear(in_features, hidden)
        self.linear_2 = nn.Linear(hidden, hidden)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class TimeTextEmbedding(nn.Module):
    """temb [B, D] = MLP(sinusoid(timestep)) + MLP(pooled text feature), one row per sample."""

    def __init__(self, hidden: int, pooled_dim: int):
        super().__init__()
        self.timestep_embedder = TwoLayerMLP(TIMESTEP_FEATURES, hidden)
        self.text_embedder = TwoLayerMLP(pooled_dim, hidden)

    def forward(self, timesteps: Tensor, pooled: Tensor) -> Tensor:
        features = timestep_features(timesteps).to(pooled.dtype)
        return self.timestep_embedder(features) + self.text_embedder(pooled)


class Modulation(nn.Module):
    """`linear` of SiLU(temb): [B, D] -> [B, n*D] per-sample modulation vectors."""

    def __init__(self, hidden: int, n: int):
        super().__init__()
        self.linear = nn.Linear(hidden, n * hidden)

    def forward(self, temb_act: Tensor) -> Tensor:
        return self.linear(temb_act)


class GeluProjection(nn.Module):
    """The feed-forward's first layer (`proj`); GELU is applied by the caller."""

    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.proj = nn.Linear(hidden, inner)


class FeedForward(nn.Module):
    """Linear -> GELU (tanh) -> Linear, named `net.0.proj` / `net.2` as in the checkpoint
    (`net.1` was a dropout of rate 0: an identity keeps the indices)."""

    def __init__(self, hidden: int, mult: int = 4):
        super().__init__()
        self.net = nn.ModuleList([GeluProjection(hidden, hidden * mult), nn.Identity(),
                                  nn.Linear(hidden * mult, hidden)])

    def forward(self, x: Tensor) -> Tensor:
        return self.net[2](F.gelu(self.net[0].proj(x), approximate="tanh"))


class FinalNorm(nn.Module):
    """AdaLN-continuous output norm: its `linear` gives (scale, shift), in that order (quirk F6)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, 2 * hidden)

    def forward(self, x: Tensor, temb_act: Tensor, samples: Samples) -> Tensor:
        scale, shift = self.linear(temb_act).chunk(2, dim=-1)                      # [B, D] each
        return modulate(layer_norm(x, NORM_EPS), shift, 1 + scale, samples)


def split_heads(x: Tensor, heads: int) -> Tensor:
    return x.unflatten(-1, (heads, -1))                                            # [N, H, d]


class JointAttention(nn.Module):
    """Projections of both streams, per-head QK RMSNorm, RoPE, one attention per joint sequence.

    Video: to_q/to_k/to_v -> to_out.0; caption: add_q/k/v_proj -> to_add_out (absent when the block
    is `context_pre_only`: the caption outputs of the last MMDiT block are never used).
    """
    CONTEXT_NORMS: ClassVar[tuple[str, str]] = ("norm_added_q", "norm_added_k")  # MMDiT: norm_add_q/k

    def __init__(self, hidden: int, heads: int, eps: float, context_out: bool = True):
        super().__init__()
        self.heads = heads
        head_dim = hidden // heads
        self.to_q, self.to_k, self.to_v = (nn.Linear(hidden, hidden) for _ in range(3))
        self.norm_q, self.norm_k = RMSNorm(head_dim, eps=eps), RMSNorm(head_dim, eps=eps)
        self.add_q_proj, self.add_k_proj, self.add_v_proj = (nn.Linear(hidden, hidden) for _ in range(3))
        for name in self.CONTEXT_NORMS:
            setattr(self, name, RMSNorm(head_dim, eps=eps))
        self.to_out = nn.ModuleList([nn.Linear(hidden, hidden)])
        if context_out:
            self.to_add_out = nn.Linear(hidden, hidden)
        self.inner_attention = InnerAttention()

    def forward(self, vid: Tensor, txt: Tensor, rope: Tensor, pack: PackInfo) -> tuple[Tensor, Tensor | None]:
        # vid [Nv, D], txt [Nt, D] (normalised and modulated); rope [L, d/2] complex, joint order
        norm_added_q, norm_added_k = (getattr(self, name) for name in self.CONTEXT_NORMS)
        q = to_joint(self.norm_q(split_heads(self.to_q(vid), self.heads)),
                     norm_added_q(split_heads(self.add_q_proj(txt), self.heads)), pack)      # [L, H, d]
        k = to_joint(self.norm_k(split_heads(self.to_k(vid), self.heads)),
                     norm_added_k(split_heads(self.add_k_proj(txt), self.heads)), pack)
        v = to_joint(split_heads(self.to_v(vid), self.heads), split_heads(self.add_v_proj(txt), self.heads),
                     pack)
        q, k = like_v(v, apply_rope(q, rope), apply_rope(k, rope))
        v_out, t_out = from_joint(self.inner_attention(q, k, v, pack.joint).flatten(1), pack)
        t_out = self.to_add_out(t_out) if hasattr(self, "to_add_out") else None
        return self.to_out[0](v_out), t_out


class JointBlock(nn.Module):
    """Double-stream (MMDiT) block: AdaLN-Zero on both streams from each sample's temb, joint attention,
    GELU feed-forwards. `context_pre_only` (the last MMDiT block): the caption stream is only read
    (AdaLN-continuous on it, no caption output or feed-forward)."""

    def __init__(self, hidden: int, heads: int, qk_eps: float, context_pre_only: bool = False,
                 attention: type[JointAttention] = JointAttention):
        super().__init__()
        self.context_pre_only = context_pre_only
        self.norm1 = Modulation(hidden, 6)
        self.norm1_context = Modulation(hidden, 2 if context_pre_only else 6)
        self.attn = attention(hidden, heads, qk_eps, context_out=not context_pre_only)
        self.ff = FeedForward(hidden)
        if not context_pre_only:
            self.ff_context = FeedForward(hidden)

    def forward(self, vid: Tensor, txt: Tensor, temb_act: Tensor, rope: Tensor, pack: PackInfo
                ) -> tuple[Tensor, Tensor | None]:
        # vid [Nv, D], txt [Nt, D], temb_act = SiLU(temb) [B, D]
        vs = Samples.of(lambda: pack.video_counts, pack.video_sample)
        ts = Samples.of(lambda: pack.text_counts, pack.text_sample)
        v_shift1, v_scale1, v_gate1, v_shift2, v_scale2, v_gate2 = adaln_vectors(
            self.norm1(temb_act), 6).chunk(6, dim=-1)                                      # [B, D]
        if self.context_pre_only:
            t_scale1, t_shift1 = self.norm1_context(temb_act).chunk(2, dim=-1)
            t_scale1 = 1 + t_scale1
        else:
            t_shift1, t_scale1, t_gate1, t_shift2, t_scale2, t_gate2 = adaln_vectors(
                self.norm1_context(temb_act), 6).chunk(6, dim=-1)

        v_attn, t_attn = self.attn(modulate(layer_norm(vid, NORM_EPS), v_shift1, v_scale1, vs),
                                   modulate(layer_norm(txt, NORM_EPS), t_shift1, t_scale1, ts), rope, pack)
        vid = gated_residual(vid, v_gate1, v_attn, vs)
        vid = gated_residual(vid, v_gate2, self.ff(modulate(layer_norm(vid, NORM_EPS), v_shift2, v_scale2, vs)),
                             vs)
        if self.context_pre_only:
            return vid, None
        txt = gated_residual(txt, t_gate1, t_attn, ts)
        txt = gated_residual(txt, t_gate2, self.ff_context(modulate(layer_norm(txt, NORM_EPS), t_shift2,
                                                                    t_scale2, ts)), ts)
        return vid, txt


def pyramid_init(model: nn.Module, zeroed: list[nn.Linear]) -> None:
    """The original's init: xavier-uniform linears with zero bias, N(0, 0.02) conditioning and caption
    embedders, unit norms; `zeroed` (AdaLN modulation and the output layer) start at 0."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            nn.init.xavier_uniform_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.RMSNorm):
            nn.init.ones_(module.weight)
    embed = model.time_text_embed
    for linear in (embed.timestep_embedder.linear_1, embed.timestep_embedder.linear_2,
                   embed.text_embedder.linear_1, embed.text_embedder.linear_2, model.context_embedder):
        nn.init.normal_(linear.weight, std=0.02)
    for linear in zeroed:
        nn.init.zeros_(linear.weight)
        nn.init.zeros_(linear.bias)


def hidden_linears(model: nn.Module, block_lists: tuple[str, ...]) -> dict[str, tuple[int, ...]]:
    """Attention and feed-forward weights of the blocks (not the modulation linears), each one matrix."""
    modulation = {m.linear for m in model.modules() if isinstance(m, Modulation)}
    out = {}
    for prefix in block_lists:
        for name, module in getattr(model, prefix).named_modules(prefix=prefix):
            if isinstance(module, nn.Linear) and module not in modulation:
                out[f"{name}.weight"] = (module.out_features,)
    return out


def joint_block_flops(hidden: int, nv: int, nt: int, b: int, attention: int, context_pre_only: bool) -> int:
    """Matmul FLOPs of one JointBlock (see `PyramidFluxTransformer.forward_flops`)."""
    d = hidden
    video = 2 * nv * (4 * d * d + 8 * d * d)                        # q, k, v, out + feed-forward (4x)
    text = 2 * nt * (3 * d * d) if context_pre_only else 2 * nt * (4 * d * d + 8 * d * d)
    modulation = 2 * b * d * (6 * d + (2 * d if context_pre_only else 6 * d))
    return video + text + modulation + attention


def attention_backend(model: nn.Module) -> str:
    """The backend of the model's attention calls (`set_attention_backend` sets them all alike)."""
    return next(m.backend for m in model.modules() if isinstance(m, InnerAttention))


def attention_flops(segments: AttnSegments, hidden: int, backend: str) -> int:
    """QK^T and AV of every joint sequence, summed over heads: 4 * D per (query, key) pair computed.

    All pairs under the full rule, and under the block-causal rule for `sdpa` (it evaluates the
    masked pairs too). Backends that skip masked blocks (`blockwise`, `varlen`, and `auto` until the
    trainer measures its choice: it runs blockwise there) compute only the allowed pairs; `flex` is
    counted the same, a lower bound (its tiles compute partly masked blocks whole). Segments asked by
    some rows only count their queries.
    """
    count = len(segments.seqlens)
    frames, groups = segments.frames or (None,) * count, segments.frame_groups or (None,) * count
    pairs = 0
    for n, asking, frame, group in zip(segments.seqlens, segments.query_lens or segments.seqlens, frames, groups):
        if frame is None or backend == "sdpa":
            pairs += asking * n
        else:   # a query of frame f sees the keys of frames <= f
            visible = torch.bincount(frame.cpu()).cumsum(0)
            pairs += int(visible[group.query_frames().cpu()].sum())
    return 4 * hidden * pairs


# ------------------------------------------------------------------------------------------------
# The frame both released models share around their blocks
# ------------------------------------------------------------------------------------------------

class PyramidDiT(nn.Module):
    """What both released DiTs do alike outside their blocks. A subclass sets `config` (its released
    keys), `time_text_embed`, `context_embedder`, `norm_out` and `proj_out`, and names its block
    lists, in forward order, in `BLOCK_LISTS`."""
    BLOCK_LISTS: ClassVar[tuple[str, ...]]

    @property
    def num_attention_heads(self) -> int:
        return self.config.num_attention_heads

    def sample_layout(self, grids, text_len: int) -> SampleLayout:
        """The layout this model trains on: clips oldest first (post-patch grids), last one trained."""
        return pyramid_sample_layout(grids, text_len, self.config.use_temporal_causal,
                                     self.config.interp_condition_pos)

    def conditioning(self, timesteps: Tensor, pooled: Tensor, pack: PackInfo) -> Tensor:
        """SiLU(temb) [B, D] of each sample, once the pack is checked against the config's rules."""
        check_layouts(pack, self.config.use_temporal_causal, self.config.interp_condition_pos)
        return F.silu(self.time_text_embed(timesteps, pooled))

    def output(self, vid: Tensor, temb_act: Tensor, pack: PackInfo, trained_only: bool = False) -> Tensor:
        """The video rows [Nv, D] (`trained_only`: the trained ones [n, D], stream order) through the
        AdaLN-continuous norm and the output projection."""
        return self.proj_out(self.norm_out(vid, temb_act, video_samples(pack, trained_only)))

    @torch.no_grad()
    def init_weights(self) -> None:
        """The original's init (zeroed AdaLN modulation and output: every block starts as the identity
        and the first prediction is 0)."""
        zeroed = [m.linear for m in self.modules() if isinstance(m, (Modulation, FinalNorm))]
        pyramid_init(self, zeroed + [self.proj_out])

    def fsdp_blocks(self) -> list[nn.Module]:
        """Transformer blocks in forward order: the FSDP, activation-checkpointing and compile units."""
        return [block for name in self.BLOCK_LISTS for block in getattr(self, name)]

    def checkpointed_blocks(self) -> list[nn.Module]:
        """Blocks the config's use_gradient_checkpointing / gradient_checkpointing_ratio select: the
        first ones of each block list (the original takes the MMDiT's last ones: quirk M5)."""
        if not self.config.use_gradient_checkpointing:
            return []
        ratio = self.config.gradient_checkpointing_ratio
        return [block for name in self.BLOCK_LISTS for block in first_blocks(getattr(self, name), ratio)]

    def hidden_matrices(self) -> dict[str, tuple[int, ...]]:
        """Hidden 2-D matrices (for Muon) -> row splits: q/k/v/out projections and feed-forward weights
        of every block (each its own matrix). Embedders, modulation linears, the output layer, norms and
        biases go to AdamW. The last MMDiT block's add_q_proj is listed although its output is never
        used (its gradient is 0), as in the original."""
        return hidden_linears(self, self.BLOCK_LISTS)

    def edge_flops(self, pack: PackInfo) -> int:
        """Matmul FLOPs outside the blocks: the timestep and pooled-text MLPs, the embedders and the
        output layer (a token is patch_size^2 x in_channels values for both models)."""
        c, d = self.config, self.config.hidden_size
        nv, nt, b = sum(pack.video_lens), sum(pack.text_lens), pack.num_samples
        token = c.in_channels * c.patch_size ** 2
        flops = 2 * b * (TIMESTEP_FEATURES * d + d * d + c.pooled_projection_dim * d + d * d)   # temb
        flops += 2 * nt * c.joint_attention_dim * d + 2 * nv * token * d                       # embedders
        return flops + 2 * b * d * 2 * d + 2 * nv * d * token                                  # output


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

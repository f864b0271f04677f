"""The layers both released Pyramid-Flow DiTs (`pan.models.pyramid_flux`, `pan.models.pyramid_mmdit`)
are built of, under the checkpoint's names: the timestep + pooled-text embedding, the AdaLN modulation
linears, the GELU feed-forward, the AdaLN-continuous output norm, the joint attention and the
double-stream block; and the FLOPs of a double-stream block and of the attention calls.

Shapes: B = samples, Nv / Nt = video / caption rows held by this process, L = Nv + Nt (joint order:
each sample's [video; caption] rows, samples in order), D = hidden size, H = heads, d = head dim.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pan.models.attention import InnerAttention
from pan.models.layers import Samples, adaln_vectors, from_joint, gated_residual, layer_norm, like_v, modulate, to_joint
from pan.models.norm import RMSNorm
from pan.models.packing import AttnSegments, PackInfo
from pan.models.rope import apply_rope

TIMESTEP_FEATURES = 256       # sinusoidal timestep features before the timestep MLP
NORM_EPS = 1e-6               # every LayerNorm of both released models


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

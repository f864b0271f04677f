"""Building blocks of `PanVideoDiffusionTransformer`; single-device code on packed token rows.

Shapes: Nv / Nt = video / text rows held by this process, L = Nv + Nt, B = samples,
D = hidden size, H = heads, d = head dim. Per-sample vectors ([B, D]) reach tokens through the
pack's per-sample token counts, so the same code runs on one context-parallel rank's share of the
tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pan.models.attention import InnerAttention
from pan.models.norm import RMSNorm
from pan.models.packing import PackInfo, permute_rows
from pan.models.rope import apply_rope


@dataclass(frozen=True)
class Samples:
    """Which sample each token row belongs to: `counts[i]` contiguous rows for sample i, and the
    same as a per-row index (`index[r]` = sample of row r).

    Per-sample vectors [B, D] reach the tokens through it. Eager: small samples by one gather of
    [B, D] to [N, D] by `index`, large ones sample by sample on views (there the expansion costs more
    than the loop: a copy of every modulation vector per token); the gradients' per-sample sums are
    always taken sample by sample. Under torch.compile: one gather by `index`, which the compiler
    fuses into the op; the counts (Python ints) are not even read, since a graph that depends on
    them would be recompiled for every new batch layout.
    """
    counts: tuple[int, ...]
    index: Tensor

    @classmethod
    def of(cls, counts_fn, index: Tensor) -> Samples:
        return cls(() if torch.compiler.is_compiling() else counts_fn(), index)


def _result_dtype(*tensors: Tensor) -> torch.dtype:
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


# Up to this many elements a sample, one gather of the per-sample rows costs less than a loop over
# the samples (CPU, 1 thread: 0.15-0.8x the loop's time at <= 16k elements a sample, 0.8-4x above:
# the gathered [N, D] operand is one more pass over memory); both give the same values.
GATHER_ELEMENTS_PER_SAMPLE = 16384


def _addcmul_by_sample(rows: Tensor, per_sample: Tensor, samples: Samples, base: Tensor | None = None,
                       base_per_sample: bool = False) -> Tensor:
    """base + rows * per_sample[s] over the rows of each sample s. `base`: None (no addend), token
    rows like `rows`, or (`base_per_sample`) one row per sample like `per_sample`. Small samples
    gather their per-sample rows; large ones are written sample by sample into one output
    (per-sample pieces joined by a copy would cost a copy per call, forward and backward)."""
    counts = samples.counts
    if rows.numel() <= GATHER_ELEMENTS_PER_SAMPLE * max(len(counts), 1):
        factor = per_sample.index_select(0, samples.index)
        if base is None:
            return rows * factor
        return torch.addcmul(base.index_select(0, samples.index) if base_per_sample else base, rows, factor)
    operands = (rows, per_sample) if base is None else (rows, per_sample, base)
    out = rows.new_empty(rows.shape, dtype=_result_dtype(*operands))
    bases = None if base is None or base_per_sample else base.split(counts)
    for i, (r, o) in enumerate(zip(rows.split(counts), out.split(counts))):
        if base is None:
            torch.mul(r, per_sample[i], out=o)
        else:
            torch.addcmul(base[i] if base_per_sample else bases[i], r, per_sample[i], out=o)
    return out


def _sums_by_sample(rows: Tensor, counts: tuple[int, ...], times: Tensor | None = None) -> Tensor:
    """[B, D]: each sample's rows (times `times`' rows) summed, sample by sample (one reduction per
    sample keeps the summation order whatever else is in the pack)."""
    return torch.stack([p.sum(0) for p in (rows if times is None else rows * times).split(counts)])


class _PerSampleModulate(torch.autograd.Function):
    """shift[s] + x * scale[s] over the rows of each sample s (`_addcmul_by_sample`)."""

    @staticmethod
    def forward(ctx, x: Tensor, shift: Tensor, scale: Tensor, samples: Samples) -> Tensor:
        ctx.samples = samples
        ctx.save_for_backward(x, scale)
        return _addcmul_by_sample(x, scale, samples, base=shift, base_per_sample=True)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, scale = ctx.saved_tensors
        need_x, need_shift, need_scale = ctx.needs_input_grad[:3]
        counts = ctx.samples.counts
        return (_addcmul_by_sample(grad, scale, ctx.samples) if need_x else None,
                _sums_by_sample(grad, counts) if need_shift else None,
                _sums_by_sample(grad, counts, times=x) if need_scale else None, None)


class _PerSampleGatedResidual(torch.autograd.Function):
    """x + gate[s] * y over the rows of each sample s (`_addcmul_by_sample`); x's gradient is the
    output's, passed on without a copy."""

    @staticmethod
    def forward(ctx, x: Tensor, gate: Tensor, y: Tensor, samples: Samples) -> Tensor:
        ctx.samples = samples
        ctx.save_for_backward(gate, y)
        return _addcmul_by_sample(y, gate, samples, base=x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        gate, y = ctx.saved_tensors
        need_x, need_gate, need_y = ctx.needs_input_grad[:3]
        return (grad if need_x else None,
                _sums_by_sample(grad, ctx.samples.counts, times=y) if need_gate else None,
                _addcmul_by_sample(grad, gate, ctx.samples) if need_y else None, None)


def modulate(x: Tensor, shift: Tensor, one_plus_scale: Tensor, samples: Samples | None = None) -> Tensor:
    """shift + x * scale with per-sample shift/scale rows [B, D] (or one row [1, D] for all tokens)."""
    if samples is None or shift.shape[0] == 1:
        return torch.addcmul(shift, x, one_plus_scale)
    if torch.compiler.is_compiling():
        return torch.addcmul(shift.index_select(0, samples.index), x,
                             one_plus_scale.index_select(0, samples.index))
    return _PerSampleModulate.apply(x, shift, one_plus_scale, samples)


def gated_residual(x: Tensor, gate: Tensor, y: Tensor, samples: Samples | None = None) -> Tensor:
    """x + gate * y with per-sample gate rows [B, D] (or [1, D]), as in `modulate`."""
    if samples is None or gate.shape[0] == 1:
        return torch.addcmul(x, gate, y)
    if torch.compiler.is_compiling():
        return torch.addcmul(x, gate.index_select(0, samples.index), y)
    return _PerSampleGatedResidual.apply(x, gate, y, samples)


def linear_of_cat(linear: nn.Module, a: Tensor, b: Tensor) -> Tensor:
    """linear(cat([a, b], -1)) for [N, *] rows without the concatenation: one GEMM per part with its
    columns of the weight (the [N, width] copy, and its backward's strided slices, cost ~3% of a
    Pyramid-Flow step on CPU). A wrapped linear (a peft LoRA layer) gets the concatenation."""
    if type(linear) is not nn.Linear:
        return linear(torch.cat([a, b], dim=-1))
    w_a, w_b = linear.weight.split([a.shape[-1], b.shape[-1]], dim=1)
    return torch.addmm(F.linear(b, w_b, linear.bias), a, w_a.t())


def layer_norm(x: Tensor, eps: float) -> Tensor:
    """LayerNorm without affine parameters (the modulation supplies scale and shift)."""
    return F.layer_norm(x, x.shape[-1:], eps=eps)


def adaln_vectors(mod: Tensor, n: int) -> Tensor:
    """Linear(SiLU(temb)) output [B, n*D] of (shift, scale, gate, ...) -> same with scale+1 (per sample)."""
    chunks = list(mod.chunk(n, dim=-1))
    for i in range(1, n, 3):  # scales sit at 1, 4: add 1 on [B, D], before expanding to tokens
        chunks[i] = chunks[i] + 1
    return torch.cat(chunks, dim=-1)


def to_joint(video_rows: Tensor, text_rows: Tensor, pack: PackInfo) -> Tensor:
    """Video rows [Nv, ...] and text rows [Nt, ...] -> joint order [L, ...] (one copy of each)."""
    out = video_rows.new_empty((video_rows.shape[0] + text_rows.shape[0], *video_rows.shape[1:]))
    out.index_copy_(0, pack.video_joint_rows, video_rows)   # backward: a gather per stream
    out.index_copy_(0, pack.text_joint_rows, text_rows)
    return out


def from_joint(rows: Tensor, pack: PackInfo) -> tuple[Tensor, Tensor]:
    """Joint order [L, ...] -> (video rows [Nv, ...], text rows [Nt, ...])."""
    stream = permute_rows(rows, pack.stream_to_joint, pack.joint_to_stream)
    return stream.split([pack.num_video_tokens, pack.num_text_tokens])


class TimestepEmbedder(nn.Module):
    """Timesteps in [0, 1000] -> sinusoidal features [B, freq_dim] -> MLP -> temb [B, D]."""

    def __init__(self, hidden_size: int, freq_dim: int):
        super().__init__()
        self.freq_dim = freq_dim
        self.fc1 = nn.Linear(freq_dim, hidden_size)
        self.fc2 = nn.Linear(hidden_size, hidden_size)

    def forward(self, t: Tensor) -> Tensor:
        half = self.freq_dim // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32)
                          / half)
        args = t.float()[:, None] * freqs[None]
        emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1).to(self.fc1.weight.dtype)
        return self.fc2(F.silu(self.fc1(emb)))


def like_v(v: Tensor, *qk: Tensor) -> tuple[Tensor, ...]:
    """q and k in v's dtype. Under CUDA autocast RMSNorm and RoPE run in fp32 while v comes from a
    bf16 matmul, and attention kernels (and the Ulysses all-to-all) need a single dtype."""
    return tuple(t.to(v.dtype) for t in qk)


class QKV(nn.Module):
    """One fused q/k/v projection plus per-head RMSNorm on q and k: [N, D] -> 3 x [N, H, d]."""

    def __init__(self, hidden_size: int, num_heads: int, eps: float, bias: bool):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size, bias=bias)
        self.q_norm = RMSNorm(hidden_size // num_heads, eps=eps)
        self.k_norm = RMSNorm(hidden_size // num_heads, eps=eps)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = self.qkv(x).unflatten(-1, (3, self.num_heads, -1)).unbind(-3)
        return self.q_norm(q), self.k_norm(k), v


class GeluMLP(nn.Module):
    """Linear -> GELU (tanh) -> Linear, with bias."""

    def __init__(self, hidden_size: int, inner_size: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden_size, inner_size)
        self.fc2 = nn.Linear(inner_size, hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class SwiGLU(nn.Module):
    """SiLU(x W1) * (x W3) -> W2, no bias; W1 and W3 are one fused matrix `w13` ([W1; W3])."""

    def __init__(self, hidden_size: int, inner_size: int):
        super().__init__()
        self.w13 = nn.Linear(hidden_size, 2 * inner_size, bias=False)
        self.w2 = nn.Linear(inner_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class RefinerBlock(nn.Module):
    """Caption self-attention block: pre-RMSNorm attention (QK RMSNorm, no bias, no RoPE) + SwiGLU."""

    def __init__(self, hidden_size: int, num_heads: int, mlp_ratio: float, eps: float):
        super().__init__()
        self.attn_norm = RMSNorm(hidden_size, eps=eps)
        self.attn_qkv = QKV(hidden_size, num_heads, eps, bias=False)
        self.attn_out = nn.Linear(hidden_size, hidden_size, bias=False)
        self.inner_attention = InnerAttention()
        self.ffn_norm = RMSNorm(hidden_size, eps=eps)
        self.ffn = SwiGLU(hidden_size, int(hidden_size * mlp_ratio))

    def forward(self, txt: Tensor, pack: PackInfo) -> Tensor:
        q, k, v = self.attn_qkv(self.attn_norm(txt))                      # [Nt, H, d]
        q, k = like_v(v, q, k)
        txt = txt + self.attn_out(self.inner_attention(q, k, v, pack.text).flatten(1))
        return txt + self.ffn(self.ffn_norm(txt))


class DoubleStreamBlock(nn.Module):
    """MMDiT block: separate video/text weights, one joint attention over [video_i; text_i].

    Video: AdaLN-Zero from temb (per sample). Text: a static learned modulation table (no timestep).
    """

    def __init__(self, hidden_size: int, num_heads: int, mlp_ratio: float, text_mlp_ratio: float,
                 eps: float):
        super().__init__()
        self.eps = eps
        self.video_mod = nn.Linear(hidden_size, 6 * hidden_size)
        self.text_mod = nn.Parameter(torch.empty(6, hidden_size))
        self.video_qkv = QKV(hidden_size, num_heads, eps, bias=True)
        self.text_qkv = QKV(hidden_size, num_heads, eps, bias=True)
        self.inner_attention = InnerAttention()
        self.video_out = nn.Linear(hidden_size, hidden_size)
        self.text_out = nn.Linear(hidden_size, hidden_size)
        self.video_mlp = GeluMLP(hidden_size, int(hidden_size * mlp_ratio))
        self.text_mlp = GeluMLP(hidden_size, int(hidden_size * text_mlp_ratio))

    def forward(self, vid: Tensor, txt: Tensor, temb_act: Tensor, rope: Tensor, pack: PackInfo
                ) -> tuple[Tensor, Tensor]:
        # vid [Nv, D], txt [Nt, D], temb_act = SiLU(temb) [B, D], rope [Nv, d/2] complex
        samples = Samples.of(lambda: pack.video_counts, pack.video_sample)
        v_shift1, v_scale1, v_gate1, v_shift2, v_scale2, v_gate2 = adaln_vectors(
            self.video_mod(temb_act), 6).chunk(6, dim=-1)                                   # [B, D]
        t_shift1, t_scale1, t_gate1, t_shift2, t_scale2, t_gate2 = adaln_vectors(
            self.text_mod.reshape(1, -1), 6).chunk(6, dim=-1)                               # [1, D]

        vq, vk, vv = self.video_qkv(modulate(layer_norm(vid, self.eps), v_shift1, v_scale1, samples))
        tq, tk, tv = self.text_qkv(modulate(layer_norm(txt, self.eps), t_shift1, t_scale1))
        vq, vk = apply_rope(vq, rope), apply_rope(vk, rope)
        vq, vk, tq, tk = like_v(vv, vq, vk, tq, tk)
        out = self.inner_attention(to_joint(vq, tq, pack), to_joint(vk, tk, pack), to_joint(vv, tv, pack),
                                   pack.joint)                                            # [L, H, d]
        v_attn, t_attn = from_joint(out.flatten(1), pack)
        vid = gated_residual(vid, v_gate1, self.video_out(v_attn), samples)
        txt = torch.addcmul(txt, t_gate1, self.text_out(t_attn))

        vid = gated_residual(vid, v_gate2, self.video_mlp(modulate(layer_norm(vid, self.eps), v_shift2, v_scale2,
                                                                   samples)), samples)
        txt = torch.addcmul(txt, t_gate2, self.text_mlp(modulate(layer_norm(txt, self.eps), t_shift2, t_scale2)))
        return vid, txt


class SingleStreamBlock(nn.Module):
    """HunyuanVideo-style single block over both streams with shared weights, modulated by temb.

    One Linear produces q, k, v and the MLP input; one Linear maps [attention; GELU(mlp)] back.
    """

    def __init__(self, hidden_size: int, num_heads: int, mlp_ratio: float, eps: float):
        super().__init__()
        self.eps = eps
        self.num_heads = num_heads
        self.mlp_size = int(hidden_size * mlp_ratio)
        self.mod = nn.Linear(hidden_size, 3 * hidden_size)
        self.linear1 = nn.Linear(hidden_size, 3 * hidden_size + self.mlp_size)
        self.q_norm = RMSNorm(hidden_size // num_heads, eps=eps)
        self.k_norm = RMSNorm(hidden_size // num_heads, eps=eps)
        self.inner_attention = InnerAttention()
        self.linear2 = nn.Linear(hidden_size + self.mlp_size, hidden_size)

    def forward(self, x: Tensor, temb_act: Tensor, rope: Tensor, pack: PackInfo) -> Tensor:
        # x [L, D] in stream order: the Nv video rows, then the Nt text rows
        nv = pack.num_video_tokens
        mod = adaln_vectors(self.mod(temb_act), 3)                        # [B, 3D]
        # stream order: every sample's video rows, then every sample's text rows
        samples = Samples.of(lambda: pack.video_counts + pack.text_counts,
                             torch.cat([pack.video_sample, pack.text_sample + mod.shape[0]]))
        shift, scale, gate = torch.cat([mod, mod]).chunk(3, dim=-1)        # [2B, D]
        qkv, mlp = self.linear1(modulate(layer_norm(x, self.eps), shift, scale, samples)).split(
            [x.shape[-1] * 3, self.mlp_size], dim=-1)
        q, k, v = qkv.unflatten(-1, (3, self.num_heads, -1)).unbind(-3)   # [L, H, d]
        q, k = self.q_norm(q), self.k_norm(k)
        q = torch.cat([apply_rope(q[:nv], rope), q[nv:]])
        k = torch.cat([apply_rope(k[:nv], rope), k[nv:]])
        q, k = like_v(v, q, k)
        joint = [permute_rows(t, pack.joint_to_stream, pack.stream_to_joint) for t in (q, k, v)]
        attn = permute_rows(self.inner_attention(*joint, pack.joint).flatten(1),
                                  pack.stream_to_joint, pack.joint_to_stream)       # [L, D] stream order
        out = linear_of_cat(self.linear2, attn, F.gelu(mlp, approximate="tanh"))
        return gated_residual(x, gate, out, samples)


class FinalLayer(nn.Module):
    """AdaLN-continuous (scale, shift from temb; LayerNorm without affine) then Linear to patch values."""

    def __init__(self, hidden_size: int, out_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.mod = nn.Linear(hidden_size, 2 * hidden_size)
        self.proj = nn.Linear(hidden_size, out_size)

    def forward(self, vid: Tensor, temb_act: Tensor, pack: PackInfo) -> Tensor:
        scale, shift = self.mod(temb_act).chunk(2, dim=-1)               # [B, D] each
        return self.proj(modulate(layer_norm(vid, self.eps), shift, 1 + scale,
                                  Samples.of(lambda: pack.video_counts, pack.video_sample)))

"""WanTransformer: the Wan 2.1 / 2.2 video DiT (diffusers' `WanTransformer3DModel`) on pan's packed batches.

One model covers every released variant, told apart by config.json alone: T2V (2.1 1.3B/14B, 2.2
A14B's two experts), I2V / FLF2V 2.1 (CLIP image features through `image_dim` and added k/v
projections; FLF2V adds a learnt position table over its two images) and 2.2 TI2V 5B (per-token
timesteps). Architecture: a patch embedding (a Conv3d with kernel = stride = patch); a timestep MLP
whose projection gives each block 6 modulation vectors, added to the block's own learnt table; a text
projection (umT5 features) and, for I2V, an image projection. Each block: modulated LayerNorm ->
self-attention over the sample's video tokens (RMSNorm of q and k across heads, 3-D RoPE) -> gated
residual; optional affine LayerNorm -> cross-attention to the sample's text (and image: its own k/v
projections, the two outputs summed) -> residual; modulated LayerNorm -> GELU MLP -> gated residual.
Output: LayerNorm modulated by the timestep embedding and a table, then a Linear to patch values.

Inputs are packed: the video tokens of all samples (pan's `patchify` order, grids may differ) in one
[Nv, C] tensor, the text rows of all samples in one [Nt, text_dim] tensor, and a `PackInfo` with the
grids and text lengths. Attention never crosses samples. Parameter names are the diffusers folder's
keys, so loading and writing a folder (pan/recipes/wan/weights.py) is the identity on the state dict.

Numerics. Wan computes its LayerNorms, the modulation and the residual stream in fp32 around bf16
matmuls (its own code under fp32 autocast; diffusers with FP32LayerNorm and `.float()` casts, then
casting the stream back to the weights' dtype). Here they run in fp32 *at least* (`_up`) and the
residual stream stays so: the same as diffusers in fp32; a float64 model stays float64 (diffusers'
`.float()` rounds a float64 model to fp32 at every block); under bf16 autocast (how pan runs bf16
weights) the stream stays fp32, as in Wan's own code, where a bf16 diffusers model keeps it in bf16.
The sinusoidal timestep frequencies and the RoPE rotations are fp32 values in every dtype, as in
diffusers. A caption's zero padding rows are embedded and projected once and attended to as one key
weighted by their count (`distinct_text_rows`): the same values, other summation orders.

Shapes: B samples, Nv / Nt / Ni video / text / image rows, G modulation groups (samples, or runs of
equal per-token timesteps), D = heads x head_dim, H heads, d head dim, p = patch volume.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake

from pan.config.core import ConfigError, knob
from pan.models.attention import AttentionBackend, InnerAttention, set_attention_backend
from pan.models.layers import Samples, gated_residual, like_v, modulate
from pan.models.norm import RMSNorm
from pan.models.packing import AttnSegments, PackInfo, patchify, unpatchify
from pan.models.rope import apply_rope, rope_frequencies
from pan.recipes.wan.cross_attention import InnerCrossAttention, cross_segments

ROPE_THETA = 10000.0
QK_NORM = "rms_norm_across_heads"   # the only one diffusers' Wan implements (it ignores the key)


@dataclass(kw_only=True)
class WanConfig:
    """The keys of a `WanTransformer3DModel` config.json, same names and meaning; defaults are
    diffusers' constructor's (a key missing from the file takes its default, as diffusers does)."""
    patch_size: list[int] = knob([1, 2, 2], "patch (t, h, w) in latent voxels", length=3, ge=1)
    num_attention_heads: int = knob(40, "attention heads", ge=1)
    attention_head_dim: int = knob(128, "head dim; width D = heads x head dim", ge=2)
    in_channels: int = knob(16, "input channels per latent voxel (I2V: noisy + 4 mask + condition)", ge=1)
    out_channels: int | None = knob(16, "output channels per latent voxel (null: in_channels)", ge=1)
    text_dim: int = knob(4096, "width of the text encoder features (umT5)", ge=1)
    freq_dim: int = knob(256, "sinusoidal timestep features", ge=1)
    ffn_dim: int = knob(13824, "MLP inner width", ge=1)
    num_layers: int = knob(40, "transformer blocks", ge=1)
    cross_attn_norm: bool = knob(True, "affine LayerNorm before each cross-attention")
    qk_norm: str | None = knob(QK_NORM, f"must be {QK_NORM!r}: RMSNorm of q and k across heads")
    eps: float = knob(1e-6, "epsilon of the blocks' norms", gt=0)
    image_dim: int | None = knob(None, "width of the image features (CLIP; I2V / FLF2V), null without", ge=1)
    added_kv_proj_dim: int | None = knob(None, "input width of the image k/v projections (= D), null without",
                                         ge=1)
    rope_max_seq_len: int = knob(1024, "RoPE positions per axis (a longer grid is refused)", ge=1)
    pos_embed_seq_len: int | None = knob(None, "image rows per sample with a learnt position table (FLF2V: "
                                               "2 x 257), null without", ge=1)

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def patch_volume(self) -> int:
        return math.prod(self.patch_size)

    @property
    def output_channels(self) -> int:
        return self.out_channels or self.in_channels

    @property
    def rope_axes_dim(self) -> list[int]:
        """Head dims rotated by the (t, h, w) positions: h and w get 2 * (d // 6) each, t the rest."""
        hw = 2 * (self.attention_head_dim // 6)
        return [self.attention_head_dim - 2 * hw, hw, hw]

    def check(self) -> None:
        if self.qk_norm != QK_NORM:
            raise ConfigError("qk_norm", f"is {self.qk_norm!r}; diffusers' Wan applies RMSNorm across heads to q "
                                         f"and k whatever this says, so pan accepts only {QK_NORM!r}.")
        if self.attention_head_dim % 2:
            raise ConfigError("attention_head_dim", f"{self.attention_head_dim} is odd: RoPE rotates pairs.")
        if (self.image_dim is None) != (self.added_kv_proj_dim is None):
            raise ConfigError("added_kv_proj_dim", f"image_dim is {self.image_dim} and added_kv_proj_dim "
                                                   f"{self.added_kv_proj_dim}: an I2V model sets both, T2V neither.")
        if self.added_kv_proj_dim not in (None, self.inner_dim):
            raise ConfigError("added_kv_proj_dim", f"{self.added_kv_proj_dim} must equal the width heads x head "
                                                   f"dim = {self.inner_dim}: it projects the embedded image rows.")
        if self.pos_embed_seq_len is not None and self.image_dim is None:
            raise ConfigError("pos_embed_seq_len", "is set without image_dim: it positions image rows.")


def _up(x: Tensor) -> Tensor:
    """x in fp32 at least (Wan's norms, modulation and residual stream); float64 stays float64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _layer_norm(x: Tensor, eps: float, norm: nn.LayerNorm | None = None) -> Tensor:
    """LayerNorm over the last dim in fp32 at least (affine with `norm`'s parameters when given)."""
    weight, bias = (None, None) if norm is None else (_up(norm.weight), _up(norm.bias))
    return F.layer_norm(_up(x), x.shape[-1:], weight, bias, eps)


def timestep_features(t: Tensor, dim: int) -> Tensor:
    """[G] timesteps (0..1000) -> [G, dim]: cos then sin of t * 10000^(-k / (dim // 2)), k < dim // 2,
    zero-padded to an odd dim. Frequencies in fp32 (diffusers' `Timesteps`); t in fp32 at least."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = _up(t)[:, None] * freqs
    return F.pad(torch.cat([torch.cos(args), torch.sin(args)], dim=-1), (0, dim % 2))


@dataclass(frozen=True)
class TextRows:
    """Where the caption rows' distinct rows go (`distinct_text_rows`): the caption rows of every sample
    (`index`), and each sample's keys of the cross-attention, its nonzero rows then the zero row once
    (`keys`, `key_lens`) with the log of how many of its rows each stands for (`key_bias`: 0, or the log
    of its zero rows' count)."""
    index: Tensor                  # [Nt]: the distinct row of each caption row
    keys: Tensor                   # [Nk]: the distinct row of each sample's keys, sample after sample
    key_lens: tuple[int, ...]      # each sample's keys
    key_bias: Tensor               # [Nk] float64


def distinct_text_rows(text: Tensor, text_lens: Sequence[int]) -> tuple[Tensor, TextRows | None]:
    """Caption rows [Nt, text_dim] (`text_lens` a sample) as (their nonzero rows, then one zero row:
    [Nu, text_dim]; where each caption row and each sample's keys are among them), or (text, None) when
    no row is zero.

    Captions come zero-padded to 512 rows (WanPipeline's padding, the task's `padded`), most of them
    padding. Everything the text goes through before attention (the text projection, each block's
    to_k / to_v and norm_k) works row by row, so a zero row gives the same k and v in every sample:
    computed once, and exactly (a Linear of a zero row is its bias, to the bit). In the cross-attention
    the m equal keys of a sample's padding are one key with log(m) added to its scores, which is their
    attention exactly (m e^s = e^(s + log m)); only sums are taken in another order. At the benchmark's
    captions (32..128 real rows of 512) this saves ~80% of the text-side matmuls and of the
    cross-attention's scores. Costs a host sync (the counts). Rows without values (fake or meta
    tensors: pan's estimates trace the model on them; a traced graph) are taken as they are.
    """
    if text.device.type == "meta" or is_fake(text) or torch.compiler.is_compiling():
        return text, None
    nonzero = text.ne(0).any(dim=1)                                                        # [Nt]
    real = torch.stack([part.sum() for part in nonzero.split(list(text_lens))]).tolist() if text_lens else []
    total = sum(real)
    if total == text.shape[0]:
        return text, None
    rows = torch.cat([text[nonzero], text.new_zeros(1, text.shape[1])])                   # [total + 1, text_dim]
    index = torch.where(nonzero, nonzero.cumsum(0) - 1, total)                             # zero rows -> the last
    keys, bias, starts = [], [], [0, *itertools.accumulate(real)]
    for start, n, length in zip(starts, real, text_lens):
        keys += [*range(start, start + n), *([total] if length > n else [])]
        bias += [0.0] * n + ([math.log(length - n)] if length > n else [])
    key_lens = tuple(n + (length > n) for n, length in zip(real, text_lens))
    return rows, TextRows(index, torch.tensor(keys, device=text.device), key_lens,
                          torch.tensor(bias, dtype=torch.float64, device=text.device))


def _rows(x: Tensor, rows: TextRows | None) -> Tensor:
    """x's rows in caption order: the distinct text rows gathered back (`distinct_text_rows`)."""
    return x if rows is None else x.index_select(0, rows.index)


def _equal_group_rows(groups: Samples) -> int | None:
    """The rows of each modulation group when there are several and all have as many (a batch of clips
    of one size), else None (also under torch.compile, where `modulate` gathers and the compiler fuses)."""
    counts = groups.counts
    return counts[0] if len(counts) > 1 and len(set(counts)) == 1 else None


def _modulate(x: Tensor, shift: Tensor, one_plus_scale: Tensor, groups: Samples) -> Tensor:
    """`modulate` (shift + x * scale per group [G, D]); groups of equal size broadcast over a [G, n, D]
    view, one op forward and one per gradient as in diffusers' [B, L, D] layout, where `modulate` takes
    the groups one by one (twice the ops at two groups, each a parallel region of its own)."""
    n = _equal_group_rows(groups)
    if n is None:
        return modulate(x, shift, one_plus_scale, groups)
    rows = x.reshape(shift.shape[0], n, x.shape[-1])
    return torch.addcmul(shift[:, None], rows, one_plus_scale[:, None]).view(x.shape)


def _gated_residual(x: Tensor, gate: Tensor, y: Tensor, groups: Samples) -> Tensor:
    """`gated_residual` (x + gate * y per group [G, D]), broadcast over equal groups as `_modulate`."""
    n = _equal_group_rows(groups)
    if n is None:
        return gated_residual(x, gate, y, groups)
    g, d = gate.shape
    return torch.addcmul(x.reshape(g, n, d), gate[:, None], y.reshape(g, n, d)).view(x.shape)


def _heads(x: Tensor, heads: int) -> Tensor:
    return x.unflatten(-1, (heads, -1))                                   # [N, D] -> [N, H, d]


# ------------------------------------------------------------------------------------------------
# Layers, named as the folder names their parameters
# ------------------------------------------------------------------------------------------------

class _Projection(nn.Module):
    """`net.0` of diffusers' FeedForward: its input Linear sits at `.proj`."""

    def __init__(self, dim: int, inner: int):
        super().__init__()
        self.proj = nn.Linear(dim, inner)


class FeedForward(nn.Module):
    """Linear -> GELU -> Linear, at `net.0.proj` and `net.2` (`net.1` is diffusers' dropout)."""

    def __init__(self, dim: int, inner: int, out: int, approximate: str):
        super().__init__()
        self.approximate = approximate
        self.net = nn.ModuleList([_Projection(dim, inner), nn.Identity(), nn.Linear(inner, out)])

    def forward(self, x: Tensor) -> Tensor:
        return self.net[2](F.gelu(self.net[0].proj(x), approximate=self.approximate))


class TwoLinears(nn.Module):
    """linear_1 -> activation -> linear_2: the timestep MLP (SiLU) and the text projection (GELU tanh)."""

    def __init__(self, dim_in: int, dim: int, activation):
        super().__init__()
        self.activation = activation
        self.linear_1 = nn.Linear(dim_in, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_2(self.activation(self.linear_1(x)))


class PatchEmbedding(nn.Module):
    """Conv3d with kernel = stride = patch, applied to patchified tokens: pan's patchify flattens a
    token as a conv kernel flattens (c, pt, ph, pw), so the conv is one Linear. The parameters keep
    the Conv3d's shapes ([D, C, pt, ph, pw], [D]): the folder's."""

    def __init__(self, in_channels: int, dim: int, patch: list[int]):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, in_channels, *patch))
        self.bias = nn.Parameter(torch.empty(dim))

    def forward(self, tokens: Tensor) -> Tensor:
        return F.linear(tokens, self.weight.flatten(1), self.bias)         # [Nv, C * p] -> [Nv, D]


class ImageEmbedder(nn.Module):
    """CLIP image rows -> D: (+ position table) -> LayerNorm -> GELU MLP -> LayerNorm (affine norms,
    eps 1e-5, in fp32 at least)."""

    def __init__(self, image_dim: int, dim: int, pos_embed_seq_len: int | None):
        super().__init__()
        self.norm1 = nn.LayerNorm(image_dim)
        self.ff = FeedForward(image_dim, image_dim, dim, approximate="none")
        self.norm2 = nn.LayerNorm(dim)
        self.pos_embed = None if pos_embed_seq_len is None else nn.Parameter(torch.empty(1, pos_embed_seq_len,
                                                                                         image_dim))

    def forward(self, image: Tensor) -> Tensor:
        # image [B, Li, image_dim] -> [B, Li, D]
        if self.pos_embed is not None:
            image = image + self.pos_embed
        h = self.ff(_layer_norm(image, self.norm1.eps, self.norm1).to(image.dtype))
        return _layer_norm(h, self.norm2.eps, self.norm2).to(h.dtype)


class ConditionEmbedder(nn.Module):
    """The timestep MLP and its projection to the blocks' modulation, the text and image projections."""

    def __init__(self, c: WanConfig):
        super().__init__()
        d = c.inner_dim
        self.freq_dim = c.freq_dim
        self.time_embedder = TwoLinears(c.freq_dim, d, F.silu)
        self.time_proj = nn.Linear(d, 6 * d)
        self.text_embedder = TwoLinears(c.text_dim, d, lambda x: F.gelu(x, approximate="tanh"))
        self.image_embedder = (None if c.image_dim is None
                               else ImageEmbedder(c.image_dim, d, c.pos_embed_seq_len))

    def text(self, text: Tensor, text_lens: Sequence[int]) -> tuple[Tensor, TextRows | None]:
        """[Nt, text_dim] caption rows -> (embedded distinct rows [Nu, D], where they go: None when every
        row is its own); see `distinct_text_rows`."""
        rows, where = distinct_text_rows(text, text_lens)
        return self.text_embedder(rows), where

    def time(self, t: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """[G] timesteps -> temb [G, D] (in `dtype`: the text's, as diffusers casts it) and the blocks'
        modulation projection [G, 6D]."""
        features = timestep_features(t, self.freq_dim).to(self.time_embedder.linear_1.weight.dtype)
        temb = self.time_embedder(features).to(dtype)
        return temb, self.time_proj(F.silu(temb))


class SelfAttention(nn.Module):
    """q/k/v of the video rows, RMSNorm of q and k across heads, RoPE, attention within each sample."""

    def __init__(self, dim: int, heads: int, eps: float):
        super().__init__()
        self.heads = heads
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim) for _ in range(3))
        self.to_out = nn.ModuleList([nn.Linear(dim, dim)])
        self.norm_q = RMSNorm(dim, eps=eps)
        self.norm_k = RMSNorm(dim, eps=eps)
        self.inner_attention = InnerAttention()

    def forward(self, x: Tensor, rope: Tensor, segments: AttnSegments) -> Tensor:
        # x [Nv, D] modulated, rope [Nv, d/2] complex -> [Nv, D]
        q = apply_rope(_heads(self.norm_q(self.to_q(x)), self.heads), rope)                   # [Nv, H, d]
        k = apply_rope(_heads(self.norm_k(self.to_k(x)), self.heads), rope)
        v = _heads(self.to_v(x), self.heads)
        q, k = like_v(v, q, k)
        return self.to_out[0](self.inner_attention(q, k, v, segments).flatten(1))


class CrossAttention(nn.Module):
    """Video queries of sample i against its text rows, plus (I2V) against its image rows through the
    added k/v projections; one query projection, the two attention outputs summed, one output Linear."""

    def __init__(self, dim: int, heads: int, eps: float, added_kv_proj_dim: int | None):
        super().__init__()
        self.heads = heads
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim) for _ in range(3))
        self.to_out = nn.ModuleList([nn.Linear(dim, dim)])
        self.norm_q = RMSNorm(dim, eps=eps)
        self.norm_k = RMSNorm(dim, eps=eps)
        if added_kv_proj_dim is not None:
            self.add_k_proj = nn.Linear(added_kv_proj_dim, dim)
            self.add_v_proj = nn.Linear(added_kv_proj_dim, dim)
            self.norm_added_k = RMSNorm(dim, eps=eps)
        self.cross_attention = InnerCrossAttention()

    def forward(self, x: Tensor, text: Tensor, plan: WanPlan, image: Tensor | None) -> Tensor:
        # x [Nv, D], text [Nu, D]: the distinct text rows (plan.text_rows) -> [Nv, D]
        q = _heads(self.norm_q(self.to_q(x)), self.heads)                                    # [Nv, H, d]
        k, v = self.norm_k(self.to_k(text)), self.to_v(text)                                  # [Nu, D]
        rows = plan.text_rows
        if rows is not None and self.cross_attention.takes_key_bias(q, plan.text):
            # each sample's distinct rows as keys, its zero rows' one key weighted by their count
            v = _heads(v.index_select(0, rows.keys), self.heads)                              # [Nk, H, d]
            qt, k = like_v(v, q, _heads(k.index_select(0, rows.keys), self.heads))
            out = self.cross_attention(qt, k, v, plan.text_keys, key_bias=rows.key_bias)
        else:
            v = _heads(_rows(v, rows), self.heads)                                            # [Nt, H, d]
            qt, k = like_v(v, q, _heads(_rows(k, rows), self.heads))
            out = self.cross_attention(qt, k, v, plan.text)
        if image is not None:
            v = _heads(self.add_v_proj(image), self.heads)                                    # [Ni, H, d]
            qi, k = like_v(v, q, _heads(self.norm_added_k(self.add_k_proj(image)), self.heads))
            out = out + self.cross_attention(qi, k, v, plan.image)
        return self.to_out[0](out.flatten(1))


@dataclass(frozen=True)
class WanPlan:
    """What every block of one forward shares: who attends to whom, and the modulation groups.

    Under Ulysses context parallel (`pack.cp_size > 1`) this process holds a strided share of each
    sample's video rows (`pack.video_index`): the self-attention's segments say so (`local_index`), and
    the Ulysses wrapper around `inner_attention` trades rows for heads. The text (and image) rows are
    whole on every rank, so the cross-attention needs no exchange: this rank's video rows of sample i
    (`pack.video_counts[i]` of them) attend to all of sample i's text rows, locally.
    """
    video: AttnSegments          # self-attention: each sample's video rows
    text: AttnSegments           # this rank's video rows of sample i -> text rows of sample i
    image: AttnSegments | None   # this rank's video rows of sample i -> image rows of sample i (I2V)
    groups: Samples              # modulation group of each video row (contiguous runs)
    text_rows: TextRows | None = None   # where the distinct text rows go (`distinct_text_rows`)
    text_keys: AttnSegments | None = None   # with text_rows: this rank's video rows -> the sample's keys

    @classmethod
    def of(cls, pack: PackInfo, image_rows: int | None, device, groups: Samples,
           text_rows: TextRows | None = None) -> WanPlan:
        video = AttnSegments.from_lengths(pack.video_lens, device)
        if pack.cp_size > 1:
            video = dataclasses.replace(video, local_index=pack.video_index)
        queries = pack.video_counts
        image = None if image_rows is None else cross_segments(queries, [image_rows] * pack.num_samples, device)
        # built here, not in the (maybe compiled) blocks: their lengths change with every batch
        keys = None if text_rows is None else cross_segments(queries, text_rows.key_lens, device)
        return cls(video=video, text=cross_segments(queries, pack.text_lens, device), image=image, groups=groups,
                   text_rows=text_rows, text_keys=keys)


class WanBlock(nn.Module):
    """Self-attention, cross-attention and MLP; the first and last modulated (shift, scale, gate) by the
    timestep per group of rows, the cross-attention unmodulated and ungated."""

    def __init__(self, c: WanConfig):
        super().__init__()
        d = c.inner_dim
        self.eps = c.eps
        self.attn1 = SelfAttention(d, c.num_attention_heads, c.eps)
        self.attn2 = CrossAttention(d, c.num_attention_heads, c.eps, c.added_kv_proj_dim)
        self.norm2 = nn.LayerNorm(d, eps=c.eps) if c.cross_attn_norm else None
        self.ffn = FeedForward(d, c.ffn_dim, d, approximate="tanh")
        self.scale_shift_table = nn.Parameter(torch.empty(1, 6, d))

    def forward(self, vid: Tensor, proj: Tensor, rope: Tensor, text: Tensor, image: Tensor | None,
                plan: WanPlan) -> Tensor:
        # vid [Nv, D] (fp32 at least), proj [G, 6D] -> [Nv, D]
        mod = self.scale_shift_table + _up(proj).unflatten(-1, (6, -1))                       # [G, 6, D]
        shift1, scale1, gate1, shift2, scale2, gate2 = mod.unbind(1)                           # [G, D] each
        g = plan.groups
        h = _modulate(_layer_norm(vid, self.eps), shift1, 1 + scale1, g)
        vid = _gated_residual(vid, gate1, self.attn1(h, rope, plan.video), g)
        h = vid if self.norm2 is None else _layer_norm(vid, self.eps, self.norm2)
        vid = vid + self.attn2(h, text, plan, image)
        h = _modulate(_layer_norm(vid, self.eps), shift2, 1 + scale2, g)
        return _gated_residual(vid, gate2, self.ffn(h), g)


# ------------------------------------------------------------------------------------------------
# The model
# ------------------------------------------------------------------------------------------------

def timestep_groups(timesteps: Tensor, pack: PackInfo) -> tuple[Tensor, Samples]:
    """The modulation groups of the video rows: (their timesteps [G], the group of each row).

    Per-sample timesteps [B]: the samples. Per-token timesteps [Nv] (Wan 2.2 TI2V: a sample's first
    frame at 0, the rest at t): runs of equal consecutive values, so the timestep MLP and the [G, 6D]
    modulation are computed once per run rather than once per token (what diffusers does), and the
    per-row work reads them through `Samples` like per-sample vectors.
    """
    b, nv = pack.num_samples, pack.num_video_tokens
    if timesteps.dim() != 1 or timesteps.shape[0] not in (b, nv):
        raise ValueError(f"timesteps {tuple(timesteps.shape)}: give one per sample [{b}] or one per video "
                         f"token [{nv}].")
    if timesteps.shape[0] == b:   # (also when b == nv: then every sample is one token, the same thing)
        return timesteps, Samples.of(lambda: pack.video_counts, pack.video_sample)
    values, counts = torch.unique_consecutive(timesteps, return_counts=True)
    index = torch.repeat_interleave(torch.arange(values.shape[0], device=timesteps.device), counts)
    return values, Samples.of(lambda: tuple(counts.tolist()), index)


class WanTransformer(nn.Module):
    """Wan 2.1 / 2.2 transformer on packed video tokens; see the module docstring.

    Build on the meta device, parallelize from outside, then `to_empty` and `init_weights()`; or load
    a diffusers folder with `pan.recipes.wan.weights.load_transformer`.
    """

    def __init__(self, config: WanConfig, attention_backend: AttentionBackend = "auto"):
        super().__init__()
        config.check()
        self.config = config
        c, d = config, config.inner_dim
        self.patch_embedding = PatchEmbedding(c.in_channels, d, c.patch_size)
        self.condition_embedder = ConditionEmbedder(c)
        self.blocks = nn.ModuleList(WanBlock(c) for _ in range(c.num_layers))
        self.proj_out = nn.Linear(d, c.output_channels * c.patch_volume)
        self.scale_shift_table = nn.Parameter(torch.empty(1, 2, d))
        set_attention_backend(self, attention_backend)
        if self.scale_shift_table.device.type != "meta":
            self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Wan's init for training from scratch: xavier-uniform Linears (the patch embedding as the
        [D, C * p] matrix it is) with zero biases, N(0, 0.02) timestep MLP and text projection, a zero
        output Linear, modulation tables N(0, 1/D), unit norms and a zero image position table."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
            elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
                nn.init.ones_(module.weight)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
        nn.init.xavier_uniform_(self.patch_embedding.weight.view(self.patch_embedding.weight.shape[0], -1))
        nn.init.zeros_(self.patch_embedding.bias)
        embedder = self.condition_embedder
        for linear in (embedder.time_embedder.linear_1, embedder.time_embedder.linear_2,
                       embedder.text_embedder.linear_1, embedder.text_embedder.linear_2):
            nn.init.normal_(linear.weight, std=0.02)
        if embedder.image_embedder is not None and embedder.image_embedder.pos_embed is not None:
            nn.init.zeros_(embedder.image_embedder.pos_embed)
        nn.init.zeros_(self.proj_out.weight)
        d = self.config.inner_dim
        for table in [self.scale_shift_table] + [block.scale_shift_table for block in self.blocks]:
            nn.init.normal_(table, std=d ** -0.5)

    def fsdp_blocks(self) -> list[nn.Module]:
        """The transformer blocks, in forward order (the units of FSDP, activation checkpointing, compile)."""
        return list(self.blocks)

    def forward_flops(self, pack: PackInfo, image_rows: int = 0) -> int:
        """Matmul and attention FLOPs of one forward over a pack, as this process runs it (a training
        step: 3x this): the whole pack, or a context-parallel rank's share of it.

        Linears cost 2 x rows x in x out; attention 4 x D x queries x keys per sample (QK^T and AV over
        all heads; under cp a rank attends whole sequences for 1/cp of the heads, and its own video rows
        to the whole text). The text (and image) rows are projected on every cp rank. The timestep MLP
        and modulation are counted once per sample (per-token TI2V timesteps add a group or two); norms,
        RoPE and elementwise work are not counted. `image_rows`: CLIP rows per sample (I2V). Every text
        row counts as given: the zero rows a caption is padded with cost less (`distinct_text_rows`), so
        on padded captions this is more than is computed."""
        c, d = self.config, self.config.inner_dim
        nv, nt, b = pack.num_video_tokens, sum(pack.text_lens), pack.num_samples
        ni = image_rows * b
        flops = 2 * nv * c.in_channels * c.patch_volume * d                           # patch embedding
        flops += 2 * b * (c.freq_dim * d + d * d + d * 6 * d)                         # timestep MLP, projection
        flops += 2 * nt * (c.text_dim * d + d * d)                                     # text projection
        if c.image_dim is not None and ni:
            flops += 2 * ni * (c.image_dim * c.image_dim + c.image_dim * d)            # image projection
        self_attn = 4 * d * sum(n * n for n in pack.video_lens) // pack.cp_size
        cross = 4 * d * sum(v * t for v, t in zip(pack.video_counts, pack.text_lens))
        block = (2 * nv * 4 * d * d + self_attn                                        # self-attention
                 + 2 * nv * 2 * d * d + 2 * nt * 2 * d * d + cross                     # cross-attention (text)
                 + 2 * nv * 2 * d * c.ffn_dim)                                         # MLP
        if c.added_kv_proj_dim is not None and ni:
            block += 2 * ni * 2 * d * d + 4 * d * image_rows * nv                      # cross-attention (image)
        return flops + c.num_layers * block + 2 * nv * d * c.output_channels * c.patch_volume

    def forward(self, x: Tensor, timesteps: Tensor, text: Tensor, pack: PackInfo,
                image: Tensor | None = None) -> Tensor:
        """x [Nv, in_channels * p] (pan's patchify order; under cp this rank's rows, `pack.video_index`),
        timesteps [B] or per token [Nv] on Wan's 0..1000 scale (1000 x sigma, what diffusers' model
        takes), text [Nt, text_dim] (each sample's `pack.text_lens` rows, whole on every cp rank), image
        [B, Li, image_dim] (I2V: each sample's CLIP rows; FLF2V: its two images' rows, Li =
        pos_embed_seq_len) -> [Nv, out_channels * p] in pan's patchify order."""
        self._check_inputs(x, text, pack, image)
        t, groups = timestep_groups(timesteps, pack)
        temb, proj = self.condition_embedder.time(t, text.dtype)                             # [G, D], [G, 6D]
        text, text_rows = self.condition_embedder.text(text, pack.text_lens)                 # [Nu, D]
        plan = WanPlan.of(pack, None if image is None else image.shape[1], x.device, groups, text_rows)
        if image is not None:
            image = self.condition_embedder.image_embedder(image).flatten(0, 1)               # [Ni, D]
        rope = rope_frequencies(pack.video_pos, self.config.rope_axes_dim, ROPE_THETA, 1.0)   # [Nv, d/2]
        vid = _up(self.patch_embedding(x))                          # [Nv, D]: the residual stream, fp32+
        for block in self.blocks:
            vid = block(vid, proj, rope, text, image, plan)
        shift, scale = (self.scale_shift_table + temb.unsqueeze(1)).unbind(1)                 # [G, D] each
        out = self.proj_out(_modulate(_layer_norm(vid, self.config.eps), shift, 1 + scale, groups))  # [Nv, p * C]
        # proj_out's rows are (pt, ph, pw, c) per token; pan's patchify order is (c, pt, ph, pw)
        return out.unflatten(-1, (self.config.patch_volume, -1)).transpose(1, 2).flatten(1)

    def _check_inputs(self, x: Tensor, text: Tensor, pack: PackInfo, image: Tensor | None) -> None:
        c = self.config
        if x.shape != (pack.num_video_tokens, c.in_channels * c.patch_volume):
            raise ValueError(f"video tokens {tuple(x.shape)}, expected [{pack.num_video_tokens}, "
                             f"{c.in_channels * c.patch_volume}] (in_channels x patch volume).")
        text_rows = sum(pack.text_lens)   # whole on every cp rank (WanPlan)
        if text.shape != (text_rows, c.text_dim):
            raise ValueError(f"text rows {tuple(text.shape)}, expected [{text_rows}, {c.text_dim}] (every "
                             "sample's rows, also on a context-parallel rank).")
        for layout in pack.layouts:
            if layout.attention != "full":
                raise ValueError(f"Wan attends fully within a sample; got the {layout.attention!r} rule.")
            extent = max(max(clip.frame_offset + clip.grid[0], *(clip.ref_hw or clip.grid[1:]))
                         for clip in layout.clips)
            if extent > c.rope_max_seq_len:
                raise ValueError(f"a grid reaches position {extent - 1} on some axis; the model's RoPE covers "
                                 f"rope_max_seq_len = {c.rope_max_seq_len} positions per axis.")
        if (image is None) != (c.image_dim is None):
            raise ValueError("this model takes image rows (image_dim is set): pass `image`." if image is None
                             else "this model has no image input (image_dim is null).")
        if image is not None:
            rows = c.pos_embed_seq_len or image.shape[1]
            if image.shape != (pack.num_samples, rows, c.image_dim):
                raise ValueError(f"image rows {tuple(image.shape)}, expected [{pack.num_samples}, {rows}, "
                                 f"{c.image_dim}] (samples, rows per sample, image_dim).")

    def forward_dense(self, hidden_states: Tensor, timestep: Tensor, encoder_hidden_states: Tensor,
                      encoder_hidden_states_image: Tensor | None = None) -> Tensor:
        """diffusers' call: latents [B, C, F, H, W] of one size, timestep [B] or per token [B, L] (TI2V),
        text [B, Lt, text_dim], image [B, Li, image_dim] (FLF2V: [2B, Li / 2, image_dim], the two
        images of a sample consecutive) -> [B, out_channels, F, H, W]. Packs, runs, unpacks."""
        c = self.config
        b, _, frames, height, width = hidden_states.shape
        pt, ph, pw = c.patch_size
        grid = (frames // pt, height // ph, width // pw)
        tokens = torch.cat([patchify(latent, c.patch_size) for latent in hidden_states])
        pack = PackInfo.build([grid] * b, [encoder_hidden_states.shape[1]] * b, device=hidden_states.device)
        image = encoder_hidden_states_image
        if image is not None and c.pos_embed_seq_len is not None:
            image = image.reshape(b, -1, image.shape[-1])
        out = self(tokens, timestep.flatten(), encoder_hidden_states.flatten(0, 1), pack, image)
        return torch.stack([unpatchify(o, grid, c.patch_size) for o in out.split(pack.video_lens)])

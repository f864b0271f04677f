"""Packed batches: per-batch bookkeeping for variable-length video + caption sequences.

A packed batch concatenates samples along one token axis, with no padding. The model sees two
streams, `[all video tokens]` and `[all text tokens]` (sample after sample), while attention runs over
the joint sequences `[video_0; text_0][video_1; text_1]...`. `PackInfo` holds everything derived
once per batch: sample index per token, RoPE grid positions, the rows of each stream inside the joint
order, and the attention segments.

Context parallel (Ulysses) shards the joint order with a stride: cp rank r of N holds joint tokens
j with j % N == r. `PackInfo.shard(r, N)` describes that subset; per-token work (linears, norms, RoPE,
modulation by sample index) runs on it unchanged, and only `inner_attention` needs the other ranks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from itertools import accumulate

import torch
from torch import Tensor


@dataclass(frozen=True)
class AttnSegments:
    """The full sequences one attention call covers, and which of their rows this process holds.

    q/k/v given to an attention call are `[L_local, heads, head_dim]`; row i is row `local_index[i]`
    of the full packed sequence (all segments back to back). Without context parallel
    `local_index` is None: the process holds every row, in order.
    """
    seqlens: tuple[int, ...]        # full length of each segment
    cu_seqlens: Tensor              # [S + 1] int32 offsets of the full segments
    max_seqlen: int
    local_index: Tensor | None = None  # [L_local] int64 rows held here (strictly increasing)
    # Seam for masked attention (e.g. block-causal): one bool [Ls, Ls] per segment, True = attend.
    masks: tuple[Tensor | None, ...] | None = None

    @classmethod
    def from_lengths(cls, seqlens: list[int] | tuple[int, ...], device=None) -> AttnSegments:
        offsets = [0, *accumulate(seqlens)]
        return cls(tuple(seqlens), torch.tensor(offsets, dtype=torch.int32, device=device),
                   max(seqlens, default=0))

    @property
    def total(self) -> int:
        return sum(self.seqlens)

    @property
    def is_sharded(self) -> bool:
        return self.local_index is not None

    def unsharded(self) -> AttnSegments:
        """The same segments as seen by a process that holds every row (after a CP all-to-all)."""
        return dataclasses.replace(self, local_index=None)

    def to(self, device) -> AttnSegments:
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        masks = None if self.masks is None else tuple(move(m) for m in self.masks)
        return dataclasses.replace(self, cu_seqlens=self.cu_seqlens.to(device),
                                   local_index=move(self.local_index), masks=masks)


@dataclass(frozen=True)
class PackInfo:
    """Per-batch layout of a packed batch, possibly one context-parallel rank's share of it.

    Stream order is the order of the model's inputs: the video (resp. text) rows this process holds,
    sample after sample. All tensors index those local rows.
    """
    grid_sizes: tuple[tuple[int, int, int], ...]  # post-patch (t, h, w) of each sample
    text_lens: tuple[int, ...]                    # caption length of each sample
    cp_rank: int
    cp_size: int
    video_index: Tensor       # [nv] int64 rows of the full video stream held here
    text_index: Tensor        # [nt] int64 rows of the full text stream held here
    video_sample: Tensor      # [nv] int64 sample of each local video token
    text_sample: Tensor       # [nt] int64 sample of each local text token
    video_pos: Tensor         # [nv, 3] int64 (t, h, w) grid position of each local video token
    video_counts: tuple[int, ...]  # local video rows of each sample (contiguous in stream order)
    text_counts: tuple[int, ...]   # local text rows of each sample
    stream_to_joint: Tensor   # [nv + nt] int64 row in the local joint order of each stream row
    joint_to_stream: Tensor   # [nv + nt] int64 inverse permutation: stream row of each joint row
    joint: AttnSegments       # [video_i; text_i] sequences (double- and single-stream blocks)
    text: AttnSegments        # text_i sequences (refiner)

    @classmethod
    def build(cls, grid_sizes, text_lens, device=None) -> PackInfo:
        """Layout of a whole packed batch (one process, no context parallel)."""
        return _derive(grid_sizes, text_lens, 0, 1, device)

    def shard(self, cp_rank: int, cp_size: int) -> PackInfo:
        """The share of cp rank `cp_rank` of `cp_size`: joint tokens j with j % cp_size == cp_rank."""
        if not 0 <= cp_rank < cp_size:
            raise ValueError(f"cp_rank {cp_rank} is not in [0, {cp_size}).")
        return _derive(self.grid_sizes, self.text_lens, cp_rank, cp_size, self.video_index.device)

    def to(self, device) -> PackInfo:
        tensors = {f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
                   if isinstance(getattr(self, f.name), (Tensor, AttnSegments))}
        return dataclasses.replace(self, **tensors)

    @property
    def num_samples(self) -> int:
        return len(self.grid_sizes)

    @property
    def video_lens(self) -> tuple[int, ...]:
        return tuple(t * h * w for t, h, w in self.grid_sizes)

    @property
    def video_joint_rows(self) -> Tensor:
        """[nv] row of each local video token in the local joint order."""
        return self.stream_to_joint[:self.num_video_tokens]

    @property
    def text_joint_rows(self) -> Tensor:
        """[nt] row of each local text token in the local joint order."""
        return self.stream_to_joint[self.num_video_tokens:]

    @property
    def num_video_tokens(self) -> int:
        """Video rows held by this process."""
        return self.video_index.numel()

    @property
    def num_text_tokens(self) -> int:
        """Text rows held by this process."""
        return self.text_index.numel()

    def shard_inputs(self, x: Tensor, text: Tensor) -> tuple[Tensor, Tensor]:
        """This process's rows of the full video tokens `[Nv, C]` and text features `[Nt, D]`."""
        if self.cp_size == 1:
            return x, text
        return x.index_select(0, self.video_index), text.index_select(0, self.text_index)


def _derive(grid_sizes, text_lens, cp_rank: int, cp_size: int, device) -> PackInfo:
    grid_sizes = tuple(tuple(int(n) for n in g) for g in grid_sizes)
    text_lens = tuple(int(n) for n in text_lens)
    if len(grid_sizes) != len(text_lens) or not grid_sizes:
        raise ValueError(f"need one grid size and one caption length per sample, got "
                         f"{len(grid_sizes)} grids and {len(text_lens)} caption lengths.")
    if any(len(g) != 3 or min(g) < 1 for g in grid_sizes) or min(text_lens) < 0:
        raise ValueError(f"grid sizes must be positive (t, h, w) and caption lengths >= 0, got "
                         f"{grid_sizes} and {text_lens}.")
    video_lens = torch.tensor([t * h * w for t, h, w in grid_sizes])
    txt_lens = torch.tensor(text_lens)
    samples = torch.arange(len(grid_sizes))
    joint_start = torch.cumsum(video_lens + txt_lens, 0) - (video_lens + txt_lens)

    def joint_position(lens: Tensor, offset_in_sample: Tensor) -> Tensor:
        # Global joint index of every row of a stream: its rank inside its sample plus the sample's
        # joint start (plus video length for text rows).
        start_in_stream = torch.cumsum(lens, 0) - lens
        shift = torch.repeat_interleave(joint_start + offset_in_sample - start_in_stream, lens)
        return torch.arange(int(lens.sum())) + shift

    video_joint = joint_position(video_lens, torch.zeros_like(video_lens))
    text_joint = joint_position(txt_lens, video_lens)
    video_index = torch.nonzero(video_joint % cp_size == cp_rank).squeeze(1)
    text_index = torch.nonzero(text_joint % cp_size == cp_rank).squeeze(1)

    # Local joint order = held joint indices, ascending; each stream row's place in it.
    local_joint = torch.cat([video_joint[video_index], text_joint[text_index]])
    joint_to_stream = torch.argsort(local_joint)
    stream_to_joint = torch.argsort(joint_to_stream)
    video_sample = torch.repeat_interleave(samples, video_lens)[video_index]
    text_sample = torch.repeat_interleave(samples, txt_lens)[text_index]

    positions = torch.cat([
        torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"),
                    -1).reshape(-1, 3)
        for t, h, w in grid_sizes])
    sharded = cp_size > 1
    joint = AttnSegments.from_lengths((video_lens + txt_lens).tolist())
    text = AttnSegments.from_lengths(list(text_lens))
    if sharded:
        joint = dataclasses.replace(joint, local_index=local_joint[joint_to_stream])
        text = dataclasses.replace(text, local_index=text_index)
    pack = PackInfo(
        grid_sizes=grid_sizes, text_lens=text_lens, cp_rank=cp_rank, cp_size=cp_size,
        video_index=video_index, text_index=text_index,
        video_sample=video_sample, text_sample=text_sample, video_pos=positions[video_index],
        video_counts=tuple(torch.bincount(video_sample, minlength=len(samples)).tolist()),
        text_counts=tuple(torch.bincount(text_sample, minlength=len(samples)).tolist()),
        stream_to_joint=stream_to_joint, joint_to_stream=joint_to_stream, joint=joint, text=text)
    return pack if device is None else pack.to(device)


def patchify(x: Tensor, patch_size: tuple[int, int, int] | list[int]) -> Tensor:
    """[C, T, H, W] latent -> [T/pt * H/ph * W/pw, C * pt * ph * pw] tokens ((t, h, w) order).

    Within a token the order is (c, pt, ph, pw): the flattening of a Conv3d kernel with
    kernel = stride = patch, so a Linear on these tokens is that convolution.
    """
    pt, ph, pw = patch_size
    c, t, h, w = x.shape
    if t % pt or h % ph or w % pw:
        raise ValueError(f"latent shape {tuple(x.shape)} is not divisible by patch {tuple(patch_size)}.")
    x = x.reshape(c, t // pt, pt, h // ph, ph, w // pw, pw)
    return x.permute(1, 3, 5, 0, 2, 4, 6).reshape((t // pt) * (h // ph) * (w // pw), c * pt * ph * pw)


def unpatchify(tokens: Tensor, grid: tuple[int, int, int], patch_size: tuple[int, int, int] | list[int]
               ) -> Tensor:
    """Inverse of `patchify`: [t * h * w, C * pt * ph * pw] tokens -> [C, t * pt, h * ph, w * pw]."""
    pt, ph, pw = patch_size
    t, h, w = grid
    c = tokens.shape[1] // (pt * ph * pw)
    x = tokens.reshape(t, h, w, c, pt, ph, pw).permute(3, 0, 4, 1, 5, 2, 6)
    return x.reshape(c, t * pt, h * ph, w * pw)

"""Packed batches: per-batch bookkeeping for variable-length video + caption sequences.

A packed batch concatenates samples along one token axis, with no padding. The model sees two
streams, `[all video tokens]` and `[all text tokens]` (sample after sample), while attention runs over
the joint sequences `[video_0; text_0][video_1; text_1]...`. `PackInfo` holds everything derived
once per batch: sample index per token, RoPE grid positions, the rows of each stream inside the joint
order, and the attention segments.

Each sample is described by a `SampleLayout`: one or more clips (each a post-patch grid with its RoPE
positions: integer grid positions, or h/w positions interpolated onto a reference grid as Pyramid-
Flow does for low-resolution history), which clips are trained, and an attention rule: `full`, or
`block_causal` over frames (a query in frame f sees keys in frames <= f of its own sample; caption
tokens count as frame 0). The layout travels with the pack through sharding and context parallel.

Context parallel (Ulysses) shards the joint order with a stride: cp rank r of N holds joint tokens
j with j % N == r. `PackInfo.shard(r, N)` describes that subset; per-token work (linears, norms, RoPE,
modulation by sample index) runs on it unchanged, and only `inner_attention` needs the other ranks.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from itertools import accumulate
from typing import Literal

import torch
from torch import Tensor


@dataclass(frozen=True)
class FrameGroups:
    """One block-causal segment's rule as a schedule of unmasked attention calls (block-sparse backends).

    Keys sorted by frame (stable) put the rows of frames <= f first, so the keys a query of frame f
    sees are a prefix of that order. Queries stay in segment order, in runs of consecutive rows of one
    frame (a sample's video frame by frame, then its caption, frame 0): run (start, end, visible)
    attends the first `visible` sorted keys, and the runs' outputs back to back are the segment's rows
    in order. Built once per pack from `frames`; O(Ls) memory; host ints, so slicing needs no sync.

    With `queries` (segment rows, increasing) only those rows ask: the runs cut the rows given (q
    holds just those, in order), each still seeing every key of frames <= its own.
    """
    frames: Tensor                          # [Ls] int64 frame of each row (what this was built from)
    key_order: Tensor                       # [Ls] int64 segment rows sorted by frame (stable)
    key_inverse: Tensor                     # [Ls] int64 place in `key_order` of each segment row
    keys_in_order: bool                     # key_order is the identity (no gather needed)
    runs: tuple[tuple[int, int, int], ...]  # (start, end, visible keys) of each run of same-frame queries
    queries: Tensor | None = None           # [nq] int64 segment rows that query (None: every row)
    # the frames of the rows and of the asking rows, as host bytes: segments with equal ones have
    # the same mask (what groups them into one call, `LayoutBatches`), whatever device `frames` is on
    rule: tuple[bytes, bytes] = (b"", b"")

    @classmethod
    def of(cls, frames: Tensor, queries: Tensor | None = None) -> FrameGroups:
        """The schedule of one segment from the frame of each of its rows ([Ls] integers)."""
        cpu = frames.cpu()
        order = torch.sort(cpu, stable=True).indices
        values, counts = torch.unique_consecutive(cpu[order], return_counts=True)
        visible_of_value = torch.cumsum(counts, 0)                  # keys of frames <= each value
        asking = cpu if queries is None else cpu[queries.cpu()]
        run_values, run_lengths = torch.unique_consecutive(asking, return_counts=True)
        run_ends = torch.cumsum(run_lengths, 0)
        visible = visible_of_value[torch.searchsorted(values, run_values)]
        runs = tuple(zip((run_ends - run_lengths).tolist(), run_ends.tolist(), visible.tolist()))
        in_order = bool(torch.equal(order, torch.arange(len(order))))
        rule = tuple(t.to(torch.int32).numpy().tobytes() for t in (cpu, asking))
        return cls(frames, order.to(frames.device), torch.argsort(order).to(frames.device), in_order, runs,
                   None if queries is None else queries.to(frames.device), rule)

    def moved(self, frames: Tensor) -> FrameGroups:
        """The same schedule beside `frames` (this schedule's frames on another device)."""
        move = lambda t: None if t is None else t.to(frames.device)  # noqa: E731
        return dataclasses.replace(self, frames=frames, key_order=move(self.key_order),
                                   key_inverse=move(self.key_inverse), queries=move(self.queries))

    def query_frames(self) -> Tensor:
        """[nq] frame of each querying row."""
        return self.frames if self.queries is None else self.frames[self.queries]


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
    # The block-causal rule, per segment: the frame of each of its rows ([Ls] int64; a row attends to
    # rows of frames <= its own), or None where the segment attends fully. O(L) memory: backends
    # build whatever mask they need from it, segment by segment.
    frames: tuple[Tensor | None, ...] | None = None
    # The same rule as a schedule of unmasked calls (FrameGroups), per segment: derived from `frames`
    # when the segments are made (once per pack) and carried along by unsharded() and to(), so no
    # attention call rebuilds it. Rebuilt only if `frames` is replaced by other tensors.
    frame_groups: tuple[FrameGroups | None, ...] | None = None
    # Asked by some rows only (`with_queries`): q holds the rows `query_rows` of the full sequence
    # ([Lq] int64, increasing), `query_lens` of them per segment; the keys are still every row.
    query_rows: Tensor | None = None
    query_lens: tuple[int, ...] | None = None

    def __post_init__(self):
        if self._groups_match_frames():
            return
        groups = None if self.frames is None else tuple(None if f is None else FrameGroups.of(f)
                                                        for f in self.frames)
        object.__setattr__(self, "frame_groups", groups)

    def _groups_match_frames(self) -> bool:
        if self.frames is None or self.frame_groups is None:
            return self.frames is None and self.frame_groups is None
        return len(self.frame_groups) == len(self.frames) and all(
            (g is None and f is None) or (g is not None and g.frames is f)
            for g, f in zip(self.frame_groups, self.frames))

    @classmethod
    def from_lengths(cls, seqlens: list[int] | tuple[int, ...], device=None) -> AttnSegments:
        offsets = [0, *accumulate(seqlens)]
        return cls(tuple(seqlens), torch.tensor(offsets, dtype=torch.int32, device=device),
                   max(seqlens, default=0))

    @property
    def total(self) -> int:
        return sum(self.seqlens)

    @property
    def is_causal(self) -> bool:
        """Whether any segment follows the block-causal rule."""
        return self.frames is not None and any(f is not None for f in self.frames)

    @property
    def is_sharded(self) -> bool:
        return self.local_index is not None

    def with_queries(self, rows: Tensor) -> AttnSegments:
        """These segments asked by `rows` only (rows of the full sequence, increasing): attention then
        takes q and returns outputs for those rows, each seeing the keys its rule allows. What a
        layer whose other outputs nobody reads computes (built once per pack, not per call)."""
        if self.is_sharded:
            raise ValueError("a query subset of a context-parallel rank's share is not supported: pass "
                             "every row's query under context parallel.")
        cpu = rows.cpu()
        starts = self.cu_seqlens.cpu().long()
        segment = torch.bucketize(cpu, starts[1:], right=True)                # segment of each row
        groups = None
        if self.frames is not None:
            groups = tuple(None if f is None else FrameGroups.of(f, cpu[segment == i] - starts[i])
                           for i, f in enumerate(self.frames))
        lens = torch.bincount(segment, minlength=len(self.seqlens))
        return dataclasses.replace(self, query_rows=rows, query_lens=tuple(lens.tolist()), frame_groups=groups)

    @functools.cached_property
    def layout_batches(self) -> LayoutBatches:
        """The segments that ask something, grouped by layout (lengths and rule) for one batched
        attention call per group. Built once per pack."""
        return LayoutBatches.of(self)

    def unsharded(self) -> AttnSegments:
        """The same segments as seen by a process that holds every row (after a CP all-to-all); the
        same object at every call, so what it builds once per pack (`layout_batches`) is built once,
        not once per layer."""
        return self._unsharded

    @functools.cached_property
    def _unsharded(self) -> AttnSegments:
        return dataclasses.replace(self, local_index=None)

    def to(self, device) -> AttnSegments:
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        frames = groups = None
        if self.frames is not None:
            frames = tuple(move(f) for f in self.frames)
            groups = tuple(None if g is None else g.moved(f) for g, f in zip(self.frame_groups, frames))
        return dataclasses.replace(self, cu_seqlens=self.cu_seqlens.to(device), local_index=move(self.local_index),
                                   frames=frames, frame_groups=groups, query_rows=move(self.query_rows))


class _PermuteRows(torch.autograd.Function):
    """rows[order] whose backward is the inverse gather (index_select's backward is a scatter-add)."""

    @staticmethod
    def forward(ctx, rows: Tensor, order: Tensor, inverse: Tensor) -> Tensor:
        ctx.save_for_backward(inverse)
        return rows.index_select(0, order)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def permute_rows(rows: Tensor, order: Tensor | None, inverse: Tensor | None) -> Tensor:
    """rows[order] for a permutation `order` of rows' first axis and its `inverse`, differentiable
    by the inverse gather; rows themselves when order is None (the identity)."""
    return rows if order is None else _PermuteRows.apply(rows, order, inverse)


@dataclass(frozen=True)
class LayoutBatch:
    """`count` segments of one layout, back to back in `LayoutBatches`' order: one attention call
    with a batch dimension computes each of them exactly as a call of its own would."""
    count: int
    query_len: int
    key_len: int
    groups: FrameGroups | None   # the block-causal rule of each of them (None: full)


@dataclass(frozen=True)
class LayoutBatches:
    """The asking segments of an `AttnSegments` grouped by layout: a packed AR batch repeats a few
    layouts (stage x unit), so one call per layout replaces one per segment (16 -> ~5 in the AR
    demo). Rows are gathered batch by batch (`*_order`, None where already in that order); keys of
    segments that ask nothing come last, read by no batch."""
    batches: tuple[LayoutBatch, ...]
    query_order: Tensor | None
    query_inverse: Tensor | None
    key_order: Tensor | None
    key_inverse: Tensor | None

    @classmethod
    def of(cls, segments: AttnSegments) -> LayoutBatches:
        asking = segments.query_lens or segments.seqlens
        groups: dict[tuple, list[int]] = {}
        for i, (keys, queries) in enumerate(zip(segments.seqlens, asking)):
            if queries:
                groups.setdefault((keys, queries, _rule_key(segments, i)), []).append(i)
        key_starts, query_starts = [0, *accumulate(segments.seqlens)], [0, *accumulate(asking)]
        batched = [i for members in groups.values() for i in members]
        idle = [i for i, n in enumerate(asking) if not n]
        query_order = _rows_of(batched, query_starts, asking)
        key_order = _rows_of(batched + idle, key_starts, segments.seqlens)
        device = segments.cu_seqlens.device
        batches = tuple(_layout_batch(segments, members) for members in groups.values())
        return cls(batches, *_permutation(query_order, device), *_permutation(key_order, device))


def _rule_key(segments: AttnSegments, i: int) -> tuple[bytes, bytes] | None:
    """What decides segment i's mask: its rows' frames and its asking rows' frames (None: full)."""
    groups = segments.frame_groups[i] if segments.frame_groups else None
    return None if groups is None else groups.rule


def _layout_batch(segments: AttnSegments, members: list[int]) -> LayoutBatch:
    first = members[0]
    groups = segments.frame_groups[first] if segments.frame_groups else None
    queries = (segments.query_lens or segments.seqlens)[first]
    return LayoutBatch(len(members), queries, segments.seqlens[first], groups)


def _rows_of(members: list[int], starts: list[int], lens) -> list[int]:
    return [row for i in members for row in range(starts[i], starts[i] + lens[i])]


def _permutation(order: list[int], device) -> tuple[Tensor | None, Tensor | None]:
    """(order, its inverse) as tensors on `device`, or (None, None) for the identity. Host lists: the
    preflight's memory check runs the model on fake tensors, where a tensor made here has no values."""
    if order == list(range(len(order))):
        return None, None
    inverse = [0] * len(order)
    for place, row in enumerate(order):
        inverse[row] = place
    return torch.tensor(order, device=device), torch.tensor(inverse, device=device)


AttentionRule = Literal["full", "block_causal"]
ATTENTION_RULES = ("full", "block_causal")


@dataclass(frozen=True)
class Clip:
    """One clip of a sample's video tokens, in (t, h, w) order after the previous clip's.

    RoPE positions of its token (i, j, k): t = frame_offset + i; h, w = j, k on its own grid, or,
    with `ref_hw = (H, W)`, the centres of its cells mapped onto an H x W grid (a 1/2-resolution
    clip's j becomes 2j + 0.5: linear interpolation with align_corners=False).
    """
    grid: tuple[int, int, int]             # post-patch (t, h, w)
    frame_offset: int = 0                  # frame index of its first frame within the sample
    ref_hw: tuple[int, int] | None = None  # reference grid of the h/w positions (None: integers)
    trained: bool = True                   # whether its tokens are predicted and in the loss

    @property
    def tokens(self) -> int:
        t, h, w = self.grid
        return t * h * w

    def positions(self) -> Tensor:
        """[tokens, 3] (t, h, w) RoPE positions: int64, or float64 with a reference grid."""
        t, h, w = self.grid
        axes = [torch.arange(t) + self.frame_offset, torch.arange(h), torch.arange(w)]
        if self.ref_hw is not None:
            axes = [axes[0].double()] + [(torch.arange(n, dtype=torch.float64) + 0.5) * ref / n - 0.5
                                         for n, ref in zip((h, w), self.ref_hw)]
        return torch.stack(torch.meshgrid(*axes, indexing="ij"), -1).reshape(-1, 3)


@dataclass(frozen=True)
class SampleLayout:
    """What one packed sample is: its clips (oldest first), caption length and attention rule."""
    clips: tuple[Clip, ...]
    text_len: int
    attention: AttentionRule = "full"

    def __post_init__(self):
        if not self.clips or any(len(c.grid) != 3 or min(c.grid) < 1 for c in self.clips):
            raise ValueError(f"a sample needs at least one clip with a positive (t, h, w) grid, got "
                             f"{[c.grid for c in self.clips]}.")
        if self.text_len < 0:
            raise ValueError(f"caption length must be >= 0, got {self.text_len}.")
        if self.attention not in ATTENTION_RULES:
            raise ValueError(f"unknown attention rule {self.attention!r}; choose one of {ATTENTION_RULES}.")

    @classmethod
    def single(cls, grid, text_len: int, attention: AttentionRule = "full") -> SampleLayout:
        """One clip on its own integer grid: a plain video (or image) sample."""
        return cls((Clip(tuple(int(n) for n in grid)),), int(text_len), attention)

    @classmethod
    def stacked(cls, grids, text_len: int, *, ref_hw: tuple[int, int] | None = None,
                trained: tuple[bool, ...] | None = None, attention: AttentionRule = "full"
                ) -> SampleLayout:
        """Clips that continue one another in time (each starts where the previous one stops),
        all positioned on `ref_hw` when given (clips already on that grid keep integer values)."""
        clips, offset = [], 0
        for i, grid in enumerate(grids):
            grid = tuple(int(n) for n in grid)
            ref = None if ref_hw is None or tuple(grid[1:]) == tuple(ref_hw) else tuple(ref_hw)
            clips.append(Clip(grid, offset, ref, True if trained is None else trained[i]))
            offset += grid[0]
        return cls(tuple(clips), int(text_len), attention)

    @property
    def video_len(self) -> int:
        return sum(c.tokens for c in self.clips)

    def positions(self) -> Tensor:
        """[video_len, 3] RoPE positions of the sample's video tokens (float64 if any clip
        is interpolated onto a reference grid)."""
        parts = [c.positions() for c in self.clips]
        if any(p.is_floating_point() for p in parts):
            parts = [p.double() for p in parts]
        return torch.cat(parts)

    def frame_of_tokens(self) -> Tensor:
        """[video_len] frame index of each video token (its RoPE t before any scaling)."""
        return torch.cat([torch.arange(c.grid[0]).add(c.frame_offset).repeat_interleave(c.grid[1] * c.grid[2])
                          for c in self.clips])

    def trained_tokens(self) -> Tensor:
        """[video_len] bool: tokens whose prediction is trained."""
        return torch.cat([torch.full((c.tokens,), c.trained) for c in self.clips])


@dataclass(frozen=True)
class PackInfo:
    """Per-batch layout of a packed batch, possibly one context-parallel rank's share of it.

    Stream order is the order of the model's inputs: the video (resp. text) rows this process holds,
    sample after sample. All tensors index those local rows.
    """
    layouts: tuple[SampleLayout, ...]  # what each sample is (clips, caption, attention rule)
    cp_rank: int
    cp_size: int
    video_index: Tensor       # [nv] int64 rows of the full video stream held here
    text_index: Tensor        # [nt] int64 rows of the full text stream held here
    video_sample: Tensor      # [nv] int64 sample of each local video token
    text_sample: Tensor       # [nt] int64 sample of each local text token
    video_pos: Tensor         # [nv, 3] (t, h, w) RoPE position of each local video token (int64,
                              # or float64 when a clip is interpolated onto a reference grid)
    video_trained: Tensor     # [nv] bool: the local video tokens whose prediction is trained
    video_trained_rows: Tensor  # [n] int64 the same as local video rows (increasing)
    video_counts: tuple[int, ...]  # local video rows of each sample (contiguous in stream order)
    trained_counts: tuple[int, ...]  # local trained video rows of each sample
    text_counts: tuple[int, ...]   # local text rows of each sample
    stream_to_joint: Tensor   # [nv + nt] int64 row in the local joint order of each stream row
    joint_to_stream: Tensor   # [nv + nt] int64 inverse permutation: stream row of each joint row
    joint: AttnSegments       # [video_i; text_i] sequences (double- and single-stream blocks)
    text: AttnSegments        # text_i sequences (refiner)

    @classmethod
    def build(cls, grid_sizes, text_lens, device=None) -> PackInfo:
        """A whole packed batch of plain samples (one clip each, full attention), no context parallel."""
        if len(grid_sizes) != len(text_lens) or not grid_sizes:
            raise ValueError(f"need one grid size and one caption length per sample, got "
                             f"{len(grid_sizes)} grids and {len(text_lens)} caption lengths.")
        return cls.from_layouts([SampleLayout.single(g, n) for g, n in zip(grid_sizes, text_lens)], device)

    @classmethod
    def from_layouts(cls, layouts, device=None) -> PackInfo:
        """A whole packed batch of samples described by their layouts, no context parallel."""
        return _derive(tuple(layouts), 0, 1, device)

    def shard(self, cp_rank: int, cp_size: int) -> PackInfo:
        """The share of cp rank `cp_rank` of `cp_size`: joint tokens j with j % cp_size == cp_rank."""
        if not 0 <= cp_rank < cp_size:
            raise ValueError(f"cp_rank {cp_rank} is not in [0, {cp_size}).")
        return _derive(self.layouts, cp_rank, cp_size, self.video_index.device)

    def to(self, device) -> PackInfo:
        tensors = {f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
                   if isinstance(getattr(self, f.name), (Tensor, AttnSegments))}
        return dataclasses.replace(self, **tensors)

    @property
    def num_samples(self) -> int:
        return len(self.layouts)

    @property
    def text_lens(self) -> tuple[int, ...]:
        return tuple(s.text_len for s in self.layouts)

    @property
    def video_lens(self) -> tuple[int, ...]:
        return tuple(s.video_len for s in self.layouts)

    @property
    def grid_sizes(self) -> tuple[tuple[int, int, int], ...]:
        """The grid of each sample, for packs of one-clip samples."""
        if any(len(s.clips) != 1 for s in self.layouts):
            raise ValueError("this pack has samples of several clips: read `layouts`.")
        return tuple(s.clips[0].grid for s in self.layouts)

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

    @functools.cached_property
    def trained_joint(self) -> AttnSegments:
        """The joint segments asked by the trained video rows only (`AttnSegments.with_queries`): what
        a last layer computes when only the trained predictions are read. Built once per pack."""
        return self.joint.with_queries(self.video_joint_rows.index_select(0, self.video_trained_rows))

    def shard_inputs(self, x: Tensor, text: Tensor) -> tuple[Tensor, Tensor]:
        """This process's rows of the full video tokens `[Nv, C]` and text features `[Nt, D]`."""
        if self.cp_size == 1:
            return x, text
        return x.index_select(0, self.video_index), text.index_select(0, self.text_index)


@dataclass(frozen=True)
class _SampleRows:
    """What a pack takes from each sample's layout: the same for the same layout, so kept (shared,
    never written to) for the layouts seen lately."""
    positions: Tensor                 # [video_len, 3] RoPE positions
    trained: Tensor                   # [video_len] bool
    frames: Tensor | None             # [video_len + text_len] frame of each joint row (block-causal)
    frame_groups: FrameGroups | None  # their schedule


# An AR batch has at most (stages x units x caption lengths) layouts, repeated every step: building
# their rows and schedules again was ~40% of the AR task's per-step preparation on the CPU. 128 of them
# hold ~130 MB at most at 768p (~1 MB a sample).
@functools.lru_cache(maxsize=128)
def _sample_rows(layout: SampleLayout) -> _SampleRows:
    frames = groups = None
    if layout.attention == "block_causal":  # joint order is [video; caption]: caption rows are frame 0
        frames = torch.cat([layout.frame_of_tokens(), torch.zeros(layout.text_len, dtype=torch.int64)])
        groups = FrameGroups.of(frames)
    return _SampleRows(layout.positions(), layout.trained_tokens(), frames, groups)


def _derive(layouts: tuple[SampleLayout, ...], cp_rank: int, cp_size: int, device) -> PackInfo:
    if not layouts:
        raise ValueError("a pack needs at least one sample.")
    video_lens = torch.tensor([s.video_len for s in layouts])
    txt_lens = torch.tensor([s.text_len for s in layouts])
    samples = torch.arange(len(layouts))
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

    rows = [_sample_rows(s) for s in layouts]
    positions = [r.positions for r in rows]
    if any(p.is_floating_point() for p in positions):
        positions = [p.double() for p in positions]
    positions = torch.cat(positions)
    trained = torch.cat([r.trained for r in rows])[video_index]
    joint = AttnSegments.from_lengths((video_lens + txt_lens).tolist())
    if any(s.attention == "block_causal" for s in layouts):
        joint = dataclasses.replace(joint, frames=tuple(r.frames for r in rows),
                                    frame_groups=tuple(r.frame_groups for r in rows))
    text = AttnSegments.from_lengths(list(txt_lens.tolist()))
    if cp_size > 1:
        joint = dataclasses.replace(joint, local_index=local_joint[joint_to_stream])
        text = dataclasses.replace(text, local_index=text_index)
    pack = PackInfo(
        layouts=layouts, cp_rank=cp_rank, cp_size=cp_size,
        video_index=video_index, text_index=text_index,
        video_sample=video_sample, text_sample=text_sample, video_pos=positions[video_index],
        video_trained=trained, video_trained_rows=torch.nonzero(trained).squeeze(1),
        video_counts=tuple(torch.bincount(video_sample, minlength=len(samples)).tolist()),
        trained_counts=tuple(torch.bincount(video_sample[trained], minlength=len(samples)).tolist()),
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

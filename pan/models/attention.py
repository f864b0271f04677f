"""Attention over packed variable-length sequences, behind one function.

All backends: scale 1/sqrt(head_dim), never crossing segments, and the same attention rule per
segment: full, or block-causal over frames (`AttnSegments.frames`: a row attends to the rows of frames
<= its own in its segment). A backend that cannot apply a rule refuses with a ValueError; none
changes the semantics.
- `sdpa`: one `F.scaled_dot_product_attention` call per segment layout; a block-causal layout gets
  its own [Lq, Ls] mask, built when its call runs. The reference, and the fast path for the full
  rule on CPU (2.3-3.3x faster there than one call with a block-diagonal mask). Segments of one
  layout (lengths and rule: an AR batch repeats a few, a batch of same-size images one) share the
  call with a batch dimension (`AttnSegments.layout_batches`), which gives each the bits of a call
  of its own.
- `blockwise`: full segments as in sdpa; a block-causal segment as unmasked SDPA calls, one per run
  of same-frame queries over exactly the keys of frames <= theirs (`FrameGroups`, built once per
  pack), so the masked part is never computed; the segments of one layout share each run's call, as
  in sdpa. `benchmarks/attention.py` on CPU (1 thread, forward +
  backward, 16 frames): 0.76x the cost of the full rule at 64 tokens per frame (CPU's flash kernel
  is less efficient on small query blocks), 0.59x at 256; sdpa with the mask costs 1.1-1.4x. Its
  many small calls suffer from OpenMP barriers on an oversubscribed CPU. On CUDA its unmasked calls
  take the flash kernels.
- `flex`: torch's `flex_attention` over the whole pack with a BlockMask (same segment AND the frame
  rule) built once per pack. Compiled on CUDA. On CPU torch has no flex backward, so it refuses to
  train there, and runs eager (holding [heads, L, L] scores): compiling costs ~10 s per pack shape.
- `varlen`: `torch.nn.attention.varlen.varlen_attn` (flash varlen; CUDA only): one call over all
  segments under the full rule; with block-causal segments, a call per layout and per run, as in
  blockwise.
- `auto`: chosen by measurement. Until a choice is made, the rule: blockwise if any segment is
  block-causal; else varlen for fp16/bf16 CUDA tensors, sdpa otherwise. Each `InnerAttention` left on
  `auto` records the shapes and segments of its first training call (`AttentionCall`); the trainer
  then times every exact candidate on them, forward and backward (`measure_backends`), takes rank
  0's fastest on every rank, keeps it in the checkpoint and logs it (pan/trainer.py). Outside
  training (sampling) `auto` stays the rule.

Segments asked by some rows only (`AttnSegments.with_queries`: a last layer whose other outputs
nobody reads) take q and give outputs for those rows; every backend answers them exactly (sdpa,
blockwise and varlen compute those queries alone; flex, whose BlockMask covers every row, asks with
zero queries elsewhere and keeps the subset).

Models call attention only through `InnerAttention` submodules, so context parallel can replace or
wrap them from outside; `set_attention_backend` switches the backend of every one in a model.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from itertools import accumulate
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pan.models.packing import AttnSegments, FrameGroups, permute_rows

AttentionBackend = Literal["auto", "sdpa", "blockwise", "flex", "varlen"]
ATTENTION_BACKENDS: tuple[str, ...] = get_args(AttentionBackend)

# q, k, v [n_q or n_k, H, d] -> [n_q, H, d]: unmasked attention of every query over every key (or
# [count, n, H, d]: `count` segments of one layout, each its own attention)
Kernel = Callable[[Tensor, Tensor, Tensor], Tensor]
ROWS = -3   # the row (token) dimension of q/k/v, [(count,) n, H, d]


def attention(q: Tensor, k: Tensor, v: Tensor, segments: AttnSegments,
              backend: AttentionBackend = "auto") -> Tensor:
    """Attention within each segment. k, v: [L, heads, head_dim] holding every row; q and the output:
    the same rows, or only the segments' `query_rows` ([Lq, heads, head_dim]) when they have some."""
    if segments.is_sharded:
        raise ValueError("these q/k/v are one context-parallel rank's share of the sequence; attach a "
                         "context-parallel inner attention (pan.parallel) before running a sharded pack.")
    if backend == "auto":
        backend = auto_backend(q, segments)
    run = _BACKENDS.get(backend)
    if run is None:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {ATTENTION_BACKENDS}.")
    return run(q, k, v, segments)


def auto_backend(q: Tensor, segments: AttnSegments) -> str:
    """The backend `auto` runs for these inputs."""
    if segments.is_causal:
        return "blockwise"  # exact for every dtype and device; never computes the masked pairs
    # flash varlen has fp16/bf16 kernels only
    return "varlen" if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) else "sdpa"


# ------------------------------------------------------------------------------------------------
# sdpa and blockwise: one call per segment layout
# ------------------------------------------------------------------------------------------------

def sdpa_rows(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
    """One SDPA call on [n, H, d] rows, or on [count, n, H, d]: `count` segments of one layout (SDPA
    reads the heads-first strided views without a copy)."""
    out = F.scaled_dot_product_attention(*(_heads_first(t) for t in (q, k, v)), attn_mask=mask)
    return _rows_first(out, q)


def _heads_first(t: Tensor) -> Tensor:
    """[n, H, d] -> [1, H, n, d], [count, n, H, d] -> [count, H, n, d] (views)."""
    return (t if t.dim() == 4 else t.unsqueeze(0)).transpose(1, 2)


def _rows_first(out: Tensor, like: Tensor) -> Tensor:
    """`_heads_first`'s inverse, back to the layout of `like`."""
    out = out.transpose(1, 2)
    return out if like.dim() == 4 else out[0]


def block_causal_mask(groups: FrameGroups, device) -> Tensor:
    """[nq, Ls] bool: which keys each asking row of a block-causal segment sees (frames <= its own)."""
    return groups.query_frames().to(device)[:, None] >= groups.frames.to(device)[None, :]


def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, segments: AttnSegments) -> Tensor:
    """Reference backend: one SDPA call per segment layout, with the layout's block-causal mask if
    any (built for that call only, never for the whole pack)."""
    return _per_layout(q, k, v, segments, sdpa_rows,
                       lambda qs, ks, vs, groups: sdpa_rows(qs, ks, vs, block_causal_mask(groups, q.device)))


def blockwise_attention(q: Tensor, k: Tensor, v: Tensor, segments: AttnSegments) -> Tensor:
    """Block-causal layouts as unmasked SDPA calls, one per run of same-frame queries (see
    `frame_group_attention`); full ones as in sdpa."""
    return _per_layout(q, k, v, segments, sdpa_rows,
                       lambda qs, ks, vs, groups: frame_group_attention(qs, ks, vs, groups, sdpa_rows))


def _per_layout(q: Tensor, k: Tensor, v: Tensor, segments: AttnSegments, full: Kernel,
                block_causal: Callable[[Tensor, Tensor, Tensor, FrameGroups], Tensor]) -> Tensor:
    """Run the segments of each layout (`AttnSegments.layout_batches`) together through `full` or
    `block_causal` (by the layout's rule) as [count, n, H, d] tensors: their rows gathered back to
    back, one call where there were `count`. Each batch element is computed as its own call would
    compute it (the same values, to the bit, on CPU's flash kernel), for a fraction of the per-call
    cost when segments are small. Rows are cut with `split`, whose backward is one concatenation
    (slicing would give each piece a zero-filled gradient the size of the pack)."""
    plan = segments.layout_batches
    qs = permute_rows(q, plan.query_order, plan.query_inverse)
    ks, vs = (permute_rows(t, plan.key_order, plan.key_inverse) for t in (k, v))
    query_rows = [b.count * b.query_len for b in plan.batches]
    key_rows = [b.count * b.key_len for b in plan.batches]
    key_rows.append(k.shape[0] - sum(key_rows))   # segments that ask nothing: read by no batch
    if query_rows == [qs.shape[0]] and key_rows[1] == 0:   # one layout holds every row: no cut, no join
        pieces = [(qs, ks, vs)]                        # (each a copy forward or backward, for nothing)
    else:
        pieces = zip(qs.split(query_rows), ks.split(key_rows), vs.split(key_rows))
    outs = []
    for b, (qb, kb, vb) in zip(plan.batches, pieces):
        batched = [t.view(b.count, -1, *t.shape[1:]) for t in (qb, kb, vb)]
        out = full(*batched) if b.groups is None else block_causal(*batched, b.groups)
        outs.append(out.reshape(qb.shape))
    if not outs:   # no segment asks anything
        return torch.empty_like(q)
    joined = outs[0] if len(outs) == 1 else torch.cat(outs)
    return permute_rows(joined, plan.query_inverse, plan.query_order)


def frame_group_attention(q: Tensor, k: Tensor, v: Tensor, groups: FrameGroups, kernel: Kernel) -> Tensor:
    """One block-causal segment, q/k/v [Ls, H, d] (or `count` segments of one layout, [count, Ls, H,
    d]: the runs are theirs alike), without a mask: each run of same-frame query rows attends the
    prefix of the frame-sorted keys that holds exactly the rows of frames <= its own. Cost sum over
    runs of n_run * visible instead of Ls^2 (about half at many frames)."""
    # the CPU flash op is what SDPA runs on CPU unless the caller turned it off (sdpa_kernel(MATH))
    if kernel is sdpa_rows and q.device.type == "cpu" and torch.backends.cuda.flash_sdp_enabled():
        return _CpuFlashFrameGroups.apply(q, k, v, groups)
    return _FrameGroupAttention.apply(q, k, v, groups, kernel)


class _FrameGroupAttention(torch.autograd.Function):
    """`frame_group_attention`, with a backward that accumulates every run's key/value gradients into
    one buffer. Plain autograd would give each key prefix (a slice) a zero-filled gradient the size
    of the whole segment: an [Ls, H, d] allocation and fill per run, which on CPU cost more than the
    attention it saves. The forward keeps each run's own small autograd graph; the kernel's saved
    tensors are views of q and of the frame-sorted k/v, O(Ls) memory as for one SDPA call. Activation
    checkpointing keeps them too (they are this node's, not the block's), so a checkpointed block
    holds its block-causal q/k/v and outputs until its backward (selective checkpointing keeps the
    attention outputs anyway)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, groups: FrameGroups, kernel: Kernel) -> Tensor:
        ks, vs = _keys_by_frame(k, v, groups)
        runs = [(q.narrow(ROWS, start, end - start), ks.narrow(ROWS, 0, visible), vs.narrow(ROWS, 0, visible))
                for start, end, visible in groups.runs]
        ctx.groups, ctx.graphs = groups, None
        if not any(ctx.needs_input_grad[:3]):
            return torch.cat([kernel(*inputs) for inputs in runs], ROWS)   # runs back to back: segment order
        runs = [tuple(t.detach().requires_grad_() for t in inputs) for inputs in runs]
        # The runs' graphs belong to this node alone: plain saved tensors, out of reach of any
        # saved-tensor hooks around it (activation checkpointing would otherwise recompute the block
        # from inside this node's backward).
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_as_is, _as_is):
            outs = [kernel(*inputs) for inputs in runs]                  # [(count,) n_run, H, d] each
        ctx.graphs = (outs, runs)
        ctx.key_meta = ((k.shape, k.dtype), (v.shape, v.dtype))       # of the gradients to return
        return torch.cat([out.detach() for out in outs], ROWS)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):
        (outs, runs), ctx.graphs = ctx.graphs, None                     # each run's graph is used once
        def run_grads(i: int) -> tuple[Tensor, Tensor, Tensor]:
            start, end, _ = ctx.groups.runs[i]
            return torch.autograd.grad(outs[i], runs[i], grad.narrow(ROWS, start, end - start))

        return *_gather_run_gradients(ctx.groups, ctx.key_meta, grad, run_grads), None, None


def _gather_run_gradients(groups: FrameGroups, key_meta, grad: Tensor,
                          run_grads: Callable[[int], tuple[Tensor, Tensor, Tensor]]) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of a segment from its runs' (gq, gk, gv) [(count,) n_run or visible, H, d], `run_grads(i)`
    of run i, taken one run at a time (only one run's key/value gradients exist at once: O(Ls)
    memory), the runs that see more keys first: the first one's key/value gradients are the sums'
    buffers when it sees every key (no zero-filled buffer to add them into), the others' are added
    to their prefixes; the sums, in frame-sorted order, are then put back in the segment's order."""
    dqs: list[Tensor | None] = [None] * len(groups.runs)
    dk = dv = None
    for i in sorted(range(len(groups.runs)), key=lambda i: -groups.runs[i][2]):
        visible = groups.runs[i][2]
        dqs[i], gk, gv = run_grads(i)
        if dk is None and visible == key_meta[0][0][ROWS]:
            dk, dv = gk, gv
            continue
        if dk is None:
            dk, dv = (grad.new_zeros(shape, dtype=dtype) for shape, dtype in key_meta)
        dk.narrow(ROWS, 0, visible).add_(gk)
        dv.narrow(ROWS, 0, visible).add_(gv)
    if dk is None:   # no runs: no row asks
        dk, dv = (grad.new_zeros(shape, dtype=dtype) for shape, dtype in key_meta)
    if not groups.keys_in_order:
        dk, dv = (t.index_select(ROWS, groups.key_inverse) for t in (dk, dv))
    return torch.cat(dqs, ROWS), dk, dv                                 # dq: runs back to back, segment order


def _keys_by_frame(k: Tensor, v: Tensor, groups: FrameGroups) -> tuple[Tensor, Tensor]:
    """k and v with their rows sorted by frame (the schedule's key order)."""
    if groups.keys_in_order:
        return k, v
    return k.index_select(ROWS, groups.key_order), v.index_select(ROWS, groups.key_order)


def _as_is(t: Tensor) -> Tensor:
    return t


_CPU_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_CPU_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class _CpuFlashFrameGroups(torch.autograd.Function):
    """`frame_group_attention` with SDPA's CPU flash kernel called directly, forward and backward
    (the op `sdpa_rows` reaches on CPU: bit-identical results). The generic path builds, and walks
    in its backward, a small autograd graph per run; at hundreds of short runs a step (the temporal
    pyramid's history frames) that bookkeeping cost ~10% of the attention's CPU time. Each run's
    output and log-sum-exp are kept as plain attributes, like the generic path's run graphs (see
    `_FrameGroupAttention` on activation checkpointing)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, groups: FrameGroups) -> Tensor:
        ks, vs = _keys_by_frame(k, v, groups)
        qh, kh, vh = (_heads_first(t) for t in (q, ks, vs))              # one view each, sliced per run
        runs = [(qh[:, :, start:end], kh[:, :, :visible], vh[:, :, :visible]) for start, end, visible in groups.runs]
        results = [_CPU_FLASH(*run) for run in runs]                    # (out [c, H, n, d], lse [c, H, n])
        if any(ctx.needs_input_grad[:3]):
            ctx.groups, ctx.runs, ctx.results = groups, runs, results
            ctx.key_meta = ((k.shape, k.dtype), (v.shape, v.dtype))   # of the gradients to return
        # runs back to back: segment order
        return torch.cat([_rows_first(out, q) for out, _ in results], ROWS)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):
        (runs, results), ctx.runs, ctx.results = (ctx.runs, ctx.results), None, None   # used once
        grad_h = _heads_first(grad)

        def run_grads(i: int) -> tuple[Tensor, Tensor, Tensor]:
            (start, end, _), (out, lse) = ctx.groups.runs[i], results[i]
            grads = _CPU_FLASH_BACKWARD(grad_h[:, :, start:end], *runs[i], out, lse, 0.0, False)
            return tuple(_rows_first(g, grad) for g in grads)

        return *_gather_run_gradients(ctx.groups, ctx.key_meta, grad, run_grads), None


# ------------------------------------------------------------------------------------------------
# flex
# ------------------------------------------------------------------------------------------------

class _FlexMasks:
    """BlockMasks of the last few packs: built once per pack, not once per attention call.

    Keyed by the identities of the segments' `cu_seqlens` and `frames` (kept alive here, so an id
    cannot be reused while cached); `unsharded()` keeps both, so context parallel hits the cache too.
    """

    def __init__(self, capacity: int = 4):
        self.capacity = capacity
        self._entries: OrderedDict[tuple, tuple[AttnSegments, object]] = OrderedDict()

    def get(self, segments: AttnSegments, device: torch.device):
        key = (id(segments.cu_seqlens), id(segments.frames), str(device))
        hit = self._entries.get(key)
        if hit is not None and hit[0].cu_seqlens is segments.cu_seqlens and hit[0].frames is segments.frames:
            return hit[1]
        mask = flex_block_mask(segments, device)
        self._entries[key] = (segments, mask)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        return mask


_FLEX_MASKS = _FlexMasks()


def flex_block_mask(segments: AttnSegments, device: torch.device):
    """The flex BlockMask of the packed sequence: same segment AND (full rule, or frame_q >= frame_k)."""
    from torch.nn.attention.flex_attention import create_block_mask

    seqlens = torch.tensor(segments.seqlens, device=device)
    segment = torch.repeat_interleave(torch.arange(len(seqlens), device=device), seqlens)   # [L]
    frames = segments.frames or (None,) * len(seqlens)
    frame = torch.cat([torch.zeros(n, dtype=torch.int64, device=device) if f is None else f.to(device)
                       for n, f in zip(segments.seqlens, frames)])                            # [L]

    def same_segment_and_no_later_frame(b, h, q_idx, kv_idx):
        return (segment[q_idx] == segment[kv_idx]) & (frame[q_idx] >= frame[kv_idx])

    total = segments.total
    # eager on CPU evaluates the rule on all L^2 pairs (fine at CPU sizes); compiled on CUDA never does
    return create_block_mask(same_segment_and_no_later_frame, None, None, total, total, device=device,
                             _compile=device.type == "cuda")


def flex_attention(q: Tensor, k: Tensor, v: Tensor, segments: AttnSegments) -> Tensor:
    """torch's flex_attention over the whole pack with this pack's BlockMask."""
    from torch.nn.attention.flex_attention import flex_attention as flex

    if not q.is_cuda and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise ValueError("attention_backend 'flex' cannot train on CPU: torch's flex_attention has no "
                         "CPU backward. Use 'blockwise' (or 'auto') for the block_causal rule, 'sdpa' "
                         "for full attention.")
    if segments.total == 0:
        return torch.empty_like(q)
    if segments.query_rows is not None:   # the BlockMask covers every row: ask with all, keep the subset
        every = q.new_zeros((segments.total, *q.shape[1:])).index_copy(0, segments.query_rows, q)
        return flex_attention(every, k, v, dataclasses.replace(segments, query_rows=None, query_lens=None)
                              ).index_select(0, segments.query_rows)
    block_mask = _FLEX_MASKS.get(segments, q.device)
    qs, ks, vs = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))              # [1, H, L, d]
    try:
        if q.is_cuda:
            out = _compiled_flex()(qs, ks, vs, block_mask=block_mask)
        else:
            with warnings.catch_warnings():
                # on CPU the unfused path is chosen on purpose: compiling costs seconds per pack length
                warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile")
                out = flex(qs, ks, vs, block_mask=block_mask)
    except NotImplementedError as e:
        raise ValueError(f"attention_backend 'flex' cannot run these inputs (q {tuple(q.shape)} "
                         f"{q.dtype} on {q.device}): {e}") from e
    return out[0].transpose(0, 1)


@functools.cache
def _compiled_flex():
    """torch.compile(flex_attention), made on first use (compiling is what makes flex fast)."""
    from torch.nn.attention.flex_attention import flex_attention as flex

    return torch.compile(flex, dynamic=True)


# ------------------------------------------------------------------------------------------------
# varlen
# ------------------------------------------------------------------------------------------------

def varlen_attention(q: Tensor, k: Tensor, v: Tensor, segments: AttnSegments) -> Tensor:
    """Flash varlen attention (CUDA only)."""
    if not q.is_cuda:
        raise ValueError("attention_backend 'varlen' needs CUDA tensors; use 'sdpa', 'blockwise' or "
                         "'auto' on CPU.")
    from torch.nn.attention.varlen import varlen_attn

    return varlen_packed(q, k, v, segments, varlen_attn)


def varlen_packed(q: Tensor, k: Tensor, v: Tensor, segments: AttnSegments, varlen) -> Tensor:
    """All segments in one `varlen(q, k, v, cu_q, cu_k, max_q, max_k)` call under the full rule. With
    block-causal segments: a call per full segment, and per run of same-frame queries of a
    block-causal one (over the keys of frames <= theirs), as blockwise does with SDPA."""
    if not segments.is_causal:
        cu = segments.cu_seqlens.to(q.device)
        if segments.query_lens is None:
            return varlen(q, k, v, cu, cu, segments.max_seqlen, segments.max_seqlen)
        cu_q = torch.tensor([0, *accumulate(segments.query_lens)], dtype=cu.dtype, device=q.device)
        return varlen(q, k, v, cu_q, cu, max(segments.query_lens), segments.max_seqlen)

    def equal_sequences(qs: Tensor, ks: Tensor, vs: Tensor) -> Tensor:
        """[count, nq or nk, H, d]: `count` sequences of one length, one call."""
        count, nq, nk = qs.shape[0], qs.shape[1], ks.shape[1]
        cu_q, cu_k = (torch.arange(0, (count + 1) * n, n, dtype=torch.int32, device=q.device) for n in (nq, nk))
        out = varlen(*(t.flatten(0, 1) for t in (qs, ks, vs)), cu_q, cu_k, nq, nk)
        return out.view(qs.shape)

    return _per_layout(q, k, v, segments, equal_sequences,
                       lambda qs, ks, vs, groups: frame_group_attention(qs, ks, vs, groups, equal_sequences))


_BACKENDS: dict[str, Callable[[Tensor, Tensor, Tensor, AttnSegments], Tensor]] = {
    "sdpa": sdpa_attention, "blockwise": blockwise_attention, "flex": flex_attention,
    "varlen": varlen_attention}


# ------------------------------------------------------------------------------------------------
# The swappable module
# ------------------------------------------------------------------------------------------------

class InnerAttention(nn.Module):
    """The swappable attention call of one block: (q, k, v, segments) -> out, all [L, heads, head_dim]."""

    def __init__(self, backend: AttentionBackend = "auto"):
        super().__init__()
        self.backend = backend
        self.first_call: AttentionCall | None = None   # while `auto`: what `measure_backends` times

    # Not traced by torch.compile (compile_transformer): the kernels are whole already, and the
    # per-segment loop (or varlen's max_seqlen) would make every new batch layout a recompilation.
    @torch.compiler.disable
    def forward(self, q: Tensor, k: Tensor, v: Tensor, segments: AttnSegments) -> Tensor:
        if self.backend == "auto" and self.first_call is None and torch.is_grad_enabled():
            self.first_call = AttentionCall(q.shape, k.shape, q.dtype, q.device, segments)
        return attention(q, k, v, segments, self.backend)

    def extra_repr(self) -> str:
        return f"backend={self.backend}"


def set_attention_backend(model: nn.Module, backend: AttentionBackend) -> None:
    """Use `backend` in every `InnerAttention` of `model` (also ones wrapped by context parallel)."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {ATTENTION_BACKENDS}.")
    for module in model.modules():
        if isinstance(module, InnerAttention):
            module.backend, module.first_call = backend, None


# ------------------------------------------------------------------------------------------------
# auto: the backend chosen by measurement
# ------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, eq=False)
class AttentionCall:
    """What timing one attention call needs: the shapes, dtype and device of q and of k/v, and the
    pack's segments (the cost depends on these, never on the values)."""
    q_shape: torch.Size
    kv_shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    segments: AttnSegments

    @property
    def key(self) -> tuple:
        """Calls with equal keys cost the same (the blocks of one model share the pack's segments)."""
        return self.q_shape, self.kv_shape, self.dtype, self.device, id(self.segments)


def auto_attention(model: nn.Module) -> list[InnerAttention]:
    """The model's attention modules still on `auto`."""
    return [m for m in model.modules() if isinstance(m, InnerAttention) and m.backend == "auto"]


def auto_candidates(device: torch.device, dtype: torch.dtype, causal: bool = True) -> list[str]:
    """The backends `auto` chooses among: every exact one that trains any pack on this device in this
    dtype. blockwise only for packs with block-causal segments (on full ones it makes sdpa's own
    calls: timing both would pick one of two equal things by noise). Not flex: it compiles (on CUDA)
    for every new pack shape."""
    names = ["sdpa", "blockwise"] if causal else ["sdpa"]
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        names.append("varlen")
    return names


def measure_backends(calls: Sequence[AttentionCall], repeats: int = 3) -> dict[str, float | str]:
    """Seconds of forward + backward of all `calls` (one per attention module; equal calls are timed
    once and counted as often as they occur) for each candidate backend: per call the median of
    `repeats` runs after a warm-up, the backends taking turns so that the machine's drift reaches all
    alike. A backend that refuses a call, or fails on it, gets the reason instead of a time."""
    counts: dict[tuple, int] = {}
    distinct: dict[tuple, AttentionCall] = {}
    for call in calls:
        counts[call.key] = counts.get(call.key, 0) + 1
        distinct.setdefault(call.key, call)
    candidates = auto_candidates(calls[0].device, calls[0].dtype, any(c.segments.is_causal for c in calls))
    results: dict[str, float | str] = dict.fromkeys(candidates, 0.0)
    for key, call in distinct.items():
        inputs = _random_inputs(call)
        runs: dict[str, list[float]] = {name: [] for name in candidates}
        for _ in range(1 + repeats):
            for name in candidates:
                if isinstance(results[name], str):
                    continue
                try:
                    runs[name].append(_forward_backward_seconds(name, call, *inputs))
                except (ValueError, RuntimeError) as e:   # a refusal, or out of memory
                    results[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        for name in candidates:
            if not isinstance(results[name], str):
                results[name] += counts[key] * statistics.median(runs[name][1:])   # the first warms up
    return results


def _random_inputs(call: AttentionCall) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """q, k, v (leaves that want gradients) and an output gradient, from a generator of their own:
    measuring draws nothing from the training's random streams."""
    generator = torch.Generator(call.device).manual_seed(0)
    def draw(shape):
        return torch.randn(shape, generator=generator, device=call.device, dtype=call.dtype)
    q, k, v = (draw(shape).requires_grad_() for shape in (call.q_shape, call.kv_shape, call.kv_shape))
    return q, k, v, draw(call.q_shape)


def _forward_backward_seconds(backend: str, call: AttentionCall, q: Tensor, k: Tensor, v: Tensor,
                              grad: Tensor) -> float:
    synchronize = torch.cuda.synchronize if call.device.type == "cuda" else (lambda: None)
    synchronize()
    start = time.perf_counter()
    out = attention(q, k, v, call.segments, backend)
    torch.autograd.grad(out, (q, k, v), grad)
    synchronize()
    return time.perf_counter() - start


def describe(results: dict[str, float | str]) -> str:
    """`measure_backends`' results for a log line: "sdpa 9.35 ms, blockwise refused (why)"."""
    return ", ".join(f"{name} {t * 1e3:.2f} ms" if isinstance(t, float) else f"{name} refused ({t})"
                     for name, t in results.items())


def fastest(results: dict[str, float | str]) -> str:
    """The measured backend with the least time (a refusing one is never chosen)."""
    timed = [(t, name) for name, t in results.items() if not isinstance(t, str)]
    if not timed:
        raise RuntimeError(f"no attention backend ran the first pack's attention calls: {results}")
    return min(timed)[1]

"""Ulysses context parallel: N ranks split one packed batch by tokens and attention by heads.

Token layout (see `pan.models.packing`): cp rank r of N holds joint tokens j with j % N == r. All
per-token work (linears, norms, RoPE, modulation) runs on that share unchanged. Attention needs whole
sequences, so `UlyssesAttention` trades tokens for heads around it:

    q, k, v [L_r, H, d] on rank r  --all-to-all-->  [L, H/N, d] on every rank (whole sequences,
    heads of group r)  --inner attention-->  [L, H/N, d]  --all-to-all-->  [L_r, H, d]

The inner attention gets `segments.unsharded()`: whole sequences with their attention rule (the
block-causal `frames` and their frame schedule describe whole segments, never one rank's share), so
any backend applies the rule after the exchange exactly as in one process.

Row counts L_r differ between ranks (lengths need not be multiples of N), so the exchanges use split
sizes. Traffic: every element of q, k, v and of the output crosses the network once, except the 1/N
that stays on its own rank: one attention call moves 4 * (N - 1) / N * L * H * d elements summed over
the group (L = whole sequence), and its backward the same again.

`ContextParallel` brings the batch to the group: only cp rank 0 reads data and runs the frozen
encoders; it broadcasts the prepared micro-batch and every rank keeps its strided share.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor, nn

from pan.models.attention import InnerAttention
from pan.models.packing import AttnSegments, PackInfo

# ------------------------------------------------------------------------------------------------
# Attention
# ------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """Which rows of the full sequence every rank of the cp group holds (for one AttnSegments)."""
    counts: list[int]    # rows held by each cp rank
    rows: Tensor         # [L] the held rows of rank 0, then rank 1, ... (a permutation of 0..L-1)
    inverse: Tensor      # [L] position in `rows` of each full-sequence row


class ShardLayouts:
    """Layouts of the last few AttnSegments seen, shared by all Ulysses modules of a model.

    A packed batch has two sequence sets (joint and caption) used by every block, so the layout is
    gathered once per micro-batch, not once per attention call (and not again when activation
    checkpointing recomputes a block). Entries are keyed by the identity of `local_index`, which is
    kept alive here, so an id cannot be reused while cached.
    """

    def __init__(self, group: dist.ProcessGroup, capacity: int = 8):
        self.group = group
        self.capacity = capacity
        self._entries: OrderedDict[int, tuple[Tensor, ShardLayout]] = OrderedDict()

    def get(self, segments: AttnSegments) -> ShardLayout:
        key = id(segments.local_index)
        hit = self._entries.get(key)
        if hit is not None and hit[0] is segments.local_index:
            return hit[1]
        layout = self._gather(segments.local_index, segments.total)
        self._entries[key] = (segments.local_index, layout)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        return layout

    @torch.compiler.disable
    def _gather(self, local_index: Tensor, total: int) -> ShardLayout:
        size = dist.get_world_size(self.group)
        count = torch.tensor([local_index.numel()], device=local_index.device)
        counts = [torch.empty_like(count) for _ in range(size)]
        dist.all_gather(counts, count, group=self.group)
        counts = [int(c.item()) for c in counts]
        padded = local_index.new_zeros(max(counts))
        padded[:local_index.numel()] = local_index
        held = [torch.empty_like(padded) for _ in range(size)]
        dist.all_gather(held, padded, group=self.group)
        rows = torch.cat([h[:n] for h, n in zip(held, counts)])
        if rows.numel() != total:
            raise ValueError(f"the cp ranks hold {rows.numel()} rows of a {total}-row sequence: they "
                             "were not sharded from the same PackInfo with the same cp size.")
        return ShardLayout(counts, rows, torch.argsort(rows))


def _all_to_all(x: Tensor, output_splits: list[int], input_splits: list[int],
                group: dist.ProcessGroup) -> Tensor:
    """Differentiable all_to_all_single along dim 0 (its backward is the reverse exchange)."""
    return funcol.wait_tensor(funcol.all_to_all_single(x.contiguous(), output_splits, input_splits,
                                                       group))


class UlyssesAttention(nn.Module):
    """Wraps a block's inner attention: trades tokens for heads, attends whole sequences, trades back.

    Input and output are this rank's rows `[L_r, H, d]`, in the order of `segments.local_index`.
    Unsharded segments (every rank holds the whole sequence, e.g. validation sampling) pass straight
    through to the inner attention.
    """

    def __init__(self, inner: nn.Module, group: dist.ProcessGroup, layouts: ShardLayouts | None = None):
        super().__init__()
        self.inner = inner
        self.group = group
        self.size = dist.get_world_size(group)
        self.layouts = layouts or ShardLayouts(group)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, segments: AttnSegments) -> Tensor:
        if not segments.is_sharded:
            return self.inner(q, k, v, segments)
        n = self.size
        rows, heads, head_dim = q.shape
        if heads % n:
            raise ValueError(f"{heads} attention heads cannot be split over {n} context-parallel ranks.")
        layout = self.layouts.get(segments)

        # [3, L_r, H, d] -> [N, 3, L_r, H/N, d]: block g goes to rank g (its head group).
        qkv = torch.stack([q, k, v]).unflatten(2, (n, heads // n)).permute(2, 0, 1, 3, 4)
        received = _all_to_all(qkv.reshape(n * 3 * rows, heads // n, head_dim),
                               [3 * c for c in layout.counts], [3 * rows] * n, self.group)
        # From rank s: [3, L_s, H/N, d]; concatenated in rank order, then put in sequence order.
        chunks = received.split([3 * c for c in layout.counts])
        full = torch.cat([c.unflatten(0, (3, -1)) for c in chunks], dim=1)      # [3, L, H/N, d]
        full = full.index_select(1, layout.inverse)
        out = self.inner(full[0], full[1], full[2], segments.unsharded())        # [L, H/N, d]

        # Back: rank s gets its rows of this head group; we get our rows of every head group.
        out = _all_to_all(out.index_select(0, layout.rows), [rows] * n, layout.counts, self.group)
        return out.unflatten(0, (n, rows)).permute(1, 0, 2, 3).reshape(rows, heads, head_dim)

    def extra_repr(self) -> str:
        return f"cp_size={self.size}"


def attach_ulysses(model: nn.Module, group: dist.ProcessGroup) -> int:
    """Wrap every `inner_attention` of `model` in `UlyssesAttention` (one shared layout cache).

    Returns the number of attention calls wrapped. Parameter names do not change (attention has none).
    """
    layouts = ShardLayouts(group)
    wrapped = 0
    for module in list(model.modules()):
        inner = getattr(module, "inner_attention", None)
        if isinstance(inner, InnerAttention):
            module.inner_attention = UlyssesAttention(inner, group, layouts)
            wrapped += 1
    if not wrapped:
        raise ValueError(f"{type(model).__name__} has no `inner_attention` submodule to make context "
                         "parallel.")
    return wrapped


# ------------------------------------------------------------------------------------------------
# Batches
# ------------------------------------------------------------------------------------------------

class ContextParallel:
    """The cp group of this process: cp rank 0 prepares each micro-batch, every rank trains on its share.

    `device` is where the broadcast runs (the process's GPU under NCCL, CPU under gloo).
    """

    def __init__(self, rank: int, size: int, group: dist.ProcessGroup | None,
                 device: torch.device = torch.device("cpu")):
        self.rank, self.size, self.group, self.device = rank, size, group, device

    def distribute(self, inputs, split: dict[str, str] | None = None):
        """cp rank 0 passes its prepared micro-batch (whole), the others None; every rank gets back its
        share. The micro-batch type says how each tensor field is split in `CP_FIELDS`: "video" rows
        (rows `pack.video_index`), "text" rows (`pack.text_index`), or "whole" (per-sample tensors such
        as timesteps and pooled text, kept whole on every rank). `split` (given on cp rank 0) replaces
        `CP_FIELDS` for this micro-batch: a field whose kind depends on its contents (per-sample or
        per-token timesteps).

        Every rank rebuilds the pack from the sample layouts cp rank 0 sends (clips, RoPE positions,
        trained clips, attention rule), then takes its share. Counters (`samples`, `tokens`,
        `bad_samples`) stay on cp rank 0 only, so sums over all ranks count each sample once.
        """
        if self.size == 1:
            return inputs
        if (inputs is None) != (self.rank != 0):
            raise ValueError("exactly cp rank 0 provides the micro-batch to distribute.")
        meta = [None]
        if self.rank == 0:
            if inputs.pack.cp_size != 1:
                raise ValueError("distribute() takes a whole micro-batch, not a cp share.")
            split = type(inputs).CP_FIELDS if split is None else split
            fields = {f.name: getattr(inputs, f.name) for f in dataclasses.fields(inputs)}
            meta = [{
                "type": type(inputs),  # pickled by reference: the receivers import its module
                "split": split,
                "shapes": {k: (tuple(fields[k].shape), fields[k].dtype) for k in split},
                "layouts": inputs.pack.layouts,
                "scalars": {k: v for k, v in fields.items() if k not in split and k != "pack"}}]
        dist.broadcast_object_list(meta, group=self.group, group_src=0, device=self.device)
        meta = meta[0]
        pack = PackInfo.from_layouts(meta["layouts"], device=self.device).shard(self.rank, self.size)
        rows = {"video": pack.video_index, "text": pack.text_index, "whole": None}
        shares = {}
        for name, kind in meta["split"].items():
            shape, dtype = meta["shapes"][name]
            t = (getattr(inputs, name).to(self.device, dtype).contiguous() if self.rank == 0
                 else torch.empty(shape, dtype=dtype, device=self.device))
            dist.broadcast(t, group=self.group, group_src=0)
            shares[name] = t if rows[kind] is None else t.index_select(0, rows[kind])
        scalars = dict(meta["scalars"])
        if self.rank:
            scalars.update(samples=0, tokens=0, bad_samples=0)
        return meta["type"](pack=pack, **shares, **scalars)

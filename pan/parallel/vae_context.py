"""VAE context parallel: the frames of one clip split in time over the ranks of a context group.

The causal video VAE's only operations that cross frames are its causal convolutions (norms and
attention work per frame). A convolution with temporal kernel k reads, for its first output, up to
k - 1 frames before the first frame it owns. So a clip can be cut in time into consecutive shares,
one per rank of a group of `context_size` ranks: rank r encodes and decodes its own frames, and each
causal conv receives from rank r - 1 the input frames its first output still needs (its "halo"),
exactly the frames a chunked encode carries from one temporal window to the next
(`pan.models.causal_vae_blocks.TemporalWindows`). Rank 0 reads the conv's zero padding instead. The
backward pass sends the halo's gradient back. The result is the single-rank result: each conv
computes the same sums, only on another rank (tested against one rank in float64 and fp32).

Frame rule. The encoder compresses time by f = 2**n (n stride-2 stages, 8 in the released model):
latent frame 0 is pixel frame 0 alone, latent frame j >= 1 is pixel frames f(j-1)+1 .. fj. A rank
must decode exactly the pixel frames it encoded (its loss compares the two), so the split is made on
latent frames: rank 0 holds latent frame 0 and q_0 more, rank r holds q_r, every q_r >= 1:

    T = 1 + f * k frames with k >= context_size; rank 0 gets 1 + f q_0 frames, rank r > 0 f q_r,
    with the k latent frames after the first dealt as evenly as possible (balanced when
    k % context_size == 0, i.e. T = 1 + f k' context_size: 33 frames for context 2 at f = 8).

The original's code needs the balanced case and passes only fixed-size halos (its docs say
`NUM_FRAMES = 17 * CONTEXT_SIZE + 1`, 35 for context 2, which breaks the rule; its script's 33 obeys
it). Here the halo is whatever the previous rank's input leaves over, so an uneven split works too.

Communication: per causal conv (time kernel > 1), one point-to-point message of the halo (at most
k - 1 frames of that layer's activations) from each rank to the next, in a chain (rank r forwards a
frame it received when its own share is shorter than the halo), and the same back in the backward.
The model code is unchanged: `attach_halo_hooks(model)` once, then pass `ContextWindows(group)` as
the `windows` argument of the encoder and decoder.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from pan.models.causal_vae_blocks import CausalConv3d, TemporalWindows

# ----------------------------------------------------------------------------------------------
# The group and the frame split
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ContextGroup:
    """One rank's view of its context group: `size` consecutive global ranks `ranks`."""
    rank: int                       # rank within the group (0 holds the clip's first frame)
    size: int
    ranks: tuple[int, ...]          # global ranks of the group, in frame order
    group: object = None            # the torch.distributed process group

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.size - 1

    @classmethod
    def build(cls, context_size: int) -> ContextGroup | None:
        """This process's group of `context_size` consecutive ranks (collective: every rank calls
        it); None without context parallel."""
        if context_size == 1:
            return None
        if not dist.is_initialized() or dist.get_world_size() % context_size:
            raise ValueError(f"context_size {context_size} needs a process group whose size it divides")
        group, _ = dist.new_subgroups(group_size=context_size)
        rank = dist.get_rank()
        start = rank - rank % context_size
        return cls(rank % context_size, context_size, tuple(range(start, start + context_size)), group)


def latent_split(latent_frames: int, size: int) -> list[int]:
    """Latent frames per rank: rank 0 holds frame 0 and a share of the others; the others are dealt
    in consecutive runs, as evenly as possible (earlier ranks take the extra ones)."""
    rest = latent_frames - 1
    if size < 1 or rest < size:
        raise ValueError(f"{latent_frames} latent frames cannot give each of {size} ranks one after the "
                         "first")
    shares = [rest // size + (1 if r < rest % size else 0) for r in range(size)]
    shares[0] += 1
    return shares


def frame_split(num_frames: int, temporal_factor: int, size: int) -> list[int]:
    """Pixel frames per rank for a clip of `num_frames` (= 1 + temporal_factor * k, k >= size)."""
    problem = context_frames_problem(num_frames, temporal_factor, size)
    if problem:
        raise ValueError(problem)
    latent = latent_split((num_frames - 1) // temporal_factor + 1, size)
    return [1 + temporal_factor * (latent[0] - 1)] + [temporal_factor * q for q in latent[1:]]


def frame_range(num_frames: int, temporal_factor: int, size: int, rank: int) -> tuple[int, int]:
    """[start, stop) of the pixel frames rank `rank` holds."""
    split = frame_split(num_frames, temporal_factor, size)
    start = sum(split[:rank])
    return start, start + split[rank]


def latent_range(num_frames: int, temporal_factor: int, size: int, rank: int) -> tuple[int, int]:
    """[start, stop) of the latent frames rank `rank` holds."""
    split = latent_split((num_frames - 1) // temporal_factor + 1, size)
    start = sum(split[:rank])
    return start, start + split[rank]


def context_frames_problem(num_frames: int, temporal_factor: int, size: int) -> str | None:
    """Why a clip of `num_frames` cannot be split over `size` ranks (None when it can)."""
    if num_frames < 1 or (num_frames - 1) % temporal_factor:
        return (f"a clip needs 1 + {temporal_factor}k frames (the VAE's temporal compression), got "
                f"{num_frames}")
    k = (num_frames - 1) // temporal_factor
    if k < size:
        return (f"{num_frames} frames hold {k} latent frames after the first, fewer than the {size} "
                f"ranks of a context group (each needs one): use at least "
                f"{1 + temporal_factor * size} frames")
    return None


# ----------------------------------------------------------------------------------------------
# The halo exchange, as TemporalWindows
# ----------------------------------------------------------------------------------------------

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]  # what a halo may hold


class _RecvHalo(torch.autograd.Function):
    """Forward: receive the halo from the previous rank. Backward: send its gradient back."""

    @staticmethod
    def forward(ctx, anchor: Tensor, group: ContextGroup, tag: int, device: torch.device) -> Tensor:
        ctx.group, ctx.tag = group, tag
        # header: shape [B, C, t, H, W], dtype, whether the sender's frames carry gradients
        header = torch.empty(7, dtype=torch.int64, device=device)
        dist.recv(header, src=group.ranks[group.rank - 1], group=group.group, tag=tag)
        *shape, dtype, differentiable = header.tolist()
        halo = torch.empty(shape, dtype=_DTYPES[dtype], device=device)
        dist.recv(halo, src=group.ranks[group.rank - 1], group=group.group, tag=tag)
        if not differentiable:  # e.g. the pixels themselves: no gradient goes back for them
            ctx.mark_non_differentiable(halo)
        return halo

    @staticmethod
    def backward(ctx, grad: Tensor):
        group = ctx.group
        dist.send(grad.contiguous(), dst=group.ranks[group.rank - 1], group=group.group, tag=ctx.tag)
        return None, None, None, None


class _SendHalo(torch.autograd.Function):
    """Forward: send the next rank its halo; returns a token that joins the conv's output, so that
    the backward (receive the halo's gradient from the next rank) runs."""

    @staticmethod
    def forward(ctx, tail: Tensor, group: ContextGroup, tag: int) -> Tensor:
        ctx.group, ctx.tag, ctx.shape = group, tag, tail.shape
        tail = tail.contiguous()
        dst = group.ranks[group.rank + 1]
        header = [*tail.shape, _DTYPES.index(tail.dtype), int(ctx.needs_input_grad[0])]
        dist.send(torch.tensor(header, dtype=torch.int64, device=tail.device), dst=dst,
                  group=group.group, tag=tag)
        dist.send(tail, dst=dst, group=group.group, tag=tag)
        return tail.new_zeros(())

    @staticmethod
    def backward(ctx, _token_grad: Tensor):
        group = ctx.group
        grad = torch.empty(ctx.shape, dtype=_token_grad.dtype, device=_token_grad.device)
        dist.recv(grad, src=group.ranks[group.rank + 1], group=group.group, tag=ctx.tag)
        return grad, None, None


class _Join(torch.autograd.Function):
    """output unchanged; in backward also a (zero) gradient for `token`, which triggers its node.

    The output is the conv's own tensor with its history rebased (`mark_dirty`), not a view of it:
    no copy, and the block that returns it hands FSDP2 no view (whose hook an in-place op would drop)."""

    @staticmethod
    def forward(ctx, output: Tensor, token: Tensor) -> Tensor:
        ctx.mark_dirty(output)  # (nothing but this join holds the conv's fresh output)
        return output

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, grad.new_zeros(())


@dataclass
class _HaloFronts:
    """The `front` mapping of ContextWindows: reading a conv's front receives its halo from the
    previous rank; storing what the next window needs sends it to the next rank."""
    group: ContextGroup
    anchor: Tensor
    pending: dict = field(default_factory=dict)   # conv -> token to join into its output
    tags: dict = field(default_factory=dict)      # conv -> message tag (its order in the pass)

    def _tag(self, conv: nn.Module) -> int:
        return self.tags.setdefault(conv, len(self.tags))

    def get(self, conv: nn.Module, default=None):
        if self.group.first:
            return default  # the conv's own zero padding, as in one shot
        return _RecvHalo.apply(self.anchor, self.group, self._tag(conv), self.anchor.device)

    def __setitem__(self, conv: nn.Module, tail: Tensor) -> None:
        if not self.group.last:
            self.pending[conv] = _SendHalo.apply(tail, self.group, self._tag(conv))


class ContextWindows(TemporalWindows):
    """`windows` for one encoder or decoder pass of one rank of a context group. Rank 0 holds the
    clip's first frame (the decoder drops the extra frame of its temporal up-sampling there only)."""

    def __init__(self, group: ContextGroup, device: torch.device, dtype: torch.dtype = torch.float32):
        super().__init__()
        anchor = torch.zeros((), device=device, dtype=dtype, requires_grad=torch.is_grad_enabled())
        self.front = _HaloFronts(group, anchor)
        self.first = group.first


def _join_sent_halo(conv: nn.Module, args: tuple, output: Tensor):
    windows = args[1] if len(args) > 1 else None
    if isinstance(windows, ContextWindows):
        token = windows.front.pending.pop(conv, None)
        if token is not None:
            return _Join.apply(output, token)
    return None


def attach_halo_hooks(model: nn.Module) -> int:
    """Let `ContextWindows` passes of `model` send halos with gradients: a forward hook on every
    causal conv with a temporal kernel joins the sent halo into the conv's output. Inert for any
    other `windows` (or none). Returns the number of convs hooked.

    Activation checkpointing must stay off for such a model: recomputing a block would exchange
    its halos a second time."""
    hooked = 0
    for module in model.modules():
        if isinstance(module, CausalConv3d) and module.time_pad > 0:
            module.register_forward_hook(_join_sent_halo)
            hooked += 1
    return hooked

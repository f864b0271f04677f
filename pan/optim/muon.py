"""Muon (MomentUm Orthogonalized by Newton-Schulz) for the hidden 2-D weight matrices.

Per matrix W with gradient G (Keller Jordan 2024; Liu et al. 2025, "Muon is Scalable for LLM Training"):

    B <- mu B + (1 - mu) G                  momentum (EMA form, as torch.optim.Muon)
    U <- (1 - mu) G + mu B                  Nesterov look-ahead
    O <- NewtonSchulz5(U)                   ~ U V^T of U's SVD (singular values pushed towards 1)
    W <- W (1 - lr wd) - lr 0.2 sqrt(max(A, B)) O     decoupled weight decay, RMS-matched step

Why our own instead of `torch.optim.Muon` (torch 2.13): that one always iterates in bf16, which is
~50x slower than fp32 on CPUs without native bf16 (AVX2: 47 s vs 0.87 s per step for 16M
parameters), and on FSDP2 DTensors it runs the iteration through DTensor ops (~15 all-gathers per
matrix, bf16-level drift from the unsharded result). Here the iteration dtype follows the device
(fp32 on CPU, so CPU runs are exact to fp32 tolerance and fast on any CPU; bf16 on CUDA;
overridable) and a sharded matrix is gathered once, orthogonalised whole, and re-sharded.

Learning rate: an orthogonalised A x B update has RMS ~ 1/sqrt(max(A, B)), AdamW's update RMS is
typically 0.2-0.4. Scaling Muon's step by 0.2 sqrt(max(A, B)) (Moonshot's "match AdamW RMS" rule)
gives it RMS ~0.2, so one `learning_rate` and `weight_decay` tuned for AdamW serve both optimisers.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

# Quintic Newton-Schulz coefficients that maximise the slope at zero (Keller Jordan's Muon).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5


def default_ns_dtype(device: torch.device) -> torch.dtype:
    """bf16 on CUDA (fast tensor cores); fp32 elsewhere (bf16 matmul is ~90x slower on AVX2 CPUs)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def newton_schulz(g: Tensor, steps: int = NS_STEPS,
                  coefficients: tuple[float, float, float] = NS_COEFFICIENTS, eps: float = 1e-7,
                  dtype: torch.dtype | None = None) -> Tensor:
    """Approximate orthogonalisation U V^T of a matrix g [A, B] (quintic Newton-Schulz)."""
    a, b, c = coefficients
    x = g.to(dtype or default_ns_dtype(g.device))
    tall = g.size(0) > g.size(1)
    if tall:  # iterate on the wide orientation: the Gram matrix x x^T is then the smaller one
        x = x.T
    x = x / x.norm().clamp(min=eps)  # Frobenius norm >= spectral norm: singular values now <= 1
    for _ in range(steps):
        gram = x @ x.T                                     # [min, min]
        x = a * x + (b * gram + c * gram @ gram) @ x       # p(s) = a s + b s^3 + c s^5 on singular values
    if tall:
        x = x.T
    return x.to(g.dtype)


def match_adamw_rms_scale(shape: torch.Size) -> float:
    """Moonshot's learning-rate factor 0.2 sqrt(max(A, B)) for an A x B matrix (see module docstring)."""
    return 0.2 * math.sqrt(max(shape[0], shape[1]))


def scaled_orthogonal(m: Tensor, row_splits: tuple[int, ...] | None, steps: int,
                      coefficients: tuple[float, float, float], eps: float,
                      dtype: torch.dtype | None) -> Tensor:
    """Muon's update direction for a whole matrix: each row block orthogonalised on its own and scaled
    by its RMS-matching factor. `row_splits` lists the row counts of matrices fused into one
    parameter (e.g. q/k/v stacked); None = one matrix."""
    blocks = m.split(list(row_splits)) if row_splits is not None else (m,)
    return torch.cat([newton_schulz(b, steps, coefficients, eps, dtype) * match_adamw_rms_scale(b.shape)
                      for b in blocks])


def orthogonal_update(update: Tensor, orthogonalise: Callable[[Tensor], Tensor]) -> Tensor:
    """`orthogonalise` (a whole-matrix `scaled_orthogonal`), also when `update` is a sharded DTensor
    of any layout.

    The iteration mixes all rows, so a shard cannot be orthogonalised alone: gather the full matrix
    once, orthogonalise it (every rank computes the same result), and keep this rank's shard, so the
    sharded step equals the unsharded one. `ShardedOrthogonaliser` spreads that work over the ranks
    for the usual row-sharded layouts.
    """
    if not isinstance(update, DTensor):
        return orthogonalise(update)
    full = orthogonalise(update.full_tensor())
    # src_data_rank=None: every rank holds the same `full`, so each slices its own shard locally.
    return distribute_tensor(full, update.device_mesh, update.placements, src_data_rank=None)


def _row_shard_dim(t: DTensor) -> int | None:
    """The mesh dim over which `t` is split by rows when every other mesh dim replicates it (FSDP2's
    layouts), else None."""
    dims = [i for i, pl in enumerate(t.placements) if isinstance(pl, Shard) and pl.dim == 0]
    others_replicate = all(isinstance(pl, Replicate) for i, pl in enumerate(t.placements) if i not in dims)
    return dims[0] if len(dims) == 1 and others_replicate else None


def _shard_rows(rows: int, ranks: int) -> list[int]:
    """Rows of each rank's shard under Shard(0) (torch.chunk: ceil-sized, trailing ranks may be empty)."""
    size = -(-rows // ranks)
    return [max(0, min(size, rows - i * size)) for i in range(ranks)]


class ShardedOrthogonaliser:
    """Newton-Schulz for row-sharded matrices with the work split over the ranks that hold them.

    With every rank orthogonalising every matrix (`orthogonal_update`), each of N ranks repeats the
    whole optimizer's Newton-Schulz work: for a 29B model that is seconds per step on every GPU.
    Here the matrices are taken N at a time; each is sent, shard by shard, to one owner rank (one
    all-to-all), the owner orthogonalises it whole, and a second all-to-all hands every rank its
    rows of each result. Each rank computes 1/N of the matrices and moves about the same bytes as
    the all-gather it replaces, and the result is the same as the unsharded step to the bit. Under
    HSDP (R replicas of the shard group) the replicas take different matrices, R x N at a time,
    and all-gather their rows of the results over the replica group: 1/(R N) of the work each.
    DDP is HSDP with shards of one rank: each rank orthogonalises whole matrices it already holds.
    """

    def __init__(self, mesh, shard_dim: int):
        self.group = mesh.get_group(shard_dim)
        self.ranks = mesh.size(shard_dim)
        self.me = mesh.get_local_rank(shard_dim)
        # HSDP: the replicas (one more mesh dim) take different matrices and swap the results.
        replicate = [d for d in range(mesh.ndim) if d != shard_dim]
        self.replica_group = mesh.get_group(replicate[0]) if len(replicate) == 1 else None
        self.replicas = mesh.size(replicate[0]) if self.replica_group is not None else 1
        self.replica = mesh.get_local_rank(replicate[0]) if self.replica_group is not None else 0

    def __call__(self, updates: list[DTensor], orthogonalise) -> list[DTensor]:
        out = []
        per_round = self.ranks * self.replicas
        for start in range(0, len(updates), per_round):
            batch = updates[start:start + per_round]
            # Replica r orthogonalises matrices [r * ranks, (r + 1) * ranks) of the batch.
            first = start + self.replica * self.ranks
            mine = updates[first:min(first + self.ranks, start + len(batch))]
            done = self._round(mine, orthogonalise[first:first + len(mine)]) if mine else []
            out += self._from_every_replica(batch, done) if self.replicas > 1 else done
        return out

    def _from_every_replica(self, batch: list[DTensor], done: list[DTensor]) -> list[DTensor]:
        """This rank's shards of every matrix of `batch`, given its shards of its own replica's
        share (`done`): one all-gather over the replicas (padded to the largest share)."""
        shares = [batch[r * self.ranks:(r + 1) * self.ranks] for r in range(self.replicas)]
        sizes = [sum(u.to_local().numel() for u in share) for share in shares]
        flat = torch.cat([d.to_local().reshape(-1) for d in done]) if done else batch[0].to_local().new_empty(0)
        padded = flat.new_zeros(max(sizes))
        padded[:flat.numel()] = flat
        gathered = [torch.empty_like(padded) for _ in range(self.replicas)]
        dist.all_gather(gathered, padded, group=self.replica_group)
        out = []
        for share, size, buffer in zip(shares, sizes, gathered):
            pieces = buffer[:size].split([u.to_local().numel() for u in share])
            out += [DTensor.from_local(piece.view(u.to_local().shape), u.device_mesh, u.placements,
                                       shape=u.shape, stride=u.stride()) for u, piece in zip(share, pieces)]
        return out

    def _round(self, updates: list[DTensor], orthogonalise) -> list[DTensor]:
        """Up to `ranks` matrices; matrix j is orthogonalised on rank j of the shard group."""
        rows = [_shard_rows(u.shape[0], self.ranks) for u in updates]
        locals_ = [u.to_local() for u in updates]
        mine = self.me < len(updates)
        # 1. Shards to owners: rank i sends its rows of matrix j to rank j.
        received = self._exchange(
            [t.reshape(-1) for t in locals_] + [locals_[0].new_empty(0)] * (self.ranks - len(updates)),
            [r * updates[self.me].shape[1] for r in rows[self.me]] if mine else [0] * self.ranks)
        # 2. The owner's matrix, whole, orthogonalised (its rows arrive in rank = row order).
        result = None
        if mine:
            whole = torch.cat(received).view(updates[self.me].shape)
            result = orthogonalise[self.me](whole).to(locals_[0].dtype)
        # 3. Rows back: the owner sends rank i its rows of the result.
        pieces = list(result.split(rows[self.me])) if mine else [locals_[0].new_empty(0)] * self.ranks
        back = self._exchange([p.reshape(-1) for p in pieces],
                              [rows[j][self.me] * u.shape[1] for j, u in enumerate(updates)] + [0] * (self.ranks - len(updates)))
        return [DTensor.from_local(back[j].view(locals_[j].shape), u.device_mesh, u.placements,
                                   shape=u.shape, stride=u.stride()) for j, u in enumerate(updates)]

    def _exchange(self, send: list[Tensor], recv_sizes: list[int]) -> list[Tensor]:
        """all-to-all: send[i] goes to rank i; returns the pieces received, by sender."""
        out = send[0].new_empty(sum(recv_sizes))
        dist.all_to_all_single(out, torch.cat(send), output_split_sizes=recv_sizes,
                               input_split_sizes=[t.numel() for t in send], group=self.group)
        return list(out.split(recv_sizes))


def _newton_schulz_of(group: dict) -> Callable[[Tensor], Tensor]:
    """A param group's Newton-Schulz settings as one whole-matrix function."""
    return functools.partial(scaled_orthogonal, row_splits=group["row_splits"], steps=group["ns_steps"],
                             coefficients=group["ns_coefficients"], eps=group["eps"], dtype=group["ns_dtype"])


def orthogonal_updates(updates: list[Tensor], groups: list[dict]) -> list[Tensor]:
    """Muon's direction for each update (its param group gives the Newton-Schulz settings); row-
    sharded DTensors of one mesh and dtype go through one ShardedOrthogonaliser."""
    fns = [_newton_schulz_of(g) for g in groups]
    out: list[Tensor | None] = [None] * len(updates)
    batches: dict[tuple, list[int]] = {}
    for i, u in enumerate(updates):
        shard_dim = _row_shard_dim(u) if isinstance(u, DTensor) and dist.is_initialized() else None
        if shard_dim is None:
            out[i] = orthogonal_update(u, fns[i])
        else:
            batches.setdefault((id(u.device_mesh), shard_dim, u.dtype), []).append(i)
    for (_, shard_dim, _), idx in batches.items():
        sharded = ShardedOrthogonaliser(updates[idx[0]].device_mesh, shard_dim)
        for i, result in zip(idx, sharded([updates[i] for i in idx], [fns[i] for i in idx])):
            out[i] = result
    return out


class Muon(torch.optim.Optimizer):
    """Muon for 2-D parameters (plain tensors or FSDP2 DTensors); see the module docstring.

    `ns_dtype` is the Newton-Schulz iteration dtype; None picks it per device (`default_ns_dtype`).
    A param group may set `row_splits` (row counts summing to the rows of each of its matrices) for
    parameters that stack several matrices, such as a fused q/k/v projection: each block then gets
    its own orthogonalisation and lr factor, as if the matrices were separate parameters.
    """

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.0, momentum: float = 0.95,
                 nesterov: bool = True, ns_steps: int = NS_STEPS,
                 ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS, eps: float = 1e-7,
                 ns_dtype: torch.dtype | None = None):
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_steps=ns_steps, ns_coefficients=tuple(ns_coefficients), eps=eps,
                        ns_dtype=ns_dtype, row_splits=None)
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(f"Muon takes 2-D matrices only, got a parameter of shape "
                                     f"{tuple(p.shape)}; optimise it with AdamW")
                splits = group["row_splits"]
                if splits is not None and sum(splits) != p.shape[0]:
                    raise ValueError(f"row_splits {splits} do not add up to the {p.shape[0]} rows "
                                     f"of a parameter of shape {tuple(p.shape)}")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params, groups, updates = [], [], []
        for group in self.param_groups:
            momentum = group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - momentum)
                params.append(p)
                groups.append(group)
                updates.append(p.grad.lerp(buf, momentum) if group["nesterov"] else buf)
        # All matrices at once, so that sharded ones can share the Newton-Schulz work out.
        for p, group, direction in zip(params, groups, orthogonal_updates(updates, groups)):
            p.mul_(1 - group["lr"] * group["weight_decay"])
            p.add_(direction, alpha=-group["lr"])
        return loss

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

import math

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, distribute_tensor

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


def orthogonal_update(update: Tensor, row_splits: tuple[int, ...] | None, steps: int,
                      coefficients: tuple[float, float, float], eps: float,
                      dtype: torch.dtype | None) -> Tensor:
    """`scaled_orthogonal`, also when `update` is a sharded DTensor.

    The iteration mixes all rows, so a shard cannot be orthogonalised alone: gather the full matrix
    once, orthogonalise it (every rank computes the same result), and keep this rank's shard, so the
    sharded step equals the unsharded one.
    """
    if not isinstance(update, DTensor):
        return scaled_orthogonal(update, row_splits, steps, coefficients, eps, dtype)
    full = scaled_orthogonal(update.full_tensor(), row_splits, steps, coefficients, eps, dtype)
    # src_data_rank=None: every rank holds the same `full`, so each slices its own shard locally.
    return distribute_tensor(full, update.device_mesh, update.placements, src_data_rank=None)


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
        for group in self.param_groups:
            lr, wd, momentum = group["lr"], group["weight_decay"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - momentum)
                update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                update = orthogonal_update(update, group["row_splits"], group["ns_steps"],
                                           group["ns_coefficients"], group["eps"], group["ns_dtype"])
                p.mul_(1 - lr * wd)
                p.add_(update, alpha=-lr)
        return loss

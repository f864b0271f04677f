"""Muon on row-sharded DTensors: the Newton-Schulz work is split over the shard group, and the result
is the unsharded step to the bit (real gloo process groups)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import pan.optim.muon as muon_module
from dist_utils import run_distributed
from pan.optim import Muon

# Rows chosen so that shards are uneven and, over 4 ranks, some are empty (2 rows; 5 rows -> 2,2,1,0).
SHAPES = [(5, 6), (7, 3), (2, 9), (12, 4), (3, 3)]
STEPS = 3


def _params_and_grads():
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(*s, generator=g, dtype=torch.float64) for s in SHAPES]
    grads = [[torch.randn(*s, generator=g, dtype=torch.float64) for s in SHAPES] for _ in range(STEPS)]
    return weights, grads


def _train(params, grads_per_step, place):
    opt = Muon([{"params": params[:4]}, {"params": params[4:], "row_splits": (1, 2)}],
               lr=0.05, weight_decay=0.1, momentum=0.9)
    for grads in grads_per_step:
        for p, grad in zip(params, grads):
            p.grad = place(grad)
        opt.step()


def _sharded_run(mesh_shape: tuple[int, ...]) -> dict:
    weights, grads = _params_and_grads()
    names = ("replicate", "shard")[-len(mesh_shape):]
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    placements = [Replicate()] * (len(mesh_shape) - 1) + [Shard(0)]
    place = lambda t: distribute_tensor(t, mesh, placements)  # noqa: E731
    params = [torch.nn.Parameter(place(w)) for w in weights]

    calls = []
    real = muon_module.scaled_orthogonal

    def counting(m, *args, **kwargs):
        calls.append(tuple(m.shape))
        return real(m, *args, **kwargs)

    muon_module.scaled_orthogonal = counting
    try:
        _train(params, grads, place)
    finally:
        muon_module.scaled_orthogonal = real

    plain = [torch.nn.Parameter(w.clone()) for w in weights]
    _train(plain, grads, lambda t: t)
    return {"equal": [torch.equal(p.full_tensor(), q.detach()) for p, q in zip(params, plain)],
            "sharded_calls": len(calls), "rank": dist.get_rank()}


@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2), (2, 1)], ids=["fsdp2", "fsdp4", "hsdp2x2", "ddp2"])
def test_sharded_muon_splits_the_work_and_equals_the_unsharded_step(mesh_shape):
    world = 1
    for n in mesh_shape:
        world *= n
    results = run_distributed(_sharded_run, world, args=(mesh_shape,))
    for r in results:
        assert all(r["equal"]), r
        # Each rank orthogonalises only the matrices it owns, dealt out over every rank (replicas
        # included), never all five.
        owned = len(range(r["rank"], len(SHAPES), world))
        assert r["sharded_calls"] == STEPS * owned, r

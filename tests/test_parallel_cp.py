"""Ulysses attention and the cp batch broadcast on real gloo process groups, against one process."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dist_utils import run_distributed
from pan.models.attention import InnerAttention, sdpa_attention
from pan.models.packing import PackInfo
from pan.parallel.context_parallel import ContextParallel, UlyssesAttention

# Lengths chosen so no segment, and no total, is a multiple of 2 or 4.
GRIDS = [(1, 3, 3), (2, 2, 3), (1, 1, 5)]
TEXT_LENS = [4, 3, 6]
HEADS, HEAD_DIM = 4, 8


def _ulysses_errors(pack: PackInfo, cp_size: int, group) -> dict[str, float]:
    """Max |Ulysses - reference| of outputs and q/k/v gradients, for joint and caption attention."""
    rank = dist.get_rank(group)
    shard = pack.shard(rank, cp_size)
    errors = {}
    for name in ("joint", "text"):
        full, local = getattr(pack, name), getattr(shard, name)
        g = torch.Generator().manual_seed(len(name))
        q, k, v, w = (torch.randn(full.total, HEADS, HEAD_DIM, generator=g) for _ in range(4))
        ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
        ref_out = sdpa_attention(*ref_in, full)
        (ref_out * w).sum().backward()

        idx = local.local_index
        cp_in = [t[idx].clone().requires_grad_() for t in (q, k, v)]
        out = UlyssesAttention(InnerAttention("sdpa"), group)(*cp_in, local)
        (out * w[idx]).sum().backward()
        errors[f"{name}/out"] = (out - ref_out[idx]).abs().max().item()
        for t_name, a, b in zip("qkv", cp_in, ref_in):
            errors[f"{name}/grad_{t_name}"] = (a.grad - b.grad[idx]).abs().max().item()
    # Unsharded segments (e.g. sampling on every rank) pass straight through.
    q = torch.randn(pack.joint.total, HEADS, HEAD_DIM)
    out = UlyssesAttention(InnerAttention("sdpa"), group)(q, q, q, pack.joint)
    errors["unsharded"] = (out - sdpa_attention(q, q, q, pack.joint)).abs().max().item()
    return errors


def _distribute_check(cp_size: int, group) -> dict:
    from pan.recipes.pan.task import ModelInputs

    rank = dist.get_rank(group)
    pack = PackInfo.build(GRIDS, TEXT_LENS)
    g = torch.Generator().manual_seed(0)
    nv, nt = sum(pack.video_lens), sum(TEXT_LENS)
    full = ModelInputs(x=torch.randn(nv, 5, generator=g), target=torch.randn(nv, 2, generator=g),
                       weight=torch.rand(nv, generator=g), timesteps=torch.rand(3, generator=g),
                       text=torch.randn(nt, 7, generator=g), pack=pack, sample_ids=["a", "b", "c"],
                       samples=3, tokens=nv, packing=0.75, bad_samples=2)
    mine = ContextParallel(rank, cp_size, group).distribute(full if rank == 0 else None)
    shard = pack.shard(rank, cp_size)
    ok = (torch.equal(mine.x, full.x[shard.video_index])
          and torch.equal(mine.target, full.target[shard.video_index])
          and torch.equal(mine.weight, full.weight[shard.video_index])
          and torch.equal(mine.text, full.text[shard.text_index])
          and torch.equal(mine.timesteps, full.timesteps)
          and torch.equal(mine.pack.joint.local_index, shard.joint.local_index))
    return {"rows_ok": ok, "counters": (mine.samples, mine.tokens, mine.bad_samples),
            "ids": mine.sample_ids, "packing": mine.packing}


def _worker() -> dict:
    torch.manual_seed(0)
    world = dist.get_world_size()
    pack = PackInfo.build(GRIDS, TEXT_LENS)
    out = {"cp4": _ulysses_errors(pack, world, dist.group.WORLD)}
    # Two cp groups of 2 inside the world of 4: {0, 1} and {2, 3}.
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = pairs[dist.get_rank() // 2]
    out["cp2"] = _ulysses_errors(pack, 2, pair)
    out["distribute"] = _distribute_check(2, pair)
    return out


def test_ulysses_matches_full_attention_and_distribute_shares_the_batch():
    results = run_distributed(_worker, world_size=4)
    for rank, res in enumerate(results):
        for layout in ("cp4", "cp2"):
            for key, err in res[layout].items():
                assert err < 1e-5, f"rank {rank} {layout} {key}: {err}"
        d = res["distribute"]
        assert d["rows_ok"], f"rank {rank} got the wrong rows"
        assert d["ids"] == ["a", "b", "c"] and d["packing"] == 0.75
        cp_rank = rank % 2
        assert d["counters"] == ((3, sum(t * h * w for t, h, w in GRIDS), 2) if cp_rank == 0
                                 else (0, 0, 0))

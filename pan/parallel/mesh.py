"""The device mesh of a run: dp_replicate x dp_shard x cp, and the groups each part of pan needs.

Rank layout (row-major, cp fastest): rank = (replica * dp_shard + shard) * cp + cp_rank. So a cp group
is `cp` consecutive ranks (inside one node when cp divides the ranks per node), a shard group is one
node under hybrid shard, and replicas are nodes.

Who uses which dimension:
- data: every dp rank (dp_replicate x dp_shard) reads its own share; the cp ranks of a dp rank share
  one micro-batch (cp rank 0 reads it, see `ContextParallel`).
- parameters: cp ranks hold the same parameters, so FSDP shards over dp_shard x cp flattened and
  replicates over dp_replicate (`fsdp_mesh`); gradients are summed over all of them.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from pan.parallel.dims import ParallelDims
from pan.parallel.world import World

MESH_DIMS = ("dp_replicate", "dp_shard", "cp")


def build_mesh(dims: ParallelDims, world: World) -> DeviceMesh | None:
    """The 3-D mesh (dp_replicate, dp_shard, cp) over the default process group; None for a world of one."""
    if dims.world_size == 1:
        return None
    if dist.get_world_size() != dims.world_size:
        raise ValueError(f"the process group has {dist.get_world_size()} ranks but the layout "
                         f"expects {dims.world_size}.")
    return init_device_mesh(world.device.type, (dims.dp_replicate, dims.dp_shard, dims.cp),
                            mesh_dim_names=MESH_DIMS)


def fsdp_mesh(mesh: DeviceMesh, dims: ParallelDims, data_parallel_mode: str) -> DeviceMesh:
    """The mesh FSDP2 places parameters on: every rank, as (replicate,) shard.

    fsdp: 1-D over dp_shard x cp (FSDP), or 2-D (dp_replicate, dp_shard x cp) under hybrid shard (HSDP).
    ddp: 2-D (all ranks, 1): HSDP with shards of one rank, i.e. every rank keeps whole parameters
    and gradients are all-reduced; parameter names and DCP behave exactly as under fsdp.
    """
    world = mesh._flatten("world")  # cp is the fastest dim, so shard x cp ranks are contiguous
    if data_parallel_mode == "ddp":
        return world._unflatten(0, (dims.world_size, 1), ("dp_replicate_cp", "dp_shard"))
    hsdp = world._unflatten(0, (dims.dp_replicate, dims.dp_shard * dims.cp),
                            ("dp_replicate", "dp_shard_cp"))
    return hsdp if dims.dp_replicate > 1 else hsdp["dp_shard_cp"]


def cp_group(mesh: DeviceMesh | None) -> dist.ProcessGroup | None:
    return None if mesh is None else mesh["cp"].get_group()


def cp_rank(mesh: DeviceMesh | None) -> int:
    return 0 if mesh is None else mesh["cp"].get_local_rank()

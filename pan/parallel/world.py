"""The processes of a run as torchrun starts them: process group, device, and who reads data."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class World:
    rank: int
    size: int
    local_rank: int
    local_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


def init_world() -> World:
    """Start the default process group when torchrun launched several processes (NCCL on GPUs, gloo on
    CPU); a plain `python train.py` is a world of one and starts none."""
    rank = int(os.environ.get("RANK", 0))
    size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", size))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        # The validated eager mode keeps NCCL's async error handling on: a hung collective aborts
        # the job instead of blocking the whole allocation.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    else:
        device = torch.device("cpu")
    if size > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    return World(rank, size, local_rank, local_size, device)


def close_world() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()

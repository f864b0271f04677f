"""The processes of a run as torchrun starts them: process group, device, and who reads data."""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import ClassVar, NoReturn

import torch
import torch.distributed as dist

from pan.config.core import knob
from pan.parallel.dims import ParallelDims
from pan.recipe import get_recipe


@dataclass(kw_only=True)
class ProcessConfig:
    """How each process of a run sets up its GPU and its process group (`init_world`)."""
    SECTION: ClassVar[str] = "distributed"
    TRAINING_ONLY: ClassVar[bool] = True  # not checked where a trained model is only used (pan sample)

    process_group_timeout: float = knob(
        1800.0, "seconds a collective waits for every rank before the run fails (NCCL's default is "
                "600), and the most the rendezvous that starts the process group waits for the launcher's "
                "store and every rank: keep it above the longest work one rank does alone between two "
                "collectives (committing a checkpoint, decoding validation videos); the watchdog "
                "(watchdog_factor, watchdog_startup_timeout) catches real hangs sooner", gt=0)
    allow_tf32: bool = knob(
        True, "on CUDA, fp32 matmuls and convolutions run on TF32 tensor cores (fp32 range, 10-bit "
              "mantissa inputs, fp32 sums; ~7x faster on H100): what runs outside bf16 autocast "
              "(dtype: fp32 runs, fp32 frozen encoders). false: exact fp32")


@dataclass(frozen=True)
class World:
    rank: int
    size: int
    local_rank: int
    local_size: int
    device: torch.device

    @classmethod
    def planned(cls, size: int = 1, local_size: int | None = None, *, rank: int = 0,
                device: torch.device | str = "cpu") -> World:
        """Process `rank` (rank 0 by default) of a world of `size` processes, `local_size` per node
        (default: all on one node), that no launcher started: no process group, no GPU taken. What a
        task is built with outside a run: preflight's checks of a planned layout (`planned_task`),
        one-process commands, tests. On the CPU unless `device` says otherwise."""
        local_size = size if local_size is None else local_size
        return cls(rank=rank, size=size, local_rank=rank % local_size, local_size=local_size,
                   device=torch.device(device))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


ONE_PROCESS = ParallelDims(world_size=1, local_world_size=1, cp=1, dp_replicate=1, dp_shard=1)


def planned_task(job, dims: ParallelDims = ONE_PROCESS, device: torch.device | str = "cpu"):
    """The job's recipe's task as rank 0 of the layout `dims` builds it, outside any launch (nothing
    heavy is loaded: see Task.__init__): preflight's task of the planned world (`Preflight.task`),
    or by default one process with neither data nor context parallelism, whatever the job's
    `parallel` keys plan (`pan data precompute`'s encoders, tests); its tensors go to `device`."""
    world = World.planned(dims.world_size, dims.local_world_size, device=device)
    return get_recipe(job.recipe).build_task(job, world, dims, None)


def is_main_process() -> bool:
    """Whether this is rank 0 of the launch, read from torchrun's environment (usable before any
    process group exists, e.g. to print a config error once)."""
    return os.environ.get("RANK", "0") == "0"


def init_world(cfg: ProcessConfig | None = None) -> World:
    """Start the default process group when torchrun launched several processes (NCCL on GPUs, gloo on
    CPU); a plain `python train.py` is a world of one and starts none. On GPUs, process LOCAL_RANK
    uses cuda:LOCAL_RANK (TF32 as `allow_tf32` says). `process_group_timeout` bounds the rendezvous
    too: a rank never waits longer for a launcher's store that is gone or for a rank that never
    comes (train() passes the job's ProcessConfig; recipes without one get its defaults)."""
    cfg = cfg or ProcessConfig()
    rank = int(os.environ.get("RANK", 0))
    size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", size))
    if torch.cuda.is_available():
        device = use_gpu(local_rank, cfg.allow_tf32)
        # The validated eager mode keeps NCCL's async error handling on: a hung collective aborts
        # the job instead of blocking the whole allocation.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    else:
        device = torch.device("cpu")
    if size > 1 and not dist.is_initialized():
        start_process_group("nccl" if device.type == "cuda" else "gloo",
                            device_id=device if device.type == "cuda" else None,
                            timeout=timedelta(seconds=cfg.process_group_timeout))
    return World(rank, size, local_rank, local_size, device)


def use_gpu(local_rank: int, allow_tf32: bool = True) -> torch.device:
    """Make cuda:`local_rank` this process's current device (every later CUDA allocation, NCCL
    communicator and kernel lands there, not on GPU 0) and set TF32 for fp32 matmuls."""
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise RuntimeError(f"process LOCAL_RANK={local_rank} needs GPU {local_rank}, but {count} "
                           f"GPU(s) are visible here (CUDA_VISIBLE_DEVICES="
                           f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): start at most {count} "
                           "processes per node (--nproc_per_node), or make more GPUs visible.")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    precision = "tf32" if allow_tf32 else "ieee"
    torch.backends.cuda.matmul.fp32_precision = precision
    torch.backends.cudnn.conv.fp32_precision = precision
    return device


def close_world() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


_group_started = False


def start_process_group(backend: str, **kwargs) -> None:
    """`dist.init_process_group`, remembered so that `exit_process` ends this process safely."""
    global _group_started
    dist.init_process_group(backend, **kwargs)
    _group_started = True


def exit_process(code: int) -> NoReturn:
    """End a command with exit status `code`; after a process group ran here, without the
    interpreter's teardown.

    A gloo worker thread can still be freeing a finished collective's tensors (which takes the GIL)
    when the interpreter finalises; Python then ends that thread mid-unwind and the process dies of
    SIGABRT ("terminate called without an active exception") after a run that succeeded, so torchrun
    and Slurm report it failed. Seen about once in 40 two-process runs on 2 CPU cores. Everything
    pan writes is closed by now, so only the standard streams need flushing.
    """
    if not _group_started:
        sys.exit(code)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

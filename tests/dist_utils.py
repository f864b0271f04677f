"""Run a function on N real gloo processes (spawned, one thread each) and collect what each returns.

    results = run_distributed(fn, world_size=4, args=(cfg,), local_world_size=2)

`fn(*args)` runs in every process after the default process group is up, with RANK, WORLD_SIZE,
LOCAL_RANK and LOCAL_WORLD_SIZE set as torchrun would (so `pan.parallel.world.init_world()` works).
The processes are CPU ones, also where GPUs are visible: a gloo group of CPU tensors, compared
with CPU references (on a one-GPU machine, rank 1 would otherwise ask for a cuda:1 that is not there).
`fn` must be importable by the children (a module-level function). An exception in any process
fails the call with that process's traceback. Results come back through files, in rank order.
"""

from __future__ import annotations

import os
import socket
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from pan.parallel.world import exit_process, start_process_group


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, fn, world_size: int, local_world_size: int, port: int, args: tuple,
            out_dir: str) -> None:
    # Before anything initialises CUDA in this fresh (spawned) process: init_world() then picks the CPU.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank % local_world_size), LOCAL_WORLD_SIZE=str(local_world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # the test machine has 2 cores for all ranks
    # A file store, not a TCP store served by rank 0: a rank that finishes first and exits must not
    # take the store away from ranks still tearing their groups down.
    start_process_group("gloo", init_method=f"file://{Path(out_dir) / 'store'}", rank=rank,
                        world_size=world_size)
    code = 0
    try:
        result = fn(*args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()  # every rank is done with every collective before any group goes away
    except BaseException:
        (Path(out_dir) / f"rank{rank}.err").write_text(traceback.format_exc())
        code = 1
    finally:
        dist.destroy_process_group()
    exit_process(code)  # as pan's entry points end: without the interpreter teardown that can abort


def run_distributed(fn, world_size: int, args: tuple = (), local_world_size: int | None = None
                    ) -> list:
    """`fn(*args)` on `world_size` gloo processes; returns each rank's return value, by rank."""
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            mp.start_processes(_worker, args=(fn, world_size, local_world_size or world_size,
                                              free_port(), args, out_dir),
                               nprocs=world_size, start_method="spawn")
        except ProcessException as e:
            errors = sorted(Path(out_dir).glob("rank*.err"))
            detail = "\n".join(f"--- {p.stem}:\n{p.read_text()}" for p in errors)
            raise RuntimeError(f"a distributed worker failed:\n{detail or e}") from None
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False)
                for r in range(world_size)]

"""Checkpoint save and load throughput against the disk's own sequential write and read speed.

    python -m benchmarks.checkpoint_io [--size-mb 400] [--repeats 3] [--dir /some/disk] [--out benchmarks/results/checkpoint_io.json]

One process, a model of `--size-mb` MB of fp32 weights with AdamW state (so a checkpoint is about 3x
that). Each repeat, side by side in one run:
  - disk write: one file of the checkpoint's size, written in 8 MiB blocks and fsynced (like dd
    conv=fsync); disk read: that file read back in 8 MiB blocks;
  - save: `Checkpointer.save` (DCP shards, fsync of every file, marker, rename);
  - load: `Checkpointer.resume` (verification, DCP read, optimizer/model state set).
Reported as MB/s and as a ratio to the disk's speed measured in the same repeat (medians over
repeats). Before each read (the dd-like read and the checkpoint load) the page cache is dropped
when this process may (root: /proc/sys/vm/drop_caches), so both read the disk; otherwise both are
likely served from memory, the load ratio then compares software overhead, and the table says so.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
from torch import nn

try:
    from benchmarks.common import write_json
except ModuleNotFoundError:  # run as `python benchmarks/checkpoint_io.py`: its folder is on the path
    from common import write_json
from pan.checkpoint.dcp import folder_size
from pan.checkpoint.manager import CheckpointConfig, Checkpointer
from pan.parallel.dims import ParallelConfig, ParallelDims
from pan.parallel.world import World
from pan.recipes.contract import Part
from pan.trainer import TrainState

BLOCK = 8 << 20


def build_parts(size_mb: int, seed: int = 0) -> dict:
    """Square fp32 matrices of 1024 x 1024 (4 MiB each) totalling `size_mb`, with AdamW state."""
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(1024, 1024, bias=False) for _ in range(max(size_mb // 4, 1))])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()  # creates exp_avg and exp_avg_sq
    optimizer.zero_grad(set_to_none=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    return {"parts": {"transformer": Part("transformer", model, optimizer, scheduler)},
            "train_state": TrainState(step=1), "task": None, "loader": None}


def disk_write(path: Path, size: int) -> float:
    """Seconds to write `size` bytes sequentially and fsync them."""
    block = os.urandom(BLOCK)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for offset in range(0, size, BLOCK):
            f.write(block[:min(BLOCK, size - offset)])
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def disk_read(path: Path) -> float:
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(BLOCK):
            pass
    return time.perf_counter() - t0


def drop_page_cache() -> bool:
    """Write dirty pages and drop the page cache, if this process may; say whether it did."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def one_repeat(root: Path, size_mb: int, step: int) -> dict:
    world = World(rank=0, size=1, local_rank=0, local_size=1, device=torch.device("cpu"))
    dims = ParallelDims.from_config(ParallelConfig(), world_size=1, local_world_size=1)
    ckpt = Checkpointer(CheckpointConfig(output_dir=str(root / "run"), save_total_limit=1), world, dims)
    parts = build_parts(size_mb)

    t0 = time.perf_counter()
    path = ckpt.save(step, parts)
    save_s = time.perf_counter() - t0
    size = folder_size(path)

    fresh = build_parts(size_mb, seed=1)
    dropped = drop_page_cache()
    t0 = time.perf_counter()
    assert ckpt.resume(fresh) == step
    load_s = time.perf_counter() - t0

    probe = root / "dd.bin"
    write_s = disk_write(probe, size)
    dropped = drop_page_cache() and dropped
    read_s = disk_read(probe)
    probe.unlink()
    mb = size / 1e6
    return {"bytes": size, "cache_dropped": dropped, "save_MBps": mb / save_s, "load_MBps": mb / load_s,
            "disk_write_MBps": mb / write_s, "disk_read_MBps": mb / read_s,
            "save_vs_disk_write": write_s / save_s, "load_vs_disk_read": read_s / load_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=400, help="model weights in MB (fp32)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--out", default="benchmarks/results/checkpoint_io.json")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")

    root = Path(tempfile.mkdtemp(prefix="pan_ckpt_io_", dir=args.dir))
    try:
        runs = [one_repeat(root, args.size_mb, step=r + 1) for r in range(args.repeats)]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    median = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k != "cache_dropped"}

    print(f"checkpoint of a {args.size_mb} MB model + AdamW state: {median['bytes'] / 1e6:.0f} MB on disk, "
          f"median of {args.repeats}")
    print(f"{'':<8}{'pan MB/s':>12}{'disk MB/s':>12}{'pan / disk':>12}")
    print(f"{'save':<8}{median['save_MBps']:>12.0f}{median['disk_write_MBps']:>12.0f}"
          f"{median['save_vs_disk_write']:>12.2f}")
    print(f"{'load':<8}{median['load_MBps']:>12.0f}{median['disk_read_MBps']:>12.0f}"
          f"{median['load_vs_disk_read']:>12.2f}")
    dropped = all(r["cache_dropped"] for r in runs)
    print("(disk: one file of the same size, 8 MiB blocks, fsync after writing; page cache "
          + ("dropped before every read)" if dropped else "NOT dropped: reads may come from memory)"))
    write_json(args.out, {"benchmark": "checkpoint_io", "size_mb": args.size_mb, "repeats": runs,
                          "median": median})


if __name__ == "__main__":
    main()

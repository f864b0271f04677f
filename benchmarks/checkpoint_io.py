"""Checkpoint save and load throughput against the disk's own sequential write and read speed, with
the checksums (CRC32 of every file) on and off.

    python -m benchmarks.checkpoint_io [--size-mb 400] [--repeats 3] [--dir /some/disk] [--out benchmarks/results/checkpoint_io.json]

One process, a model of `--size-mb` MB of fp32 weights with AdamW state (so a checkpoint is about 3x
that). Each repeat, side by side in one run:
  - disk write: one file of the checkpoint's size, written in 8 MiB blocks and fsynced (like dd
    conv=fsync); disk read: that file read back in 8 MiB blocks;
  - save: `Checkpointer.save` (DCP shards, fsync of every file, marker, rename), once with
    save_checksums off and once on (the CRC32s computed while writing), in alternating order;
  - load: `Checkpointer.resume` (verification, DCP read, optimizer/model state set), once with
    verify_checksums off and once on (every file read and hashed before the load).
Reported as MB/s and as a ratio to the disk's speed measured in the same repeat (medians over
repeats), and the share of the save (and load) time the checksums cost. Before each read (the
dd-like read and the checkpoint loads) the page cache is dropped when this process may (root:
/proc/sys/vm/drop_caches), so both read the disk; otherwise both are likely served from memory, the
load ratio then compares software overhead, and the table says so.
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
from pan.checkpoint.checksums import CRC32_LIBRARY, HASH_THREADS, crc32_parallel
from pan.checkpoint.layout import folder_size
from pan.checkpoint.manager import CheckpointConfig, Checkpointer
from pan.parallel.dims import ParallelConfig, ParallelDims
from pan.parallel.world import World
from pan.task import Part
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


def checkpointer(output_dir: Path, checksums: bool) -> Checkpointer:
    world = World.planned()
    dims = ParallelDims.from_config(ParallelConfig(), world_size=1, local_world_size=1)
    cfg = CheckpointConfig(output_dir=str(output_dir), save_total_limit=1, save_checksums=checksums,
                           verify_checksums=checksums)
    return Checkpointer(cfg, world, dims)


def save_and_load(ckpt: Checkpointer, size_mb: int, step: int) -> tuple[float, float, int, bool]:
    """(save seconds, load seconds, checkpoint bytes, page cache dropped before the load)."""
    parts = build_parts(size_mb)
    t0 = time.perf_counter()
    path = ckpt.save(step, parts)
    save_s = time.perf_counter() - t0
    fresh = build_parts(size_mb, seed=1)
    dropped = drop_page_cache()
    t0 = time.perf_counter()
    assert ckpt.resume(fresh) == step
    return save_s, time.perf_counter() - t0, folder_size(path), dropped


def one_repeat(root: Path, size_mb: int, step: int) -> dict:
    times = {}
    # Alternate which goes first, so that neither always meets the other's dirty pages.
    for checksums in ((False, True) if step % 2 else (True, False)):
        times[checksums] = save_and_load(checkpointer(root / f"run_{int(checksums)}", checksums), size_mb, step)
    (save_s, load_s, size, dropped), (plain_save_s, plain_load_s, _, plain_dropped) = times[True], times[False]

    block = os.urandom(256 << 20)
    t0 = time.perf_counter()
    crc32_parallel(block)
    crc_s = (time.perf_counter() - t0) * size / len(block)  # the whole checkpoint's CRC32, in memory

    probe = root / "dd.bin"
    write_s = disk_write(probe, size)
    dropped = drop_page_cache() and dropped and plain_dropped
    read_s = disk_read(probe)
    probe.unlink()
    mb = size / 1e6
    return {"bytes": size, "cache_dropped": dropped, "save_MBps": mb / save_s, "load_MBps": mb / load_s,
            "save_no_checksums_MBps": mb / plain_save_s, "load_no_verify_MBps": mb / plain_load_s,
            "checksum_share_of_save": (save_s - plain_save_s) / save_s,
            "verify_share_of_load": (load_s - plain_load_s) / load_s,
            "crc32_MBps": mb / crc_s, "crc32_share_of_save_if_serial": crc_s / save_s,
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
    # The checksums' share of pan's time, from the median speeds (steadier than per-repeat shares).
    save_share = 1 - median["save_MBps"] / median["save_no_checksums_MBps"]
    load_share = 1 - median["load_MBps"] / median["load_no_verify_MBps"]
    print(f"{'':<8}{'pan MB/s':>12}{'disk MB/s':>12}{'pan / disk':>12}{'no crc MB/s':>14}{'crc share':>12}")
    print(f"{'save':<8}{median['save_MBps']:>12.0f}{median['disk_write_MBps']:>12.0f}"
          f"{median['save_vs_disk_write']:>12.2f}{median['save_no_checksums_MBps']:>14.0f}"
          f"{100 * save_share:>11.1f}%")
    print(f"{'load':<8}{median['load_MBps']:>12.0f}{median['disk_read_MBps']:>12.0f}"
          f"{median['load_vs_disk_read']:>12.2f}{median['load_no_verify_MBps']:>14.0f}"
          f"{100 * load_share:>11.1f}%")
    print("(pan: with checksums, CRC32s computed while writing and verified by reading every file "
          "before a load; no crc: save_checksums and verify_checksums off; crc share: the part of "
          "pan's time the checksums cost)")
    print(f"CRC32 alone, in memory: {median['crc32_MBps']:.0f} MB/s ({CRC32_LIBRARY}, {HASH_THREADS} threads): "
          f"even not overlapped with the writes it would add {100 * median['crc32_share_of_save_if_serial']:.0f}% "
          "to the save")
    dropped = all(r["cache_dropped"] for r in runs)
    print("(disk: one file of the same size, 8 MiB blocks, fsync after writing; page cache "
          + ("dropped before every read)" if dropped else "NOT dropped: reads may come from memory)"))
    write_json(args.out, {"benchmark": "checkpoint_io", "size_mb": args.size_mb, "repeats": runs,
                          "median": median, "crc32_library": CRC32_LIBRARY})


if __name__ == "__main__":
    main()

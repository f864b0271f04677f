"""Muon's optimizer step on row-sharded (FSDP2) matrices: Newton-Schulz shared out over the shard
group against every rank orthogonalising every matrix, side by side in one run.

    python -m benchmarks.muon_sharded [--world 2] [--hidden 512] [--matrices 24] [--repeats 5]

`--world` gloo processes on this machine, one thread each; `--matrices` hidden x hidden matrices
sharded by rows over all of them. Each round times one `Muon.step` per mode (interleaved, median
over repeats, the slowest rank counts). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

try:
    from benchmarks.common import free_port, print_table, write_json
except ModuleNotFoundError:  # run as `python benchmarks/muon_sharded.py`: its folder is on the path
    from common import free_port, print_table, write_json


def _worker(rank: int, world: int, port: int, args, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import pan.optim.muon as muon
    from pan.optim import Muon

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    shape = (args.hidden, args.hidden)
    params = [torch.nn.Parameter(distribute_tensor(torch.randn(*shape, generator=g), mesh, [Shard(0)]))
              for _ in range(args.matrices)]
    for p in params:
        p.grad = distribute_tensor(torch.randn(*shape, generator=g), mesh, [Shard(0)])
    opt = Muon(params, lr=1e-3)
    sharded_dim = muon._row_shard_dim
    modes = {"shared": sharded_dim, "every_rank": lambda t: None}  # None: the per-matrix gather path
    times = {m: [] for m in modes}
    for r in range(args.repeats + 1):
        for mode, fn in modes.items():
            muon._row_shard_dim = fn
            dist.barrier()
            t0 = time.perf_counter()
            opt.step()
            elapsed = torch.tensor(time.perf_counter() - t0)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank sets the step
            if r:  # the first round warms up
                times[mode].append(elapsed.item())
    if rank == 0:
        torch.save(times, Path(out) / "times.pt")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--matrices", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/muon_sharded.json")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_worker, args=(args.world, free_port(), args, out), nprocs=args.world,
                           start_method="spawn")
        times = torch.load(Path(out) / "times.pt")
    shared, every = statistics.median(times["shared"]), statistics.median(times["every_rank"])
    rows = [{"world": args.world, "matrices": f"{args.matrices} x {args.hidden}^2",
             "every_rank_s": round(every, 3), "shared_s": round(shared, 3), "speedup": round(every / shared, 2)}]
    print(f"Muon.step on row-sharded matrices, gloo on CPU, median of {args.repeats} (slowest rank)")
    print_table(rows, list(rows[0]))
    print(f"wrote {write_json(args.out, {'benchmark': 'muon_sharded', 'rows': rows, 'times': times})}")


if __name__ == "__main__":
    main()

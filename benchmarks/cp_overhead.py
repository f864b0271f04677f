"""Ulysses context-parallel overhead: step time for cp = 1, 2, 4 at equal global work, and the bytes
the all-to-alls move per step against the analytic count.

    python -m benchmarks.cp_overhead [--cp 1 2 4] [--steps 3] [--out benchmarks/results/cp_overhead.json]

Each cp size runs as its own gloo process group on this machine (FSDP over the cp ranks, fp32, one
thread per rank), on the same packed batch. Two measures per step, as ratios to cp = 1 from the same
run: wall time (slowest rank), and CPU seconds summed over the ranks, i.e. the total work including
the all-to-alls' packing and copies; the second stays meaningful when ranks outnumber cores (the
2-core test machine), where wall time mostly shows the oversubscription.

Bytes: every all-to-all executed (forward and backward) is counted at dispatch, as the elements each
rank sends to the other ranks. Analytic count per attention call over a sequence set of L rows
(summed over all segments), H heads of d: 4 (N - 1) / N * L * H * d elements forward (q, k, v in,
output back), the same again backward.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

try:
    from benchmarks.common import free_port, write_json
except ModuleNotFoundError:  # run as `python benchmarks/cp_overhead.py`: its folder is on the path
    from common import free_port, write_json
from pan.models.packing import PackInfo
from pan.models.pan_dit import PanDiTConfig, PanVideoDiffusionTransformer
from pan.parallel.context_parallel import ContextParallel
from pan.parallel.dims import ParallelConfig, ParallelDims
from pan.parallel.fsdp import materialize_and_init, parallelize_model
from pan.parallel.mesh import build_mesh, cp_group, cp_rank
from pan.parallel.world import init_world
from pan.trainer import TrainerConfig

ARCH = PanDiTConfig(in_channels=9, out_channels=4, hidden_size=256, num_attention_heads=8, num_layers=3,
                    num_single_layers=1, num_refiner_layers=1, mlp_ratio=4.0, text_mlp_ratio=4.0,
                    refiner_mlp_ratio=4.0, text_embed_dim=64, rope_axes_dim=[8, 12, 12])
GRIDS = [(3, 16, 15), (1, 20, 21)]   # 720 + 420 video tokens
TEXT_LENS = [37, 23]


class AllToAllBytes(TorchDispatchMode):
    """Counts the bytes this rank sends to other ranks in functional all_to_all_single calls."""

    def __init__(self, rank: int):
        super().__init__()
        self.rank, self.sent, self.calls = rank, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops._c10d_functional.all_to_all_single.default:
            x, _, input_splits = args[:3]
            row_bytes = x[0].numel() * x.element_size()
            self.sent += (x.shape[0] - input_splits[self.rank]) * row_bytes
            self.calls += 1
        return func(*args, **(kwargs or {}))


def analytic_bytes_per_step(cp: int) -> int:
    """Elements of q/k/v/output crossing ranks per training step (forward + backward), in bytes."""
    if cp == 1:
        return 0
    pack = PackInfo.build(GRIDS, TEXT_LENS)
    hd = ARCH.hidden_size  # H * d
    rows = (ARCH.num_refiner_layers * pack.text.total
            + (ARCH.num_layers + ARCH.num_single_layers) * pack.joint.total)
    return round(2 * 4 * (cp - 1) / cp * rows * hd * 4)  # fwd + bwd, 4 tensors, fp32


def batch(seed: int):
    from pan.recipes.pan.task import ModelInputs

    g = torch.Generator().manual_seed(seed)
    pack = PackInfo.build(GRIDS, TEXT_LENS)
    nv, nt, p = pack.num_video_tokens, pack.num_text_tokens, ARCH.patch_volume
    return ModelInputs(x=torch.randn(nv, ARCH.in_channels * p, generator=g),
                       target=torch.randn(nv, ARCH.out_channels * p, generator=g),
                       weight=torch.ones(nv), timesteps=torch.rand(len(GRIDS), generator=g),
                       text=torch.randn(nt, ARCH.text_embed_dim, generator=g), pack=pack,
                       sample_ids=["a", "b"], samples=2, tokens=nv, packing=1.0, bad_samples=0)


def run_rank(rank: int, cp: int, threads: int, steps: int, port: int, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(cp), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(cp))
    torch.set_num_threads(threads)
    if cp > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=cp)
    pcfg, tcfg = ParallelConfig(cp_size=cp), TrainerConfig(dtype="fp32")
    dims = ParallelDims.from_config(pcfg, cp, cp)
    world = init_world()
    mesh = build_mesh(dims, world)
    with torch.device("meta"):
        model = PanVideoDiffusionTransformer(ARCH, zero_init_modulation=False, attention_backend="sdpa")
    model = parallelize_model(materialize_and_init(model, world.device, 0, mesh), mesh, dims, pcfg, tcfg)
    context = ContextParallel(cp_rank(mesh), cp, cp_group(mesh))
    times, cpu, counter = [], [], AllToAllBytes(rank)
    for step in range(steps + 2):  # step 0 warms up, the last one counts bytes (untimed)
        inputs = context.distribute(batch(step) if rank == 0 else None)
        counting = step == steps + 1
        if cp > 1:
            dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        with counter if counting else contextlib.nullcontext():
            pred = model(inputs.x, inputs.timesteps, inputs.text, inputs.pack)
            ((pred - inputs.target).square().sum(1) * inputs.weight).sum().backward()
        if cp > 1:
            dist.barrier()
        if 0 < step and not counting:
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        model.zero_grad(set_to_none=True)
    torch.save({"times": times, "cpu": cpu, "sent": counter.sent, "calls": counter.calls},
               Path(out_dir) / f"rank{rank}.pt")
    if cp > 1:
        dist.destroy_process_group()


def measure(cp: int, threads: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(run_rank, args=(cp, threads, steps, free_port(), out_dir), nprocs=cp,
                           start_method="spawn")
        ranks = [torch.load(Path(out_dir) / f"rank{r}.pt") for r in range(cp)]
    step_times = [max(r["times"][i] for r in ranks) for i in range(steps)]  # slowest rank
    cpu_times = [sum(r["cpu"][i] for r in ranks) for i in range(steps)]
    return {"cp": cp, "threads_per_rank": threads, "step_time_s": statistics.median(step_times),
            "cpu_s_all_ranks": statistics.median(cpu_times),
            "all_to_all_calls_per_rank": ranks[0]["calls"],
            "all_to_all_bytes": sum(r["sent"] for r in ranks),
            "analytic_bytes": analytic_bytes_per_step(cp)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--out", default="benchmarks/results/cp_overhead.json")
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    rows = [measure(cp, args.threads, args.steps) for cp in args.cp]
    base, base_cpu = rows[0]["step_time_s"], rows[0]["cpu_s_all_ranks"]
    print(f"packed batch: {sum(t * h * w for t, h, w in GRIDS)} video + {sum(TEXT_LENS)} text tokens, "
          f"hidden {ARCH.hidden_size}, {ARCH.num_attention_heads} heads, {cores} cores")
    print(f"{'cp':>3} {'wall s':>7} {'vs cp1':>6} {'cpu s':>7} {'vs cp1':>6} {'a2a calls':>9} "
          f"{'a2a MB':>9} {'analytic MB':>11} {'meas/anal':>9}")
    for r in rows:
        r["time_vs_first"] = r["step_time_s"] / base
        r["cpu_vs_first"] = r["cpu_s_all_ranks"] / base_cpu
        ratio = r["all_to_all_bytes"] / r["analytic_bytes"] if r["analytic_bytes"] else float("nan")
        r["measured_over_analytic"] = ratio
        print(f"{r['cp']:>3} {r['step_time_s']:>7.3f} {r['time_vs_first']:>6.2f} "
              f"{r['cpu_s_all_ranks']:>7.3f} {r['cpu_vs_first']:>6.2f} "
              f"{r['all_to_all_calls_per_rank']:>9} {r['all_to_all_bytes'] / 1e6:>9.2f} "
              f"{r['analytic_bytes'] / 1e6:>11.2f} {ratio:>9.3f}")
    path = write_json(args.out, {"benchmark": "cp_overhead", "cores": cores, "grids": GRIDS,
                                 "text_lens": TEXT_LENS, "hidden_size": ARCH.hidden_size, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

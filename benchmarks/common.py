"""Shared helpers for benchmarks: side-by-side interleaved timing, this machine's matmul peak, output.

Absolute times drift on shared machines, so benchmarks time their candidates round-robin in one
run (interleaved repeats, median) and report ratios: against a reference implementation, and
against the fp32 matmul peak measured in the same rounds.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def time_call(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one call, synchronising CUDA if in use.

    CPU seconds are robust to other jobs on a shared machine (they only count this process's
    work); wall seconds are what a user waits. Report both.
    """
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - wall, time.process_time() - cpu


def matmul_probe(size: int = 2048, dtype: torch.dtype = torch.float32, device="cpu"
                 ) -> tuple[Callable[[], object], int]:
    """(one [size, size] @ [size, size] matmul, its FLOPs): time it beside a workload for the peak."""
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    torch.mm(a, b)  # warm the allocator and the BLAS threads
    return (lambda: torch.mm(a, b)), 2 * size ** 3


def interleaved_times(candidates: dict[str, Callable[[], object]], repeats: int, warmup: int = 1
                      ) -> dict[str, dict[str, list[float]]]:
    """Time every candidate once per round, `repeats` rounds, after `warmup` untimed rounds.

    Returns {name: {"wall": [seconds per round], "cpu": [process CPU seconds per round]}}.
    """
    times = {name: {"wall": [], "cpu": []} for name in candidates}
    for round_ in range(warmup + repeats):
        for name, fn in candidates.items():
            wall, cpu = time_call(fn)
            if round_ >= warmup:
                times[name]["wall"].append(wall)
                times[name]["cpu"].append(cpu)
    return times


def median(values: list[float]) -> float:
    return statistics.median(values)


def machine_info() -> dict:
    return {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "cpu": platform.processor() or platform.machine(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def print_table(rows: list[dict], columns: list[str]) -> None:
    """Print rows as an aligned text table, formatting floats to 3 significant digits."""
    def fmt(v):
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))


def write_json(path: str | Path, payload: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": machine_info(), **payload}, indent=2) + "\n")
    return path


def free_port() -> int:
    """A free TCP port on this machine, for a benchmark's own process group."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Dense kernels (matmuls and CPU flash attention): a step's share in them bounds what a faster
# implementation of everything else can win.
KERNELS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm",
           "aten::_scaled_dot_product_flash_attention_for_cpu",
           "aten::_scaled_dot_product_flash_attention_for_cpu_backward")


def kernel_share(step: Callable[[], object]) -> float:
    """Fraction of one step's CPU time spent inside KERNELS (torch.profiler, self times)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    return sum(e.self_cpu_time_total for e in events if e.key in KERNELS) / total


def import_original(src: Path, deps: str | None, load: Callable[[], object]):
    """`load()` (which imports from the original Pyramid-Flow source) -> (its result, None), or
    (None, why not). Runs after pan is imported, so the import-time stand-ins the original needs
    (`import_stubs.py`) and its dependencies never change what pan imported."""
    if not (src / "import_stubs.py").is_file() or not (src / "src").is_dir():
        return None, f"the original's source is not at {src} (pass --original)"
    for path in (str(src / "src"), str(src)) + ((deps,) if deps else ()):
        if path not in sys.path:
            sys.path.insert(0, path)
    try:
        import import_stubs
        import_stubs.install()
        return load(), None
    except ImportError as e:
        return None, (f"the original cannot be imported ({e}); install einops, timm and accelerate into "
                      "a separate folder and pass it as --original-deps")



class LiveTensorBytes(TorchDispatchMode):
    """Bytes of the live tensors while a call runs (`with LiveTensorBytes(resident): step()`): the
    `resident` tensors given (what lives across steps), plus every storage an operation makes from
    then on until it is freed; `peak` is their most. The count of the estimate tests
    (tests/test_estimate.py), which found it within 0.5% of torch's MemTracker."""

    def __init__(self, resident: list[torch.Tensor]):
        super().__init__()
        self.live: dict[int, int] = {}       # storage address -> bytes
        self.total = 0
        for t in resident:
            self._follow(t.untyped_storage())
        self.peak = self.total = sum(self.live.values())

    def _follow(self, storage) -> None:
        key = storage.data_ptr()
        self.live[key] = storage.nbytes()
        weakref.finalize(storage, self._freed, key)

    def _freed(self, key: int) -> None:
        self.total -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.untyped_storage().nbytes() == 0:
                continue
            storage = t.untyped_storage()
            if storage.data_ptr() not in self.live:
                self._follow(storage)
                self.total += storage.nbytes()
        self.peak = max(self.peak, self.total)
        return out


def frozen_encoders(trainer) -> list[torch.nn.Module]:
    """Pan's text encoder, the Pyramid-Flow recipes' T5 and CLIPs (where loaded), a frozen VAE, the
    causal VAE's LPIPS and its discriminator's scoring copy."""
    task = trainer.task
    text = getattr(task, "_text_encoder", None) or getattr(task, "text_encoder", None)
    encoders = [getattr(text, "model", None), *getattr(text, "models", []), getattr(task, "vae", None),
                getattr(task, "lpips", None), getattr(task, "disc_copy", None)]
    return [m for m in encoders if isinstance(m, torch.nn.Module)]


def resident_tensors(trainer) -> list[torch.Tensor]:
    """What lives across steps: every part's parameters, gradients and optimizer states, the EMA,
    and the frozen encoders."""
    out = []
    for part in trainer.parts.values():
        out += [t for p in part.model.parameters() for t in (p, p.grad) if t is not None]
        out += [t for opt in part.optimizer.optimizers for state in opt.state.values()
                for t in state.values() if isinstance(t, torch.Tensor)]
        if part.ema is not None:
            out += list(part.ema.shadow.values())
    for module in frozen_encoders(trainer):
        out += [*module.parameters(), *module.buffers()]
    return out

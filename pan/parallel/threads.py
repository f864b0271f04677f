"""How many threads a CPU run computes with, chosen at start and logged.

torch's CPU operations split their work over OpenMP threads, one per core by default, and every
operation ends with the threads waiting for each other. On a machine where another process keeps a
core busy, the thread that shares that core runs half the time and every operation waits for it:
measured on a 2-core machine, one busy process beside the Pan demo slowed its steps from 0.12 s to
2-3 s with two threads (benchmarks/cpu_threads.py). So a CPU run uses as many threads as there are
cores other processes leave idle, measured over a moment at start, at least one. OMP_NUM_THREADS,
when set, is the user's choice and is kept (torchrun sets it to 1 for several processes a node).
"""

from __future__ import annotations

import math
import os
import time

import torch

MEASURE_SECONDS = 0.3


def cores_here() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def busy_cores(seconds: float = MEASURE_SECONDS) -> float | None:
    """Cores other processes keep busy, from /proc/stat over `seconds` while this process sleeps
    (None where /proc/stat cannot be read)."""
    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)   # idle + iowait
        return sum(fields[:8]), idle
    try:
        total0, idle0 = sample()
        time.sleep(seconds)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    if total1 <= total0:
        return None
    machine_cores = os.cpu_count() or 1
    return machine_cores * (1 - (idle1 - idle0) / (total1 - total0))


def threads_for(cores: int, busy: float | None) -> int:
    """The cores left idle by others (busy 0.6 of a core leaves one of two idle), at least one."""
    if busy is None:
        return cores
    return max(1, min(cores, math.floor(cores - busy + 0.5)))


def omp_num_threads() -> int | None:
    """OMP_NUM_THREADS as OpenMP reads it (the first level of a list such as "4,2"); None when unset,
    empty or not a positive number (OpenMP then ignores it too: `export OMP_NUM_THREADS=$N` with N
    unset must not stop a run)."""
    first = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(first) if first.isdigit() and int(first) > 0 else None


_CHOSEN: list[str] = []   # once a process: a demo chooses before its data phase, its trainer keeps that


def set_cpu_threads() -> str:
    """Set torch's thread count for a CPU run (once a process); returns the choice and why, for the log."""
    if not _CHOSEN:
        _CHOSEN.append(_choose())
    return _CHOSEN[0]


def _choose() -> str:
    if omp_num_threads() is not None:
        return f"{torch.get_num_threads()} thread(s): OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} is set"
    cores, busy = cores_here(), busy_cores()
    threads = threads_for(cores, busy)
    torch.set_num_threads(threads)
    seen = "unmeasured" if busy is None else f"{busy:.1f} kept busy by other processes"
    return (f"{threads} thread(s): {cores} core(s) here, {seen} (threads that share a core with another "
            "process make every operation wait; set OMP_NUM_THREADS to choose)")

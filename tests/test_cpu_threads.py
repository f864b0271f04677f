"""A CPU run's thread count (pan/parallel/threads.py): the cores other processes leave idle,
measured at start; OMP_NUM_THREADS, when set, is kept. (Its effect on step time is measured by
benchmarks/cpu_threads.py, not here.)"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from pan.parallel.threads import busy_cores, cores_here, threads_for


@pytest.mark.parametrize("cores,busy,threads", [(2, 0.0, 2), (2, 0.4, 2), (2, 0.6, 1), (2, 1.0, 1), (2, 2.7, 1),
                                                (8, 3.2, 5), (2, None, 2)])
def test_threads_are_the_cores_left_idle(cores, busy, threads):
    assert threads_for(cores, busy) == threads


@pytest.fixture
def spinner():
    """Another process keeping one core busy."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    time.sleep(0.3)
    yield proc
    proc.kill()
    proc.wait()


def test_a_busy_process_is_seen_and_left_its_core(spinner):
    busy = busy_cores(0.5)
    assert busy is not None and busy >= 0.7, busy
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", "import torch; from pan.parallel.threads import set_cpu_threads; "
                          "print(set_cpu_threads()); print(torch.get_num_threads())"],
                         env=env, capture_output=True, text=True, timeout=120, check=True).stdout.splitlines()
    chosen = int(out[-1])
    assert "kept busy by other processes" in out[0]
    assert chosen == max(1, cores_here() - 1) if cores_here() <= 2 else 1 <= chosen < cores_here()


def test_OMP_NUM_THREADS_is_the_users_choice():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", "import torch; from pan.parallel.threads import set_cpu_threads; "
                          "print(set_cpu_threads()); print(torch.get_num_threads())"],
                         env=env, capture_output=True, text=True, timeout=120, check=True).stdout.splitlines()
    assert out == ["1 thread(s): OMP_NUM_THREADS=1 is set", "1"]


@pytest.mark.parametrize("value,read", [("", None), ("abc", None), ("0", None), ("3", 3), ("4,2", 4), (" 2 ", 2)])
def test_OMP_NUM_THREADS_is_read_as_OpenMP_reads_it(monkeypatch, value, read):
    """`export OMP_NUM_THREADS=$N` with N unset leaves it empty: OpenMP ignores it, and so must pan
    (`pan check`'s cpu row crashed on it, which refused every launch)."""
    from pan.parallel.threads import omp_num_threads

    monkeypatch.setenv("OMP_NUM_THREADS", value)
    assert omp_num_threads() == read

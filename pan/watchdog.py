"""Ranks that stop on their own: when a step, save or validation hangs, and when their launcher dies.

Hangs. The loop runs each phase ("step", "save", "validation") under `Watchdog.watching(phase)`. A
phase that runs longer than max(min_timeout, factor x the median of its last runs) (first_timeout
while it has no history) is a hang: the rank that sees it first logs why, tells the others through
the process group's store, and every rank writes its Python stacks (faulthandler, every thread) to
its stderr, waits a few seconds for the others to do the same, and exits with HANG_EXIT_CODE, so the
scheduler can restart the run. A rank hung in native code that never releases the GIL cannot run the
watchdog thread: faulthandler's own C timer, armed for each phase a little later, dumps its stacks
and exits 1 instead.

Orphans. torchrun starts each rank in a session of its own, so a SIGKILLed launcher leaves its ranks
training (or waiting in a collective) forever. A thread notices that the parent process changed and
ends the rank.
"""

from __future__ import annotations

import collections
import contextlib
import faulthandler
import os
import statistics
import sys
import threading
import time
from typing import Iterator

from pan.logging import get_logger

HANG_EXIT_CODE = 3
LAUNCHER_GONE_EXIT_CODE = 1
POLL_S = 0.5            # how often the watchdog thread looks at the clock and the store
WAIT_FOR_PEERS_S = 10.0  # how long a rank that dumped its stacks waits for the others' dumps
BACKSTOP_S = 30.0       # faulthandler's timer fires this long after the Python thread should have
HISTORY = 100           # runs of a phase its median is taken over
_HANG_KEY, _DUMPED_KEY = "pan/watchdog/hang", "pan/watchdog/dumped"


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def _default_store():
    """The default process group's store (None without one): how ranks tell each other of a hang."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - a private API: without it each rank only sees its own hangs
        return None


class Watchdog:
    """Times the loop's phases on one rank and ends every rank of the run when one hangs."""

    def __init__(self, factor: float, min_timeout: float, first_timeout: float, rank: int,
                 world_size: int, store=None):
        self.factor, self.min_timeout, self.first_timeout = factor, min_timeout, first_timeout
        self.rank, self.world_size, self.store = rank, world_size, store
        self.history: dict[str, collections.deque] = collections.defaultdict(
            lambda: collections.deque(maxlen=HISTORY))
        self.log = get_logger()
        self._phase: tuple[str, str, float, float] | None = None  # (phase, what, start, limit)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def describe(self) -> str:
        return (f"watchdog: a step, save or validation running longer than max({self.min_timeout:g} s, "
                f"{self.factor:g} x the median of its last {HISTORY}) ({self.first_timeout:g} s for the "
                f"first of its kind) is a hang: every rank then writes its Python stacks to the log and "
                f"the run exits {HANG_EXIT_CODE}")

    def limit(self, phase: str) -> float:
        past = self.history[phase]
        if not past:
            return self.first_timeout
        return max(self.min_timeout, self.factor * statistics.median(past))

    @contextlib.contextmanager
    def watching(self, phase: str, what: str = "") -> Iterator[None]:
        """Time one run of `phase` ("step", "save", "validation"); `what` names it in the log."""
        limit = self.limit(phase)
        start = time.monotonic()
        with self._lock:
            self._phase = (phase, what or phase, start, limit)
        faulthandler.dump_traceback_later(limit + BACKSTOP_S, exit=True, file=sys.__stderr__)
        try:
            yield
        finally:
            faulthandler.cancel_dump_traceback_later()
            with self._lock:
                self._phase = None
            self.history[phase].append(time.monotonic() - start)

    # -- the thread ------------------------------------------------------------------------------
    def start(self) -> None:
        self.log.info("%s", self.describe())
        self._thread = threading.Thread(target=self._run, name="pan-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        faulthandler.cancel_dump_traceback_later()

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            with self._lock:
                current = self._phase
            if current is None:
                continue
            phase, what, start, limit = current
            elapsed = time.monotonic() - start
            if elapsed > limit:
                self._hang(f"rank {self.rank}: {what} has run {elapsed:.0f} s, longer than its limit of "
                           f"{limit:.0f} s", announce=True)
            # A peer's hang keeps this rank waiting in the same phase: look for it once this phase
            # is itself slow (never in a healthy fast phase, which would load the store).
            if elapsed > min(limit, self.min_timeout) / 2 and (reason := self._peer_hang()) is not None:
                self._hang(reason, announce=False)

    def _peer_hang(self) -> str | None:
        if self.store is None:
            return None
        try:
            if self.store.check([_HANG_KEY]):
                return self.store.get(_HANG_KEY).decode()
        except Exception:  # noqa: BLE001 - the store's server went away with its rank
            return None
        return None

    def _hang(self, reason: str, announce: bool) -> None:
        """Log, tell the other ranks, dump this rank's stacks, wait for theirs, exit."""
        self.log.error("watchdog: %s; every rank writes its Python stacks to the log and the run exits "
                       "%d", reason, HANG_EXIT_CODE)
        if announce and self.store is not None:
            with contextlib.suppress(Exception):
                self.store.set(_HANG_KEY, reason)
        _flush()
        # The process's own stderr (the log), also where a test harness swapped sys.stderr.
        print(f"watchdog: Python stacks of rank {self.rank} (pid {os.getpid()}):", file=sys.__stderr__,
              flush=True)
        faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)
        _flush()
        self._wait_for_peers()
        os._exit(HANG_EXIT_CODE)

    def _wait_for_peers(self) -> None:
        """Until every rank has dumped its stacks (or WAIT_FOR_PEERS_S): the store lives in rank 0,
        and a rank that exits breaks the collectives the others would be dumped from."""
        if self.store is None or self.world_size == 1:
            return
        deadline = time.monotonic() + WAIT_FOR_PEERS_S
        with contextlib.suppress(Exception):
            self.store.add(_DUMPED_KEY, 1)
            while time.monotonic() < deadline and self.store.add(_DUMPED_KEY, 0) < self.world_size:
                time.sleep(0.1)
            if self.rank == 0:
                time.sleep(0.5)  # the store's server: let the others read the final count first


@contextlib.contextmanager
def watchdog_running(factor: float, min_timeout: float, first_timeout: float, world
                     ) -> Iterator[Watchdog]:
    """A started Watchdog of this rank for the run (its thread stopped on the way out)."""
    dog = Watchdog(factor, min_timeout, first_timeout, world.rank, world.size, _default_store())
    dog.start()
    try:
        yield dog
    finally:
        dog.stop()


def exit_when_launcher_dies(poll_s: float = 1.0) -> bool:
    """Start a thread that ends this process (exit LAUNCHER_GONE_EXIT_CODE) once its parent is gone.

    Only for a rank started by a launcher (RANK is set: torchrun, srun, the tests); a plain `python
    train.py` may be meant to outlive its shell (nohup). Returns whether the thread started.
    """
    parent = os.getppid()
    if "RANK" not in os.environ or parent == 1:
        return False
    log = get_logger()

    def watch():
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                log.error("the launcher of this rank (pid %d) is gone: this rank stops (exit %d)",
                          parent, LAUNCHER_GONE_EXIT_CODE)
                _flush()
                os._exit(LAUNCHER_GONE_EXIT_CODE)

    threading.Thread(target=watch, name="pan-launcher-watch", daemon=True).start()
    return True

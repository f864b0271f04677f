"""Ranks that stop on their own: when the start-up, a step, a save or a validation hangs, and when
their launcher dies.

Hangs. train() runs the start-up (rendezvous, lease, resume, model build: everything before the first
step) under `Watchdog.watching(STARTUP)`, the loop each phase ("step", "save", "validation") under
`Watchdog.watching(phase)`. A start-up longer than startup_timeout, a phase that runs longer than
max(min_timeout, factor x the median of its last runs) (first_timeout while it has no history) is a
hang: the rank that sees it first logs why, tells the others through the process group's store (once
there is one), and every rank writes its Python stacks (faulthandler, every thread) to its stderr,
waits a few seconds for the others to do the same, and exits with HANG_EXIT_CODE, so the scheduler
can restart the run. A rank hung in native code that never releases the GIL cannot run the
watchdog thread: faulthandler's own C timer, armed for each phase a little later, dumps its stacks
and exits 1 instead.

Orphans. torchrun starts each rank in a session of its own, so a SIGKILLed launcher leaves its ranks
importing, waiting in the rendezvous, training or waiting in a collective, forever. train.py starts
`watch_launcher` before anything heavy is imported: it records the parent process, ends the rank at
once when that is no launcher any more (torchrun died before the rank started), and from then on a
thread ends the rank within LAUNCHER_POLL_S of the parent's change. That part uses the standard
library only.

A SIGTERM before the first step. A preemption (scancel, the time limit, the launch wrapper passing
it on) can come at any moment of the start-up, which can take many minutes (model build, loader).
`pan train` calls `record_sigterm` before the config loads and train() again when it starts: from
then on a SIGTERM is only recorded (`sigterm_received`), the start-up looks at it at the end of
each of its phases (pan.trainer.stop_if_sigterm: every rank together, exit 143, nothing written),
and the loop after each step. Standard library only, as the launcher watch.
"""

from __future__ import annotations

import collections
import contextlib
import faulthandler
import os
import signal
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
STARTUP = "start-up"    # the phase of everything before the first step


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
                 world_size: int, store=None, startup_timeout: float | None = None):
        self.factor, self.min_timeout, self.first_timeout = factor, min_timeout, first_timeout
        self.startup_timeout = first_timeout if startup_timeout is None else startup_timeout
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
                f"first of its kind), or a start-up longer than {self.startup_timeout:g} s, is a hang: "
                f"every rank then writes its Python stacks to the log and the run exits {HANG_EXIT_CODE}")

    def limit(self, phase: str) -> float:
        if phase == STARTUP:
            return self.startup_timeout
        past = self.history[phase]
        if not past:
            return self.first_timeout
        return max(self.min_timeout, self.factor * statistics.median(past))

    @contextlib.contextmanager
    def watching(self, phase: str, what: str = "") -> Iterator[None]:
        """Time one run of `phase` (STARTUP, "step", "save", "validation"); `what` names it in the log."""
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

    def use_process_group(self) -> None:
        """Tell and hear the other ranks' hangs through the default process group's store, once it
        is up (a hang in the rendezvous is only this rank's)."""
        self.store = _default_store()

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
def watchdog_running(factor: float, min_timeout: float, first_timeout: float,
                     startup_timeout: float | None = None) -> Iterator[Watchdog]:
    """A started Watchdog of this rank for the run (its thread stopped on the way out). It can start
    before the process group (the start-up is watched from its first moment): the rank and world size
    are torchrun's, and `use_process_group` gives it the store once the group is up."""
    dog = Watchdog(factor, min_timeout, first_timeout, int(os.environ.get("RANK", "0")),
                   int(os.environ.get("WORLD_SIZE", "1")), _default_store(), startup_timeout)
    dog.start()
    try:
        yield dog
    finally:
        dog.stop()


# -- the launcher --------------------------------------------------------------------------------
# Everything below runs before torch is imported (train.py's first lines): standard library only.

LAUNCHER_POLL_S = 0.25  # how often the launcher watch looks at the parent process


def _proc_parent(pid: int) -> int | None:
    """The parent pid of process `pid` (None: it is gone, or this system has no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # the command name, in (), may hold spaces


def _proc_command(pid: int) -> str | None:
    """Process `pid`'s command line ("" when it cannot be read; None when it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    except OSError:
        return ""
    return " ".join(arg.decode(errors="replace") for arg in raw.split(b"\0") if arg)


def _may_be_torchrun(pid: int) -> bool:
    """Whether process `pid` can be a torchrun agent (torchrun, `python -m torch.distributed.run`, a
    Python program that calls it): a Python interpreter. Where that cannot be told, yes."""
    command = _proc_command(pid)
    if command is None:
        return False
    if not command:
        return True
    program = os.path.basename(command.split()[0]).lower()
    return "python" in program or "pypy" in program or "torch" in command.lower()


class _LauncherWatch:
    """The launcher of this rank, as recorded when the process started, and the thread that ends the
    rank once that launcher is gone."""

    def __init__(self):
        self.pid = os.getpid()
        self.parent = os.getppid()  # the launcher, unless it died before this line ran
        # torchrun starts each rank in a session of its own: the session's leader is the process
        # torchrun started (this rank, or a wrapper such as `torchrun --no-python run.sh` that
        # starts it), and its parent is torchrun's agent.
        self.torchrun = "TORCHELASTIC_RUN_ID" in os.environ
        self.leader, self.agent = self.pid, self.parent
        if self.torchrun and os.path.isdir("/proc") and os.getsid(0) != self.pid:
            self.leader = os.getsid(0)
            self.agent = _proc_parent(self.leader)
        self.gone_at_start = self._gone_at_start()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _gone_at_start(self) -> str | None:
        """Why the launcher is already gone when this process starts (None: it is there, or that
        cannot be told). Only torchrun's ranks can tell: their launcher is a Python process, so a
        parent that is no Python process (init, pid 1, or a subreaper) adopted the rank."""
        if not self.torchrun or self.agent is None or not os.path.isdir("/proc"):
            return None
        if _may_be_torchrun(self.agent):
            return None
        command = (_proc_command(self.agent) or "?").split(" ")[0]
        return (f"torchrun died before this rank started: the process torchrun started now has the "
                f"parent pid {self.agent} ({os.path.basename(command)}), not torchrun's agent")

    def gone(self) -> str | None:
        """Why this rank's launcher is gone (None while it is there): its parent changed (the rank
        was adopted by init or a subreaper), or it was gone when the rank started."""
        if self.gone_at_start is not None:
            return self.gone_at_start
        if os.getppid() != self.parent:
            return f"this rank's parent is now pid {os.getppid()}"
        if self.leader != self.pid and self.agent is not None:
            now = _proc_parent(self.leader)
            if now is not None and now != self.agent:
                return f"the process torchrun started (pid {self.leader}) now has the parent pid {now}"
        return None

    def exit_if_gone(self) -> None:
        """End this process (exit LAUNCHER_GONE_EXIT_CODE, one log line) when its launcher is gone."""
        reason = self.gone()
        if reason is None:
            return
        launcher = self.agent if self.agent is not None and self.gone_at_start is None else "unknown"
        get_logger().error("the launcher of this rank (pid %s) is gone: this rank stops (exit %d); %s",
                           launcher, LAUNCHER_GONE_EXIT_CODE, reason)
        _flush()
        os._exit(LAUNCHER_GONE_EXIT_CODE)

    def start(self, poll_s: float) -> None:
        self.exit_if_gone()
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()

        def watch():
            while not self._stop.wait(poll_s):
                self.exit_if_gone()

        self._thread = threading.Thread(target=watch, name="pan-launcher-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()


_launcher: _LauncherWatch | None = None


def watch_launcher(poll_s: float = LAUNCHER_POLL_S) -> bool:
    """End this process (exit LAUNCHER_GONE_EXIT_CODE, with one log line) once its launcher is gone:
    at once if it is gone already, else from a thread that looks every `poll_s` seconds.

    Call it first thing (train.py does, before torch is imported): torchrun starts each rank in a
    session of its own, so a launcher killed while its ranks import, wait in the rendezvous or train
    leaves them running (holding GPUs) or waiting forever. The launcher is the parent process as
    recorded at the first call. Only for a rank started by a launcher (RANK is set: torchrun, srun,
    the tests); a plain `python train.py` may be meant to outlive its shell (nohup). Calls after the
    first keep the first record. Returns whether the watch runs.
    """
    global _launcher
    if "RANK" not in os.environ:
        return False
    if _launcher is None:
        _launcher = _LauncherWatch()
    _launcher.start(poll_s)
    return True


def stop_watching_launcher() -> None:
    """Stop the launcher watch (`exit_when_launcher_dies: false`, read once the config is)."""
    if _launcher is not None:
        _launcher.stop()


def exit_if_launcher_gone(grace_s: float = 0.0) -> None:
    """On a rank whose launcher watch runs: end it now (as the watch would) if its launcher is gone,
    looking again for up to `grace_s` seconds. For an error path, so that a rank that lost its peers
    or the launcher's store says why: a dying process closes its sockets before its children are
    given to a new parent, so the error can come first."""
    if _launcher is None or _launcher._stop.is_set():
        return
    deadline = time.monotonic() + grace_s
    while True:
        _launcher.exit_if_gone()
        if time.monotonic() >= deadline:
            return
        time.sleep(0.05)


# -- SIGTERM before the first step -------------------------------------------------------------
# Standard library only too: `pan train` records SIGTERM before the config (and torch) loads.

_sigterm_seen = [0]       # the SIGTERM recorded since record_sigterm installed its handler (0: none)
_sigterm_before = None    # SIGTERM's handler before that


def _record_sigterm(signum, frame) -> None:
    _sigterm_seen[0] = signum


def record_sigterm() -> bool:
    """From now on SIGTERM only records itself (`sigterm_received`) instead of ending this process.
    Returns whether this call installed the recording (its caller then ends it with
    `stop_recording_sigterm`); a call while it is installed keeps the first record. Nothing outside
    the main thread (Python takes signals there only): SIGTERM keeps its action."""
    global _sigterm_before
    if threading.current_thread() is not threading.main_thread() or sigterm_recording():
        return False
    _sigterm_seen[0] = 0
    _sigterm_before = signal.signal(signal.SIGTERM, _record_sigterm)
    return True


def sigterm_recording() -> bool:
    """Whether SIGTERM is being recorded (record_sigterm) in this process."""
    return signal.getsignal(signal.SIGTERM) is _record_sigterm


def sigterm_received() -> list[int]:
    """The record: [0] is the SIGTERM received since the recording started (0 while none was)."""
    return _sigterm_seen


def stop_recording_sigterm() -> None:
    """SIGTERM's action as it was before record_sigterm (nothing when it is not recording)."""
    if threading.current_thread() is threading.main_thread() and sigterm_recording():
        # None: a handler set outside Python, which cannot be set back from here: the default.
        signal.signal(signal.SIGTERM, signal.SIG_DFL if _sigterm_before is None else _sigterm_before)

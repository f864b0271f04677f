"""One run per output folder: `output_dir/lease.json` names the run that holds it.

The lease records who runs there (the host, its boot, every rank's pid and process start time, the
Slurm job), when it started, and a heartbeat that rank 0 refreshes every few seconds from a thread.
A launch that finds a live lease is refused (exit 2) with the holder's name; a stale one is taken
over, with a warning that says why it was stale. A lease is stale when:
  - it belongs to an earlier run of this same Slurm job (a requeue: Slurm ends every process of a
    job before it starts it again), or
  - none of its processes is alive on this machine, and either all of them ran on this machine (a
    run killed here: no need to wait for its heartbeat) or its heartbeat is older than
    `lease_timeout` (a run on another node that died, or whose node died).
Only whole-file operations are used (exclusive create, write-then-rename, unlink), never flock, so
it holds on a filesystem shared by several nodes. Two launches that take over the same stale lease
in the same instant: the later write keeps it and the other one stops at its next heartbeat.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Iterator

import torch.distributed as dist

from pan.checkpoint.manager import first_problem
from pan.logging import get_logger

LEASE_FILE = "lease.json"
TAKEOVER_SETTLE_S = 0.5  # after a takeover, read the lease again this much later: did another launch win?


class LeaseHeldError(RuntimeError):
    """output_dir is held by a run that may be alive: a second run there is refused."""


# --- processes ----------------------------------------------------------------------------------

def boot_id() -> str:
    """This machine's current boot ("" where unknown): a pid means nothing across a reboot."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def process_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (None where /proc is unavailable); with the
    pid it names one process, even after the pid is reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # field 22; the name in (...) may hold spaces


def this_process() -> dict:
    return {"host": socket.gethostname(), "boot": boot_id(), "pid": os.getpid(),
            "start": process_start(os.getpid())}


def on_this_machine(proc: dict) -> bool:
    return proc["host"] == socket.gethostname() and proc.get("boot", "") == boot_id()


def process_alive(proc: dict) -> bool:
    """Whether the process `proc` (of this machine) still runs; a zombie or a reused pid does not."""
    pid = proc["pid"]
    if Path("/proc").is_dir():
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        fields = stat.rsplit(")", 1)[1].split()
        return fields[0] != "Z" and (proc.get("start") is None or int(fields[19]) == proc["start"])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


# --- the lease file ------------------------------------------------------------------------------

def read_lease(path: Path, attempts: int = 5) -> dict | None:
    """The lease at `path` (None: there is none). A file caught while its creator writes it is read
    again a moment later; one that never parses is reported as a lease with no live process."""
    for attempt in range(attempts):
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError):
            time.sleep(0.1 * (attempt + 1))
    mtime = path.stat().st_mtime if path.exists() else 0.0
    return {"token": "", "processes": [], "heartbeat": mtime, "started": "?", "unreadable": True}


def why_stale(lease: dict, timeout: float, now: float | None = None) -> str | None:
    """Why `lease` may be taken over, or None while its run may still be alive."""
    now = time.time() if now is None else now
    job = os.environ.get("SLURM_JOB_ID")
    restart = os.environ.get("SLURM_RESTART_COUNT", "0")
    if job and lease.get("slurm_job_id") == job and lease.get("slurm_restart") != restart:
        return (f"it belongs to run {lease.get('slurm_restart')} of this Slurm job {job}, which Slurm "
                f"ended before starting this run ({restart})")
    procs = lease.get("processes", [])
    local = [p for p in procs if on_this_machine(p)]
    if any(process_alive(p) for p in local):
        return None
    if local and len(local) == len(procs):
        return "none of its processes is alive on this machine, where all of them ran"
    age = now - float(lease.get("heartbeat", 0.0))
    if age > timeout:
        return f"its heartbeat is {age:.0f} s old (lease_timeout {timeout:.0f} s)"
    return None


def describe_holder(lease: dict, now: float | None = None) -> str:
    now = time.time() if now is None else now
    if lease.get("unreadable"):
        return "a run whose lease file cannot be read"
    hosts: dict[str, list[int]] = {}
    for p in lease.get("processes", []):
        hosts.setdefault(p["host"], []).append(p["pid"])
    where = "; ".join(f"{host} pids {pids}" for host, pids in hosts.items())
    job = f", Slurm job {lease['slurm_job_id']}" if lease.get("slurm_job_id") else ""
    return (f"the run started {lease.get('started', '?')} ({where}{job}), last heartbeat "
            f"{now - float(lease.get('heartbeat', 0.0)):.0f} s ago")


def in_use(path: Path, held: dict, timeout: float) -> str:
    """Why a launch is refused: the folder of lease file `path` is held by the live run `held`."""
    return (f"{path.parent} is in use by {describe_holder(held)} (lease file {path}). Two "
            f"runs in one output_dir would write the same checkpoints. Stop that run or choose "
            f"another output_dir. A dead run's lease is taken over by the next launch once its "
            f"processes on this machine are gone, or once its heartbeat is older than "
            f"lease_timeout ({timeout:.0f} s).")


class RunLease:
    """The lease of one run on `output_dir`, held by rank 0 on behalf of every rank's `processes`."""

    def __init__(self, output_dir: Path, timeout: float, processes: list[dict]):
        self.path = Path(output_dir) / LEASE_FILE
        self.timeout = timeout
        self.token = uuid.uuid4().hex
        self.started_at = time.time()
        self.processes = processes
        self.lost = False  # another launch took the lease over: this run must stop
        self.log = get_logger()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def heartbeat_interval(self) -> float:
        return min(10.0, self.timeout / 4)

    def record(self) -> dict:
        return {"token": self.token, "processes": self.processes,
                "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(self.started_at)),
                "started_at": self.started_at, "heartbeat": time.time(),
                "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
                "slurm_restart": os.environ.get("SLURM_RESTART_COUNT", "0")}

    # -- acquire and release ------------------------------------------------------------------
    def acquire(self) -> None:
        """Take the lease, or raise LeaseHeldError naming the run that holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self._create():
            return
        held = read_lease(self.path)
        if held is None and self._create():  # released between our two looks
            return
        held = held or read_lease(self.path) or {}
        reason = why_stale(held, self.timeout)
        if reason is None:
            raise LeaseHeldError(in_use(self.path, held, self.timeout))
        self._replace()
        time.sleep(TAKEOVER_SETTLE_S)
        if not self.is_ours():
            raise LeaseHeldError(f"{self.path.parent}: another launch took over the stale lease at "
                                 f"the same moment ({describe_holder(read_lease(self.path) or {})}).")
        self.log.warning("took over the lease of %s from %s: %s", self.path.parent, describe_holder(held),
                         reason)

    def _create(self) -> bool:
        """Create the lease file if none exists (atomically); whether this call created it."""
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(self.record()))
            f.flush()
            os.fsync(f.fileno())
        return True

    def _replace(self) -> None:
        """Write the lease whole, then rename it over the old one: readers see one or the other."""
        tmp = self.path.with_name(f"{LEASE_FILE}.{socket.gethostname()}.{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            f.write(json.dumps(self.record()))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def is_ours(self) -> bool:
        held = read_lease(self.path)
        return held is not None and held.get("token") == self.token

    def release(self) -> None:
        self.stop_heartbeat()
        if not self.lost and self.is_ours():
            self.path.unlink(missing_ok=True)

    # -- heartbeat ----------------------------------------------------------------------------
    def beat(self) -> None:
        """Refresh the heartbeat; mark the lease lost if another launch has taken it."""
        if not self.is_ours():
            self.lost = True
            self.log.error("the lease of %s was taken over by %s: this run stops without saving",
                           self.path.parent, describe_holder(read_lease(self.path) or {}))
            return
        self._replace()

    def start_heartbeat(self) -> None:
        def run():
            while not self._stop.wait(self.heartbeat_interval) and not self.lost:
                try:
                    self.beat()
                except OSError as e:  # a shared filesystem's hiccup: try again at the next beat
                    self.log.warning("lease heartbeat failed (%s); retrying", e)

        self._thread = threading.Thread(target=run, name="pan-lease-heartbeat", daemon=True)
        self._thread.start()

    def stop_heartbeat(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None


def refuse_if_held(output_dir: str | Path, timeout: float, world) -> None:
    """Refuse the launch (LeaseHeldError on every rank; collective) when a live run holds
    output_dir's lease, reading only: for the checks that run before the lease is taken (`pan
    check`'s rows, which probe whether the folder can be written), so that a refused launch leaves a
    held folder as it was. A free or stale lease passes; `run_lease` then takes it (or is refused
    after all, when another launch took it meanwhile)."""
    problem = None
    if world.is_main:
        path = Path(output_dir) / LEASE_FILE
        try:
            held = read_lease(path) if path.is_file() else None
        except OSError:  # unreadable: the checks and the lease itself say why
            held = None
        if held is not None and why_stale(held, timeout) is None:
            problem = in_use(path, held, timeout)
    problem = first_problem(problem)
    if problem is not None:
        raise LeaseHeldError(problem)


@contextlib.contextmanager
def run_lease(output_dir: str | Path, timeout: float, world) -> Iterator[RunLease | None]:
    """Hold output_dir's lease for the run (collective: every rank enters together). Rank 0 holds it
    for all ranks (yielded there, None elsewhere); every rank raises LeaseHeldError when refused."""

    processes = [this_process()]
    if dist.is_initialized():
        processes = [None] * dist.get_world_size()
        dist.all_gather_object(processes, this_process())
    lease, problem = None, None
    if world.is_main:
        lease = RunLease(Path(output_dir), timeout, processes)
        try:
            lease.acquire()
        except (LeaseHeldError, OSError) as e:
            problem = str(e) if isinstance(e, LeaseHeldError) else f"cannot write the lease: {e}"
    problem = first_problem(problem)
    if problem is not None:
        raise LeaseHeldError(problem)
    if lease is not None:
        lease.start_heartbeat()
    try:
        yield lease
    finally:
        if lease is not None:
            lease.release()

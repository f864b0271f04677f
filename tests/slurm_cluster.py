"""A real two-node Slurm cluster for a pytest session, started and stopped by scripts/local_slurm.sh.

Both nodes are slurmd daemons on this machine (pan0, pan1 at 127.0.0.1), so a multi-node job runs
one task per node with its own SLURM_NODEID, as on a real cluster.

Use it from a test module with `from slurm_cluster import slurm_cluster  # noqa: F401` and take the
`slurm_cluster` fixture. Tests that need it are skipped (with the reason) when Slurm is not installed;
`.ci/install_slurm.sh` installs it. The daemons are stopped by PID at the end of the session, also
when tests fail.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
LOCAL_SLURM = REPO_ROOT / "scripts" / "local_slurm.sh"
NODES = 2


def slurm_installed() -> bool:
    # Debian puts the daemons in /usr/sbin, which is not on every user's PATH.
    return all(shutil.which(p) or Path("/usr/sbin", p).exists() for p in ("slurmctld", "slurmd", "munged"))


def environ_outside_slurm() -> dict[str, str]:
    """This process's environment minus every SLURM_* variable (pytest may itself run in a job)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}


# Job states after which a job no longer runs (`scontrol show job`'s JobState).
ENDED_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "PREEMPTED", "NODE_FAIL", "OUT_OF_MEMORY",
                "BOOT_FAIL", "DEADLINE"}


@dataclass
class JobEnd:
    """How Slurm recorded a job's end: its JobState and ExitCode=<exit_code>:<signal>, the fields
    sacct prints (this cluster has no accounting database, so they are read from slurmctld)."""
    state: str
    exit_code: int
    signal: int


@dataclass
class SlurmCluster:
    base: Path  # holds etc/slurm.conf, log/, state/, munge/ of this cluster
    nodes: int
    env: dict[str, str]  # an environment whose Slurm commands talk to this cluster

    def sbatch_wait(self, script: Path, args: list[str], *, env: dict[str, str], cwd: Path, output: Path,
                    timeout: float, options: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
        """Submit `script args` with `sbatch --wait [options]` (they beat the script's #SBATCH lines);
        returns once the job ended, with the job's exit code."""
        return subprocess.run(
            ["sbatch", "--wait", f"--output={output}", *options, str(script), *args],
            env={**self.env, **env}, cwd=cwd, capture_output=True, text=True, timeout=timeout,
        )

    def submit(self, script: Path, args: list[str], *, env: dict[str, str], cwd: Path, output: Path,
               options: tuple[str, ...] = ()) -> str:
        """Submit `script args` (`options` beat the script's #SBATCH lines); returns the job id."""
        submitted = subprocess.run(
            ["sbatch", "--parsable", f"--output={output}", *options, str(script), *args],
            env={**self.env, **env}, cwd=cwd, capture_output=True, text=True, timeout=60, check=True)
        return submitted.stdout.strip().split(";")[0]

    def wait_for_end(self, job_id: str, timeout: float) -> JobEnd:
        """Wait until the job has ended; its state and exit code as slurmctld records them. Polled
        well within MinJobAge (4 s here), the time an ended job stays in slurmctld's memory."""
        deadline = time.time() + timeout
        record = ""
        while time.time() < deadline:
            shown = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=self.env,
                                   capture_output=True, text=True, timeout=60, check=False)
            assert shown.returncode == 0, f"job {job_id} is gone before its end was seen: {shown.stderr}"
            record = shown.stdout
            state = re.search(r"\bJobState=(\S+)", record)
            if state and state.group(1) in ENDED_STATES:
                exit_code, signal = re.search(r"\bExitCode=(\d+):(\d+)", record).groups()
                return JobEnd(state.group(1), int(exit_code), int(signal))
            time.sleep(0.2)
        raise AssertionError(f"job {job_id} still runs after {timeout:g} s: {record}")

    def job_log(self, output: Path) -> str:
        return output.read_text() if output.exists() else "<no job output>"


def local_slurm(command: str, base: Path, *args: str) -> subprocess.CompletedProcess:
    """Run `scripts/local_slurm.sh command base args...`."""
    return subprocess.run([str(LOCAL_SLURM), command, str(base), *args], capture_output=True, text=True,
                          timeout=60)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory) -> Iterator[SlurmCluster]:
    if not slurm_installed():
        pytest.skip("Slurm is not installed (slurmctld/slurmd/munged missing): run .ci/install_slurm.sh")
    base = tmp_path_factory.mktemp("slurm")
    started = local_slurm("start", base, str(NODES))
    if started.returncode != 0:
        local_slurm("stop", base)  # start stops what it began, but be sure
        pytest.fail(f"local Slurm did not start:\n{started.stderr}")
    env = environ_outside_slurm()
    env["SLURM_CONF"] = str(base / "etc" / "slurm.conf")
    try:
        yield SlurmCluster(base=base, nodes=NODES, env=env)
    finally:
        stopped = local_slurm("stop", base)
        assert stopped.returncode == 0, f"local Slurm did not stop cleanly:\n{stopped.stderr}"

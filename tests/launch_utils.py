"""Start the ranks of one `train.py` launch as torchrun would (RANK, WORLD_SIZE, ...), without
torchrun's agent in between, so a test's SIGKILL reaches exactly the training processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from dist_utils import free_port

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent


def launch(config: Path, log: Path, world_size: int = 2, **env_extra: str) -> list[subprocess.Popen]:
    """The `world_size` ranks of one launch of train.py on `config`, output appended to `log`."""
    port = str(free_port())
    procs = []
    for rank in range(world_size):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{TESTS}",
               "TQDM_DISABLE": "1", "RANK": str(rank), "LOCAL_RANK": str(rank),
               "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, **env_extra}
        with open(log, "a") as out:
            procs.append(subprocess.Popen([sys.executable, str(ROOT / "train.py"), "--config", str(config)],
                                          cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT))
    return procs


def run_to_end(config: Path, log: Path, world_size: int = 2, timeout: float = 240, **env_extra: str) -> None:
    procs = launch(config, log, world_size, **env_extra)
    codes = [p.wait(timeout=timeout) for p in procs]
    assert codes == [0] * world_size, log.read_text()[-3000:]


def last_logged_step(output_dir: Path) -> int:
    """The highest step in output_dir/metrics.jsonl (0: none yet; a half-written line is ignored)."""
    path = output_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return max((json.loads(line)["step"] for line in lines if line.endswith("}")), default=0)


def kill_after_step(procs: list[subprocess.Popen], output_dir: Path, step: int, log: Path,
                    timeout: float = 180) -> None:
    """SIGKILL every rank once `step` is logged."""
    deadline = time.time() + timeout
    while last_logged_step(output_dir) < step:
        assert all(p.poll() is None for p in procs), log.read_text()[-3000:]
        assert time.time() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)
    for p in procs:
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=60)


def consumed(output_dir: Path) -> dict[str, dict[int, str]]:
    """Per dp rank: step -> sample ids (a step trained again after a kill: its last line)."""
    out = {}
    for path in sorted((output_dir / "consumed").iterdir()):
        out[path.name] = {int(line.split()[0]): line.split(" ", 1)[1]
                          for line in path.read_text().splitlines()}
    return out


def consumed_per_step(output_dir: Path) -> dict[int, list[str]]:
    """Step -> the sample ids every rank trained in it (sorted), each rank's last line of the step."""
    steps: dict[int, dict[str, list[str]]] = {}
    for path in (output_dir / "consumed").glob("*.txt"):
        for line in path.read_text().splitlines():
            step, *ids = line.split()
            steps.setdefault(int(step), {})[path.name] = ids
    return {step: sorted(i for ids in by_rank.values() for i in ids) for step, by_rank in steps.items()}


def loss_per_step(output_dir: Path) -> dict[int, float]:
    """Step -> logged loss (a step trained again after a kill: its last row)."""
    path = output_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    return {row["step"]: row["loss"] for row in rows if "loss" in row}


def assert_continues_the_run(reference: Path, continued: Path, first_step: int, last_step: int,
                             rel: float = 1e-5) -> None:
    """From `first_step` on, a run continued on another layout trains exactly the samples the
    reference run trained at each step, and its loss is the reference's within `rel` (default:
    floating-point noise: the same global batch and draws, reduced in another order)."""
    want, got = consumed_per_step(reference), consumed_per_step(continued)
    assert sorted(got) == list(range(first_step, last_step + 1))
    for step in got:
        assert got[step] == want[step], step
    want_loss, got_loss = loss_per_step(reference), loss_per_step(continued)
    for step in got:
        assert abs(got_loss[step] - want_loss[step]) <= rel * abs(want_loss[step]), (
            step, got_loss[step], want_loss[step])


def logged_rows(output_dir: Path) -> dict[int, dict]:
    """Step -> its last logged row of metrics."""
    path = output_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    return {row["step"]: row for row in rows if "loss" in row}

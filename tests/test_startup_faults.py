"""A launcher that dies while its ranks start (issue 28, finding 1).

A real `torchrun --nproc_per_node 2 train.py` on the tests' toy recipe, its torchrun SIGKILLed at
moments of the start-up: as soon as the ranks exist (torchrun is usually gone before their first
line runs), while they import torch, and once the lease is taken (after `init_process_group`).
torchrun starts each rank in a session of its own, so the kill misses them: each rank must notice on
its own and exit within a few seconds, with one log line saying why. Also: the process group's
timeout (`process_group_timeout`, which bounds the rendezvous) reaches the process group.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from launch_utils import ROOT, TESTS
from pan.runtime.watchdog import LAUNCHER_GONE_EXIT_CODE
from pan.runtime.watchdog_config import WatchdogConfig

PLUGIN = {"PAN_RECIPE_MODULES": "pan_toy_gan"}
GONE_WITHIN_S = 8.0  # the watch looks 4 times a second; the rest is slack for a loaded 2-core machine
LAUNCHER_GONE = re.compile(rf"\[pan r(\d)\] .* ERROR the launcher of this rank \(pid \S+\) is gone: this "
                           rf"rank stops \(exit {LAUNCHER_GONE_EXIT_CODE}\)")


def toy_config(path: Path, output_dir: Path) -> Path:
    cfg = {"recipe": "toy_gan", "model": {"toy_width": 8, "toy_samples": 40, "toy_batch": 2},
           "training": {"max_steps": 1000, "learning_rate": 1e-2, "warmup_steps": 0, "dtype": "fp32"},
           "output": {"output_dir": str(output_dir), "save_interval": 1000, "log_interval": 1,
                      "progress_bar": False}}
    path.write_text(yaml.safe_dump(cfg))
    return path


def proc_stat(pid: int) -> list[str] | None:
    """Fields 3 on of /proc/<pid>/stat (state, ppid, ...; None: no such process)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def children_running(parent: int, script: str) -> dict[int, str]:
    """pid -> start time of the processes of `parent` whose command line runs `script`."""
    found = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        stat = proc_stat(int(entry.name))
        if stat is None or int(stat[1]) != parent:
            continue
        try:
            command = Path(f"/proc/{entry.name}/cmdline").read_bytes()
        except OSError:
            continue
        if script.encode() in command:
            found[int(entry.name)] = stat[19]
    return found


def alive(pid: int, start: str) -> bool:
    """Whether that process (same pid, same start time) still runs (a zombie has ended)."""
    stat = proc_stat(pid)
    return stat is not None and stat[19] == start and stat[0] != "Z"


def wait_until(condition, what: str, log: Path, timeout: float) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"{what}:\n{log.read_text()[-3000:]}"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    """One config for every case: each launch before the lease writes nothing; the lease case
    starts afresh in a folder of its own through --output_dir."""
    root = tmp_path_factory.mktemp("startup")
    return toy_config(root / "toy.yaml", root / "unused")


# When torchrun is SIGKILLed: as soon as its ranks exist, while they import, after the lease.
MOMENTS = ["spawned", "importing", "lease-taken"]


@pytest.mark.parametrize("moment", MOMENTS)
def test_every_rank_stops_when_torchrun_dies_during_start_up(moment, config, tmp_path):
    out, log = tmp_path / "run", tmp_path / "torchrun.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{TESTS}",
           "TQDM_DISABLE": "1", **PLUGIN}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    with open(log, "w") as f:
        torchrun = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
             str(ROOT / "train.py"), "--config", str(config), "--output_dir", str(out)],
            cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    ranks: dict[int, str] = {}
    try:
        def spawned() -> bool:
            ranks.update(children_running(torchrun.pid, "train.py"))
            assert torchrun.poll() is None, log.read_text()[-3000:]
            return len(ranks) == 2

        wait_until(spawned, "torchrun starts its 2 ranks", log, timeout=60)
        if moment == "importing":
            time.sleep(0.5)  # train.py's first line has run; torch is still being imported
        elif moment == "lease-taken":
            wait_until(lambda: (out / "lease.json").exists(), "the ranks take the lease", log, timeout=90)
        torchrun.send_signal(signal.SIGKILL)
        torchrun.wait()
        killed = time.time()
        wait_until(lambda: not any(alive(pid, start) for pid, start in ranks.items()),
                   f"the ranks stop within {GONE_WITHIN_S:g} s of torchrun's death", log, timeout=GONE_WITHIN_S)
        print(f"{moment}: both ranks stopped {time.time() - killed:.1f} s after torchrun was killed")
    finally:
        torchrun.kill()
        for pid, start in ranks.items():
            if alive(pid, start):
                os.kill(pid, signal.SIGKILL)
    text = log.read_text()
    said = sorted(int(rank) for rank in LAUNCHER_GONE.findall(text))
    assert said == [0, 1], text[-3000:]  # one line per rank, and nothing else said why
    assert "Traceback" not in text and "lost a peer process" not in text, text[-3000:]


def test_the_process_group_timeout_bounds_the_rendezvous(monkeypatch, tmp_path):
    """A rendezvous with a launcher's store that is gone waits process_group_timeout, not the
    default 30 minutes: train() hands the job's process config to init_world."""
    import pan.trainer
    from pan.checkpoint.manager import CheckpointConfig
    from pan.parallel.world import ProcessConfig
    from pan.recipes.pan.config import PanJobConfig

    job = PanJobConfig(process=ProcessConfig(process_group_timeout=7),
                       checkpoint=CheckpointConfig(output_dir=str(tmp_path / "run")),
                       watchdog=WatchdogConfig(watchdog=False, exit_when_launcher_dies=False))
    given = []

    def init_world(cfg=None):
        given.append(cfg)
        raise pan.trainer.ConfigError(None, "stop here")

    monkeypatch.setattr(pan.trainer, "init_world", init_world)
    assert pan.trainer.train(job) == 2
    assert given[0].process_group_timeout == 7

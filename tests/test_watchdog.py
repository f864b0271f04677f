"""The hang watchdog (pan/runtime/watchdog.py): its limits, and real 2-rank runs of the tests' toy recipe in
which rank 1 hangs inside a step, or in the resume before the first step (frozen by SIGSTOP, or stuck
as on a dead file system). Rank 0 (and a rank 1 that can) must write its Python stacks to the log
and exit with the watchdog's code within the configured time, instead of waiting for rank 1 forever
(or until the process group's 30-minute timeout)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from dist_utils import free_port
from launch_utils import ROOT, TESTS, last_logged_step, run_to_end
from pan.runtime.watchdog import HANG_EXIT_CODE, POLL_S, STARTUP, WAIT_FOR_PEERS_S, Watchdog

MIN_TIMEOUT = 2.0  # the test run's watchdog_min_timeout: its toy steps take milliseconds
HANG_AT_STEP = 4

# Rank 1 sleeps inside its 4th step: a test-only hook, monkeypatched into the spawned process.
RUNNER = f"""
import os, sys, time
import pan_toy_gan.task as toy_gan_recipe
from pan.cli import cmd_train
from pan.parallel.world import exit_process

real_step = toy_gan_recipe.ToyGanTask.train_step

def hung_step(self, ctx, micro_batches):
    if ctx.step == {HANG_AT_STEP - 1} and os.environ["RANK"] == "1":
        time.sleep(3600)  # stands for a rank stuck inside its step
    return real_step(self, ctx, micro_batches)

toy_gan_recipe.ToyGanTask.train_step = hung_step
exit_process(cmd_train(sys.argv[1:]))
"""


def test_limits_follow_the_median_with_a_floor_and_a_first_timeout():
    dog = Watchdog(factor=10, min_timeout=5, first_timeout=100, rank=0, world_size=1)
    assert dog.limit("step") == 100  # no history yet
    dog.history["step"].extend([0.1, 0.2, 30.0])
    assert dog.limit("step") == 5  # 10 x median 0.2 = 2 s, raised to the floor
    dog.history["save"].extend([3.0, 4.0, 5.0])
    assert dog.limit("save") == 40  # 10 x median 4 s
    with dog.watching("save"):
        pass
    assert len(dog.history["save"]) == 4
    assert "max(5 s, 10 x the median" in dog.describe() and "100 s for the first" in dog.describe()


def test_the_start_up_has_a_limit_of_its_own():
    dog = Watchdog(factor=10, min_timeout=5, first_timeout=100, rank=0, world_size=1, startup_timeout=40)
    assert dog.limit(STARTUP) == 40 and dog.limit("step") == 100
    with dog.watching(STARTUP):
        pass
    assert dog.limit(STARTUP) == 40  # never a median: there is one start-up per launch
    assert "or a start-up longer than 40 s, is a hang" in dog.describe()


def write_config(path: Path, output_dir: Path, max_steps: int = 1000) -> Path:
    cfg = {"recipe": "toy_gan", "model": {"toy_width": 8, "toy_samples": 40, "toy_batch": 2},
           "training": {"max_steps": max_steps, "learning_rate": 1e-2, "warmup_steps": 0, "dtype": "fp32",
                        "watchdog_factor": 5.0, "watchdog_min_timeout": MIN_TIMEOUT,
                        "watchdog_first_timeout": 60.0},
           "output": {"output_dir": str(output_dir), "save_interval": 1000, "log_interval": 1,
                      "progress_bar": False}}
    path.write_text(yaml.safe_dump(cfg))
    return path


def launch_runner(runner: str, config: Path, log: Path, args: tuple[str, ...] = (), **env_extra: str
                  ) -> list[subprocess.Popen]:
    """The 2 ranks of one launch of `runner` (a train.py with a test-only hook) on `config`."""
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{TESTS}",
               "PAN_RECIPE_MODULES": "pan_toy_gan", "RANK": str(rank), "LOCAL_RANK": str(rank),
               "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
               **env_extra}
        with open(log, "a") as f:
            procs.append(subprocess.Popen([sys.executable, "-c", runner, "--config", str(config), *args],
                                          cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT))
    return procs


def test_a_rank_hung_inside_a_step_stops_every_rank_with_their_stacks(tmp_path):
    out, log = tmp_path / "run", tmp_path / "train.log"
    config = write_config(tmp_path / "toy.yaml", out)
    procs = launch_runner(RUNNER, config, log)
    deadline = time.time() + 180
    while last_logged_step(out) < HANG_AT_STEP - 1:
        assert time.time() < deadline and all(p.poll() is None for p in procs), log.read_text()[-3000:]
        time.sleep(0.05)
    hang_began = time.time()
    # The configured time: the floor, the watchdog's poll, and the wait for the peers' dumps at most;
    # plus slack for a loaded 2-core machine.
    allowed = MIN_TIMEOUT + 2 * POLL_S + WAIT_FOR_PEERS_S + 15
    codes = [p.wait(timeout=allowed + 60) for p in procs]
    took = time.time() - hang_began
    text = log.read_text()
    assert codes == [HANG_EXIT_CODE] * 2, text[-4000:]
    assert took < allowed, (took, text[-4000:])
    print(f"both ranks exited {took:.1f} s after step {HANG_AT_STEP - 1} was logged")

    assert f"watchdog: a step, save or validation running longer than max({MIN_TIMEOUT:g} s, 5 x" in text
    for rank in (0, 1):
        assert f"watchdog: Python stacks of rank {rank}" in text, text[-4000:]
    stacks = text[text.index("watchdog: Python stacks of rank"):]
    assert "in hung_step" in stacks  # rank 1's stack shows where it hangs
    assert re.search(r"step \d+ has run \d+ s, longer than its limit of 2 s", text), text[-4000:]
    assert last_logged_step(out) == HANG_AT_STEP - 1


# --- a hang before the first step (issue 28, finding 3) -------------------------------------------

STARTUP_TIMEOUT = 8.0  # the relaunch's watchdog_startup_timeout: its healthy start-up takes ~1-2 s
PEERS_WAIT_S = 3.0     # the relaunch's wait for the other ranks' dumps (WAIT_FOR_PEERS_S)

# Rank 1 of the relaunch stops in its resume: frozen (SIGSTOP: it can write nothing) right after the
# lease, where the resume looks for the newest checkpoint, or stuck (a dead file system: it still
# writes its stacks) reading its own files of the checkpoint. A test-only hook, as RUNNER above.
STARTUP_RUNNER = f"""
import os, signal, sys, time
import pan.runtime.watchdog
from pan.checkpoint.manager import Checkpointer
from pan.cli import cmd_train
from pan.parallel.world import exit_process

pan.runtime.watchdog.WAIT_FOR_PEERS_S = {PEERS_WAIT_S}
how, where = os.environ["HANG_HOW"], os.environ["HANG_WHERE"]
real = getattr(Checkpointer, where)

def rank_1_hangs(self, *args, **kwargs):
    if os.environ["RANK"] == "1":
        if how == "frozen":
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            time.sleep(3600)
    return real(self, *args, **kwargs)

setattr(Checkpointer, where, rank_1_hangs)
exit_process(cmd_train(sys.argv[1:]))
"""


def proc_state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


@pytest.mark.parametrize("how,where", [("frozen", "latest_step"), ("stuck", "_read_local_state")])
def test_a_rank_hung_in_the_resume_stops_the_run_with_the_stacks(how, where, tmp_path):
    out, log = tmp_path / "run", tmp_path / "train.log"
    config = write_config(tmp_path / "toy.yaml", out, max_steps=2)
    run_to_end(config, tmp_path / "first.log", world_size=2, timeout=180, PAN_RECIPE_MODULES="pan_toy_gan")
    # The first launch saved its last step (2): the relaunch resumes from it.
    procs = launch_runner(STARTUP_RUNNER, config, log, ("--max_steps", "4", "--watchdog_startup_timeout",
                                                        str(STARTUP_TIMEOUT)), HANG_HOW=how, HANG_WHERE=where)
    try:
        deadline = time.time() + 120
        hook = "rank_1_hangs" if how == "stuck" else None
        while (proc_state(procs[1].pid) != "T") if how == "frozen" else ("lease of" not in log.read_text()):
            assert time.time() < deadline and procs[0].poll() is None, log.read_text()[-3000:]
            time.sleep(0.05)
        hang_began = time.time()
        # The start-up limit, the watchdog's poll and the wait for the peers' dumps at most; plus
        # slack for a loaded 2-core machine.
        allowed = STARTUP_TIMEOUT + 2 * POLL_S + PEERS_WAIT_S + 15
        code = procs[0].wait(timeout=allowed + 60)
        took = time.time() - hang_began
        if how == "stuck":  # rank 1 also sees its start-up run too long: it writes its stacks too
            assert procs[1].wait(timeout=30) == HANG_EXIT_CODE, log.read_text()[-4000:]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    text = log.read_text()
    assert code == HANG_EXIT_CODE, text[-4000:]
    assert took < allowed, (took, text[-4000:])
    print(f"{how} in {where}: rank 0 exited {HANG_EXIT_CODE} {took:.1f} s after the hang began")
    assert f"or a start-up longer than {STARTUP_TIMEOUT:g} s, is a hang" in text
    assert re.search(rf"rank \d: the start-up has run \d+ s, longer than its limit of {STARTUP_TIMEOUT:g} s",
                     text), text[-4000:]
    stacks = text[text.index("watchdog: Python stacks of rank 0"):]
    assert "in latest_step" in stacks or "in resume" in stacks, stacks[:4000]  # rank 0 waits for rank 1
    if hook is not None:
        assert "watchdog: Python stacks of rank 1" in text and f"in {hook}" in text, text[-4000:]
    assert last_logged_step(out) == 2  # nothing was trained

"""The hang watchdog (pan/watchdog.py): its limits, and a real 2-rank run of the tests' toy recipe in
which rank 1 hangs inside a step. Both ranks must write their Python stacks to the log and exit with
the watchdog's code within the configured time, instead of rank 0 waiting for rank 1 forever."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import yaml

from dist_utils import free_port
from launch_utils import ROOT, TESTS, last_logged_step
from pan.watchdog import HANG_EXIT_CODE, POLL_S, WAIT_FOR_PEERS_S, Watchdog

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


def write_config(path: Path, output_dir: Path) -> Path:
    cfg = {"recipe": "toy_gan", "model": {"toy_width": 8, "toy_samples": 40, "toy_batch": 2},
           "training": {"max_steps": 1000, "learning_rate": 1e-2, "warmup_steps": 0, "dtype": "fp32",
                        "watchdog_factor": 5.0, "watchdog_min_timeout": MIN_TIMEOUT,
                        "watchdog_first_timeout": 60.0},
           "output": {"output_dir": str(output_dir), "save_interval": 1000, "log_interval": 1,
                      "progress_bar": False}}
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_a_rank_hung_inside_a_step_stops_every_rank_with_their_stacks(tmp_path):
    out, log = tmp_path / "run", tmp_path / "train.log"
    config = write_config(tmp_path / "toy.yaml", out)
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{TESTS}",
               "PAN_RECIPE_MODULES": "pan_toy_gan", "RANK": str(rank), "LOCAL_RANK": str(rank),
               "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        with open(log, "a") as f:
            procs.append(subprocess.Popen([sys.executable, "-c", RUNNER, "--config", str(config)], cwd=ROOT,
                                          env=env, stdout=f, stderr=subprocess.STDOUT))
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

"""A SIGTERM before the first step (issue 52, finding 1): a preemption during the start-up ends the
run with 143, not as a crash.

A real 2-rank launch of the tests' toy recipe through pan's launch wrapper (`python -m
pan.launch_command torchrun`, what the launch scripts run), one phase of the start-up slowed by a
test-only hook: the rendezvous (rank 1 comes late, so rank 0 waits in it), the model build, or the
loader build (over a saved checkpoint, so there is a resume to leave alone). A SIGTERM to the
wrapper while the phase runs: it passes the signal on, the ranks finish the phase, stop together
at its end with one log line each, release the lease and exit 143; the wrapper exits 143. No
checkpoint is written (a resumed run's checkpoint is untouched) and the next launch trains (checked
after the model build and the loader build). Under
the local Slurm (tests/slurm_cluster.py), `scancel --signal=TERM` at that moment: the job records 143.
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

from dist_utils import free_port
from launch_utils import ROOT, TESTS, last_logged_step
from pan.checkpoint import layout
from pan.checkpoint.lease import LEASE_FILE
from pan.runtime.watchdog import record_sigterm, stop_recording_sigterm
from pan.trainer import StoppedBeforeTraining, sigterm_stops_the_start_up, stop_if_sigterm
from slurm_cluster import slurm_cluster  # noqa: F401  (a fixture: a real local Slurm)

PLUGIN = {"PAN_RECIPE_MODULES": "pan_toy_gan"}
SLOW_S = 4.0  # how long the hook holds its phase: the SIGTERM comes within it
# After the slowed phase ends, the ranks stop at its boundary: a collective, the log line, the
# lease's release, the wrapper's report. Seconds, plus slack for a loaded 2-core machine.
STOPS_WITHIN_S = 10.0
LINE = re.compile(r"\[pan r(\d)\] .* WARNING SIGTERM during start-up \(([^)]*)\): nothing trained yet, "
                  r"exiting 143 so the job is requeued")

# train.py with a test-only hook: the first call of one start-up function sleeps SLOW_S (on the
# ranks named), saying when the phase begins and ends.
RUNNER = """\
import os, sys, time
import pan.trainer
from pan.cli import cmd_train
from pan.parallel.world import exit_process

phase, seconds, rank = os.environ["SLOW_PHASE"], float(os.environ["SLOW_S"]), os.environ["RANK"]


def slowed(real, ranks):
    calls = []

    def hooked(*args, **kwargs):
        first = not calls
        calls.append(1)
        if first:
            print(f"test hook: rank {rank} {phase} begins", flush=True)
            if rank in ranks:
                time.sleep(seconds)
        result = real(*args, **kwargs)
        if first:
            print(f"test hook: rank {rank} {phase} ends", flush=True)
        return result
    return hooked


if phase == "rendezvous":  # rank 1 comes late: rank 0 waits in the rendezvous meanwhile
    pan.trainer.init_world = slowed(pan.trainer.init_world, {"1"})
elif phase == "model build":
    pan.trainer.build_part = slowed(pan.trainer.build_part, {"0", "1"})
elif phase == "loader build":
    pan.trainer.build_loader_everywhere = slowed(pan.trainer.build_loader_everywhere, {"0", "1"})
exit_process(cmd_train(sys.argv[1:]))
"""


def toy_config(path: Path, output_dir: Path, max_steps: int) -> Path:
    cfg = {"recipe": "toy_gan", "model": {"toy_width": 8, "toy_samples": 40, "toy_batch": 2},
           "training": {"max_steps": max_steps, "learning_rate": 1e-2, "warmup_steps": 0, "dtype": "fp32"},
           "output": {"output_dir": str(output_dir), "save_interval": 1000, "log_interval": 1,
                      "progress_bar": False}}
    path.write_text(yaml.safe_dump(cfg))
    return path


def launch_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{TESTS}",
           "TQDM_DISABLE": "1", **PLUGIN, **extra}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def wrapper(runner: Path, config: Path, log: Path, phase: str, *args: str) -> subprocess.Popen:
    """pan's launch wrapper running torchrun with 2 ranks of `runner` (output appended to `log`)."""
    with open(log, "a") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "pan.launch_command", "torchrun", "--standalone", "--nproc_per_node", "2",
             str(runner), "--config", str(config), *args],
            cwd=ROOT, env=launch_env(SLOW_PHASE=phase, SLOW_S=str(SLOW_S)), stdout=f, stderr=subprocess.STDOUT)


def files_of(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under `folder`: relative path -> (size, mtime in ns)."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def run_to_end(runner: Path, config: Path, log: Path, *args: str) -> str:
    proc = wrapper(runner, config, log, "none", *args)
    assert proc.wait(timeout=240) == 0, log.read_text()[-4000:]
    return log.read_text()


def test_the_start_up_records_sigterm_and_stops_at_the_end_of_a_phase():
    """In one process (a world of one): inside train()'s start-up a SIGTERM is only recorded, and
    the next phase boundary raises the 143 stop; outside it the boundaries do nothing. The handler
    is restored by whoever installed it (`pan train` before train())."""
    before = signal.getsignal(signal.SIGTERM)
    stop_if_sigterm("model build")  # outside train(): nothing
    with sigterm_stops_the_start_up():
        stop_if_sigterm("rendezvous")  # no SIGTERM yet
        os.kill(os.getpid(), signal.SIGTERM)  # recorded, not fatal
        with pytest.raises(StoppedBeforeTraining) as stopped:
            stop_if_sigterm("model build")
    assert signal.getsignal(signal.SIGTERM) is before
    assert stopped.value.exit_code == 143
    assert str(stopped.value) == ("SIGTERM during start-up (model build): nothing trained yet, exiting 143 "
                                  "so the job is requeued")
    assert record_sigterm()  # an outer caller (`pan train`) records first: it restores the handler
    try:
        with sigterm_stops_the_start_up():
            pass
        assert signal.getsignal(signal.SIGTERM) is not before
    finally:
        stop_recording_sigterm()
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.fixture(scope="module")
def runner(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("runner") / "slow_start_train.py"
    path.write_text(RUNNER)
    return path


@pytest.mark.parametrize("phase", ["rendezvous", "model build", "loader build"])
def test_a_sigterm_during_the_start_up_exits_143_and_the_next_launch_trains(phase, runner, tmp_path):
    out, log = tmp_path / "run", tmp_path / "launch.log"
    config = toy_config(tmp_path / "toy.yaml", out, max_steps=2)
    saved: dict[str, tuple[int, int]] = {}
    if phase == "loader build":  # a checkpoint to resume from: the stopped launch leaves it as it was
        run_to_end(runner, config, tmp_path / "first.log")
        assert [p.name for p in layout.complete_checkpoints(out)] == ["checkpoint-2"]
        saved = files_of(out / "checkpoint-2")

    proc = wrapper(runner, config, log, phase, "--max_steps", "4")
    begun = [f"test hook: rank {r} {phase} begins" for r in (0, 1)]
    ended = [f"test hook: rank {r} {phase} ends" for r in (0, 1)]
    deadline = time.time() + 180
    while not all(line in log.read_text() for line in begun):
        assert proc.poll() is None and time.time() < deadline, log.read_text()[-4000:]
        time.sleep(0.05)
    time.sleep(0.5)  # rank 0 is inside the phase (waiting in the rendezvous, sleeping in the hook)
    proc.send_signal(signal.SIGTERM)
    signalled = time.time()
    phase_end = None
    try:
        while proc.poll() is None:
            if phase_end is None and all(line in log.read_text() for line in ended):
                phase_end = time.time()
            assert time.time() < signalled + SLOW_S + 120, log.read_text()[-4000:]
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait()
    stopped = time.time()
    text = log.read_text()
    assert proc.returncode == 143, text[-4000:]
    # Both ranks finished the phase (not killed by the signal), then stopped at its end, together.
    assert phase_end is not None, text[-4000:]
    print(f"{phase}: the wrapper exited 143 {stopped - phase_end:.1f} s after the phase ended "
          f"({stopped - signalled:.1f} s after the SIGTERM)")
    assert stopped - phase_end < STOPS_WITHIN_S, text[-4000:]
    said = sorted((int(rank), where) for rank, where in LINE.findall(text))
    assert said == [(0, phase), (1, phase)], text[-4000:]
    assert "pan launch: SIGTERM: passed on" in text and "pan launch: status 143 (rank" in text, text[-4000:]
    assert "Traceback" not in text and "lost a peer" not in text, text[-4000:]
    assert "| loss" not in text, text[-4000:]  # nothing trained
    assert not (out / LEASE_FILE).exists()  # released
    if saved:
        assert [p.name for p in out.glob("checkpoint-*")] == ["checkpoint-2"], text[-4000:]
        assert files_of(out / "checkpoint-2") == saved  # the resume's state untouched
    else:
        assert not list(out.glob("checkpoint-*")), text[-4000:]

    if phase == "rendezvous":
        return  # the relaunch of a fresh folder: the model build's case
    # The next launch (a requeue) trains: from the start, or on from the checkpoint.
    again = run_to_end(runner, config, tmp_path / "again.log", "--max_steps", "3")
    assert "training finished at step 3" in again, again[-4000:]
    assert ("resuming from checkpoint-2" in again) == bool(saved), again[-4000:]
    assert last_logged_step(out) == 3 and (out / "checkpoint-3" / layout.MARKER).is_file()


# ---- under the local Slurm -----------------------------------------------------------------------

def test_scancel_during_the_start_up_records_143_and_the_next_job_trains(slurm_cluster, runner, tmp_path):
    """`scancel --signal=TERM` reaches every process of the job's step (srun, the wrapper, both
    ranks) while they build the model: the job ends 143:0 (the batch shell is not signalled: the
    ranks' status is the job's), nothing is saved, and the next job trains."""
    out, log = tmp_path / "run", tmp_path / "job.out"
    config = toy_config(tmp_path / "toy.yaml", out, max_steps=2)
    script = ROOT / "scripts" / "pretrain.sh"

    def env(phase: str) -> dict[str, str]:
        return {**slurm_cluster.env, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{TESTS}",
                **PLUGIN, "PAN_ROOT": str(ROOT), "PAN_PYTHON": sys.executable, "PAN_NPROC_PER_NODE": "2",
                "PAN_TRAIN_SCRIPT": str(runner), "SLOW_PHASE": phase, "SLOW_S": str(SLOW_S),
                "MASTER_PORT": str(free_port()), "TQDM_DISABLE": "1"}

    job = slurm_cluster.submit(script, [str(config)], env=env("model build"), cwd=tmp_path, output=log)
    deadline = time.time() + 180
    while not all(f"test hook: rank {r} model build begins" in slurm_cluster.job_log(log) for r in (0, 1)):
        assert time.time() < deadline, slurm_cluster.job_log(log)
        time.sleep(0.1)
    subprocess.run(["scancel", "--signal=TERM", job], env=slurm_cluster.env, check=True, timeout=60)
    ended = slurm_cluster.wait_for_end(job, timeout=120)
    text = slurm_cluster.job_log(log)
    assert (ended.state, ended.exit_code, ended.signal) == ("FAILED", 143, 0), (ended, text[-4000:])
    assert sorted(int(rank) for rank, _ in LINE.findall(text)) == [0, 1], text[-4000:]
    assert "the ranks' status is 143" in text and "Traceback" not in text, text[-4000:]
    assert not list(out.glob("checkpoint-*")) and not (out / LEASE_FILE).exists(), text[-4000:]

    result = slurm_cluster.sbatch_wait(script, [str(config)], env=env("none"), cwd=tmp_path,
                                       output=tmp_path / "again.out", timeout=180)
    again = slurm_cluster.job_log(tmp_path / "again.out")
    assert result.returncode == 0 and "training finished at step 2" in again, again[-4000:]

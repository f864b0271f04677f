"""One run per output folder (pan/checkpoint/lease.py) and ranks that outlive their launcher.

The lease's rules on lease files written by hand (other hosts, dead and reused pids, a requeued Slurm
job, a heartbeat that stops, a takeover behind a holder's back), then real launches of train.py on
the tests' toy recipe: a second launch on a running output_dir is refused with exit 2 naming the
holder; once the holder is SIGKILLed the next launch takes the lease over and resumes; ranks whose
torchrun was SIGKILLed stop on their own, and the launch after them takes over.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import yaml

from dist_utils import free_port
from launch_utils import ROOT, TESTS, last_logged_step, run_to_end
from pan.checkpoint import layout
from pan.checkpoint.consolidate import consolidated_weights
from pan.checkpoint.lease import (LEASE_FILE, LeaseHeldError, RunLease, process_alive, process_start,
                                  read_lease, this_process, why_stale)
from pan.cli import main as pan_main
from slurm_cluster import slurm_cluster  # noqa: F401  (a fixture: a real local Slurm)

PLUGIN = {"PAN_RECIPE_MODULES": "pan_toy_gan"}  # also found by its entry point: this names it twice
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture
def pan_log(caplog):
    logger = logging.getLogger("pan")  # pan's logger does not propagate
    logger.addHandler(caplog.handler)
    yield caplog
    logger.removeHandler(caplog.handler)


def dead_process() -> dict:
    """This machine's record of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.2)"])
    record = {**this_process(), "pid": proc.pid, "start": process_start(proc.pid)}
    proc.wait()
    return record


def write_lease(output_dir: Path, processes: list[dict], heartbeat_age: float = 0.0, **extra) -> None:
    output_dir.mkdir(parents=True, exist_ok=True)
    record = {"token": "theirs", "processes": processes, "started": "2026-01-01T00:00:00",
              "heartbeat": time.time() - heartbeat_age, **extra}
    (output_dir / LEASE_FILE).write_text(json.dumps(record))


# --- the rules ------------------------------------------------------------------------------------

def test_a_live_holder_refuses_a_second_run_until_it_releases(tmp_path):
    first = RunLease(tmp_path, timeout=60, processes=[this_process()])
    first.acquire()
    second = RunLease(tmp_path, timeout=60, processes=[this_process()])
    with pytest.raises(LeaseHeldError) as refused:
        second.acquire()
    message = str(refused.value)
    assert f"pids [{os.getpid()}]" in message and this_process()["host"] in message
    assert "lease_timeout (60 s)" in message
    first.release()
    assert not (tmp_path / LEASE_FILE).exists()
    second.acquire()  # free now
    assert read_lease(tmp_path / LEASE_FILE)["token"] == second.token


def test_a_lease_whose_processes_here_are_gone_is_taken_over_at_once(tmp_path, pan_log):
    write_lease(tmp_path, [dead_process(), dead_process()])  # heartbeat fresh: a run just SIGKILLed
    lease = RunLease(tmp_path, timeout=3600, processes=[this_process()])
    lease.acquire()
    assert read_lease(tmp_path / LEASE_FILE)["token"] == lease.token
    assert any("took over the lease" in r.getMessage() and "none of its processes is alive" in r.getMessage()
               for r in pan_log.records)


def test_a_reused_pid_does_not_keep_a_lease_alive(tmp_path):
    me = this_process()
    assert why_stale({"processes": [me], "heartbeat": time.time()}, timeout=60) is None
    reused = {**me, "start": me["start"] + 1}  # the same pid, another process
    assert why_stale({"processes": [reused], "heartbeat": time.time()}, timeout=60) is not None


def test_another_hosts_lease_waits_for_its_heartbeat_to_go_stale(tmp_path):
    other = {"host": "node-that-is-not-this-one", "boot": "x", "pid": 1234, "start": 1}
    write_lease(tmp_path, [other], heartbeat_age=30)
    with pytest.raises(LeaseHeldError, match="node-that-is-not-this-one pids \\[1234\\].*last heartbeat 30 s ago"):
        RunLease(tmp_path, timeout=60, processes=[this_process()]).acquire()
    write_lease(tmp_path, [other], heartbeat_age=61)
    RunLease(tmp_path, timeout=60, processes=[this_process()]).acquire()
    # A process alive here keeps a lease, however old its heartbeat (a run stopped with SIGSTOP).
    write_lease(tmp_path, [other, this_process()], heartbeat_age=1000)
    with pytest.raises(LeaseHeldError):
        RunLease(tmp_path, timeout=60, processes=[this_process()]).acquire()


def test_a_requeued_slurm_job_takes_over_its_earlier_run(tmp_path, monkeypatch):
    other = {"host": "node-that-is-not-this-one", "boot": "x", "pid": 1234, "start": 1}
    write_lease(tmp_path, [other], slurm_job_id="77", slurm_restart="0")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    RunLease(tmp_path, timeout=3600, processes=[this_process()]).acquire()
    write_lease(tmp_path, [other], slurm_job_id="78", slurm_restart="0")  # another job: refused
    with pytest.raises(LeaseHeldError):
        RunLease(tmp_path, timeout=3600, processes=[this_process()]).acquire()


def test_the_heartbeat_advances_and_a_takeover_behind_its_back_is_noticed(tmp_path):
    lease = RunLease(tmp_path, timeout=0.4, processes=[this_process()])  # a beat every 0.1 s
    lease.acquire()
    first = read_lease(tmp_path / LEASE_FILE)["heartbeat"]
    lease.start_heartbeat()
    deadline = time.time() + 10
    while read_lease(tmp_path / LEASE_FILE)["heartbeat"] == first:
        assert time.time() < deadline
        time.sleep(0.05)
    write_lease(tmp_path, [this_process()])  # another launch's lease replaces ours
    while not lease.lost:
        assert time.time() < deadline
        time.sleep(0.05)
    lease.release()
    assert read_lease(tmp_path / LEASE_FILE)["token"] == "theirs"  # the new holder's lease is left alone


def test_an_unreadable_lease_is_stale_only_after_the_timeout(tmp_path):
    (tmp_path / LEASE_FILE).write_text("{not json")
    with pytest.raises(LeaseHeldError, match="cannot be read"):
        RunLease(tmp_path, timeout=60, processes=[this_process()]).acquire()
    os.utime(tmp_path / LEASE_FILE, (time.time() - 120, time.time() - 120))
    RunLease(tmp_path, timeout=60, processes=[this_process()]).acquire()


# --- real launches --------------------------------------------------------------------------------

def toy_config(path: Path, output_dir: Path, max_steps: int = 1000) -> Path:
    """The tests' GAN recipe, slowed to 0.1 s a step so that a launch is still running when we look."""
    cfg = {"recipe": "toy_gan", "model": {"toy_width": 8, "toy_samples": 40, "toy_batch": 2, "toy_step_sleep": 0.1},
           "training": {"max_steps": max_steps, "learning_rate": 1e-2, "warmup_steps": 0, "dtype": "fp32"},
           "output": {"output_dir": str(output_dir), "save_interval": 2, "log_interval": 1,
                      "progress_bar": False, "save_total_limit": 2}}
    path.write_text(yaml.safe_dump(cfg))
    return path


def env_of(rank: int | None = None, world_size: int = 1, port: int = 0) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{TESTS}", **PLUGIN}
    if rank is not None:
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                   LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return env


def start_train(config: Path, log: Path, *args: str) -> subprocess.Popen:
    """One plain `python train.py` process (a world of one), output appended to `log`."""
    with open(log, "a") as out:
        return subprocess.Popen([sys.executable, str(ROOT / "train.py"), "--config", str(config), *args],
                                cwd=ROOT, env=env_of(), stdout=out, stderr=subprocess.STDOUT)


def wait_for(condition, what: str, log: Path, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"{what}:\n{log.read_text()[-3000:]}"
        time.sleep(0.05)


def test_a_second_launch_is_refused_then_takes_over_once_the_first_is_killed(tmp_path):
    out, log = tmp_path / "run", tmp_path / "train.log"
    config = toy_config(tmp_path / "toy.yaml", out)
    first = start_train(config, log)
    wait_for(lambda: last_logged_step(out) >= 2, "the first launch trains", log)

    second_log = tmp_path / "second.log"
    second = start_train(config, second_log)
    assert second.wait(timeout=120) == 2, second_log.read_text()
    refusal = second_log.read_text()
    assert "is in use by the run started" in refusal and f"pids [{first.pid}]" in refusal, refusal
    assert first.poll() is None  # the first run was not disturbed

    wait_for(lambda: layout.complete_checkpoints(out), "the first launch saves", log)
    first.send_signal(signal.SIGKILL)
    first.wait()
    killed_at = last_logged_step(out)
    third = start_train(config, log, "--max_steps", str(killed_at + 2))
    assert third.wait(timeout=120) == 0, log.read_text()[-3000:]
    text = log.read_text()
    assert "took over the lease of" in text and "none of its processes is alive" in text
    assert "resuming from checkpoint-" in text
    assert not (out / LEASE_FILE).exists()  # released by the run that ended


def folder_state(folder: Path) -> tuple[int, dict[str, tuple[int, int]]]:
    """The folder's own mtime and each entry's (size, mtime), all in ns."""
    return folder.stat().st_mtime_ns, {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir()}


def test_a_refused_launch_writes_nothing_into_the_held_folder(tmp_path, monkeypatch, capsys):
    """Issue 52, finding 2: the launch learns that output_dir is held before `pan check`'s rows run
    at its start, whose output-dir row probes the folder by creating and deleting a `.pan-check-*`
    file. A launch refused by a live holder leaves the folder as it was: no probe in it (every
    probe is recorded), its entries and mtimes (the folder's own too) unchanged."""
    out = tmp_path / "run"
    config = toy_config(tmp_path / "toy.yaml", out)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # the live run
    probes: list[Path] = []
    real = tempfile.NamedTemporaryFile

    def recorded(*args, **kwargs):
        probes.append(Path(kwargs.get("dir") or tempfile.gettempdir()))
        return real(*args, **kwargs)

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", recorded)
    monkeypatch.setenv("PAN_RECIPE_MODULES", PLUGIN["PAN_RECIPE_MODULES"])
    try:
        write_lease(out, [{**this_process(), "pid": holder.pid, "start": process_start(holder.pid)}])
        (out / "checkpoint-2").mkdir()  # what the holder wrote so far
        before = folder_state(out)
        time.sleep(0.05)  # a write now would give a later mtime than the ones recorded
        code = pan_main(["train", "--config", str(config), "--exit_when_launcher_dies", "false"])
        refusal = capsys.readouterr().err
        assert code == 2, refusal
        assert "is in use by the run started" in refusal and f"pids [{holder.pid}]" in refusal, refusal
        assert folder_state(out) == before
        assert not any(p.resolve() == out.resolve() for p in probes), probes
    finally:
        holder.kill()
        holder.wait()
    # The recording sees the probe: `pan check` (which takes no lease) probes this very folder.
    pan_main(["check", "--config", str(config)])
    assert any(p.resolve() == out.resolve() for p in probes), probes


def test_ranks_of_a_killed_torchrun_stop_and_the_next_launch_takes_over(tmp_path):
    out, log = tmp_path / "run", tmp_path / "torchrun.log"
    config = toy_config(tmp_path / "toy.yaml", out)
    with open(log, "w") as f:
        torchrun = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
             str(ROOT / "train.py"), "--config", str(config)],
            cwd=ROOT, env=env_of(), stdout=f, stderr=subprocess.STDOUT)
    # A complete checkpoint first: the kill may otherwise land inside the first save, and the
    # relaunch would rightly start afresh.
    wait_for(lambda: layout.complete_checkpoints(out), "torchrun's ranks train and save", log, timeout=180)
    ranks = read_lease(out / LEASE_FILE)["processes"]
    assert len(ranks) == 2 and all(process_alive(p) for p in ranks)

    torchrun.send_signal(signal.SIGKILL)  # its ranks run in sessions of their own: the kill misses them
    torchrun.wait()
    killed = time.time()
    wait_for(lambda: not any(process_alive(p) for p in ranks), "the orphaned ranks stop", log, timeout=20)
    print(f"orphaned ranks stopped {time.time() - killed:.1f} s after torchrun was killed")
    assert log.read_text().count("the launcher of this rank") >= 1

    # A rank that saw its peer go first may have ended through the error path, releasing the lease.
    left_behind = (out / LEASE_FILE).exists()
    short = toy_config(tmp_path / "short.yaml", out, max_steps=last_logged_step(out) + 1)
    relaunch_log = tmp_path / "relaunch.log"
    run_to_end(short, relaunch_log, world_size=2, **PLUGIN)
    text = relaunch_log.read_text()
    assert "resuming from checkpoint-" in text
    assert ("took over the lease of" in text) == left_behind, text[-3000:]


# --- a Slurm job warned before its time limit saves, requeues itself and resumes -----------------

def consumed_steps(output_dir: Path) -> dict[str, list[int]]:
    return {p.name: [int(line.split()[0]) for line in p.read_text().splitlines()]
            for p in sorted((output_dir / "consumed").glob("*.txt"))}


def test_a_warned_slurm_job_saves_requeues_itself_and_resumes(slurm_cluster, tmp_path):
    """`--signal=B:USR1@N` makes Slurm send USR1 to the batch shell N s before the time limit; here
    `scancel --batch --signal=USR1` sends it at a chosen moment (a real time limit is whole minutes,
    and Slurm may signal up to a minute early). The job saves, requeues itself, resumes and ends
    with the weights of an uninterrupted run, every step trained once."""
    steps = 30
    straight, warned = tmp_path / "straight", tmp_path / "warned"
    run_to_end(toy_config(tmp_path / "straight.yaml", straight, max_steps=steps), tmp_path / "straight.log",
               world_size=2, **PLUGIN)

    log = tmp_path / "job.out"
    env = {**slurm_cluster.env, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{TESTS}", **PLUGIN,
           "PAN_ROOT": str(ROOT), "PAN_PYTHON": sys.executable, "PAN_NPROC_PER_NODE": "2",
           "MASTER_PORT": str(free_port())}
    config = toy_config(tmp_path / "warned.yaml", warned, max_steps=steps)
    submitted = subprocess.run(["sbatch", "--parsable", "--requeue", "--open-mode=append", f"--output={log}",
                                str(ROOT / "scripts" / "pretrain.sh"), str(config)],
                               env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60, check=True)
    job = submitted.stdout.strip().split(";")[0]
    wait_for(lambda: last_logged_step(warned) >= 3, "the job trains", log, timeout=180)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=env, check=True, timeout=60)

    def state() -> str:
        return subprocess.run(["squeue", "-h", "-o", "%T", "-j", job], env=env, capture_output=True, text=True,
                              timeout=60).stdout.strip()
    wait_for(lambda: state() == "PENDING", "the job is requeued", log, timeout=120)
    # Slurm holds a requeued job back for about two minutes (its BeginTime). A test need not wait
    # that long, only until the node has revoked the first run's credential (a start within the same
    # second would be refused).
    time.sleep(5)
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=env, check=True, timeout=60)
    wait_for(lambda: state() == "", "the requeued job finishes", log, timeout=300)

    text = log.read_text()
    assert "warning signal (USR1" in text and f"requeueing job {job}" in text, text[-3000:]
    stopped = int(re.search(r"stopped by SIGTERM after step (\d+)", text).group(1))
    assert 3 <= stopped < steps and f"resuming from checkpoint-{stopped}" in text, text[-3000:]
    assert f"training finished at step {steps}" in text, text[-3000:]
    assert consumed_steps(warned) == {name: list(range(1, steps + 1)) for name in ("0.txt", "1.txt")}
    final = {part: consolidated_weights(straight / f"checkpoint-{steps}" / part) for part in ("generator", "discriminator")}
    for part, weights in final.items():
        resumed = consolidated_weights(warned / f"checkpoint-{steps}" / part)
        assert all(torch.equal(weights[k], resumed[k]) for k in weights), part


def test_a_job_warned_by_its_real_time_limit_saves_requeues_itself_and_finishes(slurm_cluster, tmp_path):
    """The same through a real time limit: `--time=2 --signal=B:USR1@60`. slurmctld checks time
    limits every 30 s and sends the warning up to 30 s early, so it comes 30-60 s into the run (after
    the start-up: the first steps are trained), 60 s or more before the limit is enforced; the run is
    made slow enough to be still training then (0.5 s a step, in the first run only: at most 120 of
    its 300 steps by then). The job saves, requeues itself before the limit, and its second run
    finishes: the weights of an uninterrupted run, every step trained once."""
    steps = 300
    straight, warned = tmp_path / "straight", tmp_path / "warned"

    def config(name: str, output_dir: Path, sleep: float) -> Path:
        path = toy_config(tmp_path / f"{name}.yaml", output_dir, max_steps=steps)
        cfg = yaml.safe_load(path.read_text())
        cfg["model"].update(toy_step_sleep=sleep, toy_sleep_first_run_only=True)
        cfg["output"].update(save_interval=50, log_interval=10)
        path.write_text(yaml.safe_dump(cfg))
        return path
    run_to_end(config("straight", straight, 0.0), tmp_path / "straight.log", world_size=2, **PLUGIN)

    log = tmp_path / "job.out"
    env = {**slurm_cluster.env, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{TESTS}", **PLUGIN,
           "PAN_ROOT": str(ROOT), "PAN_PYTHON": sys.executable, "PAN_NPROC_PER_NODE": "2",
           "MASTER_PORT": str(free_port())}
    submitted = subprocess.run(["sbatch", "--parsable", "--time=2", "--signal=B:USR1@60", "--requeue",
                                "--open-mode=append", f"--output={log}", str(ROOT / "scripts" / "pretrain.sh"),
                                str(config("warned", warned, 0.5))],
                               env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60, check=True)
    job = submitted.stdout.strip().split(";")[0]

    def state() -> str:
        return subprocess.run(["squeue", "-h", "-o", "%T", "-j", job], env=env, capture_output=True, text=True,
                              timeout=60).stdout.strip()
    def requeued() -> bool:
        return log.exists() and "requeueing job" in log.read_text() and state() == "PENDING"
    wait_for(requeued, "the job is warned and requeued", log, timeout=240)
    time.sleep(5)  # (see the test above: skip the requeued job's BeginTime)
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=env, check=True, timeout=60)
    wait_for(lambda: state() == "", "the requeued job finishes", log, timeout=300)

    text = log.read_text()
    assert "warning signal (USR1" in text and f"requeueing job {job}" in text, text[-3000:]
    stopped = int(re.search(r"stopped by SIGTERM after step (\d+)", text).group(1))
    assert 0 < stopped < steps and f"resuming from checkpoint-{stopped}" in text, text[-3000:]
    assert f"training finished at step {steps}" in text, text[-3000:]
    assert consumed_steps(warned) == {name: list(range(1, steps + 1)) for name in ("0.txt", "1.txt")}
    for part in ("generator", "discriminator"):
        want = consolidated_weights(straight / f"checkpoint-{steps}" / part)
        got = consolidated_weights(warned / f"checkpoint-{steps}" / part)
        assert all(torch.equal(want[k], got[k]) for k in want), part


def test_every_sbatch_script_asks_for_the_warning_signal_and_requeue():
    """The save-and-requeue path only runs when the job asks Slurm for USR1 before its time limit and
    may be requeued; a requeued job appends to its output file instead of truncating it."""
    scripts = [p for p in (ROOT / "scripts").glob("*.sh") if "#SBATCH --job-name" in p.read_text()]
    assert len(scripts) >= 5
    for script in scripts:
        header = [line.split()[1] for line in script.read_text().splitlines() if line.startswith("#SBATCH ")]
        assert {"--signal=B:USR1@300", "--requeue", "--open-mode=append"} <= set(header), script.name

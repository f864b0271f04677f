"""The Pan demo's training step alone and beside one busy process, for each way of choosing CPU
threads: the evidence for pan's choice (pan/parallel/threads.py).

Each setting trains the demo's model (`pan demo`'s config, data and precomputed clips) for
`--steps` steps in a fresh process (OpenMP reads its environment once, at start) and reports the
median wall time of a step after `--skip` warm-up steps, from the run's metrics.jsonl. "beside 1
busy" starts a process that spins on one core (`while True: pass`) before the run and stops it
after. The settings:

- `pan's choice`: nothing set; pan measures the idle cores at start (`set_cpu_threads`);
- `OMP_NUM_THREADS=1`; `OMP_NUM_THREADS=<cores>` (torch's default); the same with
  `OMP_WAIT_POLICY=PASSIVE` (waiting threads sleep instead of spinning).

    python benchmarks/cpu_threads.py [--steps 30] [--out benchmarks/results/cpu_threads.json]
    python benchmarks/cpu_threads.py --quick      # 2 settings, 4 steps: the script's smoke test

Columns: `alone_s`, `busy_s` (median step seconds), `busy/alone`, and `vs best alone` (busy_s over
the fastest setting's alone_s). Goal (issue 30): one competing process costs pan's choice at most 2x.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import machine_info, print_table, write_json  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def settings(cores: int, quick: bool) -> dict[str, dict[str, str]]:
    every = {"pan's choice": {}, "OMP_NUM_THREADS=1": {"OMP_NUM_THREADS": "1"},
             f"OMP_NUM_THREADS={cores}": {"OMP_NUM_THREADS": str(cores)},
             f"OMP_NUM_THREADS={cores}, PASSIVE": {"OMP_NUM_THREADS": str(cores), "OMP_WAIT_POLICY": "PASSIVE"}}
    return dict(list(every.items())[:2]) if quick else every


def child(work: Path, steps: int, quick: bool) -> None:
    """Train the demo's model for `steps` steps in this process (what `pan demo` trains)."""
    from pan.config import load_config_or_exit
    from pan.demo.main import job_argv, make_data, parse_args, precompute_clips
    from pan.parallel.threads import set_cpu_threads
    from pan.trainer import build_trainer

    set_cpu_threads()
    args = parse_args(["--out", str(work), "--steps", str(steps), *(["--quick"] if quick else [])])
    data = make_data(work / "data", Path(args.config), args.quick)
    source = load_config_or_exit(job_argv(args, data["train_csv"], work / "prep"))
    csv = precompute_clips(source, work / "data" / "latents")
    run = work / f"run-{os.getpid()}"
    job = load_config_or_exit([*job_argv(args, csv, run), "--log_interval", "1", "--save_interval", str(10 * steps)])
    trainer = build_trainer(job)
    try:
        trainer.fit()
    finally:
        trainer.close()
    times = [json.loads(line)["step_time"] for line in (run / "metrics.jsonl").read_text().splitlines()
             if '"step_time"' in line]
    print("STEP_TIMES " + json.dumps(times))


def run_setting(env_changes: dict[str, str], work: Path, steps: int, quick: bool, busy: bool) -> list[float]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    env.update(env_changes)
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        if spinner:
            time.sleep(0.5)   # running before the run measures the idle cores
        out = subprocess.run([sys.executable, __file__, "--child", str(work), "--steps", str(steps),
                              *(["--quick"] if quick else [])], env=env, cwd=REPO, capture_output=True,
                             text=True, timeout=3600)
    finally:
        if spinner:
            spinner.kill()
            spinner.wait()
    lines = [line for line in out.stdout.splitlines() if line.startswith("STEP_TIMES ")]
    if out.returncode != 0 or not lines:
        raise SystemExit(f"the run failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    chosen = [line for line in out.stderr.splitlines() if "CPU threads:" in line]
    if chosen:
        print(f"    {chosen[-1].split('CPU threads: ', 1)[1][:90]}")
    return json.loads(lines[-1].split(" ", 1)[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--skip", type=int, default=5, help="warm-up steps left out of the median")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "cpu_threads.json"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.skip = 4, 1
    if args.child:
        child(Path(args.child), args.steps, args.quick)
        return 0

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    rows = []
    with tempfile.TemporaryDirectory(prefix="pan-cpu-threads-") as tmp:
        work = Path(tmp)
        for name, env in settings(cores, args.quick).items():
            medians = {}
            for busy in (False, True):
                print(f"{name}, {'beside 1 busy process' if busy else 'alone'} ...", flush=True)
                times = run_setting(env, work, args.steps, args.quick, busy)
                medians[busy] = statistics.median(times[args.skip:] or times)
            rows.append({"setting": name, "alone_s": round(medians[False], 4), "busy_s": round(medians[True], 4),
                         "busy/alone": round(medians[True] / medians[False], 2)})
    best = min(r["alone_s"] for r in rows)
    for r in rows:
        r["vs best alone"] = round(r["busy_s"] / best, 2)
    print_table(rows, ["setting", "alone_s", "busy_s", "busy/alone", "vs best alone"])
    path = write_json(args.out, {"machine": machine_info(), "steps": args.steps, "skip": args.skip,
                                 "quick": args.quick, "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A demo's training step alone and beside one busy process, for each way of choosing CPU threads:
the evidence for pan's choice (pan/parallel/threads.py).

Each setting trains the demo's model (`--demo pan`: `pan demo`'s config, data and precomputed
clips; `--demo causal_vae` / `pyramid_flow_ar`: that recipe demo's config, data and tiny model
folder; each with its data worker process) for `--steps` steps in a fresh process (OpenMP reads its
environment once, at start) and reports the median wall time of a step after `--skip` warm-up steps, from the run's metrics.jsonl. "beside 1
busy" starts a process that spins on one core (`while True: pass`) before the run and stops it
after. The settings:

- `pan's choice`: nothing set; pan measures the idle cores at start (`set_cpu_threads`);
- `OMP_NUM_THREADS=1`; `OMP_NUM_THREADS=<cores>` (torch's default); the same with
  `OMP_WAIT_POLICY=PASSIVE` (waiting threads sleep instead of spinning).

    python benchmarks/cpu_threads.py [--demo pan] [--steps 30] [--out benchmarks/results/cpu_threads.json]
    python benchmarks/cpu_threads.py --demo all   # the three demos, one table (--out: cpu_threads_all.json)
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


def pan_demo_job(work: Path, steps: int, quick: bool):
    """`pan demo`'s job (its command line), on its data and precomputed clips, for `steps` steps."""
    from pan.config import load_config_or_exit
    from pan.recipes.pan.demo import job_argv, make_data, parse_args, precompute_clips

    args = parse_args(["--out", str(work), "--steps", str(steps), *(["--quick"] if quick else [])])
    data = make_data(work / "data", Path(args.config), args.quick)
    source = load_config_or_exit(job_argv(args, data["train_csv"], work / "prep"))
    csv = precompute_clips(source, work / "data" / "latents")
    return lambda run: job_argv(args, csv, run)


def causal_vae_demo_job(work: Path, steps: int, quick: bool):
    """`pan demo --recipe causal_vae`'s job (no validation: only its training steps are timed)."""
    from pan.demo import kit
    from pan.recipes.causal_vae import demo

    args = demo.parse_args(["--out", str(work), "--steps", str(steps), *(["--quick"] if quick else [])])
    data = kit.make_data(work / "data-vae", args.quick, demo.SIZE, demo.NUM_FRAMES)

    def job(run: Path) -> list[str]:
        overrides = demo.vae_job_overrides(args, data, run)
        for key in ("validation_interval", "validation_csv", "validation_clips"):
            overrides.pop(key)
        return kit.job_argv(demo.VAE_CONFIG, overrides)
    return job


def pyramid_flow_ar_demo_job(work: Path, steps: int, quick: bool):
    """`pan demo --recipe pyramid_flow_ar`'s job, on its clips (encoded once) and tiny released-layout
    model folder."""
    from pan.recipes.pyramid_flow_ar import demo

    args = demo.parse_args(["--out", str(work), "--steps", str(steps), *(["--quick"] if quick else [])])
    data, model = demo.make_ar_inputs(work / "data-ar", work / "model-ar", args.quick)

    def job(run: Path):
        return ["--config", str(demo.write_ar_config(args, data, model, run, run.parent / f"{run.name}.yaml"))]
    return job


DEMO_JOBS = {"pan": pan_demo_job, "causal_vae": causal_vae_demo_job, "pyramid_flow_ar": pyramid_flow_ar_demo_job}


def child(demo: str, work: Path, steps: int, quick: bool) -> None:
    """Train `demo`'s model for `steps` steps in this process (what that demo trains)."""
    from pan.config import load_config_or_exit
    from pan.parallel.threads import set_cpu_threads
    from pan.trainer import build_trainer

    set_cpu_threads()
    argv_for = DEMO_JOBS[demo](work, steps, quick)
    run = work / f"run-{os.getpid()}"
    job = load_config_or_exit([*argv_for(run), "--log_interval", "1", "--save_interval", str(10 * steps)])
    trainer = build_trainer(job)
    try:
        trainer.fit()
    finally:
        trainer.close()
    times = [json.loads(line)["step_time"] for line in (run / "metrics.jsonl").read_text().splitlines()
             if '"step_time"' in line]
    print("STEP_TIMES " + json.dumps(times))


def run_setting(demo: str, env_changes: dict[str, str], work: Path, steps: int, quick: bool,
                busy: bool) -> list[float]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    env.update(env_changes)
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        if spinner:
            time.sleep(0.5)   # running before the run measures the idle cores
        out = subprocess.run([sys.executable, __file__, "--child", str(work), "--demo", demo, "--steps", str(steps),
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
    parser.add_argument("--demo", choices=[*DEMO_JOBS, "all"], default="pan", help="whose training step to time")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--skip", type=int, default=5, help="warm-up steps left out of the median")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", help="the JSON (default: benchmarks/results/cpu_threads.json for the Pan "
                                      "demo, cpu_threads_<demo>.json for another)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.skip = 4, 1
    if args.child:
        child(args.demo, Path(args.child), args.steps, args.quick)
        return 0

    from pan.parallel.threads import cores_here

    cores = cores_here()
    demos = list(DEMO_JOBS) if args.demo == "all" else [args.demo]
    rows = []
    with tempfile.TemporaryDirectory(prefix="pan-cpu-threads-") as tmp:
        for demo in demos:
            rows += demo_rows(demo, cores, Path(tmp) / demo, args)
    print_table(rows, ["demo", "setting", "alone_s", "busy_s", "busy/alone", "vs best alone"])
    name = "cpu_threads.json" if args.demo == "pan" else f"cpu_threads_{args.demo}.json"
    path = write_json(args.out or REPO / "benchmarks" / "results" / name,
                      {"machine": machine_info(), "steps": args.steps, "skip": args.skip, "quick": args.quick,
                       "rows": rows})
    print(f"wrote {path}")
    return 0


def demo_rows(demo: str, cores: int, work: Path, args: argparse.Namespace) -> list[dict]:
    """One row per thread setting: the median step alone and beside one busy process."""
    rows = []
    for name, env in settings(cores, args.quick).items():
        medians = {}
        for busy in (False, True):
            print(f"{demo}: {name}, {'beside 1 busy process' if busy else 'alone'} ...", flush=True)
            times = run_setting(demo, env, work, args.steps, args.quick, busy)
            medians[busy] = statistics.median(times[args.skip:] or times)
        rows.append({"demo": demo, "setting": name, "alone_s": round(medians[False], 4),
                     "busy_s": round(medians[True], 4), "busy/alone": round(medians[True] / medians[False], 2)})
    best = min(r["alone_s"] for r in rows)
    for r in rows:
        r["vs best alone"] = round(r["busy_s"] / best, 2)
    return rows


if __name__ == "__main__":
    sys.exit(main())

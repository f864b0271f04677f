"""Data at scale: what a manifest of N rows costs a run, against the 1,000-row run (issue 51).

For each size, a synthetic manifest of N rows pointing at a few real precomputed latents (the demo's
clips, `pan data synth`, encoded by `pan data precompute` with config/tiny_cpu.yaml; rows repeat
them) is
1. indexed (`pan.data.index.ensure_index`, as `pan data index` does): seconds and rows per second;
2. trained on for a few steps with `train.py --config config/tiny_cpu.yaml` (one rank, one decoding
   worker, the index reused): seconds from launch to the first logged step, and the unique memory
   (psutil USS: pages no other process shares; the index's pages are shared through the page cache)
   of the rank and of its decoding worker, the largest seen up to the first step; `--rounds` runs of
   each size, the sizes interleaved, and the median of each figure reported.
Goals (issue 51): index >= 500,000 rows/s on 2 cores; at 10 M rows, first step within 5 s and each
process's USS within 100 MB of the 1,000-row run.

    OMP_NUM_THREADS=1 python -m benchmarks.data_scale [--rows 1000 1000000 10000000]
        [--out benchmarks/results/data_scale.json]
    python -m benchmarks.data_scale --quick      # tiny sizes: the script runs whole
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

try:
    from benchmarks.common import print_table, write_json
except ModuleNotFoundError:  # run as `python benchmarks/data_scale.py`: its folder is on the path
    from common import print_table, write_json
from pan.data.index import RowIndex, ensure_index, index_candidates

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "config" / "tiny_cpu.yaml"
FIRST_STEP = re.compile(r"\bstep 1 \| loss")
GOALS = {"index_rows_per_s": 500_000, "first_step_delta_s": 5.0, "uss_delta_MiB": 100 * 1e6 / 2**20}


def pan_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "pan.cli", *args]


def precomputed_rows(work: Path) -> tuple[Path, list[str], list[list[str]]]:
    """The demo's clips precomputed: (the folder of the latents, the precomputed CSV's header and rows)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run(pan_command("data", "synth", "--out", str(work / "synth"), "--num-train", "8",
                               "--num-heldout", "0", "--size", "32", "--num-frames", "5"),
                   cwd=ROOT, env=env, check=True, capture_output=True)
    subprocess.run(pan_command("data", "precompute", "--config", str(CONFIG), "--video_csv_paths",
                               str(work / "synth" / "train.csv"), "--out", str(work / "latents")),
                   cwd=ROOT, env=env, check=True, capture_output=True)
    written = work / "latents" / "train.csv"   # precompute names its CSV after the one it read
    with open(written, newline="") as f:
        rows = list(csv.reader(f))
    return written.parent, rows[0], rows[1:]


def write_manifest(path: Path, header: list[str], rows: list[list[str]], count: int) -> Path:
    """`count` rows cycling through `rows`, written a block at a time."""
    text = io.StringIO()
    csv.writer(text).writerows(rows)
    lines = text.getvalue().splitlines(keepends=True)
    per_block = min(count, 100_000)
    block = "".join(lines[i % len(lines)] for i in range(per_block))
    with open(path, "w", newline="") as f:
        csv.writer(f).writerow(header)
        for _ in range(count // per_block):
            f.write(block)
        f.write("".join(lines[i % len(lines)] for i in range(count % per_block)))
    return path


def index_once(manifest: Path) -> dict:
    for stale in index_candidates(manifest):
        stale.unlink(missing_ok=True)
    start = time.perf_counter()
    built = ensure_index(manifest, "table")
    seconds = time.perf_counter() - start
    rows = len(RowIndex(built))
    return {"index_s": seconds, "index_rows_per_s": rows / seconds}


def first_step(manifest: Path, out: Path, steps: int) -> dict:
    """Train `steps` steps on `manifest`; seconds to the first logged step and the processes' USS."""
    command = [sys.executable, str(ROOT / "train.py"), "--config", str(CONFIG), "--video_csv_paths", str(manifest),
               "--output_dir", str(out), "--max_steps", str(steps), "--log_interval", "1",
               "--packed_dataloader_num_workers", "1", "--save_interval", str(steps)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    log = out.with_suffix(".log")
    start = time.perf_counter()
    with open(log, "w") as sink:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT)
        rank, peak = psutil.Process(proc.pid), {"rank": 0, "worker": 0}
        stepped = None
        while proc.poll() is None and stepped is None:
            _sample_uss(rank, peak)
            if FIRST_STEP.search(log.read_text()):
                stepped = time.perf_counter() - start
            time.sleep(0.1)
        code = proc.wait(timeout=600)
    if code != 0 or stepped is None:
        raise RuntimeError(f"training on {manifest} failed (exit {code}):\n{log.read_text()[-3000:]}")
    return {"first_step_s": stepped, "rank_uss_MiB": peak["rank"] / 2**20, "worker_uss_MiB": peak["worker"] / 2**20}


def _sample_uss(rank: psutil.Process, peak: dict) -> None:
    try:
        peak["rank"] = max(peak["rank"], rank.memory_full_info().uss)
        for child in rank.children(recursive=True):
            peak["worker"] = max(peak["worker"], child.memory_full_info().uss)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        pass


def markdown_table(rows: list[dict]) -> str:
    """The table docs/data.md shows (a test checks it against benchmarks/results/data_scale.json)."""
    lines = ["| rows | index build | index rows/s | first step | vs first row | rank USS | vs first row | "
             "worker USS | vs first row |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['rows']:,} | {r['index_s']:.2f} s | {r['index_rows_per_s']:,.0f} "
                     f"| {r['first_step_s']:.1f} s | {r['first_step_delta_s']:+.1f} s "
                     f"| {r['rank_uss_MiB']:.0f} MiB | {r['rank_uss_delta_MiB']:+.0f} MiB "
                     f"| {r['worker_uss_MiB']:.0f} MiB | {r['worker_uss_delta_MiB']:+.0f} MiB |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1000, 1_000_000, 10_000_000],
                        help="manifest sizes (the first is the baseline the others are compared with)")
    parser.add_argument("--steps", type=int, default=3, help="training steps of each run")
    parser.add_argument("--rounds", type=int, default=3,
                        help="training runs of each size, interleaved (the median is reported)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (200 and 5,000 rows), 1 step, 1 round")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "data_scale.json")
    args = parser.parse_args(argv)
    sizes, steps, rounds = ([200, 5000], 1, 1) if args.quick else (args.rows, args.steps, args.rounds)
    with tempfile.TemporaryDirectory(prefix="pan-data-scale-") as tmp:
        work = Path(tmp)
        folder, header, rows = precomputed_rows(work)
        manifests, results = {}, []
        for count in sizes:
            manifests[count] = write_manifest(folder / f"rows_{count}.csv", header, rows, count)
            results.append({"rows": count, **index_once(manifests[count])})
        os.sync()  # the manifests and indexes on disk before the runs, which then share the machine alike
        runs = {count: [] for count in sizes}
        for round_ in range(rounds):  # sizes interleaved: the machine's drift hits each alike
            for count in sizes:
                runs[count].append(first_step(manifests[count], work / f"run_{count}_{round_}", steps))
                print(f"{count:,} rows, round {round_ + 1}: {runs[count][-1]}", file=sys.stderr)
        for row in results:
            measured = runs[row["rows"]]
            row.update({key: statistics.median(run[key] for run in measured) for key in measured[0]})
    base = results[0]
    for row in results:
        row["first_step_delta_s"] = row["first_step_s"] - base["first_step_s"]
        row["rank_uss_delta_MiB"] = row["rank_uss_MiB"] - base["rank_uss_MiB"]
        row["worker_uss_delta_MiB"] = row["worker_uss_MiB"] - base["worker_uss_MiB"]
    columns = ["rows", "index_s", "index_rows_per_s", "first_step_s", "first_step_delta_s", "rank_uss_MiB",
               "rank_uss_delta_MiB", "worker_uss_MiB", "worker_uss_delta_MiB"]
    print_table(results, columns)
    print("\n" + markdown_table(results))
    write_json(args.out, {"config": str(CONFIG.relative_to(ROOT)), "steps": steps, "rounds": rounds,
                          "goals": GOALS, "rows": results})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

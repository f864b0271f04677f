"""`benchmarks/data_shards.py --quick`: the three layouts read through the training reader (one
file per sample, local shards, shards in a loopback S3 server it starts and stops itself; its first
epoch with read-ahead and without), the table printed and the JSON written (the goals' ratios need
the full size: the real run)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_data_shards_benchmark_quick_mode_prints_its_table_and_writes_json(tmp_path):
    out = tmp_path / "data_shards.json"
    run = subprocess.run([sys.executable, "benchmarks/data_shards.py", "--quick", "--out", str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert "samples_per_s" in run.stdout and "vs_local_shards" in run.stdout
    rows = json.loads(out.read_text())["rows"]
    layouts = {"local files", "local shards", "s3 first epoch", "s3 first epoch, no read-ahead", "s3 later epochs"}
    assert {(r["layout"], r["readers"]) for r in rows} == {(name, n) for name in layouts for n in (1, 4)}
    assert all(r["samples_per_s"] > 0 for r in rows)
    assert all((r["server_cpu_us_per_sample"] is not None) == r["layout"].startswith("s3 first") for r in rows)
    assert all(r["vs_files"] == 1 for r in rows if r["layout"] == "local files")


def test_the_docs_table_is_the_benchmarks_last_run():
    """docs/data.md's table of the shard layouts is benchmarks/recorded/data_shards.json's rows."""
    rows = json.loads((ROOT / "benchmarks/recorded/data_shards.json").read_text())["rows"]
    doc = (ROOT / "docs/data.md").read_text().split("### Sharded latents and object storage")[1]
    table = [line.split("|")[1:-1] for line in doc.splitlines() if line.startswith("| ") and "KiB)" in line]
    assert [[c.strip() for c in cells] for cells in table] == [
        [r["sample"], r["layout"], str(r["readers"]), f"{r['samples_per_s']:.0f}", f"{r['vs_files']:.2f}",
         f"{r['vs_local_shards']:.2f}", f"{r['cpu_us_per_sample']:.0f}"] for r in rows]

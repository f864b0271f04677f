"""`benchmarks/data_scale.py --quick` runs whole (tests/test_benchmark_scripts.py's style): the demo's
clips precomputed, manifests of two tiny sizes indexed and trained on by the real trainer with one
decoding worker, the table printed and the JSON written (the measurements themselves, at 1 thousand
to 10 million rows, belong to the benchmark, never to a test)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_data_scale_quick_mode_prints_its_table_and_writes_json(tmp_path):
    out = tmp_path / "data_scale.json"
    run = subprocess.run([sys.executable, "benchmarks/data_scale.py", "--quick", "--out", str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert "index_rows_per_s" in run.stdout and "worker_uss_delta_MiB" in run.stdout
    result = json.loads(out.read_text())
    assert [row["rows"] for row in result["rows"]] == [200, 5000]
    for row in result["rows"]:
        # each run reached its first step, with a rank and a decoding worker measured
        assert row["first_step_s"] > 0 and row["rank_uss_MiB"] > 0 and row["worker_uss_MiB"] > 0, row
        assert row["index_rows_per_s"] > 0
    assert result["rows"][0]["first_step_delta_s"] == 0 and result["goals"]["index_rows_per_s"] == 500_000


def test_the_docs_table_is_the_recorded_benchmark():
    """docs/data.md's "Measured" table is what benchmarks/data_scale.py printed for the run the docs
    quote (its JSON kept as benchmarks/recorded/data_scale.json: benchmarks/results/ is not kept in
    git), 1 thousand to 10 million rows, and the goals the docs state hold there."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from data_scale import GOALS, markdown_table
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    result = json.loads((ROOT / "benchmarks" / "recorded" / "data_scale.json").read_text())
    rows = result["rows"]
    assert markdown_table(rows) in (ROOT / "docs" / "data.md").read_text()
    assert [row["rows"] for row in rows] == [1000, 1_000_000, 10_000_000]
    largest = rows[-1]
    assert min(row["index_rows_per_s"] for row in rows[1:]) >= GOALS["index_rows_per_s"]
    assert largest["first_step_delta_s"] <= GOALS["first_step_delta_s"]
    assert max(largest["rank_uss_delta_MiB"], largest["worker_uss_delta_MiB"]) <= GOALS["uss_delta_MiB"]


def test_the_docs_hundred_million_row_table_is_its_recorded_run():
    """The 100-million-row run docs/data.md quotes (benchmarks/recorded/data_scale_100m.json): its
    table, and the goals at that size."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from data_scale import GOALS, markdown_table
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    rows = json.loads((ROOT / "benchmarks" / "recorded" / "data_scale_100m.json").read_text())["rows"]
    assert markdown_table(rows) in (ROOT / "docs" / "data.md").read_text()
    assert [row["rows"] for row in rows] == [1000, 100_000_000]
    largest = rows[-1]
    assert largest["index_rows_per_s"] >= GOALS["index_rows_per_s"]
    assert largest["first_step_delta_s"] <= GOALS["first_step_delta_s"]
    assert max(largest["rank_uss_delta_MiB"], largest["worker_uss_delta_MiB"]) <= GOALS["uss_delta_MiB"]

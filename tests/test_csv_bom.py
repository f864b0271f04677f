"""A CSV saved with a byte-order mark (Excel's "CSV UTF-8") reads as the plain one wherever pan reads
a user's CSV (issue 52, item 5): the video CSV of a run (train, check, precompute), a CSV given
where an annotation file is expected, and `pan eval --csv`."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from pan.config import load_job_config
from pan.data.sources import looks_like_csv_header, read_video_csv
from pan.data.synth import synth_dataset

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    paths = synth_dataset(tmp_path_factory.mktemp("data"), num_train=4, num_heldout=2, size=32, num_frames=5)
    for split in ("train", "heldout"):  # beside the plain one: the same relative paths
        plain = paths[f"{split}_csv"]
        bom = plain.with_name(f"{split}_bom.csv")
        bom.write_text(plain.read_text(encoding="utf-8"), encoding="utf-8-sig")
        assert bom.read_bytes().startswith(b"\xef\xbb\xbf")
        paths[f"{split}_bom"] = bom
    return paths


def test_a_bom_csv_has_the_plain_ones_columns_and_rows(data):
    plain, bom = read_video_csv(data["train_csv"]), read_video_csv(data["train_bom"])
    assert bom.columns == plain.columns and "path" in bom.columns
    assert list(bom.rows) == list(plain.rows)
    assert looks_like_csv_header(data["train_bom"].read_bytes().splitlines()[0]) == list(plain.columns)


def test_a_bom_csv_trains_as_the_plain_one(data, tmp_path):
    from pan.trainer import build_trainer  # the run reads the CSV through the training loader

    seen = {}
    for name in ("train_csv", "train_bom"):
        job = load_job_config(["--config", str(REPO / "config/tiny_cpu.yaml"), "--video_csv_paths", str(data[name]),
                               "--output_dir", str(tmp_path / name), "--max_steps", "1"], warn=lambda m: None)
        trainer = build_trainer(job)
        trainer.fit()
        seen[name] = trainer.state.samples_seen
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        assert not any(r.get("bad_samples") for r in rows), rows
    assert seen["train_bom"] == seen["train_csv"] > 0


def test_pan_eval_reads_a_bom_csv(data):
    from pan.demo.analyser import main

    tables = []
    for name in ("heldout_csv", "heldout_bom"):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["--csv", str(data[name])]) == 0
        tables.append(out.getvalue())
    assert tables[0] == tables[1] and "videos" in tables[0]

"""A first day with the Pan recipe's JSONL annotations (issue 29), through the commands a user types:
`pan check` reads every annotation file (malformed lines and missing videos are its `data` row's
warning, or failure when no row is usable), and a video CSV given as `--annotation_paths` is one
refusal (exit 2 naming the key) of `pan check` and `train.py`, not a warning per row."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from preflight_table import parse_table

from pan.data.synth import synth_dataset
from pan.preflight import main_check

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "config" / "tiny_cpu.yaml")


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> Path:
    """The demo's clips (tiny_cpu.yaml's 32 x 32, 5 frames): train.csv and train.jsonl."""
    return synth_dataset(tmp_path_factory.mktemp("synth"), num_train=6, num_heldout=1, size=32,
                         num_frames=5)["train_csv"]


def check(capsys, *args: str) -> tuple[int, dict[str, list[tuple[str, str]]], str]:
    code = main_check(["--config", TINY, "--video_csv_paths", "[]", *args])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    return code, parse_table(captured.out), captured.err


def test_pan_check_reads_every_annotation_row(tmp_path, clips, capsys):
    good = [json.loads(line) for line in clips.with_suffix(".jsonl").read_text().splitlines()]
    for row in good:   # paths relative to the file, written elsewhere: absolute
        row["video"] = str(clips.parent / row["video"])
    out = ["--output_dir", str(tmp_path / "run")]

    mixed = tmp_path / "mixed.jsonl"   # good rows first and last: the sampled rows decode
    lines = [json.dumps(good[0]), "not json at all", json.dumps({"video": "nowhere.mp4", "text": "lost"}),
             json.dumps(good[1]), json.dumps(good[2])]
    mixed.write_text("\n".join(lines) + "\n")
    code, rows, _ = check(capsys, "--annotation_paths", f"[{mixed}]", "--sample-rows", "2", *out)
    status, detail = rows["data"][0]
    assert status == "warn" and "2 of 5 would be skipped" in detail, detail
    assert "bad_row" in detail and "missing_file" in detail
    assert code == 0

    broken = tmp_path / "broken.jsonl"   # nothing usable: malformed lines and missing videos
    broken.write_text("\n".join(["{oops", json.dumps({"video": "a.mp4", "text": "x"}), "[1, 2]"]) + "\n")
    code, rows, _ = check(capsys, "--annotation_paths", f"[{broken}]", *out)
    assert code == 1 and rows["data"][0][0] == "fail", rows["data"]


def test_a_video_csv_given_as_annotations_is_one_refusal(tmp_path, clips, capsys):
    as_jsonl = tmp_path / "clips.jsonl"            # a CSV under a JSONL name: its header tells
    as_jsonl.write_text(clips.read_text())
    for path in (clips, as_jsonl):
        code, rows, _ = check(capsys, "--annotation_paths", f"[{path}]", "--output_dir", str(tmp_path / "run"))
        status, detail = rows["config"][0]
        assert code == 2 and status == "fail" and "`annotation_paths`" in detail and "video_csv_paths" in detail
    run = subprocess.run([sys.executable, str(REPO / "train.py"), "--config", TINY, "--video_csv_paths", "[]",
                          "--annotation_paths", f"[{clips}]", "--output_dir", str(tmp_path / "run")],
                         capture_output=True, text=True, cwd=REPO, timeout=300)
    assert run.returncode == 2, run.stderr[-2000:]
    assert "`annotation_paths`" in run.stderr and "video_csv_paths" in run.stderr
    assert "Traceback" not in run.stderr and run.stderr.count("annotation_paths") < 5, run.stderr[-2000:]


def test_a_short_runs_checkpoints_and_the_estimated_mfu_are_no_noise(tmp_path, clips, capsys):
    """tiny_cpu.yaml (20 steps, a save every 10, no save_total_limit) keeps 2 checkpoints: room for
    them is no warning; the step-time row says what its MFU counts."""
    code, rows, _ = check(capsys, "--video_csv_paths", f"[{clips}]", "--output_dir", str(tmp_path / "run"))
    assert code == 0
    status, detail = rows["output dir"][0]
    assert status == "pass" and "2 checkpoint(s) kept" in detail, detail
    # What its MFU counts, or (where the estimate outruns the measured peak) that it prints none.
    step_time = rows["step time"][0][1]
    assert "compute alone" in step_time or ("no MFU" in step_time and "unreliable" in step_time), step_time


def test_synth_help_shows_its_defaults(capsys):
    from pan.data.synth import main as synth_main

    with pytest.raises(SystemExit) as stop:
        synth_main(["--help"])
    out = capsys.readouterr().out
    assert stop.value.code == 0 and "(default: 480)" in out and "(default: yuv420p)" in out

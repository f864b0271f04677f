"""A warm-start file that cannot be read is refused with a fix, as every other unreadable file is
(issue 52, item 6): a corrupt or empty `pretrained_transformer_path` fails `pan check`'s config row
naming the key and what to do (exit 2, as a missing file's), and train.py refuses it (exit 2) before
anything is built, instead of "the `warm start` check crashed ... report this row as a bug"."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pan.checkpoint.warm_start import resolve_source
from pan.config import ConfigError
from pan.data.synth import synth_dataset
from pan.preflight import main_check

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return synth_dataset(tmp_path_factory.mktemp("data"), num_train=2, num_heldout=0, size=32,
                         num_frames=5)["train_csv"]


def warm_args(tmp_path: Path, data: Path, source: Path) -> list[str]:
    return ["--config", str(REPO / "config/tiny_cpu.yaml"), "--video_csv_paths", str(data),
            "--output_dir", str(tmp_path / "run"), "--load_transformer_weights", "true",
            "--pretrained_transformer_path", str(source)]


def check_json(args: list[str]) -> tuple[int, dict]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main_check(args + ["--json"])
    return code, json.loads(out.getvalue())


def unreadable(tmp_path: Path) -> dict[str, Path]:
    files = {"corrupt.safetensors": b"\x00\x01 not a safetensors header" * 8, "empty.safetensors": b"",
             "corrupt.pt": b"not a zip archive torch.save writes" * 4}
    for name, content in files.items():
        (tmp_path / name).write_bytes(content)
    return {name: tmp_path / name for name in files}


def test_the_source_is_refused_by_key_with_a_fix(tmp_path):
    for path in unreadable(tmp_path).values():
        with pytest.raises(ConfigError) as info:
            resolve_source(str(path))
        assert info.value.key == "pretrained_transformer_path" and str(path) in str(info.value)
        assert info.value.fix and "load_transformer_weights: false" in info.value.fix
    good = tmp_path / "good.pt"
    torch.save({"w": torch.zeros(2)}, good)
    assert resolve_source(str(good)) == ("state_dict", good)


def test_pan_check_fails_the_row_as_for_a_missing_file(tmp_path, data):
    missing_code, missing = check_json(warm_args(tmp_path, data, tmp_path / "missing.safetensors"))
    for name, path in unreadable(tmp_path).items():
        code, report = check_json(warm_args(tmp_path, data, path))
        failed = [r for r in report["rows"] if r["status"] == "fail"]
        assert code == missing_code == 2, (name, failed)
        assert not any("crashed" in r["detail"] for r in report["rows"]), failed
        row = next(r for r in failed if "pretrained_transformer_path" in r["detail"])
        assert str(path) in row["detail"] and "load_transformer_weights: false" in (row["fix"] or ""), row


def test_train_refuses_it_with_exit_2(tmp_path, data):
    path = unreadable(tmp_path)["corrupt.safetensors"]
    done = subprocess.run([sys.executable, str(REPO / "train.py"), *warm_args(tmp_path, data, path)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "pretrained_transformer_path" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "run" / "config.yaml").exists()  # refused before the run wrote anything

"""The traced step of `pan check`'s estimate is kept on disk (pan/estimate/trace.py,
`cached_trace_step`): train.py's start-up checks and the next `pan check` of the same step read it
instead of tracing again (a 2B DiT's trace takes ~20 s on a CPU). What the step does not depend on
(run length, seed, output_dir) shares a trace; what it does (the model's shapes) does not; a
kept file that does not read is traced again; PAN_CACHE_DIR="" keeps none."""

from pathlib import Path

import pytest

import pan.estimate.trace as trace_module
from pan.config import load_job_config
from pan.preflight import Preflight

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("PAN_CACHE_DIR", str(folder))
    monkeypatch.setattr(trace_module, "_TRACES", {})   # nothing kept in this process
    return folder / "traces"


def estimate(tmp_path: Path, *overrides: str):
    trace_module._TRACES.clear()   # as a new process: only the disk remembers
    clips = tmp_path / "clips.csv"     # the memory plan reads no clip; the config needs the file
    clips.write_text("path,caption\n")
    job = load_job_config(["--config", str(REPO / "config/tiny_cpu.yaml"), "--output_dir", str(tmp_path / "run"),
                           "--video_csv_paths", str(clips), *overrides], warn=lambda msg: None)
    return Preflight(job, 1, 1).estimate


def traces_counted(monkeypatch) -> list:
    calls = []
    real = trace_module.trace_step

    def counted(*args):
        calls.append(args)
        return real(*args)
    monkeypatch.setattr(trace_module, "trace_step", counted)
    return calls


def test_a_second_process_reads_the_kept_trace_and_gets_the_same_estimate(cache, tmp_path, monkeypatch):
    traced = traces_counted(monkeypatch)
    first = estimate(tmp_path)
    assert len(traced) == 1 and len(list(cache.glob("*.json"))) == 1

    again = estimate(tmp_path, "--max_steps", "7", "--seed", "3", "--output_dir", str(tmp_path / "other"))
    assert len(traced) == 1, "the same step was traced again"
    assert again.device == first.device and again.total == first.total

    wider = estimate(tmp_path, "--transformer_config_overrides.hidden_size", "128",
                     "--transformer_config_overrides.rope_axes_dim", "[8, 12, 12]")
    assert len(traced) == 2 and len(list(cache.glob("*.json"))) == 2
    assert wider.device["activations"] > first.device["activations"]


def test_a_kept_trace_that_does_not_read_is_traced_again(cache, tmp_path, monkeypatch):
    first = estimate(tmp_path)
    [kept] = cache.glob("*.json")
    kept.write_text('{"step": {"at_peak": ')           # a half-written or damaged file
    traced = traces_counted(monkeypatch)
    again = estimate(tmp_path)
    assert len(traced) == 1 and again.device == first.device
    assert kept.read_text().endswith("}")              # and written whole again


def test_an_empty_PAN_CACHE_DIR_keeps_no_trace(tmp_path, monkeypatch):
    monkeypatch.setenv("PAN_CACHE_DIR", "")
    monkeypatch.setattr(trace_module, "_TRACES", {})
    traced = traces_counted(monkeypatch)
    estimate(tmp_path)
    estimate(tmp_path)
    assert len(traced) == 2
    assert not list(tmp_path.rglob("*.json"))

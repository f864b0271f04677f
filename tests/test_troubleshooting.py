"""Every message quoted in docs/troubleshooting.md (its ```pan-output <id> blocks) is one pan prints.

Triggered (the condition is brought about and pan's own output compared with the quote):
- config errors, through `load_config_or_exit` (what train.py, pan check and precompute print);
- `pan check` rows, through `main_check` at 100 columns, on 8 synthetic clips; the GPU count with
  torch.cuda reporting 4 GPUs (this machine has none);
- a tiny training run's bad-sample log lines (a JSONL with one bad row), and on that run: a
  resume refused for another data-parallel size or architecture, a run whose checkpoints are all
  truncated, and a launch on an output_dir whose lease another host holds;
- `use_gpu` for a LOCAL_RANK beyond the visible GPUs (device count patched to 2), and
  `ParallelDims.from_config` for HSDP on a world that is not whole nodes.
Source-checked (they need a hang, a killed launcher, a dead peer, a signal, NaNs, a whole pass of
bad data, several ranks or a lease taken over; tests/test_watchdog.py, test_kill_resume.py and
test_lease.py cover the behaviour): every fragment listed in SOURCE_FRAGMENTS appears verbatim in
pan's source and in the quote, and what the fragments leave of the quote is short (values).

A quote's `[…]` stands for any text (paths, times, long lists)."""

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pan.config import load_config_or_exit
from pan.cli import main as pan_main
from pan.data.synth import synth_dataset
from pan.parallel.dims import ParallelConfig, ParallelDims
from pan.parallel.world import use_gpu
from pan.preflight import main_check

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "troubleshooting.md"
ELLIPSIS = "[…]"

TINY = ["--config", "config/tiny_cpu.yaml", "--video_csv_paths", "my_videos/train.csv"]
VAE = ["--config", "config/causal_vae_tiny.yaml", "--video_csv_paths", "my_videos/train.csv"]
CHECK = TINY + ["--output_dir", "runs/check"]
# The trained run's data: 8 good rows and one without a video.
JSONL_RUN = ["--config", "config/tiny_cpu.yaml", "--video_csv_paths", "[]",
             "--annotation_paths", "my_videos/clips.jsonl"]
# A launch inside pytest: no thread that watches pytest's parent process.
IN_PROCESS = ["--exit_when_launcher_dies", "false"]

CONFIG_ERRORS = {
    "lpips-unset": VAE + ["--perceptual_weight", "0.5"],
    "lpips-missing": VAE + ["--perceptual_weight", "0.5", "--lpips_ckpt", "weights/vgg_lpips.pth"],
    "lpips-misfit": VAE + ["--perceptual_weight", "0.5", "--lpips_ckpt", "bad_lpips.pth"],
    "hybrid-ddp": TINY + ["--hybrid_shard", "true", "--data_parallel_mode", "ddp"],
    "cp-heads": TINY + ["--cp_size", "3"],
    "cp-no-heads": VAE + ["--cp_size", "2"],
    "ac-dedicated": TINY + ["--use_dedicated_gradient_checkpointing", "true"],
    "ac-vae-context": VAE + ["--context_size", "2", "--enable_gradient_checkpointing", "true"],
    "bucket": TINY + ["--resolution_buckets", '["32by32"]'],
    "patch": TINY + ["--resolution_buckets", '["30x30"]'],
    "frames-remainder": TINY + ["--frames_mod", "4", "--frames_remainder", "4"],
    "frames-min-max": TINY + ["--min_frames", "9"],
    "frames-no-count": TINY + ["--frames_mod", "4", "--frames_remainder", "1", "--min_frames", "6",
                               "--max_frames", "8"],
    "jsonl-in-csv": ["--config", "config/tiny_cpu.yaml", "--video_csv_paths", "my_videos/train.jsonl"],
    "no-data": ["--config", "config/tiny_cpu.yaml", "--video_csv_paths", "[]"],
    "weights": TINY + ["--annotation_paths", "my_videos/train.jsonl", "--video_csv_weights", "[1.0]"],
}
PREFLIGHT_ROWS = {
    "ranks-vs-samples": CHECK + ["--gpus-per-node", "16"],
    "cp-node": CHECK + ["--gpus-per-node", "2", "--cp_size", "4"],
    "over-budget": CHECK + ["--max_tokens_per_batch", "32"],
    "too-short": CHECK + ["--min_frames", "9", "--max_frames", "9"],
    "resume-arch": JSONL_RUN + ["--output_dir", "runs/x", "--transformer_config_overrides.num_layers", "3"],
}
# Rows that warn (exit 0): the Pan recipe continues its data on another data-parallel size.
PREFLIGHT_WARNINGS = {
    "resume-dp": JSONL_RUN + ["--output_dir", "runs/x", "--gpus-per-node", "2"],
}
# Fragments as they stand in pan's source (one string literal's text each).
SOURCE_FRAGMENTS = {
    "watchdog": ["watchdog: ", "has run ", " s, longer than its limit of ",
                 "; every rank writes its Python stacks to the log and the run exits "],
    "launcher-gone": ["the launcher of this rank (pid ", ") is gone: this rank stops (exit "],
    "peer-lost": ["pan: rank ", " lost a peer process (", "); the ", "first error above says why."],
    "sigterm": ["stopped by ", " after step ", ": checkpoint-",
                "is saved and the next launch resumes from it"],
    "nonfinite": [" steps in a row had a non-finite loss or gradient ",
                  "(last loss ", ", grad norm ", "); each was skipped. ",
                  "Lower learning_rate, check the data, or resume from an earlier checkpoint."],
    "no-usable-sample": ["no usable sample in a whole pass over the data of data shard ",
                         "; skipped so far: ", "See the warnings above for why each was skipped."],
    "resume-dp-launch": [" holds checkpoint-", " of a run with ", " data-",
                         "parallel ranks (world_size ", ", cp_size ", "); this run ",
                         "has ", " (world_size ", "). Each rank's ",
                         "data cursor covers its own share of the data, so they cannot be carried over. Relaunch ",
                         "with ", " data-parallel ranks, or set restart_data_on_dp_change: true to ",
                         "load the model and optimizer and restart every data stream."],
    "lease-lost": ["another launch took over the lease of ",
                   "after step ", ": this run stopped without saving"],
    # triggered in tests/test_trainer.py (a step that raises torch.OutOfMemoryError)
    "out-of-memory": ["pan: out of memory in step ", ". `pan check --config <yaml> --explain-memory` estimates ",
                      "the peak and"],
}
RUN_MESSAGES = {"skip", "bad-samples", "unreadable", "lease-held", "local-rank", "hybrid-nodes",
                "gpus-visible"}


def doc_quotes() -> dict[str, str]:
    found = re.findall(r"```pan-output ([\w-]+)\n(.*?)\n```", DOC.read_text(), re.DOTALL)
    ids = [i for i, _ in found]
    assert len(ids) == len(set(ids)), "two quotes share an id"
    return dict(found)


def assert_printed(quote: str, output: str) -> None:
    pattern = ".*?".join(re.escape(piece) for piece in quote.split(ELLIPSIS))
    assert re.search(pattern, output, re.DOTALL), f"quote not in pan's output:\n{quote}\n--- output:\n{output}"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """8 synthetic clips (CSV and JSONL, plus a JSONL with a bad row), a misfit LPIPS file, and a
    4-step run trained by train.py on the JSONL with the bad row (its log in `train.log`)."""
    root = tmp_path_factory.mktemp("trouble")
    (root / "config").symlink_to(REPO / "config")
    csv_path = synth_dataset(root / "my_videos", num_train=8, num_heldout=0, num_frames=5)["train_csv"]
    rows = [line.split(",")[:2] for line in csv_path.read_text().splitlines()[1:]]
    good = "".join(json.dumps({"video": path, "text": caption}) + "\n" for path, caption in rows)
    (root / "my_videos" / "train.jsonl").write_text(good)
    bad = json.dumps({"clip": rows[0][0], "text": "a red square moving left"}) + "\n"
    (root / "my_videos" / "clips.jsonl").write_text(good + bad)
    torch.save({"foo": torch.zeros(2)}, root / "bad_lpips.pth")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    env.pop("SLURM_JOB_ID", None)
    run = subprocess.run([sys.executable, str(REPO / "train.py"), *JSONL_RUN, "--output_dir", "runs/x",
                          "--max_steps", "4", "--save_interval", "2"], cwd=root, env=env,
                         capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    (root / "train.log").write_text(run.stdout + run.stderr)
    return root


@pytest.fixture
def in_workdir(workdir, monkeypatch) -> Path:
    monkeypatch.chdir(workdir)
    monkeypatch.setenv("COLUMNS", "100")  # the width `pan check` wraps its table to
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    return workdir


def test_every_quote_is_triggered_or_source_checked():
    triggered = set(CONFIG_ERRORS) | set(PREFLIGHT_ROWS) | set(PREFLIGHT_WARNINGS) | RUN_MESSAGES
    assert not triggered & set(SOURCE_FRAGMENTS)
    assert set(doc_quotes()) == triggered | set(SOURCE_FRAGMENTS)


@pytest.mark.parametrize("quote_id", sorted(CONFIG_ERRORS))
def test_config_errors(quote_id, in_workdir, capsys):
    with pytest.raises(SystemExit) as exit_:
        load_config_or_exit(CONFIG_ERRORS[quote_id])
    assert exit_.value.code == 2
    assert_printed(doc_quotes()[quote_id], capsys.readouterr().err)


@pytest.mark.parametrize("quote_id", sorted(PREFLIGHT_ROWS))
def test_preflight_rows(quote_id, in_workdir, capsys):
    assert main_check(PREFLIGHT_ROWS[quote_id]) == 1
    assert_printed(doc_quotes()[quote_id], capsys.readouterr().out)


@pytest.mark.parametrize("quote_id", sorted(PREFLIGHT_WARNINGS))
def test_preflight_warnings(quote_id, in_workdir, capsys):
    assert main_check(PREFLIGHT_WARNINGS[quote_id]) == 0
    assert_printed(doc_quotes()[quote_id], capsys.readouterr().out)


def test_gpu_count_rows(in_workdir, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    main_check(CHECK + ["--gpus-per-node", "8"])
    assert_printed(doc_quotes()["gpus-visible"], capsys.readouterr().out)

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(RuntimeError) as err:
        use_gpu(3)
    assert_printed(doc_quotes()["local-rank"], str(err.value))


def test_hsdp_on_a_partial_node():
    with pytest.raises(Exception) as err:
        ParallelDims.from_config(ParallelConfig(hybrid_shard=True), world_size=6, local_world_size=4)
    assert_printed(doc_quotes()["hybrid-nodes"], str(err.value))


def test_bad_sample_log_lines(workdir):
    log = (workdir / "train.log").read_text()
    for quote_id in ("skip", "bad-samples"):
        assert_printed(doc_quotes()[quote_id], log)


def test_unreadable_checkpoints_refuse_the_launch(in_workdir, capsys):
    shutil.copytree("runs/x", "runs/y")
    for shard in Path("runs/y").glob("checkpoint-*/transformer/__0_0.distcp"):
        shard.write_bytes(shard.read_bytes()[:1000])
    assert pan_main(["train", *JSONL_RUN, *IN_PROCESS, "--output_dir", "runs/y"]) == 2
    assert_printed(doc_quotes()["unreadable"], capsys.readouterr().err)


def test_a_held_lease_refuses_the_launch(in_workdir, capsys):
    """A live run on another host (fresh heartbeat) holds runs/z."""
    Path("runs/z").mkdir(parents=True)
    Path("runs/z/lease.json").write_text(json.dumps({
        "token": "other", "processes": [{"host": "gpu-node-17", "boot": "", "pid": 4242, "start": None}],
        "started": "2026-11-30T09:12:44", "started_at": time.time(), "heartbeat": time.time(),
        "slurm_job_id": None, "slurm_restart": "0"}))
    assert pan_main(["train", *JSONL_RUN, *IN_PROCESS, "--output_dir", "runs/z"]) == 2
    assert_printed(doc_quotes()["lease-held"], capsys.readouterr().err)


def pan_source() -> str:
    return "\n".join(p.read_text() for p in sorted((REPO / "pan").rglob("*.py")))


@pytest.mark.parametrize("quote_id", sorted(SOURCE_FRAGMENTS))
def test_source_checked_quotes(quote_id):
    quote, source = doc_quotes()[quote_id], pan_source()
    rest = quote
    for fragment in SOURCE_FRAGMENTS[quote_id]:
        assert fragment in source, f"{fragment!r} is not in pan's source"
        assert fragment in rest, f"{fragment!r} is not (in order) in the quote {quote!r}"
        rest = rest.split(fragment, 1)[1]
    # Between and around the fragments only values remain (a step, a path, a rank, a short list).
    leftovers = quote
    for fragment in SOURCE_FRAGMENTS[quote_id]:
        leftovers = leftovers.replace(fragment, "\n", 1)
    assert all(len(piece) <= 40 for piece in leftovers.split("\n")), leftovers

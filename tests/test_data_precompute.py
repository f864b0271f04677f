"""`pan data precompute`: latents and text features equal the online path's, failures are reported,
a rerun resumes, and the precomputed CSV feeds the loader and a training step."""

import csv
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from pan.config import load_job_config
from pan.data.build import build_data_loader
from pan.data.precompute import main, precompute
from pan.data.synth import synth_dataset
from pan.parallel.world import planned_task
from pan.recipes.pan.task import PanTask
from pan.trainer import build_trainer

REPO = Path(__file__).resolve().parents[1]
NUM_GOOD = 6


def tiny_job(tmp_path, csv_path, *extra):
    argv = ["--config", str(REPO / "config/tiny_cpu.yaml"), "--output_dir", str(tmp_path / "run"),
            "--video_csv_paths", str(csv_path), "--save_interval", "100000", "--log_interval", "1000",
            *extra]
    return load_job_config(argv, warn=lambda m: None)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """Six synthetic clips and one corrupt file (row 6) in train.csv."""
    root = tmp_path_factory.mktemp("synth")
    train_csv = synth_dataset(root, num_train=NUM_GOOD, num_heldout=1, size=32, num_frames=5)["train_csv"]
    (root / "corrupt.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 not really a video" * 20)
    with open(train_csv, "a", newline="") as f:
        csv.writer(f).writerow(["corrupt.mp4", "a broken clip", "", "", "", ""])
    return train_csv


@pytest.fixture(scope="module")
def precomputed(dataset, tmp_path_factory):
    """One precompute run through the command line: (exit code, DIR)."""
    out = tmp_path_factory.mktemp("pre")
    tmp = tmp_path_factory.mktemp("run")
    rc = main(["--config", str(REPO / "config/tiny_cpu.yaml"), "--video_csv_paths", str(dataset),
               "--output_dir", str(tmp), "--out", str(out)])
    return rc, out


def online_task(job) -> PanTask:
    """The Pan task with its encoders, in one CPU process (what the trainer uses online)."""
    task = planned_task(job)
    task.load_encoders()
    return task


def all_samples(loader, count: int) -> dict:
    """Sample id -> sample, reading batches until `count` distinct samples were seen."""
    seen = {}
    while len(seen) < count:
        for s in next(loader).samples:
            seen[s.sample_id] = s
    return seen


def test_latents_and_text_equal_the_online_path(dataset, precomputed, tmp_path):
    rc, out = precomputed
    assert rc == 0
    job = tiny_job(tmp_path, dataset)
    task = online_task(job)
    online = all_samples(task.build_loader(SimpleNamespace(dp=1)), NUM_GOOD)
    rows = list(csv.DictReader(open(out / "train.csv")))
    assert len(rows) == NUM_GOOD
    for i, row in enumerate(rows):
        tensors = load_file(str(out / row["latent_path"]))
        sample = online[f"train:{i}"]
        assert row["caption"] == sample.caption
        assert (out / row["path"]).is_file()  # still names the clip from the new CSV's folder
        expected = task.sample_latent(sample)
        assert tensors["latent"].shape == expected.shape == (3, 5, 32, 32)
        assert torch.equal(tensors["latent"], expected)
        assert torch.equal(tensors["text"], task.text_encoder.encode([sample.caption])[0].float())


def test_the_corrupt_row_is_reported_and_a_rerun_skips_everything(dataset, precomputed, tmp_path, capsys):
    rc, out = precomputed
    failures = list(csv.DictReader(open(out / "failures.csv")))
    assert [(f["row"], f["reason"]) for f in failures] == [("6", "decode_error")]
    assert failures[0]["csv"] == str(dataset)
    stamps = {p: p.stat().st_mtime_ns for p in out.glob("train/*.safetensors")}
    assert len(stamps) == NUM_GOOD

    report = precompute(tiny_job(tmp_path, dataset), out)
    assert (report.written, report.existing) == (0, NUM_GOOD)
    assert [(f.row, f.reason) for f in report.failures] == [(6, "decode_error")]
    assert {p: p.stat().st_mtime_ns for p in out.glob("train/*.safetensors")} == stamps
    assert not list(out.rglob(".*tmp*"))


def test_a_killed_run_resumes_and_other_settings_are_refused(dataset, tmp_path):
    out = tmp_path / "pre"
    first = precompute(tiny_job(tmp_path, dataset), out, limit=2)
    assert (first.written, first.existing, first.failures) == (2, 0, [])
    assert len(list(csv.DictReader(open(out / "train.csv")))) == 2
    rest = precompute(tiny_job(tmp_path, dataset), out)
    assert (rest.written, rest.existing, len(rest.failures)) == (NUM_GOOD - 2, 2, 1)
    with pytest.raises(ValueError, match="frames_mod"):
        precompute(tiny_job(tmp_path, dataset, "--frames_mod", "2"), out)


def test_all_rows_failing_exits_1(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("path,caption\nmissing.mp4,a clip that is not there\n")
    rc = main(["--config", str(REPO / "config/tiny_cpu.yaml"), "--video_csv_paths", str(bad),
               "--output_dir", str(tmp_path / "run"), "--out", str(tmp_path / "pre")])
    assert rc == 1
    assert list(csv.DictReader(open(tmp_path / "pre/failures.csv")))[0]["reason"] == "missing_file"


def test_annotation_files_are_refused_not_silently_left_out(dataset, tmp_path, capsys):
    """The Pan recipe precomputes CSVs; a job that also lists annotation files would lose those rows."""
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text('{"video": "missing.mp4", "text": "a caption"}\n')
    rc = main(["--config", str(REPO / "config/tiny_cpu.yaml"), "--video_csv_paths", str(dataset),
               "--annotation_paths", str(jsonl), "--output_dir", str(tmp_path / "run"), "--out", str(tmp_path / "pre")])
    assert rc == 2
    assert "annotation_paths is set" in capsys.readouterr().err and not (tmp_path / "pre").exists()


def test_the_loader_and_the_trainer_read_the_precomputed_csv(precomputed, tmp_path):
    _, out = precomputed
    job = tiny_job(tmp_path, out / "train.csv", "--max_steps", "1")
    task = planned_task(job)
    loader = build_data_loader(job.data, tokens_of=task.tokens_of, dp_rank=0, dp_size=1, seed=0,
                               latent_tokens_of=task.latent_tokens_of)
    samples = all_samples(loader, NUM_GOOD)
    assert all(s.frames is None and s.latent.shape == (3, 5, 32, 32) and s.text.dim() == 2
               for s in samples.values())

    trainer = build_trainer(job)
    batches, _ = trainer.next_micro_batches()
    metrics = trainer.train_step(batches)
    assert metrics["finite"] and metrics["loss"] > 0


def test_torchrun_shares_the_rows_and_writes_what_one_process_writes(dataset, precomputed, tmp_path):
    """2 processes under torchrun: each encodes half of the missing rows; the latents, the
    precomputed CSV and failures.csv equal the single-process run's."""
    import os
    import subprocess
    import sys

    out = tmp_path / "pre2"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    run = subprocess.run(["torchrun", "--standalone", "--nproc_per_node", "2", "-m", "pan.cli", "data",
                          "precompute", "--config", str(REPO / "config/tiny_cpu.yaml"),
                          "--video_csv_paths", str(dataset), "--output_dir", str(tmp_path / "run"),
                          "--out", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert f"{NUM_GOOD} latents written (by rank: 3, 3)" in run.stdout, run.stdout
    _, single = precomputed
    def rows(folder):  # `path` is relative to each output folder: compare where it points
        with open(folder / "train.csv", newline="") as f:
            return [[str((folder / r[0]).resolve()), *r[1:]] for r in csv.reader(f)][1:]

    assert rows(out) == rows(single) and len(rows(out)) == NUM_GOOD
    assert (out / "failures.csv").read_text() == (single / "failures.csv").read_text()
    for latent in sorted((single / "train").glob("*.safetensors")):
        a, b = load_file(latent), load_file(out / "train" / latent.name)
        # Text features to fp32 rounding: the encoder's matmuls ran with another thread count.
        assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-5) for k in a)

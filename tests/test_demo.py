"""The Pan demo (`pan demo`, pan/recipes/pan/demo.py) end to end in its --quick form: data, training,
samples, scores, report."""

import json
import re

import yaml
from PIL import Image

from pan.demo import main
from pan.demo.analyser import load_video
from pan.recipes.pan.demo import DEFAULT_CONFIG, QUICK_PROMPTS, SAMPLES_PER_PROMPT, make_data

OUTPUT = yaml.safe_load(DEFAULT_CONFIG.read_text())["output"]
GEOMETRY = (OUTPUT["sample_num_frames"], OUTPUT["sample_height"], OUTPUT["sample_width"], 3)


def test_quick_demo_writes_every_artefact(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["--quick", "--out", str(out), "--steps", "2"]) == 0

    scores = json.loads((out / "samples" / "scores.json").read_text())
    videos = QUICK_PROMPTS * SAMPLES_PER_PROMPT  # every held-out prompt scored on several draws
    assert scores["num_videos"] == videos
    assert {"colour_accuracy", "direction_accuracy", "shape_accuracy", "per_video"} <= set(scores)
    clips = [load_video(out / "samples" / f"{i:02d}.mp4") for i in range(videos)]
    for i, clip in enumerate(clips):
        assert clip.shape == GEOMETRY  # the config's sample geometry
        assert Image.open(out / "samples" / f"{i:02d}.gif").n_frames == GEOMETRY[0]
    prompts = [(out / "samples" / f"{i:02d}.txt").read_text() for i in range(videos)]
    assert prompts[:QUICK_PROMPTS] == prompts[QUICK_PROMPTS:2 * QUICK_PROMPTS]  # the same prompts again,
    assert (clips[0] != clips[QUICK_PROMPTS]).any()                            # from other noise
    sheet = Image.open(out / "samples" / "contact_sheet.gif")
    assert sheet.n_frames == GEOMETRY[0] and sheet.width > 2 * 2 * GEOMETRY[2]  # clips side by side, scaled 2x

    assert Image.open(out / "loss.png").size == (1200, 800)  # pan plot's four panels
    rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]  # one loss point per step in a 2-step run

    report = (out / "report.md").read_text()
    assert "training steps: 2" in report
    assert "samples/contact_sheet.gif" in report and "loss.png" in report
    printed = capsys.readouterr()
    assert "colour accuracy" in printed.out
    # the data phase says what it does and how long it took, before the trainer logs anything
    for phase in ("writing the synthetic clips", "encoding the training clips once"):
        assert re.search(rf"{phase}.*: \d+\.\d s", printed.out), phase
    # Not a terminal: log lines only, no progress bar's carriage returns (the precompute's, the
    # encoders' loading bars).
    assert "\r" not in printed.out + printed.err


def test_rerun_reuses_data_and_trains_afresh(tmp_path):
    out = tmp_path / "demo"
    assert main(["--quick", "--out", str(out), "--steps", "1"]) == 0
    first_csv = (out / "data" / "train.csv").stat().st_mtime_ns
    latent = out / "data" / "latents" / "train" / "00000000.safetensors"
    first_latent = latent.stat().st_mtime_ns
    assert main(["--quick", "--out", str(out), "--steps", "2", "--seed", "4"]) == 0
    assert (out / "data" / "train.csv").stat().st_mtime_ns == first_csv
    assert latent.stat().st_mtime_ns == first_latent  # clips are encoded once
    # The run trains from the precomputed clips, not the MP4s.
    run_config = (out / "run" / "config.yaml").read_text()
    assert str(out / "data" / "latents" / "train.csv") in run_config
    assert "training steps: 2" in (out / "report.md").read_text()
    assert yaml.safe_load(run_config)["training"]["seed"] == 4  # --seed is the run's training seed


def test_data_follows_the_config_geometry(tmp_path):
    config = tmp_path / "demo.yaml"
    config.write_text(DEFAULT_CONFIG.read_text())
    first = make_data(tmp_path / "data", config, quick=True)
    assert load_video(first["train_csv"].parent / "train" / "000000.mp4").shape == GEOMETRY

    frames, side = GEOMETRY[0] + 4, GEOMETRY[1] + 8
    other = yaml.safe_load(DEFAULT_CONFIG.read_text())
    other["output"] |= {"sample_num_frames": frames, "sample_height": side, "sample_width": side}
    config.write_text(yaml.safe_dump(other))
    second = make_data(tmp_path / "data", config, quick=True)  # stale geometry: rewritten
    assert load_video(second["train_csv"].parent / "train" / "000000.mp4").shape == (frames, side, side, 3)

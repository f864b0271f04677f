"""`pan demo --recipe ...` (pan/recipes/causal_vae/demo.py, pan/recipes/pyramid_flow_ar/demo.py): the
--quick path of each recipe's demo runs end to end and writes every output it promises; the causal
VAE demo's own PSNR agrees with the recipe's validation, and its reconstructions are scored against
the held-out clips' captions; `pan demo` hands each recipe's demo its command line."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import re
from pathlib import Path

import pytest
import yaml

import pan.demo
from pan.recipes.causal_vae import demo as causal_vae_demo
from pan.recipes.pyramid_flow_ar import demo as pyramid_flow_ar_demo
from pan.recipes.pyramid_flow_ar.demo import caption_corpus, write_tiny_pyramid_model

SCORE_KEYS = {"num_videos", "colour_accuracy", "direction_accuracy", "shape_accuracy", "joint_accuracy",
              "per_video"}


@pytest.fixture(scope="module")
def vae_demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo_causal_vae")
    assert causal_vae_demo.demo(["--out", str(out), "--quick", "--seed", "2"]) == 0
    return out


@pytest.fixture(scope="module")
def ar_demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo_pyramid_flow_ar")
    log = io.StringIO()
    with contextlib.redirect_stderr(log), contextlib.redirect_stdout(log):  # pan's log: the current sys.stderr
        assert pyramid_flow_ar_demo.demo(["--out", str(out), "--quick"]) == 0
    (out / "demo.log").write_text(log.getvalue())
    return out


def run_seed(run_dir) -> int:
    """The training seed the run's config.yaml records."""
    from pan.config import load_job_config

    return load_job_config(["--config", str(run_dir / "config.yaml")], warn=lambda m: None).trainer.seed


def test_causal_vae_quick_demo_writes_its_outputs(vae_demo):
    samples = vae_demo / "samples"
    scores = json.loads((samples / "scores.json").read_text())
    for stage in ("init", "trained"):
        assert SCORE_KEYS <= set(scores[stage]["analyser"])
        assert len(scores[stage]["per_clip"]) == scores[stage]["analyser"]["num_videos"] == 2
        assert scores[stage]["psnr"] == pytest.approx(
            sum(c["psnr"] for c in scores[stage]["per_clip"]) / 2)
    # The held-out clips themselves are what a perfect VAE would return: the analyser reads them right.
    assert scores["originals"]["analyser"]["joint_accuracy"] == 1.0
    assert scores["steps"] == 2
    for i in range(2):
        assert (samples / f"{i:02d}.mp4").is_file() and (samples / f"{i:02d}_side.mp4").is_file()
    assert (samples / "contact_sheet.gif").stat().st_size > 0
    report = (vae_demo / "report.md").read_text()
    assert f"{scores['trained']['psnr']:.2f} dB trained" in report and "| 01 |" in report
    assert run_seed(vae_demo / "run") == 2   # --seed is the run's training seed


def assert_plotted(demo_out: Path) -> None:
    """The demo's loss.png is `pan plot` of its run: four panels, the loss on a log axis (symlog
    where a loss term is signed, as the VAE's GAN term can be)."""
    from PIL import Image

    from pan.runtime.plot import draw, read_records

    assert Image.open(demo_out / "loss.png").size == (1200, 800)
    figure = draw(read_records(demo_out / "run" / "metrics.jsonl"))
    assert len(figure.axes) == 4 and figure.axes[0].get_yscale() in ("log", "symlog")


def test_the_recipe_demos_plot_their_runs(vae_demo, ar_demo):
    assert_plotted(vae_demo)
    assert_plotted(ar_demo)


def test_causal_vae_demo_psnr_is_the_recipes_validation(vae_demo):
    """The demo's per-clip pass and the recipe's own validation at the last step reconstruct the same
    clips with the same weights: the same mean PSNR and SSIM."""
    scores = json.loads((vae_demo / "samples" / "scores.json").read_text())
    validation = json.loads((vae_demo / "run" / "validation.jsonl").read_text().splitlines()[-1])
    assert validation["psnr"] == pytest.approx(scores["trained"]["psnr"], rel=1e-5)
    assert validation["ssim"] == pytest.approx(scores["trained"]["ssim"], rel=1e-5)


def test_causal_vae_demo_scores_reconstructions_against_the_clips_captions(vae_demo):
    heldout = (vae_demo / "data" / "heldout.csv").read_text().splitlines()[1:]
    captions = [row.split(",")[1] for row in heldout]
    scores = json.loads((vae_demo / "samples" / "scores.json").read_text())
    assert [row["prompt"] for row in scores["trained"]["analyser"]["per_video"]] == captions


def test_pyramid_flow_ar_quick_demo_writes_its_outputs(ar_demo):
    samples = ar_demo / "samples"
    scores = json.loads((samples / "scores.json").read_text())
    assert SCORE_KEYS <= set(scores) and scores["num_videos"] == 2
    prompts = json.loads((ar_demo / "data" / "heldout_prompts.json").read_text())[:2]
    assert [row["prompt"] for row in scores["per_video"]] == [p["prompt"] for p in prompts]
    for i in range(2):
        assert (samples / f"{i:02d}.mp4").is_file() and (samples / f"{i:02d}.gif").is_file()
    assert (samples / "contact_sheet.gif").stat().st_size > 0 and (ar_demo / "loss.png").is_file()
    assert "held-out prompts: colour" in (ar_demo / "report.md").read_text()
    log = (ar_demo / "demo.log").read_text()
    for phase in ("writing the synthetic clips", "writing the tiny Pyramid-Flow model folder",
                  "encoding the training clips once"):  # the data phase's progress, each with its time
        assert re.search(rf"{phase}.*: \d+\.\d s", log), phase
    # It trains from the clips encoded once (`pan data precompute`), not from the MP4s.
    data = yaml.safe_load((ar_demo / "pyramid_flow_ar.yaml").read_text())["data"]
    assert data["video_csv_paths"] == [] and len(data["annotation_paths"]) == 1
    rows = Path(data["annotation_paths"][0]).read_text().splitlines()
    assert len(rows) == 8 and all((ar_demo / "data" / "latents" / json.loads(r)["latent"]).is_file() for r in rows)
    # Sampling, minutes on a CPU for a real demo, says each prompt as it is done; the run its threads.
    log = (ar_demo / "demo.log").read_text()
    assert all(f"sampled {i + 1}/2 (" in log and prompts[i]["prompt"] in log for i in range(2)), log[-3000:]
    assert "CPU threads: " in log, log[-3000:]


def test_tiny_pyramid_tokenizers_split_the_demo_captions_into_known_words(tmp_path):
    """The tiny encoders' tokenizers have learnt the captions' words: T5 gives one piece per word (so
    a caption fits t5_max_length whole: the direction word reaches the DiT), CLIP splits at the
    words, and the colours (what the prompts differ in) get different tokens."""
    from transformers import CLIPTokenizer, T5Tokenizer

    folder = write_tiny_pyramid_model(tmp_path / "model", "diffusion_transformer_384p")
    clip = CLIPTokenizer.from_pretrained(folder / "tokenizer")
    t5 = T5Tokenizer.from_pretrained(folder / "tokenizer_2")
    for caption in caption_corpus():
        assert t5.tokenize(caption) == ["\u2581" + word for word in caption.split()]
        words = clip.tokenize(caption)
        assert "".join(words).replace("</w>", " ").split() == caption.split()
    assert clip.tokenize("red") != clip.tokenize("green") and t5("red").input_ids != t5("green").input_ids


def test_pan_demo_dispatches_recipe_demos(monkeypatch, tmp_path, capsys):
    """`pan demo --recipe X` hands the rest of its command line, as typed, to recipe X's `demo` hook
    (the Pan demo's without --recipe); a recipe demo refuses the Pan demo's --config."""
    from pan.config.job import DEFAULT_RECIPE
    from pan.recipe import get_recipe

    calls = []
    for name in ("causal_vae", "pyramid_flow_ar", DEFAULT_RECIPE):
        module, _, attribute = get_recipe(name).demo.partition(":")
        monkeypatch.setattr(importlib.import_module(module), attribute,
                            lambda argv, name=name: calls.append((name, argv)) or 0)
    assert pan.demo.main(["--recipe", "causal_vae", "--quick", "--steps", "3", "--seed", "5"]) == 0
    assert pan.demo.main(["--out", str(tmp_path), "--recipe", "pyramid_flow_ar"]) == 0
    assert pan.demo.main(["--quick", "--config", "x.yaml"]) == 0
    assert calls == [("causal_vae", ["--quick", "--steps", "3", "--seed", "5"]),
                     ("pyramid_flow_ar", ["--out", str(tmp_path)]),
                     (DEFAULT_RECIPE, ["--quick", "--config", "x.yaml"])]
    with pytest.raises(SystemExit) as refused:  # a usage error (exit 2) naming the option
        causal_vae_demo.parse_args(["--config", str(tmp_path / "x.yaml")])
    assert refused.value.code == 2 and "--config configures the default demo" in capsys.readouterr().err

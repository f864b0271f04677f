"""`pan demo --recipe wan` (pan/recipes/wan/demo.py) and the tiny folder it makes (pan/recipes/wan/tiny.py):
the --quick path runs end to end through `pan demo` and writes every output it promises; the folder is a
WanPipeline whose VAE codes the pixels themselves and whose tokenizer keeps the captions' words whole."""

from __future__ import annotations

import contextlib
import io
import json
import re

import pytest
import torch
import yaml

import pan.demo
from pan.demo.analyser import load_video
from pan.recipes.wan import demo as wan_demo
from pan.recipes.wan import tiny

diffusers = pytest.importorskip("diffusers")

SCORE_KEYS = {"num_videos", "colour_accuracy", "direction_accuracy", "shape_accuracy", "joint_accuracy",
              "per_video"}
# pixel_vae's codec error: the RMS norms' division by sqrt(K^2 + 2|v|^2) instead of K, O(|v|^2 / K^2) =
# 3e-6 at K = 1e3 and |v|^2 <= 3, plus fp32 rounding (measured: 2.7e-6 encode, 5.6e-6 round trip)
CODEC_TOL = 2e-5


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo_wan")
    log = io.StringIO()
    with contextlib.redirect_stderr(log), contextlib.redirect_stdout(log):  # pan's log: the current sys.stderr
        assert pan.demo.main(["--recipe", "wan", "--out", str(out), "--quick"]) == 0
    (out / "demo.log").write_text(log.getvalue())
    return out


def test_quick_demo_writes_its_outputs(quick):
    samples = quick / "samples"
    scores = json.loads((samples / "scores.json").read_text())
    assert SCORE_KEYS <= set(scores) and scores["num_videos"] == 2
    prompts = json.loads((quick / "data" / "heldout_prompts.json").read_text())[:2]
    assert [row["prompt"] for row in scores["per_video"]] == [p["prompt"] for p in prompts]
    for i in range(2):
        video = load_video(samples / f"sample_{i:02d}.mp4")
        assert video.shape == (wan_demo.WAN_FRAMES, wan_demo.WAN_SIZE, wan_demo.WAN_SIZE, 3)
        assert (samples / f"sample_{i:02d}.gif").is_file()
    assert (samples / "contact_sheet.gif").stat().st_size > 0 and (quick / "loss.png").stat().st_size > 0
    report = (quick / "report.md").read_text()
    assert "held-out prompts: colour" in report and "training steps: 2" in report
    log = (quick / "demo.log").read_text()
    for phase in ("writing the synthetic clips", "writing the tiny Wan folder", "encoding the training clips once"):
        assert re.search(rf"{phase}.*: \d+\.\d s", log), phase
    # it trains from the clips encoded once by the folder's VAE and umT5 (`pan data precompute`)
    config = yaml.safe_load((quick / "wan.yaml").read_text())
    assert config["recipe"] == "wan"
    (csv_path,) = config["data"]["video_csv_paths"]
    assert csv_path.endswith(".csv") and "latents" in csv_path
    assert (quick / "data" / "latents" / "empty_text.safetensors").is_file()
    assert (quick / "run" / "checkpoint-2").is_dir()


def test_the_demo_folder_is_a_wan_pipeline_that_codes_pixels(quick):
    """diffusers loads the demo's folder; its VAE encodes frames as their own pixels plus the place
    channel and decodes them back; the text encoder is per-word (no layers)."""
    folder = quick / "model"
    pipe = diffusers.WanPipeline.from_pretrained(folder)
    assert pipe.text_encoder.config.num_layers == 0
    video = load_video(next((quick / "data").rglob("*.mp4")))                      # [T, H, W, 3] uint8
    pixels = torch.from_numpy(video).permute(3, 0, 1, 2)[None].float() / 127.5 - 1.0
    with torch.no_grad():
        latent = pipe.vae.encode(pixels).latent_dist.mode()
        back = pipe.vae.decode(latent).sample
    assert latent.shape == (1, 4, *pixels.shape[2:]) and pipe.transformer.config.in_channels == 4
    torch.testing.assert_close(latent[:, :3], pixels, rtol=0, atol=CODEC_TOL)
    torch.testing.assert_close(back, pixels, rtol=0, atol=CODEC_TOL)
    stats = pipe.vae.config    # the clips' pixels, then the place map
    assert all(-1 < m < 1 for m in stats.latents_mean) and all(0 < s < 1 for s in stats.latents_std)


@pytest.mark.parametrize("place", [False, True])
def test_pixel_vae_codes_any_frames(place):
    """The codec gives back any frames, whatever their size and count (the latents are the pixels);
    with `place`, a fourth channel is the share of each pixel's 3 x 3 x 3 causal neighbourhood inside
    the clip, the same for every clip, and the decoder reads the pixels alone."""
    channels = 4 if place else 3
    vae = tiny.pixel_vae([0.0, 0.1, -0.1, 0.5][:channels], [0.5, 0.6, 0.7, 0.2][:channels], place=place)
    pixels = torch.rand(2, 3, 9, 8, 12, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with torch.no_grad():
        posterior = vae.encode(pixels).latent_dist
        back = vae.decode(posterior.mode()).sample
    torch.testing.assert_close(posterior.mode()[:, :3], pixels, rtol=0, atol=CODEC_TOL)
    torch.testing.assert_close(posterior.sample()[:, :3], pixels, rtol=0, atol=CODEC_TOL)   # variance at the floor
    torch.testing.assert_close(back, pixels, rtol=0, atol=CODEC_TOL)
    if place:
        share = posterior.mode()[0, 3]                                                   # [T, H, W]
        inside = torch.ones(1, 1, 9 + 2, 8, 12)
        inside[:, :, :2] = 0                                                             # the causal padding
        expected = torch.nn.functional.conv3d(inside, torch.ones(1, 1, 3, 3, 3) / 27, padding=(0, 1, 1))[0, 0]
        torch.testing.assert_close(share, expected, rtol=0, atol=CODEC_TOL)
        assert abs(share[0, 0, 0] - 4 / 27) < CODEC_TOL and abs(share[4, 3, 3] - 1) < CODEC_TOL


def test_word_tokenizer_keeps_the_captions_words_whole():
    corpus = wan_demo.caption_corpus()
    tokenizer = tiny.word_tokenizer(corpus)
    for caption in corpus:
        assert tokenizer.tokenize(caption) == ["\u2581" + word for word in caption.split()]
        assert tokenizer(caption).input_ids[-1] == tokenizer.eos_token_id == 1
    assert tokenizer.pad_token_id == 0 and tokenizer("red").input_ids != tokenizer("green").input_ids
    assert tokenizer.tokenize("cat") == ["\u2581", "c", "a", "t"]         # other words: characters

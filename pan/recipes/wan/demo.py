"""`pan demo --recipe wan`: the Wan recipe's CPU demo, on the same synthetic clips (pan.data.synth) and
scored by the same analyser (pan.demo.analyser) as the other demos.

    pan demo --recipe wan [--out demo_wan] [--steps N] [--seed N] [--quick]

Makes a tiny random Wan 2.1-layout diffusers folder (pan/recipes/wan/tiny.py: `WanPipeline.save_pretrained`
of a random-init WanTransformer3DModel, a umT5 of no layers with a tokenizer of the captions' words, and
an AutoencoderKLWan that codes the pixels themselves), encodes the clips with it (`pan data precompute`),
trains the `wan` recipe on them from scratch (flow matching, velocity, the folder's flow_shift), samples
the held-out prompts with diffusers' WanPipeline on the checkpoint's EMA weights (as `pan sample` does)
and scores them.

Everything lands under `--out`: data/ (the clips; latents/ their precomputed rows), model/ (the Wan
folder), wan.yaml (the run's config), run/ (checkpoint, metrics.jsonl), samples/ (sample_NN.mp4 and .gif,
contact_sheet.gif, scores.json), loss.png and report.md. The recipe's `demo` hook (pan/recipe.py);
docs/demo_recipes.md and docs/wan.md.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from pan.config import load_config_or_exit
from pan.data.precompute import precompute
from pan.data.sources import read_video_csv
from pan.data.synth import DIRECTIONS, PALETTE, SHAPES, caption_for
from pan.demo import kit
from pan.demo.analyser import load_video
from pan.demo.kit import PIX_FMT, QUICK, SHAPE_SIZE, fit, fresh_run_dir, make_data
from pan.demo.report import announced, report_scored_samples
from pan.logging import quiet_library_progress_bars
from pan.parallel.threads import set_cpu_threads
from pan.recipes.wan import tiny
from pan.recipes.wan.sample import generate, wan_pipeline
from pan.sampling import resolve_weights, write_video
from pan.trainer import build_trainer

# The other demos' clips: 5 frames of 16 x 16, shapes 44-52% of the frame, colour at full resolution.
WAN_SIZE, WAN_FRAMES = 16, 5
# The transformer: patches of 1 x 4 x 4 pixels (80 tokens a clip, as the Pan demo), width 128 in 2 heads
# of 64 (Wan's RoPE, theta 10000: 24 dims on time, 20 on each spatial axis; 4 heads of 32 read the
# direction words in 60% of the held-out prompts, docs/wan.md), 4 blocks.
TRANSFORMER = dict(patch_size=[1, 4, 4], num_attention_heads=2, attention_head_dim=64, freq_dim=64, ffn_dim=512,
                   num_layers=4, cross_attn_norm=True, eps=1e-6)
# umT5 of no layers: per-word features (its token embeddings after the final RMSNorm), 32 wide.
TEXT = dict(d_model=32, d_kv=16, d_ff=64, num_layers=0, num_heads=2)
MAX_TEXT_TOKENS = 8            # a caption is 5 words and </s>; WanPipeline pads to the same rows
FLOW_SHIFT = 2.0               # the folder's scheduler: sampling and (flow_shift: null) training
STEPS = 4000
LEARNING_RATE = 5.0e-3
EMA_DECAY = 0.995
CLIPS_PER_STEP = 12
SAMPLE_STEPS = 20
GUIDANCE = 3.0
SAMPLE_FPS = 8.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return kit.parse_args(argv, "wan", __doc__.split("\n\n")[0])


def caption_corpus() -> list[str]:
    """Every caption the synthetic data can hold: the words the tiny tokenizer keeps whole."""
    return [caption_for(c, s, d) for c in PALETTE for s in SHAPES for d in DIRECTIONS]


def latent_statistics(train_csv: Path) -> tuple[list[float], list[float]]:
    """Per-channel mean and std of the training clips' latents under the pixel codec (the VAE's
    latents_mean / latents_std, as a release's are its VAE's latent statistics over its data): the
    pixels in [-1, 1], then the place channel (the same map for every clip of the demo's size)."""
    source = read_video_csv(train_csv)
    pixels = np.concatenate([load_video(source.resolve(source.field(row, "path"))).reshape(-1, 3)
                             for row in source.rows])
    values = pixels.astype(np.float64) / 127.5 - 1.0
    plain = tiny.pixel_vae([0.0] * 4, [1.0] * 4, place=True)
    with torch.no_grad():
        place = plain.encode(torch.zeros(1, 3, WAN_FRAMES, WAN_SIZE, WAN_SIZE)).latent_dist.mode()[0, 3].double()
    mean = [*values.mean(0).tolist(), place.mean().item()]
    std = [*values.std(0).tolist(), place.std().item()]
    return [round(v, 4) for v in mean], [round(v, 4) for v in std]


def write_tiny_wan(folder: Path, latents_mean: list[float], latents_std: list[float], seed: int = 0) -> Path:
    """The demo's Wan folder: a random WanTransformer3DModel with Wan's init for training from scratch,
    the per-word umT5 and its tokenizer, the pixel codec VAE with its place channel, UniPC with
    FLOW_SHIFT. Seeded."""
    pipe = tiny.build_pipeline(tiny.word_tokenizer(caption_corpus()), text=TEXT,
                               vae=tiny.pixel_vae(latents_mean, latents_std, place=True), transformer=TRANSFORMER,
                               flow_shift=FLOW_SHIFT, seed=seed, perturb=False, wan_init=True)
    return tiny.write_folder(pipe, folder)


def wan_config(args: argparse.Namespace, train_csv: Path, model_path: Path, run_dir: Path) -> dict:
    steps = args.steps or (QUICK["steps"] if args.quick else STEPS)
    return {
        "recipe": "wan",
        "model": {"model_path": str(model_path), "max_text_tokens": MAX_TEXT_TOKENS, "attention_backend": "sdpa"},
        "training": {"max_steps": steps, "learning_rate": LEARNING_RATE, "warmup_steps": min(160, steps // 4),
                     "lr_scheduler_type": "cosine", "lr_decay_floor_ratio": 0.1, "weight_decay": 0.0,
                     "max_grad_norm": 1.0, "use_muon": False, "dtype": "fp32", "seed": args.seed,
                     "ema_decay": EMA_DECAY},
        "diffusion": {"flow_shift": None, "flow_snr_type": "uniform"},
        "tasks": {"text_dropout_prob": 0.1},
        "data": {"video_csv_paths": [str(train_csv)], "resolution_buckets": [f"{WAN_SIZE}x{WAN_SIZE}"],
                 "min_frames": WAN_FRAMES, "max_frames": WAN_FRAMES,
                 "max_samples_per_batch": CLIPS_PER_STEP, "max_tokens_per_batch": CLIPS_PER_STEP * 80,
                 "packed_dataloader_num_workers": 1, "sample_cache_mb": 64},
        "output": {"output_dir": str(run_dir), "save_interval": steps, "log_interval": max(1, steps // 40),
                   "progress_bar": False},
    }


def write_wan_config(args: argparse.Namespace, data: dict[str, Path], model_path: Path, run_dir: Path,
                     config: Path) -> Path:
    """The run's config at `config`, training from the clips encoded once by the folder's VAE and umT5
    (`pan data precompute` into data/latents)."""
    import yaml

    settings = wan_config(args, data["train_csv"], model_path, run_dir)
    config.write_text(yaml.safe_dump(settings, sort_keys=False))
    latents_dir = data["train_csv"].parent / "latents"
    with announced("encoding the training clips once with the folder's VAE and umT5"):
        report = precompute(load_config_or_exit(["--config", str(config)]), latents_dir)
    if report.failures:
        raise SystemExit(f"pan demo: {len(report.failures)} clips failed to encode; see "
                         f"{latents_dir / 'failures.csv'}")
    settings["data"]["video_csv_paths"] = [str(report.csvs[0])]
    config.write_text(yaml.safe_dump(settings, sort_keys=False))
    return config


def sample_prompts(job, checkpoint: Path, prompts: list[dict], out_dir: Path, *, ema: bool, steps: int) -> list[Path]:
    """Every prompt sampled by diffusers' WanPipeline with the checkpoint's (EMA) weights, as `pan
    sample` does, all in one batch (prompt i with noise seed i); one MP4 + GIF each."""
    weights = {name: resolve_weights(checkpoint, ema, part=name)[0] for name in job.model.trained_experts()}
    pipe = wan_pipeline(job, weights)
    pipe.set_progress_bar_config(disable=True)
    captions = [p["prompt"] for p in prompts]
    videos = generate(pipe, captions, seeds=list(range(len(captions))), height=WAN_SIZE, width=WAN_SIZE,
                      num_frames=WAN_FRAMES, steps=steps, guidance_scale=GUIDANCE,
                      max_sequence_length=job.model.max_text_tokens)
    return [write_video(out_dir / "sample.mp4", i, len(captions), video * 2 - 1, caption, SAMPLE_FPS)
            for i, (video, caption) in enumerate(zip(videos, captions))]


def run(args: argparse.Namespace) -> dict:
    out, seconds = args.out, {}
    t0 = time.perf_counter()
    quiet_library_progress_bars()   # (diffusers' and transformers' bars while the folder is written)
    with announced("writing the synthetic clips"):
        data = make_data(out / "data", args.quick, WAN_SIZE, WAN_FRAMES, shape_size=SHAPE_SIZE, pix_fmt=PIX_FMT)
    with announced("writing the tiny Wan folder (transformer, umT5 and its tokenizer, pixel VAE, scheduler)"):
        model_path = write_tiny_wan(out / "model", *latent_statistics(data["train_csv"]))
    run_dir = out / "run"
    fresh_run_dir(run_dir)
    config = write_wan_config(args, data, model_path, run_dir, out / "wan.yaml")
    seconds["data"] = time.perf_counter() - t0
    job = load_config_or_exit(["--config", str(config)])
    trainer = build_trainer(job)
    seconds["training"] = fit(trainer)

    prompts = json.loads(data["heldout_prompts"].read_text())[:QUICK["num_heldout"] if args.quick else None]
    samples_dir = out / "samples"
    t0 = time.perf_counter()
    videos = sample_prompts(job, run_dir / f"checkpoint-{trainer.state.step}", prompts, samples_dir,
                            ema=job.optim.ema_decay > 0, steps=QUICK["steps"] if args.quick else SAMPLE_STEPS)
    seconds["sampling"] = time.perf_counter() - t0
    return report_scored_samples("wan", out, config, run_dir, trainer.state.step, seconds, videos, prompts)


def demo(argv: list[str] | None = None) -> int:
    """The wan recipe's `demo` hook: `pan demo --recipe wan [options]`."""
    args = parse_args(argv)
    set_cpu_threads()   # before the data phase too (the trainer logs the choice)
    run(args)
    print(f"\nreport: {args.out / 'report.md'}  samples: {args.out / 'samples' / 'contact_sheet.gif'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(demo())

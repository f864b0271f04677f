"""Sampling for the `pyramid_flow_ar` recipe: unit by unit, each through the spatial pyramid, with
classifier-free guidance; from text, from a first image or continuing a clip. Used by validation
(`PyramidFlowARTask.sample_clips`) and by `pan sample` (`sample_main`, the recipe's `sample` hook).
The `task` the functions take is the run's task (a PyramidFlowARTask) with its encoders loaded.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
from torch import Tensor, nn

from pan.config.arguments import COUNT, POSITIVE, SEED
from pan.diffusion.pyramid_draws import PerSampleDraws
from pan.diffusion.pyramid_latents import denormalize_latent, normalize_latent
from pan.diffusion.pyramid_units import unit_frames
from pan.diffusion.pyramid_sampler import sample_autoregressive
from pan.encoders.pyramid_text import TextFeatures
from pan.models.packing import PackInfo
from pan.recipes.pyramid_flow.sample import GUIDANCE, placed_for_sampling, refuse_clip_size, sampling_world
from pan.recipes.pyramid_flow_ar.config import PyramidARJobConfig
from pan.sampling import (CONDITION_IMAGE, CONDITION_VIDEO, FRAMES, PIXELS, add_batch_size_option,
                          add_placement_options, load_condition, prompt_batches, sample_parser, write_video)


def history_velocity(model: nn.Module, features: list[TextFeatures]):
    """velocity_given(history, stage) -> velocity(x [b, C, f, h, w], t [b]): one packed forward of the
    b samples, sample i = [its history clips; x[i]] with caption features[i]; the prediction of
    the last clip only."""
    def given(history: list[Tensor], stage: int):
        def velocity(x: Tensor, t: Tensor) -> Tensor:
            texts = [f.caption_rows().float().to(x.device) for f in features]
            tokens, layouts = [], []
            for i, text in enumerate(texts):
                clips = [h[i] for h in history] + [x[i]]
                layouts.append(model.sample_layout([model.patch_grid(c.shape) for c in clips], text.shape[0]))
                tokens.append(torch.cat([model.patchify(c) for c in clips]))
            pooled = torch.stack([f.pooled_prompt_embed.float() for f in features]).to(x.device)
            out = model(torch.cat(tokens), t.to(x.device).float(), torch.cat(texts), pooled,
                        PackInfo.from_layouts(layouts, device=x.device), trained_only=True)
            lasts = [layout.clips[-1] for layout in layouts]   # the trained clip of each sample
            preds = out.split([last.tokens for last in lasts])
            return torch.stack([model.unpatchify(p, last.grid) for p, last in zip(preds, lasts)]).float()
        return velocity
    return given


def sample_ar_latents(task, model: nn.Module, prompts: list[str], seeds: list[int], *, num_frames: int,
                      height: int, width: int, context: Tensor | None = None, steps=None, video_steps=None,
                      guidance_scale: float | None = None, video_guidance_scale: float | None = None,
                      max_history_units: int | None = None, on_unit=None) -> Tensor:
    """Normalised latent clips [b, C, T, H, W], clip i for `prompts[i]` from seed `seeds[i]` (its
    noise and re-noising draws are those it gets sampled alone), generated together unit by unit
    after the normalised `context` [1, C, Tc, H, W] (whole units: a first image, or a clip to
    continue), every model call one packed forward of the b samples; `on_unit(done, units)` after
    each unit (progress)."""

    v, device = task.job.validation, task.world.device
    c, t, h, w = task.geometry.latent_shape(num_frames, height, width)
    fpu = task.job.ar.frame_per_unit
    t = unit_frames(1 + (t - 1) // fpu, fpu)  # whole units
    generators = [torch.Generator().manual_seed(seed) for seed in seeds]
    noise = torch.cat([torch.randn((1, c, t, h, w), generator=g) for g in generators]).to(device)
    cond = history_velocity(model, [task.text_encoder.encode([p])[0].to(device) for p in prompts])
    uncond = history_velocity(model, [task.empty.to(device)] * len(prompts))
    return sample_autoregressive(
        cond, noise, task.schedule, steps or v.sample_steps, PerSampleDraws(generators), frame_per_unit=fpu,
        video_steps=video_steps or v.sample_video_steps,
        context=None if context is None else context.expand(len(prompts), *context.shape[1:]),
        max_history_units=max_history_units if max_history_units is not None else v.sample_max_history_units,
        uncond_given=uncond,
        guidance_scale=v.sample_guidance_scale if guidance_scale is None else guidance_scale,
        video_guidance_scale=(v.sample_video_guidance_scale if video_guidance_scale is None
                              else video_guidance_scale), flow=task.job.flow, on_unit=on_unit)


def decode(task, latent: Tensor) -> Tensor:
    """Normalised latent [1, C, T, H, W] -> frames [T', 3, H', W'] in [-1, 1]."""
    raw = denormalize_latent(latent, task.job.pyramid)[0]
    return task.vae.decode(task.vae.normalize(raw))


def context_latent(task, path: str, *, frames: int, height: int, width: int) -> Tensor:
    """An image (first frame) or the first `frames` frames of a video -> normalised latent
    [1, C, Tc, H, W] cut to whole units."""
    encoded = load_condition(path, frames, height, width, task.vae, task.world.device)     # pan-normalised
    raw = task.vae.unnormalize(encoded)
    fpu = task.job.ar.frame_per_unit
    units = 1 + (raw.shape[1] - 1) // fpu
    return normalize_latent(raw[None, :, :unit_frames(units, fpu)], task.job.pyramid)


def build_parser(job: PyramidARJobConfig) -> argparse.ArgumentParser:
    """`pan sample`'s options for a pyramid_flow_ar run (the defaults are the run's `validation` keys)."""
    v = job.validation
    parser = sample_parser("Generate videos autoregressively from a pyramid_flow_ar checkpoint (unit by unit, "
                           "with CFG).")
    parser.add_argument("--image", type=CONDITION_IMAGE,
                        help="first frame (image-to-video): generation continues after it")
    parser.add_argument("--video", type=CONDITION_VIDEO, help="a clip whose first --video-frames frames are continued")
    parser.add_argument("--video-frames", type=FRAMES, default=None,
                        help="pixel frames taken from --video (default: 1 + one VAE frame group)")
    parser.add_argument("--num-frames", type=FRAMES, default=v.sample_num_frames, help="pixel frames in all")
    parser.add_argument("--height", type=PIXELS, default=v.sample_height, help="height in pixels")
    parser.add_argument("--width", type=PIXELS, default=v.sample_width, help="width in pixels")
    parser.add_argument("--steps", type=COUNT, nargs="+", default=v.sample_steps, help="first unit")
    parser.add_argument("--video-steps", type=COUNT, nargs="+", default=v.sample_video_steps, help="later units")
    parser.add_argument("--guidance-scale", type=GUIDANCE, default=v.sample_guidance_scale,
                        help="classifier-free guidance scale of the first unit (1: off)")
    parser.add_argument("--video-guidance-scale", type=GUIDANCE, default=v.sample_video_guidance_scale,
                        help="classifier-free guidance scale of every later unit")
    parser.add_argument("--max-history-units", type=COUNT, default=v.sample_max_history_units,
                        help="condition each unit on at most this many previous units (none: all)")
    parser.add_argument("--seed", type=SEED, default=0, help="noise seed of the first prompt (the next ones count up)")
    parser.add_argument("--fps", type=POSITIVE, default=v.sample_fps, help="frame rate of the videos written")
    add_batch_size_option(parser, v.sample_batch_size)
    parser.add_argument("--ema", action="store_true", help="use the EMA weights of the checkpoint")
    add_placement_options(parser)
    return parser


def sample_main(job: PyramidARJobConfig, argv: list[str]) -> int:
    """`pan sample` for a pyramid_flow_ar run: unit by unit, each through the spatial pyramid, with
    CFG; from text, from a first image (--image) or continuing a clip (--video)."""
    parser = build_parser(job)
    args = parser.parse_args(argv)
    if args.image and args.video:
        parser.error("give --image or --video, not both")
    refuse_clip_size(parser, job, args)
    with sampling_world() as world:
        # One clip per sync group: sampling draws each prompt's own noise.
        job = dataclasses.replace(job, ar=dataclasses.replace(job.ar, video_sync_group=1))
        task, model = placed_for_sampling(job, args, parser, world, num_frames=args.num_frames,
                                          height=args.height, width=args.width)
        sample_to_files(task, model, args, write=world.is_main)
    return 0


def sample_to_files(task, model: nn.Module, args, *, write: bool) -> None:
    """`pan sample`'s clips of every prompt batch, written as videos when `write` (rank 0)."""
    context = None
    if args.image or args.video:
        frames = 1 if args.image else (args.video_frames or 1 + task.geometry.temporal_factor)
        context = context_latent(task, args.image or args.video, frames=frames, height=args.height,
                                 width=args.width)
    steps = lambda s: s if len(s) > 1 else s[0]  # noqa: E731 - one count for every stage
    for first, prompts, seeds in prompt_batches(args.prompt, args.seed, args.batch_size):
        latents = sample_ar_latents(task, model, prompts, seeds,
                                    num_frames=args.num_frames, height=args.height, width=args.width,
                                    context=context, steps=steps(args.steps), video_steps=steps(args.video_steps),
                                    guidance_scale=args.guidance_scale,
                                    video_guidance_scale=args.video_guidance_scale,
                                    max_history_units=args.max_history_units)
        for i, (prompt, latent) in enumerate(zip(prompts, latents.split(1))):
            video = decode(task, latent)
            if write:
                write_video(args.out, first + i, len(args.prompt), video, prompt, args.fps)

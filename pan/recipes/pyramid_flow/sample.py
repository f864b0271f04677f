"""Sampling for the `pyramid_flow` recipe: the stage-by-stage sampler with classifier-free guidance,
used by validation (`PyramidFlowTask.sample_clips`) and by `pan sample` (`sample_main`, the
recipe's `sample` hook).
"""

from __future__ import annotations

import argparse
import contextlib
import math

import torch
import torch.distributed as dist
from torch import Tensor, nn

from pan.config.arguments import COUNT, POSITIVE, SEED, number
from pan.diffusion.pyramid_draws import PerSampleDraws
from pan.diffusion.pyramid_latents import denormalize_latent
from pan.diffusion.pyramid_sampler import sample_full_sequence
from pan.encoders.pyramid_text import TextFeatures
from pan.encoders.vae import vae_geometry
from pan.models.packing import PackInfo
from pan.parallel.fsdp import autocast_forward
from pan.parallel.world import close_world, init_world, planned_task
from pan.recipes.pyramid_flow.config import PyramidJobConfig
from pan.recipes.pyramid_flow.model import build_dit
from pan.recipes.pyramid_flow.rules import stage_unit
from pan.sampling import (
    FRAMES,
    PIXELS,
    add_batch_size_option,
    add_placement_options,
    forward_activation_bytes,
    place_model,
    placement_problem,
    prompt_batches,
    resolve_weights,
    sample_dtype,
    sample_parser,
    size_problems,
    write_video,
)

GUIDANCE = number(at_least=0)  # classifier-free guidance: 1 is off, 0 the unconditional prediction


def velocity_fn(model: nn.Module, features: list[TextFeatures]):
    """velocity(x [b, C, T, h, w], t [b]) -> [b, C, T, h, w]: one packed forward of b samples, sample
    i with caption features[i]."""
    def velocity(x: Tensor, t: Tensor) -> Tensor:
        grid = model.patch_grid(x[0].shape)
        texts = [f.caption_rows().float() for f in features]
        pack = PackInfo.from_layouts([model.sample_layout([grid], tx.shape[0]) for tx in texts],
                                     device=x.device)
        tokens = torch.cat([model.patchify(xi) for xi in x])
        pooled = torch.stack([f.pooled_prompt_embed.float() for f in features]).to(x.device)
        out = model(tokens, t.to(x.device).float(), torch.cat(texts).to(x.device), pooled, pack, trained_only=True)
        return torch.stack([model.unpatchify(o, grid) for o in out.chunk(len(features))]).float()
    return velocity


def sample_videos(task, model: nn.Module, prompts: list[str], *, num_frames: int, height: int, width: int,
                  steps, guidance_scale: float, seed: int, batch_size: int = 1) -> list[Tensor]:
    """Sample one latent clip per prompt with the pyramid sampler; decoded frames [T, 3, H, W] in [-1, 1].
    Prompt i draws from seed + i; `batch_size` prompts are sampled together (one packed forward), each
    with the draws it gets alone. `task` is the run's task (a PyramidFlowTask) with its encoders loaded."""

    device = task.world.device
    c, t, h, w = task.geometry.latent_shape(num_frames, height, width)
    videos = []
    for _, batch, seeds in prompt_batches(prompts, seed, batch_size):
        generators = [torch.Generator().manual_seed(s) for s in seeds]
        noise = torch.cat([torch.randn((1, c, t, h, w), generator=g) for g in generators]).to(device)
        cond = [task.text_encoder.encode([prompt])[0].to(device) for prompt in batch]
        uncond = [task.empty.to(device)] * len(batch)
        latents = sample_full_sequence(velocity_fn(model, cond), noise, task.schedule, steps,
                                       PerSampleDraws(generators),
                                       uncond_velocity=velocity_fn(model, uncond) if guidance_scale != 1 else None,
                                       guidance_scale=guidance_scale, flow=task.job.flow)
        for latent in latents.split(1):
            raw = denormalize_latent(latent, task.job.pyramid)[0]
            videos.append(task.vae.decode(task.vae.normalize(raw)))
    return videos


@contextlib.contextmanager
def sampling_world():
    """The launch's processes for `pan sample` (one without torchrun), closed after it when opened here."""
    started_here = not dist.is_initialized()
    try:
        yield init_world()
    finally:
        if started_here:
            close_world()


def placed_for_sampling(job: PyramidJobConfig, args: argparse.Namespace, parser: argparse.ArgumentParser,
                        world, *, num_frames: int, height: int, width: int):
    """What both Pyramid recipes' `pan sample` start from: the run's task of one process with its
    encoders loaded, and its DiT with the checkpoint's weights placed as `--dtype` and `--offload`
    say (pan.sampling.place_model; sharded over the processes under torchrun, where rank 0 alone
    reads the weights; bf16 weights compute under bf16 autocast, the DiT's forward alone). Returns
    (task, model); the recipe's task comes through the registry (this module is what the task
    imports for its validation samples)."""
    problem = placement_problem(args, world)
    if problem:
        parser.error(problem)
    dtype = sample_dtype(args.dtype, world.device)
    task = planned_task(job, device=world.device)
    weights, _ = resolve_weights(args.checkpoint, args.ema, args.lora) if world.rank == 0 else ({}, None)
    model = build_dit(job)
    tokens = args.batch_size * math.prod(model.patch_grid(task.geometry.latent_shape(num_frames, height, width)))
    model = place_model(model, weights, world, dtype, args.offload, forward_activation_bytes(model, tokens, dtype))
    del weights
    if dtype == torch.bfloat16:
        autocast_forward(model, world.device.type)
    task.load_encoders()
    return task, model


def clip_problems(job: PyramidJobConfig, num_frames: int, height: int, width: int,
                  video_frames: int | None = None) -> list[str]:
    """What the run's model cannot take of the clip size asked for: its VAE's factors, and latents
    that halve `stages - 1` times and still cut into the DiT's patches (from the config alone)."""
    geometry = vae_geometry(job.vae)
    return size_problems(num_frames, height, width, temporal_factor=geometry.temporal_factor,
                         spatial_factor=geometry.spatial_factor, pixel_unit=stage_unit(job),
                         why=f" for the DiT's patch at the smallest of {job.pyramid.stages} pyramid stages",
                         video_frames=video_frames)


def refuse_clip_size(parser: argparse.ArgumentParser, job: PyramidJobConfig, args: argparse.Namespace) -> None:
    """A parser error naming each size option the model cannot take, before anything is loaded."""
    problems = clip_problems(job, args.num_frames, args.height, args.width,
                             getattr(args, "video_frames", None) if getattr(args, "video", None) else None)
    if problems:
        parser.error("; ".join(problems))


def build_parser(job: PyramidJobConfig) -> argparse.ArgumentParser:
    """`pan sample`'s options for a pyramid_flow run (the defaults are the run's `validation` keys)."""
    v = job.validation
    parser = sample_parser("Generate videos from a pyramid_flow checkpoint (stage by stage, with CFG).")
    parser.add_argument("--num-frames", type=FRAMES, default=v.sample_num_frames,
                        help="pixel frames of each video (the run's sample_num_frames)")
    parser.add_argument("--height", type=PIXELS, default=v.sample_height, help="height in pixels")
    parser.add_argument("--width", type=PIXELS, default=v.sample_width, help="width in pixels")
    parser.add_argument("--steps", type=COUNT, nargs="+", default=v.sample_steps,
                        help="Euler steps of each pyramid stage (one number: every stage)")
    parser.add_argument("--guidance-scale", type=GUIDANCE, default=v.sample_guidance_scale,
                        help="classifier-free guidance scale against the empty caption (1: off)")
    parser.add_argument("--seed", type=SEED, default=0, help="noise seed of the first prompt (the next ones count up)")
    parser.add_argument("--fps", type=POSITIVE, default=v.sample_fps, help="frame rate of the videos written")
    add_batch_size_option(parser, v.sample_batch_size)
    parser.add_argument("--ema", action="store_true", help="use the EMA weights of the checkpoint")
    add_placement_options(parser)
    return parser


def sample_main(job: PyramidJobConfig, argv: list[str]) -> int:
    """`pan sample` for a pyramid_flow run: text-to-video with the stage-by-stage sampler and CFG."""
    parser = build_parser(job)
    args = parser.parse_args(argv)
    refuse_clip_size(parser, job, args)
    with sampling_world() as world:
        task, model = placed_for_sampling(job, args, parser, world, num_frames=args.num_frames,
                                          height=args.height, width=args.width)
        videos = sample_videos(task, model, args.prompt, num_frames=args.num_frames, height=args.height,
                               width=args.width, steps=args.steps if len(args.steps) > 1 else args.steps[0],
                               guidance_scale=args.guidance_scale, seed=args.seed, batch_size=args.batch_size)
        if world.is_main:  # every process sampled (a sharded forward needs them all); rank 0 writes
            for i, (prompt, video) in enumerate(zip(args.prompt, videos)):
                write_video(args.out, i, len(args.prompt), video, prompt, args.fps)
    return 0

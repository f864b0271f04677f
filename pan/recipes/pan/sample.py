"""`pan sample` for the Pan recipe, and the sampler its validation uses: Euler flow matching with
classifier-free guidance on packed inputs."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from pan.config.arguments import COUNT, FRACTION, POSITIVE, SEED, number
from pan.diffusion.conditioning import model_input_latent
from pan.diffusion.flow import FlowConfig, output_velocity
from pan.diffusion.sampler import euler_sample, known_frames
from pan.encoders.text import TextEncoder
from pan.encoders.vae import build_vae, vae_geometry
from pan.models.packing import PackInfo, patchify, unpatchify
from pan.models.pan_dit import PanVideoDiffusionTransformer
from pan.parallel.world import close_world, init_world
from pan.sampling import (
    CONDITION_IMAGE,
    CONDITION_VIDEO,
    FRAMES,
    PIXELS,
    add_placement_options,
    compute_dtype,
    load_condition,
    place_model,
    placement_problem,
    resolve_weights,
    sample_dtype,
    sample_parser,
    size_problems,
    write_video,
)

GUIDANCE = number(at_least=0)  # classifier-free guidance: 1 is off, 0 the unconditional prediction


@dataclass
class SampleSettings:
    """One Pan sample's geometry and sampler; the defaults are the released model's inference ones."""
    num_frames: int
    height: int
    width: int
    steps: int = 30
    guidance_scale: float = 2.5
    shift: float = 9.0
    seed: int = 0
    fresh_noise: float = 0.0  # 0: Euler; see pan.diffusion.sampler.renoise_step


def latent_velocity(model, schema: str, patch, texts: list[Tensor], given: int,
                    known: Tensor | None, flow: FlowConfig):
    """velocity_fn(x [C, T, H, W], sigma) for each caption in `texts` (one packed forward for all);
    `flow` says what the model outputs (`prediction_type`)."""
    def velocity(x: Tensor, sigma: float) -> list[Tensor]:
        cond = known if known is not None else torch.zeros_like(x)
        tokens = patchify(model_input_latent(x, cond, given, schema), patch)
        grid = (x.shape[1] // patch[0], x.shape[2] // patch[1], x.shape[3] // patch[2])
        pack = PackInfo.build([grid] * len(texts), [t.shape[0] for t in texts], device=x.device)
        out = model(tokens.repeat(len(texts), 1), torch.full((len(texts),), sigma, device=x.device),
                    torch.cat(texts), pack)
        return [output_velocity(flow, unpatchify(o, grid, patch).float(), x, sigma)
                for o in out.chunk(len(texts))]
    return velocity


@torch.no_grad()
def sample_latent(model, *, schema: str, patch, latent_shape, text: Tensor, empty_text: Tensor,
                  settings: SampleSettings, flow: FlowConfig, known: Tensor | None = None, given: int = 0,
                  device=None) -> Tensor:
    """One latent [C, T, H, W] for one caption. `known`/`given`: the first `given` latent frames of
    `known` are the condition (image-to-video: 1; continuation: k)."""
    generator = torch.Generator().manual_seed(settings.seed)
    noise = torch.randn(latent_shape, generator=generator).to(device)
    guided = settings.guidance_scale != 1.0
    both = latent_velocity(model, schema, patch, [text, empty_text] if guided else [text], given, known, flow)

    def velocity(x, sigma):
        v = both(x, sigma)
        return v[1] + settings.guidance_scale * (v[0] - v[1]) if guided else v[0]

    # Given frames follow the noise level, as they did in training (x_t covers every frame).
    condition = known_frames(known, given, noise=noise) if given else None
    return euler_sample(velocity, noise, settings.steps, settings.shift, condition_fn=condition,
                        fresh_noise=settings.fresh_noise, generator=generator)


def activation_bytes(arch, tokens: int, dtype: torch.dtype) -> int:
    """Rough peak of one forward without gradients over `tokens` joint rows: a block's widest
    intermediates (q, k, v and the MLP's inner rows) and the residual streams, in `dtype`."""
    width = arch.hidden_size * (5 + arch.mlp_ratio)
    return int(2 * tokens * width * dtype.itemsize)


def place_transformer(job, weights: dict[str, Tensor], world, dtype: torch.dtype, offload: bool,
                      tokens: int) -> torch.nn.Module:
    """The run's transformer with `weights`, placed for sampling (pan.sampling.place_model) with the
    activations of one forward over `tokens` joint rows."""
    arch = job.model.transformer_config_overrides
    with torch.device("meta"):
        model = PanVideoDiffusionTransformer(arch, job.model.zero_init_modulation, job.model.attention_backend)
    return place_model(model, weights, world, dtype, offload, activation_bytes(arch, tokens, dtype))


def sample_pan(job, argv: list[str]) -> int:
    """`pan sample` for the Pan recipe (`job`: the run's config when `main` found it). Under torchrun
    the transformer is sharded over the launch's GPUs (every process samples, rank 0 writes)."""
    started_here = not dist.is_initialized()
    try:
        return _sample_pan(job, argv)
    finally:
        if started_here:
            close_world()


def build_parser(job=None) -> argparse.ArgumentParser:
    """`pan sample`'s options for a Pan run (`job`: its config; the defaults come from it when used)."""
    parser = sample_parser("Generate videos from a Pan checkpoint.")
    parser.add_argument("--image", type=CONDITION_IMAGE, help="first-frame image (image-to-video)")
    parser.add_argument("--video", type=CONDITION_VIDEO, help="video whose first --video-frames frames are continued")
    parser.add_argument("--video-frames", type=COUNT, default=5, help="pixel frames taken from --video")
    parser.add_argument("--num-frames", type=FRAMES, help="pixel frames of each video (default: the run's "
                                                          "sample_num_frames)")
    parser.add_argument("--height", type=PIXELS, help="height in pixels (default: the run's sample_height)")
    parser.add_argument("--width", type=PIXELS, help="width in pixels (default: the run's sample_width)")
    parser.add_argument("--steps", type=COUNT, help="sampling steps (default: the run's sample_steps)")
    parser.add_argument("--guidance-scale", type=GUIDANCE,
                        help="classifier-free guidance scale, 1 = off (default: the run's sample_guidance_scale)")
    parser.add_argument("--shift", type=POSITIVE, help="timestep shift of the sampling schedule (default: the "
                                                       "run's sample_shift)")
    parser.add_argument("--fresh-noise", type=FRACTION,
                        help="share of fresh noise per step: 0 = Euler, 1 = re-noise the predicted "
                             "sample (default: the run's sample_fresh_noise)")
    parser.add_argument("--seed", type=SEED, default=0, help="noise seed of the first prompt (the next "
                                                             "ones count up)")
    parser.add_argument("--fps", type=POSITIVE, default=8.0, help="frame rate of the videos written")
    parser.add_argument("--ema", action="store_true", help="use the EMA weights of the checkpoint")
    add_placement_options(parser)
    return parser


def settings_of(job, args) -> SampleSettings:
    """The run's sampling defaults (its `validation` keys) with the options given over them."""
    v = job.validation
    return SampleSettings(
        num_frames=args.num_frames or v.sample_num_frames, height=args.height or v.sample_height,
        width=args.width or v.sample_width, steps=args.steps or v.sample_steps,
        guidance_scale=v.sample_guidance_scale if args.guidance_scale is None else args.guidance_scale,
        shift=args.shift or v.sample_shift, seed=args.seed,
        fresh_noise=v.sample_fresh_noise if args.fresh_noise is None else args.fresh_noise)


def clip_problems(job, settings: SampleSettings, video_frames: int | None = None) -> list[str]:
    """What the run's model cannot take of the clip size asked for (its VAE's factors and the
    transformer's patch, from the config alone: nothing is loaded)."""
    geometry = vae_geometry(job.vae)
    pt, ph, pw = job.model.transformer_config_overrides.patch_size
    return size_problems(settings.num_frames, settings.height, settings.width,
                         temporal_factor=geometry.temporal_factor, spatial_factor=geometry.spatial_factor,
                         frame_unit=pt, pixel_unit=(ph, pw), why=" for the transformer's patch",
                         video_frames=video_frames)


def _sample_pan(job, argv: list[str]) -> int:
    parser = build_parser(job)
    args = parser.parse_args(argv)
    if args.image and args.video:
        parser.error("give --image or --video, not both")
    if job is None:  # no config beside the checkpoint, none in an exported file, none given
        parser.error(f"--config is needed: {args.checkpoint} carries no run config (give the run's config.yaml)")
    settings = settings_of(job, args)
    problems = clip_problems(job, settings, args.video_frames if args.video else None)
    if problems:  # judged from the config, before a weight is read
        parser.error("; ".join(problems))

    world = init_world()
    if placement_problem(args, world):
        parser.error(placement_problem(args, world))
    # Sharded: rank 0 alone reads the weights and sends every rank its shard.
    weights, _ = resolve_weights(args.checkpoint, args.ema, args.lora) if world.rank == 0 else ({}, None)
    device, dtype = world.device, sample_dtype(args.dtype, world.device)
    arch = job.model.transformer_config_overrides
    # The text encoder first, and gone before the transformer comes: they never share the GPU.
    text_encoder = TextEncoder(job.text_encoder, device=device)
    texts = [t.float() for t in text_encoder.encode(args.prompt)]
    empty = text_encoder.empty_embedding().float()
    del text_encoder
    if device.type == "cuda":
        torch.cuda.empty_cache()
    vae = build_vae(job.vae, device=device)
    shape = vae.latent_shape(settings.num_frames, settings.height, settings.width)
    pt, ph, pw = arch.patch_size
    tokens = 2 * (shape[1] // pt) * (shape[2] // ph) * (shape[3] // pw) + 2 * max(t.shape[0] for t in texts)
    model = place_transformer(job, weights, world, dtype, args.offload, tokens)
    del weights
    known, given = None, 0
    if args.image or args.video:
        cond = load_condition(args.image or args.video, 1 if args.image else args.video_frames,
                              settings.height, settings.width, vae, device)
        given = cond.shape[1]
        known = torch.zeros(shape, device=device)
        known[:, :given] = cond
    for i, (prompt, text) in enumerate(zip(args.prompt, texts)):
        with compute_dtype(dtype, device):
            latent = sample_latent(model, schema=job.tasks.conditioning_schema, patch=arch.patch_size,
                                   flow=job.flow, latent_shape=shape, text=text, empty_text=empty,
                                   settings=SampleSettings(**{**vars(settings), "seed": settings.seed + i}),
                                   known=known, given=given, device=device)
        if not world.is_main:
            continue
        write_video(args.out, i, len(args.prompt), vae.decode(latent), prompt, args.fps)
    return 0

"""`pan sample` for the Wan recipe: diffusers' own WanPipeline with the run's trained weights.

    pan sample --checkpoint runs/wan/checkpoint-1000 --prompt "a cat plays the piano" --out cat.mp4

The run's Wan folder (its config's `model_path`) is loaded as a `WanPipeline`: the folder's umT5,
tokenizer, VAE (fp32) and scheduler (UniPC with flow sigmas, `flow_shift` from the folder or
--flow-shift), and every expert the run trained gets the checkpoint's weights (a LoRA checkpoint:
its base with the adapters merged; --lora merges a peft folder's) in place of the folder's; an expert
the run did not train (A14B with one expert) stays the folder's. Parameter names are the same on
both sides (pan/recipes/wan/weights.py), so the sampler is exactly WanPipeline's: prompts encoded and
padded to the run's `max_text_tokens` rows (512 for the releases, as WanPipeline pads them: what
the transformer saw in training), classifier-free guidance with --negative-prompt (A14B: --guidance-scale-2 for the
low-noise expert), the experts switched at boundary_ratio, TI2V folders' per-token timesteps.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch

from pan.logging import get_logger
from pan.sampling import resolve_weights, sample_dtype, sample_parser, write_video


def wan_pipeline(job, weights: dict[str, dict[str, torch.Tensor]], device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, flow_shift: float | None = None):
    """The run's folder as a diffusers WanPipeline on `device`, the experts named in `weights`
    (part name -> state dict) replaced by those weights; transformers and umT5 in `dtype`, the VAE in
    fp32."""
    from diffusers import UniPCMultistepScheduler, WanPipeline

    folder = job.model.folder()
    pipe = WanPipeline.from_pretrained(str(folder.path), dtype=dtype)
    for name, state in weights.items():
        model = getattr(pipe, name)
        model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True)
    if dtype != torch.float32:
        pipe.vae.to(torch.float32)
    if flow_shift is not None:
        pipe.scheduler = UniPCMultistepScheduler.from_config(pipe.scheduler.config, flow_shift=flow_shift)
    return pipe.to(device)


def pipeline_num_frames(pipe, frames: int) -> int:
    """The `num_frames` to ask WanPipeline for so that it makes `frames` frames. WanPipeline rounds a
    count that is not 1 + k x (the VAE's temporal factor) up to the next one, and with a VAE that does
    not compress time (factor 1: the demo's pixel codec) every count n % 1 = 0 != 1 is "rounded" to
    n + 1: so it is asked for one frame fewer there."""
    temporal = pipe.vae_scale_factor_temporal
    return frames - 1 if temporal == 1 else frames


@contextlib.contextmanager
def _quiet_frame_rounding(pipe):
    """WanPipeline's warning about that rounding, silenced while pipeline_num_frames undoes it."""
    log = logging.getLogger(type(pipe).__module__)
    level = log.level
    if pipe.vae_scale_factor_temporal == 1:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


@torch.no_grad()
def generate(pipe, prompts: list[str], seeds: list[int], *, height: int, width: int, num_frames: int, steps: int,
             guidance_scale: float, max_sequence_length: int, negative_prompt: str = "", **extra) -> torch.Tensor:
    """WanPipeline's videos of `prompts` in one call (prompt i drawn with the noise of seed i), as
    [B, T, 3, H, W] in [0, 1] on the CPU (fp32)."""
    device = pipe.transformer.device
    generators = [torch.Generator(device).manual_seed(seed) for seed in seeds]
    with _quiet_frame_rounding(pipe):
        frames = pipe(prompt=prompts, negative_prompt=[negative_prompt] * len(prompts), height=height, width=width,
                      num_frames=pipeline_num_frames(pipe, num_frames), num_inference_steps=steps,
                      guidance_scale=guidance_scale, generator=generators, output_type="pt",
                      max_sequence_length=max_sequence_length, **extra).frames
    return frames.float().cpu()


def sample_wan(job, argv: list[str]) -> int:
    """`pan sample` for a Wan run (`job`: the run's config)."""
    parser = sample_parser("Generate videos from a Wan run's checkpoint with diffusers' WanPipeline (the run's "
                           "folder's umT5, VAE and UniPC flow scheduler, the checkpoint's transformer weights).")
    parser.add_argument("--negative-prompt", default="", help="negative prompt of classifier-free guidance")
    parser.add_argument("--num-frames", type=int, default=81, help="pixel frames (1 + 4k)")
    parser.add_argument("--height", type=int, default=480, help="height in pixels")
    parser.add_argument("--width", type=int, default=832, help="width in pixels")
    parser.add_argument("--steps", type=int, default=50, help="sampling steps")
    parser.add_argument("--guidance-scale", type=float, default=5.0, help="classifier-free guidance, 1 = off")
    parser.add_argument("--guidance-scale-2", type=float, default=None,
                        help="A14B: guidance of the low-noise expert (default: --guidance-scale)")
    parser.add_argument("--flow-shift", type=float, default=None,
                        help="the sampling schedule's shift (default: the folder's scheduler's)")
    parser.add_argument("--seed", type=int, default=0, help="noise seed of the first prompt (the next ones count up)")
    parser.add_argument("--fps", type=float, default=16.0, help="frame rate of the videos written")
    parser.add_argument("--ema", action="store_true", help="use the EMA weights of the checkpoint")
    parser.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto",
                        help="transformer and umT5 weights and compute: auto = bf16 on a GPU, fp32 on the CPU")
    args = parser.parse_args(argv)
    if job is None:
        parser.error("--config is needed: the run's config.yaml names the Wan folder")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = sample_dtype(args.dtype, device)
    weights = {name: resolve_weights(args.checkpoint, args.ema, args.lora, part=name)[0]
               for name in job.model.trained_experts()}
    pipe = wan_pipeline(job, weights, device, dtype, args.flow_shift)
    extra = {} if args.guidance_scale_2 is None else {"guidance_scale_2": args.guidance_scale_2}
    get_logger().info("sampling %d prompt(s) with %s", len(args.prompt), job.model.model_path)
    for i, prompt in enumerate(args.prompt):
        (video,) = generate(pipe, [prompt], [args.seed + i], height=args.height, width=args.width,
                            num_frames=args.num_frames, steps=args.steps, guidance_scale=args.guidance_scale,
                            max_sequence_length=job.model.max_text_tokens, negative_prompt=args.negative_prompt,
                            **extra)                                                   # [T, 3, H, W] in [0, 1]
        write_video(Path(args.out), i, len(args.prompt), video * 2 - 1, prompt, args.fps)
    return 0

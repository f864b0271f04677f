"""Generate videos with a trained Pan transformer: Euler flow matching with CFG on packed inputs."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from pan.diffusion.conditioning import model_input_latent
from pan.diffusion.flow import FlowConfig, output_velocity
from pan.diffusion.sampler import euler_sample, known_frames
from pan.models.packing import PackInfo, patchify, unpatchify


@dataclass
class SampleSettings:
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



# ------------------------------------------------------------------------------------------------
# `pan sample`
# ------------------------------------------------------------------------------------------------

def resolve_weights(path: Path, use_ema: bool) -> tuple[dict[str, Tensor], Path | None]:
    """Transformer weights from an exported .safetensors, a checkpoint-N/ (or its transformer/), or a
    run's output_dir (its latest complete checkpoint). Returns the weights and the run dir, if known."""
    from safetensors.torch import load_file

    from pan.checkpoint import dcp as layout
    from pan.checkpoint.export import consolidated_weights

    if path.suffix == ".safetensors":
        return load_file(str(path)), None
    if (path / layout.DCP_METADATA).is_file():  # a transformer/ (or ema/) DCP folder
        return consolidated_weights(path), path.parent.parent
    if not (path / layout.TRANSFORMER).is_dir():  # a run dir: take its latest complete checkpoint
        done = layout.complete_checkpoints(path)
        if not done:
            raise SystemExit(f"pan sample: {path} holds no complete checkpoint.")
        path = done[-1]
    source = path / (layout.EMA if use_ema else layout.TRANSFORMER)
    if not source.is_dir():
        raise SystemExit(f"pan sample: {path} has no {source.name}/ weights.")
    return consolidated_weights(source), path.parent


def load_condition(path: str, given_frames: int, settings: SampleSettings, vae, device) -> Tensor:
    """Pixels of an image (first frame) or a video (first frames) -> latent with the given frames."""
    import numpy as np
    from PIL import Image

    if Path(path).suffix.lower() in (".png", ".jpg", ".jpeg", ".webp"):
        image = Image.open(path).convert("RGB").resize((settings.width, settings.height))
        frames = torch.from_numpy(np.array(image)).permute(2, 0, 1)[None]
    else:
        import av
        with av.open(path) as container:
            frames = [torch.from_numpy(f.to_ndarray(format="rgb24", width=settings.width,
                                                    height=settings.height)).permute(2, 0, 1)
                      for f in container.decode(video=0)]
        frames = torch.stack(frames[:given_frames])
    return vae.encode(frames.to(device).float().div(127.5).sub(1.0))


def run_config_of(checkpoint: Path) -> Path | None:
    """The config.yaml of the run a checkpoint path belongs to (a run dir, checkpoint-N/, or one of
    its DCP folders); None for an exported file."""
    for folder in (checkpoint, checkpoint.parent, checkpoint.parent.parent):
        if (folder / "config.yaml").is_file():
            return folder / "config.yaml"
    return None


def main(argv: list[str] | None = None) -> int:
    """`pan sample`: find the run's recipe from its config and hand the command to its sampler."""
    import argparse
    import importlib

    from pan.cli import EXIT_CONFIG_ERROR, load_config_or_exit
    from pan.recipes import get_recipe

    argv = list(argv or [])
    probe = argparse.ArgumentParser(add_help=False)
    probe.add_argument("--checkpoint", type=Path)
    probe.add_argument("--config")
    known, _ = probe.parse_known_args(argv)
    config = known.config or (run_config_of(known.checkpoint) if known.checkpoint else None)
    if config is None:  # no run to read the recipe from: Pan's sampler explains what it needs
        return sample_pan(None, argv)
    job = load_config_or_exit(["--config", str(config)])
    recipe = get_recipe(job.recipe)
    if recipe.sample is None:
        print(f"pan sample: the {job.recipe} recipe has no sampler ({recipe.description}).",
              file=sys.stderr)
        return EXIT_CONFIG_ERROR
    module, function = recipe.sample.split(":")
    return getattr(importlib.import_module(module), function)(job, argv)


# ------------------------------------------------------------------------------------------------
# Placing the transformer: one device in bf16, its blocks offloaded to host memory, or sharded
# ------------------------------------------------------------------------------------------------

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
GIB = 2 ** 30
# CUDA context, cuBLAS / attention workspaces and the allocator's slack, beside weights and activations
RUNTIME_RESERVE = 2 * GIB


def sample_dtype(choice: str, device: torch.device) -> torch.dtype:
    """Weights and compute of `pan sample`: `auto` is bf16 on a GPU (as training computes), fp32 on
    the CPU (whose bf16 matmuls are slow)."""
    if choice == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[choice]


def activation_bytes(arch, tokens: int, dtype: torch.dtype) -> int:
    """Rough peak of one forward without gradients over `tokens` joint rows: a block's widest
    intermediates (q, k, v and the MLP's inner rows) and the residual streams, in `dtype`."""
    width = arch.hidden_size * (5 + arch.mlp_ratio)
    return int(2 * tokens * width * dtype.itemsize)


def memory_plan(weights: int, activations: int, free: int, *, shards: int, offload: bool) -> str | None:
    """None when the transformer fits the device as placed; else why not and what to do instead."""
    resident = 0 if offload else weights // shards
    need = resident + activations + RUNTIME_RESERVE
    if need <= free:
        return None
    where = "with --offload" if offload else f"over {shards} GPU(s)" if shards > 1 else "on one GPU"
    return (f"pan sample: the transformer needs about {need / GIB:.1f} GiB {where} (weights "
            f"{weights / GIB:.1f} GiB, activations {activations / GIB:.1f} GiB, {RUNTIME_RESERVE / GIB:.0f} "
            f"GiB runtime), but {free / GIB:.1f} GiB is free. Options: --dtype bf16 (if it ran in fp32; "
            "half the weights); several GPUs: `torchrun --nproc_per_node N -m pan.cli sample ...` shards "
            f"the weights (about {weights / GIB / 8:.1f} GiB per GPU on 8); --offload keeps the blocks in "
            f"host memory ({weights / GIB:.1f} GiB of RAM) and moves one at a time to the GPU (slower); "
            "fewer --num-frames or a smaller --height/--width for the activations.")


def offload_blocks(model: torch.nn.Module, device: torch.device) -> None:
    """Keep the blocks' weights in (pinned) host memory and give each block its weights on `device`
    for its forward only; the rest of the model (embeddings, output layer) moves to `device`."""
    in_blocks = set()
    for block in model.fsdp_blocks():
        params = list(block.parameters())
        in_blocks.update(params)
        host = [p.data.pin_memory() if device.type == "cuda" else p.data for p in params]
        for p, h in zip(params, host):
            p.data = h                    # the pinned copy replaces the pageable one

        def load(module, args, params=params, host=host):
            for p, h in zip(params, host):
                p.data = h.to(device, non_blocking=True)

        def unload(module, args, output, params=params, host=host):
            for p, h in zip(params, host):
                p.data = h

        block.register_forward_pre_hook(load)
        block.register_forward_hook(unload, always_call=True)
    for p in model.parameters():
        if p not in in_blocks:
            p.data = p.data.to(device)


def shard_over_gpus(model: torch.nn.Module, weights: dict[str, Tensor], world) -> None:
    """FSDP2 over every process of the launch: each holds 1/N of the weights, which rank 0 reads
    from the checkpoint and sends out (the others pass no weights); each forward all-gathers one
    block at a time."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(world.device.type, (world.size,))
    for block in model.fsdp_blocks():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device=world.device)
    set_model_state_dict(model, weights, options=StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=True, strict=True))


def place_transformer(job, weights: dict[str, Tensor], world, dtype: torch.dtype, offload: bool,
                      tokens: int) -> torch.nn.Module:
    """The transformer with `weights` (every rank's are rank 0's when sharded), in `dtype`, placed
    on the device: whole, with offloaded blocks, or sharded over the launch's GPUs. Built on the
    meta device: a 29B model is never initialised in fp32 on the host just to be overwritten."""
    from pan.models.pan_dit import PanVideoDiffusionTransformer

    arch = job.model.transformer_config_overrides
    with torch.device("meta"):
        model = PanVideoDiffusionTransformer(arch, job.model.zero_init_modulation,
                                             job.model.attention_backend).to(dtype)
    device = world.device
    if device.type == "cuda":
        size = sum(p.numel() for p in model.parameters()) * dtype.itemsize
        problem = memory_plan(size, activation_bytes(arch, tokens, dtype), torch.cuda.mem_get_info(device)[0],
                              shards=world.size, offload=offload)
        if problem:
            raise SystemExit(problem)
    for name in list(weights):  # one tensor at a time: the host never holds two copies of the model
        weights[name] = weights[name].to(dtype)
    if world.size > 1:
        shard_over_gpus(model, weights, world)
        return model.eval()
    model.load_state_dict(weights, assign=True)
    if offload:
        offload_blocks(model, device)
    else:
        model.to(device)
    return model.eval()


def compute_dtype(dtype: torch.dtype, device: torch.device):
    """bf16 weights compute under bf16 autocast (inputs, latents and the sampler stay fp32)."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16,
                          cache_enabled=False)


def sample_pan(job, argv: list[str]) -> int:
    """`pan sample` for the Pan recipe (`job`: the run's config when `main` found it). Under torchrun
    the transformer is sharded over the launch's GPUs (every process samples, rank 0 writes)."""
    import torch.distributed as dist

    from pan.parallel.world import close_world

    started_here = not dist.is_initialized()
    try:
        return _sample_pan(job, argv)
    finally:
        if started_here:
            close_world()


def _sample_pan(job, argv: list[str]) -> int:
    import argparse

    from pan.cli import load_config_or_exit
    from pan.encoders.text import TextEncoder
    from pan.encoders.vae import build_vae
    from pan.media import to_uint8_frames, write_gif, write_mp4
    from pan.parallel.world import init_world

    parser = argparse.ArgumentParser(prog="pan sample", description="Generate videos from a checkpoint.")
    parser.add_argument("--checkpoint", required=True, type=Path,
                        help="checkpoint-N/ dir, a run's output_dir (latest checkpoint), or an exported "
                             ".safetensors")
    parser.add_argument("--config", help="run config (default: the run's config.yaml)")
    parser.add_argument("--prompt", action="append", required=True, help="caption (repeatable)")
    parser.add_argument("--out", required=True, type=Path, help="output .mp4 (a .gif is written beside)")
    parser.add_argument("--image", help="first-frame image (image-to-video)")
    parser.add_argument("--video", help="video whose first --video-frames frames are continued")
    parser.add_argument("--video-frames", type=int, default=5, help="pixel frames taken from --video")
    parser.add_argument("--num-frames", type=int)
    parser.add_argument("--height", type=int)
    parser.add_argument("--width", type=int)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--guidance-scale", type=float)
    parser.add_argument("--shift", type=float)
    parser.add_argument("--fresh-noise", type=float,
                        help="share of fresh noise per step: 0 = Euler, 1 = re-noise the predicted "
                             "sample (default: the run's sample_fresh_noise)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fps", type=float, default=8.0)
    parser.add_argument("--ema", action="store_true", help="use the EMA weights of the checkpoint")
    parser.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto",
                        help="transformer weights and compute: auto = bf16 on a GPU, fp32 on the CPU")
    parser.add_argument("--offload", action="store_true",
                        help="keep the transformer's blocks in host memory, each moved to the GPU for "
                             "its forward (a model larger than the GPU, on one GPU; slower)")
    args = parser.parse_args(argv)
    if args.image and args.video:
        parser.error("give --image or --video, not both")
    if args.fresh_noise is not None and not 0 <= args.fresh_noise <= 1:
        parser.error(f"--fresh-noise must be in [0, 1], got {args.fresh_noise}")

    world = init_world()
    if args.offload and world.size > 1:
        parser.error("--offload is for one process; under torchrun the weights are sharded instead")
    # Sharded: rank 0 alone reads the weights and sends every rank its shard.
    weights, run_dir = resolve_weights(args.checkpoint, args.ema) if world.rank == 0 else ({}, None)
    if job is None:
        config = args.config or (run_dir / "config.yaml" if run_dir else None)
        if config is None:
            parser.error("--config is needed with an exported .safetensors (and under torchrun)")
        job = load_config_or_exit(["--config", str(config)])
    v = job.validation
    settings = SampleSettings(
        num_frames=args.num_frames or v.sample_num_frames, height=args.height or v.sample_height,
        width=args.width or v.sample_width, steps=args.steps or v.sample_steps,
        guidance_scale=v.sample_guidance_scale if args.guidance_scale is None else args.guidance_scale,
        shift=args.shift or v.sample_shift, seed=args.seed,
        fresh_noise=v.sample_fresh_noise if args.fresh_noise is None else args.fresh_noise)
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
                              settings, vae, device)
        given = cond.shape[1]
        known = torch.zeros(shape, device=device)
        known[:, :given] = cond
    if world.is_main:
        args.out.parent.mkdir(parents=True, exist_ok=True)
    for i, (prompt, text) in enumerate(zip(args.prompt, texts)):
        with compute_dtype(dtype, device):
            latent = sample_latent(model, schema=job.tasks.conditioning_schema, patch=arch.patch_size,
                                   flow=job.flow, latent_shape=shape, text=text, empty_text=empty,
                                   settings=SampleSettings(**{**vars(settings), "seed": settings.seed + i}),
                                   known=known, given=given, device=device)
        if not world.is_main:
            continue
        frames = to_uint8_frames(vae.decode(latent))
        out = args.out if len(args.prompt) == 1 else args.out.with_name(f"{args.out.stem}_{i:02d}.mp4")
        write_mp4(out, frames, args.fps)
        write_gif(out.with_suffix(".gif"), frames, args.fps)
        print(f"{out}  <- {prompt!r}")
    return 0

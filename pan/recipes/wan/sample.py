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

An I2V run's folder (Wan 2.1 I2V, Wan 2.2 I2V A14B) is loaded as diffusers' WanImageToVideoPipeline
instead, and `--image PATH` (required there, refused elsewhere) is the first frame every prompt's video
starts from (its CLIP rows and its VAE condition latent, as that pipeline makes them).

    pan sample --checkpoint runs/wan_i2v --image first.png --prompt "the cat starts to play" --out cat.mp4
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch

from pan.logging import get_logger
from pan.config.arguments import COUNT, POSITIVE, SEED, input_file
from pan.recipes.wan.text import UMT5Encoder, padded
from pan.sampling import FRAMES, PIXELS, resolve_weights, sample_dtype, sample_parser, write_video


def _read_image(path: Path):
    from PIL import Image

    with Image.open(path) as image:
        return image.convert("RGB")


# `--image`: a file read as the sampler reads it (an RGB image), while parsing
FIRST_IMAGE = input_file("an image file (PNG, JPEG, WebP)", check=_read_image)


def wan_pipeline(job, weights: dict[str, dict[str, torch.Tensor]], device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, flow_shift: float | None = None):
    """The run's folder as a diffusers WanPipeline on `device`, the experts named in `weights`
    (part name -> state dict) replaced by those weights; transformers and umT5 in `dtype`, the VAE in
    fp32."""
    import diffusers
    from diffusers import UniPCMultistepScheduler

    folder = job.model.folder()
    # WanImageToVideoPipeline cleans prompts with ftfy whether or not it is installed (diffusers 0.42):
    # its prompts are encoded by pan (pan/recipes/wan/text.py, WanPipeline's encoding) and given to it as
    # embeddings (`generate(texts=...)`), so its own umT5 is not loaded
    own_text = {} if folder.pipeline == "WanPipeline" else {"text_encoder": None}
    pipe = getattr(diffusers, folder.pipeline).from_pretrained(str(folder.path), dtype=dtype, **own_text)
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
             guidance_scale: float, max_sequence_length: int, negative_prompt: str = "", texts=None,
             **extra) -> torch.Tensor:
    """The pipeline's videos of `prompts` in one call (prompt i drawn with the noise of seed i), as
    [B, T, 3, H, W] in [0, 1] on the CPU (fp32). `texts` (a UMT5Encoder): encode the prompts with it and
    give the pipeline their embeddings (see wan_pipeline)."""
    device = pipe.transformer.device
    generators = [torch.Generator(device).manual_seed(seed) for seed in seeds]
    if texts is None:
        text = dict(prompt=prompts, negative_prompt=[negative_prompt] * len(prompts))
    else:
        text = dict(prompt_embeds=prompt_embeds(texts, prompts, max_sequence_length),
                    negative_prompt_embeds=prompt_embeds(texts, [negative_prompt] * len(prompts), max_sequence_length))
    with _quiet_frame_rounding(pipe):
        frames = pipe(**text, height=height, width=width,
                      num_frames=pipeline_num_frames(pipe, num_frames), num_inference_steps=steps,
                      guidance_scale=guidance_scale, generator=generators, output_type="pt",
                      max_sequence_length=max_sequence_length, **extra).frames
    return frames.float().cpu()


def prompt_embeds(texts, prompts: list[str], rows: int) -> torch.Tensor:
    """[B, rows, D]: each prompt's umT5 rows padded with zero rows, as the pipelines' encode_prompt."""
    return torch.stack([padded(t, rows) for t in texts.encode(prompts)])


def sample_wan(job, argv: list[str]) -> int:
    """`pan sample` for a Wan run (`job`: the run's config)."""
    parser = sample_parser("Generate videos from a Wan run's checkpoint with diffusers' WanPipeline (the run's "
                           "folder's umT5, VAE and UniPC flow scheduler, the checkpoint's transformer weights).")
    parser.add_argument("--negative-prompt", default="", help="negative prompt of classifier-free guidance")
    parser.add_argument("--image", type=FIRST_IMAGE, default=None,
                        help="I2V runs (required there): the image file every video starts from")
    parser.add_argument("--num-frames", type=FRAMES, default=81, help="pixel frames (1 + 4k)")
    parser.add_argument("--height", type=PIXELS, default=480, help="height in pixels")
    parser.add_argument("--width", type=PIXELS, default=832, help="width in pixels")
    parser.add_argument("--steps", type=COUNT, default=50, help="sampling steps")
    parser.add_argument("--guidance-scale", type=POSITIVE, default=5.0, help="classifier-free guidance, 1 = off")
    parser.add_argument("--guidance-scale-2", type=POSITIVE, default=None,
                        help="A14B: guidance of the low-noise expert (default: --guidance-scale)")
    parser.add_argument("--flow-shift", type=POSITIVE, default=None,
                        help="the sampling schedule's shift (default: the folder's scheduler's)")
    parser.add_argument("--seed", type=SEED, default=0, help="noise seed of the first prompt (the next ones count up)")
    parser.add_argument("--fps", type=POSITIVE, default=16.0, help="frame rate of the videos written")
    parser.add_argument("--ema", action="store_true", help="use the EMA weights of the checkpoint")
    parser.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto",
                        help="transformer and umT5 weights and compute: auto = bf16 on a GPU, fp32 on the CPU")
    args = parser.parse_args(argv)
    if job is None:
        parser.error("--config is needed: the run's config.yaml names the Wan folder")
    image = first_image(parser, args.image, job.model.resolved_conditioning() == "i2v")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = sample_dtype(args.dtype, device)
    weights = {name: resolve_weights(args.checkpoint, args.ema, args.lora, part=name)[0]
               for name in job.model.trained_experts()}
    pipe = wan_pipeline(job, weights, device, dtype, args.flow_shift)
    texts = (None if pipe.text_encoder is not None
             else UMT5Encoder(job.model.folder().path, job.model.max_text_tokens, device=device, dtype=dtype))
    extra = {} if args.guidance_scale_2 is None else {"guidance_scale_2": args.guidance_scale_2}
    if image is not None:
        extra["image"] = image
    get_logger().info("sampling %d prompt(s) with %s", len(args.prompt), job.model.model_path)
    for i, prompt in enumerate(args.prompt):
        (video,) = generate(pipe, [prompt], [args.seed + i], height=args.height, width=args.width,
                            num_frames=args.num_frames, steps=args.steps, guidance_scale=args.guidance_scale,
                            max_sequence_length=job.model.max_text_tokens, negative_prompt=args.negative_prompt,
                            texts=texts, **extra)                              # [T, 3, H, W] in [0, 1]
        write_video(Path(args.out), i, len(args.prompt), video * 2 - 1, prompt, args.fps)
    return 0


def first_image(parser, path: Path | None, i2v: bool):
    """--image as a PIL RGB image for an I2V run (None otherwise); --image missing there, or given for
    another run, is a parser error (exit 2; an unreadable file is refused while parsing)."""
    if not i2v:
        if path is not None:
            parser.error("--image is for an I2V run (Wan 2.1 I2V / 2.2 I2V A14B folder); this run is not one: drop it")
        return None
    if path is None:
        parser.error("--image is required: this run trains image-to-video; give the first frame's image file")
    return _read_image(path)   # (read once while parsing: FIRST_IMAGE)

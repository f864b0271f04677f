"""`pan sample`: find the run's recipe and hand the command to its sampler; what samplers share
(the weights of a checkpoint, a condition clip, placing a model on the device, writing videos)."""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import av
import numpy as np
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file
from torch import Tensor

from pan.checkpoint import layout
from pan.checkpoint.consolidate import CONFIG_METADATA_KEY, consolidated_weights, part_source
from pan.checkpoint.layout import is_lora_checkpoint
from pan.config import DEFAULT_RECIPE, EXIT_CONFIG_ERROR, ConfigError, load_config_or_exit
from pan.config.arguments import COUNT, ValueType, input_file, output_file, whole_number, yaml_mapping
from pan.data.media import to_uint8_frames, write_gif, write_mp4
from pan.logging import quiet_library_progress_bars
from pan.lora.files import PEFT_CONFIG, apply_lora
from pan.lora.runs import merged_weights
from pan.parallel.precision import compute_precision
from pan.recipe import get_recipe


# ------------------------------------------------------------------------------------------------
# `pan sample`
# ------------------------------------------------------------------------------------------------

CHECKPOINT_TAKES = "a run's output_dir, a checkpoint-N/ folder or an exported .safetensors file"
LORA_TAKES = ("a peft folder (`pan export --format peft`) or a LoRA run's checkpoint-N/ folder or "
              "output_dir")


def resolve_weights(path: Path, use_ema: bool, lora: Path | None = None,
                    part: str | None = None) -> tuple[dict[str, Tensor], Path | None]:
    """A part's weights (`part`: its name; None: the run's main part, e.g. the transformer) from an
    exported .safetensors, a checkpoint-N/ (or one of its part folders), or a run's output_dir (its
    latest complete checkpoint); a LoRA run's checkpoint gives its base with the adapters merged in,
    and `lora` (`--lora PATH`: a peft folder or a LoRA run's checkpoint) merges its adapters into
    the weights (pan/lora/runs.py). Returns the weights and the run dir, if known. A path that gives
    none is refused as a ConfigError naming the option (`pan sample` exits 2)."""
    weights, run_dir = _resolve_weights(path, use_ema, part)
    if lora is not None:
        try:
            weights = apply_lora(weights, lora, use_ema)
        except (ValueError, FileNotFoundError) as e:
            raise ConfigError(None, str(e) if str(e).startswith("--lora") else f"--lora {lora}: {e}") from None
    return weights, run_dir


def _checkpoint_weights(source: Path, use_ema: bool = False) -> dict[str, Tensor]:
    """One DCP folder's weights, or for a LoRA checkpoint's folder its merged model."""
    if not is_lora_checkpoint(source):
        return consolidated_weights(source)
    try:
        return merged_weights(source, ema=use_ema)
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(None, f"--checkpoint {source}: {e}") from None


def checkpoint_problem(path: Path) -> str | None:
    """Why `--checkpoint PATH` gives no weights (what the path is, and what the option takes), None
    when it may: read before anything is loaded. An exported file's contents are judged by
    `embedded_config`, a checkpoint folder's by reading it."""
    if not path.exists():
        return f"--checkpoint {path} does not exist: give {CHECKPOINT_TAKES}."
    if path.is_file():
        if path.suffix == ".safetensors":
            return None
        return f"--checkpoint {path} is a file, not a .safetensors file: give {CHECKPOINT_TAKES}."
    if (path / layout.DCP_METADATA).is_file() or (path / layout.META).is_file():
        return None
    if layout.complete_checkpoints(path):
        return None
    what = "an empty folder" if not any(path.iterdir()) else "a folder without a complete checkpoint"
    return (f"--checkpoint {path} is {what} (no checkpoint-N/ folder whose save finished, no "
            f"checkpoint files): give {CHECKPOINT_TAKES}.")


def lora_problem(path: Path) -> str | None:
    """Why `--lora PATH` gives no adapters, from what the path is (before anything is loaded)."""
    if not path.exists():
        return f"--lora {path} does not exist: give {LORA_TAKES}."
    if path.is_file():
        return f"--lora {path} is a file: give {LORA_TAKES}."
    if (path / PEFT_CONFIG).is_file() or (path / layout.META).is_file() or layout.complete_checkpoints(path):
        return None
    return f"--lora {path} is a folder without {PEFT_CONFIG} or a complete checkpoint: give {LORA_TAKES}."


def _resolve_weights(path: Path, use_ema: bool, part: str | None) -> tuple[dict[str, Tensor], Path | None]:
    problem = checkpoint_problem(path)
    if problem:
        raise ConfigError(None, problem)
    if path.suffix == ".safetensors" and path.is_file():
        try:
            return load_file(str(path)), None
        except Exception as e:  # noqa: BLE001 - safetensors' own error types for a file that is not one
            raise ConfigError(None, f"--checkpoint {path} is not a readable .safetensors file ({e}): "
                                    "export it again with `pan export`.") from None
    if (path / layout.DCP_METADATA).is_file():  # one part's (or its EMA's) DCP folder
        return _checkpoint_weights(path), path.parent.parent
    if not (path / layout.META).is_file():  # a run dir: take its latest complete checkpoint
        path = layout.complete_checkpoints(path)[-1]
    try:
        _, source = part_source(path, part, use_ema)
    except ValueError as e:
        raise ConfigError(None, f"--checkpoint {e}") from None
    return _checkpoint_weights(source), path.parent


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")


def read_condition_frames(path: str | Path, frames: int, height: int, width: int) -> Tensor:
    """Pixels [T, 3, H, W] (uint8) of an image (one frame) or of a video's first `frames` frames,
    resized to width x height (an image suffix is read as an image, anything else as a video)."""
    if Path(path).suffix.lower() in IMAGE_SUFFIXES:
        image = Image.open(path).convert("RGB").resize((width, height))
        return torch.from_numpy(np.array(image)).permute(2, 0, 1)[None]
    with av.open(str(path)) as container:
        decoded = []
        for f in container.decode(video=0):
            decoded.append(torch.from_numpy(f.to_ndarray(format="rgb24", width=width, height=height)).permute(2, 0, 1))
            if len(decoded) == frames:
                break
    if not decoded:
        raise ValueError("it holds no video frame")
    return torch.stack(decoded)


def load_condition(path: str, given_frames: int, height: int, width: int, vae, device) -> Tensor:
    """Pixels of an image (first frame) or a video (first frames), resized to width x height ->
    latent with the given frames."""
    frames = read_condition_frames(path, given_frames, height, width)
    return vae.encode(frames.to(device).float().div(127.5).sub(1.0))


# `--image` / `--video`: a file read as the sampler will read it (its first frame), while parsing.
CONDITION_IMAGE = input_file("an image (.png, .jpg, .jpeg or .webp) or a video",
                             check=lambda path: read_condition_frames(path, 1, 8, 8))
CONDITION_VIDEO = input_file("a video (or an image: one frame)",
                             check=lambda path: read_condition_frames(path, 1, 8, 8))
# Clip sizes: whole numbers >= 1 that the sampler then checks against the model (`size_problems`).
PIXELS = ValueType("pixels", whole_number(1).convert, "pixels")
FRAMES = ValueType("frames", whole_number(1).convert, "frames")


def size_problems(num_frames: int, height: int, width: int, *, temporal_factor: int, spatial_factor: int,
                  frame_unit: int = 1, pixel_unit: tuple[int, int] = (1, 1), why: str = "",
                  video_frames: int | None = None) -> list[str]:
    """What the model cannot take of a clip of `num_frames` x `height` x `width` pixels (and of
    `video_frames` condition frames), one sentence naming the option per problem: the VAE encodes
    1 + k x `temporal_factor` frames and `spatial_factor` pixels to one latent pixel; the latent's
    frames must be a multiple of `frame_unit` and its height and width of `pixel_unit` (the
    transformer's patch, a pyramid's stages: `why` says which)."""
    problems = []
    latent_frames = (num_frames - 1) // temporal_factor + 1
    if (num_frames - 1) % temporal_factor or latent_frames % frame_unit:
        problems.append(f"--num-frames {num_frames}: the VAE encodes 1 + a multiple of {temporal_factor} frames"
                        + (f" into a multiple of {frame_unit} latent frames" if frame_unit > 1 else ""))
    if video_frames is not None and (video_frames - 1) % temporal_factor:
        problems.append(f"--video-frames {video_frames}: the VAE encodes 1 + a multiple of {temporal_factor} frames")
    for option, value, unit in (("--height", height, pixel_unit[0]), ("--width", width, pixel_unit[1])):
        multiple = spatial_factor * unit
        if value % multiple:
            low = max(multiple, value - value % multiple)
            problems.append(f"{option} {value}: must be a multiple of {multiple} (the VAE's {spatial_factor}x "
                            f"spatial compression x {unit}{why}), e.g. {low} or {low + multiple}")
    return problems


class HelpWithDefaults(argparse.HelpFormatter):
    """Every option's help ends with its default, where it has one (None and False say nothing: the
    help says where such a value comes from)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("%(default)" in text or any(action.default is v for v in (None, False, argparse.SUPPRESS))
                or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


# --checkpoint, --lora and --config: `main` judges them (`checkpoint_problem`, `lora_problem`,
# `config_problem`: exit 2 naming the option) before the recipe's sampler parses them again.
JUDGED_PATH = ValueType("checkpoint", Path, "path")
RUN_CONFIG = input_file("a run's config.yaml", check=yaml_mapping)


def config_problem(path: Path) -> str | None:
    """Why `--config PATH` is no run config (missing, a folder, empty, not YAML), None when it may be."""
    try:
        RUN_CONFIG.convert(str(path))
    except (ValueError, OSError) as e:
        return f"--config {e}"
    return None
VIDEO_OUT = output_file("the .mp4 file to write")


def sample_parser(description: str) -> argparse.ArgumentParser:
    """`pan sample`'s parser with the options every recipe's sampler takes; the recipe adds its own
    (each with a help text; defaults are printed by `HelpWithDefaults`)."""
    parser = argparse.ArgumentParser(prog="pan sample", description=description, formatter_class=HelpWithDefaults)
    parser.add_argument("--checkpoint", required=True, type=JUDGED_PATH,
                        help="checkpoint-N/ dir, a run's output_dir (latest checkpoint), or an exported "
                             ".safetensors")
    parser.add_argument("--config", type=RUN_CONFIG, help="run config (default: the run's config.yaml)")
    parser.add_argument("--lora", type=JUDGED_PATH,
                        help="LoRA adapters merged into the --checkpoint weights before sampling: a "
                             "peft folder (`pan export --format peft`) or a LoRA run's checkpoint-N/ "
                             "or output_dir (--ema: the adapters' EMA). A LoRA run's checkpoint given "
                             "as --checkpoint is merged onto its own base without it")
    parser.add_argument("--prompt", action="append", required=True, help="caption (repeatable)")
    parser.add_argument("--out", required=True, type=VIDEO_OUT, help="output .mp4 (a .gif is written beside)")
    return parser


def add_placement_options(parser: argparse.ArgumentParser) -> None:
    """`--dtype` and `--offload`: how the transformer is placed (`place_model`); under torchrun it is
    sharded over the launch's processes instead of offloaded."""
    parser.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto",
                        help="transformer weights and compute: auto = bf16 on a GPU, fp32 on the CPU")
    parser.add_argument("--offload", action="store_true",
                        help="keep the transformer's blocks in host memory, each moved to the GPU for "
                             "its forward (a model larger than the GPU, on one GPU; slower)")


def placement_problem(args: argparse.Namespace, world) -> str | None:
    """What the placement options cannot do in this launch (a parser error), None when they can."""
    if args.offload and world.size > 1:
        return "--offload is for one process; under torchrun the weights are sharded instead"
    return None


def add_batch_size_option(parser: argparse.ArgumentParser, default: int) -> None:
    """`--batch-size`: prompts sampled together (the run's `sample_batch_size` by default)."""
    parser.add_argument("--batch-size", type=COUNT, default=default,
                        help="prompts sampled together (each keeps its own seed's draws)")


def prompt_batches(prompts: list[str], seed: int, batch_size: int) -> Iterator[tuple[int, list[str], list[int]]]:
    """(index of the first prompt, prompts, their seeds) for each batch of `batch_size` prompts.
    Prompt i draws from seed + i whatever batch it is sampled in: the batch size changes the speed,
    not the clips."""
    for first in range(0, len(prompts), batch_size):
        batch = prompts[first:first + batch_size]
        yield first, batch, [seed + first + i for i in range(len(batch))]


def write_video(out: Path, index: int, count: int, video: Tensor, prompt: str, fps: float) -> Path:
    """One sampled video ([T, 3, H, W] in [-1, 1]) as an MP4 and a GIF beside it: `out` itself for a
    single prompt, `<stem>_NN.mp4` beside it for prompt NN of several. Prints which prompt it is."""
    path = out if count == 1 else out.with_name(f"{out.stem}_{index:02d}.mp4")
    path.parent.mkdir(parents=True, exist_ok=True)
    frames = to_uint8_frames(video)
    write_mp4(path, frames, fps)
    write_gif(path.with_suffix(".gif"), frames, fps)
    print(f"{path}  <- {prompt!r}")
    return path


def embedded_config(checkpoint: Path) -> str | None:
    """The config an exported .safetensors carries (`pan export` writes it into the file's metadata),
    None for anything else; a .safetensors that cannot be read is refused here (ValueError)."""
    if checkpoint.suffix != ".safetensors" or checkpoint.is_dir():
        return None
    if not checkpoint.is_file():
        raise ValueError(f"--checkpoint {checkpoint} does not exist: give a run's output_dir, a "
                         "checkpoint-N/ folder or an exported .safetensors file.")
    try:
        with safe_open(str(checkpoint), "pt") as f:
            metadata = f.metadata() or {}
    except Exception as e:  # safetensors raises its own error types for a file that is not one
        raise ValueError(f"--checkpoint {checkpoint} is not a readable .safetensors file ({e}): "
                         "export it again with `pan export`.") from None
    return metadata.get(CONFIG_METADATA_KEY)


def run_config_of(checkpoint: Path) -> Path | None:
    """The config.yaml of the run a checkpoint path belongs to (a run dir, checkpoint-N/, or one of
    its DCP folders); None for an exported file."""
    for folder in (checkpoint, checkpoint.parent, checkpoint.parent.parent):
        if (folder / "config.yaml").is_file():
            return folder / "config.yaml"
    return None


def main(argv: list[str] | None = None) -> int:
    """`pan sample`: find the run's recipe from its config and hand the command to its sampler. The
    paths it reads the recipe from are judged first: a wrong --checkpoint, --lora or --config is
    refused by name (exit 2) before anything is loaded."""
    argv = list(argv or [])
    probe = argparse.ArgumentParser(prog="pan sample", add_help=False)
    probe.add_argument("--checkpoint", type=Path)
    probe.add_argument("--config", type=Path)
    probe.add_argument("--lora", type=Path)
    known, _ = probe.parse_known_args(argv)
    quiet_library_progress_bars(on_a_terminal_too=True)
    try:
        for problem in (known.checkpoint and checkpoint_problem(known.checkpoint),
                        known.lora and lora_problem(known.lora), known.config and config_problem(known.config)):
            if problem:
                raise ValueError(problem)
        embedded = embedded_config(known.checkpoint) if known.checkpoint else None
    except ValueError as e:
        print(f"pan sample: {e}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    config = known.config or (run_config_of(known.checkpoint) if known.checkpoint and embedded is None else None)
    with tempfile.TemporaryDirectory() as scratch:
        under = None
        if embedded is not None:  # an exported model's own config, under a --config given (key by key)
            under = Path(scratch) / "exported.yaml"
            under.write_text(embedded)
        return sample_with(config, under, argv)


def sample_with(config: str | Path | None, under: Path | None, argv: list[str]) -> int:
    """Load the model's config (only what using it reads is checked) and run its recipe's sampler."""
    try:
        if config is None and under is None:  # nothing to read the recipe from: its sampler says what it needs
            return get_recipe(DEFAULT_RECIPE).hook("sample")(None, argv)
        job = load_config_or_exit(["--config", str(config)] if config else [], use_only=True, under=under)
        recipe = get_recipe(job.recipe)
        if recipe.sample is None:
            print(f"pan sample: the {job.recipe} recipe has no sampler ({recipe.description}).",
                  file=sys.stderr)
            return EXIT_CONFIG_ERROR
        return recipe.hook("sample")(job, argv)
    except ConfigError as e:  # what the sampler needs and the run's config does not give (encoders, VAE)
        print(f"pan sample: refused: {e}", file=sys.stderr)
        return EXIT_CONFIG_ERROR


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


def place_model(model: torch.nn.Module, weights: dict[str, Tensor], world, dtype: torch.dtype,
                offload: bool, activations: int) -> torch.nn.Module:
    """`model` (built on the meta device: a 29B model is never initialised in fp32 on the host just
    to be overwritten) with `weights` (every rank's are rank 0's when sharded), in `dtype`, placed
    on the device: whole, with offloaded blocks, or sharded over the launch's GPUs. `activations`:
    the bytes one forward needs beside the weights (for the memory plan on a GPU)."""
    model = model.to(dtype)
    device = world.device
    if device.type == "cuda":
        size = sum(p.numel() for p in model.parameters()) * dtype.itemsize
        problem = memory_plan(size, activations, torch.cuda.mem_get_info(device)[0],
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


def forward_activation_bytes(model: torch.nn.Module, tokens: int, dtype: torch.dtype) -> int:
    """Rough peak of one forward without gradients over `tokens` rows, for a model without an estimate
    of its own: every output row of its first block's matrices alive at once, twice over (the
    residual streams and the next op's output), in `dtype`."""
    block = model.fsdp_blocks()[0]
    width = sum(p.shape[0] for p in block.parameters() if p.ndim == 2)
    return int(2 * tokens * width * dtype.itemsize)


def compute_dtype(dtype: torch.dtype, device: torch.device):
    """bf16 weights compute under bf16 autocast (inputs, latents and the sampler stay fp32)."""
    return compute_precision(dtype, device.type, fp32_disables=True)

"""`pan export`: one trained part of a checkpoint as a .safetensors file, a LoRA run's adapters as a
peft folder (`--format peft`) or merged into its base (`--merge`), or a format a recipe writes (one
declared with `adapter_format` writes a LoRA run's adapters: it takes the checkpoint without --merge).

Runs on one process, without a process group: DCP reads every shard into full tensors, whatever
world size wrote them (pan/checkpoint/consolidate.py); a LoRA checkpoint's base is rebuilt as the trainer
built it (pan/lora/runs.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from pan.checkpoint import layout
from pan.lora.files import write_peft
from pan.checkpoint.consolidate import (CONFIG_METADATA_KEY, export_checkpoint, honour_umask, part_source,
                                       write_weights)
from pan.config import ConfigError, load_job_config
from pan.config.arguments import ValueType, output_place
from pan.config.job import dump_sections, job_to_sections
from pan.lora.runs import merged_weights
from pan.recipe import get_recipe, recipe_names, resolve

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PEFT = "peft"


CHECKPOINT_TAKES = "a run's output_dir, a checkpoint-N/ folder or one of its part folders"
# The file to write (a folder with --format peft or a recipe's format: main_export refuses a folder
# for a file's format).
OUT = ValueType("output file", output_place("the file (or, with --format peft or a recipe's format, the "
                                            "folder) to write"), "output_file")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pan export", description="Write one trained part's weights of a checkpoint (the main "
                                       "part by default: the transformer) as one .safetensors file "
                                       "(usable as pretrained_transformer_path).")
    parser.add_argument("checkpoint", type=ValueType("folder", Path, "folder"),  # judged by checkpoint_of
                        help="a run's output_dir (its latest complete checkpoint), a checkpoint-N/ folder, "
                             "or one of its part folders")
    parser.add_argument("--out", type=OUT, help="the .safetensors file to write (may also follow the "
                                                "checkpoint without --out)")
    parser.add_argument("out_file", nargs="?", type=OUT, help=argparse.SUPPRESS)
    parser.add_argument("--part", help="which trained part to export (default: the main one, e.g. "
                                       "transformer; `pan inspect` lists a checkpoint's parts)")
    parser.add_argument("--ema", action="store_true", help="export the EMA weights instead")
    parser.add_argument("--dtype", choices=list(DTYPES), help="cast floating tensors (default: as saved)")
    parser.add_argument("--merge", action="store_true",
                        help="a LoRA run's checkpoint: write its base with the adapters merged in "
                             "(W + scale * B @ A, fp32), in --format safetensors or a recipe's weights format (a "
                             "format that writes adapters takes the checkpoint without it)")
    formats = export_formats()
    parser.add_argument("--format", choices=["safetensors", PEFT, *formats], default="safetensors",
                        help="safetensors: one file; peft: a LoRA run's adapters as a folder that "
                             "peft's PeftModel.from_pretrained loads; or a format a recipe writes (" + "; ".join(
                            f"{name}: {describe(spec)}" for name, spec in formats.items()) + ")")
    return parser


def main_export(argv: list[str]) -> int:
    parser = build_parser()
    formats = export_formats()
    args = parser.parse_args(argv)
    if (args.out is None) == (args.out_file is None):
        parser.error("name the .safetensors file to write once: --out model.safetensors")
    args.out = args.out or args.out_file
    if args.format == "safetensors" and Path(args.out).is_dir():
        parser.error(f"--out {args.out} is a folder: give the .safetensors file to write (a folder is "
                     "written by --format peft or a recipe's format)")
    try:
        args.checkpoint = str(checkpoint_of(Path(args.checkpoint)))
    except ValueError as e:
        print(f"pan export: {e}", file=sys.stderr)
        return 2
    if args.format == PEFT:
        return export_peft(args)
    if args.format != "safetensors":
        return export_format(args, args.format, formats[args.format])
    dtype = DTYPES[args.dtype] if args.dtype else None
    try:
        metadata = sampling_metadata(Path(args.checkpoint))
        if args.merge:
            weights = export_merged(Path(args.checkpoint), Path(args.out), args.part, args.ema, dtype, metadata)
        else:
            weights = export_checkpoint(args.checkpoint, args.out, ema=args.ema, part=args.part, dtype=dtype,
                                        metadata=metadata)
    except (ValueError, FileNotFoundError) as e:
        print(f"pan export: {e}", file=sys.stderr)
        return 2
    count = sum(v.numel() for v in weights.values())
    source = Path(args.checkpoint)
    part = args.part or (source.name if (source / layout.DCP_METADATA).is_file()
                         else layout.saved_parts(source)[0])
    print(f"wrote {args.out}: part {part}{' (EMA)' if args.ema else ''}{' (LoRA merged)' if args.merge else ''}, "
          f"{len(weights)} tensors, {count:,} parameters")
    return 0


def checkpoint_of(path: Path) -> Path:
    """What to export from `path`: a run's output_dir gives its latest complete checkpoint (as `pan
    sample --checkpoint` takes it); a checkpoint-N/ or a part's folder is itself."""
    if not path.exists():
        raise ValueError(f"checkpoint {path} does not exist: give {CHECKPOINT_TAKES}.")
    if not path.is_dir():
        raise ValueError(f"checkpoint {path} is a file: give {CHECKPOINT_TAKES} (an exported .safetensors "
                         "is already exported).")
    if (path / layout.META).is_file() or (path / layout.DCP_METADATA).is_file() or layout.step_of(path) is not None:
        return path
    done = layout.complete_checkpoints(path)
    if not done:
        what = "an empty folder" if not any(path.iterdir()) else "a folder without a complete checkpoint"
        raise ValueError(f"checkpoint {path} is {what} (no checkpoint-N/ folder whose save finished): give "
                         "a run's output_dir after its first save, a checkpoint-N/ folder or one of its part "
                         "folders.")
    return done[-1]


def sampling_metadata(ckpt_dir: Path) -> dict[str, str]:
    """What `pan sample` needs beside the weights, for the exported file's metadata: the run's config
    without the paths only training reads (pan.config.job.job_to_sections), so the one file samples
    without its run. Nothing when the run's config.yaml is not beside its checkpoints or does not load here
    (the export still goes on, and says so)."""
    folder = ckpt_dir if layout.step_of(ckpt_dir) is not None else ckpt_dir.parent
    config = folder.parent / "config.yaml"
    if not config.is_file():
        return {}
    try:
        job = load_job_config(["--config", str(config)], warn=lambda msg: None, use_only=True)
    except ConfigError as e:
        print(f"pan export: the run's {config} does not load here, so the file carries no config "
              f"(pan sample will need --config): {e}", file=sys.stderr)
        return {}
    return {CONFIG_METADATA_KEY: dump_sections(job_to_sections(job, use_only=True))}


def export_merged(ckpt_dir: Path, out: Path, part: str | None, ema: bool, dtype,
                  metadata: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """`--merge`: a LoRA part's base with its adapters (or their EMA) merged in, as one file."""
    problem = lora_merge_problem(ckpt_dir, True, part)
    if problem:
        raise ValueError(problem)
    weights = merged_weights(ckpt_dir, part, ema)
    if dtype is not None:
        weights = {k: v.to(dtype) if v.is_floating_point() else v for k, v in weights.items()}
    ckpt, part_name, own_ema = layout.checkpoint_folder(ckpt_dir)
    source = ckpt_dir if part_name else part_source(ckpt, part, ema or bool(own_ema))[1]
    write_weights(weights, out, {**(metadata or {}), "source": str(source), "part": part_name or part or "",
                                 "lora": "merged"})
    return weights


def export_peft(args) -> int:
    """`--format peft`: a LoRA part's adapters as a peft folder (pan/lora/files.py)."""
    if args.merge or args.dtype:
        print("pan export: --format peft writes the adapters as saved (fp32; no --merge or --dtype)",
              file=sys.stderr)
        return 2
    try:
        written = write_peft(Path(args.checkpoint), Path(args.out), part=args.part, ema=args.ema)
    except (ValueError, FileNotFoundError) as e:
        print(f"pan export: {e}", file=sys.stderr)
        return 2
    honour_umask(Path(written))
    print(f"wrote {written} (--format peft: adapter_config.json and adapter_model.safetensors; "
          f"PeftModel.from_pretrained loads it onto the base){' (EMA)' if args.ema else ''}")
    return 0


def export_formats() -> dict[str, str]:
    """`pan export --format` name -> the recipe hook writing it (`Recipe.exports`), of every recipe."""
    return {name: spec for recipe in recipe_names() for name, spec in get_recipe(recipe).exports.items()}


def describe(spec: str) -> str:
    """The first sentence of an export hook's docstring (for --help)."""
    text = " ".join((resolve(spec).__doc__ or spec).split())
    return text.split(". ")[0].rstrip(".")


# A recipe's export hook with this attribute set true writes a LoRA run's adapters themselves (not
# merged): `pan export` then takes a LoRA checkpoint without --merge and refuses --merge with it.
WRITES_ADAPTERS = "writes_adapters"


def adapter_format(hook):
    """Declare a recipe's export hook as one that writes a LoRA run's adapters (a decorator)."""
    setattr(hook, WRITES_ADAPTERS, True)
    return hook


def writes_adapters(spec: str) -> bool:
    """Whether the export hook `spec` declares that it writes adapters (WRITES_ADAPTERS)."""
    return bool(getattr(resolve(spec), WRITES_ADAPTERS, False))


def export_format(args, name: str, spec: str) -> int:
    """A recipe's own format: its hook writes the main part as saved (no --part or --dtype)."""
    if args.part is not None or args.dtype:
        print(f"pan export: --format {name} writes the main part as saved (no --part or --dtype)",
              file=sys.stderr)
        return 2
    if writes_adapters(spec):
        problem = adapter_format_problem(Path(args.checkpoint), name, args.merge)
    else:
        problem = lora_merge_problem(Path(args.checkpoint), args.merge)
    if problem:
        print(f"pan export: {problem}", file=sys.stderr)
        return 2
    try:
        written = resolve(spec)(Path(args.checkpoint), Path(args.out), ema=args.ema)
    except (ValueError, FileNotFoundError) as e:
        print(f"pan export: {e}", file=sys.stderr)
        return 2
    honour_umask(Path(written))
    print(f"wrote {written} (--format {name}: {describe(spec)})")
    return 0


def lora_merge_problem(ckpt_dir: Path, merge: bool, part: str | None = None) -> str | None:
    """Why this export of the checkpoint is refused: a LoRA checkpoint needs --merge (a recipe's
    hook then writes the merged model, `lora_runs.part_weights`), and --merge needs one."""
    lora = layout.is_lora_checkpoint(ckpt_dir, part)
    if lora and not merge:
        return (f"{ckpt_dir} is a LoRA checkpoint (adapters only): add --merge to write its base with "
                "the adapters merged in, or use --format peft for the adapters alone")
    if merge and not lora:
        return f"--merge is for a LoRA run's checkpoint; {ckpt_dir} holds whole weights (export it without --merge)"
    return None


def adapter_format_problem(ckpt_dir: Path, name: str, merge: bool) -> str | None:
    """Why a format that writes adapters refuses this export: --merge (its files hold the adapters
    apart from the base: merged weights are another format's), or a checkpoint without adapters."""
    if merge:
        return (f"--format {name} writes a LoRA run's adapters unmerged, to load onto the base; --merge asks "
                "for the base with the adapters merged in: drop --merge, or use --merge with a format that "
                "writes whole weights (--format safetensors or a recipe's weights format)")
    if not layout.is_lora_checkpoint(ckpt_dir):
        return (f"--format {name} writes a LoRA run's adapters, and {ckpt_dir} holds whole weights: export "
                "it with --format safetensors or a recipe's weights format")
    return None

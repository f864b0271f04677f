"""`pan export` (consolidated .safetensors weights of a checkpoint) and `pan inspect` (a run's list).

Both run on one process, without a process group: DCP reads every shard of the folder into full
tensors, whatever world size wrote it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from pan.checkpoint import dcp as layout
from pan.recipe import get_recipe, recipe_names, resolve


def consolidated_weights(dcp_dir: Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP folder, unsharded, on CPU (optionally cast to `dtype`), read by this
    process alone: no collective, so with a process group each rank may call it or not (a frozen
    VAE read from a causal_vae checkpoint, `pan sample`)."""
    import torch.distributed.checkpoint as dcp

    state = {key: torch.empty(size, dtype=stored) for key, (size, stored) in layout.dcp_tensor_shapes(dcp_dir).items()}
    dcp.load(state, storage_reader=layout.DirectReader(str(dcp_dir)), no_dist=True)
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    return state


def part_source(ckpt_dir: Path, part: str | None, ema: bool) -> tuple[str, Path]:
    """(part name, DCP folder) of a part's weights (or EMA) in a checkpoint-N/ folder; the main
    (first) part when `part` is None."""
    problem = layout.verify_checkpoint(ckpt_dir)
    if problem is not None:
        raise ValueError(f"{ckpt_dir} is not a readable checkpoint: {problem}")
    parts = layout.saved_parts(ckpt_dir)
    part = part or parts[0]
    if part not in parts:
        raise ValueError(f"{ckpt_dir} holds the parts {parts}, not {part!r}: choose one with --part.")
    model_dir, _, ema_dir = layout.part_dirs(part)
    source = ckpt_dir / (ema_dir if ema else model_dir)
    if not source.is_dir():
        raise ValueError(f"{ckpt_dir} holds no EMA weights of {part} (its ema_decay was 0)")
    return part, source


def export_checkpoint(ckpt_dir: str | Path, out_path: str | Path, *, ema: bool = False,
                      dtype: torch.dtype | None = None, part: str | None = None) -> dict[str, torch.Tensor]:
    """Write one part's weights of `ckpt_dir` (a checkpoint-N/, or one DCP folder of it) as one
    .safetensors file that `safetensors.torch.load_file` and the warm start read.

    `part` names the part (default: the main one, e.g. the transformer); `ema=True` exports its EMA
    weights instead (the checkpoint must hold them). Returns the tensors.
    """
    ckpt_dir, out_path = Path(ckpt_dir), Path(out_path)
    if (ckpt_dir / layout.DCP_METADATA).is_file():
        if ema or part:
            raise ValueError(f"{ckpt_dir} is a single DCP folder; pass its checkpoint-N/ for --ema "
                             "or --part")
        part, source = ckpt_dir.name, ckpt_dir
    else:
        part, source = part_source(ckpt_dir, part, ema)
    weights = consolidated_weights(source, dtype)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + ".tmp")
    save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp),
              metadata={"source": str(source), "part": part, "format": "pan-weights"})
    tmp.replace(out_path)  # a killed export never leaves a half-written file under the real name
    return weights


def inspect_run(output_dir: str | Path, verify: bool = False) -> list[layout.CheckpointInfo]:
    """Every checkpoint folder of a run, including unfinished saves, oldest step first (or the one
    checkpoint-N/ folder given). `verify` also reads every file of each readable checkpoint and
    compares its CRC32 with the one recorded when it was saved."""
    output_dir = Path(output_dir)
    if layout.step_of(output_dir) is not None and (output_dir / layout.META).is_file():
        paths = [output_dir]
    else:
        paths = layout.checkpoint_dirs(output_dir) + layout.partial_dirs(output_dir)
    infos = sorted((layout.describe(p) for p in paths), key=lambda i: (i.step, i.path.name))
    if verify:
        for info in infos:
            if info.complete and info.problem is None:
                info.problem = layout.verify_checksums(info.path)
                info.verified = info.problem is None
    return infos


def format_inspection(infos: list[layout.CheckpointInfo]) -> str:
    lines = [f"{'checkpoint':<28}{'step':>10}{'complete':>10}{'size':>12}  {'parts':<28}status"]
    for i in infos:
        status = ("ok (checksums verified)" if i.verified else "ok") if i.problem is None else i.problem
        parts = ",".join(i.parts) if i.parts else "?"
        lines.append(f"{i.path.name:<28}{i.step:>10}{'yes' if i.complete else 'no':>10}"
                     f"{i.size_bytes / 2**20:>10.1f}MB  {parts:<28}{status}")
    readable = [i for i in infos if i.complete and i.problem is None]
    lines.append(f"resume would start from: {readable[-1].path.name if readable else 'nothing (fresh run)'}")
    return "\n".join(lines)


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def main_export(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="pan export", description="Write one trained part's weights of a checkpoint (the main "
                                       "part by default: the transformer) as one .safetensors file "
                                       "(usable as pretrained_transformer_path).")
    parser.add_argument("checkpoint", help="a checkpoint-N/ folder, or its transformer/ folder")
    parser.add_argument("--out", help="the .safetensors file to write (may also follow the checkpoint "
                                      "without --out)")
    parser.add_argument("out_file", nargs="?", help=argparse.SUPPRESS)
    parser.add_argument("--part", help="which trained part to export (default: the main one, e.g. "
                                       "transformer; `pan inspect` lists a checkpoint's parts)")
    parser.add_argument("--ema", action="store_true", help="export the EMA weights instead")
    parser.add_argument("--dtype", choices=list(DTYPES), help="cast floating tensors (default: as saved)")
    formats = export_formats()
    parser.add_argument("--format", choices=["safetensors", *formats], default="safetensors",
                        help="safetensors: one file; or a format a recipe writes (" + "; ".join(
                            f"{name}: {describe(spec)}" for name, spec in formats.items()) + ")")
    args = parser.parse_args(argv)
    if (args.out is None) == (args.out_file is None):
        parser.error("name the .safetensors file to write once: --out model.safetensors")
    args.out = args.out or args.out_file
    if args.format != "safetensors":
        return export_format(args, args.format, formats[args.format])
    try:
        weights = export_checkpoint(args.checkpoint, args.out, ema=args.ema, part=args.part,
                                    dtype=DTYPES[args.dtype] if args.dtype else None)
    except (ValueError, FileNotFoundError) as e:
        print(f"pan export: {e}", file=sys.stderr)
        return 2
    count = sum(v.numel() for v in weights.values())
    source = Path(args.checkpoint)
    part = args.part or (source.name if (source / layout.DCP_METADATA).is_file()
                         else layout.saved_parts(source)[0])
    print(f"wrote {args.out}: part {part}{' (EMA)' if args.ema else ''}, {len(weights)} tensors, "
          f"{count:,} parameters")
    return 0


def export_formats() -> dict[str, str]:
    """`pan export --format` name -> the recipe hook writing it (`Recipe.exports`), of every recipe."""
    return {name: spec for recipe in recipe_names() for name, spec in get_recipe(recipe).exports.items()}


def describe(spec: str) -> str:
    """The first sentence of an export hook's docstring (for --help)."""
    text = " ".join((resolve(spec).__doc__ or spec).split())
    return text.split(". ")[0].rstrip(".")


def export_format(args, name: str, spec: str) -> int:
    """A recipe's own format: its hook writes the main part as saved (no --part or --dtype)."""
    if args.part is not None or args.dtype:
        print(f"pan export: --format {name} writes the main part as saved (no --part or --dtype)",
              file=sys.stderr)
        return 2
    try:
        written = resolve(spec)(Path(args.checkpoint), Path(args.out), ema=args.ema)
    except (ValueError, FileNotFoundError) as e:
        print(f"pan export: {e}", file=sys.stderr)
        return 2
    print(f"wrote {written} (--format {name}: {describe(spec)})")
    return 0


def main_inspect(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pan inspect",
                                     description="List a run's checkpoints: step, completeness, size.")
    parser.add_argument("output_dir", help="the run's output_dir (or one checkpoint-N/ folder)")
    parser.add_argument("--verify", action="store_true",
                        help="also read every file of each complete checkpoint and compare its CRC32 "
                             "with the one recorded when it was saved (exit 1 if any differs)")
    args = parser.parse_args(argv)
    if not Path(args.output_dir).is_dir():
        print(f"pan inspect: {args.output_dir} is not a directory", file=sys.stderr)
        return 2
    infos = inspect_run(args.output_dir, verify=args.verify)
    print(format_inspection(infos))
    if args.verify and any(i.complete and i.problem is not None for i in infos):
        return 1
    return 0

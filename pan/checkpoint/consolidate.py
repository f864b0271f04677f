"""A checkpoint's consolidated .safetensors weights (`pan export`, pan/export.py) and `pan inspect`
(a run's list).

Both run on one process, without a process group: DCP reads every shard of the folder into full
tensors, whatever world size wrote it.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

import torch
from safetensors.torch import save_file

from pan.checkpoint import checksums, layout, reader
from pan.config.arguments import ValueType, input_folder


def consolidated_weights(dcp_dir: Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP folder, unsharded, on CPU (optionally cast to `dtype`), read by this
    process alone: no collective, so with a process group each rank may call it or not (a frozen
    VAE read from a causal_vae checkpoint, `pan sample`)."""
    import torch.distributed.checkpoint as dcp

    state = {key: torch.empty(size, dtype=stored) for key, (size, stored) in layout.dcp_tensor_shapes(dcp_dir).items()}
    with warnings.catch_warnings():  # "torch.distributed is disabled ...": reading alone is the point here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(state, storage_reader=reader.DirectReader(str(dcp_dir)), no_dist=True)
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


# The metadata key of an exported file holding what sampling it needs: the run's config without
# the paths only training reads, as YAML (pan/export.py writes it, `pan sample` reads it).
CONFIG_METADATA_KEY = "pan_config"


def export_checkpoint(ckpt_dir: str | Path, out_path: str | Path, *, ema: bool = False,
                      dtype: torch.dtype | None = None, part: str | None = None,
                      metadata: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """Write one part's weights of `ckpt_dir` (a checkpoint-N/, or one DCP folder of it) as one
    .safetensors file that `safetensors.torch.load_file` and the warm start read.

    `part` names the part (default: the main one, e.g. the transformer); `ema=True` exports its EMA
    weights instead (the checkpoint must hold them). A LoRA part's checkpoint holds its adapters
    only and is refused (`pan export --merge`, pan/export.py, writes its merged model). `metadata`:
    more of the file's metadata (the run's config). Returns the tensors.
    """
    ckpt_dir, out_path = Path(ckpt_dir), Path(out_path)
    if (ckpt_dir / layout.DCP_METADATA).is_file():
        if ema or part:
            raise ValueError(f"{ckpt_dir} is a single DCP folder; pass its checkpoint-N/ for --ema "
                             "or --part")
        part, source = ckpt_dir.name, ckpt_dir
    else:
        part, source = part_source(ckpt_dir, part, ema)
    if layout.is_lora_checkpoint(ckpt_dir, part):
        raise ValueError(f"{ckpt_dir} is a LoRA checkpoint: its {part} weights are the adapters only, "
                         "not a model. Export the base with the adapters merged in (--merge), or the "
                         "adapters as peft loads them (--format peft --out FOLDER).")
    weights = consolidated_weights(source, dtype)
    write_weights(weights, out_path, {**(metadata or {}), "source": str(source), "part": part})
    return weights


def write_weights(weights: dict[str, torch.Tensor], out_path: Path, metadata: dict[str, str]) -> None:
    """One .safetensors file of whole tensors, atomically, with the mode of any new file."""
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + ".tmp")
    save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp),
              metadata={**metadata, "format": "pan-weights"})
    tmp.chmod(0o666 & ~current_umask())  # safetensors writes 0600: honour the umask like any file
    tmp.replace(out_path)  # a killed export never leaves a half-written file under the real name


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def honour_umask(path: Path) -> None:
    """Give the safetensors files written at `path` (a file, or every file of a folder) the mode of
    any new file (0666 less the umask): safetensors creates them 0600."""
    for f in [path] if path.is_file() else path.rglob("*.safetensors"):
        f.chmod(0o666 & ~current_umask())


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
                info.problem = checksums.verify_checksums(info.path)
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pan inspect",
                                     description="List a run's checkpoints: step, completeness, size.")
    parser.add_argument("output_dir", type=ValueType("folder", Path, "folder"),  # judged by main_inspect
                        help="the run's output_dir (or one checkpoint-N/ folder)")
    parser.add_argument("--verify", action="store_true",
                        help="also read every file of each complete checkpoint and compare its CRC32 "
                             "with the one recorded when it was saved (exit 1 if any differs)")
    return parser


def main_inspect(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        input_folder("a run's output_dir or one of its checkpoint-N/ folders").convert(str(args.output_dir))
    except ValueError as e:
        print(f"pan inspect: output_dir {e}", file=sys.stderr)
        return 2
    infos = inspect_run(args.output_dir, verify=args.verify)
    print(format_inspection(infos))
    if args.verify and any(i.complete and i.problem is not None for i in infos):
        return 1
    return 0

"""The on-disk format of one checkpoint folder: its names, and the listing, verification and
inventory of a run's checkpoints.

    output_dir/checkpoint-N/
        transformer/            DCP shards of the model state (`__<rank>_<i>.distcp` + `.metadata`)
        optimizer/              DCP shards of the optimizer state (keyed by parameter name)
        ema/                    DCP shards of the EMA weights (only when the run keeps an EMA)
        <part>/, <part>_optimizer/, <part>_ema/   the same for every further part of the recipe
                                (e.g. discriminator/); the main part of a DiT recipe is `transformer`
        dataloader/<s>.json     one data cursor per data shard (data-parallel rank, or rank x
                                accumulation + micro-batch for ShardedLoader recipes)
        training_state.pt       step, LR schedulers of every part, train state, every rank's RNG states
        meta.json               parts, world_size, cp_size, dp_size, step, pan/torch versions
        COMPLETE.json           written last: the size and CRC32 of every file above

A checkpoint is written under `checkpoint-N.tmp/` and renamed to `checkpoint-N/` only after every file
(marker last) is fsynced, so a folder named `checkpoint-N` without its marker never exists unless
someone edited it by hand; such a folder, like a truncated file, fails `verify_checkpoint`. A file
whose bytes changed without changing its size (a flipped byte, a zeroed block) fails
`verify_checksums`, which reads every file once.

Beside it: durable writes in `pan.checkpoint.durable`, the CRC32 checksums (`verify_checksums`
among them) in `pan.checkpoint.checksums`, and DCP's shard reading in `pan.checkpoint.reader`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

TRANSFORMER = "transformer"
OPTIMIZER = "optimizer"
EMA = "ema"
DATALOADER = "dataloader"
TRAINING_STATE = "training_state.pt"
META = "meta.json"
MARKER = "COMPLETE.json"
DCP_METADATA = ".metadata"
FORMAT_VERSION = 1

# The parts of checkpoints written before parts had names: one transformer.
DEFAULT_PARTS = (TRANSFORMER,)


def part_dirs(part: str) -> tuple[str, str, str]:
    """(model, optimizer, EMA) folder names of a part. The transformer keeps the names of Pan's
    layout (`transformer/`, `optimizer/`, `ema/`); any other part is prefixed by its name."""
    if part == TRANSFORMER:
        return TRANSFORMER, OPTIMIZER, EMA
    return part, f"{part}_{OPTIMIZER}", f"{part}_{EMA}"


def saved_parts(path: Path) -> list[str]:
    """The parts a checkpoint holds, from its meta.json (older checkpoints: the transformer)."""
    return list(read_json(path / META).get("parts", DEFAULT_PARTS))


_NAME = re.compile(r"^checkpoint-(\d+)$")
_PARTIAL = re.compile(r"^checkpoint-(\d+)\.(tmp|old)$")


# --- naming and listing ------------------------------------------------------------------------------

def checkpoint_name(step: int) -> str:
    return f"checkpoint-{step}"


def step_of(path: Path) -> int | None:
    """N of a `checkpoint-N` folder name, None for any other name."""
    m = _NAME.match(path.name)
    return int(m.group(1)) if m else None


def partial_dirs(output_dir: Path) -> list[Path]:
    """Leftovers of interrupted saves (`checkpoint-N.tmp`) and replacements (`checkpoint-N.old`)."""
    if not output_dir.is_dir():
        return []
    return sorted(p for p in output_dir.iterdir() if p.is_dir() and _PARTIAL.match(p.name))


def checkpoint_dirs(output_dir: Path) -> list[Path]:
    """Every `checkpoint-N/` folder of a run (complete or not), oldest step first."""
    if not output_dir.is_dir():
        return []
    found = [p for p in output_dir.iterdir() if p.is_dir() and step_of(p) is not None]
    return sorted(found, key=step_of)


def has_marker(path: Path) -> bool:
    return (path / MARKER).is_file()


def complete_checkpoints(output_dir: Path) -> list[Path]:
    """`checkpoint-N/` folders whose completion marker exists, oldest first."""
    return [p for p in checkpoint_dirs(output_dir) if has_marker(p)]


# --- verification ---------------------------------------------------------------------------------

def read_json(path: Path):
    with open(path) as f:
        return json.load(f)


def dcp_metadata(dcp_dir: Path) -> Metadata:
    """The `.metadata` of a DCP folder (raises if missing or unreadable)."""
    return FileSystemReader(str(dcp_dir)).read_metadata()


def dcp_tensor_shapes(dcp_dir: Path) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Full (unsharded) shape and dtype of every tensor stored in a DCP folder."""
    meta = dcp_metadata(dcp_dir)
    return {key: (item.size, item.properties.dtype) for key, item in meta.state_dict_metadata.items()
            if isinstance(item, TensorStorageMetadata)}


def _check_dcp_files(dcp_dir: Path, meta: Metadata) -> None:
    """Every byte range the metadata points at lies inside an existing shard file."""
    ends: dict[str, int] = {}
    for info in (meta.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for rel, end in ends.items():
        f = dcp_dir / rel
        if not f.is_file():
            raise ValueError(f"{f.relative_to(dcp_dir.parent)} is missing")
        if f.stat().st_size < end:
            raise ValueError(f"{f.relative_to(dcp_dir.parent)} is truncated ({f.stat().st_size} bytes, "
                             f"the metadata needs {end})")


def verify_checkpoint(path: Path) -> str | None:
    """What is wrong with a checkpoint folder, or None when every part of it is readable.

    Cheap enough to run on every resume: it stats files and parses the small ones (marker, meta,
    cursors, DCP metadata); it does not read the tensor shards, which DCP's own load checks.
    """
    try:
        if not path.is_dir():
            return "the folder does not exist"
        if not has_marker(path):
            return f"no {MARKER} (the save did not finish)"
        marker = read_json(path / MARKER)
        for rel, size in marker["files"].items():
            f = path / rel
            if not f.is_file():
                return f"{rel} is missing"
            if f.stat().st_size != size:
                return f"{rel} has {f.stat().st_size} bytes, {size} when it was saved (truncated?)"
        for cursor in sorted((path / DATALOADER).glob("*.json")):
            read_json(cursor)
        for part in saved_parts(path):
            model, optimizer, ema = part_dirs(part)
            for name in (model, optimizer, ema):
                if name == ema and not (path / ema).exists():
                    continue
                dcp_dir = path / name
                if not (dcp_dir / DCP_METADATA).is_file():
                    return f"{name}/{DCP_METADATA} is missing"
                _check_dcp_files(dcp_dir, dcp_metadata(dcp_dir))
        if not (path / TRAINING_STATE).is_file():
            return f"{TRAINING_STATE} is missing"
    except Exception as e:  # any parse error means "unreadable"; say which file and why
        return f"{type(e).__name__}: {e}"
    return None


# --- inventory --------------------------------------------------------------------------------------

@dataclass
class CheckpointInfo:
    path: Path
    step: int
    complete: bool
    size_bytes: int
    problem: str | None     # None when readable
    parts: list[str] | None = None   # the trained parts it holds (None: unreadable meta.json)
    verified: bool = False  # its files' CRC32s were read and match the recorded ones


def folder_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def describe(path: Path) -> CheckpointInfo:
    problem = verify_checkpoint(path)
    step = step_of(path)
    if step is None:
        m = _PARTIAL.match(path.name)
        step = int(m.group(1)) if m else -1
    try:
        parts = saved_parts(path)
    except Exception:
        parts = None
    return CheckpointInfo(path, step, has_marker(path) and _NAME.match(path.name) is not None,
                          folder_size(path), problem, parts)


# A LoRA run's checkpoint (pan/lora/adapters.py): meta.json records each LoRA part's reference.

def checkpoint_folder(path: Path) -> tuple[Path, str | None, bool | None]:
    """(checkpoint-N/, part, ema) of a checkpoint-N/ folder or one of its DCP folders (then the part
    and whether it is the EMA are those of the folder; None: not said by the path)."""
    path = Path(path)
    if (path / DCP_METADATA).is_file() and (path.parent / META).is_file():
        for part in saved_parts(path.parent):
            model_dir, _, ema_dir = part_dirs(part)
            if path.name in (model_dir, ema_dir):
                return path.parent, part, path.name == ema_dir
    return path, None, None


def lora_reference(ckpt_dir: Path, part: str | None = None) -> tuple[str, dict | None]:
    """(part, its LoRA reference from meta.json, or None for a fully trained part) of a
    checkpoint-N/ folder (or one of its DCP folders); `part` None: the main (first) part."""
    ckpt_dir, own_part, _ = checkpoint_folder(ckpt_dir)
    meta_path = ckpt_dir / META
    if not meta_path.is_file():
        return part or own_part or TRANSFORMER, None
    meta = read_json(meta_path)
    part = part or own_part or meta.get("parts", [TRANSFORMER])[0]
    return part, meta.get("lora", {}).get(part)


def is_lora_checkpoint(path: Path, part: str | None = None) -> bool:
    return lora_reference(path, part)[1] is not None

"""The on-disk format of one checkpoint folder, and the file-level tools every checkpoint part uses.

    output_dir/checkpoint-N/
        transformer/            DCP shards of the model state (`__<rank>_<i>.distcp` + `.metadata`)
        optimizer/              DCP shards of the optimizer state (keyed by parameter name)
        ema/                    DCP shards of the EMA weights (only when the run keeps an EMA)
        dataloader/<dp>.json    one data cursor per data-parallel rank
        training_state.pt       step, LR schedulers, train state, every rank's RNG states
        meta.json               world_size, cp_size, dp_size, step, pan/torch versions
        COMPLETE.json           written last: the size of every file above

A checkpoint is written under `checkpoint-N.tmp/` and renamed to `checkpoint-N/` only after every file
(marker last) is fsynced, so a folder named `checkpoint-N` without its marker never exists unless
someone edited it by hand; such a folder, like a truncated file, fails `verify_checkpoint`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
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

_NAME = re.compile(r"^checkpoint-(\d+)$")
_PARTIAL = re.compile(r"^checkpoint-(\d+)\.(tmp|old)$")


# --- durable writes --------------------------------------------------------------------------------

def fsync_path(path: Path) -> None:
    """Flush a file, or a directory's entries, to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_durably(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_json_durably(path: Path, obj) -> None:
    write_bytes_durably(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under `root` (and root itself), deepest first."""
    for dirpath, _, filenames in os.walk(root, topdown=False):
        for name in filenames:
            fsync_path(Path(dirpath) / name)
        fsync_path(Path(dirpath))


def file_sizes(root: Path) -> dict[str, int]:
    """Relative path -> size of every file under `root` (the marker's manifest)."""
    return {p.relative_to(root).as_posix(): p.stat().st_size
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != MARKER}


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


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
        read_json(path / META)
        for cursor in sorted((path / DATALOADER).glob("*.json")):
            read_json(cursor)
        for part in (TRANSFORMER, OPTIMIZER, EMA):
            if part == EMA and not (path / EMA).exists():
                continue
            dcp_dir = path / part
            if not (dcp_dir / DCP_METADATA).is_file():
                return f"{part}/{DCP_METADATA} is missing"
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


def folder_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def describe(path: Path) -> CheckpointInfo:
    problem = verify_checkpoint(path)
    step = step_of(path)
    if step is None:
        m = _PARTIAL.match(path.name)
        step = int(m.group(1)) if m else -1
    return CheckpointInfo(path, step, has_marker(path) and _NAME.match(path.name) is not None,
                          folder_size(path), problem)

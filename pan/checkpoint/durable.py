"""Durable writes of a checkpoint's small files: written, flushed and fsynced, so a folder renamed
into place after `fsync_tree` holds every byte it lists (`pan.checkpoint.layout` has the format).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from pan.checkpoint.layout import MARKER


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


def json_bytes(obj) -> bytes:
    return (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode()


def write_json_durably(path: Path, obj) -> None:
    write_bytes_durably(path, json_bytes(obj))


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

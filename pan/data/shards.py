"""Shards of precomputed samples: uncompressed POSIX (ustar) tar files in WebDataset's layout, so
WebDataset, Energon, `tar -x` or any tar reader reads them as they are.

One member per sample, `<key>.safetensors` (key: the row, `00000012`), holding every tensor of the
sample (`latent` and `text`): a sample is always read whole, so one member is one read, and a
member's bytes are exactly the file the one-file-per-sample layout writes (extract a shard and you
have that layout). Beside each finished shard `<shard>.index.json` lists its members (key, offset
of the member's bytes, size): precompute builds the manifest from these and a rerun skips the rows
they hold, and the manifest's rows point at (shard, offset, size), so a reader fetches a sample with
one range read (a local pread, an S3 ranged GET) without reading any tar header.

A shard is written under a temporary name (or, for an object store, in a local temporary file) and
renamed (put) once closed, its index after it: a shard without an index is unfinished and ignored.
"""

from __future__ import annotations

import collections
import io
import json
import os
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pan.data.decode import SkipSample
from pan.data.storage import PathLike, Storage, is_url, join, local, storage

SHARD_SUFFIX = ".tar"
INDEX_SUFFIX = ".index.json"
MEMBER_SUFFIX = ".safetensors"
DEFAULT_SHARD_BYTES = 1 << 30   # ~1 GiB: few objects per TB, and a shard still re-writes quickly
BLOCK = 512                     # tar's record unit


@dataclass(frozen=True)
class Member:
    """Where one sample's bytes are: its shard (a name beside the index, or a full path / URL),
    the offset of its first byte in the shard, and its size."""
    shard: str
    offset: int
    size: int


def member_key(row: int) -> str:
    return f"{row:08d}"


def row_of(key: str) -> int | None:
    return int(key) if key.isdigit() else None


def parse_size(text: str) -> int:
    """"1GB", "256MB", "64KiB", "1000000" -> bytes (decimal units; KiB/MiB/GiB binary)."""
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
             "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
    raw = str(text).strip().lower().replace(" ", "")
    number = raw.rstrip("kmgtib")
    unit = raw[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in units or value <= 0:
        raise ValueError(f"{text!r} is not a size: give bytes or a number with KB, MB, GB (e.g. 1GB)")
    return int(value * units[unit])


# ----------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------

class ShardWriter:
    """Appends samples to the shards `<prefix>-NNNNNN.tar` of `folder` (a local folder or a URL),
    starting a new shard once the current one would pass `max_bytes`. NNNNNN continues after the
    shards of this prefix already there, so a rerun never writes over a finished shard."""

    def __init__(self, folder: PathLike, prefix: str, max_bytes: int, store: Storage | None = None):
        self.folder, self.prefix, self.max_bytes = folder, prefix, max_bytes
        self.store = store or storage()
        taken = [n for n in self.store.listdir(folder) if n.startswith(f"{prefix}-") and n.endswith(SHARD_SUFFIX)]
        self.next = 1 + max((int(n[len(prefix) + 1:-len(SHARD_SUFFIX)]) for n in taken
                             if n[len(prefix) + 1:-len(SHARD_SUFFIX)].isdigit()), default=-1)
        self.tar: tarfile.TarFile | None = None
        self.tmp: Path | None = None
        self.members: list[tuple[str, int, int]] = []
        self.finished: list[PathLike] = []

    def add(self, key: str, data: bytes) -> None:
        """One sample's member `<key>.safetensors` holding `data` (safetensors bytes)."""
        if self.tar is not None and self.tar.offset + BLOCK + _padded(len(data)) > self.max_bytes:
            self.close()
        if self.tar is None:
            self._open()
        info = tarfile.TarInfo(key + MEMBER_SUFFIX)
        info.size, info.mode, info.mtime = len(data), 0o644, 0  # mtime 0: shards are reproducible
        self.tar.addfile(info, io.BytesIO(data))
        # addfile leaves `offset` after the member's padded bytes: the bytes start that much before
        self.members.append((key, self.tar.offset - _padded(len(data)), len(data)))

    def close(self) -> None:
        """Finish the current shard (its end-of-archive blocks), move it into place, then its index."""
        if self.tar is None:
            return
        self.tar.close()
        name = f"{self.prefix}-{self.next:06d}{SHARD_SUFFIX}"
        self.store.put_file(self.tmp, join(self.folder, name))
        index = {"shard": name, "members": [list(m) for m in self.members]}
        self.store.write_text(join(self.folder, name[:-len(SHARD_SUFFIX)] + INDEX_SUFFIX),
                              json.dumps(index, separators=(",", ":")) + "\n")
        self.finished.append(join(self.folder, name))
        self.tmp.unlink(missing_ok=True)
        self.tar, self.tmp, self.members = None, None, []
        self.next += 1

    def _open(self) -> None:
        if is_url(self.folder):  # staged on local disk, put whole when finished
            fd, tmp = tempfile.mkstemp(prefix=f".{self.prefix}-", suffix=SHARD_SUFFIX)
            os.close(fd)
        else:
            local(self.folder).mkdir(parents=True, exist_ok=True)
            tmp = local(self.folder) / f".{self.prefix}-{self.next:06d}{SHARD_SUFFIX}.tmp-{os.getpid()}"
        self.tmp = Path(tmp)
        self.tar = tarfile.open(self.tmp, "w", format=tarfile.USTAR_FORMAT)


def _padded(size: int) -> int:
    return -(-size // BLOCK) * BLOCK


def read_indexes(folder: PathLike, store: Storage | None = None) -> dict[int, Member]:
    """Row -> Member of every finished shard in `folder` (shard names as they are in the folder)."""
    store = store or storage()
    rows: dict[int, Member] = {}
    for name in store.listdir(folder):
        if not name.endswith(INDEX_SUFFIX):
            continue
        index = json.loads(store.read_text(join(folder, name)))
        for key, offset, size in index["members"]:
            row = row_of(key)
            if row is not None:
                rows[row] = Member(index["shard"], int(offset), int(size))
    return rows


# ----------------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------------

class ShardReader:
    """Reads one member with one range read. Local shards stay open (a bounded LRU of file
    descriptors, read with pread, which moves no shared file position); a remote member is read
    with one ranged GET (through the storage's retries) and kept in the local cache, so that later
    epochs read it from local disk."""

    def __init__(self, max_open: int = 64, store: Storage | None = None):
        self.max_open, self.store = max_open, store
        self.handles: collections.OrderedDict[str, int] = collections.OrderedDict()
        self.pid = os.getpid()

    def read(self, shard: PathLike, offset: int, size: int) -> bytes:
        """The member's bytes; SkipSample (decode_error) when the shard ends before them."""
        if is_url(shard):
            data = (self.store or storage()).read_member(str(shard), offset, size)
        else:
            data = os.pread(self._handle(str(local(shard))), size, offset)
        if len(data) != size:
            raise SkipSample("decode_error", f"{shard} is truncated: {len(data)} of the {size} bytes at "
                                             f"offset {offset}")
        return data

    def _handle(self, path: str) -> int:
        if self.pid != os.getpid():  # a forked worker: start from its own (closed) copies
            self.close()
            self.pid = os.getpid()
        fd = self.handles.get(path)
        if fd is not None:
            self.handles.move_to_end(path)
            return fd
        fd = os.open(path, os.O_RDONLY)  # FileNotFoundError: the sample is skipped as missing_file
        self.handles[path] = fd
        while len(self.handles) > self.max_open:
            _, old = self.handles.popitem(last=False)
            os.close(old)
        return fd

    def close(self) -> None:
        while self.handles:
            os.close(self.handles.popitem()[1])


_reader: ShardReader | None = None


def shard_reader() -> ShardReader:
    """This process's reader (one bounded set of open shards per decoding process)."""
    global _reader
    if _reader is None:
        _reader = ShardReader()
    return _reader

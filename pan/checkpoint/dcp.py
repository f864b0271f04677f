"""The on-disk format of one checkpoint folder, and the file-level tools every checkpoint part uses.

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
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import re
import shutil
import sys
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType
from torch.futures import Future

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


# --- checksums ------------------------------------------------------------------------------------
# CRC32, the standard one of zlib and gzip: it catches every flipped byte and every burst of up to 32
# bits, and any other change but 1 in 2^32. Computed by ISA-L (`isal`) or zlib-ng (`zlib-ng`) when
# installed, which give the same values as the standard library's zlib 3-4x faster (8.9 and 7.5
# GB/s against 2.5 GB/s on one core of the development machine), so any of them verifies what
# another wrote. Large buffers are cut into chunks hashed by several threads (all three release
# the GIL) and the chunks' CRCs combined, as zlib's crc32_combine does, with cached GF(2) operators.


def _fastest_crc32():
    """(crc32 function, its module's name): the fastest one installed."""
    for module in ("isal.isal_zlib", "zlib_ng.zlib_ng"):
        try:
            return importlib.import_module(module).crc32, module.split(".")[0]
        except ImportError:
            continue
    return zlib.crc32, "zlib"


crc32, CRC32_LIBRARY = _fastest_crc32()
HASH_CHUNK = 4 << 20   # bytes per thread's share of a large buffer
HASH_THREADS = 4
_hash_pool = ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="pan-crc32")


def _gf2_times(matrix: list[int], vector: int) -> int:
    out, i = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


def _gf2_square(matrix: list[int]) -> list[int]:
    return [_gf2_times(matrix, row) for row in matrix]


def _zero_byte_operators(count: int = 64) -> list[list[int]]:
    """[k]: the operator that appends 2^k zero bytes to a CRC32 (zlib's reflected polynomial)."""
    one_bit = [0xEDB88320] + [1 << n for n in range(31)]
    op = _gf2_square(_gf2_square(_gf2_square(one_bit)))  # 8 zero bits
    ops = [op]
    for _ in range(count - 1):
        ops.append(_gf2_square(ops[-1]))
    return ops


_ZERO_BYTES = _zero_byte_operators()


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC32 of A + B from crc1 = CRC32(A), crc2 = CRC32(B) and len2 = len(B)."""
    k = 0
    while len2:
        if len2 & 1:
            crc1 = _gf2_times(_ZERO_BYTES[k], crc1)
        len2 >>= 1
        k += 1
    return crc1 ^ crc2


def crc32_parallel(data, crc: int = 0) -> int:
    """crc32(data, crc), computed in HASH_CHUNK pieces by the hashing threads."""
    view = memoryview(data).cast("B") if not isinstance(data, memoryview) else data
    if len(view) <= HASH_CHUNK:
        return crc32(view, crc)
    pieces = [view[i:i + HASH_CHUNK] for i in range(0, len(view), HASH_CHUNK)]
    for piece, part in zip(pieces, _hash_pool.map(crc32, pieces)):
        crc = crc32_combine(crc, part, len(piece))
    return crc


def crc32_of_file(path: Path, block: int = 8 << 20) -> int:
    """CRC32 of a whole file: blocks read in order, hashed by the hashing threads meanwhile."""
    crc, pending = 0, []
    with open(path, "rb", buffering=0) as f:
        while True:
            buffer = bytearray(block)
            n = f.readinto(buffer)
            if n:
                piece = memoryview(buffer)[:n]
                pending.append((_hash_pool.submit(crc32, piece), n))
            while pending and (len(pending) >= HASH_THREADS or not n):
                future, length = pending.pop(0)
                crc = crc32_combine(crc, future.result(), length)
            if not n:
                return crc


_writer_pool = ThreadPoolExecutor(2, thread_name_prefix="pan-crc32-write")  # runs crc32_parallel


class _ChecksummedStream(io.RawIOBase):
    """A file being written, whose CRC32 is computed from the bytes on their way in (no re-read).

    A large write is hashed by the hashing threads while the same bytes are copied into the file, and
    both are done before write() returns: the caller may free its buffer right after (torch.save
    hands over views of memory it owns, and DCP's tensors can be temporaries).
    """

    def __init__(self, raw):
        self.raw, self.crc = raw, 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data)
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")
        if len(view) <= HASH_CHUNK:
            self.crc = crc32(view, self.crc)
            return self.raw.write(view)
        crc = _writer_pool.submit(crc32_parallel, view, self.crc)
        written = self.raw.write(view)
        self.crc = crc.result()
        return written

    def tell(self) -> int:
        return self.raw.tell()

    def fileno(self) -> int:
        return self.raw.fileno()

    def flush(self) -> None:
        if not self.raw.closed:
            self.raw.flush()

    def close(self) -> None:
        self.raw.close()
        super().close()


class _ChecksummingFileSystem(FileSystem):
    """DCP's file system, recording the CRC32 of every file it writes in `sums` (path -> crc)."""

    def __init__(self, sums: dict[str, int]):
        self.sums = sums

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as raw:
            stream = _ChecksummedStream(raw)
            yield stream
        self.sums[str(path)] = stream.crc

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)  # DCP writes .metadata as a .tmp first
        if str(path) in self.sums:
            self.sums[str(new_path)] = self.sums.pop(str(path))


def checksumming_writer(path: Path, sums: dict[str, int]) -> FileSystemWriter:
    """DCP's file writer for `path` that records the CRC32 of each file it writes into `sums`
    (absolute path -> crc) as the bytes are written."""
    writer = FileSystemWriter(str(path))
    writer.fs = _ChecksummingFileSystem(sums)
    return writer


def verify_checksums(path: Path, names: list[str] | None = None) -> str | None:
    """The first file of a checkpoint (of `names`, default all) whose CRC32 is not the one its
    COMPLETE.json records, as a reason; None when all match, or when the marker records none (a
    checkpoint written before checksums, or with save_checksums off)."""
    try:
        recorded = read_json(path / MARKER).get("crc32")
        if recorded is None:
            return None
        for rel in (names if names is not None else sorted(recorded)):
            actual = crc32_of_file(path / rel)
            if f"{actual:08x}" != recorded[rel]:
                return (f"{rel} has changed since it was saved (crc32 {actual:08x}, {recorded[rel]} when "
                        f"saved)")
    except Exception as e:  # noqa: BLE001 - a missing or unreadable file fails the check too
        return f"{type(e).__name__}: {e}"
    return None


def checksummed_files(path: Path) -> list[str]:
    """The files a checkpoint's marker has checksums of, largest first (for sharing them out)."""
    marker = read_json(path / MARKER)
    return sorted(marker.get("crc32", {}), key=lambda rel: -marker["files"].get(rel, 0))


# --- reading shards ---------------------------------------------------------------------------------

class DirectReader(FileSystemReader):
    """DCP's file reader, reading each stored tensor straight into the tensor it restores.

    DCP's own reader `torch.load`s every item from a view of the shard file into fresh memory and
    then copies it into place: on this project's CPU machine that ran at about 40% of the disk's
    sequential read speed, mostly page faults of the fresh memory and the extra copy. Here the
    small head and tail of each item's `torch.save` archive are parsed (on the meta device) for the
    tensor's layout and the position of its bytes, which are then read from the file directly into
    the destination tensor. Items that cannot take that path (a GPU or non-contiguous destination,
    a slice of a stored chunk, an unusual archive) are read whole and copied.
    """

    def __init__(self, path, threads: int = 4):
        super().__init__(path)
        self.threads = threads

    def read_data(self, plan, planner) -> Future:
        if any(self.storage_data[i.storage_index].transform_descriptors for i in plan.items):
            return super().read_data(plan, planner)  # stream transforms (compression...): DCP's path
        items = sorted(plan.items, key=lambda i: (self.storage_data[i.storage_index].relative_path,
                                                  self.storage_data[i.storage_index].offset))
        paths = {self.storage_data[i.storage_index].relative_path for i in items}
        handles = {rel: open(Path(self.path) / rel, "rb", buffering=0) for rel in paths}
        try:
            # The planner is called from this thread only; the reads (which release the GIL) run
            # `threads` at a time, keeping several requests in flight to the disk.
            targets = [None if i.type == LoadItemType.BYTE_IO else planner.resolve_tensor(i).detach()
                       for i in items]
            with ThreadPoolExecutor(self.threads) as pool:
                loaded = list(pool.map(self._read_item, [handles[self.storage_data[i.storage_index].relative_path]
                                                         for i in items],
                                       [self.storage_data[i.storage_index] for i in items], items, targets))
            for item, target, data in zip(items, targets, loaded):
                if item.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(item, io.BytesIO(data))
                else:
                    planner.commit_tensor(item, target)
        finally:
            for handle in handles.values():
                handle.close()
        fut: Future = Future()
        fut.set_result(None)
        return fut

    @staticmethod
    def _read_item(f, info, item, target: torch.Tensor | None) -> bytes | None:
        """Fill `target` with the item's tensor (or return a bytes item's payload)."""
        if item.type == LoadItemType.BYTE_IO:
            return _pread(f, info.offset, info.length)
        if not _read_into(f, info, item, target):
            stored = torch.load(io.BytesIO(_pread(f, info.offset, info.length)), map_location="cpu",
                                weights_only=True)
            tensor = narrow_tensor_by_index(stored, item.storage_offsets, item.lengths)
            if target.size() != tensor.size():
                raise ValueError(f"{item.storage_index.fqn}: stored {tuple(tensor.size())}, "
                                 f"expected {tuple(target.size())}")
            target.copy_(tensor)
        return None


_ARCHIVE_EDGE = 8 << 10  # a torch.save archive keeps its pickle and zip directory in its first/last KiBs


def _read_into(f, info, item, target: torch.Tensor) -> bool:
    """Read the item's tensor bytes straight into `target` when the layouts allow; say if it did."""
    if target.device.type != "cpu" or not target.is_contiguous() or target.numel() == 0:
        return False
    stored = _stored_layout(f, info)
    if stored is None:
        return False
    meta, data_offset = stored
    whole = all(o == 0 for o in item.storage_offsets) and list(item.lengths) == list(meta.size())
    if not (whole and meta.is_contiguous() and meta.storage_offset() == 0 and meta.dtype == target.dtype
            and meta.size() == target.size()):
        return False
    dest = memoryview(target.reshape(-1).view(torch.uint8).numpy())
    got = os.preadv(f.fileno(), [dest], info.offset + data_offset)
    while got < len(dest):  # short reads are legal; finish them
        more = os.preadv(f.fileno(), [dest[got:]], info.offset + data_offset + got)
        if more == 0:
            raise EOFError(f"{info.relative_path} ends inside {item.storage_index.fqn}")
        got += more
    return True


def _stored_layout(f, info) -> tuple[torch.Tensor, int] | None:
    """(meta tensor with the stored layout, offset of its bytes in the item), or None if unusual."""
    if info.length <= 2 * _ARCHIVE_EDGE or sys.byteorder != "little":
        return None
    head = _pread(f, info.offset, _ARCHIVE_EDGE)
    tail = _pread(f, info.offset + info.length - _ARCHIVE_EDGE, _ARCHIVE_EDGE)
    try:
        meta = torch.load(_EdgesOnly(head, tail, info.length), map_location="meta", weights_only=True)
        offset = meta.untyped_storage()._checkpoint_offset
    except (_OutsideEdges, AttributeError):
        return None
    return (meta, offset) if isinstance(meta, torch.Tensor) and isinstance(offset, int) else None


class _OutsideEdges(Exception):
    pass


class _EdgesOnly(io.RawIOBase):
    """A read-only file of `length` bytes of which only the head and tail are known."""

    def __init__(self, head: bytes, tail: bytes, length: int):
        self.head, self.tail, self.length, self.pos = head, tail, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset + (0, self.pos, self.length)[whence]
        return self.pos

    def readinto(self, buffer) -> int:
        n = min(len(buffer), self.length - self.pos)
        tail_start = self.length - len(self.tail)
        if self.pos + n <= len(self.head):
            buffer[:n] = self.head[self.pos:self.pos + n]
        elif self.pos >= tail_start:
            buffer[:n] = self.tail[self.pos - tail_start:self.pos - tail_start + n]
        else:
            raise _OutsideEdges
        self.pos += n
        return n


def _pread(f, offset: int, length: int) -> bytes:
    data = os.pread(f.fileno(), length, offset)
    if len(data) != length:
        raise EOFError(f"{f.name} ends before byte {offset + length}")
    return data


def load_dcp(state: dict, dcp_dir: Path) -> None:
    """DCP load of `state` (plain or DTensor values) from `dcp_dir`, in place, through
    DirectReader. Collective when a process group exists."""
    dcp.load(state, storage_reader=DirectReader(str(dcp_dir)), no_dist=not dist.is_initialized())


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

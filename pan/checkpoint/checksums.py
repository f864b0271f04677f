"""The CRC32 checksums of a checkpoint's files: computed as the bytes are written (DCP's writer and
the checkpoint's own files), recorded in its COMPLETE.json, and verified by reading every file once
(`verify_checksums`; `pan.checkpoint.layout` has the format).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from pan.checkpoint.layout import MARKER, read_json

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

"""The row index: a manifest (video CSV, JSONL annotations, Parquet table) or an image tar as a
memory-mapped Arrow file, read by row number.

Every process of a run (each rank and each of its decoding workers) needs any row by its number:
that is what makes seeded shuffles, disjoint shares and exact resume possible. Parsing a manifest
into Python lists in every process costs ~550 MB and ~8 s per million rows per process; the index is
built once (streaming, in bounded memory) and then only mapped: rows are read where they lie, and the
processes of a node share its pages through the page cache.

Why Arrow IPC (the file format, uncompressed) and not Parquet: a Parquet file must be decoded (and
usually decompressed) into each reader's memory; an IPC file's buffers are the in-memory layout, so
`pyarrow.memory_map` serves a row without copying the file.

Cells stay text, as in the manifest, and are parsed when their sample is loaded: a malformed value
or line spoils one sample (skipped as bad data), not the run. An index is keyed by its manifest's
size, modification time and first and last bytes (`manifest_stamp`; a manifest at a URL: its size and
ETag, its index a local file built from ranged reads), rebuilt when they change, and written to a
temporary file renamed into place, so that a process never reads half an index.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import contextlib
import csv
import fcntl
import hashlib
import io
import logging
import os
import posixpath
import socket
import sys
import tarfile
import time
from pathlib import Path
from typing import BinaryIO, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from pan.config.arguments import ValueType, input_file, output_folder
from pan.data.storage import PathLike, StorageError, is_url, storage, suffix

logger = logging.getLogger(__name__)

INDEX_VERSION = 1
BATCH_ROWS = 1 << 16       # rows per record batch of an index (what a builder holds at once)
READ_BYTES = 1 << 22       # bytes a builder reads at a time
STAMP_BYTES = 1 << 16      # bytes of each end of a manifest that its stamp hashes
INDEX_DIR_ENV = "PAN_INDEX_DIR"   # where indexes live instead of beside their manifests
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")
CAPTION_EXTENSIONS = ("txt", "json")
KINDS = ("table", "lines", "tar")   # a CSV or Parquet table; JSONL lines; a tar's members


class SourceError(ValueError):
    """A data file that cannot be used at all (as opposed to one bad sample inside it)."""


def open_manifest(path: PathLike) -> BinaryIO:
    """The one place a manifest's (or tar's) bytes are opened for indexing: a local file, or a URL
    read in ranged GETs with retries (streamed in bounded memory, never kept whole)."""
    return storage().open_read(path, READ_BYTES)


def manifest_stamp(path: PathLike, kind: str) -> str:
    """What an index is keyed by: a local manifest's size, modification time and a hash of its first
    and last STAMP_BYTES (a rewrite of the same size within one tick of the file clock still shows);
    a remote one's URL, size and version (its ETag, else its modification time), as its store says."""
    if is_url(path):
        st = storage().stat(path)
        return f"v{INDEX_VERSION}:{kind}:{path}:{st.size}:{st.etag or st.mtime}"
    st = os.stat(path)
    digest = hashlib.blake2b(digest_size=8)
    with open_manifest(path) as f:
        digest.update(f.read(STAMP_BYTES))
        if st.st_size > STAMP_BYTES:
            f.seek(max(STAMP_BYTES, st.st_size - STAMP_BYTES))
            digest.update(f.read())
    return f"v{INDEX_VERSION}:{kind}:{st.st_size}:{st.st_mtime_ns}:{digest.hexdigest()}"


# ----------------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------------

class RowIndex:
    """An index file: `len`, and a row's cells (`cells`) or bytes (`blob`) by its number.

    The file is memory-mapped to learn where each buffer lies (and for whole-column sums); a row's
    bytes are then read with pread at those places. Reading through the mapping would map the page
    cache's folios (up to 2 MB each on recent kernels) into the reader: a few rows would show as
    megabytes of each worker's resident memory, and a long run as the whole index in every process.
    Read with pread, the rows stay in the page cache, shared by every process and charged to none."""

    def __init__(self, path: Path):
        self.path = Path(path)
        mapped = pa.memory_map(str(self.path), "r")
        reader = pa.ipc.open_file(mapped)
        self.meta = {k.decode(): v.decode() for k, v in (reader.schema.metadata or {}).items()}
        self.table = reader.read_all()   # zero-copy: the buffers point into the mapping
        mapped.seek(0)
        base = mapped.read_buffer(1).address   # a mapped file's buffers are views: this is its start
        self._fd = os.open(self.path, os.O_RDONLY)
        self._starts = [0]
        self._places: dict[str, list[tuple[int, ...]]] = {}
        for chunk in self.table.column(0).chunks:
            self._starts.append(self._starts[-1] + len(chunk))
        for name in self.table.column_names:
            self._places[name] = [tuple(b.address - base if b is not None else -1 for b in chunk.buffers())
                                  for chunk in self.table.column(name).chunks]

    def __len__(self) -> int:
        return self.table.num_rows

    def __del__(self):
        with contextlib.suppress(AttributeError, OSError):
            os.close(self._fd)

    def _where(self, row: int, column: str) -> tuple[tuple[int, ...], int]:
        if not 0 <= row < self.table.num_rows:
            raise IndexError(f"row {row} of an index of {self.table.num_rows}")
        chunk = bisect.bisect_right(self._starts, row) - 1
        return self._places[column][chunk], row - self._starts[chunk]

    def _ints(self, at: int, count: int) -> np.ndarray:
        return np.frombuffer(os.pread(self._fd, 4 * count, at), dtype=np.int32)

    def blob(self, row: int, column: str) -> bytes:
        """Row `row` of a binary (or text, as bytes) column."""
        (_, offsets, data), j = self._where(row, column)
        start, end = self._ints(offsets + 4 * j, 2)
        return os.pread(self._fd, int(end - start), data + int(start))

    def integer(self, row: int, column: str) -> int:
        """Row `row` of an int64 column."""
        (_, data), j = self._where(row, column)
        return int.from_bytes(os.pread(self._fd, 8, data + 8 * j), "little", signed=True)

    def cells(self, row: int, column: str) -> list[str]:
        """Row `row` of a list-of-text column."""
        (_, lists, _, offsets, data), j = self._where(row, column)
        first, last = (int(v) for v in self._ints(lists + 4 * j, 2))
        bounds = self._ints(offsets + 4 * first, last - first + 1)
        text = os.pread(self._fd, int(bounds[-1] - bounds[0]), data + int(bounds[0]))
        cuts = (bounds - bounds[0]).tolist()
        return [text[a:b].decode() for a, b in zip(cuts, cuts[1:])]

    def count_true(self, column: str) -> int:
        return int(pc.sum(self.table.column(column)).as_py() or 0)

    def __reduce__(self):  # a spawned process maps the file again instead of pickling the rows
        return RowIndex, (self.path,)


def index_candidates(manifest: PathLike, folder: Path | None = None) -> list[Path]:
    """Where the index of `manifest` may live, in order: `folder` (or $PAN_INDEX_DIR) if given, else
    beside a local manifest, then the user's cache folder (for read-only data folders, and for every
    manifest at a URL: its index is a local file)."""
    folder = folder or (Path(os.environ[INDEX_DIR_ENV]) if os.environ.get(INDEX_DIR_ENV) else None)
    where = str(manifest) if is_url(manifest) else str(Path(manifest).resolve())
    tag = hashlib.blake2b(where.encode(), digest_size=6).hexdigest()
    name = f"{posixpath.basename(str(manifest))}.{tag}.index.arrow"
    if folder is not None:
        return [folder / name]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pan/index"
    if is_url(manifest):
        return [cache / name]
    return [manifest.with_name(manifest.name + ".index.arrow"), cache / name]


def stamp_of(index_path: Path) -> str | None:
    """The stamp an index file was built for (None: no readable index there)."""
    try:
        with pa.memory_map(str(index_path), "r") as source:
            metadata = pa.ipc.open_file(source).schema.metadata or {}
    except (OSError, pa.ArrowInvalid):
        return None
    return metadata.get(b"stamp", b"").decode() or None


def open_index(manifest: PathLike, kind: str, folder: Path | None = None) -> RowIndex:
    """The index of `manifest`: reused where a fresh one exists, else built (see `ensure_index`)."""
    return RowIndex(ensure_index(manifest if is_url(manifest) else Path(manifest), kind, folder))


def ensure_index(manifest: PathLike, kind: str, folder: Path | None = None) -> Path:
    """The path of a fresh index of `manifest`, building it if none is fresh.

    Safe when many processes start at once (all the ranks of a node, or of a job on one shared file
    system): a builder takes a lock beside the index (processes of a node then wait for the first
    and reuse its file) and writes a temporary file of its own, renamed into place, so that even
    where locks do not reach (across nodes on some file systems) every reader sees a whole file."""
    if kind not in KINDS:
        raise ValueError(f"index kind {kind!r} is not one of {KINDS}")
    stamp = manifest_stamp(manifest, kind)
    candidates = index_candidates(manifest, folder)
    for candidate in candidates:
        if stamp_of(candidate) == stamp:
            return candidate
    for candidate in candidates:
        if not _writable_folder(candidate.parent):
            continue
        with _build_lock(candidate):
            if stamp_of(candidate) != stamp:  # another process may have built it meanwhile
                write_index(manifest, kind, candidate, stamp)
        if is_url(manifest) and manifest_stamp(manifest, kind) != stamp:  # its reads may mix two versions
            raise SourceError(f"{manifest} changed while it was being indexed: start again once it stays put.")
        return candidate
    raise SourceError(f"cannot write an index of {manifest} in {', '.join(str(c.parent) for c in candidates)}: "
                      f"set {INDEX_DIR_ENV} to a writable folder.")


def _writable_folder(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(folder, os.W_OK)


@contextlib.contextmanager
def _build_lock(index_path: Path):
    """An exclusive lock for building `index_path` (none where the file system refuses locks: the
    rename keeps the file whole anyway). The lock file goes with the build."""
    lock = index_path.with_name(index_path.name + ".lock")
    try:
        fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o644)
    except OSError:
        yield
        return
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        with contextlib.suppress(OSError):
            lock.unlink()
        os.close(fd)


def write_index(manifest: PathLike, kind: str, dest: Path, stamp: str | None = None) -> int:
    """Build the index of `manifest` into `dest` (a temporary file renamed into place); its rows."""
    stamp = stamp or manifest_stamp(manifest, kind)
    schema, batches = BUILDERS[kind](manifest)
    tmp = dest.with_name(f".{dest.name}.{socket.gethostname()}.{os.getpid()}.tmp")
    rows = 0
    try:
        with pa.OSFile(str(tmp), "wb") as sink:
            schema = schema.with_metadata({**(schema.metadata or {}), b"stamp": stamp.encode()})
            with pa.ipc.new_file(sink, schema, options=pa.ipc.IpcWriteOptions(compression=None)) as writer:
                for batch in _rebatched(batches):
                    writer.write_batch(batch)
                    rows += batch.num_rows
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return rows


def _rebatched(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """Batches of BATCH_ROWS rows (the last one shorter) from pieces of any size."""
    pieces, held = [], 0
    for batch in batches:
        pieces.append(batch)
        held += batch.num_rows
        while held >= BATCH_ROWS:
            table = pa.Table.from_batches(pieces)
            yield from table.slice(0, BATCH_ROWS).combine_chunks().to_batches()
            rest = table.slice(BATCH_ROWS)
            pieces, held = rest.to_batches(), rest.num_rows
    if held:
        yield from pa.Table.from_batches(pieces).combine_chunks().to_batches()


# ----------------------------------------------------------------------------------------------
# Building: tables (CSV, Parquet)
# ----------------------------------------------------------------------------------------------

def table_schema(header: list[str]) -> pa.Schema:
    """A table index: one column, each row's cells as a list of text (row-major: reading a row
    touches three runs of bytes, not two per column; header names may repeat or be empty), the
    header as metadata."""
    return pa.schema([("cells", pa.list_(pa.string()))], metadata={b"header": "\x1f".join(header).encode()})


def columns_schema(width: int) -> pa.Schema:
    """What the table builders read and clean before `_row_major`: a text column per cell."""
    return pa.schema([(f"c{i}", pa.string()) for i in range(width)])


def header_of(index: RowIndex) -> list[str]:
    return index.meta["header"].split("\x1f")


def _row_major(batch: pa.RecordBatch, schema: pa.Schema) -> pa.RecordBatch:
    """A batch of text columns as one column of each row's cells."""
    rows, width = batch.num_rows, batch.num_columns
    flat = pa.concat_arrays(batch.columns)
    order = (np.arange(width)[None, :] * rows + np.arange(rows)[:, None]).ravel()
    offsets = pa.array(np.arange(0, rows * width + 1, width, dtype=np.int32))
    return pa.RecordBatch.from_arrays([pa.ListArray.from_arrays(offsets, pc.take(flat, pa.array(order)))],
                                      schema=schema)


def _csv_header(path: PathLike) -> list[str]:
    """The header row, read as Python's csv module reads it (utf-8, with or without a byte-order
    mark: Excel's "CSV UTF-8" starts with one)."""
    with io.TextIOWrapper(open_manifest(path), encoding="utf-8-sig", newline="") as f:
        try:
            return [h.strip() for h in next(csv.reader(f))]
        except StopIteration:
            raise SourceError(f"{path} is empty: a video CSV needs a header row.") from None
        except UnicodeDecodeError as e:
            raise SourceError(f"{path} is not UTF-8 text ({e}).") from None


def build_csv(path: PathLike) -> tuple[pa.Schema, Iterator[pa.RecordBatch]]:
    """A CSV's rows as text, read by pyarrow's streaming reader. A line pyarrow cannot take (more or
    fewer cells than the header) is parsed by Python's csv module, padded or cut to the header, and
    kept in its place: it is a bad sample when read, not a fatal error. Rows whose cells are all
    blank are not rows (as with the csv module)."""
    header = _csv_header(path)
    if not header:
        raise SourceError(f"{path} starts with an empty line: a video CSV needs a header row.")
    schema = table_schema(header)
    return schema, (_row_major(batch, schema) for batch in _csv_batches(path, columns_schema(len(header))))


def _csv_batches(path: PathLike, schema: pa.Schema) -> Iterator[pa.RecordBatch]:
    names = schema.names
    odd: collections.deque[tuple[int, str]] = collections.deque()  # (record number, text)

    def keep_odd(row) -> str:
        odd.append((row.number, row.text))
        return "skip"

    done = 0          # records placed so far (record 1 is the header)
    try:
        # One thread: the handler then sees a block's odd lines before its batch (and their numbers).
        reader = pacsv.open_csv(
            open_manifest(path),
            read_options=pacsv.ReadOptions(use_threads=False, block_size=READ_BYTES, column_names=names),
            parse_options=pacsv.ParseOptions(newlines_in_values=True, invalid_row_handler=keep_odd),
            convert_options=pacsv.ConvertOptions(column_types={n: pa.string() for n in names},
                                                 strings_can_be_null=False, quoted_strings_can_be_null=False))
        for batch in reader:
            pieces, done = _placed(batch, odd, done, len(names))
            yield from (_without_blank_rows(p) for p in pieces)
    except pa.ArrowInvalid as e:
        raise SourceError(f"{path} is not UTF-8 CSV text ({e}).") from None
    pieces, done = _placed(pa.RecordBatch.from_pylist([], schema=schema), odd, done, len(names), final=True)
    yield from (_without_blank_rows(p) for p in pieces)


def _placed(batch: pa.RecordBatch, odd: collections.deque, done: int, width: int,
            final: bool = False) -> tuple[list[pa.RecordBatch], int]:
    """The batch's rows with the odd lines that fall among (or right after) them, in file order, the
    header (record 1) left out; and the count of records placed."""
    pieces, taken = [], 0
    while True:
        if odd and (odd[0][0] <= done + 1 or (final and taken == batch.num_rows)):
            number, text = odd.popleft()
            if number != 1:
                pieces.append(_odd_row(text, width, batch.schema))
            done += 1
        elif taken < batch.num_rows:
            n = batch.num_rows - taken if not odd else min(batch.num_rows - taken, odd[0][0] - done - 1)
            start = 1 if done == 0 else 0   # the header, read as the first record
            pieces.append(batch.slice(taken + start, n - start))
            taken, done = taken + n, done + n
        else:
            return pieces, done


def _odd_row(text: str, width: int, schema: pa.Schema) -> pa.RecordBatch:
    try:
        cells = next(csv.reader([text]), [])
    except csv.Error:
        cells = [text]
    cells = (cells + [""] * width)[:width]
    return pa.RecordBatch.from_arrays([pa.array([c], pa.string()) for c in cells], schema=schema)


def _without_blank_rows(batch: pa.RecordBatch) -> pa.RecordBatch:
    if batch.num_rows == 0:
        return batch
    filled = None
    for column in batch.columns:
        some = pc.not_equal(pc.utf8_trim_whitespace(column), "")
        filled = some if filled is None else pc.or_(filled, some)
    return batch if pc.all(filled).as_py() else batch.filter(filled)


def build_parquet(path: PathLike) -> tuple[pa.Schema, Iterator[pa.RecordBatch]]:
    """A Parquet table's rows as text (a number is kept as its text and parsed when read, as a CSV
    cell is; a null is an empty cell)."""
    try:
        table = pq.ParquetFile(open_manifest(path))
    except (pa.ArrowInvalid, OSError) as e:
        raise SourceError(f"{path} is not a readable Parquet file ({e}).") from None
    header = [str(n).strip() for n in table.schema_arrow.names]
    schema, columns_of = table_schema(header), columns_schema(len(header))

    def batches():
        for batch in table.iter_batches(batch_size=BATCH_ROWS):
            columns = []
            for name, column in zip(header, batch.columns):
                try:
                    columns.append(pc.fill_null(pc.cast(column, pa.string()), ""))
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                    raise SourceError(f"{path}: column {name!r} is {column.type}, which has no text form; "
                                      "a manifest's columns are strings or numbers.") from None
            yield _row_major(pa.RecordBatch.from_arrays(columns, schema=columns_of), schema)
    return schema, batches()


# ----------------------------------------------------------------------------------------------
# Building: lines (JSONL)
# ----------------------------------------------------------------------------------------------

LINE_FLAGS = ("latent", "text_fea")  # keys whose presence in a row's text is kept per row


def build_lines(path: PathLike) -> tuple[pa.Schema, Iterator[pa.RecordBatch]]:
    """A JSONL file's non-blank lines as bytes (each parsed when its sample is loaded), with a flag
    per row for the keys of LINE_FLAGS its text names (a text search, as the recipes ask it)."""
    schema = pa.schema([("line", pa.binary())] + [(flag, pa.bool_()) for flag in LINE_FLAGS])

    needles = [f'"{flag}"'.encode() for flag in LINE_FLAGS]

    def batches():
        for lines in _line_chunks(path):
            yield pa.RecordBatch.from_arrays(
                [pa.array(lines, pa.binary())]
                + [pa.array([needle in line for line in lines], pa.bool_()) for needle in needles],
                schema=schema)
    return schema, batches()


def _line_chunks(path: PathLike) -> Iterator[list[bytes]]:
    """The file's stripped non-blank lines (split as bytes.splitlines does), a chunk at a time."""
    carry = b""
    with open_manifest(path) as f:
        while block := f.read(READ_BYTES):
            lines = (carry + block).splitlines(keepends=True)
            carry = lines.pop() if lines and not lines[-1].endswith((b"\n", b"\r")) else b""
            yield [s for s in (line.strip() for line in lines) if s]
    if carry.strip():
        yield [carry.strip()]


# ----------------------------------------------------------------------------------------------
# Building: image tars
# ----------------------------------------------------------------------------------------------

TAR_SCHEMA = pa.schema([("key", pa.string()), ("image_offset", pa.int64()), ("image_size", pa.int64()),
                        ("image_ext", pa.string()), ("caption_offset", pa.int64()),
                        ("caption_size", pa.int64()), ("caption_ext", pa.string())])


def split_key(member_name: str) -> tuple[str, str]:
    """webdataset convention: "dir/abc.seg.jpg" -> key "dir/abc", extension "seg.jpg"."""
    folder, _, base = member_name.rpartition("/")
    stem, dot, ext = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), ext.lower()


def build_tar(path: PathLike) -> tuple[pa.Schema, Iterator[pa.RecordBatch]]:
    """A webdataset tar's images, each with its caption member (headers only: no image is read).
    A tar that breaks off part-way keeps the images before the break (noted in the index)."""
    images: dict[str, tuple[int, int, str]] = {}
    captions: dict[str, tuple[int, int, str]] = {}
    damage = ""
    try:
        with open_manifest(path) as f, tarfile.open(fileobj=f, mode="r:") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                key, ext = split_key(member.name)
                if ext in IMAGE_EXTENSIONS:
                    images[key] = (member.offset_data, member.size, ext)
                elif ext in CAPTION_EXTENSIONS:
                    captions[key] = (member.offset_data, member.size, ext)
    except tarfile.TarError as e:
        if not images:
            raise SourceError(f"{path} is not a readable tar: {e}") from None
        damage = f"damaged after {len(images)} images ({e})"
    keys = list(images)
    columns = [keys, [images[k][0] for k in keys], [images[k][1] for k in keys], [images[k][2] for k in keys],
               [captions.get(k, (-1,))[0] for k in keys], [captions.get(k, (0, 0))[1] for k in keys],
               [captions.get(k, (0, 0, ""))[2] for k in keys]]
    schema = TAR_SCHEMA.with_metadata({b"damage": damage.encode()})
    batch = pa.RecordBatch.from_arrays([pa.array(c, f.type) for c, f in zip(columns, TAR_SCHEMA)], schema=schema)
    return schema, iter([batch])


BUILDERS = {"lines": build_lines, "tar": build_tar,
            "table": lambda path: (build_parquet if suffix(path) == ".parquet" else build_csv)(path)}


# ----------------------------------------------------------------------------------------------
# `pan data index`
# ----------------------------------------------------------------------------------------------

SUFFIX_KINDS = {".csv": "table", ".parquet": "table", ".jsonl": "lines", ".tar": "tar"}

DESCRIPTION = f"""Build the row index of each manifest (video CSV or Parquet table, JSONL annotation
file, webdataset image tar) ahead of a run. Training builds or reuses them by itself (keyed by each
manifest's size, modification time and first and last bytes), so this is for large sets: build once,
before a job of many ranks starts. Under torchrun the processes split the manifests (RANK,
WORLD_SIZE). An index lives beside its manifest (MANIFEST.index.arrow), else in the user's cache
folder (always for a manifest at a URL, s3://...: its index is a local file); with --out (or {INDEX_DIR_ENV}) in that folder, where training finds it when {INDEX_DIR_ENV}
names the same folder."""


def _known_suffix(path: PathLike) -> None:
    if suffix(path) not in SUFFIX_KINDS:
        raise ValueError(f"its name ends in {suffix(path) or 'no suffix'}, not {', '.join(SUFFIX_KINDS)}")


def manifest_argument() -> ValueType:
    """A local manifest (it must exist and have a known suffix), or a URL with a known suffix (its
    store is asked when it is indexed: a missing object is then one line and exit 2)."""
    what = "a manifest training reads (.csv, .parquet, .jsonl or .tar; a local path or a URL)"
    local = input_file(what, _known_suffix)

    def convert(text: str) -> PathLike:
        if not is_url(text):
            return local.convert(text)
        try:
            _known_suffix(text)
        except ValueError as e:
            raise ValueError(f"{text} cannot be read as {what}: {e}") from None
        return text
    return ValueType("file", convert, "file")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pan data index", description=DESCRIPTION)
    parser.add_argument("manifests", nargs="+", metavar="MANIFEST", type=manifest_argument(),
                        help="a .csv, .parquet, .jsonl or .tar file, local or at a URL (s3://...)")
    parser.add_argument("--out", type=output_folder("a folder for the indexes"), default=None, metavar="FOLDER",
                        help=f"write the indexes into FOLDER (default: ${INDEX_DIR_ENV}, else beside each manifest)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    for path in args.manifests[rank::world]:
        kind = SUFFIX_KINDS[suffix(path)]
        start = time.perf_counter()
        try:
            fresh = manifest_stamp(path, kind) in {stamp_of(c) for c in index_candidates(path, args.out)}
            built = ensure_index(path, kind, args.out)
        except (SourceError, StorageError, FileNotFoundError) as e:   # a remote manifest missing or unreachable
            print(f"pan data index: {e}", file=sys.stderr)
            return 2
        seconds = time.perf_counter() - start
        rows = len(RowIndex(built))
        how = "up to date" if fresh else f"built in {seconds:.1f} s, {rows / max(seconds, 1e-9):,.0f} rows/s"
        print(f"{path}: {rows:,} rows -> {built} ({how})")
    return 0

"""Data sources: the rows of video CSVs (or Parquet tables of the same columns) and of JSONL
annotation files, and the images inside webdataset tars, by index.

Each source is read through its row index (pan/data/index.py): a memory-mapped file built once per
manifest, so that any sample can be fetched by number without every process parsing the manifest:
that is what makes seeded shuffles, disjoint data-parallel shares and exact resume possible at any
size. Rows are kept as the file's text and parsed when the sample is loaded, so a malformed value or
line spoils one sample (skipped as bad data), not the run.
"""

from __future__ import annotations

import bisect
import csv
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pan.data.decode import SkipSample
from pan.data.index import (  # noqa: F401  (SourceError, split_key and the extensions: re-exported)
    CAPTION_EXTENSIONS,
    IMAGE_EXTENSIONS,
    RowIndex,
    SourceError,
    header_of,
    open_index,
    split_key,
)
from pan.data.storage import PathLike, is_url, join, parent, stem, storage

logger = logging.getLogger(__name__)

OPTIONAL_VIDEO_COLUMNS = ("fps", "num_frames", "width", "height", "start_time", "end_time")


class TableRows(Sequence):
    """The rows of a table index, each a list of its cells' text made when asked (none are kept)."""

    def __init__(self, index: RowIndex):
        self.index = index

    def __reduce__(self):  # a spawned worker maps the index again: no rows travel
        return TableRows, (self.index,)

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> list[str]:
        if not 0 <= i < len(self.index):
            raise IndexError(i)
        return self.index.cells(i, "cells")


class LineRows(Sequence):
    """The lines of a lines index (JSONL), each as bytes."""

    def __init__(self, index: RowIndex):
        self.index = index

    def __reduce__(self):  # a spawned worker maps the index again: no rows travel
        return LineRows, (self.index,)

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> bytes:
        if not 0 <= i < len(self.index):
            raise IndexError(i)
        return self.index.blob(i, "line")


@dataclass
class VideoCsvSource:
    """The rows of one video CSV. `precomputed` CSVs point at latents (`latent_path`) instead."""
    name: str                # file stem: the prefix of sample ids and the stream's cursor name
    path: PathLike           # a local Path or a URL
    columns: dict[str, int]  # column name -> position
    rows: Sequence[list[str]]  # TableRows: each row read from the index when asked

    @property
    def precomputed(self) -> bool:
        return "latent_path" in self.columns

    def __len__(self) -> int:
        return len(self.rows)

    def field(self, row: list[str], column: str) -> str | None:
        """A cell's text, or None when the column is absent or the cell empty."""
        at = self.columns.get(column)
        if at is None or at >= len(row):
            return None
        value = row[at].strip()
        return value or None

    def resolve(self, value: str) -> PathLike:
        """Paths in a CSV are relative to the CSV's folder (a URL's "folder" for a CSV at a URL)
        unless absolute or URLs; a URL stays a string."""
        return join(parent(self.path), value)


def read_video_csv(path: PathLike) -> VideoCsvSource:
    """The rows of a video CSV (utf-8, with or without a byte-order mark) or of a Parquet table of
    the same columns, through its row index (a local file or a URL)."""
    path = as_path(path)
    index = open_index(path, "table")
    header = header_of(index)
    columns = {name: i for i, name in enumerate(header)}
    required = ("latent_path", "caption") if "latent_path" in columns else ("path", "caption")
    missing = [c for c in required if c not in columns]
    if missing:
        raise SourceError(f"{path} lacks the column(s) {missing}; its header is {header}. A video CSV "
                          "needs path and caption (or latent_path and caption for precomputed rows).")
    if not len(index):
        raise SourceError(f"{path} has a header but no rows.")
    return VideoCsvSource(name=stem(path), path=path, columns=columns, rows=TableRows(index))


def as_path(path: PathLike) -> PathLike:
    """A URL as it is (a Path would make `s3://b/k` into `s3:/b/k`), a local path as a Path."""
    return path if is_url(path) else Path(path)


@dataclass(frozen=True)
class TarMember:
    offset: int  # where the member's bytes start in the tar file
    size: int
    ext: str


@dataclass(frozen=True)
class TarImage:
    """One webdataset sample: an image member and (maybe) its caption member."""
    tar: int     # index into ImageTarSet.paths
    key: str
    image: TarMember
    caption: TarMember | None


class TarImages(Sequence):
    """The images of several tars as one sequence, each a TarImage made from the tars' indexes."""

    def __init__(self, indexes: list[RowIndex]):
        self.indexes = indexes
        self.starts = [0]
        for index in indexes:
            self.starts.append(self.starts[-1] + len(index))

    def __reduce__(self):  # a spawned worker maps the index again: no rows travel
        return TarImages, (self.indexes,)

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, i: int) -> TarImage:
        if not 0 <= i < len(self):
            raise IndexError(i)
        tar = bisect.bisect_right(self.starts, i) - 1
        index, row = self.indexes[tar], i - self.starts[tar]

        def member(prefix: str) -> TarMember:
            return TarMember(index.integer(row, f"{prefix}_offset"), index.integer(row, f"{prefix}_size"),
                             index.blob(row, f"{prefix}_ext").decode())
        caption = member("caption") if index.integer(row, "caption_offset") >= 0 else None
        return TarImage(tar, index.blob(row, "key").decode(), member("image"), caption)


@dataclass
class ImageTarSet:
    """Every image of every tar, as one indexable sequence (one image stream for all tars)."""
    paths: list[PathLike]
    names: list[str]
    images: Sequence[TarImage]

    def __len__(self) -> int:
        return len(self.images)

    def sample_id(self, image: TarImage) -> str:
        return f"{self.names[image.tar]}:{image.key}"

    def read(self, image: TarImage) -> tuple[bytes, bytes | None]:
        """The image's bytes and its caption file's bytes (None if it has none): one read of each
        member where it lies (a pread, or one ranged GET of a tar at a URL)."""
        path = self.paths[image.tar]
        data = storage().read_range(path, image.image.offset, image.image.size)
        caption = None
        if image.caption is not None:
            caption = storage().read_range(path, image.caption.offset, image.caption.size)
        return data, caption


def index_tar(path: PathLike) -> RowIndex:
    """A tar's index (its headers scanned once, no image bytes read; see pan.data.index.build_tar).
    A tar that breaks off part-way keeps the samples indexed before the break (logged)."""
    index = open_index(path, "tar")
    if index.meta.get("damage"):
        logger.warning("image tar %s is %s; using those", path, index.meta["damage"])
    return index


def read_image_tars(paths: list[PathLike]) -> ImageTarSet:
    paths = [as_path(p) for p in paths]
    images = TarImages([index_tar(p) for p in paths])
    if not len(images):
        raise SourceError(f"no images (.{'/.'.join(IMAGE_EXTENSIONS)}) in {[str(p) for p in paths]}.")
    return ImageTarSet(paths=paths, names=[stem(p) for p in paths], images=images)


def caption_from_bytes(data: bytes | None, ext: str | None) -> str:
    """A .txt caption is the file's text; a .json caption is its "caption" field."""
    if data is None:
        return ""
    text = data.decode("utf-8-sig", errors="replace")  # a byte-order mark is no part of the caption
    if ext == "json":
        value = json.loads(text)
        return str(value.get("caption") or "") if isinstance(value, dict) else ""
    return text.strip()


# ----------------------------------------------------------------------------------------------
# JSONL annotations (Pyramid-Flow's format)
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class AnnotationRow:
    """One parsed annotation line. Paths are resolved against the annotation file's folder."""
    kind: Literal["video", "image"]
    caption: str
    media: PathLike | None          # the video or image file (a latent row may name none)
    latent: PathLike | None         # precomputed latent `.pt`, unnormalised
    text_fea: PathLike | None       # precomputed text features `.pt`
    frames: tuple[int, ...] | None  # source frame indices to decode (video rows)


@dataclass
class AnnotationSource:
    """The lines of one JSONL annotation file, as bytes: each is parsed when its sample is loaded."""
    name: str          # file stem: the prefix of sample ids and the stream's cursor name
    path: PathLike     # a local Path or a URL
    rows: Sequence[bytes]  # non-blank lines (LineRows: read from the index when asked)

    def __len__(self) -> int:
        return len(self.rows)

    def rows_naming(self, key: str) -> int:
        """Rows whose text names `key` ("latent" or "text_fea"; a text search kept in the index)."""
        return self.rows.index.count_true(key)

    @property
    def names_latents(self) -> bool:
        """Does some row name a precomputed latent? (A text search: rows are parsed only when read.)"""
        return self.rows_naming("latent") > 0

    def resolve(self, value: str) -> PathLike:
        """Paths in an annotation file are relative to its folder (a URL's "folder" for a file at a
        URL) unless absolute or URLs; a URL stays a string."""
        return join(parent(self.path), value)

    def parse(self, i: int) -> AnnotationRow:
        """Row i as an AnnotationRow; SkipSample (bad_row, empty_caption) if it cannot be one."""
        try:
            row = json.loads(self.rows[i])
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
            raise SkipSample("bad_row", f"not a JSON object: {e}") from None
        if not isinstance(row, dict):
            raise SkipSample("bad_row", f"a row must be a JSON object, not {type(row).__name__}")
        if "image" in row and "video" in row:
            raise SkipSample("bad_row", "a row names an image or a video, not both")
        kind = "image" if "image" in row else "video"
        if kind == "video" and "video" not in row and "latent" not in row:
            raise SkipSample("bad_row", f"no image, video or latent key (keys: {sorted(row)})")
        caption = row.get("text")
        if caption is not None and not isinstance(caption, str):
            raise SkipSample("bad_row", f"text is {caption!r}, not a string")
        if not (caption or "").strip():
            raise SkipSample("empty_caption", "the row has no text, or an empty one")
        return AnnotationRow(kind=kind, caption=caption.strip(), media=self._path(row, kind),
                             latent=self._path(row, "latent"), text_fea=self._path(row, "text_fea"),
                             frames=frame_indices(row.get("frames")))

    def _path(self, row: dict, key: str) -> PathLike | None:
        value = row.get(key)
        if value is None:
            return None
        if not isinstance(value, str) or not value.strip():
            raise SkipSample("bad_row", f"{key} is {value!r}, not a path")
        return self.resolve(value.strip())


def frame_indices(value) -> tuple[int, ...] | None:
    """A row's `frames`: source frame indices, non-negative and increasing (or absent)."""
    if value is None:
        return None
    ok = (isinstance(value, list) and value
          and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
          and all(a < b for a, b in zip(value, value[1:])))
    if not ok:
        raise SkipSample("bad_row", f"frames must be a non-empty list of increasing frame indices, "
                                    f"got {str(value)[:80]}")
    return tuple(value)


def read_annotations(path: PathLike) -> AnnotationSource:
    """A JSONL annotation file (a local file or a URL): one JSON object per line; blank lines are
    not rows. A video CSV given as one (its header row is no JSON object) is refused whole, not
    skipped row by row."""
    path = as_path(path)
    rows = LineRows(open_index(path, "lines"))
    if not len(rows):
        raise SourceError(f"{path} has no rows (an annotation file holds one JSON object per line).")
    header = looks_like_csv_header(rows[0])
    if header is not None:
        raise SourceError(f"{path} is a CSV (its first line is the header {header}), not a JSONL "
                          "annotation file: list it in video_csv_paths, not annotation_paths.")
    return AnnotationSource(name=stem(path), path=path, rows=rows)


def looks_like_csv_header(line: bytes) -> list[str] | None:
    """The columns of a line that is a video CSV's header (names a `path`, `latent_path` or `caption`
    column and is no JSON), else None."""
    try:
        json.loads(line)
        return None
    except ValueError:
        pass
    try:
        cells = [c.strip() for c in next(csv.reader([line.decode("utf-8-sig")]))]
    except (UnicodeDecodeError, StopIteration, csv.Error):
        return None
    return cells if len(cells) > 1 and {"path", "latent_path", "caption"} & set(cells) else None


SCAN_ROWS = 20000   # rows `scan_annotations` looks at: every row of a file this long, else this many spread
REMOTE_LOOKUPS = 200   # of those, rows whose URLs it looks up (one request each)


@dataclass
class AnnotationScan:
    """Rows of an annotation file parsed, and the files each names looked up (no media read)."""
    rows: int                                     # rows scanned
    problems: dict[str, list[tuple[int, str]]]   # reason -> (row, detail), in row order
    total: int = 0                                # rows of the file

    @property
    def bad(self) -> int:
        return sum(len(v) for v in self.problems.values())

    def summary(self, shown: int = 3) -> str:
        """"2 bad_row (#0: ..., #5: ...), 1 missing_file (#3: ...)"."""
        parts = []
        for reason, found in self.problems.items():
            examples = ", ".join(f"#{i}: {detail}" for i, detail in found[:shown])
            more = f", {len(found) - shown} more" if len(found) > shown else ""
            parts.append(f"{len(found)} {reason} ({examples}{more})")
        return "; ".join(parts)


def scan_annotations(source: AnnotationSource, use_precomputed: bool = True, limit: int = SCAN_ROWS) -> AnnotationScan:
    """Parse the rows of `source` (every row, or `limit` spread over a longer file) and check that the
    files they name exist: what training would skip (`bad_row`, `empty_caption`, `missing_file`),
    found without decoding anything (URLs looked up for the first REMOTE_LOOKUPS rows naming
    them). With `use_precomputed`, a row naming a `latent` needs that file
    (and its `text_fea`), not its media."""
    problems: dict[str, list[tuple[int, str]]] = {}
    remote = 0   # rows whose URLs were looked up
    size = len(source)
    indices = range(size) if size <= limit else sorted({i * (size - 1) // (limit - 1) for i in range(limit)})
    for i in indices:
        try:
            row = source.parse(i)
        except SkipSample as e:
            problems.setdefault(e.reason, []).append((i, e.detail[:120]))
            continue
        needed = []
        if use_precomputed and row.latent is not None:
            needed.append(row.latent)
        elif row.media is not None:
            needed.append(row.media)
        else:
            problems.setdefault("missing_file", []).append((i, "the row names no video to decode"))
            continue
        if use_precomputed and row.text_fea is not None:
            needed.append(row.text_fea)
        if any(is_url(p) for p in needed):
            remote += 1
            if remote > REMOTE_LOOKUPS:   # a request each: the rest are found missing by training
                needed = [p for p in needed if not is_url(p)]
        missing = [str(p) for p in needed if not (storage().exists(p) if is_url(p) else Path(p).is_file())]
        if missing:
            problems.setdefault("missing_file", []).append((i, ", ".join(missing)))
    return AnnotationScan(len(indices), problems, size)

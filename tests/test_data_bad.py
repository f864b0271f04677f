"""Bad data never stops training: every kind is skipped, counted by reason, logged once, and skipping
is deterministic (with or without workers, and across a resume)."""

from __future__ import annotations

import collections
import dataclasses
import logging
import os

import pytest

from pan.data import build_data_loader
from pan.data.sources import SourceError
from test_data_loader import fingerprint
from test_data_sources import (BIKES, CARPHONE, image_bytes, make_tar, real_video, small_config,
                               tokens_of, write_csv)

# reason each CSV row must be skipped for (None: a good row)
ROWS = [
    ([BIKES, "bikes, first second", 0, 1, "", ""], None),
    ([CARPHONE, "carphone, first second", 0, 1, "", ""], None),
    (["missing.mp4", "a file that is not there", 0, 1, "", ""], "missing_file"),
    (["truncated.mp4", "the first 100 kB of bikes.mp4", 0, 1, "", ""], "decode_error"),
    (["garbage.mp4", "random bytes", "", "", "", ""], "decode_error"),
    (["corrupt.mp4", "bikes.mp4 with its frames overwritten", "", "", "", ""], "decode_error"),
    ([BIKES, "0.1 s is 2 frames, min_frames is 5", 0, 0.1, "", ""], "too_short"),
    # the CSV's own metadata rules it out before the (missing) file is opened
    (["never_opened.mp4", "2 frames by the CSV", "", "", 25, 2], "too_short"),
    ([CARPHONE, "", 0, 1, "", ""], "empty_caption"),
    ([CARPHONE, "start is not a number", "soon", "", "", ""], "bad_row"),
]
IMAGES = {"good": None, "broken": "decode_error", "uncaptioned": "empty_caption", "blank": "empty_caption"}


@pytest.fixture(scope="module")
def bad_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    bikes = real_video(BIKES).read_bytes()
    (root / "truncated.mp4").write_bytes(bikes[:100_000])
    (root / "garbage.mp4").write_bytes(os.urandom(5000))
    mdat = bikes.find(b"mdat") + 8
    (root / "corrupt.mp4").write_bytes(bikes[:mdat] + os.urandom(20_000) + bikes[mdat + 20_000:])
    rows = [[str(real_video(r[0])) if r[0] in (BIKES, CARPHONE) else r[0], *r[1:]] for r, _ in ROWS]
    csv_path = write_csv(root / "clips.csv", ["path", "caption", "start_time", "end_time", "fps", "num_frames"],
                         rows)
    tar = make_tar(root / "shard.tar", {
        "good.jpg": image_bytes(64, 32, 1), "good.txt": b"a good image",
        "broken.jpg": b"\xff\xd8 this is not a jpeg", "broken.txt": b"a broken image",
        "uncaptioned.png": image_bytes(32, 32, 2, "PNG"),
        "blank.webp": image_bytes(32, 64, 3, "WEBP"), "blank.json": b'{"caption": ""}'})
    cfg = small_config(video_csv_paths=[str(csv_path)], image_tar_paths=[str(tar)], image_sample_prob=0.3,
                       min_frames=5)
    return cfg


def reasons_by_id() -> dict[str, str | None]:
    out = {f"clips:{i}": reason for i, (_, reason) in enumerate(ROWS)}
    out.update({f"shard:{key}": reason for key, reason in IMAGES.items()})
    return out


def expected_skips(loader) -> collections.Counter:
    """Replay the plan up to the loader's cursor and count the visits of each bad sample."""
    planner, want = loader._initial.copy(), collections.Counter()
    reasons = reasons_by_id()
    for _ in range(loader.planner.step):
        reason = reasons[loader._sample_id(planner.next_ref())]
        if reason:
            want[reason] += 1
    return want


def test_every_kind_of_bad_data_is_skipped_counted_and_logged_once(bad_data, caplog):
    loader = build_data_loader(bad_data, tokens_of=tokens_of, dp_rank=0, dp_size=1, seed=0)
    per_batch = collections.Counter()
    with caplog.at_level(logging.WARNING, logger="pan.data.packed"):
        for _ in range(12):
            batch = next(loader)
            per_batch.update(batch.skipped)
            for s in batch.samples:
                assert reasons_by_id()[s.sample_id] is None
    assert loader.skipped_total == per_batch == expected_skips(loader)
    assert set(loader.skipped_total) == {r for r in reasons_by_id().values() if r}
    warned = collections.Counter(r.getMessage().split()[1] for r in caplog.records if "skipping" in r.getMessage())
    bad_ids = {i for i, r in reasons_by_id().items() if r}
    assert set(warned) == bad_ids and set(warned.values()) == {1}  # each bad sample logged once
    assert sum(loader.skipped_total.values()) > len(bad_ids)  # ... though visited several times


def test_skipping_is_the_same_with_workers_and_across_a_resume(bad_data):
    def run(cfg, n, state=None):
        loader = build_data_loader(cfg, tokens_of=tokens_of, dp_rank=0, dp_size=1, seed=3)
        if state is not None:
            loader.load_state_dict(state)
        out = [(fingerprint(b), b.skipped) for b in (next(loader) for _ in range(n))]
        return out, loader
    straight, _ = run(bad_data, 8)
    with_workers, _ = run(dataclasses.replace(bad_data, packed_dataloader_num_workers=2), 8)
    assert with_workers == straight
    head, first = run(bad_data, 3)
    tail, second = run(bad_data, 5, first.state_dict())
    assert head + tail == straight
    assert second.skipped_total == sum((collections.Counter(s) for _, s in straight), collections.Counter())


def test_samples_over_the_token_budget_are_skipped(bad_data):
    # 5-frame clips are 16 tokens, images 8: a budget of 10 keeps only the images
    cfg = dataclasses.replace(bad_data, max_tokens_per_batch=10)
    loader = build_data_loader(cfg, tokens_of=tokens_of, dp_rank=0, dp_size=1, seed=0)
    batch = next(loader)
    assert {s.kind for s in batch.samples} == {"image"} and loader.skipped_total["over_budget"] > 0


def test_data_with_nothing_usable_stops_with_a_clear_error(tmp_path):
    csv_path = write_csv(tmp_path / "void.csv", ["path", "caption"], [["a.mp4", "x"], ["b.mp4", "y"]])
    loader = build_data_loader(small_config(video_csv_paths=[str(csv_path)]), tokens_of=tokens_of,
                               dp_rank=0, dp_size=1, seed=0)
    with pytest.raises(SourceError, match="no usable sample"):
        next(loader)


def test_an_unusable_source_stops_every_rank_with_one_message(tmp_path):
    """2 ranks of train.py and a CSV with one row: each rank needs its own share, so the run is
    refused with exit 2 on both, the reason printed once, no traceback."""
    import subprocess
    import sys
    from pathlib import Path

    from dist_utils import free_port

    root = Path(__file__).resolve().parents[1]
    csv = tmp_path / "one.csv"
    csv.write_text(f"path,caption\n{BIKES},bikes\n")
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root), "RANK": str(rank),
               "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        procs.append(subprocess.Popen(
            [sys.executable, str(root / "train.py"), "--config", str(root / "config/tiny_cpu.yaml"),
             "--video_csv_paths", str(csv), "--output_dir", str(tmp_path / "run")],
            env=env, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [2, 2], outputs
    errors = "".join(err for _, err in outputs)
    assert errors.count("fewer than the 2 data-parallel ranks") == 1, errors
    assert "Traceback" not in errors

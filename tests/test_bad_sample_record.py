"""The run's record of known-bad samples: each bad sample is read once per run (also across a resume,
the record travels in the checkpoint), skips and distinct bad samples are counted apart, and the
list is written to output_dir/bad_samples/ for the user."""

from __future__ import annotations

import collections
import dataclasses
import json
from pathlib import Path

import pytest

from pan.config import load_job_config
from pan.data import build_data_loader
from pan.data.packed import RefSequence
from pan.data.reader import KnownBad
from pan.trainer import build_trainer
from test_data_bad import bad_data, reasons_by_id  # noqa: F401  (bad_data is a fixture)
from test_data_sources import BIKES, CARPHONE, real_video, tokens_of, write_csv

REPO = Path(__file__).resolve().parents[1]
BAD_IDS = {i for i, reason in reasons_by_id().items() if reason}


@pytest.fixture
def reads(monkeypatch) -> collections.Counter:
    """How often each sample is sent to be read (decoded), by (stream, index): what the sampler hands
    the decoding workers, counted in this process; KnownBad visits are not reads."""
    counts: collections.Counter = collections.Counter()
    real = RefSequence.__iter__

    def counting(self):
        for ref in real(self):
            if not isinstance(ref, KnownBad):
                counts[(ref.stream, ref.index)] += 1
            yield ref

    monkeypatch.setattr(RefSequence, "__iter__", counting)
    return counts


def bad_reads(loader, reads: collections.Counter) -> dict[str, int]:
    return {loader._id_of(stream, index): n for (stream, index), n in reads.items()
            if loader._id_of(stream, index) in BAD_IDS}


@pytest.mark.parametrize("workers", [0, 2])
def test_each_bad_sample_is_read_once_and_skips_are_counted_apart(bad_data, reads, workers):  # noqa: F811
    cfg = dataclasses.replace(bad_data, packed_dataloader_num_workers=workers)
    loader = build_data_loader(cfg, tokens_of=tokens_of, dp_rank=0, dp_size=1, seed=0)
    for _ in range(6):
        next(loader)
    assert set(loader.bad_samples) == BAD_IDS
    assert {i: why[0] for i, why in loader.bad_samples.items()} == {i: reasons_by_id()[i] for i in BAD_IDS}
    # Once, also with workers: a visit sent while an earlier one of its row is still being read
    # goes as Deferred (a KnownBad: not read), settled when it arrives (tests/test_bad_rows.py).
    assert bad_reads(loader, reads) == {i: 1 for i in BAD_IDS}
    reads.clear()
    skips_before = sum(loader.skipped_total.values())
    for _ in range(6):
        next(loader)
    assert sum(loader.skipped_total.values()) > skips_before + len(BAD_IDS)  # met again and again...
    assert bad_reads(loader, reads) == {}  # ...and never read again
    loader.close()


def test_the_record_travels_in_the_loader_state_and_nothing_recorded_is_read_again(bad_data, reads):  # noqa: F811
    straight = build_data_loader(bad_data, tokens_of=tokens_of, dp_rank=0, dp_size=1, seed=0)
    batches = [[s.sample_id for s in next(straight).samples] for _ in range(10)]

    first = build_data_loader(bad_data, tokens_of=tokens_of, dp_rank=0, dp_size=1, seed=0)
    for _ in range(5):
        next(first)
    state = json.loads(json.dumps(first.state_dict()))  # as the checkpoint stores it
    assert {first._id_of(s, i) for s, i, _, _ in state["bad_samples"]} == set(first.bad_samples)
    reads.clear()
    resumed = build_data_loader(bad_data, tokens_of=tokens_of, dp_rank=0, dp_size=1, seed=0)
    resumed.load_state_dict(state)
    assert resumed.bad_samples == first.bad_samples
    tail = [[s.sample_id for s in next(resumed).samples] for _ in range(5)]
    assert tail == batches[5:]  # the same samples as the uninterrupted loader
    assert resumed.skipped_total == straight.skipped_total  # the same skips
    recorded = set(first.bad_samples)
    assert not recorded & set(bad_reads(resumed, reads))  # none of the recorded ones read again


def test_a_run_lists_its_bad_samples_and_logs_them_apart_from_skips(tmp_path):
    csv = write_csv(tmp_path / "clips.csv", ["path", "caption", "start_time", "end_time"], [
        [str(real_video(BIKES)), "bikes", 0, 1], [str(real_video(CARPHONE)), "a phone call", 0, 1],
        ["missing.mp4", "not there", 0, 1], [str(real_video(CARPHONE)), "", 0, 1],
        [str(tmp_path / "clips.csv"), "a CSV is no video", 0, 1]])
    argv = ["--config", str(REPO / "config/tiny_cpu.yaml"), "--output_dir", str(tmp_path / "run"),
            "--video_csv_paths", str(csv), "--max_tokens_per_batch", "320", "--max_samples_per_batch", "1",
            "--save_interval", "3", "--log_interval", "1", "--max_steps", "6"]
    trainer = build_trainer(load_job_config(argv, warn=lambda m: None))
    trainer.fit()
    listed = (tmp_path / "run" / "bad_samples" / "0.tsv").read_text().splitlines()
    assert listed[0] == "sample_id\treason\tdetail"
    assert [line.split("\t")[:2] for line in listed[1:]] == [
        ["clips:2", "missing_file"], ["clips:3", "empty_caption"], ["clips:4", "decode_error"]]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["bad_samples_distinct"] == 3
    assert rows[-1]["bad_samples"] > 3  # skips: the 3 met on every pass over the 5 rows

"""Elastic resume through real launches: a run of 4 data-parallel ranks continues on 2 (and a run of
2 on 4) with the global batch kept (gradient_accumulation_steps x ranks = 4 data shards). Each step
after the resume trains exactly the samples the uninterrupted 4-rank run trained at that step, with
the same noise, and logs its loss within floating-point noise; nothing is lost or trained twice.
"""

from __future__ import annotations

import collections
import shutil
from pathlib import Path

import pytest
import yaml

from pan.data.synth import synth_dataset
from launch_utils import assert_continues_the_run, consumed_per_step
from test_kill_resume import MAX_STEPS, Job, tail, tiny_config


def config_for(root: Path, name: str, data_csv: Path, out: Path, accumulation: int) -> Path:
    config = tiny_config(root / f"{name}.yaml", data_csv, out, {"cp_size": 1}, keep=MAX_STEPS)
    cfg = yaml.safe_load(config.read_text())
    cfg["training"]["gradient_accumulation_steps"] = accumulation
    config.write_text(yaml.safe_dump(cfg))
    return config


def continue_from(checkpoint: Path, root: Path, name: str, data_csv: Path, world: int) -> tuple[Path, str]:
    """A new output_dir holding only `checkpoint`, trained on to MAX_STEPS by `world` ranks that
    keep 4 micro-batches a step; its folder and log."""
    out = root / name
    shutil.copytree(checkpoint, out / checkpoint.name)
    log = root / f"{name}.log"
    assert Job(config_for(root, name, data_csv, out, 4 // world), log, world=world).wait(timeout=600) == [0] * world, tail(log)
    text = log.read_text()
    assert f"resuming from checkpoint-{checkpoint.name.split('-')[1]}" in text, tail(log)
    assert "each of the 4 data shards continues exactly" in text, tail(log)
    return out, text


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> tuple[Path, Path]:
    """The uninterrupted run of 4 data-parallel ranks (checkpoint every 2 steps, all kept)."""
    root = tmp_path_factory.mktemp("elastic4")
    data_csv = synth_dataset(root / "data", num_train=24, num_heldout=0, size=16, num_frames=5)["train_csv"]
    out, log = root / "four", root / "four.log"
    assert Job(config_for(root, "four", data_csv, out, 1), log, world=4).wait(timeout=600) == [0] * 4, tail(log)
    return out, data_csv


@pytest.fixture(scope="module")
def on_two(four_ranks) -> Path:
    """The 4-rank run's checkpoint-4 continued on 2 ranks x 2 micro-batches."""
    straight, data_csv = four_ranks
    out, _ = continue_from(straight / "checkpoint-4", straight.parent, "two", data_csv, world=2)
    return out


def test_four_ranks_continue_on_two_exactly(four_ranks, on_two):
    straight, _ = four_ranks
    assert sorted(p.name for p in (on_two / "consumed").iterdir()) == ["0.txt", "1.txt"]
    assert_continues_the_run(straight, on_two, first_step=5, last_step=MAX_STEPS)


def test_two_ranks_continue_on_four_exactly(four_ranks, on_two):
    """The 2-rank continuation's checkpoint-6 goes back to 4 ranks x 1 micro-batch."""
    straight, data_csv = four_ranks
    out, _ = continue_from(on_two / "checkpoint-6", straight.parent, "back_to_four", data_csv, world=4)
    assert_continues_the_run(straight, out, first_step=7, last_step=MAX_STEPS)


def test_no_sample_is_lost_or_trained_twice_across_the_resumes(four_ranks, on_two):
    """Steps 1-4 on 4 ranks and 5-10 on 2 train the uninterrupted run's samples, each clip of the
    24 as often as any other (within one: an epoch may be unfinished)."""
    straight, _ = four_ranks
    before, after = consumed_per_step(straight), consumed_per_step(on_two)
    trained = collections.Counter(i for step in range(1, MAX_STEPS + 1)
                                  for i in (before if step <= 4 else after)[step])
    assert trained == collections.Counter(i for ids in before.values() for i in ids)
    assert len(trained) == 24 and max(trained.values()) - min(trained.values()) <= 1, trained

"""DataConfig's cross-key rules: each refusal names the key and the fix."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from pan.config.core import ConfigError
from pan.data.config import DataConfig, parse_bucket
from test_data_sources import clips_csv, images_tar


@pytest.fixture()
def files(tmp_path):
    (tmp_path / "b").mkdir()
    return {"csv": str(clips_csv(tmp_path / "clips.csv", seconds=1)),
            "csv2": str(clips_csv(tmp_path / "more.csv", seconds=1)),
            "same_name": str(clips_csv(tmp_path / "b" / "clips.csv", seconds=1)),
            "tar": str(images_tar(tmp_path / "shard.tar", 2))}


def job(explicit=()):
    return SimpleNamespace(explicit_keys=set(explicit))


def refused(cfg: DataConfig, explicit=()) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        cfg.check(job(explicit))
    return e.value


def test_buckets_are_width_by_height():
    assert parse_bucket("1248x704") == (704, 1248)
    for bad in ("1248", "0x5", "ax7", "3x4x5"):
        with pytest.raises(ValueError):
            parse_bucket(bad)


def test_a_sound_config_passes(files):
    cfg = DataConfig(video_csv_paths=[files["csv"], files["csv2"]], video_csv_weights=[2.0, 1.0],
                     image_tar_paths=[files["tar"]], image_sample_prob=0.2)
    cfg.check(job())
    DataConfig(image_tar_paths=[files["tar"]], image_sample_prob=1.0).check(job())  # image-only
    assert cfg.frame_count_range()[:3] == [1, 5, 9] and cfg.frame_count_range()[-1] == 121


@pytest.mark.parametrize("change,key,words", [
    (dict(video_csv_paths=[]), "video_csv_paths", "no data"),
    (dict(video_csv_weights=[1.0, 2.0]), "video_csv_weights", "one weight per CSV"),
    (dict(image_sample_prob=0.3), "image_sample_prob", "image_tar_paths is empty"),
    (dict(image_sample_prob=1.0, image_tar_paths=["TAR"]), "image_sample_prob", "never be read"),
    (dict(image_tar_paths=["TAR"]), "image_tar_paths", "image_sample_prob is 0"),
    (dict(video_csv_paths=["nowhere.csv"]), "video_csv_paths", "does not exist"),
    (dict(video_csv_paths=["CSV", "SAME"]), "video_csv_paths", "rename them apart"),
    (dict(resolution_buckets=["wide"]), "resolution_buckets", "WIDTHxHEIGHT"),
    (dict(frames_remainder=4), "frames_remainder", "below 4"),
    (dict(min_frames=10, max_frames=9), "min_frames", "exceeds"),
    (dict(min_frames=2, max_frames=4), "max_frames", "no frame count"),
])
def test_contradictions_are_refused(files, change, key, words):
    swap = {"TAR": files["tar"], "CSV": files["csv"], "SAME": files["same_name"]}
    change = {k: [swap.get(x, x) for x in v] if isinstance(v, list) else v for k, v in change.items()}
    cfg = dataclasses.replace(DataConfig(video_csv_paths=[files["csv"]]), **change)
    err = refused(cfg)
    assert err.key == key and words in err.message


def test_prefetch_without_workers_is_refused_only_when_set(files):
    cfg = DataConfig(video_csv_paths=[files["csv"]], packed_dataloader_num_workers=0)
    cfg.check(job())  # the default prefetch factor is fine: nobody asked for it
    err = refused(cfg, explicit={"packed_dataloader_prefetch_factor"})
    assert err.key == "packed_dataloader_prefetch_factor"

"""Object storage (pan/data/storage.py) against a real S3 server on 127.0.0.1 (tests/s3_server.py):
precompute into s3://, train from its shards, an endpoint that goes away mid-epoch (retried, the
stream unchanged; or, past the retries, a clear stop and an exact resume), clips read from s3://,
manifests, annotation files and image tars at s3:// URLs and their local indexes; and the retry
policy and the local cache on their own."""

from __future__ import annotations

import csv
import errno
import io
import json
import tarfile
import threading
from pathlib import Path
from types import SimpleNamespace

import fsspec
import pytest
import torch
from safetensors.torch import save

from pan.config import ConfigError, load_job_config
from pan.data import build_data_loader
import pan.data.index as index_module
from pan.data.index import index_candidates
from pan.data.precompute import main as precompute_main
from pan.data.reader import read_raw_latent, read_text_features
from pan.data.shards import ShardWriter, read_indexes
from pan.data.sources import read_image_tars, read_video_csv
import pan.data.storage as storage_module
from pan.data.storage import (
    DiskCache,
    RetryPolicy,
    Settings,
    Storage,
    StorageError,
    is_transient,
    join,
    storage,
    with_retries,
)
from pan.data.synth import synth_dataset
from pan.trainer import build_trainer
from s3_server import s3_server  # noqa: F401  (a fixture)
from test_data_sources import small_config, tokens_of, write_csv

REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------------------------
# Retries and the cache, on fakes
# ----------------------------------------------------------------------------------------------

class Flaky:
    """Fails with `error` `failures` times, then answers."""

    def __init__(self, error: Exception, failures: int):
        self.error, self.failures, self.calls = error, failures, 0

    def __call__(self):
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return "answer"


class ClientError(Exception):
    """botocore's ClientError as far as the policy looks: an HTTP status and an error code."""

    def __init__(self, status: int, code: str):
        super().__init__(code)
        self.response = {"ResponseMetadata": {"HTTPStatusCode": status}, "Error": {"Code": code}}


def test_transient_errors_are_retried_with_growing_jittered_waits():
    waits = []
    flaky = Flaky(ConnectionRefusedError(errno.ECONNREFUSED, "refused"), failures=4)
    policy = RetryPolicy(tries=6, base_delay=0.5, max_delay=3.0)
    assert with_retries(flaky, "s3://b/k", policy, sleep=waits.append, rng=lambda: 1.0) == "answer"
    assert flaky.calls == 5 and waits == [0.5, 1.0, 2.0, 3.0]   # doubling, capped at max_delay
    jittered = []
    with_retries(Flaky(TimeoutError("slow"), 3), "s3://b/k", policy, sleep=jittered.append, rng=lambda: 0.25)
    assert jittered == [0.125, 0.25, 0.5]                          # a random share of each wait


def test_after_the_last_try_the_error_names_the_url_and_a_missing_object_is_not_retried():
    flaky = Flaky(ClientError(503, "SlowDown"), failures=10)
    with pytest.raises(StorageError, match=r"s3://bucket/shard.tar: gave up after 3 tries"):
        with_retries(flaky, "s3://bucket/shard.tar", RetryPolicy(tries=3), sleep=lambda s: None)
    assert flaky.calls == 3
    for error in (FileNotFoundError("s3://bucket/gone"), ClientError(404, "NoSuchKey"),
                  ClientError(403, "AccessDenied"), ValueError("a bug")):
        flaky = Flaky(error, failures=1)
        with pytest.raises(type(error)):
            with_retries(flaky, "s3://bucket/x", RetryPolicy(tries=5), sleep=lambda s: None)
        assert flaky.calls == 1 and not is_transient(error)
    assert all(is_transient(e) for e in (ClientError(500, "InternalError"), ClientError(429, "x"),
                                         ClientError(400, "Throttling"), ConnectionResetError()))


class RefusingStore(Storage):
    """A store whose every call is refused as a wrong key is (what s3fs raises for a 403)."""

    def _fs(self, url):
        class Fs:
            def cat_file(self, path, start=None, end=None):
                raise PermissionError(f"{path}: Access Denied")
        return Fs(), url.split("://", 1)[1]


def test_refused_credentials_stop_the_run_instead_of_spoiling_every_sample(tmp_path):
    store = RefusingStore(Settings(tmp_path, 0, RetryPolicy(tries=3)), sleep=lambda s: pytest.fail("retried"))
    with pytest.raises(StorageError, match=r"s3://b/shard.tar: access refused .*check the credentials"):
        store.read_range("s3://b/shard.tar", 0, 10)


def test_the_cache_keeps_the_most_recently_used_within_its_bytes(tmp_path):
    cache = DiskCache(tmp_path, budget=250)
    for key in ("a", "b"):
        cache.put(key, key.encode() * 100)
    assert cache.get("a") == b"a" * 100        # a is now the most recently used
    cache.put("c", b"c" * 100)                 # 300 bytes > 250: b goes
    assert cache.get("b") is None and cache.get("a") and cache.get("c")
    cache.put("huge", b"h" * 1000)             # larger than the whole budget: not kept
    assert cache.get("huge") is None
    assert sum(p.stat().st_size for p in tmp_path.iterdir()) <= 250


def test_bad_storage_settings_and_stores_that_cannot_open_are_refused_when_the_config_loads(tmp_path, monkeypatch):
    clips = write_csv(tmp_path / "clips.csv", ["path", "caption"], [["a.mp4", "a clip"]])
    monkeypatch.setenv("PAN_DATA_CACHE_GB", "lots")
    with pytest.raises(ConfigError, match=r"PAN_DATA_CACHE_GB='lots' is not a number: unset it or give"):
        small_config(video_csv_paths=[str(clips)]).check(SimpleNamespace())
    monkeypatch.setenv("PAN_DATA_CACHE_GB", "1")
    monkeypatch.setenv("PAN_DATA_RETRIES", "0")
    with pytest.raises(ConfigError, match=r"PAN_DATA_RETRIES='0' is below 1"):
        small_config(video_csv_paths=[str(clips)]).check(SimpleNamespace())
    monkeypatch.delenv("PAN_DATA_RETRIES")
    small_config(video_csv_paths=["s3://bucket/clips.csv"]).check(SimpleNamespace())   # opened by the run
    with pytest.raises(ConfigError, match=r"annotation_paths`: lists gs://b/a.jsonl: no gs:// store .* install gcsfs"):
        small_config(annotation_paths=["gs://b/a.jsonl"]).check(SimpleNamespace())


# ----------------------------------------------------------------------------------------------
# Against the S3 server
# ----------------------------------------------------------------------------------------------

def make_bucket(name: str = "data") -> str:
    fsspec.filesystem("s3", endpoint_url=storage_endpoint()).mkdir(name)
    return f"s3://{name}"


def storage_endpoint() -> str:
    import os

    return os.environ["AWS_ENDPOINT_URL"]


def sharded_manifest(bucket: str, folder: Path, count: int) -> Path:
    """`count` small samples in shards under s3://bucket/pre (written there by the shard writer), and
    a local manifest of them."""
    writer = ShardWriter(join(bucket, "pre"), "shard-r000", 4096)
    for i in range(count):
        writer.add(f"{i:08d}", save({"latent": torch.full((4, 1, 4, 4), float(i)), "text": torch.ones(3, 16)}))
    writer.close()
    members = read_indexes(join(bucket, "pre"))
    rows = [[f"{bucket}/pre/{members[i].shard}", members[i].offset, members[i].size, f"clip {i}"]
            for i in range(count)]
    return write_csv(folder / "remote.csv", ["latent_path", "latent_offset", "latent_size", "caption"], rows)


def loader_of(manifest: Path, workers: int = 0):
    return build_data_loader(small_config(video_csv_paths=[str(manifest)], packed_dataloader_num_workers=workers),
                             tokens_of=tokens_of, latent_tokens_of=lambda t, h, w: t * h * w, dp_rank=0,
                             dp_size=1, seed=0)


def steps(loader, n: int) -> list:
    return [[(s.sample_id, float(s.latent[0, 0, 0, 0])) for s in next(loader).samples] for _ in range(n)]


def test_a_server_restarted_mid_epoch_is_retried_and_nothing_is_skipped_or_repeated(s3_server, tmp_path,  # noqa: F811
                                                                                    monkeypatch):
    monkeypatch.setenv("PAN_DATA_CACHE_GB", "0")   # every read goes to the server
    manifest = sharded_manifest(make_bucket(), tmp_path, 12)
    expected = steps(loader_of(manifest), 8)
    monkeypatch.setenv("PAN_DATA_RETRIES", "12")
    transient = []
    monkeypatch.setattr(storage_module, "is_transient", lambda e: transient.append(e) or is_transient(e))
    loader = loader_of(manifest)
    got = steps(loader, 3)
    old = s3_server.process.pid
    s3_server.endpoint.stop()                                   # gone mid-epoch ...
    restarting = threading.Thread(target=s3_server.restart)   # ... restarted, and back with its objects
    restarting.start()
    got += steps(loader, 5)
    restarting.join()
    assert got == expected and not loader.bad_samples
    assert transient and all(is_transient(e) for e in transient)   # the outage was met, and retried
    assert s3_server.process.pid != old


@pytest.mark.parametrize("workers", [0, 1])
def test_an_outage_past_the_retries_stops_clearly_and_the_run_resumes_exactly(s3_server, tmp_path,  # noqa: F811
                                                                             monkeypatch, workers):
    monkeypatch.setenv("PAN_DATA_CACHE_GB", "0")
    manifest = sharded_manifest(make_bucket(), tmp_path, 12)
    expected = steps(loader_of(manifest), 8)
    monkeypatch.setenv("PAN_DATA_RETRIES", "2")
    loader = loader_of(manifest, workers)   # with a worker, its error crosses to the training process
    got = steps(loader, 3)
    checkpoint = loader.state_dict()
    s3_server.endpoint.stop()
    with pytest.raises(StorageError, match=r"s3://data/pre/shard-r000-\d+\.tar: gave up after 2 tries"):
        steps(loader, 5)
    assert not loader.bad_samples                               # nothing was taken for a bad sample
    s3_server.endpoint.start()
    resumed = loader_of(manifest)
    resumed.load_state_dict(checkpoint)
    assert got + steps(resumed, 5) == expected


def test_a_later_epoch_reads_the_members_from_the_local_cache(s3_server, tmp_path):  # noqa: F811
    manifest = sharded_manifest(make_bucket(), tmp_path, 6)
    first = steps(loader_of(manifest), 4)                       # every sample read at least once
    s3_server.endpoint.stop()                                   # no server: the cache alone answers
    assert steps(loader_of(manifest), 4) == first


def test_precompute_into_s3_then_train_from_its_shards(s3_server, tmp_path, capsys):  # noqa: F811
    bucket = make_bucket()
    clips = synth_dataset(tmp_path / "synth", num_train=4, num_heldout=1, size=32, num_frames=5)["train_csv"]
    argv = ["--config", str(REPO / "config/tiny_cpu.yaml"), "--video_csv_paths", str(clips),
            "--output_dir", str(tmp_path / "run"), "--out", f"{bucket}/pre", "--shards"]
    assert precompute_main(argv) == 0
    names = set(storage().listdir(f"{bucket}/pre")) | set(storage().listdir(f"{bucket}/pre/train"))
    assert {"train.csv", "failures.csv", "precompute.json", "shard-r000-000000.tar",
            "shard-r000-000000.index.json"} <= names
    assert precompute_main(argv) == 0                           # a rerun finds the shards in the bucket
    assert "0 latents written, 4 already there" in capsys.readouterr().out
    manifest = tmp_path / "train.csv"          # manifests are read from local files (the index's work)
    manifest.write_bytes(storage().read_bytes(f"{bucket}/pre/train.csv"))
    rows = list(csv.DictReader(open(manifest)))
    assert all(r["latent_path"] == f"{bucket}/pre/train/shard-r000-000000.tar" for r in rows)
    job = load_job_config(["--config", str(REPO / "config/tiny_cpu.yaml"), "--output_dir", str(tmp_path / "t"),
                           "--video_csv_paths", str(manifest), "--max_steps", "2", "--save_interval", "100000",
                           "--log_interval", "1000"], warn=lambda m: None)
    trainer = build_trainer(job)
    for _ in range(2):
        batches, _ = trainer.next_micro_batches()
        metrics = trainer.train_step(batches)
        assert metrics["finite"] and metrics["loss"] > 0


def test_clips_latent_files_and_text_features_are_read_from_s3(s3_server, tmp_path):  # noqa: F811
    """A clip CSV whose paths are s3:// URLs decodes as the same clips on local disk; a latent file
    and Pyramid-Flow's latent and text-feature files read from s3:// as from local disk."""
    bucket = make_bucket()
    local = synth_dataset(tmp_path / "synth", num_train=3, num_heldout=1, size=32, num_frames=5)["train_csv"]
    rows = list(csv.reader(open(local)))
    for row in rows[1:]:
        storage().write_bytes(f"{bucket}/clips/{row[0]}", (local.parent / row[0]).read_bytes())
        row[0] = f"{bucket}/clips/{row[0]}"
    (tmp_path / "remote").mkdir()
    remote = write_csv(tmp_path / "remote" / local.name, rows[0], rows[1:])   # the same stem: the same order

    def frames(path: Path):
        cfg = small_config(video_csv_paths=[str(path)], resolution_buckets=["32x32"])
        loader = build_data_loader(cfg, tokens_of=tokens_of, dp_rank=0, dp_size=1, seed=0)
        return [[(s.sample_id, s.frames.sum().item()) for s in next(loader).samples] for _ in range(3)]

    assert frames(remote) == frames(local)
    assert any((tmp_path / "storage-cache").iterdir())          # whole-file reads went through the cache

    latent = torch.arange(64.0).reshape(4, 1, 4, 4)
    storage().write_bytes(f"{bucket}/pre/0.safetensors", save({"latent": latent, "text": torch.ones(3, 16)}))
    manifest = write_csv(tmp_path / "pre.csv", ["latent_path", "caption"], [[f"{bucket}/pre/0.safetensors", "a"]])
    assert torch.equal(next(loader_of(manifest)).samples[0].latent, latent)
    features = {"prompt_embed": torch.ones(1, 5, 8), "prompt_attention_mask": torch.ones(1, 5),
                "pooled_prompt_embed": torch.ones(1, 4)}
    for name, obj in (("latent.pt", latent[None]), ("text.pt", features)):
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        storage().write_bytes(f"{bucket}/pyramid/{name}", buffer.getvalue())
    assert torch.equal(read_raw_latent(f"{bucket}/pyramid/latent.pt"), latent)
    assert read_text_features(f"{bucket}/pyramid/text.pt")["prompt_embed"].shape == (5, 8)
    with pytest.raises(FileNotFoundError):                      # a missing object: at once, no retries
        read_raw_latent(f"{bucket}/pyramid/missing.pt")


# ----------------------------------------------------------------------------------------------
# Manifests, annotation files and image tars at URLs
# ----------------------------------------------------------------------------------------------

def remote_and_local_manifests(bucket: str, tmp_path: Path) -> tuple[list[str], list[str]]:
    """A video CSV and a JSONL annotation file, each at s3://bucket/set/ and in the local folder of the
    same clips; half their cells relative (to the manifest's folder), half absolute s3:// URLs."""
    synth = synth_dataset(tmp_path / "synth", num_train=4, num_heldout=1, size=32, num_frames=5)["train_csv"]
    header, *rows = list(csv.reader(open(synth)))
    for row in rows:
        storage().write_bytes(f"{bucket}/set/{row[0]}", (synth.parent / row[0]).read_bytes())
    cells = [row[0] if i % 2 else f"{bucket}/set/{row[0]}" for i, row in enumerate(rows)]
    table = io.StringIO()
    csv.writer(table).writerows([header, *([c, *row[1:]] for c, row in zip(cells, rows))])
    lines = "".join(json.dumps({"video": c, "text": f"note {i}"}) + "\n" for i, c in enumerate(reversed(cells)))
    paths = ([], [])
    for name, text in (("clips.csv", table.getvalue()), ("notes.jsonl", lines)):
        storage().write_text(f"{bucket}/set/{name}", text)
        (synth.parent / name).write_text(text)
        paths[0].append(f"{bucket}/set/{name}")
        paths[1].append(str(synth.parent / name))
    return paths


def trained_ids(tmp_path: Path, manifests: list[str], run: str) -> list[list[str]]:
    """The sample ids of 2 training steps of tiny_cpu.yaml on a video CSV and an annotation file."""
    job = load_job_config(["--config", str(REPO / "config/tiny_cpu.yaml"), "--output_dir", str(tmp_path / run),
                           "--video_csv_paths", manifests[0], "--annotation_paths", manifests[1],
                           "--max_steps", "2", "--save_interval", "100000", "--log_interval", "1000"],
                          warn=lambda m: None)
    trainer, ids = build_trainer(job), []
    for _ in range(2):
        batches, _ = trainer.next_micro_batches()
        assert trainer.train_step(batches)["finite"]
        ids.append([i for b in batches for i in b.sample_ids])
    return ids


def test_manifests_at_s3_train_on_the_samples_of_their_local_copies(s3_server, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("PAN_INDEX_DIR", str(tmp_path / "indexes"))
    remote, local = remote_and_local_manifests(make_bucket(), tmp_path)
    got = trained_ids(tmp_path, remote, "remote")
    indexes = sorted(p.name for p in (tmp_path / "indexes").iterdir())   # local files, built from the objects
    assert indexes == sorted(index_candidates(url)[0].name for url in remote), indexes
    assert got == trained_ids(tmp_path, local, "local") and all(got), got


def test_an_image_tar_at_s3_reads_its_images_one_ranged_get_each(s3_server, tmp_path, monkeypatch):  # noqa: F811
    from test_data_sources import image_bytes

    monkeypatch.setenv("PAN_INDEX_DIR", str(tmp_path / "indexes"))
    tar = tmp_path / "images.tar"
    with tarfile.open(tar, "w") as f:
        members = (("a.jpg", image_bytes(48, 32, 1)), ("a.txt", b"an image"), ("b.png", image_bytes(32, 48, 2, "PNG")))
        for key, data in members:
            info = tarfile.TarInfo(key)
            info.size = len(data)
            f.addfile(info, io.BytesIO(data))
    url = f"{make_bucket()}/images.tar"
    storage().write_bytes(url, tar.read_bytes())
    remote, here = read_image_tars([url]), read_image_tars([tar])
    assert remote.paths == [url] and remote.names == ["images"] and len(remote) == 2
    reads = []
    real = Storage.read_range
    monkeypatch.setattr(Storage, "read_range", lambda self, path, *span: reads.append(path) or real(self, path, *span))
    assert [remote.read(remote.images[i]) for i in range(2)] == [here.read(here.images[i]) for i in range(2)]
    assert reads.count(url) == 3                                # the two images and the one caption


def test_the_index_of_a_remote_manifest_is_kept_locally_and_rebuilt_when_the_object_changes(  # noqa: F811
        s3_server, tmp_path, monkeypatch):
    monkeypatch.setenv("PAN_INDEX_DIR", str(tmp_path / "indexes"))
    url = f"{make_bucket()}/set/clips.csv"
    storage().write_text(url, "path,caption\na.mp4,one\n")
    builds = []
    real = index_module.write_index
    monkeypatch.setattr(index_module, "write_index", lambda *a, **k: builds.append(a[0]) or real(*a, **k))
    first = read_video_csv(url)
    assert len(first) == 1 and first.resolve("a.mp4") == "s3://data/set/a.mp4"
    assert len(read_video_csv(url)) == 1 and builds == [url]   # the same object: the index is reused
    storage().write_text(url, "path,caption\na.mp4,one\nb.mp4,two\n")   # a new version
    assert read_video_csv(url).rows[1] == ["b.mp4", "two"] and builds == [url, url]
    assert [p.name for p in (tmp_path / "indexes").iterdir()] == [index_candidates(url)[0].name]


def test_pan_data_index_builds_the_local_index_of_a_remote_manifest_that_training_then_reuses(  # noqa: F811
        s3_server, tmp_path, monkeypatch, capsys):
    from pan.data.index import main as index_main

    monkeypatch.setenv("PAN_INDEX_DIR", str(tmp_path / "indexes"))
    url = f"{make_bucket()}/set/clips.csv"
    storage().write_text(url, "path,caption\na.mp4,one\nb.mp4,two\n")
    assert index_main([url]) == 0
    assert f"{url}: 2 rows -> {index_candidates(url)[0]} (built in" in capsys.readouterr().out
    builds = []
    real = index_module.write_index
    monkeypatch.setattr(index_module, "write_index", lambda *a, **k: builds.append(a[0]) or real(*a, **k))
    assert len(read_video_csv(url)) == 2 and builds == []        # training's read reuses it
    assert index_main([url]) == 0 and "(up to date)" in capsys.readouterr().out
    # a missing object, or a URL whose name no reader knows: one line, exit 2
    assert index_main([f"{make_bucket('other')}/set/gone.csv"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pan data index: ") and "gone.csv" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as exited:
        index_main([f"{make_bucket('third')}/set/clips.txt"])
    assert exited.value.code == 2 and "ends in .txt" in capsys.readouterr().err


def test_pan_check_counts_the_rows_of_a_remote_manifest(s3_server, tmp_path, monkeypatch):  # noqa: F811
    from pan.preflight import Preflight, run_preflight

    monkeypatch.setenv("PAN_INDEX_DIR", str(tmp_path / "indexes"))
    remote, _ = remote_and_local_manifests(make_bucket(), tmp_path)
    job = load_job_config(["--config", str(REPO / "config/tiny_cpu.yaml"), "--video_csv_paths", remote[0],
                           "--annotation_paths", remote[1], "--output_dir", str(tmp_path / "run")],
                          warn=lambda msg: None)
    rows = [row for row in run_preflight(Preflight(job, 1, 1)) if row.check == "data"]
    assert rows and all(row.status == "pass" for row in rows), rows
    assert "4 samples" in rows[0].detail, rows[0].detail


def test_a_store_unreachable_while_training_stops_with_one_line_naming_the_url(s3_server, tmp_path,  # noqa: F811
                                                                              monkeypatch, capsys):
    from pan.trainer import train

    monkeypatch.setenv("PAN_DATA_CACHE_GB", "0")
    monkeypatch.setenv("PAN_DATA_RETRIES", "1")
    remote, local = remote_and_local_manifests(make_bucket(), tmp_path)   # local manifests, s3:// clips
    job = load_job_config(["--config", str(REPO / "config/tiny_cpu.yaml"), "--output_dir", str(tmp_path / "run"),
                           "--video_csv_paths", local[0], "--max_steps", "2", "--save_interval", "100000"],
                          warn=lambda m: None)
    s3_server.endpoint.stop()
    assert train(job) == 1
    text = capsys.readouterr().err
    err = [line for line in text.splitlines() if line.startswith("pan:")]
    assert len(err) == 1 and "Traceback" not in text, text
    assert err[0].startswith("pan: stopped: s3://data/set/") and "gave up after 1 tries" in err[0], err
    assert "continues exactly" in err[0]

"""Read-ahead of remote shard members (pan/data/storage.py ReadAhead, SampleReader.read_all): the
members a decoding worker's next visits read are fetched concurrently, at most PAN_DATA_READ_AHEAD
at a time, and the reader takes them when it gets there. It only warms bytes: the samples, their
order and every skip are those of a reader without it, and a fetch that fails leaves the member to
the normal read (its retries, its skip of a bad sample). On an in-memory store whose reads can wait
for each other (Storage with only its object-store client replaced), then against the S3 server."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

import pan.data.reader as reader_module
import pan.data.shards as shards_module
from pan.data.packed import ChunkReader
from pan.data.plan import Ref
from pan.data.reader import KnownBad, SampleReader, rules_of, stream_name
from pan.data.shards import ShardWriter, read_indexes
from pan.data.sources import read_video_csv
from pan.data.storage import RetryPolicy, Settings, Storage
from s3_server import Endpoint, s3_server  # noqa: F401  (a fixture)
from test_data_s3 import make_bucket, sharded_manifest
from test_data_sources import small_config, write_csv

RULES = rules_of(small_config())


def sample_bytes(i: int) -> bytes:
    return save({"latent": torch.full((4, 1, 4, 4), float(i)), "text": torch.ones(3, 16)})


def shards_in_memory(folder: Path, count: int) -> tuple[dict[str, bytes], list[list]]:
    """`count` samples in tar shards written locally, as the objects of s3://data/pre (name ->
    bytes), and the manifest rows pointing at their members."""
    writer = ShardWriter(folder / "pre", "shard-r000", 4096)
    for i in range(count):
        writer.add(f"{i:08d}", sample_bytes(i))
    writer.close()
    objects = {f"data/pre/{p.name}": p.read_bytes() for p in (folder / "pre").glob("*.tar")}
    members = read_indexes(folder / "pre")
    rows = [[f"s3://data/pre/{members[i].shard}", members[i].offset, members[i].size, f"clip {i}"]
            for i in range(count)]
    return objects, rows


class MemoryFs:
    """The part of an fsspec filesystem that Storage's member reads use, over `objects`; each
    cat_file passes `gate` first (which may wait, count or fail it)."""

    def __init__(self, objects: dict[str, bytes], gate):
        self.objects, self.gate = objects, gate

    def info(self, path: str) -> dict:
        if path not in self.objects:
            raise FileNotFoundError(path)
        return {"type": "file", "size": len(self.objects[path]), "ETag": '"v1"'}

    def invalidate_cache(self, path: str) -> None:
        pass

    def cat_file(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        self.gate(path, start)
        if path not in self.objects:
            raise FileNotFoundError(path)
        return self.objects[path][start:end]


class MemoryStore(Storage):
    """A Storage (retries, cache, read-ahead: all its own) whose object-store client is MemoryFs."""

    def __init__(self, settings: Settings, fs: MemoryFs):
        self.sleeps: list[float] = []
        super().__init__(settings, sleep=self.sleeps.append)
        self.fs = fs

    def _fs(self, url: str):
        return self.fs, url.split("://", 1)[1]


class InFlight:
    """A gate that counts the requests in flight at once and holds each until `want` have been in
    flight together (or `patience` seconds pass: then `waited_out` is set)."""

    def __init__(self, want: int, patience: float = 5.0):
        self.want, self.patience = want, patience
        self.cond = threading.Condition()
        self.now = self.most = 0
        self.waited_out = False

    def __call__(self, path: str, start: int) -> None:
        with self.cond:
            self.now += 1
            self.most = max(self.most, self.now)
            self.cond.notify_all()
            if not self.cond.wait_for(lambda: self.most >= self.want, timeout=self.patience):
                self.waited_out = True
            self.now -= 1


def reader_on(store: Storage, manifest: Path, monkeypatch) -> tuple[SampleReader, str]:
    """A SampleReader of `manifest` whose reads (the shard reader's and read-ahead's) go to `store`."""
    monkeypatch.setattr(reader_module, "storage", lambda: store)
    monkeypatch.setattr(shards_module, "storage", lambda: store)
    source = read_video_csv(manifest)
    return SampleReader({stream_name(source): source}, None, RULES), stream_name(source)


def outcomes(loaded) -> list[tuple]:
    return [(got.ref.index, got.reason, got.sample and float(got.sample.latent[0, 0, 0, 0])) for got in loaded]


def visits_of(stream: str, rows: list[int]) -> list[Ref]:
    return [Ref(seq, stream, 0, seq, row) for seq, row in enumerate(rows)]


def test_read_ahead_has_several_requests_in_flight_at_once_and_reads_the_same_samples(tmp_path, monkeypatch):
    objects, rows = shards_in_memory(tmp_path, 12)
    manifest = write_csv(tmp_path / "remote.csv", ["latent_path", "latent_offset", "latent_size", "caption"], rows)
    gate = InFlight(want=4)
    store = MemoryStore(Settings(tmp_path / "cache", 0, RetryPolicy(tries=3), read_ahead=4), MemoryFs(objects, gate))
    reader, stream = reader_on(store, manifest, monkeypatch)
    order = [7, 2, 11, 0, 5, 9, 1, 3, 10, 4, 8, 6]
    got = ChunkReader(reader)[visits_of(stream, order)]   # what a decoding worker does with a message
    assert gate.most >= 4 and not gate.waited_out   # 4 ranged GETs were in flight together
    assert outcomes(got) == [(i, "", float(i)) for i in order]

    one_at_a_time = MemoryStore(Settings(tmp_path / "cache", 0, RetryPolicy(tries=3), read_ahead=0),
                                MemoryFs(objects, gate := InFlight(want=2, patience=0.01)))
    reader, stream = reader_on(one_at_a_time, manifest, monkeypatch)
    assert outcomes(reader.read_all(visits_of(stream, order))) == outcomes(got)
    assert gate.most == 1 and one_at_a_time.pool is None   # PAN_DATA_READ_AHEAD=0: no read-ahead


def test_read_ahead_holds_at_most_its_depth_of_members(tmp_path, monkeypatch):
    objects, rows = shards_in_memory(tmp_path, 12)
    manifest = write_csv(tmp_path / "remote.csv", ["latent_path", "latent_offset", "latent_size", "caption"], rows)
    store = MemoryStore(Settings(tmp_path / "cache", 1 << 20, RetryPolicy(tries=3), read_ahead=3),
                        MemoryFs(objects, lambda path, start: time.sleep(0.002)))
    counts = {"fetched": 0, "read": 0, "ahead": 0}
    fetch, read = store.fetch_member, store.read_member

    def fetch_member(*span):
        counts["fetched"] += 1
        counts["ahead"] = max(counts["ahead"], counts["fetched"] - counts["read"])
        return fetch(*span)

    def read_member(*span):
        counts["read"] += 1
        return read(*span)

    monkeypatch.setattr(store, "fetch_member", fetch_member)
    monkeypatch.setattr(store, "read_member", read_member)
    reader, stream = reader_on(store, manifest, monkeypatch)
    got = reader.read_all(visits_of(stream, list(range(12))))
    assert outcomes(got) == [(i, "", float(i)) for i in range(12)]
    assert counts["fetched"] == 12 and counts["ahead"] <= 3   # never more than 3 members ahead of the reader
    # the second pass: the members are in the local cache, so nothing is fetched ahead
    assert outcomes(reader.read_all(visits_of(stream, list(range(12))))) == outcomes(got)
    assert counts["fetched"] == 12


class DropsFirstTries:
    """A gate that fails the first `failures` requests of each member (a reset connection)."""

    def __init__(self, failures: int):
        self.failures, self.calls = failures, {}

    def __call__(self, path: str, start: int) -> None:
        self.calls[path, start] = self.calls.get((path, start), 0) + 1
        if self.calls[path, start] <= self.failures:
            raise ConnectionResetError(f"{path}: reset")


def test_a_failed_read_ahead_falls_back_to_the_normal_read_with_its_retries_and_skips(tmp_path, monkeypatch):
    objects, rows = shards_in_memory(tmp_path, 8)
    rows[3][0] = "s3://data/pre/gone.tar"                               # a missing object
    shard = rows[7][0].split("://", 1)[1]
    members = read_indexes(tmp_path / "pre")
    objects[shard] = objects[shard][:members[7].offset + members[7].size // 2]   # 7's shard breaks off in it
    manifest = write_csv(tmp_path / "remote.csv", ["latent_path", "latent_offset", "latent_size", "caption"], rows)
    order = [5, 3, 0, 7, 2, 6, 1, 4]
    visits = visits_of(stream_name(read_video_csv(manifest)), order)
    visits[4] = KnownBad(visits[4], "decode_error")                     # row 2 is in the record: not read
    results = {}
    for ahead in (0, 8):
        gate = DropsFirstTries(failures=2)
        store = MemoryStore(Settings(tmp_path / f"cache-{ahead}", 1 << 20, RetryPolicy(tries=4), read_ahead=ahead),
                            MemoryFs(objects, gate))
        reader, _ = reader_on(store, manifest, monkeypatch)
        results[ahead] = outcomes(reader.read_all(visits))
        # each good member: its 2 failed tries, then its answer. Read ahead, the first failed try
        # is the fetch ahead's (one try, no wait), and the normal read's retries did the rest
        fetched = {key: n for key, n in gate.calls.items() if not key[0].endswith("gone.tar")}
        assert set(fetched.values()) == {3}, fetched
        assert len(store.sleeps) == (2 if ahead == 0 else 1) * len(fetched)
    assert results[8] == results[0]
    skipped = {index: reason for index, reason, sample in results[8] if sample is None}
    assert skipped == {3: "missing_file", 7: "decode_error", 2: "decode_error"}
    assert [(i, v) for i, _, v in results[8] if v is not None] == [(i, float(i)) for i in (5, 0, 6, 1, 4)]


def test_local_shards_are_not_read_ahead(tmp_path, monkeypatch):
    writer = ShardWriter(tmp_path / "pre", "shard-r000", 4096)
    for i in range(6):
        writer.add(f"{i:08d}", sample_bytes(i))
    writer.close()
    members = read_indexes(tmp_path / "pre")
    manifest = write_csv(tmp_path / "local.csv", ["latent_path", "latent_offset", "latent_size", "caption"],
                         [[f"pre/{members[i].shard}", members[i].offset, members[i].size, f"clip {i}"]
                          for i in range(6)])
    store = MemoryStore(Settings(tmp_path / "cache", 0, RetryPolicy(), read_ahead=8), MemoryFs({}, None))
    reader, stream = reader_on(store, manifest, monkeypatch)
    assert outcomes(reader.read_all(visits_of(stream, [4, 1, 5, 0]))) == [(i, "", float(i)) for i in (4, 1, 5, 0)]
    assert store.pool is None and not any(map(reader.remote_member, visits_of(stream, range(6))))


def test_a_bad_read_ahead_setting_is_refused(monkeypatch):
    for value, why in (("many", "is not an integer"), ("-1", "is below 0")):
        monkeypatch.setenv("PAN_DATA_READ_AHEAD", value)
        with pytest.raises(ValueError, match=f"PAN_DATA_READ_AHEAD='{value}' {why}"):
            Settings.from_env()
    monkeypatch.setenv("PAN_DATA_READ_AHEAD", "0")
    assert Settings.from_env().read_ahead == 0
    monkeypatch.delenv("PAN_DATA_READ_AHEAD")
    assert Settings.from_env().read_ahead == 16


# ----------------------------------------------------------------------------------------------
# Against the S3 server
# ----------------------------------------------------------------------------------------------

class RequestsInFlight:
    """The S3 server's requests in flight, seen by the relay in front of it (tests/s3_server.py
    Endpoint.first_bytes): each connection from its request's first bytes to its answer's."""

    def __init__(self):
        self.lock = threading.Lock()
        self.asked: set[frozenset] = set()
        self.now = self.most = 0

    def __call__(self, src, dst, data: bytes) -> None:
        connection = frozenset((id(src), id(dst)))
        with self.lock:
            if not data.startswith(b"HTTP/"):     # a request, on its way to the server
                self.asked.add(connection)
                self.now += 1
                self.most = max(self.most, self.now)
            elif connection in self.asked:         # its answer, on its way back
                self.asked.discard(connection)
                self.now -= 1


def test_the_first_epoch_from_s3_has_several_gets_in_flight_and_reads_the_same_samples(  # noqa: F811
        s3_server, tmp_path, monkeypatch):
    monkeypatch.setenv("PAN_DATA_CACHE_GB", "0")   # every read goes to the server
    manifest = sharded_manifest(make_bucket(), tmp_path, 16)
    source = read_video_csv(manifest)
    visits = visits_of(stream_name(source), [(5 * i + 3) % 16 for i in range(16)])
    results, most = {}, {}
    for ahead in ("0", "8"):
        monkeypatch.setenv("PAN_DATA_READ_AHEAD", ahead)   # a new Storage
        counter = RequestsInFlight()
        monkeypatch.setattr(Endpoint, "first_bytes", staticmethod(counter))
        results[ahead] = outcomes(ChunkReader(SampleReader({stream_name(source): source}, None, RULES))[visits])
        most[ahead] = counter.most
    assert results["8"] == results["0"] == [(v.index, "", float(v.index)) for v in visits]
    assert most["0"] == 1 and most["8"] >= 4, most   # one GET at a time without read-ahead; several with

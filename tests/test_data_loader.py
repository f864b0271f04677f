"""The packed loader: determinism, data-parallel shares, mixing, exact resume, precomputed rows."""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import pan
from pan.data import DataResumeError, build_data_loader
from test_data_sources import CARPHONE, clips_csv, images_tar, small_config, tokens_of, write_csv

TESTS_DIR = Path(__file__).parent


def fingerprint(batch) -> list:
    """What must be equal between two runs: ids, kinds, captions and the pixels themselves."""
    return [[s.sample_id, s.kind, s.caption, s.tokens, hashlib.sha256(s.frames.numpy().tobytes()).hexdigest()]
            for s in batch.samples]


def take(loader, n: int) -> list:
    return [fingerprint(next(loader)) for _ in range(n)]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    return {"csv": clips_csv(root / "clips.csv"), "tar": images_tar(root / "shard.tar", 10), "root": root}


def mixed_config(data, **kw):
    return small_config(video_csv_paths=[str(data["csv"])], image_tar_paths=[str(data["tar"])],
                        image_sample_prob=0.3, **kw)


def loader_of(cfg, rank=0, size=1, seed=0):
    return build_data_loader(cfg, tokens_of=tokens_of, dp_rank=rank, dp_size=size, seed=seed)


def test_batches_are_packed_within_budget_and_report_efficiency(data):
    loader = loader_of(mixed_config(data))
    kinds = collections.Counter()
    for _ in range(8):
        batch = next(loader)
        assert batch.tokens == sum(s.tokens for s in batch.samples) <= batch.token_budget == 64
        assert 0 < batch.packing_efficiency <= 1 and len(batch.samples) <= 8
        for s in batch.samples:
            kinds[s.kind] += 1
            assert s.frames.dtype == torch.uint8 and s.frames.shape[1] == 3
            assert s.tokens == tokens_of(*s.grid) and s.grid == (s.frames.shape[0], *s.frames.shape[2:])
            assert s.frames.shape[0] == (1 if s.kind == "image" else 5)
    assert kinds["image"] > 0 and kinds["video"] > 0


def test_same_seed_same_stream_other_seed_other_stream(data):
    cfg = mixed_config(data)
    first = take(loader_of(cfg, seed=7), 3)
    assert take(loader_of(cfg, seed=7), 3) == first
    assert take(loader_of(cfg, seed=8), 3) != first


def test_workers_give_the_same_stream(data):
    assert take(loader_of(mixed_config(data, packed_dataloader_num_workers=2)), 4) == \
        take(loader_of(mixed_config(data)), 4)


def test_ranks_read_disjoint_shares_in_a_new_order_each_epoch(data):
    cfg = mixed_config(data)
    plans = {}
    for rank in range(2):
        planner = loader_of(cfg, rank=rank, size=2).planner.copy()
        refs = [planner.next_ref() for _ in range(60)]
        plans[rank] = [r for r in refs if r.stream == "video:clips"]
    share = len(loader_of(cfg, rank=0, size=2).reader.sources["video:clips"]) // 2
    for epoch in (0, 1):
        ours = [[r.index for r in plans[rank] if r.epoch == epoch] for rank in range(2)]
        assert all(len(x) == share for x in ours)
        assert not set(ours[0]) & set(ours[1])
    epochs = [[r.index for r in plans[0] if r.epoch == e] for e in (0, 1)]
    assert epochs[0] != epochs[1]  # reshuffled per epoch


def test_mixing_follows_image_prob_and_csv_weights(data, tmp_path):
    other = clips_csv(tmp_path / "other.csv", seconds=2, videos=(CARPHONE,))  # 2 rows vs clips' 8
    cfg = small_config(video_csv_paths=[str(data["csv"]), str(other)], image_tar_paths=[str(data["tar"])],
                       image_sample_prob=0.25)

    def counts(cfg):
        planner = loader_of(cfg).planner.copy()
        return collections.Counter(planner.next_ref().stream for _ in range(4000))
    got = counts(cfg)  # weights null: proportional to rows, 8 : 2
    assert abs(got["images"] / 4000 - 0.25) < 0.03
    assert abs(got["video:clips"] / (got["video:clips"] + got["video:other"]) - 0.8) < 0.03
    got = counts(dataclasses.replace(cfg, video_csv_weights=[1.0, 3.0]))
    assert abs(got["video:clips"] / (got["video:clips"] + got["video:other"]) - 0.25) < 0.03


@pytest.mark.parametrize("dp_size,workers", [(1, 0), (2, 0), (1, 2), (2, 2)])
def test_resume_continues_exactly(data, dp_size, workers):
    cfg = mixed_config(data, packed_dataloader_num_workers=workers)
    for rank in range(dp_size):
        straight = take(loader_of(cfg, rank, dp_size), 7)
        first = loader_of(cfg, rank, dp_size)
        assert take(first, 3) == straight[:3]
        state = json.loads(json.dumps(first.state_dict()))
        assert state["buffer"], "the test should save while samples wait in the lookahead buffer"
        first.close()
        second = loader_of(cfg, rank, dp_size)
        second.load_state_dict(state)
        assert take(second, 4) == straight[3:]


def test_resume_in_a_fresh_process(data, tmp_path):
    cfg = mixed_config(data, packed_dataloader_num_workers=2)
    straight = take(loader_of(cfg, 1, 2), 6)
    first = loader_of(cfg, 1, 2)
    take(first, 2)
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"cfg": dataclasses.asdict(cfg), "state": first.state_dict()}))
    first.close()
    script = (
        "import json, sys\n"
        f"sys.path.insert(0, {str(TESTS_DIR)!r})\n"
        "from pan.data import DataConfig, build_data_loader\n"
        "from test_data_loader import take\n"
        "from test_data_sources import tokens_of\n"
        "job = json.load(open(sys.argv[1]))\n"
        "loader = build_data_loader(DataConfig(**job['cfg']), tokens_of=tokens_of, dp_rank=1, dp_size=2, seed=0)\n"
        "loader.load_state_dict(job['state'])\n"
        "print(json.dumps(take(loader, 4)))\n")
    repo = Path(pan.__file__).parents[1]
    out = subprocess.run([sys.executable, "-c", script, str(job)], cwd=repo, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == straight[2:]


def test_resume_video_csv_false_restarts_videos_and_keeps_images(data):
    cfg = mixed_config(data)
    first = loader_of(cfg)
    take(first, 4)
    state = first.state_dict()
    assert state["planner"]["streams"]["video:clips"] != {"epoch": 0, "pos": 0, "size": 8}
    second = loader_of(dataclasses.replace(cfg, resume_video_csv=False))
    second.load_state_dict(state)
    assert second.planner.cursor["video:clips"] == (0, 0)
    assert second.planner.cursor["images"] == first.planner.cursor["images"]
    assert all(r.stream == "images" for r in second.replay)
    assert len(second.replay) == sum(s == "images" for _, s, *_ in state["buffer"])

    def next_indices(planner, stream, n):
        planner = planner.copy()
        out = []
        while len(out) < n:
            ref = planner.next_ref()
            if ref.stream == stream:
                out.append(ref.index)
        return out
    fresh = loader_of(cfg).planner
    assert next_indices(second.planner, "video:clips", 5) == next_indices(fresh, "video:clips", 5)
    assert next_indices(second.planner, "images", 5) == next_indices(first.planner, "images", 5)
    next(second)  # and it runs


def test_different_dp_size_is_refused_unless_restart_is_allowed(data):
    cfg = mixed_config(data)
    old = loader_of(cfg, 0, 2)
    take(old, 2)
    state = old.state_dict()
    with pytest.raises(DataResumeError, match="restart_data_on_dp_change"):
        loader_of(cfg, 0, 1).load_state_dict(state)
    with pytest.raises(DataResumeError, match="rank 0"):
        loader_of(cfg, 1, 2).load_state_dict(state)
    allowed = loader_of(dataclasses.replace(cfg, restart_data_on_dp_change=True), 0, 1)
    allowed.load_state_dict(state)
    assert take(allowed, 2) == take(loader_of(cfg, 0, 1), 2)  # every stream from the top


def recorded(loader) -> list:
    """The references of every sample `loader` hands out from now on, in order."""
    refs, take = [], loader.packer.take

    def take_and_record():
        chosen = take()
        refs.extend(p.item[0] for p in chosen)
        return chosen
    loader.packer.take = take_and_record
    return refs


def holds_head_samples(loader) -> bool:
    return any(loader.planner.head.values()) or any(p.item[0].pos < 0 for p in loader.packer.buffer)


@pytest.mark.parametrize("old_dp,new_dp", [(4, 2), (2, 3)])
def test_a_new_data_parallel_size_continues_without_losing_or_repeating_a_sample(data, old_dp, new_dp):
    """Old ranks stop at different points (samples waiting in their buffers); the new ranks finish
    the old epochs first, then continue with their own shares: within every epoch each sample the
    old layout would have trained is trained exactly once. A same-size resume inside the head
    continues it exactly."""
    cfg = mixed_config(data)
    consumed, states, bad = [], [], set()
    for rank in range(old_dp):
        old = loader_of(cfg, rank, old_dp)
        refs = recorded(old)
        take(old, 2 + rank)
        consumed += refs
        states.append(json.loads(json.dumps(old.state_dict())))
        old.close()
    assert any(state["buffer"] for state in states)
    for rank in range(new_dp):
        new = loader_of(cfg, rank, new_dp)
        new.load_elastic_state(states)
        refs = recorded(new)
        if rank == 0:  # save inside the head, resume with the same size: the same samples follow
            take(new, 1)
            consumed += refs
            again = loader_of(cfg, rank, new_dp)
            again.load_state_dict(json.loads(json.dumps(new.state_dict())))
            assert any(again.planner.head.values())
            refs = recorded(again)
            assert take(again, 3) == take(new, 3)
            new = again
        while holds_head_samples(new):
            next(new)
        consumed += refs
        bad |= set(new.known_bad)  # skipped samples (too short...) are never trained
    keys = [(r.stream, r.epoch, r.index) for r in consumed]
    assert len(keys) == len(set(keys)), "a sample was trained twice in one epoch"
    for stream, order in loader_of(cfg, 0, old_dp).planner.streams.items():
        last = max(state["planner"]["streams"][stream]["epoch"] for state in states)
        for epoch in range(last + 1):
            got = {index for s, e, index in keys if s == stream and e == epoch}
            expected = {order.at(epoch, slot) for slot in range(order.share * old_dp)}
            assert got == {i for i in expected if (stream, i) not in bad}, (stream, epoch)


def test_precomputed_rows_are_read_without_decoding(tmp_path):
    (tmp_path / "latents").mkdir()
    rows = []
    for i, (t, h, w) in enumerate([(3, 4, 6), (1, 4, 4), (2, 6, 4)]):
        save_file({"latent": torch.full((4, t, h, w), float(i)), "text": torch.randn(5 + i, 16)},
                  str(tmp_path / "latents" / f"{i}.safetensors"))
        rows.append([f"latents/{i}.safetensors", f"clip {i}"])
    csv_path = write_csv(tmp_path / "pre.csv", ["latent_path", "caption"], rows)
    cfg = small_config(video_csv_paths=[str(csv_path)], max_tokens_per_batch=200, packing_lookahead=3)
    with pytest.raises(ValueError, match="latent_tokens_of"):
        loader_of(cfg)
    latent_tokens = lambda t, h, w: t * (h // 2) * (w // 2)  # noqa: E731
    loader = build_data_loader(cfg, tokens_of=tokens_of, latent_tokens_of=latent_tokens,
                               dp_rank=0, dp_size=1, seed=0)
    batch = next(loader)
    assert {s.sample_id for s in batch.samples} == {"pre:0", "pre:1", "pre:2"}
    for s in batch.samples:
        i = int(s.sample_id[-1])
        assert s.frames is None and s.latent.shape[1:] == s.grid and s.text.shape == (5 + i, 16)
        assert torch.all(s.latent == i) and s.tokens == latent_tokens(*s.grid)


@pytest.mark.parametrize("workers, batch_samples, per_message", [(1, 8, 8), (3, 8, 3), (1, 40, 16)])
def test_a_worker_sends_its_share_of_a_batch_as_one_message(data, workers, batch_samples, per_message):
    """One round trip per ceil(max_samples_per_batch / workers) samples (at most
    MAX_SAMPLES_PER_MESSAGE), not one per sample (~0.5 ms of the training process's time each), the
    samples in the plan's order; prefetch_factor whole batches still in flight."""
    from pan.data.packed import MAX_SAMPLES_PER_MESSAGE

    assert MAX_SAMPLES_PER_MESSAGE == 16
    cfg = mixed_config(data, packed_dataloader_num_workers=workers, max_samples_per_batch=batch_samples)
    loader = loader_of(cfg)
    assert loader.samples_in_flight() >= cfg.packed_dataloader_prefetch_factor * batch_samples
    messages = iter(loader._data_loader())
    received = [next(messages) for _ in range(2 * workers)]
    del messages  # stops the workers
    assert [len(message) for message in received] == [per_message] * (2 * workers)
    plan = loader.planner.copy()
    assert [got.ref for message in received for got in message] == \
        [plan.next_ref() for _ in range(2 * workers * per_message)]


def test_samples_cross_from_workers_intact_small_tensors_by_value(monkeypatch):
    """Small tensors travel inside the message (no per-tensor fd handshake), large ones through
    shared memory; both arrive equal, dtype and shape included."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers the shared-memory reductions)
    from pan.data.batch import Sample

    g = torch.Generator().manual_seed(0)
    sample = Sample(sample_id="a:0", kind="video", caption="c", grid=(5, 32, 32), tokens=320,
                    frames=torch.randint(0, 255, (5, 3, 32, 32), dtype=torch.uint8, generator=g),
                    latent=torch.randn(4, 2, 8, 8, generator=g).to(torch.bfloat16),
                    text=torch.randn(0, 16, generator=g))
    by_value = ForkingPickler.dumps(sample)
    monkeypatch.setattr(Sample, "BY_VALUE_BYTES", 0)
    shared = ForkingPickler.dumps(sample)
    assert len(by_value) > sample.frames.nbytes > len(shared)
    for message in (by_value, shared):
        got = ForkingPickler.loads(message)
        for key in ("frames", "latent", "text"):
            assert getattr(got, key).dtype == getattr(sample, key).dtype
            assert torch.equal(getattr(got, key), getattr(sample, key)), key
        assert got.sample_id == sample.sample_id and got.grid == sample.grid


def latent_rows(folder: Path, count: int) -> Path:
    """A precomputed CSV of `count` small latent rows (safetensors files under folder/latents)."""
    (folder / "latents").mkdir(parents=True)
    rows = []
    for i in range(count):
        save_file({"latent": torch.full((4, 1, 4, 4), float(i)), "text": torch.randn(3, 16)},
                  str(folder / "latents" / f"{i}.safetensors"))
        rows.append([f"latents/{i}.safetensors", f"clip {i}"])
    return write_csv(folder / "pre.csv", ["latent_path", "caption"], rows)


def latent_loader(cfg):
    return build_data_loader(cfg, tokens_of=tokens_of, latent_tokens_of=lambda t, h, w: t * h * w,
                             dp_rank=0, dp_size=1, seed=0)


def latent_fingerprints(loader, n: int) -> list:
    return [[(s.sample_id, hashlib.sha256(s.latent.numpy().tobytes() + s.text.numpy().tobytes()).hexdigest())
             for s in next(loader).samples] for _ in range(n)]


@pytest.mark.parametrize("workers", [0, 1])
def test_sample_cache_serves_later_epochs_without_reading_the_files_again(tmp_path, monkeypatch, workers):
    """With sample_cache_mb a process reads each row's file once (a decoding worker; with workers the
    training process too, for a row it settles itself: Visits), and the stream is exactly an uncached
    run's; without it every visit reads the file."""
    import pan.data.reader as reader

    csv_path = latent_rows(tmp_path, 6)
    log, load_file = tmp_path / "reads.txt", reader.load_file

    def logged_load_file(path, *args, **kwargs):   # a line per read, from whichever process reads
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {Path(path).name}\n")
        return load_file(path, *args, **kwargs)

    monkeypatch.setattr(reader, "load_file", logged_load_file)
    cfg = small_config(video_csv_paths=[str(csv_path)], max_tokens_per_batch=200, max_samples_per_batch=2,
                       packing_lookahead=2, packed_dataloader_num_workers=workers)
    expected = latent_fingerprints(latent_loader(cfg), 12)            # 4 epochs of 6 rows
    uncached_reads = log.read_text().splitlines()
    log.unlink()
    assert latent_fingerprints(latent_loader(dataclasses.replace(cfg, sample_cache_mb=1.0)), 12) == expected
    reads = collections.Counter(log.read_text().splitlines())
    assert len(uncached_reads) >= 24 and max(reads.values()) == 1
    assert {line.split()[1] for line in reads} == {f"{i}.safetensors" for i in range(6)}


def test_sample_cache_drops_the_least_recently_used_beyond_its_budget_and_hands_out_copies():
    from pan.data.batch import Sample
    from pan.data.reader import SampleCache

    def sample(i: int) -> Sample:   # 4 x 4 x 4 float32 = 256 bytes of tensors
        return Sample(f"s:{i}", "video", "c", (1, 4, 4), 16, latent=torch.full((4, 1, 4, 4), i + 1.0))

    cache = SampleCache(budget=600)
    cache.put(("s", 0), sample(0))
    cache.put(("s", 1), sample(1))
    got = cache.get(("s", 0))                     # 0 is now the most recently used
    got.latent.zero_()                            # the caller's own copy
    cache.put(("s", 2), sample(2))                # 768 bytes > 600: the least recently used (1) goes
    assert cache.get(("s", 1)) is None and cache.used == 512
    assert torch.equal(cache.get(("s", 0)).latent, sample(0).latent) and cache.get(("s", 2)) is not None
    cache.put(("s", 3), Sample("s:3", "video", "c", (1, 8, 8), 64, latent=torch.zeros(4, 1, 8, 8)))
    assert cache.get(("s", 3)) is None            # larger than the whole budget: not kept
    cache.put(("s", 2), sample(2))                # put again: held once
    assert cache.used == 512 and len(cache.samples) == 2


STUCK_WORKER = """
import sys, threading, time
from pathlib import Path
from pan.data import build_data_loader
from pan.data.reader import SampleReader
from test_data_sources import clips_csv, small_config, tokens_of

# every read hangs, as one from a store that stopped answering: the decoding worker is stuck in it
SampleReader.__getitem__ = lambda self, ref: time.sleep(3600)
cfg = small_config(video_csv_paths=[str(clips_csv(Path(sys.argv[1])))], packed_dataloader_num_workers=1)
loader = build_data_loader(cfg, tokens_of=tokens_of, dp_rank=0, dp_size=1, seed=0)
threading.Thread(target=lambda: next(loader), daemon=True).start()   # waits on the stuck worker
time.sleep(3)
del loader
sys.exit(0)
"""


def test_a_process_exits_while_its_decoding_worker_is_stuck_in_a_read(tmp_path):
    """The workers ignore SIGTERM (they outlive a job step's SIGTERM until the trainer's last save),
    so multiprocessing's exit-time terminate() cannot stop one stuck in a read and its join would wait
    forever; the loader kills them at exit instead (before it, `python tests/test_data_s3.py`'s outage
    test never ended)."""
    run = subprocess.run([sys.executable, "-c", STUCK_WORKER, str(tmp_path / "clips.csv")], cwd=TESTS_DIR,
                         env={**os.environ, "PYTHONPATH": str(TESTS_DIR)}, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]

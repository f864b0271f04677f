"""JSONL annotation files (Pyramid-Flow's format) as a data source: every kind of row, relative and
absolute paths, images and videos packed together, precomputed latents and text features carried
through worker processes, bad rows counted, exact resume, and the Pyramid-Flow precompute writer."""

from __future__ import annotations

import collections
import csv
import dataclasses
import hashlib
import json
import os
import zlib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pan.config.core import ConfigError
from pan.data import build_data_loader
from pan.data.batch import Sample
from pan.data.decode import decode_image, decode_video
from pan.data.plan import Ref
from pan.data.precompute import PrecomputeError
from pan.data.reader import SampleReader, rules_of
from pan.data.sources import read_annotations, read_video_csv
from pan.recipes.pyramid_flow.precompute import (EMPTY_TEXT_FEA, PyramidEncoders, precompute_pyramid,
                                                 pyramid_text_record)
from test_data_sources import BIKES, CARPHONE, clips_csv, image_bytes, real_video, small_config, tokens_of


def latent_tokens_of(t: int, h: int, w: int) -> int:
    """A patch of (1, 2, 2) latent cells per token."""
    return t * (h // 2) * (w // 2)


def write_jsonl(path: Path, rows: list) -> Path:
    """Rows are dicts (written as JSON) or raw strings (written as they are)."""
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    path.write_text("\n".join(lines) + "\n\n")  # a trailing blank line is not a row
    return path


def features(length: int, width: int, pooled: int, seed: int, batch_dim: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {"prompt_embed": torch.randn(length, width, generator=g).to(torch.bfloat16),
           "prompt_attention_mask": (torch.arange(length) < length - 2).long(),
           "pooled_prompt_embed": torch.randn(pooled, generator=g)}
    return {k: v.unsqueeze(0) for k, v in out.items()} if batch_dim else out


def digest(t: torch.Tensor | None) -> str | None:
    if t is None:
        return None
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def fingerprint(batch) -> list:
    """What must be equal between two runs: ids, kinds, captions, tokens and every tensor's bytes."""
    return [[s.sample_id, s.kind, s.caption, s.tokens, digest(s.frames), digest(s.raw_latent),
             None if s.text_features is None else {k: digest(v) for k, v in s.text_features.items()}]
            for s in batch.samples]


def loader_of(cfg, rank=0, size=1, seed=0):
    return build_data_loader(cfg, tokens_of=tokens_of, latent_tokens_of=latent_tokens_of, dp_rank=rank,
                             dp_size=size, seed=seed)


def read_row(source, i: int, use_precomputed=True):
    """Row i of an annotation source as the loader reads it (small_config's rules)."""
    reader = SampleReader({f"annotations:{source.name}": source}, None, rules_of(small_config()),
                          use_precomputed=use_precomputed)
    return reader[Ref(0, f"annotations:{source.name}", 0, 0, i)]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    """Two annotation files beside a video CSV; media in sub-folders of the annotation files' folder."""
    root = tmp_path_factory.mktemp("annotated")
    for folder in ("clips", "images", "pre"):
        (root / folder).mkdir()
    os.symlink(real_video(BIKES), root / "clips" / "bikes.mp4")
    (root / "images" / "wide.jpg").write_bytes(image_bytes(96, 64, 1))
    (root / "images" / "tall.png").write_bytes(image_bytes(64, 96, 2, "PNG"))
    # As Pyramid-Flow's extraction tools save them: a leading batch dim of 1, bf16 latents.
    torch.save(torch.randn(1, 4, 3, 4, 6, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16),
               root / "pre" / "batched.pt")
    torch.save(features(7, 16, 12, seed=1, batch_dim=True), root / "pre" / "batched-text.pt")
    torch.save(torch.full((4, 1, 4, 4), 2.5), root / "pre" / "plain.pt")  # 1 frame, no batch dim, fp32
    videos = write_jsonl(root / "videos.jsonl", [
        {"video": "clips/bikes.mp4", "text": "bikes, relative path"},
        {"video": str(real_video(CARPHONE)), "text": "carphone, absolute path"},
        {"video": "clips/bikes.mp4", "text": "bikes, every other frame from 10",
         "frames": [10, 12, 14, 16, 18, 20]},
        {"video": "clips/bikes.mp4", "text": "a precomputed clip", "latent": "pre/batched.pt",
         "text_fea": "pre/batched-text.pt"},
        {"text": "a latent and no video", "latent": str(root / "pre" / "plain.pt")},
    ])
    images = write_jsonl(root / "images.jsonl", [
        {"image": "images/wide.jpg", "text": "a wide image, relative path"},
        {"image": str(root / "images" / "tall.png"), "text": "a tall image, absolute path"},
        {"image": "images/wide.jpg", "text": "an image with text features",
         "text_fea": "pre/batched-text.pt"},
    ])
    clips = clips_csv(root / "clips.csv", seconds=2, videos=(CARPHONE,))
    return {"root": root, "videos": videos, "images": images, "csv": clips}


def mixed_config(data, **kw):
    base = dict(video_csv_paths=[str(data["csv"])],
                annotation_paths=[str(data["videos"]), str(data["images"])])
    base.update(kw)
    return small_config(**base)


# ----------------------------------------------------------------------------------------------
# Reading rows
# ----------------------------------------------------------------------------------------------

def test_every_kind_of_row_is_read_with_relative_and_absolute_paths(data):
    rules = rules_of(small_config())
    videos, images = read_annotations(data["videos"]), read_annotations(data["images"])
    assert (videos.name, len(videos), len(images)) == ("videos", 5, 3)
    got = [read_row(videos, i).sample for i in range(5)]
    assert all(s is not None for s in got), [read_row(videos, i).detail for i in range(5)]

    bikes, carphone, strided, batched, plain = got
    for sample, path in ((bikes, real_video(BIKES)), (carphone, real_video(CARPHONE))):
        frames, fps = decode_video(str(path), rules)  # what a CSV row of the same file gives
        assert sample.kind == "video" and torch.equal(sample.frames, frames) and sample.fps == fps
        assert sample.grid == (5, *frames.shape[2:]) and sample.raw_latent is None
        assert sample.text_features is None
    assert bikes.sample_id == "videos:0" and carphone.caption == "carphone, absolute path"

    # `frames` picks source frames 10, 12, ... (max_frames 5 of them): every other frame from 10.
    every, _ = decode_video(str(real_video(BIKES)), dataclasses.replace(rules, max_frames=21, frames_mod=1,
                                                                         frames_remainder=0))
    assert torch.equal(strided.frames, every[10:19:2]) and strided.fps == 25 / 2

    # Precomputed rows: the latent as saved (batch dim dropped, dtype kept), no decoding at all.
    saved = torch.load(data["root"] / "pre" / "batched.pt")
    assert batched.frames is None and batched.raw_latent.dtype == torch.bfloat16
    assert torch.equal(batched.raw_latent, saved[0]) and batched.grid == (3, 4, 6)
    want = features(7, 16, 12, seed=1, batch_dim=False)
    assert batched.text_features.keys() == want.keys()
    assert all(torch.equal(batched.text_features[k], want[k]) for k in want)
    assert plain.kind == "video" and torch.equal(plain.raw_latent, torch.full((4, 1, 4, 4), 2.5))
    assert plain.text_features is None and plain.grid == (1, 4, 4)

    wide, tall, featured = (read_row(images, i).sample for i in range(3))
    assert wide.kind == tall.kind == "image"
    assert torch.equal(wide.frames, decode_image(image_bytes(96, 64, 1), rules)) and wide.grid == (1, 32, 64)
    assert torch.equal(tall.frames, decode_image(image_bytes(64, 96, 2, "PNG"), rules))
    assert tall.grid == (1, 64, 32)
    assert featured.frames is not None and torch.equal(featured.text_features["pooled_prompt_embed"],
                                                       want["pooled_prompt_embed"])


BAD_ROWS = [  # (row, reason it is skipped for; None: a good row)
    ({"video": "clips/bikes.mp4", "text": "good video"}, None),
    ({"image": "images/wide.jpg", "text": "good image"}, None),
    ({"latent": "pre/plain.pt", "text": "good latent"}, None),
    ('{"video": "clips/bikes.mp4", "text": "cut off', "bad_row"),
    ("[1, 2, 3]", "bad_row"),
    ({"video": "clips/bikes.mp4", "text": 5}, "bad_row"),
    ({"video": 7, "text": "a number for a path"}, "bad_row"),
    ({"image": "images/wide.jpg", "video": "clips/bikes.mp4", "text": "both"}, "bad_row"),
    ({"text": "nothing to read"}, "bad_row"),
    ({"video": "clips/bikes.mp4", "text": "frames backwards", "frames": [3, 2]}, "bad_row"),
    ({"video": "clips/bikes.mp4"}, "empty_caption"),
    ({"video": "clips/bikes.mp4", "text": "   "}, "empty_caption"),
    ({"video": "clips/nowhere.mp4", "text": "missing video"}, "missing_file"),
    ({"image": "images/nowhere.jpg", "text": "missing image"}, "missing_file"),
    ({"latent": "pre/nowhere.pt", "text": "missing latent"}, "missing_file"),
    ({"latent": "pre/plain.pt", "text_fea": "pre/nowhere.pt", "text": "missing features"}, "missing_file"),
    ({"latent": "pre/junk.pt", "text": "a latent file of random bytes"}, "decode_error"),
    ({"latent": "pre/flat.pt", "text": "a latent of the wrong rank"}, "decode_error"),
    ({"latent": "pre/plain.pt", "text_fea": "pre/unpooled.pt", "text": "features without pooled"},
     "decode_error"),
    ({"image": "images/broken.jpg", "text": "not an image"}, "decode_error"),
    ({"video": "clips/bikes.mp4", "text": "frames past the end", "frames": [1000, 1001]}, "too_short"),
]


@pytest.fixture(scope="module")
def bad(data) -> Path:
    root = data["root"]
    (root / "pre" / "junk.pt").write_bytes(os.urandom(300))
    torch.save(torch.zeros(4, 4, 4), root / "pre" / "flat.pt")
    torch.save({k: v for k, v in features(3, 8, 4, 0, True).items() if k != "pooled_prompt_embed"},
               root / "pre" / "unpooled.pt")
    (root / "images" / "broken.jpg").write_bytes(b"\xff\xd8 not a jpeg")
    return write_jsonl(root / "bad.jsonl", [row for row, _ in BAD_ROWS])


def test_each_bad_row_is_skipped_for_its_reason(bad):
    source = read_annotations(bad)
    for i, (row, reason) in enumerate(BAD_ROWS):
        got = read_row(source, i)
        assert (got.reason or None) == reason, (row, got.detail)


def expected_skips(loader) -> collections.Counter:
    """Replay the plan up to the loader's cursor and count the visits of each bad row."""
    planner, want = loader._initial.copy(), collections.Counter()
    for _ in range(loader.planner.step):
        reason = BAD_ROWS[planner.next_ref().index][1]
        if reason:
            want[reason] += 1
    return want


def test_bad_rows_are_counted_the_same_with_workers_and_never_stop_the_run(bad):
    cfg = small_config(annotation_paths=[str(bad)])

    def run(cfg, n):
        loader = loader_of(cfg)
        return [(fingerprint(b), b.skipped) for b in (next(loader) for _ in range(n))], loader
    straight, loader = run(cfg, 2)
    assert loader.planner.cursor["annotations:bad"][0] >= 1, "the test should pass every row once"
    good = {f"bad:{i}" for i, (_, reason) in enumerate(BAD_ROWS) if reason is None}
    assert {s[0] for batch, _ in straight for s in batch} == good
    assert loader.skipped_total == expected_skips(loader)
    assert set(loader.skipped_total) == {r for _, r in BAD_ROWS if r}
    assert run(dataclasses.replace(cfg, packed_dataloader_num_workers=2), 2)[0] == straight


# ----------------------------------------------------------------------------------------------
# The loader
# ----------------------------------------------------------------------------------------------

def test_images_and_videos_of_annotation_files_pack_into_one_batch(data):
    cfg = mixed_config(data, max_tokens_per_batch=48, packing_lookahead=8)
    loader = loader_of(cfg)
    kinds, streams = collections.Counter(), collections.Counter()
    mixed = 0
    for _ in range(6):
        batch = next(loader)
        assert batch.tokens == sum(s.tokens for s in batch.samples) <= 48
        mixed += len({s.kind for s in batch.samples}) == 2
        for s in batch.samples:
            kinds[s.kind] += 1
            streams[s.sample_id.split(":")[0]] += 1
            if s.raw_latent is not None:
                assert s.tokens == latent_tokens_of(*s.grid)
            else:
                assert s.tokens == tokens_of(*s.grid)
                assert s.frames.shape[0] == (1 if s.kind == "image" else 5)
    assert mixed >= 1 and kinds["image"] > 0 and kinds["video"] > 0
    assert set(streams) == {"clips", "videos", "images"}


def test_mixing_weighs_csvs_and_annotation_files_on_one_scale(data):
    def shares(cfg):
        planner = loader_of(cfg).planner.copy()
        got = collections.Counter(planner.next_ref().stream for _ in range(4000))
        return {k: v / 4000 for k, v in got.items()}
    by_rows = shares(mixed_config(data))  # null weights: 2 CSV rows, 5 and 3 annotation rows
    for stream, rows in (("video:clips", 2), ("annotations:videos", 5), ("annotations:images", 3)):
        assert abs(by_rows[stream] - rows / 10) < 0.03, by_rows
    given = shares(mixed_config(data, video_csv_weights=[1.0], annotation_weights=[1.0, 2.0]))
    for stream, weight in (("video:clips", 1), ("annotations:videos", 1), ("annotations:images", 2)):
        assert abs(given[stream] - weight / 4) < 0.03, given


def test_precomputed_latents_and_features_cross_worker_processes_intact(data, tmp_path):
    """A large latent and large features travel through shared memory, small ones by value: both
    arrive equal to the files, dtype included, with the same stream as without workers."""
    rows = []
    for i, (shape, length) in enumerate([((16, 3, 64, 96), 300), ((4, 2, 6, 4), 5), ((4, 1, 8, 8), 9)]):
        g = torch.Generator().manual_seed(i)
        torch.save(torch.randn(1, *shape, generator=g).to(torch.bfloat16 if i else torch.float32),
                   tmp_path / f"{i}.pt")
        torch.save(features(length, 1024, 8, seed=i, batch_dim=bool(i % 2)), tmp_path / f"{i}-text.pt")
        rows.append({"latent": f"{i}.pt", "text_fea": f"{i}-text.pt", "text": f"clip {i}"})
    cfg = small_config(annotation_paths=[str(write_jsonl(tmp_path / "pre.jsonl", rows))],
                       max_tokens_per_batch=5000, packing_lookahead=3)
    with pytest.raises(ValueError, match="latent_tokens_of"):
        build_data_loader(cfg, tokens_of=tokens_of, dp_rank=0, dp_size=1, seed=0)

    def samples(cfg):
        loader = loader_of(cfg)
        seen = {}
        while len(seen) < 3:
            seen.update((s.sample_id, s) for s in next(loader).samples)
        loader.close()
        return seen
    alone, workers = samples(cfg), samples(dataclasses.replace(cfg, packed_dataloader_num_workers=2))
    assert workers["pre:0"].raw_latent.nbytes > Sample.BY_VALUE_BYTES  # the shared-memory path is used
    for i in range(3):
        want = torch.load(tmp_path / f"{i}.pt")[0]
        want_text = features([300, 5, 9][i], 1024, 8, seed=i, batch_dim=False)
        for got in (alone[f"pre:{i}"], workers[f"pre:{i}"]):
            assert got.raw_latent.dtype == want.dtype and torch.equal(got.raw_latent, want)
            assert got.grid == tuple(want.shape[1:]) and got.tokens == latent_tokens_of(*got.grid)
            assert all(torch.equal(got.text_features[k], want_text[k]) for k in want_text)


@pytest.mark.parametrize("dp_size,workers", [(1, 0), (2, 2)])
def test_resume_continues_exactly_with_annotation_sources(data, dp_size, workers):
    cfg = mixed_config(data, packed_dataloader_num_workers=workers, max_tokens_per_batch=48)
    for rank in range(dp_size):
        straight = [fingerprint(next(loader)) for loader in [loader_of(cfg, rank, dp_size)] for _ in range(7)]
        first = loader_of(cfg, rank, dp_size)
        assert [fingerprint(next(first)) for _ in range(3)] == straight[:3]
        state = json.loads(json.dumps(first.state_dict()))
        assert state["buffer"], "the test should save while samples wait in the lookahead buffer"
        assert {"annotations:videos", "annotations:images"} <= set(state["planner"]["streams"])
        first.close()
        second = loader_of(cfg, rank, dp_size)
        second.load_state_dict(state)
        assert [fingerprint(next(second)) for _ in range(4)] == straight[3:]


def test_samples_with_raw_latents_and_features_pickle_by_value_and_by_shared_memory(monkeypatch):
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers the shared-memory reductions)

    sample = Sample(sample_id="a:0", kind="video", caption="c", grid=(3, 32, 32), tokens=768,
                    raw_latent=torch.randn(16, 3, 32, 32).to(torch.bfloat16),
                    text_features=features(128, 256, 64, seed=0, batch_dim=False))
    tensor_bytes = sample.raw_latent.nbytes + sum(t.nbytes for t in sample.text_features.values())
    for limit in (Sample.BY_VALUE_BYTES, 0):
        monkeypatch.setattr(Sample, "BY_VALUE_BYTES", limit)
        message = ForkingPickler.dumps(sample)
        assert (len(message) > tensor_bytes) == (limit > 0)  # inside the message, or shared memory handles
        got = ForkingPickler.loads(message)
        assert got.raw_latent.dtype == torch.bfloat16 and torch.equal(got.raw_latent, sample.raw_latent)
        assert all(torch.equal(got.text_features[k], v) and got.text_features[k].dtype == v.dtype
                   for k, v in sample.text_features.items())


# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("change,key,words", [
    (dict(annotation_weights=[1.0]), "annotation_weights", "one weight per annotation file"),
    (dict(video_csv_weights=[1.0]), "video_csv_weights", "give both lists or neither"),
    (dict(annotation_weights=[1.0, 1.0]), "annotation_weights", "give both lists or neither"),
    (dict(annotation_paths=["nowhere.jsonl"]), "annotation_paths", "does not exist"),
    (dict(video_csv_paths=["VIDEOS"], annotation_paths=[]), "video_csv_paths", "list it in annotation_paths"),
    (dict(video_csv_paths=[], image_tar_paths=["TAR"], image_sample_prob=1.0), "image_sample_prob",
     "annotation_paths would never be read"),
    (dict(annotation_paths=["VIDEOS", "SAME"]), "video_csv_paths", "rename them apart"),
])
def test_annotation_keys_are_checked(data, tmp_path, change, key, words):
    from test_data_sources import images_tar
    (tmp_path / "b").mkdir()
    swap = {"VIDEOS": str(data["videos"]), "TAR": str(images_tar(tmp_path / "shard.tar", 2)),
            "SAME": str(write_jsonl(tmp_path / "b" / "videos.jsonl", [{"video": "x.mp4", "text": "x"}]))}
    change = {k: [swap.get(x, x) for x in v] if isinstance(v, list) else v for k, v in change.items()}
    cfg = dataclasses.replace(mixed_config(data), **change)
    with pytest.raises(ConfigError) as e:
        cfg.check(type("Job", (), {"explicit_keys": set()})())
    assert e.value.key == key and words in e.value.message, e.value.message
    mixed_config(data).check(type("Job", (), {"explicit_keys": set()})())  # the base is sound
    small_config(annotation_paths=[str(data["images"])]).check(type("Job", (), {"explicit_keys": set()})())


# ----------------------------------------------------------------------------------------------
# Precompute in Pyramid-Flow's format
# ----------------------------------------------------------------------------------------------

def stand_in_latent(frames: torch.Tensor) -> torch.Tensor:
    """uint8 [T, 3, H, W] -> a [4, T, H/8, W/8] "latent"; refuses portrait clips like a picky VAE."""
    if frames.shape[-1] < frames.shape[-2]:
        raise ValueError("portrait clips do not fit this VAE")
    pooled = F.avg_pool2d(frames.float().div(127.5).sub(1.0), 8)                       # [T, 3, h, w]
    return torch.cat([pooled, pooled.mean(1, keepdim=True)], 1).transpose(0, 1).to(torch.bfloat16)


def stand_in_text(caption: str) -> dict[str, torch.Tensor]:
    if "encoder fails" in caption:
        raise RuntimeError("out of memory, say")
    g = torch.Generator().manual_seed(zlib.crc32(caption.encode()))
    words = len(caption.split())
    return {"prompt_embed": torch.randn(6, 8, generator=g),
            "prompt_attention_mask": (torch.arange(6) < words).long(),
            "pooled_prompt_embed": torch.randn(5, generator=g)}


ENCODERS = PyramidEncoders(latent=stand_in_latent, text=stand_in_text)


@pytest.fixture()
def to_encode(data, tmp_path) -> list:
    """An annotation file with rows of every outcome, and a video CSV."""
    src = write_jsonl(data["root"] / "to_encode.jsonl", [
        {"video": "clips/bikes.mp4", "text": "bikes"},
        {"video": str(real_video(CARPHONE)), "text": "carphone, strided", "frames": [0, 2, 4, 6, 8]},
        {"image": "images/wide.jpg", "text": "a wide image"},
        {"image": "images/tall.png", "text": "a tall image"},                    # vae_shape
        {"video": "clips/nowhere.mp4", "text": "a missing clip"},                # missing_file
        {"video": "clips/bikes.mp4", "text": "the encoder fails here"},          # encode_error
        {"video": "clips/bikes.mp4", "text": "encoded from the video, not its latent",
         "latent": "pre/nowhere.pt"},
    ])
    one_clip = clips_csv(tmp_path / "one.csv", seconds=1, videos=(CARPHONE,))
    return [read_annotations(src), read_video_csv(one_clip)]


def test_precompute_writes_pyramid_flows_format_and_the_loader_reads_it_back(to_encode, tmp_path):
    rules = rules_of(small_config())
    out = tmp_path / "pre"
    report = precompute_pyramid(to_encode, rules, ENCODERS, out)
    assert (report.written, report.existing) == (5, 0)
    failures = [(f.row, f.reason) for f in report.failures]
    assert failures == [(3, "vae_shape"), (4, "missing_file"), (5, "encode_error")]
    listed = [r[1:3] for r in csv.reader(open(out / "failures.csv"))][1:]
    assert listed == [[str(r), why] for r, why in failures]
    assert not list(out.rglob("0000000[34].pt"))  # nothing of rows that failed to decode or encode
    assert (out / "latent/to_encode/00000005.pt").is_file()  # kept: only the text is redone next time

    # The empty caption's features, in the saved (batched) layout.
    empty = torch.load(out / EMPTY_TEXT_FEA)
    assert report.empty_text == out / EMPTY_TEXT_FEA
    assert {k: tuple(v.shape) for k, v in empty.items()} == {
        "prompt_embed": (1, 6, 8), "prompt_attention_mask": (1, 6), "pooled_prompt_embed": (1, 5)}
    assert all(torch.equal(empty[k], v) for k, v in pyramid_text_record(stand_in_text("")).items())

    jsonl = [json.loads(line) for line in (out / "to_encode.jsonl").read_text().splitlines()]
    assert [r["text"] for r in jsonl] == ["bikes", "carphone, strided", "a wide image",
                                          "encoded from the video, not its latent"]
    assert report.annotations == [out / "to_encode.jsonl", out / "one.jsonl"]
    assert jsonl[1]["frames"] == [0, 2, 4, 6, 8] and "image" in jsonl[2]
    assert jsonl[3]["latent"] == "latent/to_encode/00000006.pt"  # ours, not the source row's
    for row in jsonl:
        assert not Path(row.get("video", row.get("image"))).is_absolute()
        assert (out / row.get("video", row.get("image"))).resolve().is_file()
        saved = torch.load(out / row["latent"])
        assert saved.shape[:2] == (1, 4) and saved.dim() == 5 and saved.dtype == torch.bfloat16
        assert torch.load(out / row["text_fea"])["prompt_embed"].shape == (1, 6, 8)

    # Training reads the files back: the latent the encoder gave, of the frames the data rules give.
    reader_cfg = small_config(annotation_paths=[str(out / "to_encode.jsonl"), str(out / "one.jsonl")])
    loader = loader_of(reader_cfg)
    seen = {}
    while len(seen) < 5:
        seen.update((s.sample_id, s) for s in next(loader).samples)
    decoded = [read_row(to_encode[0], i, use_precomputed=False).sample for i in (0, 1, 2, 6)]
    for i, source in enumerate(decoded):
        got = seen[f"to_encode:{i}"]
        assert got.kind == source.kind and got.frames is None
        assert torch.equal(got.raw_latent, stand_in_latent(source.frames))
        want = stand_in_text(source.caption)
        assert all(torch.equal(got.text_features[k], want[k]) for k in want)
    assert seen["one:0"].raw_latent.shape == (4, 5, 6, 6)  # carphone goes to the 48x48 bucket


def test_precompute_skips_what_exists_and_refuses_other_settings(to_encode, tmp_path):
    rules = rules_of(small_config())
    out = tmp_path / "pre"
    precompute_pyramid(to_encode, rules, ENCODERS, out, limit=2, settings={"vae": {"name": "a"}})
    assert len((out / "to_encode.jsonl").read_text().splitlines()) == 2
    lost = out / "text_fea" / "to_encode" / "00000001.pt"
    lost.unlink()  # as if killed between a row's two files
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("*.pt")}
    again = precompute_pyramid(to_encode, rules, ENCODERS, out, settings={"vae": {"name": "a"}})
    # rows 1 (its text features only), 2 and 6 are written; 0 and the CSV's row were there
    assert (again.written, again.existing) == (3, 2) and len(again.failures) == 3
    assert lost.is_file() and all(p.stat().st_mtime_ns == t for p, t in stamps.items())
    assert len((out / "to_encode.jsonl").read_text().splitlines()) == 4
    assert not list(out.rglob(".*tmp*"))
    with pytest.raises(PrecomputeError, match="vae.name"):
        precompute_pyramid(to_encode, rules, ENCODERS, out, settings={"vae": {"name": "b"}})

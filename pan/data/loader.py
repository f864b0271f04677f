"""The packed data loader: seeded streams -> decoding workers -> lookahead buffer -> packed batches.

How exact resume works. Every rank walks its own sequence of sample references, planned in the
training process from nothing but counters:
- each source (a video CSV, an annotation file, or all image tars together) is a stream: a seeded
  shuffle per epoch, of which rank r owns positions r, r + dp_size, r + 2 dp_size, ...;
- the n-th sample's stream (the image tars, or which CSV or annotation file) is drawn from an RNG
  seeded by (seed, rank, n), so the "mixing RNG" state is the counter n.
Worker processes only turn references into samples (or skip reasons), in order. The training
process replays the plan in step with what it receives, so its cursor (n, and each stream's epoch
and position) describes exactly what reached the buffer, however far the workers ran ahead. The
buffer's samples are saved as references and decoded again on resume.

A "rank" here is a data shard: one per data-parallel rank, or with `build_sharded_loader` one per
micro-batch of a step (ShardedLoader), so that the data a step trains depends on the shard count
only and a run continues exactly on any layout with the same count.

Elastic resume (another number of shards, `load_elastic_state`): from every old rank's cursor, the
samples of each stream's unfinished epochs that no old rank consumed (their buffers included) are
dealt round robin to the new ranks as a head, drawn before the stream continues with the new
shares from the next epoch. No sample is lost or trained twice in any epoch.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import hashlib
import logging
import math
import random
import signal
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar, Literal

import av
import numpy as np
import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader, Dataset

from pan.data.config import DataConfig
from pan.data.decode import (FrameRules, SkipSample, centre_crop, decode_image, decode_video, frame_step,
                             pick_bucket, video_stream)
from pan.data.packing import LookaheadPacker
from pan.data.sources import (AnnotationSource, ImageTarSet, SourceError, VideoCsvSource, caption_from_bytes,
                              read_annotations, read_image_tars, read_video_csv)

logger = logging.getLogger(__name__)

IMAGE_STREAM = "images"
STATE_VERSION = 1
TokensOf = Callable[[int, int, int], int]
RowSource = VideoCsvSource | AnnotationSource
# Pyramid-Flow's text features, per sample after the leading batch dim of 1 is dropped:
# prompt_embed [L, D], prompt_attention_mask [L] (1 = a real token), pooled_prompt_embed [P].
TEXT_FEATURE_DIMS = {"prompt_embed": 2, "prompt_attention_mask": 1, "pooled_prompt_embed": 1}


# ----------------------------------------------------------------------------------------------
# What the trainer receives
# ----------------------------------------------------------------------------------------------

@dataclass
class Sample:
    """One clip or image. Decoded samples carry `frames`; pan's precomputed CSV rows carry `latent` +
    `text`; annotation rows with a `latent` carry `raw_latent`, and with a `text_fea`, `text_features`."""
    sample_id: str                       # "<csv|jsonl stem>:<row>" (0 = first data row) or "<tar stem>:<key>"
    kind: Literal["video", "image"]
    caption: str
    grid: tuple[int, int, int]           # (T, H, W) of frames (pixels) or of the latent (latent cells)
    tokens: int                          # model tokens, as tokens_of / latent_tokens_of count them
    frames: torch.Tensor | None = None   # uint8 [T, 3, H, W], RGB, 0..255
    fps: float | None = None             # frame rate of `frames` (after target_fps resampling)
    latent: torch.Tensor | None = None   # [C, T, H, W], already normalised (pan's precomputed CSVs)
    text: torch.Tensor | None = None     # [L, D] text features (pan's precomputed CSVs)
    raw_latent: torch.Tensor | None = None  # [C, T, H, W] as the VAE gave it, NOT normalised, in the
    #                                         dtype it was saved in (annotation rows' `latent`)
    text_features: dict[str, torch.Tensor] | None = None  # annotation rows' `text_fea` (TEXT_FEATURE_DIMS)

    # Between a decoding worker and the trainer, a tensor normally travels as a shared-memory file
    # descriptor, handed over through a fresh authenticated connection per tensor: about 1 ms each,
    # which for small clips costs the trainer more than the clip itself. Tensors up to this size
    # travel inside the pickled message instead.
    BY_VALUE_BYTES: ClassVar[int] = 1 << 20
    TENSORS: ClassVar[tuple[str, ...]] = ("frames", "latent", "text", "raw_latent")

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        for key in self.TENSORS:
            state[key] = _by_value(state[key], self.BY_VALUE_BYTES)
        if state["text_features"] is not None:
            state["text_features"] = {k: _by_value(t, self.BY_VALUE_BYTES)
                                      for k, t in state["text_features"].items()}
        return state

    def __setstate__(self, state: dict) -> None:
        for key in self.TENSORS:
            state[key] = _from_value(state[key])
        if state["text_features"] is not None:
            state["text_features"] = {k: _from_value(t) for k, t in state["text_features"].items()}
        self.__dict__.update(state)


def _by_value(t, limit: int):
    """A tensor of at most `limit` bytes as _TensorBytes; anything else as it is."""
    if isinstance(t, torch.Tensor) and t.nbytes <= limit:
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return _TensorBytes(raw, t.dtype, tuple(t.shape))
    return t


def _from_value(t):
    return t.tensor() if isinstance(t, _TensorBytes) else t


@dataclass
class _TensorBytes:
    """A small tensor pickled by value (see Sample.BY_VALUE_BYTES)."""
    raw: bytes
    dtype: torch.dtype
    shape: tuple[int, ...]

    def tensor(self) -> torch.Tensor:
        flat = torch.frombuffer(bytearray(self.raw), dtype=torch.uint8) if self.raw else torch.empty(0, dtype=torch.uint8)
        return flat.view(self.dtype).reshape(self.shape)


@dataclass
class RawBatch:
    """One packed batch for one data-parallel rank: samples of different shapes, no padding."""
    samples: list[Sample]
    tokens: int                          # sum of the samples' tokens
    token_budget: int                    # max_tokens_per_batch
    skipped: dict[str, int]              # bad samples dropped since the previous batch, by reason
    shard: int = 0                       # the data shard that made it (see ShardedLoader) ...
    number: int = 0                      # ... and its count of batches made before it
    first_sample: int = 0                # ... and of samples batched before it

    @property
    def packing_efficiency(self) -> float:
        """Real tokens / budget: the share of the batch's compute spent on data."""
        return self.tokens / self.token_budget


class DataResumeError(ValueError):
    """A dataloader state that cannot be restored under the current config."""


# ----------------------------------------------------------------------------------------------
# Planning: streams, shares and the mixing RNG (runs in the training process)
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Ref:
    """A reference to one sample of one rank's sequence."""
    seq: int      # the sample's number in this rank's sequence
    stream: str   # "video:<csv stem>", "annotations:<jsonl stem>" or "images"
    epoch: int
    pos: int      # position within this rank's share of the epoch (-1: dealt from an elastic head)
    index: int    # row (CSV, JSONL) or image (tars) index in the source


def stable_int(*parts) -> int:
    """A 64-bit integer from the parts, equal in every process (unlike hash())."""
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little")


def seed_draws(generator: torch.Generator, rng: random.Random | None, seed: int, drawer: int, number: int) -> None:
    """Seed the random streams of one micro-batch from what names it: the run's seed, who draws (a
    data shard, or an AR slot's place among all slots) and the drawer's batch number. The draws
    then do not depend on which rank holds the shard, so a run continues exactly on another layout."""
    value = stable_int(seed, "draws", drawer, number)
    generator.manual_seed(value >> 1)  # torch takes 63 bits
    if rng is not None:
        rng.seed(value)


class StreamOrder:
    """A source's per-epoch seeded shuffle and one rank's share of it."""

    def __init__(self, name: str, size: int, seed: int, dp_rank: int, dp_size: int):
        self.name, self.size, self.seed = name, size, seed
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.share = size // dp_size  # equal shares keep ranks in the same epoch; the rest waits
        self._cache: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()

    def index(self, epoch: int, pos: int) -> int:
        return self.at(epoch, pos * self.dp_size + self.dp_rank)

    def at(self, epoch: int, slot: int) -> int:
        """The sample at `slot` of the epoch's shuffle (the same for every data-parallel size)."""
        return int(self._permutation(epoch)[slot])

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._cache:
            rng = np.random.default_rng([self.seed, stable_int(self.name), epoch])
            self._cache[epoch] = rng.permutation(self.size).astype(np.int64)
            while len(self._cache) > 2:  # the planner and its replica may sit in adjacent epochs
                self._cache.popitem(last=False)
        return self._cache[epoch]


class Planner:
    """Which sample comes next: the mixing draw for step n, then that stream's next position."""

    def __init__(self, streams: dict[str, StreamOrder], weights: dict[str, float], image_prob: float,
                 seed: int, dp_rank: int):
        self.streams, self.seed, self.dp_rank = streams, seed, dp_rank
        self.image_prob = image_prob
        self.video_names = list(weights)
        total = sum(weights.values())
        self.cumulative = np.cumsum([weights[n] / total for n in self.video_names]).tolist()
        self.step = 0
        self.cursor = {name: (0, 0) for name in streams}  # stream -> (epoch, pos)
        # stream -> (epoch, index) still to draw before its cursor: an elastic resume's share of the
        # old ranks' unfinished epochs.
        self.head: dict[str, collections.deque[tuple[int, int]]] = {}

    def next_ref(self) -> Ref:
        rng = random.Random(f"{self.seed}/{self.dp_rank}/{self.step}")
        if rng.random() < self.image_prob:
            name = IMAGE_STREAM
        else:
            u = rng.random()
            name = self.video_names[min(np.searchsorted(self.cumulative, u, side="right"),
                                        len(self.video_names) - 1)]
        head = self.head.get(name)
        if head:
            epoch, index = head.popleft()
            ref = Ref(self.step, name, epoch, -1, index)
            self.step += 1
            return ref
        epoch, pos = self.cursor[name]
        stream = self.streams[name]
        ref = Ref(self.step, name, epoch, pos, stream.index(epoch, pos))
        self.cursor[name] = (epoch + 1, 0) if pos + 1 == stream.share else (epoch, pos + 1)
        self.step += 1
        return ref

    def copy(self) -> Planner:
        twin = Planner.__new__(Planner)
        twin.__dict__.update(self.__dict__)
        twin.cursor = dict(self.cursor)
        twin.head = {name: collections.deque(items) for name, items in self.head.items()}
        return twin

    def state_dict(self) -> dict:
        return {"step": self.step,
                "streams": {n: {"epoch": e, "pos": p, "size": self.streams[n].size}
                            for n, (e, p) in self.cursor.items()},
                "head": {n: [list(item) for item in items] for n, items in self.head.items() if items}}


# ----------------------------------------------------------------------------------------------
# Loading: reference -> sample (runs in the decoding workers)
# ----------------------------------------------------------------------------------------------

@dataclass
class Loaded:
    ref: Ref
    sample: Sample | None
    reason: str = ""   # skip reason when sample is None
    detail: str = ""
    known: bool = False  # a known-bad sample, skipped without reading it again


@dataclass(frozen=True)
class KnownBad:
    """What the sampler sends instead of a reference in the run's record of bad samples."""
    ref: Ref
    reason: str


class SampleReader(Dataset):
    """Map-style dataset over references: decodes one sample, or reports why it cannot.

    With `use_precomputed` false, annotation rows are decoded from their video or image even when
    they name a latent or text features (what a precompute needs).
    """

    def __init__(self, sources: dict[str, RowSource], tars: ImageTarSet | None, rules: FrameRules,
                 use_precomputed: bool = True):
        self.sources, self.tars, self.rules = sources, tars, rules
        self.use_precomputed = use_precomputed

    def __getitem__(self, ref: Ref | KnownBad) -> Loaded:
        if isinstance(ref, KnownBad):
            return Loaded(ref.ref, None, ref.reason, known=True)
        try:
            if ref.stream == IMAGE_STREAM:
                return Loaded(ref, self._image(ref.index))
            src = self.sources[ref.stream]
            if isinstance(src, AnnotationSource):
                return Loaded(ref, self._annotation_row(src, ref.index))
            return Loaded(ref, self._video_row(src, ref.index))
        except SkipSample as e:
            return Loaded(ref, None, e.reason, e.detail)
        except FileNotFoundError as e:
            return Loaded(ref, None, "missing_file", str(e))
        except Exception as e:  # noqa: BLE001 - any error in a file (FFmpeg, Pillow, safetensors,
            # I/O) spoils that sample only; it is logged with its type so real bugs stay visible.
            return Loaded(ref, None, "decode_error", f"{type(e).__name__}: {e}")

    def _video_row(self, src: VideoCsvSource, i: int) -> Sample:
        row = src.rows[i]
        sample_id = f"{src.name}:{i}"
        caption = src.field(row, "caption")
        if not caption:
            raise SkipSample("empty_caption", "the caption cell is empty")
        if src.precomputed:
            return self._precomputed(src, row, sample_id, caption)
        path = src.field(row, "path")
        if path is None:
            raise SkipSample("missing_file", "the path cell is empty")
        start = number(src, row, "start_time") or 0.0
        end = number(src, row, "end_time")
        self._precheck(src, row, start, end)
        path = src.resolve(path)
        if not path.is_file():
            raise SkipSample("missing_file", str(path))
        frames, fps = decode_video(str(path), self.rules, start, end)
        return Sample(sample_id, "video", caption, tuple(frames.shape[i] for i in (0, 2, 3)), 0,
                      frames=frames, fps=fps)

    def _precheck(self, src: VideoCsvSource, row: list[str], start: float, end: float | None) -> None:
        """Skip a row its own metadata columns rule out, without opening the file."""
        fps, count = number(src, row, "fps"), number(src, row, "num_frames")
        width, height = number(src, row, "width"), number(src, row, "height")
        if width and height:
            pick_bucket(int(height), int(width), self.rules)
        if not fps:
            return
        step = frame_step(fps, self.rules)
        if count is None:
            return
        source_frames = round(((end if end is not None else count / fps) - start) * fps)
        selected = sum(1 for k in range(self.rules.max_frames) if round(k * step) < source_frames)
        if self.rules.usable_count(selected) < self.rules.min_frames:
            until = "the end" if end is None else f"{end} s"
            raise SkipSample("too_short", f"the CSV says {count} frames at {fps} fps from {start} s to "
                                          f"{until}: {selected} usable; min_frames is {self.rules.min_frames}")

    def _precomputed(self, src: VideoCsvSource, row: list[str], sample_id: str, caption: str) -> Sample:
        path = src.field(row, "latent_path")
        if path is None:
            raise SkipSample("missing_file", "the latent_path cell is empty")
        path = src.resolve(path)
        if not path.is_file():
            raise SkipSample("missing_file", str(path))
        tensors = load_file(str(path))
        latent, text = tensors.get("latent"), tensors.get("text")
        if latent is None or text is None or latent.dim() != 4 or text.dim() != 2:
            raise SkipSample("decode_error", f"{path} must hold latent [C, T, H, W] and text [L, D]; "
                                             f"it holds {sorted(tensors)}")
        return Sample(sample_id, "video", caption, tuple(latent.shape[1:]), 0, latent=latent, text=text)

    def _annotation_row(self, src: AnnotationSource, i: int) -> Sample:
        """A JSONL row: its precomputed latent if it names one, else its decoded video or image."""
        row = src.parse(i)
        sample_id = f"{src.name}:{i}"
        features = None
        if self.use_precomputed:
            features = read_text_features(existing(row.text_fea)) if row.text_fea else None
            if row.latent is not None:
                latent = read_raw_latent(existing(row.latent))
                return Sample(sample_id, row.kind, row.caption, tuple(latent.shape[1:]), 0,
                              raw_latent=latent, text_features=features)
        if row.media is None:
            raise SkipSample("missing_file", "the row names no video to decode")
        media = existing(row.media)
        fps = None
        if row.kind == "image":
            frames = decode_image(media.read_bytes(), self.rules)
        elif row.frames is not None:
            frames, fps = decode_frames_at(str(media), row.frames, self.rules)
        else:
            frames, fps = decode_video(str(media), self.rules)
        return Sample(sample_id, row.kind, row.caption, tuple(frames.shape[i] for i in (0, 2, 3)), 0,
                      frames=frames, fps=fps, text_features=features)

    def _image(self, i: int) -> Sample:
        image = self.tars.images[i]
        data, caption_bytes = self.tars.read(image)
        caption = caption_from_bytes(caption_bytes, image.caption.ext if image.caption else None)
        if not caption:
            raise SkipSample("empty_caption", "no caption file, or an empty caption")
        frames = decode_image(data, self.rules)
        return Sample(self.tars.sample_id(image), "image", caption, tuple(frames.shape[i] for i in (0, 2, 3)),
                      0, frames=frames)


def existing(path: Path) -> Path:
    if not path.is_file():
        raise SkipSample("missing_file", str(path))
    return path


def read_raw_latent(path: Path) -> torch.Tensor:
    """A Pyramid-Flow latent `.pt`: [C, T, H, W], or [1, C, T, H, W] as its extraction tool saves it."""
    latent = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(latent, torch.Tensor) and latent.dim() == 5 and latent.shape[0] == 1:
        latent = latent[0]
    if not isinstance(latent, torch.Tensor) or latent.dim() != 4 or not latent.is_floating_point():
        raise SkipSample("decode_error", f"{path} must hold one float tensor [C, T, H, W] (or "
                                         f"[1, C, T, H, W]); it holds {describe(latent)}")
    return latent


def read_text_features(path: Path) -> dict[str, torch.Tensor]:
    """A Pyramid-Flow text-feature `.pt` (a dict of TEXT_FEATURE_DIMS tensors, each possibly with a
    leading batch dim of 1, which is dropped)."""
    saved = torch.load(path, map_location="cpu", weights_only=True)
    if not (isinstance(saved, dict) and all(torch.is_tensor(saved.get(k)) for k in TEXT_FEATURE_DIMS)):
        raise SkipSample("decode_error", f"{path} must hold a dict of tensors {list(TEXT_FEATURE_DIMS)}; "
                                         f"it holds {describe(saved)}")
    out = {}
    for key, dims in TEXT_FEATURE_DIMS.items():
        t = saved[key]
        out[key] = t[0] if t.dim() == dims + 1 and t.shape[0] == 1 else t
    shapes = {k: tuple(t.shape) for k, t in out.items()}
    if ([t.dim() for t in out.values()] != list(TEXT_FEATURE_DIMS.values())
            or out["prompt_attention_mask"].shape[0] != out["prompt_embed"].shape[0]):
        raise SkipSample("decode_error", f"{path}: text features must be prompt_embed [L, D], "
                                         f"prompt_attention_mask [L], pooled_prompt_embed [P]; got {shapes}")
    return out


def describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor {list(value.shape)}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {describe(v)}" for k, v in value.items()) + "}"
    return type(value).__name__


def decode_frames_at(path: str, indices: tuple[int, ...], rules: FrameRules) -> tuple[torch.Tensor, float]:
    """The listed source frames of a video (indices counted from its first frame, increasing) ->
    (uint8 frames [T, 3, H, W], their rate). Buckets and frame-count rules apply as in decode_video;
    target_fps does not: the row chose its frames."""
    wanted = indices[:rules.max_frames]
    with av.open(path) as container:
        stream, rate = video_stream(container)
        bucket, h, w, scale = pick_bucket(stream.codec_context.height, stream.codec_context.width, rules)
        interpolation = "AREA" if scale < 1 else "BICUBIC"
        kept: list[np.ndarray] = []
        for index, frame in enumerate(container.decode(stream)):  # from the start: indices are exact
            if index == wanted[len(kept)]:
                rgb = frame.to_ndarray(format="rgb24", width=w, height=h, interpolation=interpolation)
                kept.append(centre_crop(rgb, bucket))
                if len(kept) == len(wanted):
                    break
    count = rules.usable_count(len(kept))
    if count < rules.min_frames:
        raise SkipSample("too_short", f"{len(kept)} of the row's frames exist, {count} usable; min_frames "
                                      f"{rules.min_frames} (with rule count % {rules.frames_mod} == "
                                      f"{rules.frames_remainder})")
    frames = torch.from_numpy(np.stack(kept[:count])).permute(0, 3, 1, 2).contiguous()
    stride = (wanted[count - 1] - wanted[0]) / (count - 1) if count > 1 else 1.0
    return frames, float(rate) / stride


def number(src: VideoCsvSource, row: list[str], column: str) -> float | None:
    text = src.field(row, column)
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        raise SkipSample("bad_row", f"{column} is {text!r}, not a number") from None
    if not math.isfinite(value) or value < 0:
        raise SkipSample("bad_row", f"{column} is {text!r}")
    return value


def _keep(item: Loaded) -> Loaded:
    return item  # the DataLoader's collate step: samples travel as they are


def _ignore_sigterm(worker_id: int) -> None:
    """Decoding workers outlive a SIGTERM sent to every process of a job step (Slurm does so on
    preemption): the trainer still needs batches until its last save, then stops them itself; and
    a worker gone mid-epoch would fail the trainer's next fetch before it can save."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _close_at_exit(loader_ref: weakref.ref) -> None:
    loader = loader_ref()
    if loader is not None:
        loader.close()


class RefSequence:
    """The DataLoader's sampler: buffered references to re-read first, then the plan onwards, in
    which a sample of the run's record of bad samples is sent as KnownBad (not read again). It runs
    in the training process, so it sees the record as it grows."""

    def __init__(self, replay: list[Ref], planner: Planner, known_bad: dict[tuple[str, int], tuple[str, str]]):
        self.replay, self.planner, self.known_bad = replay, planner, known_bad

    def __iter__(self):
        yield from self.replay
        while True:
            ref = self.planner.next_ref()
            bad = self.known_bad.get((ref.stream, ref.index))
            yield ref if bad is None else KnownBad(ref, bad[0])


# ----------------------------------------------------------------------------------------------
# The loader
# ----------------------------------------------------------------------------------------------

class PackedLoader:
    """An endless iterator of RawBatch for one data-parallel rank, with exact state_dict/load."""

    def __init__(self, cfg: DataConfig, *, sources: dict[str, RowSource], tars: ImageTarSet | None,
                 planner: Planner, tokens_of: TokensOf, latent_tokens_of: TokensOf | None,
                 dp_rank: int, dp_size: int, seed: int):
        self.cfg, self.seed, self.dp_rank, self.dp_size = cfg, seed, dp_rank, dp_size
        self.tokens_of, self.latent_tokens_of = tokens_of, latent_tokens_of
        self.reader = SampleReader(sources, tars, rules_of(cfg))
        self._initial = planner.copy()
        self.planner = planner              # advanced only by samples that reached this process
        self.packer = LookaheadPacker(cfg.max_tokens_per_batch, cfg.max_samples_per_batch,
                                      cfg.packing_lookahead)  # items: (Ref, Sample)
        self.replay: list[Ref] = []         # buffered references still to be re-read after a resume
        self.skipped_total: collections.Counter[str] = collections.Counter()  # skips, by reason
        self._skipped_since: collections.Counter[str] = collections.Counter()
        # The run's record of bad samples: (stream, index) -> (reason, detail). Each is read once
        # per run (carried in the checkpoint); later visits are skipped without reading it.
        self.known_bad: dict[tuple[str, int], tuple[str, str]] = {}
        self.batches = 0                    # batches made so far (saved: it numbers the next one)
        self.batched_samples = 0            # samples in them
        self._results = None
        self._closes_at_exit = False

    # --- iteration -------------------------------------------------------------------------------

    def __iter__(self) -> PackedLoader:
        return self

    def __next__(self) -> RawBatch:
        last_good = dict(self.planner.cursor)
        while self.packer.wants_more():
            if self._receive():
                last_good = dict(self.planner.cursor)
            elif self._passed_everything_since(last_good):
                raise SourceError(f"no usable sample in a whole pass over the data of data shard "
                                  f"{self.dp_rank}; skipped so far: {dict(self.skipped_total)}. "
                                  "See the warnings above for why each was skipped.")
        chosen = self.packer.take()
        skipped, self._skipped_since = dict(self._skipped_since), collections.Counter()
        batch = RawBatch(samples=[p.item[1] for p in chosen], tokens=sum(p.tokens for p in chosen),
                         token_budget=self.cfg.max_tokens_per_batch, skipped=skipped, shard=self.dp_rank,
                         number=self.batches, first_sample=self.batched_samples)
        self.batches += 1
        self.batched_samples += len(chosen)
        return batch

    def _passed_everything_since(self, cursor: dict[str, tuple[int, int]]) -> bool:
        """Has every stream gone through one whole epoch (not just `share` samples: epochs are
        shuffled apart) since `cursor`?"""
        for name, (epoch, _) in self.planner.cursor.items():
            first_full_epoch = cursor[name][0] + (1 if cursor[name][1] > 0 else 0)
            if epoch <= first_full_epoch:
                return False
        return True

    def _receive(self) -> bool:
        """Take the next decoded sample into the buffer; False if it was skipped."""
        if self._results is None:
            self._start_workers()
        got: Loaded = next(self._results)
        if self.replay:
            expected = self.replay.pop(0)
        else:
            expected = self.planner.next_ref()
        assert got.ref == expected, f"decoded {got.ref}, expected {expected}"
        sample = got.sample
        if sample is not None:
            sample.tokens = self._tokens(sample)
            if sample.tokens > self.cfg.max_tokens_per_batch:
                got = Loaded(got.ref, None, "over_budget", f"{sample.tokens} tokens > max_tokens_per_batch "
                                                           f"{self.cfg.max_tokens_per_batch}")
        if got.sample is None:
            self._skip(got)
            return False
        self.packer.add(got.ref.seq, got.sample.tokens, (got.ref, got.sample))
        return True

    def _tokens(self, sample: Sample) -> int:
        if sample.latent is not None or sample.raw_latent is not None:
            return int(self.latent_tokens_of(*sample.grid))
        return int(self.tokens_of(*sample.grid))

    def _skip(self, got: Loaded) -> None:
        """Count a skip; record (and log) a bad sample the first time it is found."""
        self.skipped_total[got.reason] += 1
        self._skipped_since[got.reason] += 1
        key = (got.ref.stream, got.ref.index)
        if not got.known and key not in self.known_bad:
            self.known_bad[key] = (got.reason, got.detail[:300])  # the record travels in every cursor
            logger.warning("skipping %s (%s): %s", self._sample_id(got.ref), got.reason, got.detail)

    @property
    def bad_samples(self) -> dict[str, tuple[str, str]]:
        """The distinct bad samples found so far in this run: sample id -> (reason, detail)."""
        return {self._id_of(stream, index): why for (stream, index), why in self.known_bad.items()}

    def _sample_id(self, ref: Ref) -> str:
        return self._id_of(ref.stream, ref.index)

    def _id_of(self, stream: str, index: int) -> str:
        if stream == IMAGE_STREAM:
            return self.reader.tars.sample_id(self.reader.tars.images[index])
        return f"{self.reader.sources[stream].name}:{index}"

    def _start_workers(self) -> None:
        self._results = iter(self._data_loader())
        if self.cfg.packed_dataloader_num_workers and not self._closes_at_exit:
            # The workers ignore SIGTERM, so multiprocessing's exit-time terminate() and join would
            # wait for them forever: stop them first (atexit runs the newest handler first).
            atexit.register(_close_at_exit, weakref.ref(self))
            self._closes_at_exit = True

    def _data_loader(self) -> DataLoader:
        workers = self.cfg.packed_dataloader_num_workers
        sampler = RefSequence(list(self.replay), self.planner.copy(), self.known_bad)
        # Our own generator: otherwise each new iterator draws its base seed from the global torch
        # RNG, and a resumed run's global RNG would be one draw away from the uninterrupted run's.
        return DataLoader(self.reader, batch_size=None, sampler=sampler, collate_fn=_keep,
                          num_workers=workers, generator=torch.Generator().manual_seed(self.seed),
                          prefetch_factor=self.samples_in_flight_per_worker() if workers else None,
                          worker_init_fn=_ignore_sigterm if workers else None)

    def samples_in_flight_per_worker(self) -> int:
        """DataLoader's prefetch factor counts samples here: keep `packed_dataloader_prefetch_factor`
        whole batches in flight, or the trainer waits for most of each batch to be decoded."""
        workers = self.cfg.packed_dataloader_num_workers
        share = -(-self.cfg.max_samples_per_batch // workers)  # ceil
        return self.cfg.packed_dataloader_prefetch_factor * share

    def close(self) -> None:
        """Stop the decoding workers (they restart on the next batch)."""
        self._results = None

    # --- state -----------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The cursor of what the trainer has consumed (JSON-serialisable)."""
        pending = [p.item[0] for p in sorted(self.packer.buffer, key=lambda p: p.seq)] + self.replay
        return {"version": STATE_VERSION, "dp_rank": self.dp_rank, "dp_size": self.dp_size,
                "seed": self.seed, "batches": self.batches,
                "batched_samples": self.batched_samples, "planner": self.planner.state_dict(),
                "buffer": [[r.seq, r.stream, r.epoch, r.pos, r.index] for r in pending],
                "skipped_total": dict(self.skipped_total),
                "bad_samples": [[stream, index, reason, detail]
                                for (stream, index), (reason, detail) in sorted(self.known_bad.items())]}

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly where `state` (from state_dict) left off; restarts the workers."""
        self.close()
        self.packer.buffer, self.replay = [], []
        self._skipped_since = collections.Counter()
        self.known_bad = {}
        if state.get("version") != STATE_VERSION:
            raise DataResumeError(f"dataloader state version {state.get('version')} is not "
                                  f"{STATE_VERSION}: it was written by another pan version.")
        if state["dp_size"] != self.dp_size:
            if not self.cfg.restart_data_on_dp_change:
                raise DataResumeError(
                    f"the checkpoint's data cursors were written by {state['dp_size']} data-parallel "
                    f"ranks, this run has {self.dp_size}: each rank's cursor covers its own share of "
                    "the data, so they cannot be carried over. Resume with the same world_size / "
                    "cp_size, or set restart_data_on_dp_change: true to restart every data stream.")
            logger.warning("data-parallel size changed from %d to %d: restarting every data stream "
                           "(restart_data_on_dp_change)", state["dp_size"], self.dp_size)
            self.planner = self._initial.copy()
            self.skipped_total = collections.Counter()
            return
        if state["dp_rank"] != self.dp_rank:
            raise DataResumeError(f"this is the cursor of rank {state['dp_rank']}, loaded on rank "
                                  f"{self.dp_rank}: load dataloader/<rank>.json of your own rank.")
        if state["seed"] != self.seed:
            logger.warning("data seed changed from %s to %s: the streams keep their positions in "
                           "differently shuffled epochs", state["seed"], self.seed)
        self.skipped_total = collections.Counter(state.get("skipped_total", {}))
        self.batches = state.get("batches", 0)
        self.batched_samples = state.get("batched_samples", 0)
        self.planner, restarted = self._restored_planner(state["planner"])
        for seq, stream, epoch, pos, *index in state["buffer"]:
            if stream not in restarted:
                index = index[0] if index else self.planner.streams[stream].index(epoch, pos)
                self.replay.append(Ref(seq, stream, epoch, pos, index))
        # A restarted stream's rows may have changed: its bad samples are looked at again.
        self.known_bad = {(stream, index): (reason, detail)
                          for stream, index, reason, detail in state.get("bad_samples", [])
                          if stream not in restarted}

    def load_elastic_state(self, states: list[dict]) -> None:
        """Continue a run of another data-parallel size from all its ranks' cursors (`states[r]`:
        old rank r's state_dict): the samples of each stream's unfinished epochs that no old rank
        consumed are dealt round robin to the new ranks, then each stream goes on with the new
        shares from the next epoch."""
        self.close()
        self.packer.buffer, self.replay = [], []
        self._skipped_since = collections.Counter()
        old_dp = len(states)
        for r, state in enumerate(states):
            if state.get("version") != STATE_VERSION or state["dp_rank"] != r or state["dp_size"] != old_dp:
                raise DataResumeError(f"the {old_dp} data cursors of the checkpoint are not those of one run "
                                      f"(cursor {r}: rank {state.get('dp_rank')} of {state.get('dp_size')}, "
                                      f"version {state.get('version')})")
        planner = self._initial.copy()
        planner.step = max(state["planner"]["step"] for state in states)  # fresh mixing draws
        self.batches = max(state.get("batches", 0) for state in states)
        self.batched_samples = max(state.get("batched_samples", 0) for state in states)
        restarted = set()
        for name, order in planner.streams.items():
            saved = [state["planner"]["streams"].get(name) for state in states]
            if any(c is None or c["size"] != order.size for c in saved) or (
                    name != IMAGE_STREAM and not self.cfg.resume_video_csv):
                logger.warning("data stream %s restarts from the top (new, resized, or resume_video_csv "
                               "is false)", name)
                restarted.add(name)
                continue
            left = unconsumed(order, states, name)
            planner.head[name] = collections.deque(left[self.dp_rank::self.dp_size])
            planner.cursor[name] = (max(c["epoch"] for c in saved) + 1, 0)
        self.planner = planner
        self.known_bad = {(stream, index): (reason, detail) for state in states
                          for stream, index, reason, detail in state.get("bad_samples", [])
                          if stream not in restarted}
        self.skipped_total = collections.Counter()
        if self.dp_rank == 0:  # the old ranks' skip counts, once
            for state in states:
                self.skipped_total.update(state.get("skipped_total", {}))
        logger.info("data-parallel size %d -> %d: this rank finishes %d samples of the old ranks' "
                    "unfinished epochs first", old_dp, self.dp_size, sum(map(len, planner.head.values())))

    def _restored_planner(self, saved: dict) -> tuple[Planner, set[str]]:
        """The saved cursor applied to today's streams, and the streams that restart from the top."""
        planner = self._initial.copy()
        planner.step = saved["step"]
        restarted = set()
        for name, order in planner.streams.items():
            cursor = saved["streams"].get(name)
            if cursor is None:
                logger.warning("data stream %s is new since the checkpoint: it starts from the top", name)
            elif cursor["size"] != order.size:
                logger.warning("data stream %s has %d samples, %d when saved: it restarts from the top",
                               name, order.size, cursor["size"])
            elif name != IMAGE_STREAM and not self.cfg.resume_video_csv:
                logger.info("resume_video_csv is false: video stream %s restarts from the top", name)
            else:
                planner.cursor[name] = (cursor["epoch"], cursor["pos"])
                head = saved.get("head", {}).get(name)
                if head:
                    planner.head[name] = collections.deque(tuple(item) for item in head)
                continue
            restarted.add(name)
        restarted |= set(saved["streams"]) - set(planner.streams)
        return planner, restarted


def unconsumed(order: StreamOrder, states: list[dict], name: str) -> list[tuple[int, int]]:
    """(epoch, index) of every sample of stream `name` that the ranks of `states` (old rank r:
    positions r, r + dp, ... of each epoch's shuffle) had not consumed, in epoch order: what is
    left of their unfinished epochs, what sat in their buffers, and their own elastic heads."""
    old_dp = len(states)
    left = []
    for r, state in enumerate(states):
        left += [tuple(item) for item in state["planner"].get("head", {}).get(name, [])]
        # Buffered samples were drawn (possibly epochs ago: packing keeps a long one waiting) but
        # not trained. (Cursors of older pan versions carry no index.)
        left += [(epoch, index[0] if index else order.at(epoch, pos * old_dp + r))
                 for _seq, stream, epoch, pos, *index in state["buffer"] if stream == name]
    cursors = [(c["epoch"], c["pos"]) for c in (s["planner"]["streams"][name] for s in states)]
    share = order.size // old_dp
    for epoch in range(min(e for e, _ in cursors), max(e for e, _ in cursors) + 1):
        for slot in range(share * old_dp):
            if (epoch, slot // old_dp) >= cursors[slot % old_dp]:  # not drawn yet by its old rank
                left.append((epoch, order.at(epoch, slot)))
    return sorted(left, key=lambda item: item[0])


# ----------------------------------------------------------------------------------------------
# Building
# ----------------------------------------------------------------------------------------------

def rules_of(cfg: DataConfig) -> FrameRules:
    return FrameRules(buckets=tuple(cfg.buckets()), allow_upscale=cfg.allow_upscale,
                      target_fps=cfg.target_fps, min_frames=cfg.min_frames, max_frames=cfg.max_frames,
                      frames_mod=cfg.frames_mod, frames_remainder=cfg.frames_remainder)


def stream_name(source: RowSource) -> str:
    """A row source's stream (and cursor) name."""
    kind = "annotations" if isinstance(source, AnnotationSource) else "video"
    return f"{kind}:{source.name}"


def read_row_sources(cfg: DataConfig) -> dict[str, RowSource]:
    """Every video CSV, then every annotation file, by stream name."""
    sources = [read_video_csv(p) for p in cfg.video_csv_paths]
    sources += [read_annotations(p) for p in cfg.annotation_paths]
    return {stream_name(s): s for s in sources}


def names_latents(source: RowSource) -> bool:
    return source.precomputed if isinstance(source, VideoCsvSource) else source.names_latents


def row_weights(cfg: DataConfig, sources: dict[str, RowSource]) -> dict[str, float]:
    """Sampling weight of each row source: the given lists, else each file's number of rows."""
    csvs = [n for n, s in sources.items() if isinstance(s, VideoCsvSource)]
    annotations = [n for n in sources if n not in csvs]
    weights = {}
    for names, given in ((csvs, cfg.video_csv_weights), (annotations, cfg.annotation_weights)):
        weights.update(zip(names, given or [len(sources[n]) for n in names]))
    return weights


def build_data_loader(cfg: DataConfig, *, tokens_of: TokensOf, dp_rank: int, dp_size: int, seed: int,
                      latent_tokens_of: TokensOf | None = None) -> PackedLoader:
    """The packed loader of one data-parallel rank.

    tokens_of(num_frames, height, width) -> model tokens of a decoded sample (pixel dims);
    latent_tokens_of(t, h, w) -> model tokens of a precomputed latent grid (needed only when a CSV
    has a latent_path column or an annotation row names a latent). Every rank reads a disjoint
    share of every stream.
    """
    return build_sharded_loader(cfg, tokens_of=tokens_of, dp_rank=dp_rank, dp_size=dp_size, seed=seed,
                                latent_tokens_of=latent_tokens_of).loaders[dp_rank]


def build_sharded_loader(cfg: DataConfig, *, tokens_of: TokensOf, dp_rank: int, dp_size: int, seed: int,
                         accumulation: int = 1, latent_tokens_of: TokensOf | None = None,
                         writes_cursors: bool = True) -> ShardedLoader:
    """The `accumulation` data shards of one data-parallel rank (see ShardedLoader), the sources
    read once for all of them; arguments as for build_data_loader."""
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} is outside 0..{dp_size - 1}")
    sources = read_row_sources(cfg)
    if latent_tokens_of is None and any(names_latents(s) for s in sources.values()):
        raise ValueError("a video CSV has a latent_path column or an annotation row names a latent "
                         "(precomputed rows): pass latent_tokens_of to build_data_loader.")
    tars = read_image_tars(cfg.image_tar_paths) if cfg.image_tar_paths else None
    sizes = {name: len(s) for name, s in sources.items()}
    if tars is not None:
        sizes[IMAGE_STREAM] = len(tars)
    count = dp_size * accumulation
    sharers = (f"{count} data-parallel ranks" if accumulation == 1 else
               f"{count} data shards (data-parallel ranks x gradient_accumulation_steps)")
    for name, size in sizes.items():
        if size < count:
            raise SourceError(f"{name} has {size} samples, fewer than the {sharers} that share it.")
    if accumulation > 1 and cfg.packed_dataloader_num_workers:  # the rank's workers, split
        cfg = dataclasses.replace(cfg, packed_dataloader_num_workers=-(-cfg.packed_dataloader_num_workers
                                                                         // accumulation))
    image_prob = cfg.image_sample_prob if tars is not None else 0.0
    loaders = {}
    for shard in range(dp_rank * accumulation, (dp_rank + 1) * accumulation):
        streams = {name: StreamOrder(name, size, seed, shard, count) for name, size in sizes.items()}
        planner = Planner(streams, row_weights(cfg, sources), image_prob, seed, shard)
        loaders[shard] = PackedLoader(cfg, sources=sources, tars=tars, planner=planner, tokens_of=tokens_of,
                                      latent_tokens_of=latent_tokens_of, dp_rank=shard, dp_size=count,
                                      seed=seed)
    return ShardedLoader(loaders, writes_cursors)


def build_step_shards(task, dims) -> ShardedLoader:
    """The loader of a recipe whose micro-batches are data shards (`Task.sharded_micro_batches`):
    its job's data keys, seed and accumulation, and its `tokens_of` / `latent_tokens_of`."""
    job = task.job
    return build_sharded_loader(job.data, tokens_of=task.tokens_of, dp_rank=task.dp_rank, dp_size=dims.dp,
                                seed=job.trainer.seed, accumulation=job.trainer.gradient_accumulation_steps,
                                latent_tokens_of=task.latent_tokens_of)


class ShardedLoader:
    """The data of one data-parallel rank as `accumulation` shards of the run's data: micro-batch m
    of every step comes from shard dp_rank x accumulation + m, each shard a PackedLoader of its own
    (its share of every stream, its cursor, its buffer).

    The data a step trains is then a function of the shard count alone (data-parallel ranks x
    gradient_accumulation_steps), not of how the shards are spread over ranks: a resume on another
    data-parallel size whose accumulation keeps the count continues every shard exactly, and each
    step trains the same micro-batches as the uninterrupted run would have. Another count continues
    through `load_elastic_state` (nothing lost or repeated, but other batches). The shards of a rank
    share one record of bad samples and split its decoding workers.
    """

    def __init__(self, loaders: dict[int, PackedLoader], writes_cursors: bool = True):
        self.loaders = loaders
        # Whether this rank writes its shards' cursors into checkpoints: False where other ranks
        # read the same shards and one of them writes (a context group, an AR sync group).
        self.writes_cursors = writes_cursors
        self._turn = 0  # the shard of the next micro-batch
        self._share_bad_sample_record()

    @property
    def shards(self) -> list[int]:
        return list(self.loaders)

    def __iter__(self) -> ShardedLoader:
        return self

    def __next__(self) -> RawBatch:
        loader = self.loaders[self.shards[self._turn]]
        self._turn = (self._turn + 1) % len(self.loaders)
        return next(loader)

    def shard_states(self) -> dict[int, dict]:
        return {shard: loader.state_dict() for shard, loader in self.loaders.items()}

    def load_shard_states(self, states: dict[int, dict]) -> None:
        """Continue each shard exactly (states: shard -> its state_dict, from any data-parallel size)."""
        for shard, loader in self.loaders.items():
            loader.load_state_dict(states[shard])
        self._turn = 0
        self._share_bad_sample_record()

    def load_elastic_state(self, states: list[dict]) -> None:
        """Continue a run of another shard count from all its shards' cursors."""
        for loader in self.loaders.values():
            loader.load_elastic_state(states)
        self._turn = 0
        self._share_bad_sample_record()

    def _share_bad_sample_record(self) -> None:
        record = {}
        for loader in self.loaders.values():
            record.update(loader.known_bad)
        for loader in self.loaders.values():
            loader.known_bad = record

    @property
    def known_bad(self) -> dict[tuple[str, int], tuple[str, str]]:
        return next(iter(self.loaders.values())).known_bad

    @property
    def bad_samples(self) -> dict[str, tuple[str, str]]:
        return next(iter(self.loaders.values())).bad_samples

    def close(self) -> None:
        for loader in self.loaders.values():
            loader.close()

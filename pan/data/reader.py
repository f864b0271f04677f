"""Loading: reference -> sample (runs in the decoding workers). `SampleReader` decodes the sample a
`Ref` names (a video CSV row, an annotation row or an image of the tars), checks it against what the
run's model takes (`SampleFit`, pan/data/fit.py), or says why it cannot; `rules_of` and
`read_row_sources` give it the config's frame rules and sources (`open_sources`: each source opened
or the error that stops it, for `pan check`'s data rows)."""

from __future__ import annotations

import collections
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import av
import numpy as np
import torch
from safetensors.torch import load, load_file
from torch.utils.data import Dataset

from pan.data.batch import TEXT_FEATURE_DIMS, Sample
from pan.data.config import DataConfig
from pan.data.decode import (
    FrameRules,
    SkipSample,
    decode_image,
    decode_video,
    frame_converter,
    frame_step,
    pick_bucket,
    video_stream,
)
from pan.data.fit import SampleFit
from pan.data.plan import IMAGE_STREAM, Ref
from pan.data.shards import shard_reader
from pan.data.sources import (
    AnnotationSource,
    ImageTarSet,
    SourceError,
    VideoCsvSource,
    caption_from_bytes,
    read_annotations,
    read_image_tars,
    read_video_csv,
)
from pan.data.storage import PathLike, StorageError, is_url, storage

RowSource = VideoCsvSource | AnnotationSource


@dataclass
class Loaded:
    ref: Ref
    sample: Sample | None
    reason: str = ""   # skip reason when sample is None
    detail: str = ""
    known: bool = False  # a known-bad sample, skipped without reading it again
    deferred: bool = False  # not read: another visit of its row was being read (see Deferred)


@dataclass(frozen=True)
class KnownBad:
    """What the sampler sends instead of a reference in the run's record of bad samples: a visit
    the worker does not read."""
    ref: Ref
    reason: str


@dataclass(frozen=True)
class Deferred(KnownBad):
    """What the sampler sends instead of a reference whose row is being read already (an earlier
    visit still in flight in the decoding workers) and is not known to be good: the worker does not
    read it either. The training process settles it when it arrives, after the earlier visit: a
    skip if that found the row bad, else it reads the row itself (PackedLoader). So a bad row is read
    once even when more visits are in flight than the data has rows."""
    reason: str = ""


class SampleReader(Dataset):
    """Map-style dataset over references: decodes one sample, or reports why it cannot.

    With `use_precomputed` false, annotation rows are decoded from their video or image even when
    they name a latent or text features (what a precompute needs). With a `fit`, every sample read
    is checked against what the run's model takes, and one that does not fit is skipped (`unfit`,
    `not_finite`).
    """

    def __init__(self, sources: dict[str, RowSource], tars: ImageTarSet | None, rules: FrameRules,
                 use_precomputed: bool = True, fit: SampleFit | None = None, cache_bytes: int = 0):
        self.sources, self.tars, self.rules = sources, tars, rules
        self.use_precomputed, self.fit = use_precomputed, fit
        self.cache = SampleCache(cache_bytes) if cache_bytes else None  # each worker process its own

    def __getitem__(self, ref: Ref | KnownBad) -> Loaded:
        if isinstance(ref, KnownBad):
            return Loaded(ref.ref, None, ref.reason, known=True, deferred=isinstance(ref, Deferred))
        cached = self.cache.get((ref.stream, ref.index)) if self.cache is not None else None
        if cached is not None:
            return Loaded(ref, cached)
        try:
            sample = self._read(ref)
            if self.fit is not None:
                self.fit.check(sample)
            if self.cache is not None:
                self.cache.put((ref.stream, ref.index), sample)
            return Loaded(ref, sample)
        except SkipSample as e:
            return Loaded(ref, None, e.reason, e.detail)
        except StorageError:  # a store unreachable through every retry: the run stops, the sample is not bad
            raise
        except FileNotFoundError as e:
            return Loaded(ref, None, "missing_file", str(e))
        except Exception as e:  # noqa: BLE001 - any error in a file (FFmpeg, Pillow, safetensors,
            # I/O) spoils that sample only; it is logged with its type so real bugs stay visible.
            return Loaded(ref, None, "decode_error", f"{type(e).__name__}: {e}")

    def read_all(self, visits: list) -> list[Loaded]:
        """`self[visit]` of each visit, in order, the members of remote shards among them fetched
        ahead, concurrently (Storage.read_ahead: PAN_DATA_READ_AHEAD at a time). Which sample each
        visit reads, and what comes of it, is the same as without: read-ahead only warms bytes."""
        with storage().read_ahead(span for span in map(self.remote_member, visits) if span):
            return [self[visit] for visit in visits]

    def remote_member(self, visit: Ref | KnownBad) -> tuple[str, int, int] | None:
        """(url, offset, size) of the member of a remote shard that reading `visit` will fetch; None
        for a visit that fetches none (a local path, a known-bad or cached row, any row that is
        not a shard member or that the read will refuse before fetching)."""
        if isinstance(visit, KnownBad) or visit.stream == IMAGE_STREAM:
            return None
        src = self.sources.get(visit.stream)
        if not isinstance(src, VideoCsvSource) or not src.precomputed or (
                self.cache is not None and (visit.stream, visit.index) in self.cache.samples):
            return None
        try:
            row = src.rows[visit.index]
            path = src.field(row, "latent_path")
            if path is None or src.field(row, "latent_offset") is None or not src.field(row, "caption"):
                return None
            path = locate(src, path)
            return (str(path), *member_span(src, row)) if is_url(path) else None
        except Exception:  # noqa: BLE001 - a row the read itself will find bad: no read-ahead for it
            return None

    def _read(self, ref: Ref) -> Sample:
        if ref.stream == IMAGE_STREAM:
            return self._image(ref.index)
        src = self.sources[ref.stream]
        if isinstance(src, AnnotationSource):
            return self._annotation_row(src, ref.index)
        return self._video_row(src, ref.index)

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
        frames, fps = decode_video(readable(existing(locate(src, path))), self.rules, start, end)
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
        path = locate(src, path)
        if src.field(row, "latent_offset") is not None:  # a member of a tar shard: one range read
            tensors = load(shard_reader().read(path, *member_span(src, row)))
        elif is_url(path):
            tensors = load(storage().read_bytes(path))
        else:
            tensors = load_file(str(existing(path)))
        latent, text = tensors.get("latent"), tensors.get("text")
        if latent is None or text is None or latent.dim() != 4 or text.dim() != 2:
            raise SkipSample("decode_error", f"{path} must hold latent [C, T, H, W] and text [L, D]; "
                                             f"it holds {sorted(tensors)}")
        extras = {k: v for k, v in tensors.items() if k not in ("latent", "text")}   # a recipe's own (SampleFit.extras)
        return Sample(sample_id, "video", caption, tuple(latent.shape[1:]), 0, latent=latent, text=text,
                      extras=extras or None)

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
            frames = decode_image(storage().read_bytes(media), self.rules)
        elif row.frames is not None:
            frames, fps = decode_frames_at(readable(media), row.frames, self.rules)
        else:
            frames, fps = decode_video(readable(media), self.rules)
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


class SampleCache:
    """Good samples read lately, by row, up to `budget` bytes of tensors; the least recently used is
    dropped first. Decoding is a function of the row and the config, so a cached sample is the one a
    new read would give, as long as the files stay as they were. Only good samples are kept: a bad
    row is in the run's record and never read again anyway. Each copy handed out is the caller's own."""

    def __init__(self, budget: int):
        self.budget, self.used = budget, 0
        self.samples: collections.OrderedDict[tuple[str, int], Sample] = collections.OrderedDict()

    def get(self, key: tuple[str, int]) -> Sample | None:
        sample = self.samples.get(key)
        if sample is None:
            return None
        self.samples.move_to_end(key)
        return sample.copy()

    def put(self, key: tuple[str, int], sample: Sample) -> None:
        size = sample.nbytes
        if size > self.budget:
            return
        replaced = self.samples.pop(key, None)   # a row put again: its old bytes are no longer held
        self.used += size - (replaced.nbytes if replaced is not None else 0)
        self.samples[key] = sample.copy()
        while self.used > self.budget:
            _, dropped = self.samples.popitem(last=False)
            self.used -= dropped.nbytes


def existing(path: PathLike) -> PathLike:
    """A local file that is there (else the sample is skipped); a URL as it is (a missing object is
    found by its read, which skips the sample as missing_file without a request more)."""
    if not is_url(path) and not Path(path).is_file():
        raise SkipSample("missing_file", str(path))
    return path


def locate(src: VideoCsvSource, cell: str) -> PathLike:
    """A path cell of a CSV: a URL as it is, else a path relative to the CSV's folder."""
    return cell if is_url(cell) else src.resolve(cell)


def readable(path: PathLike):
    """What a decoder opens: a local path, or a remote file's bytes (read through the local cache)."""
    return io.BytesIO(storage().read_bytes(path)) if is_url(path) else str(path)


def member_span(src: VideoCsvSource, row: list[str]) -> tuple[int, int]:
    """(offset, size) of a sharded row's member, from its latent_offset and latent_size cells."""
    span = []
    for column in ("latent_offset", "latent_size"):
        text = src.field(row, column)
        if text is None or not str(text).isdigit():
            raise SkipSample("bad_row", f"{column} is {text!r}, not a byte count")
        span.append(int(text))
    return span[0], span[1]


def read_raw_latent(path: PathLike) -> torch.Tensor:
    """A Pyramid-Flow latent `.pt`: [C, T, H, W], or [1, C, T, H, W] as its extraction tool saves it."""
    latent = torch.load(readable(path), map_location="cpu", weights_only=True)
    if isinstance(latent, torch.Tensor) and latent.dim() == 5 and latent.shape[0] == 1:
        latent = latent[0]
    if not isinstance(latent, torch.Tensor) or latent.dim() != 4 or not latent.is_floating_point():
        raise SkipSample("decode_error", f"{path} must hold one float tensor [C, T, H, W] (or "
                                         f"[1, C, T, H, W]); it holds {describe(latent)}")
    return latent


def read_text_features(path: PathLike) -> dict[str, torch.Tensor]:
    """A Pyramid-Flow text-feature `.pt` (a dict of TEXT_FEATURE_DIMS tensors, each possibly with a
    leading batch dim of 1, which is dropped)."""
    saved = torch.load(readable(path), map_location="cpu", weights_only=True)
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
        convert = frame_converter(stream, rules)
        kept: list[np.ndarray] = []
        for index, frame in enumerate(container.decode(stream)):  # from the start: indices are exact
            if index == wanted[len(kept)]:
                kept.append(convert(frame))
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


SourceKind = Literal["video_csv", "annotations", "image_tars"]
SOURCE_KINDS: tuple[SourceKind, ...] = ("video_csv", "annotations", "image_tars")


@dataclass(frozen=True)
class OpenedSource:
    """One data source of a config as `open_sources` found it: opened, or the error that stops it."""
    kind: SourceKind
    label: str | Path     # the path as configured; the image tars': their paths, joined by ", "
    source: VideoCsvSource | AnnotationSource | ImageTarSet | None   # None: it could not be opened
    error: Exception | None = None

    @property
    def stream(self) -> str:
        """Its stream name (of an opened source)."""
        return IMAGE_STREAM if self.kind == "image_tars" else stream_name(self.source)


@dataclass(frozen=True)
class OpenedSources:
    """Every source of a config, opened (rows read, tar headers indexed) or not, in the order
    training reads them: the video CSVs, the annotation files, then the image tars as one."""
    entries: tuple[OpenedSource, ...]

    def __iter__(self):
        return iter(self.entries)

    @property
    def failed(self) -> list[OpenedSource]:
        return [o for o in self.entries if o.source is None]

    @property
    def opened(self) -> list[OpenedSource]:
        return [o for o in self.entries if o.source is not None]

    @property
    def row_sources(self) -> dict[str, RowSource]:
        """The opened video CSVs and annotation files by stream name (what a SampleReader reads)."""
        return {o.stream: o.source for o in self.opened if o.kind != "image_tars"}

    @property
    def tars(self) -> ImageTarSet | None:
        return next((o.source for o in self.opened if o.kind == "image_tars"), None)


def open_sources(cfg: DataConfig, kinds: tuple[SourceKind, ...] = SOURCE_KINDS) -> OpenedSources:
    """Open every source of `kinds` a config names, each on its own: a file that cannot be read is
    kept with its error, and the others are still opened (`read_row_sources`, for training, stops
    at the first)."""
    openers = []
    if "video_csv" in kinds:
        openers += [("video_csv", p, lambda p=p: read_video_csv(p)) for p in cfg.video_csv_paths]
    if "annotations" in kinds:
        openers += [("annotations", p, lambda p=p: read_annotations(p)) for p in cfg.annotation_paths]
    if "image_tars" in kinds and cfg.image_tar_paths:
        openers.append(("image_tars", ", ".join(map(str, cfg.image_tar_paths)),
                        lambda: read_image_tars(cfg.image_tar_paths)))
    entries = []
    for kind, label, read in openers:
        try:
            entries.append(OpenedSource(kind, label, read()))
        except (SourceError, OSError, UnicodeDecodeError) as e:
            entries.append(OpenedSource(kind, label, None, e))
    return OpenedSources(tuple(entries))

"""The causal_vae recipe's data: random windows of real clips, each rank decoding only its own
frames (ClipReader, decode_window), and the micro-batch as one rank sees it (ClipBatch)."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from pan.data.batch import Sample
from pan.data.decode import FrameRules, SkipSample, decode_image, frame_converter, frame_step, video_stream
from pan.data.plan import Ref, stable_int
from pan.data.reader import KnownBad, SampleReader, existing, number, readable
from pan.data.storage import PathLike, storage
from pan.parallel.vae_context import frame_range


class ClipBatch:
    """One micro-batch as this rank sees it: each sample's own frames (all of them without context
    parallel), the posterior noise of its own latent frames, and its full frame count.

    A plain class, not a dataclass: FSDP rebuilds dataclasses and lists passed to a forward (to cast
    their tensors), and the objective writes into this object during the forward."""

    def __init__(self, clips: list[Tensor], noises: list[Tensor], full_frames: list[int],
                 sample_ids: list[str], count: float, frames: int):
        self.clips = clips                  # [3, t_own, H, W] in [-1, 1]
        self.noises = noises                # [C, t'_own, h, w]
        self.full_frames = full_frames      # T of each whole clip
        self.sample_ids = sample_ids
        self.count = count                  # samples this rank counts (0 on context ranks > 0)
        self.frames = frames                # frames this rank holds
        self.bad_samples = 0
        self.packing = 1.0
        self.outputs: list = []             # (x, x_hat detached, T) per shape group, for the discriminator

    def groups(self) -> list[list[int]]:
        """Sample indices grouped by shape (each group runs as one batch), in order of first use."""
        by_shape: dict[tuple, list[int]] = {}
        for i, clip in enumerate(self.clips):
            by_shape.setdefault((tuple(clip.shape), self.full_frames[i]), []).append(i)
        return list(by_shape.values())

    def stacked(self) -> list[Tensor]:
        return [torch.stack([self.clips[i] for i in g]) for g in self.groups()]


@dataclass(frozen=True)
class FrameShare:
    """Which frames of a clip of `total` frames this process keeps: [first, first + count)."""
    total: int
    first: int
    count: int


def decode_window(path: str, rules: FrameRules, share: FrameShare, pick: Callable[[int], int],
                  start: float = 0.0, end: float | None = None) -> tuple[Tensor, float]:
    """A window of `share.total` frames (after target_fps resampling) of the video's [start, end)
    seconds, at an offset `pick(latest possible offset in source frames)`; only the frames
    [share.first, share.first + share.count) of the window are converted (resized and cropped).
    Returns (uint8 frames [count, 3, H, W], output fps)."""
    import av
    import numpy as np

    with av.open(path) as container:
        stream, rate = video_stream(container)
        src_fps = float(rate)
        step = frame_step(src_fps, rules)
        convert = frame_converter(stream, rules)
        t0 = float(stream.start_time * stream.time_base) if stream.start_time is not None else 0.0
        duration = (float(stream.duration * stream.time_base) if stream.duration
                    else (container.duration or 0) / 1e6)
        total = stream.frames or round(duration * src_fps)
        first_src = round(start * src_fps)
        last_src = min(total, round(end * src_fps)) if end is not None else total
        span = round((share.total - 1) * step) + 1                 # source frames the window covers
        if last_src - first_src < span:
            raise SkipSample("too_short", f"{last_src - first_src} source frames, a window of {share.total} "
                                          f"frames at {src_fps / step:.3g} fps needs {span}")
        offset = first_src + pick(last_src - first_src - span)
        wanted = [offset + round((share.first + k) * step) for k in range(share.count)]
        if wanted[0] > 0:
            container.seek(int((t0 + wanted[0] / src_fps) / stream.time_base), stream=stream, backward=True)
        todo, kept = set(wanted), {}
        for frame in container.decode(stream):
            index = round(((frame.time or 0.0) - t0) * src_fps)
            if index in todo and index not in kept:
                kept[index] = convert(frame)
            if index >= wanted[-1]:
                break
    if len(kept) < len(todo):
        raise SkipSample("too_short", f"decoded {len(kept)} of the window's {len(todo)} frames (the clip "
                                      "ends before its metadata says)")
    frames = np.stack([kept[i] for i in wanted])
    return torch.from_numpy(frames).permute(0, 3, 1, 2).contiguous(), src_fps / step


class ClipReader(SampleReader):
    """pan's sample reader with the VAE's sampling: each video a window of `max_frames` frames at a
    random offset (the same for every rank of a context group: drawn from the sample's reference),
    of which this process decodes only its own share; images are 1-frame clips. Sources: video CSVs
    (`path`), Pyramid-Flow annotation files (rows `{"video": path}` or `{"image": path}`; their
    `latent`, `text_fea` and `frames` are not used: the VAE reads pixels and picks its own windows)
    and image tars. Captions are not needed. The whole clip's shape is the sample's grid, so every
    rank of a group packs its batches alike."""

    def __init__(self, base: SampleReader, *, seed: int, temporal_factor: int, context_rank: int = 0,
                 context_size: int = 1, random_window: bool = True):
        super().__init__(base.sources, base.tars, base.rules, use_precomputed=False, fit=base.fit)
        self.seed, self.temporal_factor = seed, temporal_factor
        self.context_rank, self.context_size, self.random_window = context_rank, context_size, random_window
        self._window_rng = random.Random(0)

    def __getitem__(self, ref: Ref | KnownBad):
        if not isinstance(ref, KnownBad):  # (a known-bad or deferred visit is not read)
            self._window_rng = random.Random(stable_int(self.seed, "window", ref.stream, ref.epoch, ref.index))
        return super().__getitem__(ref)

    def share(self) -> FrameShare:
        total = self.rules.max_frames
        start, stop = frame_range(total, self.temporal_factor, self.context_size, self.context_rank)
        return FrameShare(total, start, stop - start)

    def video(self, sample_id: str, path: PathLike, start: float = 0.0, end: float | None = None) -> Sample:
        """The sample of a video file (or URL): this rank's frames of a (random) window of max_frames frames."""
        media = readable(existing(path))
        pick = (lambda latest: self._window_rng.randint(0, latest)) if self.random_window else (lambda _: 0)
        frames, fps = decode_window(media, self.rules, self.share(), pick, start, end)
        grid = (self.rules.max_frames, frames.shape[2], frames.shape[3])
        return Sample(sample_id, "video", "", grid, 0, frames=frames, fps=fps)

    def image(self, sample_id: str, data: bytes) -> Sample:
        frames = decode_image(data, self.rules)
        return Sample(sample_id, "image", "", tuple(frames.shape[k] for k in (0, 2, 3)), 0, frames=frames)

    def _video_row(self, src, i: int) -> Sample:
        row = src.rows[i]
        path = src.field(row, "path")
        if path is None:
            raise SkipSample("missing_file", "the path cell is empty (a precomputed latent row? the VAE "
                                             "trains on pixels)")
        start = number(src, row, "start_time") or 0.0
        end = number(src, row, "end_time")
        self._precheck(src, row, start, end)
        return self.video(f"{src.name}:{i}", src.resolve(path), start, end)

    def _annotation_row(self, src, i: int) -> Sample:
        try:
            row = json.loads(src.rows[i])
        except ValueError as e:
            raise SkipSample("bad_row", f"not a JSON object: {e}") from None
        media = [k for k in ("video", "image") if isinstance(row, dict) and isinstance(row.get(k), str)]
        if len(media) != 1:
            raise SkipSample("bad_row", "a row for the VAE names a `video` or an `image` path (one of them)")
        path = src.resolve(row[media[0]].strip())
        if media[0] == "image":
            return self.image(f"{src.name}:{i}", storage().read_bytes(existing(path)))
        return self.video(f"{src.name}:{i}", path)

    def _image(self, i: int) -> Sample:
        image = self.tars.images[i]
        data, _ = self.tars.read(image)
        return self.image(self.tars.sample_id(image), data)

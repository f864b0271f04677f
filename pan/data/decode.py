"""Decoding: video clips with PyAV and images with Pillow, to uint8 frames [T, 3, H, W].

Every clip is resized to cover its resolution bucket (aspect ratio kept) and centre-cropped to it.
Frames stay uint8 until the recipe normalises them to [-1, 1]: a quarter of float32's memory and of
the bytes workers hand to the training process.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import av
import numpy as np
import torch
from PIL import Image, ImageOps

# NTSC rates (29.97 for 30, 23.976 for 24) must count as the nominal rate, not as too slow.
FPS_TOLERANCE = 0.01


class SkipSample(Exception):
    """A sample that cannot be used; `reason` is one of the documented skip reasons."""

    def __init__(self, reason: str, detail: str):
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}")


@dataclass(frozen=True)
class FrameRules:
    """What a decoded clip must look like (from DataConfig)."""
    buckets: tuple[tuple[int, int], ...]  # (height, width)
    allow_upscale: bool
    target_fps: float | None
    min_frames: int
    max_frames: int
    frames_mod: int
    frames_remainder: int

    def usable_count(self, available: int) -> int:
        """Largest frame count <= available and <= max_frames that obeys the modulo rule (0: none)."""
        n = min(available, self.max_frames)
        while n > 0 and n % self.frames_mod != self.frames_remainder % self.frames_mod:
            n -= 1
        return n


def nearest_bucket(height: int, width: int, buckets) -> tuple[int, int]:
    """The bucket whose aspect ratio is closest to the source's (in log space, so 2:1 and 1:2 are
    equally far from 1:1); the first listed wins ties."""
    aspect = math.log(width / height)
    return min(buckets, key=lambda b: abs(math.log(b[1] / b[0]) - aspect))


def cover_size(height: int, width: int, bucket: tuple[int, int]) -> tuple[int, int, float]:
    """Size (h, w) to resize to so the bucket fits inside with the aspect kept, and the scale."""
    bh, bw = bucket
    scale = max(bh / height, bw / width)
    return max(bh, round(height * scale)), max(bw, round(width * scale)), scale


def centre_crop(frames: np.ndarray, bucket: tuple[int, int]) -> np.ndarray:
    """[..., H, W, C] -> [..., bh, bw, C], centred."""
    bh, bw = bucket
    h, w = frames.shape[-3:-1]
    top, left = (h - bh) // 2, (w - bw) // 2
    return frames[..., top:top + bh, left:left + bw, :]


def pick_bucket(height: int, width: int, rules: FrameRules) -> tuple[tuple[int, int], int, int, float]:
    bucket = nearest_bucket(height, width, rules.buckets)
    h, w, scale = cover_size(height, width, bucket)
    if scale > 1 and not rules.allow_upscale:
        raise SkipSample("too_small", f"{width}x{height} is smaller than its bucket "
                                      f"{bucket[1]}x{bucket[0]} and allow_upscale is false")
    return bucket, h, w, scale


def frame_step(src_fps: float, rules: FrameRules) -> float:
    """Source frames per output frame (1.0 keeps every frame)."""
    if rules.target_fps is None:
        return 1.0
    if src_fps < rules.target_fps * (1 - FPS_TOLERANCE):
        raise SkipSample("low_fps", f"{src_fps:.3f} fps is below target_fps {rules.target_fps}")
    return max(1.0, src_fps / rules.target_fps)


def video_stream(container):
    """A decodable video's first video stream (threaded decoding on) and its frame rate; raises
    SkipSample when it has no video stream or no frame rate."""
    if not container.streams.video:
        raise SkipSample("decode_error", "no video stream")
    stream = container.streams.video[0]
    stream.thread_type = "AUTO"  # frame + slice threads: several times faster on HD h264
    rate = stream.average_rate or stream.guessed_rate
    if not rate:
        raise SkipSample("decode_error", "unknown frame rate")
    return stream, rate


def frame_converter(stream, rules: FrameRules):
    """How each decoded frame of `stream` becomes one of the clip's frames: resized to cover its
    bucket (area averaging when shrinking avoids aliasing; bicubic when enlarging) and centre-cropped
    to it, as uint8 RGB [H, W, 3]. What every decoder of video files shares."""
    bucket, h, w, scale = pick_bucket(stream.codec_context.height, stream.codec_context.width, rules)
    interpolation = "AREA" if scale < 1 else "BICUBIC"

    def convert(frame) -> np.ndarray:
        return centre_crop(frame.to_ndarray(format="rgb24", width=w, height=h, interpolation=interpolation), bucket)
    return convert


def decode_video(path: str, rules: FrameRules, start: float = 0.0,
                 end: float | None = None) -> tuple[torch.Tensor, float]:
    """Decode [start, end) seconds of a video -> (uint8 frames [T, 3, H, W], output fps).

    Frames are selected from the clip's start (every `frame_step`-th source frame, nearest), and T is
    the longest count the frame rules allow. Raises SkipSample for clips that do not qualify;
    PyAV/FFmpeg errors propagate (the caller counts them as decode errors).
    """
    with av.open(path) as container:
        stream, rate = video_stream(container)
        src_fps = float(rate)
        step = frame_step(src_fps, rules)
        convert = frame_converter(stream, rules)
        wanted = [round(k * step) for k in range(rules.max_frames)]  # source indices, from start
        t0 = float(stream.start_time * stream.time_base) if stream.start_time is not None else 0.0
        half_frame = 0.5 / src_fps
        if start > 0:
            container.seek(int((t0 + start) / stream.time_base), stream=stream, backward=True)
        kept: list[np.ndarray] = []
        index = 0  # source frame index counted from `start`
        for frame in container.decode(stream):
            t = (frame.time - t0) if frame.time is not None else start + index / src_fps
            if t < start - half_frame:
                continue  # before the clip: decoded only because seeking lands on a keyframe
            if end is not None and t >= end - half_frame:
                break
            if index == wanted[len(kept)]:
                kept.append(convert(frame))
                if len(kept) == len(wanted):
                    break
            index += 1
    count = rules.usable_count(len(kept))
    if count < rules.min_frames:
        raise SkipSample("too_short", f"{len(kept)} usable frames, min_frames {rules.min_frames} "
                                      f"(with rule count % {rules.frames_mod} == {rules.frames_remainder})")
    frames = torch.from_numpy(np.stack(kept[:count])).permute(0, 3, 1, 2).contiguous()
    return frames, src_fps / step


def decode_image(data: bytes, rules: FrameRules) -> torch.Tensor:
    """Image bytes -> uint8 frames [1, 3, H, W] (an image is a 1-frame video)."""
    with Image.open(io.BytesIO(data)) as img:
        img = img.convert("RGB")
        bucket, _, _, scale = pick_bucket(img.height, img.width, rules)
        bh, bw = bucket
        method = Image.Resampling.BOX if scale < 1 else Image.Resampling.BICUBIC
        img = ImageOps.fit(img, (bw, bh), method=method)
    return torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1).unsqueeze(0).contiguous()

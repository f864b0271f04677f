"""Decoding real videos and images: buckets, aspect-preserving crop, fps resampling, frame rules."""

from __future__ import annotations

import io

import av
import numpy as np
import pytest
import torch
from PIL import Image

from pan.data.decode import FrameRules, SkipSample, cover_size, decode_image, decode_video, nearest_bucket
from test_data_sources import BIKES, CARPHONE, image_bytes, real_video


def rules(buckets=((136, 320),), **kw) -> FrameRules:
    base = dict(buckets=tuple(buckets), allow_upscale=True, target_fps=None, min_frames=1, max_frames=9,
                frames_mod=4, frames_remainder=1)
    base.update(kw)
    return FrameRules(**base)


def reference_frames(name: str, width: int, height: int, count: int, interpolation="AREA") -> np.ndarray:
    """The first `count` frames straight from PyAV at (width, height): [T, H, W, 3]."""
    with av.open(str(real_video(name))) as c:
        out = []
        for frame in c.decode(video=0):
            out.append(frame.to_ndarray(format="rgb24", width=width, height=height,
                                        interpolation=interpolation))
            if len(out) == count:
                break
    return np.stack(out)


def as_hwc(frames: torch.Tensor) -> np.ndarray:
    return frames.permute(0, 2, 3, 1).numpy()


def test_bucket_choice_and_cover_size():
    buckets = [(704, 1248), (1248, 704), (960, 960)]
    assert nearest_bucket(720, 1280, buckets) == (704, 1248)
    assert nearest_bucket(1920, 1080, buckets) == (1248, 704)
    assert nearest_bucket(500, 520, buckets) == (960, 960)
    # 176x144 (w x h) into 64x64: scale by 64/144 keeps the aspect -> 78x64, then crop the width
    assert cover_size(144, 176, (64, 64))[:2] == (64, 78)


def test_same_aspect_bucket_is_a_plain_resize():
    frames, fps = decode_video(str(real_video(BIKES)), rules())
    assert frames.dtype == torch.uint8 and frames.shape == (9, 3, 136, 320) and fps == 25
    np.testing.assert_array_equal(as_hwc(frames), reference_frames(BIKES, 320, 136, 9))


def test_other_aspect_is_resized_to_cover_then_centre_cropped():
    frames, _ = decode_video(str(real_video(CARPHONE)), rules(buckets=[(64, 64), (32, 128)], max_frames=5))
    assert frames.shape == (5, 3, 64, 64)
    full = reference_frames(CARPHONE, 78, 64, 5)  # 176x144 scaled to height 64 keeps 78 columns
    np.testing.assert_array_equal(as_hwc(frames), full[:, :, 7:71])


def test_target_fps_selects_every_other_frame_and_start_time_seeks():
    src = reference_frames(BIKES, 320, 136, 120)
    frames, fps = decode_video(str(real_video(BIKES)), rules(target_fps=12.5, max_frames=5), start=2.0)
    assert fps == 12.5
    np.testing.assert_array_equal(as_hwc(frames), src[50:60:2])


def test_end_time_and_the_frame_rule_decide_the_length():
    # [1 s, 1.4 s) of 25 fps = 10 frames; the 1 + 4k rule keeps 9
    frames, _ = decode_video(str(real_video(BIKES)), rules(max_frames=121), start=1.0, end=1.4)
    assert frames.shape[0] == 9
    frames, _ = decode_video(str(real_video(BIKES)), rules(max_frames=121, frames_mod=1, frames_remainder=0),
                             start=1.0, end=1.4)
    assert frames.shape[0] == 10


def test_clips_that_do_not_qualify_raise_skip():
    path = str(real_video(CARPHONE))  # 29.97 fps, 176x144
    assert decode_video(path, rules(target_fps=30, max_frames=5))[0].shape[0] == 5  # NTSC counts as 30
    with pytest.raises(SkipSample) as e:
        decode_video(path, rules(target_fps=50))
    assert e.value.reason == "low_fps"
    with pytest.raises(SkipSample) as e:
        decode_video(path, rules(min_frames=9), start=0.0, end=0.2)
    assert e.value.reason == "too_short"
    with pytest.raises(SkipSample) as e:
        decode_video(path, rules(buckets=[(256, 256)], allow_upscale=False))
    assert e.value.reason == "too_small"


def test_image_is_a_one_frame_video_cropped_to_its_bucket():
    img = np.zeros((60, 120, 3), np.uint8)
    img[:, 30:90] = 255  # a white band in the middle third of the width
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG")
    frames = decode_image(buf.getvalue(), rules(buckets=[(30, 30), (30, 60)]))
    assert frames.shape == (1, 3, 30, 60) and frames.dtype == torch.uint8
    band = frames[0, :, :, 20:40].float().mean()
    assert band > 250 and frames[0, :, :, :10].float().mean() < 5  # aspect kept, nothing cropped
    square = decode_image(image_bytes(100, 40, 3), rules(buckets=[(16, 16)]))
    assert square.shape == (1, 3, 16, 16)

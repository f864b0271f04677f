"""Writing videos: MP4 through PyAV, GIF through Pillow. Frames are uint8 [T, H, W, 3] RGB."""

from __future__ import annotations

from pathlib import Path

import av
import numpy as np
import torch
from PIL import Image


def to_uint8_frames(frames: torch.Tensor) -> np.ndarray:
    """[T, 3, H, W] in [-1, 1] -> uint8 [T, H, W, 3]."""
    x = frames.detach().float().clamp(-1, 1).add(1).mul(127.5).round().to(torch.uint8)
    return x.permute(0, 2, 3, 1).cpu().numpy()


def video_codec() -> str:
    """H.264 where this PyAV build can encode it, else MPEG-4 part 2 (every FFmpeg build has it)."""
    return "libx264" if "libx264" in av.codecs_available else "mpeg4"


def write_mp4(path: str | Path, frames: np.ndarray, fps: float, quantiser: int = 10,
              pix_fmt: str = "yuv420p") -> None:
    """Encode frames as an MP4 readable by PyAV and browsers (odd sizes are padded to even).

    `pix_fmt` yuv420p (what browsers play) stores colour at half the resolution on each axis;
    yuv444p keeps it at full resolution (H.264 High 4:4:4: PyAV and FFmpeg read it, few browsers do).

    A constant quantiser and one thread make the bytes reproducible: x264's rate control and frame
    threads write different bytes for the same frames from one run to the next.
    """
    frames = _even(frames)
    codec = video_codec()
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=round(fps))
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = pix_fmt if codec == "libx264" else "yuv420p"  # MPEG-4 part 2: 4:2:0 only
        stream.options = {"qp": str(quantiser)} if codec == "libx264" else {"qscale": "2"}
        stream.codec_context.thread_count = 1
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())  # flush


def write_gif(path: str | Path, frames: np.ndarray, fps: float, scale: int = 1) -> None:
    images = [Image.fromarray(f) for f in frames]
    if scale != 1:
        images = [im.resize((im.width * scale, im.height * scale), Image.NEAREST) for im in images]
    images[0].save(path, save_all=True, append_images=images[1:], duration=round(1000 / fps), loop=0)


def _even(frames: np.ndarray) -> np.ndarray:
    t, h, w, c = frames.shape
    if h % 2 or w % 2:
        frames = np.pad(frames, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)), mode="edge")
    return frames

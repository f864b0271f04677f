"""What every demo writes beside its samples: the contact sheet, the loss curve, report lines."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from pan.demo.analyser import load_video
from pan.data.media import write_gif


@contextlib.contextmanager
def announced(what: str) -> Iterator[None]:
    """Print what a set-up step does before it and its time after: the demos' data phases (clips
    written, encoded, a model folder made) take up to ~15 s before the trainer logs anything."""
    print(f"{what} ...", flush=True)
    t0 = time.perf_counter()
    yield
    print(f"{what}: {time.perf_counter() - t0:.1f} s", flush=True)


def write_contact_sheet(videos: list[Path], path: Path, scale: int = 2, columns: int = 5) -> None:
    """All samples tiled into one looping GIF (scaled up `scale`x so 32-pixel clips are visible)."""
    clips = [load_video(v) for v in videos]  # [T, H, W, 3] uint8 each
    t, h, w, _ = clips[0].shape
    columns = min(columns, len(clips))
    rows = -(-len(clips) // columns)
    gap = 2
    sheet = np.full((t, rows * (h + gap) + gap, columns * (w + gap) + gap, 3), 64, dtype=np.uint8)
    for i, clip in enumerate(clips):
        y, x = gap + (i // columns) * (h + gap), gap + (i % columns) * (w + gap)
        sheet[:, y:y + h, x:x + w] = clip[:t]
    write_gif(path, sheet, fps=8, scale=scale)


def draw_loss_curve(metrics_path: Path, path: Path, size: tuple[int, int] = (640, 360)) -> None:
    """Training loss against step (metrics.jsonl rows, one per log interval), drawn with Pillow."""
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    steps = np.array([r["step"] for r in rows], dtype=float)
    loss = np.array([r["loss"] for r in rows], dtype=float)
    width, height = size
    left, right, top, bottom = 60, 20, 30, 40
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    x0, x1 = steps.min(), max(steps.max(), steps.min() + 1)
    y0, y1 = 0.0, max(loss.max(), 1e-6) * 1.05

    def to_px(s: float, v: float) -> tuple[float, float]:
        return (left + (s - x0) / (x1 - x0) * (width - left - right),
                height - bottom - (v - y0) / (y1 - y0) * (height - top - bottom))

    draw.rectangle([left, top, width - right, height - bottom], outline="black")
    for frac in (0.0, 0.25, 0.5, 0.75, 1.0):
        v = y0 + frac * (y1 - y0)
        _, y = to_px(x0, v)
        draw.line([left - 4, y, left, y], fill="black")
        draw.text((4, y - 6), f"{v:.3f}", fill="black")
    for s in (x0, (x0 + x1) / 2, x1):
        x, _ = to_px(s, y0)
        draw.text((x - 10, height - bottom + 6), f"{s:.0f}", fill="black")
    draw.text((left, 8), "training loss (flow-matching MSE) vs step", fill="black")
    points = [to_px(s, v) for s, v in zip(steps, loss)]
    if len(points) > 1:
        draw.line(points, fill=(200, 40, 40), width=2)
    for x, y in points:
        draw.ellipse([x - 2, y - 2, x + 2, y + 2], fill=(200, 40, 40))
    image.save(path)


def pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def accuracy_line(scores: dict) -> str:
    return (f"colour {pct(scores['colour_accuracy'])}, direction {pct(scores['direction_accuracy'])}, "
            f"shape {pct(scores['shape_accuracy'])}, joint {pct(scores['joint_accuracy'])} "
            f"({scores['num_videos']} videos)")


def files_section(out: Path, files: list[Path]) -> list[str]:
    return ["## Files", "", *(f"- `{f.relative_to(out)}`" for f in files), ""]

"""What every demo writes beside its samples: the contact sheet, the loss curve, report lines."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

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


def pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def accuracy_line(scores: dict) -> str:
    return (f"colour {pct(scores['colour_accuracy'])}, direction {pct(scores['direction_accuracy'])}, "
            f"shape {pct(scores['shape_accuracy'])}, joint {pct(scores['joint_accuracy'])} "
            f"({scores['num_videos']} videos)")


def files_section(out: Path, files: list[Path]) -> list[str]:
    return ["## Files", "", *(f"- `{f.relative_to(out)}`" for f in files), ""]

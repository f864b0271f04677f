"""What every demo writes beside its samples: the contact sheet, the loss curve, report lines."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from pan.demo.analyser import format_table, load_video, score_videos
from pan.data.media import write_gif
from pan.runtime.plot import plot_run


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


def report_scored_samples(recipe: str, out: Path, config: Path, run_dir: Path, steps: int, seconds: dict[str, float],
                          videos: list[Path], prompts: list[dict]) -> dict:
    """Score a text-to-video demo's samples (read back from the MP4s, as every demo scores its own)
    and write what it leaves beside them: samples/contact_sheet.gif, samples/scores.json, loss.png
    (the panels of `pan plot`) and report.md. Returns the scores."""
    samples_dir = out / "samples"
    write_contact_sheet(videos, samples_dir / "contact_sheet.gif")
    scores = score_videos(videos, prompts)
    table = format_table(scores)
    print(table)
    (samples_dir / "scores.json").write_text(json.dumps(scores, indent=1) + "\n")
    metrics_path = run_dir / "metrics.jsonl"
    plot_run(metrics_path, out / "loss.png")
    final_loss = json.loads(metrics_path.read_text().splitlines()[-1])["loss"]
    files = [config, out / "loss.png", samples_dir / "contact_sheet.gif", samples_dir / "scores.json",
             *videos, *(v.with_suffix(".gif") for v in videos)]
    lines = [
        f"# pan demo report: {recipe}", "",
        f"- training steps: {steps}",
        *(f"- {name} time: {s:.0f} s" for name, s in seconds.items()),
        f"- final training loss (last log interval): {final_loss:.4f}",
        f"- held-out prompts: {accuracy_line(scores)}", "",
        "## Scores", "", "```", table, "```", "", *files_section(out, files)]
    (out / "report.md").write_text("\n".join(lines))
    return scores

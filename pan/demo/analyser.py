"""Deterministic scoring of demo videos: does the clip show the prompt's colour, motion and shape?

The demo (see docs/demo.md) trains on `pan.data.synth` clips: one shape of a palette colour moving
over a black background. This analyser reads a video the same way a person would:

1. background = per-channel median of the border pixels of all frames (the object covers little of
   the border, and unlike a per-pixel temporal median this still works when the object stands still);
2. foreground = pixels whose largest channel difference from the background exceeds a threshold;
   no object when too few such pixels, or when they cover too much of the frame (noise, flicker);
3. colour = weighted majority vote of the foreground pixels' nearest palette colour, compared after
   dividing each colour by its largest channel, so a dim or anti-aliased red is still red;
4. direction = sign and axis of the least-squares slope of the mask-weighted centroid over time,
   "static" when it moves less than a fraction of the frame, "unknown" when no axis dominates or
   the centroid does not follow a line;
5. shape, from the object's largest connected blob cut at half its peak contrast: an apex-up
   triangle has its centroid 2/3 of the way down its bounding box (square and circle: 1/2); between
   the other two, the fill ratio (area / bounding-box area) is ~1.0 for a square, ~pi/4 for a circle.

    scores = score_videos([video_or_mp4_path, ...], ["a red square moving left", ...])
    print(format_table(scores))
    python -m pan.demo.analyser --csv samples.csv        # columns path (relative to the CSV) and caption
"""

from __future__ import annotations

import argparse
import csv
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import av
import numpy as np
from scipy import ndimage

from pan.config.arguments import input_file, output_file, whole_number
from pan.data.synth import BACKGROUND, PALETTE, parse_caption

if TYPE_CHECKING:
    from torch import Tensor

UNKNOWN = "unknown"
STATIC = "static"


@dataclass(frozen=True)
class Thresholds:
    """The analyser's decision thresholds (intensities in [0, 1], lengths as fractions of the frame)."""

    foreground: float = 0.2  # largest channel difference from the background that marks an object
    min_object_area: float = 0.004  # per frame, at least this fraction of pixels (and >= 3 pixels)
    max_foreground_fraction: float = 0.45  # more than this, averaged over frames: no single object
    min_object_frames: float = 0.5  # the object must be found in at least this fraction of frames
    min_colour_confidence: float = 0.5  # share of the colour vote the winner needs
    min_displacement: float = 0.08  # smaller centroid travel over the clip reads as "static"
    axis_dominance: float = 1.5  # the motion axis must move this many times more than the other
    min_line_fit: float = 0.5  # R^2 of the centroid on the motion axis vs a line; below: "unknown"
    triangle_depth: float = 0.56  # centroid this deep in the bounding box: apex-up triangle (2/3)
    square_fill: float = 0.88  # otherwise fill ratio above this: square (1.0), else circle (pi/4)


@dataclass(frozen=True)
class VideoAnalysis:
    """What the analyser sees in one video."""

    colour: str
    colour_confidence: float  # the winning colour's share of the vote
    direction: str  # left | right | up | down | static | unknown
    dx: float  # centroid travel over the clip, fraction of the width (positive: right)
    dy: float  # centroid travel over the clip, fraction of the height (positive: down)
    shape: str
    fill_ratio: float  # blob area / bounding-box area
    centroid_depth: float  # blob centroid's height in its box, from the top (0.5: symmetric)
    foreground_fraction: float  # share of pixels marked foreground, averaged over frames


def load_video(path: str | Path) -> np.ndarray:
    """Decode all frames of a video file with PyAV: [T, H, W, 3] uint8."""
    with av.open(str(path)) as container:
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    if not frames:
        raise ValueError(f"{path}: no video frames")
    return np.stack(frames)


def to_unit_frames(video: Any) -> np.ndarray:
    """A video as float32 [T, H, W, 3] in [0, 1].

    Accepts an MP4 path, or an ndarray / torch tensor [T, H, W, 3] or [T, 3, H, W], uint8 or float
    in [0, 1]. Floats outside [0, 1] (e.g. a [-1, 1] model output) are refused, not guessed at.
    """
    if isinstance(video, (str, Path)):
        video = load_video(video)
    if hasattr(video, "detach"):  # torch.Tensor, without importing torch here
        video = video.detach().cpu().numpy()
    array = np.asarray(video)
    if array.ndim != 4 or 3 not in (array.shape[1], array.shape[3]):
        raise ValueError(f"expected a video [T, H, W, 3] or [T, 3, H, W], got shape {array.shape}")
    if array.shape[3] != 3:
        array = array.transpose(0, 2, 3, 1)  # [T, 3, H, W] -> [T, H, W, 3]
    if array.dtype == np.uint8:
        return array.astype(np.float32) / 255.0
    array = array.astype(np.float32)
    if array.min() < -0.01 or array.max() > 1.01:
        raise ValueError(f"float video values must lie in [0, 1], got [{array.min():.3f}, "
                         f"{array.max():.3f}]; map a [-1, 1] output with (x + 1) / 2 first")
    return np.clip(array, 0.0, 1.0)


def _chroma_directions(colours: np.ndarray, background: np.ndarray) -> np.ndarray:
    """Colours lifted off the background, divided by their largest channel: [..., 3]."""
    lifted = np.clip(colours - background, 0.0, None)
    return lifted / np.maximum(lifted.max(axis=-1, keepdims=True), 1e-6)


_PALETTE_NAMES = list(PALETTE)
_PALETTE_DIRECTIONS = _chroma_directions(np.array(list(PALETTE.values()), np.float32) / 255.0,
                                         np.array(BACKGROUND, np.float32) / 255.0)  # [K, 3]


def _border_background(frames: np.ndarray) -> np.ndarray:
    """Per-channel median of every frame's one-pixel border: [3]."""
    border = np.concatenate([frames[:, 0], frames[:, -1], frames[:, :, 0], frames[:, :, -1]], axis=1)
    return np.median(border.reshape(-1, 3), axis=0)


def _classify_colour(frames: np.ndarray, background: np.ndarray, contrast: np.ndarray, mask: np.ndarray,
                     thresholds: Thresholds) -> tuple[str, float]:
    pixels = _chroma_directions(frames[mask], background)  # [N, 3]
    nearest = np.linalg.norm(pixels[:, None] - _PALETTE_DIRECTIONS[None], axis=-1)  # [N, K]
    votes = np.bincount(nearest.argmin(axis=1), weights=contrast[mask], minlength=len(_PALETTE_NAMES))
    winner = int(votes.argmax())
    confidence = float(votes[winner] / votes.sum())
    if confidence < thresholds.min_colour_confidence:
        return UNKNOWN, confidence
    return _PALETTE_NAMES[winner], confidence


def _classify_direction(contrast: np.ndarray, mask: np.ndarray, object_frames: np.ndarray,
                        thresholds: Thresholds) -> tuple[str, float, float]:
    num_frames, height, width = contrast.shape
    weights = contrast * mask  # [T, H, W]
    mass = weights.sum(axis=(1, 2))  # [T]
    ys, xs = np.mgrid[0:height, 0:width]
    t = np.flatnonzero(object_frames)
    centre_x = (weights[t] * xs).sum(axis=(1, 2)) / mass[t]  # [frames with an object]
    centre_y = (weights[t] * ys).sum(axis=(1, 2)) / mass[t]
    centres = np.stack([centre_x, centre_y], axis=1)  # [n, 2]
    # Least-squares lines through the centroids; slopes (pixels per frame) become the travel over
    # the whole clip as a fraction of the frame side.
    slopes, offsets = np.polyfit(t, centres, 1)
    dx, dy = float(slopes[0]) * (num_frames - 1) / width, float(slopes[1]) * (num_frames - 1) / height
    axis = 0 if abs(dx) >= abs(dy) else 1
    along, across = (abs(dx), abs(dy)) if axis == 0 else (abs(dy), abs(dx))
    if along < thresholds.min_displacement:
        return STATIC, dx, dy
    # A drift that is not a line (an object jumping around) or has no main axis names no direction.
    residual = centres[:, axis] - (slopes[axis] * t + offsets[axis])
    line_fit = 1.0 - residual.var() / max(float(centres[:, axis].var()), 1e-12)
    if along < thresholds.axis_dominance * across or line_fit < thresholds.min_line_fit:
        return UNKNOWN, dx, dy
    if axis == 0:
        return ("right" if dx > 0 else "left"), dx, dy
    return ("down" if dy > 0 else "up"), dx, dy


def _classify_shape(contrast: np.ndarray, mask: np.ndarray, object_frames: np.ndarray,
                    thresholds: Thresholds) -> tuple[str, float, float]:
    # Half the object's peak contrast is where an anti-aliased edge covers half a pixel: the outline.
    half_peak = 0.5 * float(np.percentile(contrast[mask], 95))
    fills, depths = [], []
    for t in np.flatnonzero(object_frames):
        labels, count = ndimage.label(contrast[t] > half_peak)
        if count == 0:
            continue
        blob = labels == 1 + int(np.bincount(labels.ravel())[1:].argmax())  # largest blob only
        rows, cols = np.flatnonzero(blob.any(axis=1)), np.flatnonzero(blob.any(axis=0))
        box_height = rows[-1] - rows[0] + 1
        fills.append(blob.sum() / (box_height * (cols[-1] - cols[0] + 1)))
        row_of_pixels = np.nonzero(blob)[0]
        depths.append((row_of_pixels.mean() + 0.5 - rows[0]) / box_height)
    if not fills:
        return UNKNOWN, 0.0, 0.0
    fill, depth = float(np.median(fills)), float(np.median(depths))
    if depth >= thresholds.triangle_depth:
        return "triangle", fill, depth
    return ("square" if fill >= thresholds.square_fill else "circle"), fill, depth


def analyse_video(video: Any, thresholds: Thresholds = Thresholds()) -> VideoAnalysis:
    """Colour, direction and shape of the single moving object in `video` (see `to_unit_frames`)."""
    frames = to_unit_frames(video)  # [T, H, W, 3]
    num_frames, height, width, _ = frames.shape
    background = _border_background(frames)  # [3]
    contrast = np.abs(frames - background).max(axis=-1)  # [T, H, W]
    mask = contrast > thresholds.foreground
    foreground_fraction = float(mask.mean())
    min_pixels = max(3.0, thresholds.min_object_area * height * width)
    object_frames = mask.sum(axis=(1, 2)) >= min_pixels  # [T]
    found = (object_frames.mean() >= thresholds.min_object_frames and object_frames.sum() >= 2
             and foreground_fraction <= thresholds.max_foreground_fraction)
    if not found:
        return VideoAnalysis(UNKNOWN, 0.0, UNKNOWN, 0.0, 0.0, UNKNOWN, 0.0, 0.0, foreground_fraction)
    colour, confidence = _classify_colour(frames, background, contrast, mask, thresholds)
    direction, dx, dy = _classify_direction(contrast, mask, object_frames, thresholds)
    shape, fill, depth = _classify_shape(contrast, mask, object_frames, thresholds)
    return VideoAnalysis(colour, confidence, direction, dx, dy, shape, fill, depth, foreground_fraction)


def _targets(prompt: str | dict) -> dict[str, str | None]:
    """Expected colour, shape and direction of a prompt string or a heldout_prompts.json entry."""
    if isinstance(prompt, dict):
        parsed = parse_caption(prompt.get("prompt", ""))
        return {key: prompt.get(key) or parsed[key] for key in ("colour", "shape", "direction")}
    return parse_caption(prompt)


def _accuracy(rows: list[dict], key: str) -> float | None:
    judged = [row[f"{key}_ok"] for row in rows if row[f"{key}_ok"] is not None]
    return sum(judged) / len(judged) if judged else None


def score_videos(videos: list[Any], prompts: list[str | dict],
                 thresholds: Thresholds = Thresholds()) -> dict[str, Any]:
    """Score each video against its prompt.

    `videos`: MP4 paths, arrays or tensors (see `to_unit_frames`); `prompts`: caption strings or
    {prompt, colour, shape, direction} dicts. A property the prompt does not name is not judged.
    Returns {num_videos, colour_accuracy, direction_accuracy, shape_accuracy, joint_accuracy
    (every property the prompt names right), per_video: [...]}; an accuracy is None when nothing
    was judged.
    """
    if len(videos) != len(prompts):
        raise ValueError(f"got {len(videos)} videos but {len(prompts)} prompts")
    rows = []
    for video, prompt in zip(videos, prompts):
        seen, expected = analyse_video(video, thresholds), _targets(prompt)
        row = {"prompt": prompt["prompt"] if isinstance(prompt, dict) else prompt, **asdict(seen)}
        for key in ("colour", "direction", "shape"):
            row[f"target_{key}"] = expected[key]
            row[f"{key}_ok"] = None if expected[key] is None else row[key] == expected[key]
        named = [ok for ok in (row["colour_ok"], row["direction_ok"], row["shape_ok"]) if ok is not None]
        row["joint_ok"] = all(named) if named else None  # every property the prompt names is right
        rows.append(row)
    return {"num_videos": len(rows), **{f"{key}_accuracy": _accuracy(rows, key)
                                        for key in ("colour", "direction", "shape", "joint")},
            "per_video": rows}


def format_table(scores: dict[str, Any], max_rows: int | None = None) -> str:
    """A plain-text table: one line per video (seen vs expected), then the accuracies."""
    def mark(ok: bool | None) -> str:
        return "" if ok is None else ("ok" if ok else "X")

    header = f"{'#':>4}  {'prompt':<32} {'colour':<16} {'direction':<16} {'shape':<16}"
    lines = [header, "-" * len(header)]
    rows = scores["per_video"] if max_rows is None else scores["per_video"][:max_rows]
    for i, row in enumerate(rows):
        cells = [f"{row[key]} {mark(row[key + '_ok'])}".strip() for key in ("colour", "direction", "shape")]
        lines.append(f"{i:>4}  {row['prompt'][:32]:<32} {cells[0]:<16} {cells[1]:<16} {cells[2]:<16}")
    if len(rows) < scores["num_videos"]:
        lines.append(f"   ... {scores['num_videos'] - len(rows)} more")
    lines.append("")
    for key in ("colour", "direction", "shape", "joint"):
        value = scores[f"{key}_accuracy"]
        lines.append(f"{key + ' accuracy':<20} " + ("n/a" if value is None else f"{100 * value:.1f}%"))
    lines.append(f"{'videos':<20} {scores['num_videos']}")
    return "\n".join(lines)


def read_csv_rows(path: Path) -> list[dict[str, str]]:
    """The rows of `pan eval`'s CSV (utf-8, with or without a byte-order mark); ValueError when it has
    no path and caption columns or no row."""
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        header = [name.strip() for name in reader.fieldnames or []]
        missing = [c for c in ("path", "caption") if c not in header]
        if missing:
            raise ValueError(f"it lacks the column(s) {missing}; its header is {header}")
        reader.fieldnames = header
        rows = [row for row in reader if any((v or "").strip() for v in row.values())]
    if not rows:
        raise ValueError("it has a header but no rows")
    return rows


CSV_TAKES = "a CSV with columns path (relative to the CSV or absolute) and caption"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pan eval", description=__doc__.split("\n\n")[0])
    parser.add_argument("--csv", required=True, type=input_file(CSV_TAKES, check=read_csv_rows),
                        help="CSV with columns path (relative to the CSV or absolute) and caption")
    parser.add_argument("--json", type=output_file("the JSON file to write"),
                        help="also write the scores, with per-video details, to this file")
    parser.add_argument("--max-rows", type=whole_number(0), help="print at most this many per-video lines")
    return parser


def main(argv: list[str] | None = None) -> int:
    """`python -m pan.demo.analyser --csv FILE [--json OUT] [--max-rows N]`: score the videos a CSV lists."""
    parser = build_parser()
    args = parser.parse_args(argv)
    rows = read_csv_rows(args.csv)
    videos = [args.csv.parent / row["path"].strip() for row in rows]  # an absolute path stays absolute
    missing = [f"row {i + 1}: {v}" for i, v in enumerate(videos) if not v.is_file()]
    if missing:
        parser.error(f"--csv {args.csv}: {len(missing)} of its {len(rows)} videos do not exist "
                     f"({'; '.join(missing[:3])}{' ...' if len(missing) > 3 else ''})")
    try:
        scores = score_videos(videos, [row["caption"] for row in rows])
    except (OSError, ValueError, av.error.FFmpegError) as e:  # a listed file that is no readable video
        parser.error(f"--csv {args.csv}: a video it lists cannot be scored: {e}")
    print(format_table(scores, max_rows=args.max_rows))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(scores, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

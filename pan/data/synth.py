"""Synthetic text-to-video data for the CPU demo: one coloured shape moving over a black background.

Every clip shows a single shape (square, circle, triangle) of one palette colour, moving at constant
speed in one direction (left, right, up, down), fully inside the frame in every frame. Captions read
"a red square moving left". A fixed set of (colour, direction) pairs never appears in training; those
combinations form the held-out prompts, so a model that scores well on them has composed colour and
motion rather than memorised captions. `pan.demo.analyser` scores generated videos against these prompts.

    synth_dataset("demo_data", num_train=480, num_heldout=60, size=32, num_frames=9, fps=8, seed=0)
    python -m pan.data.synth --out demo_data

Layout written under `out_dir`: `train/NNNNNN.mp4`, `heldout/NNNNNN.mp4`, `train.csv`, `heldout.csv`
(and the same rows as `train.jsonl`, `heldout.jsonl`: one {"video", "text"} object a line)
(columns path,caption,fps,num_frames,width,height; paths relative to the CSV) and
`heldout_prompts.json` (list of {prompt, colour, shape, direction}).
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from pan.config.arguments import COUNT, SEED, number, output_folder, whole_number
from pan.data.media import write_mp4

# Saturated colours that stay apart after brightness normalisation (see pan.demo.analyser), survive yuv420p
# chroma subsampling at 32x32, and are easy for a person to name. Blue is lifted off pure (0,0,255)
# because pure blue has so little luma that compression smears it into the black background.
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (230, 30, 30),
    "green": (30, 210, 30),
    "blue": (40, 80, 255),
    "yellow": (235, 225, 30),
    "white": (235, 235, 235),
}
SHAPES: tuple[str, ...] = ("square", "circle", "triangle")
# Unit motion per direction in image coordinates (x right, y down).
DIRECTIONS: dict[str, tuple[int, int]] = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
BACKGROUND: tuple[int, int, int] = (0, 0, 0)

CSV_COLUMNS = ("path", "caption", "fps", "num_frames", "width", "height")
SUPERSAMPLE = 4  # shapes are drawn at 4x and box-filtered down: anti-aliased edges, sub-pixel motion
SHAPE_SIZE_RANGE = (0.28, 0.36)  # side of the shape's bounding box, as a fraction of the frame
TRAVEL_RANGE = (0.45, 1.0)  # distance covered over the clip, as a fraction of the free room
PIX_FMTS = ("yuv420p", "yuv444p")  # the MP4s' colour sampling: 4:2:0 or full resolution


@dataclass(frozen=True)
class ClipSpec:
    """Everything that determines one clip's pixels (positions in pixels of the output frame)."""

    colour: str
    shape: str
    direction: str
    shape_size: float  # bounding-box side
    start_xy: tuple[float, float]  # top-left of the bounding box in frame 0
    displacement: float  # distance travelled from the first to the last frame

    @property
    def caption(self) -> str:
        return caption_for(self.colour, self.shape, self.direction)


def caption_for(colour: str, shape: str, direction: str) -> str:
    return f"a {colour} {shape} moving {direction}"


def parse_caption(caption: str) -> dict[str, str | None]:
    """The palette colour, shape and direction words found in a caption (None where absent)."""
    words = caption.lower().replace(",", " ").replace(".", " ").split()

    def first_of(vocabulary) -> str | None:
        return next((w for w in words if w in vocabulary), None)

    return {"colour": first_of(PALETTE), "shape": first_of(SHAPES), "direction": first_of(DIRECTIONS)}


def heldout_combinations() -> list[tuple[str, str, str]]:
    """(colour, shape, direction) triples never shown in training.

    Colour i is held out with direction i mod 4, for every shape: each colour still moves in three
    directions in training and each direction is still shown with at least three colours, so the
    held-out prompts test composition of seen words, not unseen words.
    """
    directions = list(DIRECTIONS)
    held_pairs = {(colour, directions[i % len(directions)]) for i, colour in enumerate(PALETTE)}
    return [(c, s, d) for c, s, d in itertools.product(PALETTE, SHAPES, DIRECTIONS) if (c, d) in held_pairs]


def train_combinations() -> list[tuple[str, str, str]]:
    held = set(heldout_combinations())
    return [combo for combo in itertools.product(PALETTE, SHAPES, DIRECTIONS) if combo not in held]


def sample_clip_specs(combos: list[tuple[str, str, str]], num_clips: int, size: int,
                      rng: np.random.Generator,
                      shape_size: tuple[float, float] = SHAPE_SIZE_RANGE) -> list[ClipSpec]:
    """`num_clips` specs cycling through `combos` (balanced), in a shuffled order; each shape's side
    drawn uniformly from `shape_size` (fractions of the frame)."""
    order = [combos[i % len(combos)] for i in range(num_clips)]
    rng.shuffle(order)
    specs = []
    for colour, shape, direction in order:
        side = float(rng.uniform(*shape_size)) * size
        room = size - side  # the top-left corner may lie anywhere in [0, room] on each axis
        travel = float(rng.uniform(*TRAVEL_RANGE)) * room
        ux, uy = DIRECTIONS[direction]
        # Along the motion axis start where the whole path stays in frame; across it, anywhere.
        start = [float(rng.uniform(0, room)), float(rng.uniform(0, room))]
        axis = 0 if ux else 1
        sign = ux or uy
        start[axis] = float(rng.uniform(0, room - travel)) + (travel if sign < 0 else 0.0)
        specs.append(ClipSpec(colour, shape, direction, side, (start[0], start[1]), travel))
    return specs


def _shape_alpha(shape: str, x: float, y: float, side: float, size: int) -> np.ndarray:
    """Coverage in [0, 1] of a shape with bounding box (x, y, side) on a size x size frame: [H, W]."""
    k = SUPERSAMPLE
    canvas = Image.new("L", (size * k, size * k), 0)
    draw = ImageDraw.Draw(canvas)
    x0, y0, x1, y1 = x * k, y * k, (x + side) * k, (y + side) * k
    if shape == "square":
        draw.rectangle((x0, y0, x1 - 1, y1 - 1), fill=255)
    elif shape == "circle":
        draw.ellipse((x0, y0, x1 - 1, y1 - 1), fill=255)
    elif shape == "triangle":  # apex up, base along the bottom of the box
        draw.polygon([((x0 + x1) / 2, y0), (x1 - 1, y1 - 1), (x0, y1 - 1)], fill=255)
    else:
        raise ValueError(f"unknown shape {shape!r}; choose one of {SHAPES}")
    small = canvas.resize((size, size), Image.Resampling.BOX)  # area average = anti-aliasing
    return np.asarray(small, dtype=np.float32) / 255.0


def render_clip(spec: ClipSpec, size: int, num_frames: int) -> np.ndarray:
    """The clip's frames: [T, H, W, 3] uint8."""
    ux, uy = DIRECTIONS[spec.direction]
    step = spec.displacement / max(num_frames - 1, 1)
    colour = np.array(PALETTE[spec.colour], dtype=np.float32)
    background = np.array(BACKGROUND, dtype=np.float32)
    frames = np.empty((num_frames, size, size, 3), dtype=np.uint8)
    for t in range(num_frames):
        x, y = spec.start_xy[0] + ux * step * t, spec.start_xy[1] + uy * step * t
        alpha = _shape_alpha(spec.shape, x, y, spec.shape_size, size)[..., None]  # [H, W, 1]
        frames[t] = np.rint(background + alpha * (colour - background)).astype(np.uint8)
    return frames


def _write_split(out_dir: Path, split: str, specs: list[ClipSpec], size: int, num_frames: int,
                 fps: int, pix_fmt: str) -> Path:
    clip_dir = out_dir / split
    clip_dir.mkdir(parents=True, exist_ok=True)
    csv_path = out_dir / f"{split}.csv"
    # The same clips as a JSONL annotation file (one {"video", "text"} a line), the other input form.
    with open(csv_path, "w", newline="") as f, open(csv_path.with_suffix(".jsonl"), "w") as jsonl:
        writer = csv.writer(f)
        writer.writerow(CSV_COLUMNS)
        for i, spec in enumerate(specs):
            relative = f"{split}/{i:06d}.mp4"
            write_mp4(out_dir / relative, render_clip(spec, size, num_frames), fps, pix_fmt=pix_fmt)
            writer.writerow([relative, spec.caption, fps, num_frames, size, size])
            jsonl.write(json.dumps({"video": relative, "text": spec.caption}) + "\n")
    return csv_path


def synth_dataset(out_dir: str | Path, *, num_train: int = 480, num_heldout: int = 60, size: int = 32,
                  num_frames: int = 9, fps: int = 8, seed: int = 0,
                  shape_size: tuple[float, float] = SHAPE_SIZE_RANGE,
                  pix_fmt: str = "yuv420p") -> dict[str, Path]:
    """Write the synthetic dataset under `out_dir` and return the paths of what was written.

    Returns {"train_csv", "heldout_csv", "heldout_prompts"}. Deterministic for a given `seed` (and
    arguments). `num_frames` = 1 + 4k suits a causal VAE with 4x temporal compression (9, 13, ...).
    `shape_size` = (smallest, largest) side of a shape's bounding box as a fraction of the frame.
    `pix_fmt` yuv444p keeps colour at full resolution: in yuv420p a 16-pixel frame's colour is 8 x 8
    samples, and a colour edge is smeared over two pixels (a model trained on it learns the smear).
    """
    if pix_fmt not in PIX_FMTS:
        raise ValueError(f"pix_fmt must be one of {PIX_FMTS}, got {pix_fmt!r}")
    if size < 16 or size % 2:
        raise ValueError(f"size must be an even number >= 16 (yuv420p needs even sides), got {size}")
    if num_frames < 2:
        raise ValueError(f"num_frames must be >= 2 to show motion, got {num_frames}")
    if not 0 < shape_size[0] <= shape_size[1] < 1:
        raise ValueError(f"shape_size must be fractions 0 < smallest <= largest < 1, got {shape_size}")
    if num_train < 1 or num_heldout < 0 or fps < 1:
        raise ValueError(f"need num_train >= 1, num_heldout >= 0, fps >= 1; got {num_train}, "
                         f"{num_heldout}, {fps}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    train_specs = sample_clip_specs(train_combinations(), num_train, size, rng, shape_size)
    heldout_specs = sample_clip_specs(heldout_combinations(), num_heldout, size, rng, shape_size)

    prompts_path = out / "heldout_prompts.json"
    prompts = [{"prompt": caption_for(c, s, d), "colour": c, "shape": s, "direction": d}
               for c, s, d in heldout_combinations()]
    prompts_path.write_text(json.dumps(prompts, indent=1) + "\n")
    return {
        "train_csv": _write_split(out, "train", train_specs, size, num_frames, fps, pix_fmt),
        "heldout_csv": _write_split(out, "heldout", heldout_specs, size, num_frames, fps, pix_fmt),
        "heldout_prompts": prompts_path,
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pan data synth", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", required=True, default=argparse.SUPPRESS,
                        type=output_folder("the folder to write the dataset into"),
                        help="folder to write the dataset into")
    parser.add_argument("--num-train", type=COUNT, default=480, help="training clips")
    parser.add_argument("--num-heldout", type=whole_number(0), default=60, help="clips of held-out prompts")
    parser.add_argument("--size", type=whole_number(16, even=True), default=32, help="frame height = width, even")
    parser.add_argument("--num-frames", type=whole_number(2), default=9,
                        help="frames per clip (1 + 4k for a causal VAE)")
    parser.add_argument("--fps", type=COUNT, default=8, help="frame rate written into the MP4 and CSV")
    parser.add_argument("--seed", type=SEED, default=0, help="seed: the same seed writes the same files")
    parser.add_argument("--shape-size", type=number(above=0, below=1), nargs=2, default=SHAPE_SIZE_RANGE,
                        metavar=("MIN", "MAX"), help="side of a shape's box, fraction of the frame")
    parser.add_argument("--pix-fmt", choices=PIX_FMTS, default="yuv420p",
                        help="yuv420p (plays in browsers) or yuv444p (colour at full resolution)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """`pan data synth --out DIR [--num-train N] [--num-heldout N] [--size S] [--num-frames T] ...`"""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.shape_size[0] > args.shape_size[1]:
        parser.error(f"--shape-size {args.shape_size[0]:g} {args.shape_size[1]:g}: give the smaller side first")
    try:
        paths = synth_dataset(args.out, num_train=args.num_train, num_heldout=args.num_heldout,
                              size=args.size, num_frames=args.num_frames, fps=args.fps, seed=args.seed,
                              shape_size=tuple(args.shape_size), pix_fmt=args.pix_fmt)
    except OSError as e:  # the folder cannot be written (permissions, a full disk)
        print(f"pan data synth: --out {args.out}: {e}", file=sys.stderr)
        return 2
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

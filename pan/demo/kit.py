"""What the recipes' demos share (each recipe's `demo` hook, pan/recipes/<name>/demo.py): the options
of a demo run with --recipe, the synthetic clips and their look, a job's command line, a fresh run
folder, the training and the weights a demo samples with. No recipe is named here: each demo names
its own."""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import time
from pathlib import Path

import pan
from pan.config.arguments import COUNT, SEED, output_folder
from pan.config.job import DEFAULT_RECIPE
from pan.data.synth import heldout_combinations, synth_dataset

CONFIG_DIR = Path(pan.__file__).resolve().parent.parent / "config"
# Shapes span 44-52% of the frame (synth's default: 28-36%): at 16 pixels a 5-pixel square, circle
# and triangle differ in a handful of pixels and the model draws all three as one blob.
SHAPE_SIZE = (0.44, 0.52)
# Colour at full resolution: with 4:2:0 a colour edge spans two of the 16 pixels, and the model
# learnt to draw that smear, which rounded its squares' corners (docs/demo.md).
PIX_FMT = "yuv444p"
# --quick: every output of the pipeline from a couple of steps, not a model that learns.
QUICK = {"num_train": 8, "num_heldout": 2, "steps": 2}


def build_parser(recipe: str, description: str) -> argparse.ArgumentParser:
    """The options of `pan demo --recipe RECIPE`: --out, --steps, --seed, --quick."""
    parser = argparse.ArgumentParser(prog=f"pan demo --recipe {recipe}", description=description)
    parser.add_argument("--out", type=output_folder("the folder to write the demo into"),
                        help=f"folder for data, run, samples and report (default: demo_{recipe})")
    parser.add_argument("--steps", type=COUNT, help="training steps (default: the demo's own)")
    parser.add_argument("--seed", type=SEED, default=0, help="the training seed (docs/demo_recipes.md scores several)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny data and schedule: checks the pipeline in about a minute")
    parser.add_argument("--config", help=argparse.SUPPRESS)  # the default demo's option: refused below
    return parser


def parse_args(argv: list[str] | None, recipe: str, description: str) -> argparse.Namespace:
    """The options of `pan demo --recipe RECIPE`, parsed: --out (as a Path, default demo_<recipe>),
    --steps, --seed, --quick."""
    parser = build_parser(recipe, description)
    args = parser.parse_args(argv)
    if args.config is not None:
        parser.error(f"--config configures the default demo (--recipe {DEFAULT_RECIPE}); the recipe demos "
                     "build their own config")
    args.out = Path(args.out or f"demo_{recipe}")
    return args


def make_data(data_dir: Path, quick: bool, size: int, num_frames: int, **clips) -> dict[str, Path]:
    """The synthetic clips, written afresh: 480 training clips and one held-out clip per held-out
    (colour, shape, direction) combination (15), or a handful with --quick; `clips`: synth_dataset's
    other arguments (shape_size, pix_fmt)."""

    if data_dir.exists():
        shutil.rmtree(data_dir)
    counts = ({"num_train": QUICK["num_train"], "num_heldout": QUICK["num_heldout"]} if quick
              else {"num_heldout": len(heldout_combinations())})
    return synth_dataset(data_dir, size=size, num_frames=num_frames, **counts, **clips)


def job_argv(config: Path | str, overrides: dict) -> list[str]:
    """The job's command line: `--config CONFIG` and each override as `--key <JSON value>`."""
    argv = ["--config", str(config)]
    for key, value in overrides.items():
        argv += [f"--{key}", json.dumps(value)]
    return argv


def fresh_run_dir(run_dir: Path) -> None:
    """Each demo trains afresh: a finished run in `run_dir` would otherwise be resumed."""
    if run_dir.exists():
        print(f"removing the previous demo run {run_dir}")
        shutil.rmtree(run_dir)


def fit(trainer) -> float:
    """Train to max_steps; the seconds it took."""
    t0 = time.perf_counter()
    try:
        trainer.fit()
    finally:
        trainer.close()
    return time.perf_counter() - t0


def trained_weights(trainer):
    """The weights a run exports and samples with: its EMA when it keeps one."""
    return trainer.ema.swapped_in() if trainer.ema is not None else contextlib.nullcontext()

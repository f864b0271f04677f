"""`make demo` / `pan demo`: synthesise data, train a tiny text-to-video model on CPU, sample the
held-out prompts, score them and write a report.

    python -m pan.cli demo [--out demo_out] [--steps N] [--quick]

Everything lands under `--out`: data/ (the synthetic dataset; latents/ its encoded clips), run/
(checkpoints, metrics.jsonl), samples/ (an MP4 + GIF per held-out prompt and draw, contact_sheet.gif,
scores.json), loss.png, report.md. The Pan recipe's `demo` hook (pan/recipe.py); docs/demo.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import time
from pathlib import Path

import yaml

from pan.config import load_config_or_exit
from pan.config.arguments import COUNT, SEED, input_file, output_folder, yaml_mapping
from pan.data.precompute import PrecomputeError, precompute
from pan.data.synth import synth_dataset
from pan.demo.analyser import format_table, score_videos
from pan.demo.kit import CONFIG_DIR, PIX_FMT, SHAPE_SIZE, fresh_run_dir, job_argv as kit_job_argv, trained_weights
from pan.demo.report import accuracy_line, announced, write_contact_sheet
from pan.logging import quiet_library_progress_bars
from pan.parallel.threads import set_cpu_threads
from pan.runtime.plot import plot_run
from pan.trainer import build_trainer

DEFAULT_CONFIG = CONFIG_DIR / "demo_cpu.yaml"

# --quick: a shape check of the whole pipeline (tests), not a model that learns.
QUICK_OVERRIDES = {
    "transformer_config_overrides.hidden_size": 32,
    "transformer_config_overrides.num_attention_heads": 2,
    "transformer_config_overrides.num_layers": 1,
    "transformer_config_overrides.rope_axes_dim": [4, 6, 6],
    "max_tokens_per_batch": 1152,
    "sample_steps": 2,
}
QUICK_PROMPTS = 2
# Each held-out prompt is sampled twice (other noise): 15 videos scored one wrong shape as 7 points,
# so a model drawing 97% of shapes right read below 90% about one run in fourteen (docs/demo.md).
SAMPLES_PER_PROMPT = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pan demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=output_folder("the folder to write the demo into"),
                        help="folder for data, run, samples and report (default: demo_out)")
    parser.add_argument("--steps", type=COUNT, help="training steps (default: the config's max_steps)")
    parser.add_argument("--config", type=input_file("the demo's run config YAML", check=demo_config),
                        default=DEFAULT_CONFIG, help="the demo's run config")
    parser.add_argument("--seed", type=SEED, help="the training seed (default: the config's; docs/demo.md "
                                                  "and docs/demo_recipes.md score several)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny data, model and schedule: checks the pipeline in about a minute")
    return parser


def demo_config(path: Path) -> None:
    """`--config`: a YAML whose `output` section gives the sample geometry the demo's data is made at."""
    yaml_mapping(path)
    output = yaml.safe_load(path.read_text(encoding="utf-8-sig")).get("output") or {}
    missing = [k for k in ("sample_height", "sample_num_frames") if k not in output]
    if missing:
        raise ValueError(f"its output section lacks {missing} (the demo's clips are made at that size)")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    args.config = str(args.config)
    return args


def make_data(data_dir: Path, config: Path, quick: bool) -> dict[str, Path]:
    """The synthetic dataset at the config's sample geometry (frame side `sample_height`, frame count
    `sample_num_frames`) with the demo's SHAPE_SIZE, written once: reused while `synth.json` records
    these arguments, rewritten otherwise. (Read from the YAML: the job config can only load once its
    training CSV exists.)"""

    output = yaml.safe_load(config.read_text())["output"]
    arguments = {"size": output["sample_height"], "num_frames": output["sample_num_frames"],
                 "shape_size": list(SHAPE_SIZE), "pix_fmt": PIX_FMT}
    if quick:
        arguments |= {"num_train": 16, "num_heldout": 0}
    paths = {"train_csv": data_dir / "train.csv", "heldout_csv": data_dir / "heldout.csv",
             "heldout_prompts": data_dir / "heldout_prompts.json"}
    record = data_dir / "synth.json"
    if record.is_file() and all(p.is_file() for p in paths.values()):
        if json.loads(record.read_text()) == arguments:
            return paths
        print(f"rewriting {data_dir}: it was made with other arguments than {arguments}")
    if data_dir.exists():
        shutil.rmtree(data_dir)
    paths = synth_dataset(data_dir, **arguments)
    record.write_text(json.dumps(arguments) + "\n")
    return paths


def job_argv(args: argparse.Namespace, train_csv: Path, run_dir: Path) -> list[str]:
    overrides = {"video_csv_paths": [str(train_csv)], "output_dir": str(run_dir)}
    if args.quick:
        overrides |= QUICK_OVERRIDES | {"max_steps": args.steps or 2}
    elif args.steps:
        overrides["max_steps"] = args.steps
    if args.seed is not None:
        overrides["seed"] = args.seed
    if "max_steps" in overrides:
        steps = overrides["max_steps"]
        warmup = yaml.safe_load(Path(args.config).read_text()).get("training", {}).get("warmup_steps", 0)
        overrides["warmup_steps"] = min(warmup, steps // 4)  # a short run keeps a quarter for warmup at most
        overrides["log_interval"] = max(1, steps // 40)  # about 40 points on the loss curve
    return kit_job_argv(args.config, overrides)


def precompute_clips(job, latents_dir: Path) -> Path:
    """Encode every training clip once (pixels + caption features, `pan data precompute`) and return
    the precomputed CSV: a step then loads 48 small tensors instead of decoding 48 MP4s and running the
    text encoder, which left the model waiting for data half of each step. Reused while the data and
    encoder keys are unchanged; redone when they changed."""

    try:
        report = precompute(job, latents_dir)
    except PrecomputeError as err:  # made with other settings: start over
        print(f"redoing {latents_dir}: {err}")
        shutil.rmtree(latents_dir)
        report = precompute(job, latents_dir)
    if report.failures:
        raise SystemExit(f"pan demo: {len(report.failures)} clips failed to encode; see "
                         f"{latents_dir / 'failures.csv'}")
    return report.csvs[0]


def sample_prompts(trainer, prompts: list[dict], out_dir: Path) -> list[Path]:
    """One MP4 + GIF per prompt with the trained weights (the EMA weights when the run keeps them)."""
    task = trainer.task
    task.job.validation = dataclasses.replace(task.job.validation,
                                              validation_prompts=[p["prompt"] for p in prompts])
    trainer.model.eval()
    with trained_weights(trainer):
        return task.write_samples(trainer.model, trainer.state.step, out_dir)


def write_report(path: Path, *, steps: int, seconds: dict[str, float], final_loss: float, scores: dict,
                 table: str, files: list[Path]) -> None:
    lines = [
        "# pan demo report", "",
        f"- training steps: {steps}",
        *(f"- {name} time: {s:.0f} s" for name, s in seconds.items()),
        f"- final training loss (last log interval): {final_loss:.4f}",
        f"- held-out prompts: {accuracy_line(scores)}", "",
        "## Scores", "", "```", table, "```", "",
        "## Files", "", *(f"- `{f.relative_to(path.parent)}`" for f in files), "",
    ]
    path.write_text("\n".join(lines))


def run(args: argparse.Namespace) -> int:
    quiet_library_progress_bars()  # (the encoders load for the precompute, before the trainer)
    out = Path(args.out or "demo_out")
    seconds: dict[str, float] = {}
    run_dir = out / "run"
    t0 = time.perf_counter()
    with announced("writing the synthetic clips"):
        data = make_data(out / "data", Path(args.config), args.quick)
    source_job = load_config_or_exit(job_argv(args, data["train_csv"], run_dir))
    with announced("encoding the training clips once (pixels and caption features)"):
        train_csv = precompute_clips(source_job, out / "data" / "latents")
    seconds["data"] = time.perf_counter() - t0

    fresh_run_dir(run_dir)
    job = load_config_or_exit(job_argv(args, train_csv, run_dir))
    t0 = time.perf_counter()
    trainer = build_trainer(job)
    try:
        trainer.fit()
    finally:
        trainer.close()
    seconds["training"] = time.perf_counter() - t0

    prompts = json.loads(data["heldout_prompts"].read_text())
    if args.quick:
        prompts = prompts[:QUICK_PROMPTS]
    prompts = prompts * SAMPLES_PER_PROMPT  # the i-th video's noise is seeded by i: each draw differs
    samples_dir = out / "samples"
    t0 = time.perf_counter()
    videos = sample_prompts(trainer, prompts, samples_dir)
    seconds["sampling"] = time.perf_counter() - t0
    write_contact_sheet(videos, samples_dir / "contact_sheet.gif")

    scores = score_videos(videos, prompts)  # read back from the MP4s, as a user would see them
    table = format_table(scores)
    print(table)
    (samples_dir / "scores.json").write_text(json.dumps(scores, indent=1) + "\n")

    metrics_path = out / "run" / "metrics.jsonl"
    plot_run(metrics_path, out / "loss.png")  # the panels of `pan plot`
    final_loss = json.loads(metrics_path.read_text().splitlines()[-1])["loss"]
    files = [out / "loss.png", samples_dir / "contact_sheet.gif", samples_dir / "scores.json",
             *sorted(samples_dir.glob("*.mp4")), *sorted(samples_dir.glob("*.gif"))]
    files = list(dict.fromkeys(files))
    write_report(out / "report.md", steps=trainer.state.step, seconds=seconds, final_loss=final_loss,
                 scores=scores, table=table, files=files)
    print(f"\nreport: {out / 'report.md'}  loss curve: {out / 'loss.png'}  "
          f"samples: {samples_dir / 'contact_sheet.gif'}")
    return 0


def demo(argv: list[str] | None = None) -> int:
    """The Pan recipe's `demo` hook: `pan demo [options]` (`make demo`)."""
    args = parse_args(argv)
    set_cpu_threads()  # before the data phase too (the trainer logs the choice)
    return run(args)


if __name__ == "__main__":
    raise SystemExit(demo())

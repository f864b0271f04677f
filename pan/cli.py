"""The `pan` command: train, check, launch-command, data, sample, export, inspect, plot, demo."""

from __future__ import annotations

import argparse
import sys

from pan.config import EXIT_CONFIG_ERROR, ConfigError, load_config_or_exit  # noqa: F401 - the commands' exit code
from pan.recipe import RegistryError
from pan.runtime.watchdog import record_sigterm, stop_recording_sigterm, watch_launcher


def cmd_train(argv: list[str]) -> int:
    """Train: `pan train --config X.yaml [--key value ...]` (the same as `train.py`)."""
    if argv and argv[0] in ("-h", "--help"):
        print("usage: pan train --config config/X.yaml [--key value ...]\n\n"
              "Train with the run config X.yaml; any key can be overridden on the command line\n"
              "(--learning_rate 1e-5, --transformer_config_overrides.num_layers 4). Every key is\n"
              "listed in docs/config.md. Launch several processes with torchrun.")
        return 0
    watch_launcher()  # before the config and torch load (train.py has started it already)
    # A SIGTERM (preemption, scancel) from here on is recorded, not fatal: train() stops every rank
    # with 143 at the end of the start-up phase it came in (also while the config and torch load).
    recording = record_sigterm()
    try:
        job = load_config_or_exit(argv)
        from pan.preflight.core import refuse_at_start  # lazy, as the trainer
        from pan.trainer import train  # lazy: `pan --help` and the other commands never load the trainer
        # What `pan check` fails for this launch's world is refused before anything is built (exit 2).
        return train(job, preflight=refuse_at_start)
    finally:
        if recording:
            stop_recording_sigterm()


def cmd_data(argv: list[str]) -> int:
    """`pan data synth ...` (the demo dataset), `pan data precompute ...` (latents + text features) and
    `pan data index ...` (the row indexes of manifests, ahead of a large run)."""
    tools = {"synth": "pan.data.synth", "precompute": "pan.data.precompute", "index": "pan.data.index"}
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in tools:
        print("usage: pan data {synth,precompute,index} [options]\n\n"
              "  synth       write the demo's synthetic captioned videos (MP4 + CSV + held-out prompts)\n"
              "  precompute  encode a run's video CSVs into latents + text features: --config X.yaml\n"
              "              [--key value ...] --out DIR [--limit N] [--device D]\n"
              "  index       build the row index of each manifest ahead of a large run: MANIFEST...\n"
              "              [--out FOLDER] (under torchrun the processes split the manifests)")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    import importlib
    return importlib.import_module(tools[argv[0]]).main(argv[1:])


def _delegate(module: str, function: str = "main"):
    """A subcommand whose argparse lives beside its code (imported only when run)."""
    def run(argv: list[str]) -> int:
        import importlib
        return getattr(importlib.import_module(module), function)(argv)
    return run


COMMANDS = {
    "train": (cmd_train, "train a model from a YAML config (same as train.py)"),
    "check": (_delegate("pan.preflight.command", "main_check"),
              "preflight: validate a config and the environment without training"),
    "launch-command": (_delegate("pan.launch_command", "main_launch_command"),
                       "print a validated torchrun/srun command for a workflow"),
    "data": (cmd_data, "data tools: synth (the demo dataset), precompute (latents + text features), "
                       "index (row indexes)"),
    "eval": (_delegate("pan.demo.analyser"), "score generated videos against their prompts (the demo's analyser)"),
    "sample": (_delegate("pan.sampling"), "generate videos from a checkpoint"),
    "export": (_delegate("pan.export", "main_export"),
               "write consolidated safetensors weights from a checkpoint"),
    "inspect": (_delegate("pan.checkpoint.consolidate", "main_inspect"),
                "list a run's checkpoints with step, completeness and size"),
    "plot": (_delegate("pan.runtime.plot"), "draw a run's loss, grad norm, LR and step time (metrics.jsonl) to a PNG"),
    "demo": (_delegate("pan.demo"), "the tiny end-to-end CPU demo (make demo)"),
}


# After `make demo`: the README's "Train on your own videos", on CPU (tests/test_newcomer_path.py
# checks that each line is a command of that section).
FIRST_RUN = """\
train on your own videos (README, "Train on your own videos"; a CSV with path,caption columns):
  pan check --config config/tiny_cpu.yaml --video_csv_paths my_videos/train.csv --output_dir runs/mine
  pan data precompute --config config/tiny_cpu.yaml --video_csv_paths my_videos/train.csv --out my_videos/latents
  python train.py --config config/tiny_cpu.yaml --video_csv_paths my_videos/latents/train.csv --output_dir runs/mine
  pan sample --checkpoint runs/mine --prompt "a red square moving left" --num-frames 5 --height 32 --width 32 --out mine.mp4

a refusal, an error or a run that stops: docs/troubleshooting.md (by symptom: the message, why, the fix)"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog=__package__, description="pan: train video diffusion transformers. New here? `make demo`, then "
                                "the commands below.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="commands:\n" + "\n".join(f"  {n:<15} {h}" for n, (_, h) in COMMANDS.items())
        + "\n\n" + FIRST_RUN)
    parser.add_argument("command", choices=list(COMMANDS), metavar="command")
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    args, rest = parser.parse_known_args(argv[:1])
    fn, _ = COMMANDS[args.command]
    try:
        return fn(argv[1:]) or 0
    except RegistryError as e:  # two installed recipes claim one name: an installation to fix, not a bug
        print(f"pan: {e}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except ConfigError as e:  # a refusal a command did not word itself: still a refusal (exit 2)
        print(f"pan {args.command}: refused: {e}", file=sys.stderr)
        return EXIT_CONFIG_ERROR


def run() -> None:
    """The `pan` console script: `main`, then an exit that stays safe after a process group ran."""
    code = main()
    world = sys.modules.get("pan.parallel.world")  # loaded only by commands that can start one
    if world is not None:
        world.exit_process(code)
    sys.exit(code)


if __name__ == "__main__":
    run()

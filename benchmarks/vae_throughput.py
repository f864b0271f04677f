"""Causal video VAE throughput: pan's encode and decode against the original implementation's.

For clips of 1 + 8k frames (k = 1..8 by default) of one size, both implementations encode the clip
(to the posterior) and decode its mean, in one process, with the same weights (pan's model saved in
the released folder layout and loaded by the original's `from_pretrained`), round-robin (interleaved
rounds, median), in eval mode without gradients. Reported per frame count: frames per second of
each (wall time; this process's CPU time too, robust to other jobs on a shared machine), pan's
speed as a ratio to the original's, the peak tensor memory of each call (measured by
torch.distributed._tools.MemTracker: parameters + activations + temporaries, on CPU too), and pan's
CPU seconds per frame against the shortest clip's (a cost linear in frames stays near 1).

The config is the released architecture (4 blocks of channels 1:2:4:4, 2 / 3 residual blocks, 8x
space and time compression, 16 latent channels) at `--width` channels in its first block; the
original and pan agree to fp32 rounding on it (checked here, `max_abs_diff`).

The original needs `einops`, `timm` and `accelerate` (kept out of pan's environment:
`pip install --target DIR einops timm accelerate --no-deps`, then `--original-deps DIR`) and its
source extract (`--original`, default: the shared reference beside the repository). Without them the
script measures pan alone and says so.

    OMP_NUM_THREADS=2 python benchmarks/vae_throughput.py --original-deps DIR [--size 64] [--k 1 2 4 8]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

try:
    from benchmarks.common import import_original, interleaved_times, machine_info, median, print_table, write_json
except ModuleNotFoundError:  # run as `python benchmarks/vae_throughput.py`: its folder is on the path
    from common import import_original, interleaved_times, machine_info, median, print_table, write_json
from pan.models.causal_vae import CausalVideoVAE
from pan.recipes.causal_vae.config import CausalVAEModelConfig

ROOT = Path(__file__).resolve().parents[1]
ORIGINAL = ROOT.parent / "shared" / "reference" / "pyramid_flow" / "original"
COLUMNS = ["frames", "what", "pan_fps", "original_fps", "speedup", "speedup_cpu", "pan_peak_mib",
           "original_peak_mib", "pan_cost_per_frame", "max_abs_diff"]


def load_original(src: Path, deps: str | None):
    """The original's CausalVideoVAE class, or (None, why not)."""
    def load():
        from video_vae.modeling_causal_vae import CausalVideoVAE as Original
        return Original
    return import_original(src, deps, load)


def build_models(width: int, seed: int, original_cls):
    """pan's VAE (random weights) and the original loaded from the same released-layout folder."""
    cfg = CausalVAEModelConfig(block_out_channels=[width, 2 * width, 4 * width, 4 * width],
                               norm_num_groups=min(32, width)).vae_config()
    torch.manual_seed(seed)
    pan = CausalVideoVAE(cfg).eval()
    original = None
    if original_cls is not None:
        with tempfile.TemporaryDirectory() as folder:
            pan.save_pretrained(folder)
            original = original_cls.from_pretrained(folder, torch_dtype=torch.float32, interpolate=False).eval()
    return pan, original


def peak_mib(fn) -> float:
    """Peak tensor memory (MiB) while `fn` runs: parameters, activations and temporaries."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    with tracker:
        fn()
    peak = tracker.get_tracker_snapshot("peak")
    return max(v["Total"] for v in peak.values()) / 2 ** 20


def measure(frames: int, size: int, pan, original, repeats: int, warmup: int) -> list[dict]:
    x = torch.rand(1, 3, frames, size, size, generator=torch.Generator().manual_seed(frames)) * 2 - 1
    with torch.no_grad():
        z = pan.encode(x).mean
    calls = {"encode": {"pan": lambda: pan.encode(x).moments},
             "decode": {"pan": lambda: pan.decode(z)}}
    if original is not None:
        calls["encode"]["original"] = lambda: original.encode(x, is_init_image=True,
                                                              temporal_chunk=False).latent_dist.parameters
        calls["decode"]["original"] = lambda: original.decode(z, is_init_image=True, temporal_chunk=False).sample
    rows = []
    for what, candidates in calls.items():
        with torch.no_grad():
            times = interleaved_times(candidates, repeats, warmup)
            peaks = {name: peak_mib(fn) for name, fn in candidates.items()}
            diff = (float((candidates["pan"]() - candidates["original"]()).abs().max())
                    if original is not None else None)
        row = {"frames": frames, "what": what, "pan_fps": frames / median(times["pan"]["wall"]),
               "pan_peak_mib": peaks["pan"], "pan_seconds": median(times["pan"]["wall"]),
               "pan_cpu_seconds": median(times["pan"]["cpu"])}
        if original is not None:
            row.update(original_fps=frames / median(times["original"]["wall"]),
                       original_peak_mib=peaks["original"], max_abs_diff=diff,
                       speedup=median(times["original"]["wall"]) / median(times["pan"]["wall"]),
                       speedup_cpu=median(times["original"]["cpu"]) / median(times["pan"]["cpu"]),
                       original_seconds=median(times["original"]["wall"]))
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--original", type=Path, default=ORIGINAL,
                        help="folder with the original's import_stubs.py and src/ (default: the shared "
                             "reference beside the repository)")
    parser.add_argument("--original-deps", default=None,
                        help="folder with einops, timm and accelerate for the original (pip --target)")
    parser.add_argument("--k", type=int, nargs="+", default=list(range(1, 9)),
                        help="clip lengths 1 + 8k frames (default k = 1..8)")
    parser.add_argument("--size", type=int, default=64, help="frame height and width in pixels")
    parser.add_argument("--width", type=int, default=16, help="channels of the first block (released: 128)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/vae_throughput.json", help="JSON output path")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    original_cls, note = load_original(args.original, args.original_deps)
    pan, original = build_models(args.width, args.seed, original_cls)
    rows = [row for k in args.k for row in measure(1 + 8 * k, args.size, pan, original, args.repeats, args.warmup)]
    summary = {}
    for what in ("encode", "decode"):
        mine = [r for r in rows if r["what"] == what]
        for r in mine:   # CPU seconds per frame against the shortest clip's (robust to other jobs)
            r["pan_cost_per_frame"] = (r["pan_cpu_seconds"] / r["frames"]) / (mine[0]["pan_cpu_seconds"] / mine[0]["frames"])
        if original is not None:
            summary[what] = {key: median([r[key] for r in mine]) for key in ("speedup", "speedup_cpu")}
    print(f"causal video VAE, first block {args.width} channels, {args.size} x {args.size} px, fp32, "
          f"{args.threads} threads; speedup = original time / pan time (wall; _cpu: this process's CPU)")
    print_table(rows, COLUMNS)
    for what, s in summary.items():
        print(f"{what}: median speedup {s['speedup']:.3g} (wall), {s['speedup_cpu']:.3g} (CPU) over the frame counts")
    if note:
        print(f"\nNOTE: pan alone, no comparison: {note}")
    path = write_json(args.out, {"benchmark": "vae_throughput", "size": args.size, "width": args.width,
                                 "repeats": args.repeats, "warmup": args.warmup, "machine": machine_info(),
                                 "original": note or "compared", "summary": summary, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

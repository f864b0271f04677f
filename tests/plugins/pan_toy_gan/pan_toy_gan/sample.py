"""`pan sample` for the toy GAN: draw samples from a checkpoint's generator into a CSV."""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import torch

from pan.sampling import resolve_weights
from pan_toy_gan.task import NOISE, MLP


def sample_main(job, argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pan sample", description="Draw samples from a toy GAN run.")
    parser.add_argument("--checkpoint", required=True, type=Path,
                        help="checkpoint-N/, the run's output_dir, or the generator exported as .safetensors")
    parser.add_argument("--config", help="run config (default: the run's config.yaml)")
    parser.add_argument("--num-samples", type=int, default=4, help="samples to draw (default 4)")
    parser.add_argument("--seed", type=int, default=0, help="noise seed (default 0)")
    parser.add_argument("--ema", action="store_true", help="use the generator's EMA weights")
    parser.add_argument("--out", required=True, type=Path, help="the CSV to write, one sample a row")
    args = parser.parse_args(argv)
    weights, _ = resolve_weights(args.checkpoint, args.ema, part="generator")
    model = MLP(NOISE, job.toy.toy_width, weights["fc2.weight"].shape[0])
    model.load_state_dict(weights)
    noise = torch.randn(args.num_samples, NOISE, generator=torch.Generator().manual_seed(args.seed))
    with torch.no_grad():
        samples = model(noise)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as f:
        csv.writer(f).writerows(row.tolist() for row in samples)
    print(f"{args.out}: {args.num_samples} samples from {args.checkpoint}")
    return 0

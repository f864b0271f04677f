"""`pan sample` for the toy GAN: draw samples from a checkpoint's generator into a CSV."""

from __future__ import annotations

import argparse
import csv

import torch

from pan.config.arguments import COUNT, SEED, output_file
from pan.sampling import JUDGED_PATH, RUN_CONFIG, resolve_weights
from pan_toy_gan.task import NOISE, MLP


def sample_main(job, argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pan sample", description="Draw samples from a toy GAN run.")
    parser.add_argument("--checkpoint", required=True, type=JUDGED_PATH,
                        help="checkpoint-N/, the run's output_dir, or the generator exported as .safetensors")
    parser.add_argument("--config", type=RUN_CONFIG, help="run config (default: the run's config.yaml)")
    parser.add_argument("--num-samples", type=COUNT, default=4, help="samples to draw (default 4)")
    parser.add_argument("--seed", type=SEED, default=0, help="noise seed (default 0)")
    parser.add_argument("--ema", action="store_true", help="use the generator's EMA weights")
    parser.add_argument("--out", required=True, type=output_file("the CSV to write"),
                        help="the CSV to write, one sample a row")
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

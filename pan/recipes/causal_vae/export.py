"""A causal_vae checkpoint-N/ as a released `causal_video_vae` folder (config.json +
diffusion_pytorch_model.safetensors), and its command line:

    python -m pan.recipes.causal_vae export <checkpoint-N> --out <folder> [--ema]
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pan.checkpoint.consolidate import consolidated_weights
from pan.models.causal_vae import CausalVideoVAE, check_state_dict
from pan.models.causal_vae_config import CausalVAEConfig
from pan.recipes.causal_vae.config import VAE, VAE_CONFIG_FILE


def released_folder_of(checkpoint: str | Path, out: str | Path, *, ema: bool = False) -> Path:
    """A causal_vae checkpoint-N/ as a released causal_video_vae folder (config.json + safetensors).

    Writes its `vae` part (or EMA), without logvar, as config.json + diffusion_pytorch_model.safetensors
    in `out`, and returns that folder."""
    checkpoint = Path(checkpoint)
    config = read_run_vae_config(checkpoint)
    weights = consolidated_weights(checkpoint / (f"{VAE}_ema" if ema else VAE))
    weights.pop("logvar", None)
    with torch.device("meta"):
        model = CausalVideoVAE(config)
    check_state_dict(model, weights, str(checkpoint))
    model.load_state_dict(weights, assign=True)
    model.save_pretrained(out)
    return Path(out)


def read_run_vae_config(checkpoint: Path) -> CausalVAEConfig:
    """The VAE architecture of the run that wrote `checkpoint` (its output_dir/vae_config.json)."""
    path = checkpoint.parent / VAE_CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: {checkpoint} was not written by the causal_vae recipe "
                                "(which records its VAE architecture there).")
    config, _ = CausalVAEConfig.from_json_dict(json.loads(path.read_text()), str(path))
    return config


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m pan.recipes.causal_vae",
        description="Write a causal_vae checkpoint-N/ as a released causal_video_vae folder (config.json "
                    "+ diffusion_pytorch_model.safetensors), e.g. for the original's tools. pan's own "
                    "recipes read the checkpoint directly (vae_type: causal_video_vae).")
    parser.add_argument("command", choices=["export"])
    parser.add_argument("checkpoint", type=Path, help="a checkpoint-N/ folder of a causal_vae run")
    parser.add_argument("--out", type=Path, required=True, help="the folder to write")
    parser.add_argument("--ema", action="store_true", help="the EMA weights (the run kept an EMA)")
    args = parser.parse_args(argv)
    print(f"wrote {released_folder_of(args.checkpoint, args.out, ema=args.ema)}")
    return 0

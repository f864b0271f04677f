"""`pan export --format toy_npz`: the toy GAN's generator as a NumPy archive."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pan.checkpoint.consolidate import consolidated_weights, part_source


def export_npz(ckpt_dir: Path, out: Path, *, ema: bool = False) -> Path:
    """The generator's weights as a NumPy .npz archive (one array per tensor)."""
    _, source = part_source(ckpt_dir, "generator", ema)
    weights = consolidated_weights(source)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("wb") as f:  # a file object: np.savez would add .npz to a name without it
        np.savez(f, **{name: tensor.numpy() for name, tensor in weights.items()})
    return out

"""Latents and their resolution pyramids for pyramid flow matching (`pan.diffusion.pyramid_schedule`
has the math): the released models' latent normalisation, per-frame halving and nearest up-sampling,
the latent and noise pyramids (lowest resolution first), and the stage of each batch column.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from pan.diffusion.pyramid_schedule import PyramidConfig


def normalize_latent(latent: Tensor, cfg: PyramidConfig) -> Tensor:
    """[B, C, T, H, W] VAE latent -> normalised: frame 0 with image statistics, frames 1.. with video's."""
    first = (latent[:, :, :1] - cfg.image_latent_shift) * cfg.image_latent_scale
    rest = (latent[:, :, 1:] - cfg.video_latent_shift) * cfg.video_latent_scale
    return torch.cat([first, rest], dim=2)


def denormalize_latent(latent: Tensor, cfg: PyramidConfig) -> Tensor:
    """Inverse of `normalize_latent`, for decoding a sample with the VAE."""
    first = latent[:, :, :1] / cfg.image_latent_scale + cfg.image_latent_shift
    rest = latent[:, :, 1:] / cfg.video_latent_scale + cfg.video_latent_shift
    return torch.cat([first, rest], dim=2)


def _per_frame(fn, x: Tensor) -> Tensor:
    """Apply a 2-D image op `fn` ([N, C, H, W] -> [N, C, H', W']) to every frame of [B, C, T, H, W]."""
    b, c, t, h, w = x.shape
    frames = x.transpose(1, 2).reshape(b * t, c, h, w)
    out = fn(frames)
    return out.reshape(b, t, c, *out.shape[-2:]).transpose(1, 2)


def halve(x: Tensor) -> Tensor:
    """[B, C, T, H, W] -> [B, C, T, H//2, W//2]: per-frame bilinear (align_corners=False)."""
    h, w = x.shape[-2:]
    return _per_frame(lambda f: F.interpolate(f, size=(h // 2, w // 2), mode="bilinear"), x)


def upsample_nearest(x: Tensor) -> Tensor:
    """[B, C, T, H, W] -> [B, C, T, 2H, 2W]: per-frame nearest (each value fills a 2x2 block)."""
    h, w = x.shape[-2:]
    return _per_frame(lambda f: F.interpolate(f, size=(2 * h, 2 * w), mode="nearest"), x)


def _check_divisible(x: Tensor, stages: int) -> None:
    factor = 2 ** (stages - 1)
    if x.shape[-2] % factor or x.shape[-1] % factor:
        raise ValueError(f"latent H, W {tuple(x.shape[-2:])} must be divisible by 2^(stages-1) = {factor}")


def latent_pyramid(latent: Tensor, stages: int) -> list[Tensor]:
    """[B, C, T, H, W] -> `stages` latents, lowest resolution first (each level halves H and W)."""
    _check_divisible(latent, stages)
    levels = [latent]
    for _ in range(stages - 1):
        levels.append(halve(levels[-1]))
    return levels[::-1]


def latent_pyramids(latents: list[Tensor], cfg: PyramidConfig) -> list[list[Tensor]]:
    """`latent_pyramid` of each [1, C, T, H, W] VAE latent after `normalize_latent`, on the CPU; the
    latents of one shape computed as one batch: the same values as one by one (elementwise ops and
    per-frame resizes), in a few ops instead of ~30 per sample."""
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for i, latent in enumerate(latents):
        by_shape.setdefault(tuple(latent.shape), []).append(i)
    pyramids: list[list[Tensor]] = [[] for _ in latents]
    for members in by_shape.values():
        stacked = normalize_latent(torch.cat([latents[i] for i in members]), cfg).cpu()
        levels = latent_pyramid(stacked, cfg.stages)
        for j, i in enumerate(members):
            pyramids[i] = [level[j:j + 1] for level in levels]
    return pyramids


def noise_pyramid(noise: Tensor, stages: int) -> list[Tensor]:
    """Full-resolution noise -> `stages` levels, lowest first. Halving averages 2x2 blocks, which
    divides the variance by 4, so each level is scaled by 2 to keep unit variance."""
    _check_divisible(noise, stages)
    levels = [noise]
    for _ in range(stages - 1):
        levels.append(halve(levels[-1]) * 2)
    return levels[::-1]


def column_stages(sample_ratios: Sequence[int]) -> list[int]:
    """The stage of each batch column: [1, 2, 1] -> [0, 1, 1, 2]."""
    return [stage for stage, count in enumerate(sample_ratios) for _ in range(count)]

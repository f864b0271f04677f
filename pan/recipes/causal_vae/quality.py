"""Reconstruction fidelity of frames: PSNR and SSIM, what the causal VAE's validation and its demo
report."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def psnr(x: Tensor, y: Tensor) -> Tensor:
    """Per-image PSNR in dB of frames [N, C, H, W] in [-1, 1] (peak 1 on the [0, 1] scale)."""
    mse = ((x - y) / 2).square().flatten(1).mean(1)
    return 10 * torch.log10(1.0 / mse.clamp_min(1e-10))


def ssim(x: Tensor, y: Tensor, window: int = 11, sigma: float = 1.5) -> Tensor:
    """Per-image SSIM (Wang et al., 2004) of frames [N, C, H, W] in [-1, 1]: a Gaussian window of 11
    px (sigma 1.5) per channel on the [0, 1] scale, C1 = 0.01**2, C2 = 0.03**2, averaged over the
    valid positions and the channels."""
    x, y = (x.float() + 1) / 2, (y.float() + 1) / 2
    channels = x.shape[1]
    window = min(window, x.shape[2], x.shape[3])
    coords = torch.arange(window, dtype=torch.float32, device=x.device) - (window - 1) / 2
    g = torch.exp(-coords.square() / (2 * sigma ** 2))
    g = g / g.sum()
    kernel = (g[:, None] * g[None, :]).expand(channels, 1, window, window).contiguous()
    blur = lambda v: F.conv2d(v, kernel, groups=channels)  # noqa: E731
    mu_x, mu_y = blur(x), blur(y)
    var_x = blur(x * x) - mu_x.square()
    var_y = blur(y * y) - mu_y.square()
    cov = blur(x * y) - mu_x * mu_y
    c1, c2 = 0.01 ** 2, 0.03 ** 2
    s = ((2 * mu_x * mu_y + c1) * (2 * cov + c2)) / ((mu_x.square() + mu_y.square() + c1) * (var_x + var_y + c2))
    return s.flatten(1).mean(1)

"""PatchGAN discriminators for VAE training (pix2pix's NLayerDiscriminator, as Pyramid-Flow uses it).

`2d` (the original's default): scores each frame on its own; input [N, 3, H, W] (frames of all
clips stacked), output a map of logits [N, 1, h, w]. `3d`: scores clips [B, 3, T, H, W] with 3-D
convs, output [B, 1, t, h, w].

Layout (n = `disc_num_layers`): a stride-2 conv + LeakyReLU(0.2); n - 1 stride-2 convs (stride
(1, 2, 2) in 3-D after the first) + InstanceNorm + LeakyReLU; one stride-1 conv + InstanceNorm +
LeakyReLU; a stride-1 conv to one channel. Every conv is 4 wide with padding 1 and has a bias; the
InstanceNorms have no affine parameters (quirk V2: not BatchNorm as in pix2pix; the biases of convs
that feed an InstanceNorm get ~0 gradients). State-dict keys are `main.{i}.weight/bias` as in the
original's `discriminator.pth`.

Minimum input size (quirk V2): the n stride-2 convs take a side s to floor(s / 2**n), the two last
convs each shorten it by 1, and the last one needs >= 1, so every side needs s >= 3 * 2**n:
48 px for the released 4 layers (32x32 ... 47x47 and 48x40 fail in the original with an opaque
error). In 3-D the frame count needs T >= 2 (n + 2): one stride-2 conv in time, then n + 1 convs
that shorten it by 1. Smaller inputs are refused with a clear error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import Tensor, nn

from pan.config.core import knob


@dataclass(kw_only=True)
class DiscriminatorConfig:
    SECTION: ClassVar[str] = "loss"

    disc_type: Literal["2d", "3d"] = knob("2d", "GAN discriminator: `2d` scores each frame (the original's), "
                                                "`3d` scores whole clips with 3-D convs")
    disc_num_layers: int = knob(4, "stride-2 conv layers of the discriminator; frames need >= 3 * 2**n px "
                                   "per side (48 for 4)", ge=1)
    disc_channels: int = knob(64, "channels of the discriminator's first conv (doubling per layer, "
                                  "at most 8x)", ge=1)


class NLayerDiscriminator(nn.Module):
    """PatchGAN discriminator; `dims` = 2 scores frames [N, C, H, W], 3 scores clips [B, C, T, H, W]."""

    def __init__(self, in_channels: int = 3, channels: int = 64, num_layers: int = 4, dims: int = 2):
        super().__init__()
        if dims not in (2, 3):
            raise ValueError(f"dims must be 2 or 3, got {dims}.")
        self.dims, self.num_layers = dims, num_layers
        conv = nn.Conv2d if dims == 2 else nn.Conv3d
        norm = nn.InstanceNorm2d if dims == 2 else nn.InstanceNorm3d
        later_stride = 2 if dims == 2 else (1, 2, 2)  # 3-D: only the first conv strides in time
        width = lambda n: channels * min(2 ** n, 8)  # noqa: E731
        layers: list[nn.Module] = [conv(in_channels, channels, 4, stride=2, padding=1), nn.LeakyReLU(0.2)]
        for n in range(1, num_layers):
            layers += [conv(width(n - 1), width(n), 4, stride=later_stride, padding=1), norm(width(n)),
                       nn.LeakyReLU(0.2)]
        layers += [conv(width(num_layers - 1), width(num_layers), 4, stride=1, padding=1),
                   norm(width(num_layers)), nn.LeakyReLU(0.2),
                   conv(width(num_layers), 1, 4, stride=1, padding=1)]
        self.main = nn.Sequential(*layers)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """The original's init: conv weights N(0, 0.02), zero biases."""
        for module in self.modules():
            if isinstance(module, (nn.Conv2d, nn.Conv3d)):
                nn.init.normal_(module.weight, 0.0, 0.02)
                nn.init.zeros_(module.bias)

    @property
    def min_size(self) -> int:
        """Smallest height / width (pixels) the discriminator can score."""
        return 3 * 2 ** self.num_layers

    @property
    def min_frames(self) -> int:
        """Smallest clip length the 3-D discriminator can score."""
        return 2 * (self.num_layers + 2)

    def check_input(self, x: Tensor) -> None:
        if x.dim() != self.dims + 2:
            raise ValueError(f"the {self.dims}-D discriminator takes {self.dims + 2}-D input, got shape "
                             f"{tuple(x.shape)}.")
        h, w = x.shape[-2:]
        if min(h, w) < self.min_size:
            raise ValueError(f"frames of {h}x{w} px are too small for the {self.num_layers}-layer "
                             f"discriminator: it needs >= {self.min_size} px per side "
                             f"(3 * 2**{self.num_layers}); use larger crops or fewer `disc_num_layers`.")
        if self.dims == 3 and x.shape[2] < self.min_frames:
            raise ValueError(f"clips of {x.shape[2]} frames are too short for the {self.num_layers}-layer "
                             f"3-D discriminator: it needs >= {self.min_frames} frames; use longer clips, "
                             "the 2-D discriminator or fewer `disc_num_layers`.")

    def forward(self, x: Tensor) -> Tensor:
        # x [N, C, H, W] -> [N, 1, h, w]   (3-D: [B, C, T, H, W] -> [B, 1, t, h, w])
        self.check_input(x)
        return self.main(x)


def build_discriminator(cfg: DiscriminatorConfig, in_channels: int = 3) -> NLayerDiscriminator:
    return NLayerDiscriminator(in_channels, cfg.disc_channels, cfg.disc_num_layers,
                               dims=2 if cfg.disc_type == "2d" else 3)

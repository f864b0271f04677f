"""The causal building blocks of the causal video VAE (`pan.models.causal_vae`): causal 3-D convs,
per-frame GroupNorm and attention, residual, down- and up-sampling blocks, the encoder and the decoder.

Every conv is causal in time: `kernel_t - 1` zero frames in front, none behind, so an output frame never
sees a later input frame; norms and attention work per frame. A chunked encode/decode hands each conv
a `TemporalWindows`, through which it carries the input frames its next output still reads.
Parameter names are those of the released `causal_video_vae` folder.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pan.models.causal_vae_config import CausalVAEConfig

_EPS = 1e-6  # every GroupNorm of the released model


class TemporalWindows:
    """What a chunked encode/decode carries from one temporal window to the next.

    For every causal conv: the (spatially padded) input frames that its next output still reads.
    Before the first window a conv reads `kernel_t - 1` zero frames instead, as in one shot.
    """

    def __init__(self):
        self.front: dict[nn.Module, Tensor] = {}
        self.first = True  # the first window holds the first frame, which is decoded on its own


class CausalConv3d(nn.Module):
    """Conv3d causal in time: `kernel_t - 1` zero frames in front, none behind; symmetric zero
    padding in space. `conv` holds the weights (released key `<name>.conv.weight`)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int,
                 stride: tuple[int, int, int] = (1, 1, 1)):
        super().__init__()
        self.conv = nn.Conv3d(in_channels, out_channels, kernel_size, stride=stride)
        self.time_pad = kernel_size - 1
        self.space_pad = (kernel_size // 2,) * 4  # (w_left, w_right, h_top, h_bottom)

    def forward(self, x: Tensor, windows: TemporalWindows | None = None) -> Tensor:
        # x [B, C, T, H, W] -> [B, C', T', H', W']
        if windows is None or self.time_pad == 0:
            return self.conv(F.pad(x, self.space_pad + (self.time_pad, 0)))
        x = F.pad(x, self.space_pad)
        front = windows.front.get(self)
        if front is None:
            front = x.new_zeros(x.shape[:2] + (self.time_pad,) + x.shape[3:])
        x = torch.cat([front, x], dim=2)
        # The next window's first output starts where this window's outputs stop. A copy, so the
        # window's own activations can be freed; not detached, so gradients cross windows too.
        stride_t = self.conv.stride[0]
        num_out = (x.shape[2] - self.conv.kernel_size[0]) // stride_t + 1
        windows.front[self] = x[:, :, num_out * stride_t:].clone()
        return self.conv(x)


class CausalGroupNorm(nn.GroupNorm):
    """GroupNorm over (channels, H, W) of each frame on its own, so no statistic crosses time."""

    def forward(self, x: Tensor) -> Tensor:
        b, c, t, h, w = x.shape
        frames = x.transpose(1, 2).reshape(b * t, c, h, w)                  # [(B T), C, H, W]
        frames = super().forward(frames)
        return frames.reshape(b, t, c, h, w).transpose(1, 2)                # [B, C, T, H, W]


class CausalResnetBlock(nn.Module):
    """norm -> SiLU -> causal conv, twice (dropout before the second conv), plus a 1x1x1 shortcut
    when the channel count changes."""

    def __init__(self, in_channels: int, out_channels: int, groups: int, dropout: float):
        super().__init__()
        self.norm1 = CausalGroupNorm(groups, in_channels, eps=_EPS)
        self.conv1 = CausalConv3d(in_channels, out_channels, 3)
        self.norm2 = CausalGroupNorm(groups, out_channels, eps=_EPS)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = CausalConv3d(out_channels, out_channels, 3)
        self.conv_shortcut = (CausalConv3d(in_channels, out_channels, 1) if in_channels != out_channels
                              else None)

    def forward(self, x: Tensor, windows: TemporalWindows | None = None) -> Tensor:
        h = self.conv1(F.silu(self.norm1(x)), windows)
        h = F.silu(self.norm2(h))  # (rebinding h frees conv1's output before conv2 runs)
        h = self.conv2(self.dropout(h), windows)
        if self.conv_shortcut is not None:
            x = self.conv_shortcut(x, windows)
        return x + h


class FrameAttention(nn.Module):
    """Single-head self-attention over the H*W positions of each frame, with a residual.
    Key names follow diffusers' `Attention` (`group_norm`, `to_q/k/v`, `to_out.0`)."""

    def __init__(self, channels: int, groups: int):
        super().__init__()
        self.group_norm = nn.GroupNorm(groups, channels, eps=_EPS)
        self.to_q = nn.Linear(channels, channels)
        self.to_k = nn.Linear(channels, channels)
        self.to_v = nn.Linear(channels, channels)
        self.to_out = nn.ModuleList([nn.Linear(channels, channels)])

    def forward(self, x: Tensor) -> Tensor:
        b, c, t, h, w = x.shape
        frames = x.transpose(1, 2).reshape(b * t, c, h * w)                 # [(B T), C, HW]
        tokens = self.group_norm(frames).transpose(1, 2)                    # [(B T), HW, C]
        q, k, v = (proj(tokens).unsqueeze(1) for proj in (self.to_q, self.to_k, self.to_v))
        out = F.scaled_dot_product_attention(q, k, v).squeeze(1)            # [(B T), HW, C]
        out = self.to_out[0](out).transpose(1, 2) + frames                  # [(B T), C, HW]
        return out.reshape(b, t, c, h, w).transpose(1, 2)                   # [B, C, T, H, W]


class MidBlock(nn.Module):
    """Residual block, per-frame attention, residual block."""

    def __init__(self, channels: int, groups: int, dropout: float):
        super().__init__()
        self.resnets = nn.ModuleList(CausalResnetBlock(channels, channels, groups, dropout) for _ in range(2))
        self.attentions = nn.ModuleList([FrameAttention(channels, groups)])

    def forward(self, x: Tensor, windows: TemporalWindows | None = None) -> Tensor:
        x = self.resnets[0](x, windows)
        x = self.attentions[0](x)
        return self.resnets[1](x, windows)


class ConvHolder(nn.Module):
    """A causal conv under the name `conv` (the released keys read `...samplers.0.conv.conv.weight`)."""

    def __init__(self, conv: CausalConv3d):
        super().__init__()
        self.conv = conv


class DownBlock(nn.Module):
    """Residual blocks, then optional 2x spatial and 2x temporal down-sampling (stride-2 causal convs)."""

    def __init__(self, in_channels: int, out_channels: int, layers: int, groups: int, dropout: float,
                 spatial: bool, temporal: bool):
        super().__init__()
        self.resnets = nn.ModuleList(CausalResnetBlock(in_channels if i == 0 else out_channels, out_channels,
                                                       groups, dropout) for i in range(layers))
        self.downsamplers = nn.ModuleList(
            [ConvHolder(CausalConv3d(out_channels, out_channels, 3, stride=(1, 2, 2)))]) if spatial else None
        self.temporal_downsamplers = nn.ModuleList(
            [ConvHolder(CausalConv3d(out_channels, out_channels, 3, stride=(2, 1, 1)))]) if temporal else None

    def forward(self, x: Tensor, windows: TemporalWindows | None = None) -> Tensor:
        for resnet in self.resnets:
            x = resnet(x, windows)
        if self.downsamplers is not None:
            x = self.downsamplers[0].conv(x, windows)                        # H, W -> ceil(H/2), ceil(W/2)
        if self.temporal_downsamplers is not None:
            x = self.temporal_downsamplers[0].conv(x, windows)               # T -> (T - 1) // 2 + 1
        return x


class UpBlock(nn.Module):
    """Residual blocks, then optional depth-to-space 2x spatial and 2x temporal up-sampling."""

    def __init__(self, in_channels: int, out_channels: int, layers: int, groups: int, dropout: float,
                 spatial: bool, temporal: bool):
        super().__init__()
        self.resnets = nn.ModuleList(CausalResnetBlock(in_channels if i == 0 else out_channels, out_channels,
                                                       groups, dropout) for i in range(layers))
        self.upsamplers = nn.ModuleList(
            [ConvHolder(CausalConv3d(out_channels, out_channels * 4, 3))]) if spatial else None
        self.temporal_upsamplers = nn.ModuleList(
            [ConvHolder(CausalConv3d(out_channels, out_channels * 2, 3))]) if temporal else None

    def forward(self, x: Tensor, windows: TemporalWindows | None = None) -> Tensor:
        for resnet in self.resnets:
            x = resnet(x, windows)
        if self.upsamplers is not None:
            x = space_from_channels(self.upsamplers[0].conv(x, windows))     # [B, C, T, 2H, 2W]
        if self.temporal_upsamplers is not None:
            # The first latent frame stands for the first frame alone: 2T - 1 frames where it is here.
            x = time_from_channels(self.temporal_upsamplers[0].conv(x, windows),   # [B, C, 2T (- 1), H, W]
                                   drop_first=windows is None or windows.first)
        return x


def space_from_channels(x: Tensor) -> Tensor:
    """[B, 4C, T, H, W] -> [B, C, T, 2H, 2W]; channel c*4 + 2i + j goes to pixel (2h + i, 2w + j)."""
    b, c4, t, h, w = x.shape
    x = x.reshape(b, c4 // 4, 2, 2, t, h, w).permute(0, 1, 4, 5, 2, 6, 3)
    return x.reshape(b, c4 // 4, t, 2 * h, 2 * w)


def time_from_channels(x: Tensor, drop_first: bool = False) -> Tensor:
    """[B, 2C, T, H, W] -> [B, C, 2T, H, W]; channel c*2 + p goes to frame 2t + p; without frame 0
    (2T - 1 frames) when `drop_first`.

    One gather into a fresh tensor that leaves frame 0 out: slicing it off afterwards returns a view,
    which FSDP2 warns about as a wrapped block's output (and a copy after the slice costs more)."""
    b, c2, t, h, w = x.shape
    frames = torch.arange(int(drop_first), 2 * t, device=x.device)
    pairs = x.reshape(b, c2 // 2, 2 * t, h, w)                              # (p, t) at p * T + t: a view
    return pairs.index_select(2, frames % 2 * t + frames // 2)


class Encoder(nn.Module):
    def __init__(self, c: CausalVAEConfig):
        super().__init__()
        ch, groups = c.encoder_block_out_channels, c.encoder_norm_num_groups
        self.conv_in = CausalConv3d(c.encoder_in_channels, ch[0], 3)
        self.down_blocks = nn.ModuleList(
            DownBlock(ch[max(i - 1, 0)], ch[i], c.encoder_layers_per_block[i], groups,
                      c.encoder_block_dropout[i], c.encoder_spatial_down_sample[i],
                      c.encoder_temporal_down_sample[i])
            for i in range(c.num_blocks))
        self.mid_block = MidBlock(ch[-1], groups, c.encoder_block_dropout[-1])
        self.conv_norm_out = CausalGroupNorm(groups, ch[-1], eps=_EPS)
        self.conv_out = CausalConv3d(ch[-1], 2 * c.encoder_out_channels, 3)

    def forward(self, x: Tensor, windows: TemporalWindows | None = None) -> Tensor:
        # x [B, 3, T, H, W] -> [B, 2 * latent, t, h, w]
        x = self.conv_in(x, windows)
        for block in self.down_blocks:
            x = block(x, windows)
        x = self.mid_block(x, windows)
        x = F.silu(self.conv_norm_out(x))  # (rebinding x frees the mid block's output)
        return self.conv_out(x, windows)


class Decoder(nn.Module):
    def __init__(self, c: CausalVAEConfig):
        super().__init__()
        ch, groups = c.decoder_block_out_channels[::-1], c.decoder_norm_num_groups  # from the latent side
        self.conv_in = CausalConv3d(c.decoder_in_channels, ch[0], 3)
        self.mid_block = MidBlock(ch[0], groups, c.decoder_block_dropout[-1])
        self.up_blocks = nn.ModuleList(
            UpBlock(ch[max(i - 1, 0)], ch[i], c.decoder_layers_per_block[i], groups,
                    c.decoder_block_dropout[i], c.decoder_spatial_up_sample[i],
                    c.decoder_temporal_up_sample[i])
            for i in range(c.num_blocks))
        self.conv_norm_out = CausalGroupNorm(groups, ch[-1], eps=_EPS)
        self.conv_out = CausalConv3d(ch[-1], c.decoder_out_channels, 3)

    def forward(self, z: Tensor, windows: TemporalWindows | None = None) -> Tensor:
        # z [B, latent, t, h, w] -> [B, 3, T, H, W]
        x = self.conv_in(z, windows)
        x = self.mid_block(x, windows)
        for block in self.up_blocks:
            x = block(x, windows)
        x = F.silu(self.conv_norm_out(x))  # (rebinding x frees the last up block's output)
        return self.conv_out(x, windows)

"""CausalVideoVAE: Pyramid-Flow's causal video VAE (MAGVIT-v2-like causal 3-D convolutions).

Encoder: a causal 3-D conv, down blocks (residual blocks, then an optional 2x spatial and an optional
2x temporal down-sampling conv), a mid block (residual, per-frame spatial self-attention, residual),
GroupNorm + SiLU + a causal conv to mean ++ logvar, and a 1x1x1 `quant_conv`. The decoder mirrors it
with depth-to-space up-sampling. Every conv is causal in time: `kernel_t - 1` zero frames in front,
none behind, so an output frame never sees a later input frame; norms and attention work per frame.
The first frame is encoded on its own, so an image is a 1-frame video; the released config
compresses 8x in space and 8x in time (T -> 1 + (T - 1) / 8) into 16 latent channels.

Parameter names, the `config.json` keys and the folder layout (`config.json` +
`diffusion_pytorch_model.safetensors`) are those of the released `causal_video_vae` folder, so
`from_pretrained` / `save_pretrained` are the identity on the state dict.

Long clips can be encoded and decoded in temporal windows (`chunk_frames`, `chunk_latent_frames`):
each causal conv carries the input frames its next output still needs from one window to the next
(`TemporalWindows`), so the result equals the one-shot result up to fp32 rounding.
Large frames can be processed in overlapping spatial tiles (`tile_size`), blended linearly: tiling
is approximate by nature (each tile sees a cropped context).

Reference: Pyramid Flow (Jin et al., 2024), `video_vae/`; MAGVIT-v2 (Yu et al., 2023) for the
causal 3-D conv design.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from pan.config.core import ConfigError, check_bounds, knob

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
CLASS_NAME = "CausalVideoVAE"
_DOWN_BLOCK = "DownEncoderBlockCausal3D"
_UP_BLOCK = "UpDecoderBlockCausal3D"
_CONV_TYPE = "causal_vae_conv"
_EPS = 1e-6  # every GroupNorm of the released model
# Keys whose only working value in the original is the released one.
_ONLY_VALUE = {"encoder_act_fn": "silu", "decoder_act_fn": "silu", "encoder_type": _CONV_TYPE,
               "decoder_type": _CONV_TYPE, "encoder_double_z": True, "add_post_quant_conv": True,
               "interpolate": False}
_PER_BLOCK_KEYS = tuple(f"{side}_{name}" for side, names in (
    ("encoder", ("layers_per_block", "down_block_types", "block_out_channels", "spatial_down_sample",
                 "temporal_down_sample", "block_dropout")),
    ("decoder", ("layers_per_block", "up_block_types", "block_out_channels", "spatial_up_sample",
                 "temporal_up_sample", "block_dropout"))) for name in names)


# ----------------------------------------------------------------------------------------------
# Config: the keys of the released config.json
# ----------------------------------------------------------------------------------------------

@dataclass(kw_only=True)
class CausalVAEConfig:
    """Every key of a released `causal_video_vae/config.json`; defaults are the released model.

    Keys whose only working value is the released one in the original code (block types, conv type,
    activation, `double_z`, `add_post_quant_conv`, `interpolate`) are kept so that a folder round-trips,
    and any other value is refused instead of being ignored.
    """
    SECTION: ClassVar[str] = "model"

    encoder_in_channels: int = knob(3, "pixel channels of the input", ge=1)
    encoder_out_channels: int = knob(16, "latent channels (the encoder emits twice as many: mean, logvar)",
                                     ge=1)
    encoder_layers_per_block: list[int] = knob([2, 2, 2, 2], "residual blocks per encoder down block", ge=1)
    encoder_down_block_types: list[str] = knob([_DOWN_BLOCK] * 4, f"one `{_DOWN_BLOCK}` per down block")
    encoder_block_out_channels: list[int] = knob([128, 256, 512, 512], "channels of each down block", ge=1)
    encoder_spatial_down_sample: list[bool] = knob([True, True, True, False],
                                                   "2x spatial down-sampling after each down block")
    encoder_temporal_down_sample: list[bool] = knob([True, True, True, False],
                                                    "2x temporal down-sampling after each down block")
    encoder_block_dropout: list[float] = knob([0.0] * 4, "dropout inside the residual blocks of each "
                                                         "down block (the last one also in the mid block)",
                                              ge=0, lt=1)
    encoder_act_fn: str = knob("silu", "activation of the encoder (only `silu`)")
    encoder_norm_num_groups: int = knob(32, "GroupNorm groups of the encoder", ge=1)
    encoder_double_z: bool = knob(True, "emit mean and logvar (only true)")
    encoder_type: str = knob(_CONV_TYPE, f"encoder kind (only `{_CONV_TYPE}`)")
    decoder_in_channels: int = knob(16, "latent channels the decoder reads (= encoder_out_channels)", ge=1)
    decoder_out_channels: int = knob(3, "pixel channels of the output", ge=1)
    decoder_layers_per_block: list[int] = knob([3, 3, 3, 3], "residual blocks per decoder up block", ge=1)
    decoder_up_block_types: list[str] = knob([_UP_BLOCK] * 4, f"one `{_UP_BLOCK}` per up block")
    decoder_block_out_channels: list[int] = knob([128, 256, 512, 512], "channels of the up blocks, "
                                                                       "listed from the output side", ge=1)
    decoder_spatial_up_sample: list[bool] = knob([True, True, True, False],
                                                 "2x spatial up-sampling after each up block")
    decoder_temporal_up_sample: list[bool] = knob([True, True, True, False],
                                                  "2x temporal up-sampling after each up block")
    decoder_block_dropout: list[float] = knob([0.0] * 4, "dropout inside the residual blocks of each up "
                                                         "block (the last one also in the mid block)",
                                              ge=0, lt=1)
    decoder_act_fn: str = knob("silu", "activation of the decoder (only `silu`)")
    decoder_norm_num_groups: int = knob(32, "GroupNorm groups of the decoder", ge=1)
    decoder_type: str = knob(_CONV_TYPE, f"decoder kind (only `{_CONV_TYPE}`)")
    sample_size: int | list[int] = knob(256, "default spatial tile size in pixels")
    scaling_factor: float = knob(0.13025, "latent scale used by diffusion models on this VAE", gt=0)
    add_post_quant_conv: bool = knob(True, "1x1x1 conv before the decoder (only true)")
    interpolate: bool = knob(False, "interpolating up-sampling (only false: depth-to-space)")
    downsample_scale: int = knob(8, "spatial compression factor (= 2 ** spatial down-sampling stages)", ge=1)

    # ---- derived geometry ----
    @property
    def num_blocks(self) -> int:
        return len(self.encoder_block_out_channels)

    @property
    def latent_channels(self) -> int:
        return self.encoder_out_channels

    @property
    def temporal_stages(self) -> int:
        return sum(self.encoder_temporal_down_sample)

    @property
    def temporal_factor(self) -> int:
        return 2 ** self.temporal_stages

    @property
    def spatial_factor(self) -> int:
        return 2 ** sum(self.encoder_spatial_down_sample)

    def check(self, job=None) -> None:
        """Refuse values the architecture cannot honour (ConfigError naming the key); `job` is unused."""
        self._check_fixed_values()
        self._check_block_lists()
        self._check_geometry()

    def _check_fixed_values(self) -> None:
        for key, value in _ONLY_VALUE.items():
            if getattr(self, key) != value:
                raise ConfigError(key, f"{getattr(self, key)!r} is not supported: the causal video VAE "
                                       f"only has {value!r} (the original ignores or cannot run any other).")
        for key, block in (("encoder_down_block_types", _DOWN_BLOCK), ("decoder_up_block_types", _UP_BLOCK)):
            bad = [b for b in getattr(self, key) if b != block]
            if bad:
                raise ConfigError(key, f"unknown block types {bad}; only `{block}` exists.")

    def _check_block_lists(self) -> None:
        """One entry per block in every per-block list; GroupNorm groups dividing every width."""
        n = self.num_blocks
        for key in _PER_BLOCK_KEYS:
            if len(getattr(self, key)) != n:
                raise ConfigError(key, f"has {len(getattr(self, key))} entries but "
                                       f"encoder_block_out_channels has {n}: give one per block.")
        for side in ("encoder", "decoder"):
            groups = getattr(self, f"{side}_norm_num_groups")
            widths = getattr(self, f"{side}_block_out_channels")
            if any(c % groups for c in widths):
                raise ConfigError(f"{side}_norm_num_groups", f"{groups} groups do not divide every width of "
                                                             f"{side}_block_out_channels {widths}.")

    def _check_geometry(self) -> None:
        """The decoder reads the encoder's latents and undoes its compression."""
        if self.decoder_in_channels != self.encoder_out_channels:
            raise ConfigError("decoder_in_channels",
                              f"{self.decoder_in_channels} differs from encoder_out_channels "
                              f"{self.encoder_out_channels}; the decoder reads the encoder's latents.")
        if (sum(self.decoder_spatial_up_sample) != sum(self.encoder_spatial_down_sample)
                or sum(self.decoder_temporal_up_sample) != self.temporal_stages):
            raise ConfigError("decoder_temporal_up_sample",
                              "the decoder must undo the encoder: as many spatial and temporal up-sampling "
                              "stages as down-sampling ones.")
        if self.downsample_scale != self.spatial_factor:
            raise ConfigError("downsample_scale",
                              f"{self.downsample_scale} is not the spatial compression {self.spatial_factor} "
                              "(2 ** spatial down-sampling stages).")

    # ---- config.json ----
    @classmethod
    def from_json_dict(cls, raw: dict[str, Any], where: str = CONFIG_NAME) -> tuple[CausalVAEConfig, dict]:
        """(config, metadata) of a config.json dict; metadata are its `_`-prefixed entries."""
        meta = {k: v for k, v in raw.items() if k.startswith("_")}
        values = {k: v for k, v in raw.items() if not k.startswith("_")}
        if meta.get("_class_name", CLASS_NAME) != CLASS_NAME:
            raise ConfigError("_class_name",
                              f"{where} describes a {meta['_class_name']!r}, not a {CLASS_NAME}.")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(fields))
        if unknown:
            raise ConfigError(unknown[0], f"{where} has keys the causal video VAE does not know: {unknown}. "
                                          f"Known keys: {sorted(fields)}.")
        missing = sorted(set(fields) - set(values))
        if missing:
            # The original would fill them with its constructor defaults (4 latent channels, scaling
            # 0.18215), which are not the released model's: refuse rather than guess.
            raise ConfigError(missing[0], f"{where} lacks keys {missing}; a released config lists them all.")
        for name, value in values.items():
            _check_type(name, value, fields[name].type, where)
            check_bounds(name, value, fields[name].metadata)
        config = cls(**{k: list(v) if isinstance(v, list) else v for k, v in values.items()})
        config.check()
        return config, meta

    def to_json_dict(self, meta: dict | None = None) -> dict[str, Any]:
        out = {"_class_name": CLASS_NAME, "_diffusers_version": _diffusers_version()}
        out.update(meta or {})
        out.update(dataclasses.asdict(self))
        return out


def _diffusers_version() -> str:
    try:
        return package_version("diffusers")
    except PackageNotFoundError:  # pragma: no cover - diffusers is a dependency
        return "0.0.0"


def _check_type(name: str, value: Any, annotation: str, where: str) -> None:
    """Reject a config.json value whose JSON type does not fit the field."""
    def fits(v, kind: str) -> bool:
        if kind == "bool":
            return isinstance(v, bool)
        if kind == "int":
            return isinstance(v, int) and not isinstance(v, bool)
        if kind == "float":
            return isinstance(v, (int, float)) and not isinstance(v, bool)
        return isinstance(v, str)

    for option in str(annotation).split(" | "):
        if option.startswith("list["):
            kind = option[5:-1]
            if isinstance(value, list) and all(fits(v, kind) for v in value):
                return
        elif fits(value, option):
            return
    raise ConfigError(name, f"{where}: {value!r} is not a valid `{annotation}`.")


# ----------------------------------------------------------------------------------------------
# Causal building blocks
# ----------------------------------------------------------------------------------------------

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
            x = time_from_channels(self.temporal_upsamplers[0].conv(x, windows))  # [B, C, 2T, H, W]
            if windows is None or windows.first:
                x = x[:, :, 1:]  # the first latent frame stands for the first frame alone: 2T - 1 frames
        return x


def space_from_channels(x: Tensor) -> Tensor:
    """[B, 4C, T, H, W] -> [B, C, T, 2H, 2W]; channel c*4 + 2i + j goes to pixel (2h + i, 2w + j)."""
    b, c4, t, h, w = x.shape
    x = x.reshape(b, c4 // 4, 2, 2, t, h, w).permute(0, 1, 4, 5, 2, 6, 3)
    return x.reshape(b, c4 // 4, t, 2 * h, 2 * w)


def time_from_channels(x: Tensor) -> Tensor:
    """[B, 2C, T, H, W] -> [B, C, 2T, H, W]; channel c*2 + p goes to frame 2t + p."""
    b, c2, t, h, w = x.shape
    x = x.reshape(b, c2 // 2, 2, t, h, w).transpose(2, 3)
    return x.reshape(b, c2 // 2, 2 * t, h, w)


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


# ----------------------------------------------------------------------------------------------
# Posterior
# ----------------------------------------------------------------------------------------------

class DiagonalGaussian:
    """The encoder's posterior N(mean, exp(logvar)) per latent voxel; `moments` = mean ++ logvar on C."""

    def __init__(self, moments: Tensor):
        self.moments = moments                                              # [B, 2C, t, h, w]
        self.mean, logvar = moments.chunk(2, dim=1)
        self.logvar = logvar.clamp(-30.0, 20.0)
        self.std = torch.exp(0.5 * self.logvar)
        self.var = torch.exp(self.logvar)

    def sample(self, generator: torch.Generator | None = None, *, noise: Tensor | None = None) -> Tensor:
        """mean + std * eps, eps ~ N(0, 1) from `generator` (or the global RNG), or the given `noise`."""
        if noise is None:
            device = generator.device if generator is not None else self.mean.device
            noise = torch.randn(self.mean.shape, generator=generator, device=device, dtype=self.mean.dtype)
        return self.mean + self.std * noise.to(self.mean.device)

    def mode(self) -> Tensor:
        return self.mean

    def kl(self) -> Tensor:
        """KL(q || N(0, 1)) summed over (t, h, w): [B, C]."""
        return 0.5 * torch.sum(self.mean.pow(2) + self.var - 1.0 - self.logvar, dim=[2, 3, 4])


# ----------------------------------------------------------------------------------------------
# The VAE
# ----------------------------------------------------------------------------------------------

class CausalVideoVAE(nn.Module):
    """Causal video VAE: `encode(x) -> DiagonalGaussian`, `decode(z) -> x`, `forward` for training."""

    def __init__(self, config: CausalVAEConfig, metadata: dict | None = None):
        super().__init__()
        config.check()
        self.config = config
        self.metadata = dict(metadata or {})  # `_`-prefixed config.json entries, written back on save
        self.encoder = Encoder(config)
        self.decoder = Decoder(config)
        latent = config.encoder_out_channels
        self.quant_conv = CausalConv3d(2 * latent, 2 * latent, 1)
        self.post_quant_conv = CausalConv3d(latent, latent, 1)
        if self.quant_conv.conv.weight.device.type != "meta":
            self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """The original's init: truncated normal (std 0.02) conv / linear weights, zero biases,
        unit GroupNorm scales."""
        for module in self.modules():
            if isinstance(module, (nn.Conv3d, nn.Linear)):
                nn.init.trunc_normal_(module.weight, std=0.02)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.GroupNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    @classmethod
    def from_pretrained(cls, folder: str | Path, dtype: torch.dtype = torch.float32,
                        device: torch.device | str = "cpu") -> CausalVideoVAE:
        return from_pretrained(folder, dtype, device)

    def save_pretrained(self, folder: str | Path) -> None:
        save_pretrained(self, folder)

    @property
    def last_layer(self) -> Tensor:
        """The decoder's output conv weight: where the adaptive GAN weight compares gradients."""
        return self.decoder.conv_out.conv.weight

    # ---- shape rules ----
    def check_frames(self, num_frames: int) -> None:
        """Raise ValueError unless `num_frames` = 1 + k * temporal_factor.

        Each temporal down-sampling stage is a stride-2 causal conv (kernel 3, two zero frames in
        front): it maps T frames to (T - 1) // 2 + 1 and reads every input frame only when T is odd;
        an even T leaves its last frame unread. So stage i needs an odd frame count, i.e. 1 + 2k at
        every stage, which is 1 + k * 2**n frames at the input for n stages (1 + 8k released). The
        decoder maps t latent frames back to 1 + 2**n (t - 1) frames, the same set.
        """
        n, f = self.config.temporal_stages, self.config.temporal_factor
        if num_frames < 1 or (num_frames - 1) % f:
            valid = ", ".join(str(1 + f * k) for k in range(4))
            raise ValueError(
                f"the causal video VAE encodes 1 + k*{f} frames ({valid}, ...), got {num_frames}: each of "
                f"its {n} temporal down-sampling stages (stride 2, causal) needs an odd frame count, or its "
                "last frame is never read and the decoder gives back fewer frames. Trim or pad the clip.")

    def check_pixels(self, height: int, width: int) -> None:
        f = self.config.spatial_factor
        if height % f or width % f:
            raise ValueError(f"the causal video VAE needs height and width divisible by {f} "
                             f"(its spatial compression), got {height}x{width}.")

    def latent_frames(self, num_frames: int) -> int:
        self.check_frames(num_frames)
        return (num_frames - 1) // self.config.temporal_factor + 1

    # ---- encode / decode ----
    def encode(self, x: Tensor, *, chunk_frames: int | None = None,
               tile_size: int | None = None) -> DiagonalGaussian:
        """x [B, 3, T, H, W] in [-1, 1], T = 1 + k * temporal_factor -> posterior over [B, C, t, h, w].

        `chunk_frames`: encode in temporal windows of 1 + chunk_frames, then chunk_frames frames (a
        multiple of the temporal factor), carrying each causal conv's front frames (exact).
        `tile_size`: encode overlapping spatial tiles of this many pixels and blend them (approximate).
        """
        self.check_frames(x.shape[2])
        self.check_pixels(x.shape[3], x.shape[4])
        if tile_size is not None and max(x.shape[3:]) > tile_size:
            encode_tile = lambda tile: self._encode_moments(tile, chunk_frames)  # noqa: E731
            return DiagonalGaussian(self._tiled(x, tile_size, encode_tile, encoding=True))
        return DiagonalGaussian(self._encode_moments(x, chunk_frames))

    def decode(self, z: Tensor, *, chunk_latent_frames: int | None = None,
               tile_size: int | None = None) -> Tensor:
        """z [B, C, t, h, w] -> x [B, 3, 1 + temporal_factor (t - 1), H, W].

        `chunk_latent_frames`: decode in windows of 1 + n, then n latent frames (exact);
        `tile_size`: decode overlapping tiles of this many output pixels and blend them (approximate).
        """
        if tile_size is not None and max(z.shape[3:]) * self.config.spatial_factor > tile_size:
            return self._tiled(z, tile_size, lambda tile: self._decode_pixels(tile, chunk_latent_frames),
                               encoding=False)
        return self._decode_pixels(z, chunk_latent_frames)

    def forward(self, x: Tensor, *, sample_posterior: bool = True, generator: torch.Generator | None = None,
                noise: Tensor | None = None) -> tuple[DiagonalGaussian, Tensor]:
        """Training path: (posterior, reconstruction of a posterior sample, or of its mean)."""
        posterior = self.encode(x)
        z = posterior.sample(generator, noise=noise) if sample_posterior else posterior.mode()
        return posterior, self.decode(z)

    def _encode_moments(self, x: Tensor, chunk_frames: int | None) -> Tensor:
        if chunk_frames is None:
            return self.quant_conv(self.encoder(x))
        f = self.config.temporal_factor
        if chunk_frames < 1 or chunk_frames % f:
            raise ValueError(f"chunk_frames must be a positive multiple of the temporal factor {f} (a window "
                             f"after the first then gives whole latent frames), got {chunk_frames}.")
        return self._windowed(x, 1 + chunk_frames, chunk_frames,
                              lambda w, s: self.quant_conv(self.encoder(w, s)))

    def _decode_pixels(self, z: Tensor, chunk_latent_frames: int | None) -> Tensor:
        if chunk_latent_frames is None:
            return self.decoder(self.post_quant_conv(z))
        if chunk_latent_frames < 1:
            raise ValueError(f"chunk_latent_frames must be >= 1, got {chunk_latent_frames}.")
        return self._windowed(z, 1 + chunk_latent_frames, chunk_latent_frames,
                              lambda w, s: self.decoder(self.post_quant_conv(w), s))

    @staticmethod
    def _windowed(x: Tensor, first: int, size: int, run) -> Tensor:
        """run(window, state) over [0, first), then windows of `size` frames; outputs joined in time."""
        windows, outputs, start = TemporalWindows(), [], 0
        while start < x.shape[2]:
            stop = start + (first if start == 0 else size)
            outputs.append(run(x[:, :, start:stop], windows))
            windows.first = False
            start = stop
        return torch.cat(outputs, dim=2)

    def _tiled(self, x: Tensor, tile_size: int, run, encoding: bool) -> Tensor:
        """run() on overlapping square tiles of `tile_size` pixels (a quarter of a tile overlaps its
        neighbour), outputs blended with linear ramps. Tiles are laid out on the latent grid."""
        f = self.config.spatial_factor
        if tile_size % f or tile_size < f:
            raise ValueError(f"tile_size must be a positive multiple of the spatial factor {f}, "
                             f"got {tile_size}.")
        tile = tile_size // f                                               # latent pixels per tile side
        step = tile - tile // 4
        in_scale, out_scale = (f, 1) if encoding else (1, f)
        h, w = x.shape[3] // in_scale, x.shape[4] // in_scale               # latent grid
        out = weight = None
        for i in _starts(h, tile, step):
            for j in _starts(w, tile, step):
                y = run(x[..., i * in_scale:(i + tile) * in_scale, j * in_scale:(j + tile) * in_scale])
                if out is None:
                    out = y.new_zeros(y.shape[:3] + (h * out_scale, w * out_scale))
                    weight = y.new_zeros(h * out_scale, w * out_scale)
                blend = (tile - step) * out_scale
                ramp = (_ramp(y.shape[3], blend)[:, None] * _ramp(y.shape[4], blend)[None, :]).to(y)
                rows = slice(i * out_scale, i * out_scale + y.shape[3])
                cols = slice(j * out_scale, j * out_scale + y.shape[4])
                out[..., rows, cols] += y * ramp
                weight[rows, cols] += ramp
        return out / weight


def _starts(length: int, tile: int, step: int) -> list[int]:
    """Tile origins covering [0, length): every `step`, the last one flush with the end."""
    if length <= tile:
        return [0]
    return list(range(0, length - tile, step)) + [length - tile]


def _ramp(n: int, blend: int) -> Tensor:
    """Blend weights along one tile side: rising over the first `blend` positions, falling over the
    last `blend`, 1 between; dividing by the summed weights turns overlaps into convex mixtures."""
    ramp = torch.ones(n)
    if 0 < blend <= n:
        edge = (torch.arange(blend) + 0.5) / blend
        ramp[:blend] = edge
        ramp[n - blend:] = torch.minimum(ramp[n - blend:], edge.flip(0))
    return ramp


# ----------------------------------------------------------------------------------------------
# Released folder layout
# ----------------------------------------------------------------------------------------------

def from_pretrained(folder: str | Path, dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu") -> CausalVideoVAE:
    """Load a released `causal_video_vae` folder (`config.json` + `diffusion_pytorch_model.safetensors`).

    The state dict must hold exactly the model's parameter names and shapes; any other key, a
    missing key or a wrong shape is refused with the names listed.
    """
    folder = Path(folder)
    config_path, weights_path = folder / CONFIG_NAME, folder / WEIGHTS_NAME
    for path in (config_path, weights_path):
        if not path.is_file():
            raise FileNotFoundError(f"{folder} is not a causal video VAE folder: {path.name} is missing "
                                    f"(expected {CONFIG_NAME} + {WEIGHTS_NAME}).")
    config, meta = CausalVAEConfig.from_json_dict(json.loads(config_path.read_text()), str(config_path))
    with torch.device("meta"):
        model = CausalVideoVAE(config, meta)
    state = renamed_legacy_attention_keys(load_file(str(weights_path), device=str(device)))
    check_state_dict(model, state, str(weights_path))
    model.load_state_dict(state, strict=True, assign=True)
    return model.to(dtype)


_LEGACY_ATTENTION = {"query": "to_q", "key": "to_k", "value": "to_v", "proj_attn": "to_out.0"}


def renamed_legacy_attention_keys(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Older diffusers wrote the mid-block attention as `query/key/value/proj_attn`; diffusers (and so
    the original's loader) renames them to `to_q/to_k/to_v/to_out.0` on load, and so does pan."""
    out = {}
    for key, value in state.items():
        prefix, _, rest = key.partition(".attentions.")
        parts = rest.split(".")
        if rest and len(parts) == 3 and parts[1] in _LEGACY_ATTENTION:
            key = f"{prefix}.attentions.{parts[0]}.{_LEGACY_ATTENTION[parts[1]]}.{parts[2]}"
        out[key] = value
    return out


def check_state_dict(model: nn.Module, state: dict[str, Tensor], where: str) -> None:
    """Raise ValueError naming the keys of `state` that do not fit `model` (missing, unknown, shape)."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = sorted(set(expected) - set(state))
    unknown = sorted(set(state) - set(expected))
    shapes = sorted(f"{k}: {tuple(state[k].shape)} (expected {expected[k]})"
                    for k in set(expected) & set(state) if tuple(state[k].shape) != expected[k])
    details = "; ".join(f"{text} {names}" for text, names in (("missing keys", missing),
                                                               ("unknown keys", unknown),
                                                               ("wrong shapes", shapes)) if names)
    if details:
        raise ValueError(f"{where} does not fit the causal video VAE of its config: {details}.")


def save_pretrained(model: CausalVideoVAE, folder: str | Path) -> None:
    """Write the released layout: `config.json` (the same keys) + `diffusion_pytorch_model.safetensors`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = model.config.to_json_dict(model.metadata)
    (folder / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(state, str(folder / WEIGHTS_NAME), metadata={"format": "pt"})


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
`from_pretrained` / `save_pretrained` are the identity on the state dict. Here: the posterior, the
model and the folder's reading and writing; the config keys are in `pan.models.causal_vae_config`,
the causal building blocks (encoder, decoder and their parts) in `pan.models.causal_vae_blocks`.

Long clips can be encoded and decoded in temporal windows (`chunk_frames`, `chunk_latent_frames`):
each causal conv carries the input frames its next output still needs from one window to the next
(`TemporalWindows`), so the result equals the one-shot result up to fp32 rounding.
Large frames can be processed in overlapping spatial tiles (`tile_size`), blended linearly: tiling
is approximate by nature (each tile sees a cropped context).

Reference: Pyramid Flow (Jin et al., 2024), `video_vae/`; MAGVIT-v2 (Yu et al., 2023) for the
causal 3-D conv design.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from pan.models.causal_vae_blocks import CausalConv3d, Decoder, Encoder, TemporalWindows
from pan.models.causal_vae_config import CONFIG_NAME, WEIGHTS_NAME, CausalVAEConfig
from pan.models.state_dict import ShapeDiff


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
    details = ShapeDiff.of_tensors(state, model).named()
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

"""Frozen VAEs: video frames [T, 3, H, W] in [-1, 1] <-> normalised latents [C, T', H', W'].

Types (`vae_type`):
- `identity`: latents are the pixels (C = 3, no compression), for debugging in pixel space.
- `diffusers`: any diffusers video autoencoder loaded offline from a local dir; production uses Wan 2.2
  (`AutoencoderKLWan`: z_dim 48, 16x spatial and 4x temporal compression).
- `causal_video_vae`: Pyramid-Flow's causal video VAE (pan/models/causal_vae.py), from a released
  `causal_video_vae` folder or from a checkpoint-N/ of pan's `causal_vae` recipe; latents are
  normalised per frame as Pyramid-Flow does (the first latent frame, which holds the first frame
  alone, with image statistics; every later one with video statistics).

The geometry (channels, compression factors) is known from the config alone (`vae_geometry`), without
loading weights, so the data pipeline and `pan check` can validate clip shapes before anything is built.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch

from pan.config.core import ConfigError, knob, require

_FACTOR_KEYS = ("vae_latent_channels", "vae_temporal_factor", "vae_spatial_factor")


@dataclass(kw_only=True)
class VAEConfig:
    SECTION: ClassVar[str] = "model"

    vae_type: Literal["identity", "diffusers", "causal_video_vae"] = knob(
        "identity", "frozen VAE: `identity` (pixels as latents, debugging), `diffusers` (a diffusers "
                    "autoencoder from `vae_path`) or `causal_video_vae` (Pyramid-Flow's causal VAE: a "
                    "released folder, or a checkpoint-N/ of a causal_vae run, at `vae_path`)")
    vae_path: str | None = knob(None, "local dir of the diffusers autoencoder (config.json + weights), "
                                      "or of the causal video VAE (a released causal_video_vae folder or "
                                      "a checkpoint-N/ of a causal_vae run); never downloaded",
                                non_empty=True)
    vae_class: str = knob("AutoencoderKLWan", "diffusers class name of the autoencoder at `vae_path`",
                          non_empty=True)
    vae_latent_channels: int | None = knob(
        None, "latent channels; null = read from the VAE config (set only for classes whose config "
              "does not say; a value that disagrees with the config is rejected)", gt=0)
    vae_temporal_factor: int | None = knob(
        None, "frames per latent frame after the first; null = read from the VAE config", gt=0)
    vae_spatial_factor: int | None = knob(
        None, "pixels per latent pixel along H and W; null = read from the VAE config", gt=0)
    vae_frame_latent_mean: list[float] = knob(
        [-0.04, -0.2343], "causal_video_vae: latent mean of the first latent frame (an image's) and of "
                          "every later one (normalised = (raw - mean) / std); defaults: the released "
                          "VAE's statistics as Pyramid-Flow's miniFLUX uses them", length=2)
    vae_frame_latent_std: list[float] = knob(
        [1.8726, 3.0986], "causal_video_vae: latent std of the first latent frame and of every later one",
        length=2, gt=0)

    def check(self, job) -> None:
        explicit = getattr(job, "explicit_keys", set())
        if self.vae_type != "causal_video_vae":
            for key in ("vae_frame_latent_mean", "vae_frame_latent_std"):
                require(key not in explicit, key, f"applies to `vae_type: causal_video_vae` only; remove "
                                                  f"it with `vae_type: {self.vae_type}`.")
        else:
            for key in _FACTOR_KEYS:
                require(getattr(self, key) is None, key, "is read from the causal video VAE's config "
                                                         "(`vae_type: causal_video_vae`); remove it.")
            require("vae_class" not in explicit, "vae_class", "does nothing with `vae_type: "
                                                              "causal_video_vae`; remove it.")
        if self.vae_type == "identity":
            explicit = getattr(job, "explicit_keys", set())
            for key in ("vae_path", *_FACTOR_KEYS):
                require(getattr(self, key) is None, key, "does nothing with `vae_type: identity`; remove "
                                                         "it or set `vae_type: diffusers`.")
            require("vae_class" not in explicit, "vae_class", "does nothing with `vae_type: identity`; "
                                                              "remove it or set `vae_type: diffusers`.")
        vae_geometry(self)  # raises ConfigError for a missing path, unknown class or bad factors


# ----------------------------------------------------------------------------------------------
# Geometry: what a latent looks like, from the config alone
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class VAEGeometry:
    """Latent channels and compression factors of a VAE, and the clip shapes it accepts.

    A causal video VAE encodes the first frame alone and every `temporal_factor` frames after it into
    one latent frame, so a clip needs (T - 1) % temporal_factor == 0 frames and gives
    T' = (T - 1) // temporal_factor + 1 latent frames (Wan: 4 -> 1, 5, 9, ..., 121 frames).
    """
    latent_channels: int
    temporal_factor: int
    spatial_factor: int

    def clip_shape_error(self, num_frames: int, height: int, width: int) -> str | None:
        """Why a clip of this shape cannot be encoded (None when it can)."""
        problems = []
        if num_frames < 1 or (num_frames - 1) % self.temporal_factor:
            problems.append(f"its frame count must be 1 + a multiple of {self.temporal_factor} "
                            f"((T - 1) % {self.temporal_factor} == 0)")
        if height % self.spatial_factor or width % self.spatial_factor or height < 1 or width < 1:
            problems.append(f"its height and width must be multiples of {self.spatial_factor}")
        if not problems:
            return None
        return f"a clip of {num_frames} frames at {height}x{width} does not fit this VAE: " + "; ".join(problems)

    def check_clip_shape(self, num_frames: int, height: int, width: int) -> None:
        error = self.clip_shape_error(num_frames, height, width)
        if error:
            raise ValueError(error)

    def latent_shape(self, num_frames: int, height: int, width: int) -> tuple[int, int, int, int]:
        """(C, T', H', W') of the latent of a [T, 3, H, W] clip; raises ValueError for an invalid shape."""
        self.check_clip_shape(num_frames, height, width)
        return (self.latent_channels, (num_frames - 1) // self.temporal_factor + 1,
                height // self.spatial_factor, width // self.spatial_factor)


IDENTITY_GEOMETRY = VAEGeometry(latent_channels=3, temporal_factor=1, spatial_factor=1)


def vae_geometry(cfg: VAEConfig) -> VAEGeometry:
    """The geometry named by the config, reading only the VAE's config.json (no weights)."""
    if cfg.vae_type == "identity":
        return IDENTITY_GEOMETRY
    if cfg.vae_type == "causal_video_vae":
        config = causal_vae_config(cfg)
        return VAEGeometry(latent_channels=config.latent_channels, temporal_factor=config.temporal_factor,
                           spatial_factor=config.spatial_factor)
    path = vae_dir(cfg)
    require(any(path.glob("*.safetensors")) or any(path.glob("*.bin")), "vae_path",
            f"{path} has a config.json but no weights (*.safetensors or *.bin).")
    config = diffusers_class(cfg.vae_class).load_config(str(path))
    geometry = _geometry_from_config(cfg, config)
    _latent_stats(config, geometry.latent_channels)  # rejects mean/std of the wrong length
    return geometry


def vae_dir(cfg: VAEConfig) -> Path:
    require(cfg.vae_path is not None, "vae_path", "is required with `vae_type: diffusers`: set it to "
                                                  "the local dir of the autoencoder (config.json + weights).")
    path = Path(cfg.vae_path).expanduser()
    require((path / "config.json").is_file(), "vae_path",
            f"{path} is not a local diffusers model dir (no config.json). Weights are never downloaded: "
            "fetch them beforehand (e.g. the `vae/` folder of a diffusers repo) and point the key there.")
    return path


def diffusers_class(name: str) -> type:
    import diffusers  # only for diffusers VAEs: importing it costs seconds at every config load

    model_cls = getattr(diffusers, name, None)
    require(isinstance(model_cls, type) and issubclass(model_cls, diffusers.ModelMixin)
            and hasattr(model_cls, "encode") and hasattr(model_cls, "decode"), "vae_class",
            f"{name!r} is not a diffusers autoencoder class (e.g. AutoencoderKLWan, "
            "AutoencoderKLHunyuanVideo).")
    return model_cls


def _geometry_from_config(cfg: VAEConfig, config: dict[str, Any]) -> VAEGeometry:
    """Read channels and factors from a diffusers VAE config; keys fill in what it does not say."""
    derived: dict[str, int | None] = dict.fromkeys(_FACTOR_KEYS)
    if cfg.vae_class == "AutoencoderKLWan":
        # Derived from the architecture (not `scale_factor_*`, which older configs lack): each
        # encoder stage but the last halves H and W, `temperal_downsample` marks the stages that halve
        # T, and Wan 2.2 folds `patch_size` x `patch_size` pixels into channels first.
        derived = {"vae_latent_channels": config["z_dim"],
                   "vae_temporal_factor": 2 ** sum(config["temperal_downsample"]),
                   "vae_spatial_factor": 2 ** (len(config["dim_mult"]) - 1) * (config.get("patch_size") or 1)}
    else:
        # Generic diffusers video autoencoders (HunyuanVideo, CogVideoX, LTX, ...) name them so.
        derived["vae_latent_channels"] = config.get("latent_channels", config.get("z_dim"))
        derived["vae_temporal_factor"] = config.get("temporal_compression_ratio")
        derived["vae_spatial_factor"] = config.get("spatial_compression_ratio")
    values = {}
    for key in _FACTOR_KEYS:
        given, known = getattr(cfg, key), derived[key]
        if known is not None and given is not None and int(known) != given:
            raise ConfigError(key, f"is {given}, but the {cfg.vae_class} config at {cfg.vae_path} says "
                                   f"{int(known)}; remove the key (it is read from the VAE config).")
        value = known if known is not None else given
        require(value is not None, key, f"the {cfg.vae_class} config at {cfg.vae_path} does not say it; "
                                        "set the key.")
        values[key] = int(value)
    return VAEGeometry(latent_channels=values["vae_latent_channels"],
                       temporal_factor=values["vae_temporal_factor"],
                       spatial_factor=values["vae_spatial_factor"])


# ----------------------------------------------------------------------------------------------
# Frozen VAEs
# ----------------------------------------------------------------------------------------------

class FrozenVAE(ABC):
    """frames [T, 3, H, W] in [-1, 1] <-> normalised latent [C, T', H', W'] (fp32), on one device."""

    def __init__(self, geometry: VAEGeometry):
        self.geometry = geometry

    @property
    def latent_channels(self) -> int:
        return self.geometry.latent_channels

    @property
    def temporal_factor(self) -> int:
        return self.geometry.temporal_factor

    @property
    def spatial_factor(self) -> int:
        return self.geometry.spatial_factor

    def latent_shape(self, num_frames: int, height: int, width: int) -> tuple[int, int, int, int]:
        return self.geometry.latent_shape(num_frames, height, width)

    @abstractmethod
    def encode(self, frames: torch.Tensor) -> torch.Tensor:
        """frames [T, 3, H, W] in [-1, 1] -> normalised latent [C, T', H', W'], fp32."""

    @abstractmethod
    def decode(self, latent: torch.Tensor) -> torch.Tensor:
        """normalised latent [C, T', H', W'] -> frames [T, 3, H, W] in [-1, 1], fp32."""

    def unnormalize(self, latent: torch.Tensor) -> torch.Tensor:
        """A normalised latent as the VAE itself gives it (recipes with their own latent statistics,
        such as Pyramid-Flow's per-frame ones, normalise raw latents themselves)."""
        return latent

    def normalize(self, raw: torch.Tensor) -> torch.Tensor:
        """Inverse of `unnormalize`."""
        return raw


class IdentityVAE(FrozenVAE):
    """Pixels as latents: [T, 3, H, W] <-> [3, T, H, W]."""

    def __init__(self, device: torch.device | str = "cpu"):
        super().__init__(IDENTITY_GEOMETRY)
        self.device = torch.device(device)

    def encode(self, frames: torch.Tensor) -> torch.Tensor:
        return frames.to(self.device, torch.float32).permute(1, 0, 2, 3).contiguous()

    def decode(self, latent: torch.Tensor) -> torch.Tensor:
        return latent.permute(1, 0, 2, 3).contiguous()


class DiffusersVAE(FrozenVAE):
    """A frozen diffusers autoencoder; latents use the posterior mean, normalised per channel."""

    def __init__(self, cfg: VAEConfig, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        super().__init__(vae_geometry(cfg))
        self.model = diffusers_class(cfg.vae_class).from_pretrained(str(vae_dir(cfg)), local_files_only=True, torch_dtype=dtype)
        self.model.to(device).eval().requires_grad_(False)
        self.device, self.dtype = torch.device(device), dtype
        self.mean, self.std = _latent_stats(dict(self.model.config), self.latent_channels)
        self.mean, self.std = self.mean.to(self.device), self.std.to(self.device)

    @torch.no_grad()
    def encode(self, frames: torch.Tensor) -> torch.Tensor:
        self.geometry.check_clip_shape(*_clip_dims(frames))
        video = frames.to(self.device, self.dtype).permute(1, 0, 2, 3).unsqueeze(0)  # [1, 3, T, H, W]
        latent = self.model.encode(video).latent_dist.mode()[0].float()  # [C, T', H', W']
        expected = self.latent_shape(*_clip_dims(frames))
        if tuple(latent.shape) != expected:
            raise ValueError(f"{type(self.model).__name__} gave a latent of shape {tuple(latent.shape)}, but "
                             f"the VAE geometry {self.geometry} predicts {expected}: fix "
                             f"{', '.join(_FACTOR_KEYS)} for this VAE.")
        return (latent - self.mean) / self.std

    def unnormalize(self, latent: torch.Tensor) -> torch.Tensor:
        return latent.to(self.device, torch.float32) * self.std + self.mean

    def normalize(self, raw: torch.Tensor) -> torch.Tensor:
        return (raw.to(self.device, torch.float32) - self.mean) / self.std

    @torch.no_grad()
    def decode(self, latent: torch.Tensor) -> torch.Tensor:
        raw = self.unnormalize(latent)
        video = self.model.decode(raw.to(self.dtype).unsqueeze(0)).sample[0]  # [3, T, H, W]
        return video.float().clamp(-1, 1).permute(1, 0, 2, 3).contiguous()


def _clip_dims(frames: torch.Tensor) -> tuple[int, int, int]:
    if frames.ndim != 4 or frames.shape[1] != 3:
        raise ValueError(f"expected frames [T, 3, H, W], got shape {tuple(frames.shape)}")
    return frames.shape[0], frames.shape[2], frames.shape[3]


def _latent_stats(config: dict[str, Any], channels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel (mean, std) [C, 1, 1, 1] with normalised = (raw - mean) / std.

    From `latents_mean`/`latents_std` when the config has them (Wan), else from the older
    `scaling_factor`/`shift_factor` convention (normalised = (raw - shift) * scale), else none.
    """
    if config.get("latents_mean") is not None and config.get("latents_std") is not None:
        mean, std = config["latents_mean"], config["latents_std"]
        if len(mean) != channels or len(std) != channels:
            raise ConfigError("vae_path", f"the VAE config has {len(mean)} latents_mean and {len(std)} "
                                          f"latents_std values for {channels} latent channels.")
    else:
        scale = config.get("scaling_factor") or 1.0
        mean, std = [config.get("shift_factor") or 0.0] * channels, [1.0 / scale] * channels
    as_column = lambda v: torch.tensor(v, dtype=torch.float32).view(channels, 1, 1, 1)
    return as_column(mean), as_column(std)


# ----------------------------------------------------------------------------------------------
# Pyramid-Flow's causal video VAE (a released folder, or a checkpoint of pan's causal_vae recipe)
# ----------------------------------------------------------------------------------------------

RUN_VAE_CONFIG = "vae_config.json"   # what the causal_vae recipe writes in its output_dir


def causal_vae_config(cfg: VAEConfig):
    """The CausalVAEConfig at `vae_path`: a released folder's config.json, or for a checkpoint-N/ of a
    causal_vae run, the run's output_dir/vae_config.json (ConfigError on `vae_path` otherwise)."""
    import json

    # lazy: only a causal VAE needs it
    from pan.models.causal_vae_config import CONFIG_NAME, WEIGHTS_NAME, CausalVAEConfig

    require(cfg.vae_path is not None, "vae_path", "is required with `vae_type: causal_video_vae`: a "
            "released causal_video_vae folder or a checkpoint-N/ of a causal_vae run.")
    path = Path(cfg.vae_path).expanduser()
    if (path / CONFIG_NAME).is_file() and (path / WEIGHTS_NAME).is_file():
        config_path = path / CONFIG_NAME
    elif (path / "vae" / ".metadata").is_file():
        config_path = path.parent / RUN_VAE_CONFIG
        require(config_path.is_file(), "vae_path", f"{path} holds a `vae` part but {config_path} (the "
                "architecture the causal_vae recipe writes beside its checkpoints) is missing.")
    else:
        raise ConfigError("vae_path", f"{path} is neither a released causal_video_vae folder ({CONFIG_NAME} + "
                                      f"{WEIGHTS_NAME}) nor a checkpoint-N/ of a causal_vae run (with vae/).")
    try:
        config, _ = CausalVAEConfig.from_json_dict(json.loads(config_path.read_text()), str(config_path))
    except ConfigError as e:
        raise ConfigError("vae_path", str(e)) from None
    return config


class CausalVideoVAEEncoder(FrozenVAE):
    """A frozen causal video VAE; latents are the posterior mean, normalised per latent frame:
    frame 0 (the first pixel frame alone) with the image statistics, later frames with the video ones."""

    def __init__(self, cfg: VAEConfig, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        from pan.models.causal_vae import CausalVideoVAE, check_state_dict  # lazy: only a causal VAE needs it

        config = causal_vae_config(cfg)
        super().__init__(vae_geometry(cfg))
        path = Path(cfg.vae_path).expanduser()
        if (path / "vae" / ".metadata").is_file():
            from pan.checkpoint.consolidate import consolidated_weights  # lazy: only a causal_vae run's folder
            state = consolidated_weights(path / "vae")
            state.pop("logvar", None)   # the loss's log-variance, trained with the VAE
            with torch.device("meta"):
                model = CausalVideoVAE(config)
            check_state_dict(model, state, str(path / "vae"))
            model.load_state_dict(state, assign=True)
        else:
            model = CausalVideoVAE.from_pretrained(path)
        self.model = model.to(device, dtype).eval().requires_grad_(False)
        self.device, self.dtype = torch.device(device), dtype
        column = lambda v: torch.tensor(v, dtype=torch.float32, device=self.device).view(2, 1, 1, 1)  # noqa: E731
        self.mean, self.std = column(cfg.vae_frame_latent_mean), column(cfg.vae_frame_latent_std)

    def _per_frame(self, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, std) [1, t, 1, 1]: image statistics for latent frame 0, video ones after."""
        index = torch.ones(t, dtype=torch.long, device=self.device)
        index[0] = 0
        return self.mean[index].view(1, t, 1, 1), self.std[index].view(1, t, 1, 1)

    @torch.no_grad()
    def encode(self, frames: torch.Tensor) -> torch.Tensor:
        self.geometry.check_clip_shape(*_clip_dims(frames))
        video = frames.to(self.device, self.dtype).permute(1, 0, 2, 3).unsqueeze(0)  # [1, 3, T, H, W]
        return self.normalize(self.model.encode(video).mode()[0].float())

    def normalize(self, raw: torch.Tensor) -> torch.Tensor:
        mean, std = self._per_frame(raw.shape[1])
        return (raw.to(self.device, torch.float32) - mean) / std

    def unnormalize(self, latent: torch.Tensor) -> torch.Tensor:
        mean, std = self._per_frame(latent.shape[1])
        return latent.to(self.device, torch.float32) * std + mean

    @torch.no_grad()
    def decode(self, latent: torch.Tensor) -> torch.Tensor:
        raw = self.unnormalize(latent)
        video = self.model.decode(raw.to(self.dtype).unsqueeze(0))[0]  # [3, T, H, W]
        return video.float().clamp(-1, 1).permute(1, 0, 2, 3).contiguous()


_BUILDERS = {
    "identity": lambda cfg, device, dtype: IdentityVAE(device),
    "diffusers": DiffusersVAE,
    "causal_video_vae": CausalVideoVAEEncoder,
}


def build_vae(cfg: VAEConfig, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> FrozenVAE:
    """The frozen VAE named by `vae_type`, on `device`, weights in `dtype` (latents are always fp32)."""
    return _BUILDERS[cfg.vae_type](cfg, device, dtype)

"""CausalVAEConfig: the keys of a released `causal_video_vae/config.json` and the folder's file names.

Every key is read and checked (`from_json_dict`), and written back as it was read (`to_json_dict`), so
a released folder round-trips; the model (`pan.models.causal_vae`) is built from it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from typing import Any, ClassVar

from pan.config.core import ConfigError, check_bounds, knob

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
CLASS_NAME = "CausalVideoVAE"
_DOWN_BLOCK = "DownEncoderBlockCausal3D"
_UP_BLOCK = "UpDecoderBlockCausal3D"
_CONV_TYPE = "causal_vae_conv"
# Keys whose only working value in the original is the released one.
_ONLY_VALUE = {"encoder_act_fn": "silu", "decoder_act_fn": "silu", "encoder_type": _CONV_TYPE,
               "decoder_type": _CONV_TYPE, "encoder_double_z": True, "add_post_quant_conv": True,
               "interpolate": False}
_PER_BLOCK_KEYS = tuple(f"{side}_{name}" for side, names in (
    ("encoder", ("layers_per_block", "down_block_types", "block_out_channels", "spatial_down_sample",
                 "temporal_down_sample", "block_dropout")),
    ("decoder", ("layers_per_block", "up_block_types", "block_out_channels", "spatial_up_sample",
                 "temporal_up_sample", "block_dropout"))) for name in names)


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

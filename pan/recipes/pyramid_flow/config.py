"""The `pyramid_flow` recipe's keys: its job config and the components only Pyramid-Flow reads.

Loading a config imports this module (through the recipe's `__init__`) and nothing heavier: the
variant's config.json is read to check the keys against it (`dit_config`), the DiT classes are
imported only for that (`dit_class`), and no model is built.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

import torch
from torch import nn

from pan.checkpoint.manager import CheckpointConfig
from pan.checkpoint.warm_start import WarmStartConfig
from pan.config import JobConfig
from pan.config.core import ConfigError, knob, require
from pan.data.config import DataConfig
from pan.diffusion.flow import FlowConfig
from pan.diffusion.pyramid_schedule import PyramidConfig
from pan.encoders.pyramid_text import PyramidTextConfig
from pan.encoders.vae import VAEConfig
from pan.lora.adapters import LoraConfig, candidate_names
from pan.runtime.metrics import MetricsConfig
from pan.runtime.watchdog_config import WatchdogConfig
from pan.models.attention import ATTENTION_BACKENDS
from pan.models.pan_dit import PanDiTConfig, PanVideoDiffusionTransformer
from pan.optim.config import OptimConfig
from pan.parallel.dims import ParallelConfig
from pan.trainer import TrainerConfig

MODEL_NAMES = ("pyramid_flux", "pyramid_mmdit", "pan")


# ------------------------------------------------------------------------------------------------
# Keys
# ------------------------------------------------------------------------------------------------

@dataclass(kw_only=True)
class PyramidModelConfig:
    SECTION: ClassVar[str] = "model"

    model_name: Literal["pyramid_flux", "pyramid_mmdit", "pan"] = knob(
        "pyramid_flux", "the DiT: pyramid_flux (released miniFLUX), pyramid_mmdit (released SD3 "
                        "MMDiT), or pan (PanVideoDiffusionTransformer from transformer_config_overrides)")
    model_path: str | None = knob(
        None, "folder of a released Pyramid-Flow model: its DiT variants (diffusion_transformer_384p, "
              "...) and text_encoder*/ tokenizer*/ folders; never downloaded")
    model_variant: str = knob("diffusion_transformer_384p", "the DiT folder inside model_path "
                              "(diffusion_transformer_384p, diffusion_transformer_768p, "
                              "diffusion_transformer_image)", non_empty=True)
    attention_backend: str | None = knob(
        None, "attention kernels: null = the variant's own choice (its use_flash_attn), or one of "
              "auto, sdpa, blockwise, flex, varlen (every one honours the block-causal rule or refuses; auto: "
              "the fastest exact one, measured on the first pack and kept in the checkpoint)")
    use_temporal_causal: bool | None = knob(
        None, "block-causal attention over latent frames (captions are frame 0); null = the variant's "
              "config.json value (true as released; pan model: true)")
    transformer_config_overrides: PanDiTConfig = knob(
        PanDiTConfig(), "the architecture when model_name is pan (see the Pan recipe's keys)")

    # Keys that override the variant's config.json of the same name when set (null: the variant's).
    SWITCHES: ClassVar[tuple[str, ...]] = ("use_temporal_causal",)

    def switches(self) -> dict[str, bool]:
        """The variant's config.json values this run replaces: the DiT trains, and exports, with them."""
        return {key: getattr(self, key) for key in self.SWITCHES if getattr(self, key) is not None}

    def check(self, job) -> None:
        require(self.attention_backend is None or self.attention_backend in ATTENTION_BACKENDS,
                "attention_backend", f"is {self.attention_backend!r}; choose one of "
                f"{', '.join(ATTENTION_BACKENDS)} (or null).")
        if self.model_name == "pan":
            require(self.model_path is not None or job.text.text_encoder_dir is not None, "model_path",
                    "is needed for the text encoders (or set text_encoder_dir).")
            return
        require("transformer_config_overrides" not in job.explicit_keys, "transformer_config_overrides",
                f"only applies with model_name: pan; a {self.model_name} DiT reads its architecture from "
                "model_path/model_variant/config.json. Remove it.")
        require(self.model_path is not None, "model_path",
                f"is needed for model_name {self.model_name}: the folder of the released model (with "
                f"{self.model_variant}/config.json and the text encoders).")
        dit_config(self)  # the variant's config.json and every key of it, or ConfigError naming it


@dataclass(kw_only=True)
class PyramidTaskConfig:
    SECTION: ClassVar[str] = "tasks"

    cfg_drop_prob: float = knob(0.1, "probability that a caption is replaced by the empty caption's "
                                     "features (classifier-free guidance)", ge=0.0, le=1.0)


@dataclass(kw_only=True)
class PyramidValidationConfig:
    SECTION: ClassVar[str] = "output"

    validation_interval: int = knob(0, "every this many steps, sample validation_prompts (0: never)", ge=0)
    validation_prompts: list[str] = knob([], "prompts sampled at each validation, saved beside the "
                                             "checkpoints as MP4 and GIF")
    sample_steps: list[int] = knob([20, 20, 20], "Euler steps of each pyramid stage when sampling", ge=1)
    sample_guidance_scale: float = knob(7.0, "classifier-free guidance scale when sampling (1: off)", ge=0.0)
    sample_num_frames: int = knob(9, "frames of validation samples (pixel frames)", ge=1)
    sample_height: int = knob(384, "height of validation samples in pixels", ge=1)
    sample_width: int = knob(640, "width of validation samples in pixels", ge=1)
    sample_fps: float = knob(8.0, "frame rate of the validation videos written", gt=0.0)
    sample_batch_size: int = knob(
        1, "prompts sampled together, one packed forward for all of them (validation and pan sample); "
           "each prompt keeps its own seed's draws", ge=1)

    def check(self, job) -> None:
        require(len(self.sample_steps) == job.pyramid.stages, "sample_steps",
                f"needs one step count per pyramid stage ({job.pyramid.stages}), got {self.sample_steps}.")
        require(not self.validation_interval or self.validation_prompts, "validation_interval",
                "is set but there are no validation_prompts: give some, or set validation_interval: 0.")


@dataclass(kw_only=True)
class PyramidJobConfig(JobConfig):
    recipe: str = "pyramid_flow"
    READS_PREDICTION_TYPE: ClassVar[bool] = True
    HISTORY_CLIPS: ClassVar[bool] = False  # full-sequence training: no history clips (PyramidConfig)
    model: PyramidModelConfig = knob(PyramidModelConfig(), "")
    warm_start: WarmStartConfig = knob(WarmStartConfig(), "")
    text: PyramidTextConfig = knob(PyramidTextConfig(), "")
    vae: VAEConfig = knob(VAEConfig(), "")
    trainer: TrainerConfig = knob(TrainerConfig(), "")
    watchdog: WatchdogConfig = knob(WatchdogConfig(), "")
    optim: OptimConfig = knob(OptimConfig(), "")
    pyramid: PyramidConfig = knob(PyramidConfig(), "")
    flow: FlowConfig = knob(FlowConfig(), "")
    data: DataConfig = knob(DataConfig(), "")
    tasks: PyramidTaskConfig = knob(PyramidTaskConfig(), "")
    parallel: ParallelConfig = knob(ParallelConfig(), "")
    checkpoint: CheckpointConfig = knob(CheckpointConfig(), "")
    logging: MetricsConfig = knob(MetricsConfig(), "")
    validation: PyramidValidationConfig = knob(PyramidValidationConfig(), "")
    lora: LoraConfig = knob(LoraConfig(), "")

    def lora_candidates(self) -> list[str]:
        """The linears `lora_target_modules` may name (the DiT built on the meta device)."""
        with torch.device("meta"):
            if self.model.model_name == "pan":
                # (the names inside a block are those of PanForPyramid, which wraps this model)
                return candidate_names(PanVideoDiffusionTransformer(self.model.transformer_config_overrides))
            return candidate_names(dit_class(self.model.model_name)(dit_config(self.model)))

    def attention_heads(self) -> int:
        if self.model.model_name == "pan":
            return self.model.transformer_config_overrides.num_attention_heads
        return dit_config(self.model).num_attention_heads


# ------------------------------------------------------------------------------------------------
# The released DiT a run names: its class and its config.json
# ------------------------------------------------------------------------------------------------

def dit_class(model_name: str) -> type[nn.Module]:
    if model_name == "pyramid_mmdit":
        from pan.models.pyramid_mmdit import PyramidMMDiT  # lazy: loading a config builds no model
        return PyramidMMDiT
    from pan.models.pyramid_flux import PyramidFluxTransformer  # lazy: loading a config builds no model
    return PyramidFluxTransformer


def variant_folder(cfg: PyramidModelConfig) -> Path:
    return Path(cfg.model_path).expanduser() / cfg.model_variant


def dit_config(cfg: PyramidModelConfig):
    """The variant's config.json as the model's config (with the recipe's overrides applied)."""
    from pan.models.pyramid_io import load_config  # lazy: with the model classes it reads configs for

    cls = dit_class(cfg.model_name)
    try:
        config = load_config(variant_folder(cfg), cls)
    except FileNotFoundError:
        # One wording, whichever rule reads the variant first (the same problem is then said once).
        raise ConfigError("model_variant", f"{variant_folder(cfg)} holds no config.json: model_variant names "
                          "the DiT folder inside model_path (diffusion_transformer_384p, ..._768p, "
                          "..._image).") from None
    except ConfigError as e:
        if "_class_name" not in str(e):
            raise
        other = "pyramid_mmdit" if cfg.model_name == "pyramid_flux" else "pyramid_flux"
        raise ConfigError("model_name", f"is {cfg.model_name} ({cls.RELEASED_CLASS_NAME}), but "
                          f"{variant_folder(cfg)} holds another architecture: set model_name: {other}, "
                          "or point model_path / model_variant at a folder of this one.") from None
    return dataclasses.replace(config, **cfg.switches())


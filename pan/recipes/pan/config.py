"""The Pan recipe's keys: the job config and the components only this recipe reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from pan.checkpoint.manager import CheckpointConfig
from pan.checkpoint.warm_start import WarmStartConfig
from pan.config import JobConfig
from pan.config.core import ConfigError, knob, require
from pan.data.config import DataConfig, parse_bucket
from pan.diffusion.flow import FlowConfig
from pan.encoders.text import TextEncoderConfig, text_feature_width
from pan.encoders.vae import VAEConfig, vae_geometry
from pan.lora.adapters import LoraConfig, candidate_names
from pan.runtime.metrics import MetricsConfig
from pan.runtime.watchdog_config import WatchdogConfig
from pan.models.pan_dit import PanDiTConfig, PanVideoDiffusionTransformer
from pan.optim.config import OptimConfig
from pan.parallel.dims import ParallelConfig
from pan.parallel.world import ProcessConfig
from pan.trainer import TrainerConfig
from pan.recipes.pan.validation import ValidationConfig


@dataclass(kw_only=True)
class PanModelConfig:
    SECTION: ClassVar[str] = "model"

    transformer_config_overrides: PanDiTConfig = knob(
        PanDiTConfig(), "the complete architecture: every constructor argument of "
                        "PanVideoDiffusionTransformer (see the transformer_config_overrides.* keys)")
    zero_init_modulation: bool = knob(
        True, "initialise the modulation projections, the text modulation table and the output "
              "projection to zero (AdaLN-Zero), so every block starts as the identity")
    attention_backend: Literal["auto", "sdpa", "blockwise", "flex", "varlen"] = knob(
        "auto", "attention kernel: sdpa (one SDPA call per sample layout, CPU and reference), blockwise "
                "(block-causal samples: one call per frame over the keys it may see), flex (torch "
                "flex_attention; trains on CUDA only), varlen (torch varlen kernel, CUDA), auto "
                "(the fastest exact one, measured on the first pack after step 1 and kept in the "
                "checkpoint; the rule before: blockwise for block-causal packs, varlen on CUDA, sdpa)")

    def check(self, job) -> None:
        check_bucket_patches(job)
        try:
            width = text_feature_width(job.text_encoder)
        except ConfigError:
            return  # the text encoder's own check reports an unusable path
        want = self.transformer_config_overrides.text_embed_dim
        require(width == want, "transformer_config_overrides.text_embed_dim",
                f"is {want}, but the text encoder `{job.text_encoder.text_encoder_path}` gives "
                f"{width}-wide features. Set text_embed_dim: {width}, or use the encoder the model "
                "was built for.")


def check_bucket_patches(job) -> None:
    """Every resolution bucket must cut into whole patches: the VAE divides H and W by its spatial
    factor, then patch_size groups the latent into cells, so a bucket side must be a multiple of the
    two together. (Raised when the config loads, so `pan check` and train.py refuse it alike.)"""
    try:
        factor = vae_geometry(job.vae).spatial_factor
    except ConfigError:
        return  # the VAE's own check reports it
    _, ph, pw = patch = job.model.transformer_config_overrides.patch_size
    unit_h, unit_w = factor * ph, factor * pw
    bad = []
    for text in job.data.resolution_buckets:
        try:
            height, width = parse_bucket(text)
        except ValueError:
            continue  # the data config's own check reports it
        if height % unit_h or width % unit_w:
            near = sorted({(max(unit_w, round_to(width, unit_w, up)), max(unit_h, round_to(height, unit_h, up)))
                           for up in (False, True)})
            bad.append(f"{text} (nearest valid: {' or '.join(f'{w}x{h}' for w, h in near)})")
    require(not bad, "resolution_buckets",
            f"{', '.join(bad)}: a bucket's width must be a multiple of {unit_w} and its height of "
            f"{unit_h} pixels (WIDTHxHEIGHT), since the VAE ({job.vae.vae_type}) divides them by "
            f"{factor} and patch_size {list(patch)} cuts the latent into {ph}x{pw} cells. Use the "
            "nearest valid buckets, or another patch_size.")


def round_to(value: int, unit: int, up: bool) -> int:
    return -(-value // unit) * unit if up else value // unit * unit


@dataclass(kw_only=True)
class TaskConfig:
    SECTION: ClassVar[str] = "tasks"

    conditioning_schema: Literal["latent_concat_mask", "none"] = knob(
        "latent_concat_mask", "input layout: latent_concat_mask = [noisy latents ; condition latents ; "
                              "1 mask channel] (in_channels = 2 x out_channels + 1); none = noisy "
                              "latents only (text-to-video only)")
    image_cond_prob: float = knob(
        0.0, "probability that a video's first latent frame is given as condition (image-to-video); "
             "given frames are left out of the loss", ge=0.0, le=1.0)
    video_cond_prob: float = knob(
        0.0, "probability that the first k latent frames (k uniform in 1..T-1) are given as condition "
             "(video continuation)", ge=0.0, le=1.0)
    cfg_drop_prob: float = knob(
        0.1, "probability that a caption is replaced by the embedding of the empty caption, for "
             "classifier-free guidance", ge=0.0, le=1.0)

    def check(self, job) -> None:
        arch = job.model.transformer_config_overrides
        require(self.image_cond_prob + self.video_cond_prob <= 1.0, "video_cond_prob",
                f"image_cond_prob + video_cond_prob = {self.image_cond_prob + self.video_cond_prob} "
                "exceeds 1: they are the probabilities of exclusive tasks.")
        if self.conditioning_schema == "latent_concat_mask":
            want = 2 * arch.out_channels + 1
            require(arch.in_channels == want, "transformer_config_overrides.in_channels",
                    f"is {arch.in_channels}, but conditioning_schema latent_concat_mask feeds "
                    f"{arch.out_channels} noisy + {arch.out_channels} condition latent channels + 1 "
                    f"mask channel = {want}. Set in_channels: {want}, or conditioning_schema: none.")
        else:
            require(arch.in_channels == arch.out_channels, "transformer_config_overrides.in_channels",
                    f"is {arch.in_channels}, but conditioning_schema none feeds only the noisy latents "
                    f"({arch.out_channels} channels). Set in_channels: {arch.out_channels}.")
            require(self.image_cond_prob == 0 and self.video_cond_prob == 0, "conditioning_schema",
                    "is none, so there are no condition channels for image_cond_prob / "
                    "video_cond_prob: set both to 0 or use latent_concat_mask.")


@dataclass(kw_only=True)
class PanJobConfig(JobConfig):
    READS_PREDICTION_TYPE: ClassVar[bool] = True
    # Pan's production runs, which validated the eager mode with 1, make accumulation worth a warning.
    ACCUMULATION_WARNING: ClassVar[str | None] = "Pan's production runs validated the eager mode with 1"
    model: PanModelConfig = knob(PanModelConfig(), "")
    warm_start: WarmStartConfig = knob(WarmStartConfig(), "")
    text_encoder: TextEncoderConfig = knob(TextEncoderConfig(), "")
    vae: VAEConfig = knob(VAEConfig(), "")
    trainer: TrainerConfig = knob(TrainerConfig(), "")
    watchdog: WatchdogConfig = knob(WatchdogConfig(), "")
    optim: OptimConfig = knob(OptimConfig(), "")
    flow: FlowConfig = knob(FlowConfig(), "")
    data: DataConfig = knob(DataConfig(), "")
    tasks: TaskConfig = knob(TaskConfig(), "")
    parallel: ParallelConfig = knob(ParallelConfig(), "")
    process: ProcessConfig = knob(ProcessConfig(), "")
    checkpoint: CheckpointConfig = knob(CheckpointConfig(), "")
    logging: MetricsConfig = knob(MetricsConfig(), "")
    validation: ValidationConfig = knob(ValidationConfig(), "")
    lora: LoraConfig = knob(LoraConfig(), "")

    def attention_heads(self) -> int:
        return self.model.transformer_config_overrides.num_attention_heads

    def lora_candidates(self) -> list[str]:
        """The linears `lora_target_modules` may name (the transformer built on the meta device)."""
        with torch.device("meta"):
            return candidate_names(PanVideoDiffusionTransformer(self.model.transformer_config_overrides))

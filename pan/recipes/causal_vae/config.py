"""The causal_vae recipe's keys: its config sections, its job config, and the config-time rules
(frames and sizes against the VAE, the LPIPS file, a stage's output_dir, the warm-start checkpoint).

Light on purpose: loading a config imports this module (through the recipe's `__init__`), not the
task, the data reader or the checks.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from pan.checkpoint import layout
from pan.checkpoint.manager import CheckpointConfig
from pan.config import JobConfig
from pan.config.core import ConfigError, ErrorCollector, knob, reject_unused, require
from pan.data.config import DataConfig
from pan.runtime.metrics import MetricsConfig
from pan.runtime.watchdog_config import WatchdogConfig
from pan.models.causal_vae_config import CONFIG_NAME, WEIGHTS_NAME, CausalVAEConfig
from pan.models.lpips import LPIPS, LPIPSFileError, check_keys, read_state_dict
from pan.models.vae_discriminator import DiscriminatorConfig
from pan.models.vae_loss import VAELossConfig
from pan.optim import prefixed_optim_config
from pan.parallel.dims import ParallelConfig
from pan.parallel.vae_context import context_frames_problem
from pan.trainer import TrainerConfig

VAE, DISCRIMINATOR = "vae", "discriminator"
VAE_CONFIG_FILE = "vae_config.json"   # the run's VAE architecture, written in output_dir at start


# ================================================================================================
# Keys
# ================================================================================================

_ARCH_KEYS = ("block_out_channels", "latent_channels", "norm_num_groups", "encoder_layers_per_block",
              "decoder_layers_per_block", "spatial_down_stages", "temporal_down_stages")


@dataclass(kw_only=True)
class CausalVAEModelConfig:
    SECTION: ClassVar[str] = "model"

    model_path: str | None = knob(
        None, "a released `causal_video_vae` folder (config.json + diffusion_pytorch_model.safetensors): "
              "the architecture and the weights training starts from; null = the architecture keys "
              "below, random init")
    block_out_channels: list[int] = knob([128, 256, 512, 512], "channels of the encoder's down blocks "
                                         "(and of the decoder's up blocks, from the output side)", ge=1)
    latent_channels: int = knob(16, "latent channels", ge=1)
    norm_num_groups: int = knob(32, "GroupNorm groups (divide every block's channels)", ge=1)
    encoder_layers_per_block: int = knob(2, "residual blocks per encoder down block", ge=1)
    decoder_layers_per_block: int = knob(3, "residual blocks per decoder up block", ge=1)
    spatial_down_stages: int = knob(3, "the first n blocks halve height and width (8x for 3)", ge=0)
    temporal_down_stages: int = knob(3, "the first n blocks halve time (clips of 1 + 2**n k frames)", ge=0)
    freeze_encoder: bool = knob(False, "train only the decoder (and logvar): the encoder and quant_conv "
                                       "keep their starting weights")
    warm_start_checkpoint: str | None = knob(
        None, "a checkpoint-N/ folder of a causal_vae run (stage 1) to start from: its `vae` weights, "
              "and its `discriminator` weights when it has them and this run trains one; optimizer "
              "state, schedules and step start fresh. Used only while output_dir has no checkpoint")

    def vae_config(self) -> CausalVAEConfig:
        """The architecture: the released folder's config.json, or the architecture keys."""
        if self.model_path is not None:
            return _released_config(Path(self.model_path))
        n = len(self.block_out_channels)
        flags = lambda stages: [i < stages for i in range(n)]  # noqa: E731
        return CausalVAEConfig(
            encoder_out_channels=self.latent_channels, decoder_in_channels=self.latent_channels,
            encoder_block_out_channels=list(self.block_out_channels),
            decoder_block_out_channels=list(self.block_out_channels),
            encoder_layers_per_block=[self.encoder_layers_per_block] * n,
            decoder_layers_per_block=[self.decoder_layers_per_block] * n,
            encoder_down_block_types=["DownEncoderBlockCausal3D"] * n,
            decoder_up_block_types=["UpDecoderBlockCausal3D"] * n,
            encoder_spatial_down_sample=flags(self.spatial_down_stages),
            encoder_temporal_down_sample=flags(self.temporal_down_stages),
            decoder_spatial_up_sample=flags(self.spatial_down_stages),
            decoder_temporal_up_sample=flags(self.temporal_down_stages),
            encoder_block_dropout=[0.0] * n, decoder_block_dropout=[0.0] * n,
            encoder_norm_num_groups=self.norm_num_groups, decoder_norm_num_groups=self.norm_num_groups,
            downsample_scale=2 ** self.spatial_down_stages)

    def check(self, job) -> None:
        if self.model_path is not None:
            for key in _ARCH_KEYS:
                reject_unused(self, job, key, False, "model_path sets the architecture")
        else:
            for key in ("spatial_down_stages", "temporal_down_stages"):
                require(getattr(self, key) <= len(self.block_out_channels), key,
                        f"is {getattr(self, key)}, but there are only {len(self.block_out_channels)} "
                        "blocks (block_out_channels) to down-sample in.")
        problems = ErrorCollector()  # the frame and size rules need the VAE's factors; the output_dir's do not
        with problems.gather():
            self.vae_config().check()
            check_clip_rules(job)
        with problems.gather():
            check_output_dir_stage(job)
        problems.raise_any()


@dataclass(kw_only=True)
class VAEObjectiveConfig:
    SECTION: ClassVar[str] = "loss"
    TRAINING_ONLY: ClassVar[bool] = True  # not checked where a trained model is only used (pan sample)

    lpips_ckpt: str | None = knob(
        None, "the VGG16 LPIPS state-dict file (Pyramid-Flow's vgg_lpips.pth: VGG16 trunk + linear "
              "layers + scaling) of the perceptual loss (needed when perceptual_weight > 0) and of the "
              "held-out LPIPS; a missing or misfit file is refused, naming the keys")
    add_discriminator: bool = knob(
        False, "train a discriminator (the `discriminator` part) and add the GAN terms from disc_start "
               "on; false: reconstruction, perceptual and KL terms only (stage 1)")

    def check(self, job) -> None:
        if job.loss.perceptual_weight > 0:
            require(self.lpips_ckpt is not None, "lpips_ckpt",
                    "is not set, but perceptual_weight > 0 needs the LPIPS network: set it to the "
                    "VGG16 LPIPS file (vgg_lpips.pth), or perceptual_weight: 0.")
        else:
            reject_unused(self, job, "lpips_ckpt", bool(job.validation.validation_interval),
                          "perceptual_weight is 0 and there is no validation (it serves the perceptual "
                          "loss and the held-out LPIPS)")
        if self.lpips_ckpt is not None:
            check_lpips_file(self.lpips_ckpt)
        if not self.add_discriminator:
            gan_keys = [f.name for f in dataclasses.fields(DiscriminatorConfig)] + \
                       [f.name for f in dataclasses.fields(job.disc_optim)] + ["disc_weight", "disc_start"]
            set_keys = sorted(k for k in gan_keys if k in job.explicit_keys)
            require(not set_keys, set_keys[0] if set_keys else "add_discriminator",
                    f"{set_keys} configure the discriminator, but add_discriminator is false, so they "
                    "would be ignored. Remove them, or set add_discriminator: true.")


@dataclass(kw_only=True)
class VAEContextConfig:
    SECTION: ClassVar[str] = "distributed"
    TRAINING_ONLY: ClassVar[bool] = True  # not checked where a trained model is only used (pan sample)

    context_size: int = knob(
        1, "VAE context parallel: ranks that split each clip's frames in time (each causal conv gets "
           "its halo of frames from the previous rank); divides the processes per node; clips of "
           "1 + 8k frames need k >= context_size (k % context_size == 0 balances the ranks)", ge=1)

    def check(self, job) -> None:
        if self.context_size == 1:
            return
        data = job.data
        require(data.image_sample_prob == 0, "context_size",
                f"is {self.context_size}, but image_sample_prob is {data.image_sample_prob}: an image is "
                "one frame and cannot be split over a context group. Train images without context "
                "parallel (stage 1), or set image_sample_prob: 0.")
        require(not (job.objective.add_discriminator and job.discriminator.disc_type == "3d"),
                "disc_type", "3d scores whole clips, but context_size > 1 gives each rank only its own "
                "frames: use disc_type: 2d (the original's) with context parallel.")
        require(not job.parallel.enable_gradient_checkpointing, "enable_gradient_checkpointing",
                "recomputing a block would exchange its frame halos a second time: turn it off with "
                "context_size > 1.")


@dataclass(kw_only=True)
class VAEValidationConfig:
    SECTION: ClassVar[str] = "output"
    TRAINING_ONLY: ClassVar[bool] = True  # not checked where a trained model is only used (pan sample)

    validation_interval: int = knob(0, "every this many steps, reconstruct the held-out clips and log "
                                       "PSNR, SSIM and LPIPS (0: never)", ge=0)
    validation_csv: str | None = knob(None, "held-out clips (a video CSV); their reconstructions are "
                                            "saved beside the checkpoints (output_dir/reconstructions)")
    validation_clips: int = knob(4, "how many held-out clips (the CSV's first rows that decode)", ge=1)
    validation_frames: int | None = knob(None, "frames of each held-out clip from its start (1 + 8k); "
                                               "null = max_frames", ge=1)

    def check(self, job) -> None:
        require(bool(self.validation_interval) == (self.validation_csv is not None), "validation_csv",
                "and validation_interval go together: set both (held-out clips and how often), or "
                "neither.")
        if self.validation_csv is not None:
            require(Path(self.validation_csv).is_file(), "validation_csv",
                    f"{self.validation_csv} does not exist.")


VAEOptimConfig = prefixed_optim_config(
    "", "training", "the VAE's optimizer keys (AdamW)", learning_rate=1e-4, weight_decay=1e-3,
    adam_beta2=0.95, use_muon=False, max_grad_norm=1.0)
DiscOptimConfig = prefixed_optim_config(
    "disc_", "discriminator", "the discriminator's optimizer keys (AdamW)", learning_rate=1e-4,
    weight_decay=1e-3, adam_beta2=0.95, use_muon=False, max_grad_norm=1.0)


@dataclass(kw_only=True)
class CausalVAEJobConfig(JobConfig):
    model: CausalVAEModelConfig = knob(CausalVAEModelConfig(), "")
    loss: VAELossConfig = knob(VAELossConfig(), "")
    objective: VAEObjectiveConfig = knob(VAEObjectiveConfig(), "")
    discriminator: DiscriminatorConfig = knob(DiscriminatorConfig(), "")
    trainer: TrainerConfig = knob(TrainerConfig(), "")
    watchdog: WatchdogConfig = knob(WatchdogConfig(), "")
    optim: VAEOptimConfig = knob(VAEOptimConfig(), "")
    disc_optim: DiscOptimConfig = knob(DiscOptimConfig(), "")
    data: DataConfig = knob(DataConfig(), "")
    context: VAEContextConfig = knob(VAEContextConfig(), "")
    parallel: ParallelConfig = knob(ParallelConfig(), "")
    checkpoint: CheckpointConfig = knob(CheckpointConfig(), "")
    logging: MetricsConfig = knob(MetricsConfig(), "")
    validation: VAEValidationConfig = knob(VAEValidationConfig(), "")

    def vae_config(self) -> CausalVAEConfig:
        return self.model.vae_config()


def check_clip_rules(job) -> None:
    """Frame and size rules the VAE and the discriminator impose on the data keys."""
    data, vae = job.data, job.vae_config()
    f = vae.temporal_factor
    size = job.context.context_size
    problem = context_frames_problem(data.max_frames, f, size)
    if problem is not None:
        k = max(size, (data.max_frames - 1) // f)
        fits = [1 + f * k] + ([1 + f * (k + 1)] if 1 + f * k < data.max_frames else [])
        raise ConfigError("max_frames", f"is {data.max_frames}: {problem}. Each video sample is a window of "
                          f"max_frames frames (the original's --max_frames): 1 + {f}k frames.",
                          fix=f"set max_frames to 1 + {f}k frames with k >= {size} (the context group's ranks): "
                              f"{' or '.join(map(str, fits))}.")
    for key in ("min_frames", "frames_mod", "frames_remainder"):
        require(key not in job.explicit_keys, key,
                "has no effect in the causal_vae recipe: every video sample is a window of exactly "
                "max_frames frames (shorter clips are skipped as too_short). Remove it.")
    for height, width in data.buckets():
        require(height % vae.spatial_factor == 0 and width % vae.spatial_factor == 0, "resolution_buckets",
                f"{width}x{height} is not a multiple of the VAE's spatial compression {vae.spatial_factor}.")
        if job.objective.add_discriminator:
            least = 3 * 2 ** job.discriminator.disc_num_layers
            require(min(height, width) >= least, "resolution_buckets",
                    f"{width}x{height} is smaller than the {job.discriminator.disc_num_layers}-layer "
                    f"discriminator's minimum of {least} px per side: use larger buckets or fewer "
                    "disc_num_layers.")
    if job.objective.add_discriminator and job.discriminator.disc_type == "3d":
        require(data.image_sample_prob == 0, "disc_type", "3d scores clips of >= 2 (disc_num_layers + 2) "
                "frames and cannot score images: set image_sample_prob: 0 or disc_type: 2d.")
        least = 2 * (job.discriminator.disc_num_layers + 2)
        require(data.max_frames >= least, "max_frames", f"is {data.max_frames}, fewer than the "
                f"{least} frames the 3-D discriminator needs.")
    for label, cfg in (("use_muon", job.optim), ("disc_use_muon", job.disc_optim)):
        require(not cfg.optim().use_muon or (label == "disc_use_muon" and not job.objective.add_discriminator),
                label, "is true, but the causal VAE and its discriminator are convolutions: Muon has no "
                "hidden matrices to orthogonalise here. Set it to false (AdamW).")


# ================================================================================================
# Files: the released folder, LPIPS, stage checks
# ================================================================================================

def _released_config(folder: Path) -> CausalVAEConfig:
    config_path = folder / CONFIG_NAME
    if not (config_path.is_file() and (folder / WEIGHTS_NAME).is_file()):
        raise ConfigError("model_path", f"{folder} is not a released causal_video_vae folder: it needs "
                          f"{CONFIG_NAME} and {WEIGHTS_NAME}.",
                          fix=f"point model_path at the released folder ({CONFIG_NAME} and {WEIGHTS_NAME} "
                              "together), or leave it unset to build the VAE from the architecture keys "
                              "(block_out_channels, latent_channels, ...).")
    try:
        config, _ = CausalVAEConfig.from_json_dict(json.loads(config_path.read_text()), str(config_path))
    except ConfigError as e:
        raise ConfigError("model_path", f"{config_path}: {e}") from None
    return config


def check_lpips_file(path: str) -> None:
    """Refuse a missing, unreadable or misfit LPIPS file (ConfigError on `lpips_ckpt` naming the keys
    that do not fit), reading only the tensors' headers."""
    p = Path(path)
    try:
        state = read_state_dict(p, setting="lpips_ckpt", mmap=True)
        with torch.device("meta"):
            model = LPIPS()
        check_keys(model, state, p)
    except LPIPSFileError as e:
        raise ConfigError("lpips_ckpt", str(e)) from None


def _started_from(checkpoint: Path) -> str | None:
    """How the run that wrote `checkpoint` started: the warm-start checkpoint it recorded (None: it
    started from model_path or random init); raises when the checkpoint has no such record."""
    state = torch.load(checkpoint / layout.TRAINING_STATE, map_location="cpu", weights_only=True)
    return state["rng"][0]["task"]["warm_start"]


def _resolved(path: str | None) -> str | None:
    return None if path is None else str(Path(path).resolve())


def check_output_dir_stage(job) -> None:
    """A run resumes the latest checkpoint of its output_dir. Refuse one whose checkpoints were
    written by a run that started otherwise (stage 1 in the output_dir of a stage 2): it would
    silently continue that run instead of starting this one."""
    out = Path(job.checkpoint.output_dir)
    complete = layout.complete_checkpoints(out)
    if not complete:
        return
    mine = _resolved(job.model.warm_start_checkpoint)
    try:
        theirs = _resolved(_started_from(complete[-1]))
    except Exception:  # not a causal_vae checkpoint (or unreadable): the trainer says what it is
        return
    if theirs == mine:
        return
    started = f"warm-started from {theirs}" if theirs else "started from model_path / random init (stage 1)"
    this = f"warm-starts from {mine}" if mine else "starts from model_path / random init"
    raise ConfigError(
        "output_dir", f"{out} holds {complete[-1].name} of a run that {started}; this run {this}. A run "
        "resumes the latest checkpoint of its output_dir, so it would continue that run instead of "
        f"starting its own. Give this run a new output_dir (e.g. {out / 'stage2'}), or the same "
        "warm_start_checkpoint as the run there to continue it.")


def resolve_warm_start(path: str) -> Path:
    """The checkpoint-N/ folder of a warm start (ConfigError when it cannot be used)."""
    p = Path(path)
    problem = layout.verify_checkpoint(p)
    require(problem is None, "warm_start_checkpoint", f"{p} is not a readable checkpoint ({problem}): "
            "point it at a checkpoint-N/ folder of the stage-1 run (`pan inspect <output_dir>`), or print both "
            "stages chained with `pan launch-command --stage both`.")
    parts = layout.saved_parts(p)
    require(VAE in parts, "warm_start_checkpoint", f"{p} holds the parts {parts}, no `{VAE}`: it was "
            "not written by the causal_vae recipe.")
    return p

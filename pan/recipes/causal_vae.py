"""The causal video VAE recipe: Pyramid-Flow's two-stage VAE training on pan's trainer.

Two trained parts: `vae` (the causal video VAE with the loss's learnable log-variance, which the
original never optimises) and, when `add_discriminator` is on, `discriminator` (a PatchGAN with its
own `disc_*` optimizer keys, LR schedule and checkpoint state). One step:

    VAE:            loss = mean over samples of [ nll + kl_weight * kl + d_weight * g ]
                    nll = per-frame (pixel_weight * pixel + perceptual_weight * LPIPS) / exp(logvar)
                          + logvar, averaged over the sample's frames; kl summed over the sample's
                          latent voxels, averaged over channels; g = -mean D(x_hat) once
                          step >= disc_start, d_weight = the adaptive weight at the decoder's last
                          layer (from the gradients of the whole micro-batch, summed over all ranks)
    discriminator:  hinge loss on x and the detached x_hat (only once step >= disc_start: before,
                    its optimizer is not stepped at all, so weight decay cannot move it; its LR
                    schedule counts the run's steps, as the original's does)

A batch mixes images (1-frame clips) and videos per sample (the original mixes per rank), each
video a random window of `max_frames` frames after `target_fps` resampling, resized and cropped to
a `resolution_buckets` size. With `context_size` > 1 each clip's frames are split in time over a
context group (pan/parallel/vae_context.py): each rank decodes only its own frames and runs the
VAE on them; losses and gradients equal the single-rank result.

Stage 2 warm-starts from a stage-1 checkpoint (`warm_start_checkpoint`), and a stage-2 config whose
`output_dir` holds another run's checkpoints is refused (the original's shared output folder makes
stage 2 resume stage 1 and stop at once). Keys, stages and the original's flags: docs/causal_vae.md.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from pan.checkpoint import dcp as layout
from pan.checkpoint.manager import CheckpointConfig
from pan.config import JobConfig
from pan.config.core import ConfigError, knob, reject_unused, require
from pan.data.config import DataConfig
from pan.data.decode import (FrameRules, SkipSample, centre_crop, decode_image, frame_step, pick_bucket,
                             video_stream)
from pan.data.loader import Ref, SampleReader, Sample, number, rules_of, seed_draws, stable_int
from pan.data.sources import SourceError
from pan.launch_command import Workflow, register_workflow
from pan.metrics import MetricsConfig
from pan.models.causal_vae import (CONFIG_NAME, WEIGHTS_NAME, CausalVAEConfig, CausalVideoVAE,
                                   DiagonalGaussian, check_state_dict, renamed_legacy_attention_keys)
from pan.models.lpips import LPIPS, LPIPSFileError, check_keys
from pan.models.vae_discriminator import DiscriminatorConfig, NLayerDiscriminator
from pan.models.vae_loss import VAELossConfig, frames_of, frozen, pixel_loss_per_frame
from pan.optim import prefixed_optim_config
from pan.parallel.dims import ParallelConfig
from pan.parallel.vae_context import (ContextGroup, ContextWindows, attach_halo_hooks,
                                      context_frames_problem, frame_range, frame_split, latent_range)
from pan.recipes import Recipe
from pan.recipes.contract import PartSpec, StepContext, Task, global_sums
from pan.trainer import TrainerConfig

VAE, DISCRIMINATOR = "vae", "discriminator"
# The decoder's up blocks return a view (the first up-sampled frame dropped); nothing changes it in
# place, which is what FSDP2 warns about at every step.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPUpBlock\) returned a view tensor")
# Before disc_start the discriminator's schedule advances without an optimizer step, on purpose.
warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before `optimizer.step\(\)`")
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
        self.vae_config().check()
        check_clip_rules(job)
        check_output_dir_stage(job)


@dataclass(kw_only=True)
class VAEObjectiveConfig:
    SECTION: ClassVar[str] = "loss"

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
    problem = context_frames_problem(data.max_frames, f, job.context.context_size)
    require(problem is None, "max_frames", f"is {data.max_frames}: {problem}. Each video sample is a "
            f"window of max_frames frames (the original's --max_frames): 1 + {f}k frames.")
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
    require(config_path.is_file() and (folder / WEIGHTS_NAME).is_file(), "model_path",
            f"{folder} is not a released causal_video_vae folder: it needs {CONFIG_NAME} and "
            f"{WEIGHTS_NAME}.")
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
        if not p.is_file():
            raise LPIPSFileError(f"no LPIPS weights at {p}: point lpips_ckpt at the VGG16 LPIPS "
                                 "state-dict file (e.g. Pyramid-Flow's vgg_lpips.pth).")
        try:
            state = torch.load(p, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # truncated, corrupted, or not a torch file
            raise LPIPSFileError(f"cannot read the LPIPS weights {p} (truncated or not a torch.save "
                                 f"state dict): {type(e).__name__}: {e}") from None
        if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
            state = state["state_dict"]
        if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
            raise LPIPSFileError(f"{p} does not hold a state dict of tensors.")
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
            "point it at a checkpoint-N/ folder of the stage-1 run (`pan inspect <output_dir>`).")
    parts = layout.saved_parts(p)
    require(VAE in parts, "warm_start_checkpoint", f"{p} holds the parts {parts}, no `{VAE}`: it was "
            "not written by the causal_vae recipe.")
    return p


# ================================================================================================
# The trained parts
# ================================================================================================

class TrainedCausalVAE(CausalVideoVAE):
    """The `vae` part: the causal video VAE plus the loss's learnable log-variance `logvar`.

    `logvar` has shape [1] (FSDP2 shards no scalars); every other name is the released layout's,
    so a checkpoint's `vae/` is the released state dict plus `logvar`. Its forward computes the
    training objective of one micro-batch (`objective` given) or reconstructs clips (not given):
    everything runs inside the forward, so a sharded model has its weights gathered, and the
    adaptive GAN weight differentiates the gathered decoder output weight.
    """

    def __init__(self, config: CausalVAEConfig, *, logvar_init: float = 0.0, freeze_encoder: bool = False):
        super().__init__(config)
        self.logvar = nn.Parameter(torch.full((1,), float(logvar_init)))
        self.logvar_init = float(logvar_init)
        if freeze_encoder:
            self.encoder.requires_grad_(False)
            self.quant_conv.requires_grad_(False)
        self.frozen_encoder = freeze_encoder

    @torch.no_grad()
    def init_weights(self) -> None:
        """The original's random init, logvar at logvar_init (released or stage-1 weights come
        through the part's `pretrained` state dict instead)."""
        super().init_weights()
        if hasattr(self, "logvar"):  # (CausalVideoVAE.__init__ calls this before logvar exists)
            self.logvar.fill_(self.logvar_init)

    def fsdp_blocks(self) -> list[nn.Module]:
        """Down, mid and up blocks; the convs around them, the decoder's last layer among them (its
        weight is what the adaptive GAN weight differentiates), stay in the root unit."""
        return [*self.encoder.down_blocks, self.encoder.mid_block, self.decoder.mid_block,
                *self.decoder.up_blocks]

    def hidden_matrices(self) -> dict[str, tuple[int, ...]]:
        return {}  # convolutions: no Muon

    def encode_moments(self, x: Tensor, group: ContextGroup | None) -> Tensor:
        """[b, 3, t, H, W] (this rank's frames) -> moments [b, 2C, t', h, w]."""
        windows = None if group is None else ContextWindows(group, x.device)
        if self.frozen_encoder:
            with torch.no_grad():
                return self.quant_conv(self.encoder(x, windows))
        return self.quant_conv(self.encoder(x, windows))

    def decode_latent(self, z: Tensor, group: ContextGroup | None) -> Tensor:
        windows = None if group is None else ContextWindows(group, z.device)
        return self.decoder(self.post_quant_conv(z), windows)

    def forward(self, batch: ClipBatch, objective: Objective | None = None):
        if objective is None:
            return [self.decode_latent(DiagonalGaussian(self.encode_moments(x, None)).mode(), None)
                    for x in batch.stacked()]
        return objective.generator_loss(self, batch)


class TrainedDiscriminator(NLayerDiscriminator):
    """The `discriminator` part: the original's PatchGAN (keys `main.{i}.*`, as discriminator.pth)."""

    def fsdp_blocks(self) -> list[nn.Module]:
        return []

    def hidden_matrices(self) -> dict[str, tuple[int, ...]]:
        return {}


def _load_safetensors(path: Path) -> dict[str, Tensor]:
    from safetensors.torch import load_file
    return load_file(str(path))


def read_dcp_weights(dcp_dir: Path) -> dict[str, Tensor]:
    """Every tensor of a DCP folder, whole, on this process alone (no collective: each rank may
    call it or not)."""
    import torch.distributed.checkpoint as dcp
    state = {key: torch.empty(size, dtype=dtype) for key, (size, dtype) in layout.dcp_tensor_shapes(dcp_dir).items()}
    dcp.load(state, storage_reader=layout.DirectReader(str(dcp_dir)), no_dist=True)
    return state


def full_weights(module: nn.Module) -> dict[str, Tensor]:
    """The whole parameters of a (possibly sharded) module, detached (collective when sharded)."""
    from torch.distributed.tensor import DTensor
    from pan.parallel.names import unwrapped_name
    return {unwrapped_name(n): (p.full_tensor() if isinstance(p, DTensor) else p).detach()
            for n, p in module.named_parameters()}


# ================================================================================================
# The objective
# ================================================================================================

class ClipBatch:
    """One micro-batch as this rank sees it: each sample's own frames (all of them without context
    parallel), the posterior noise of its own latent frames, and its full frame count.

    A plain class, not a dataclass: FSDP rebuilds dataclasses and lists passed to a forward (to cast
    their tensors), and the objective writes into this object during the forward."""

    def __init__(self, clips: list[Tensor], noises: list[Tensor], full_frames: list[int],
                 sample_ids: list[str], count: float, frames: int):
        self.clips = clips                  # [3, t_own, H, W] in [-1, 1]
        self.noises = noises                # [C, t'_own, h, w]
        self.full_frames = full_frames      # T of each whole clip
        self.sample_ids = sample_ids
        self.count = count                  # samples this rank counts (0 on context ranks > 0)
        self.frames = frames                # frames this rank holds
        self.bad_samples = 0
        self.packing = 1.0
        self.outputs: list = []             # (x, x_hat detached, T) per shape group, for the discriminator

    def groups(self) -> list[list[int]]:
        """Sample indices grouped by shape (each group runs as one batch), in order of first use."""
        by_shape: dict[tuple, list[int]] = {}
        for i, clip in enumerate(self.clips):
            by_shape.setdefault((tuple(clip.shape), self.full_frames[i]), []).append(i)
        return list(by_shape.values())

    def stacked(self) -> list[Tensor]:
        return [torch.stack([self.clips[i] for i in g]) for g in self.groups()]


class Objective:
    """What the VAE's loss needs besides the VAE: its keys, the frozen LPIPS, the discriminator's
    current weights (a plain copy: it scores the reconstructions without being trained by them), the
    context group. A plain class for the same reason as ClipBatch."""

    def __init__(self, cfg: VAELossConfig, lpips: LPIPS | None, discriminator: NLayerDiscriminator | None,
                 context: ContextGroup | None = None):
        self.cfg, self.lpips, self.context = cfg, lpips, context
        self.discriminator = discriminator   # None: no GAN term this step
        self.stats: list[dict] = []          # per micro-batch: this rank's summed metrics

    def generator_loss(self, vae: TrainedCausalVAE, batch: ClipBatch) -> Tensor:
        """Sum over this rank's samples of the per-sample loss (its share of each under context
        parallel); the trainer divides by the global sample count."""
        cfg = self.cfg
        logvar = vae.logvar.sum()   # [1] -> scalar
        sums = dict.fromkeys(("nll", "kl", "rec", "perceptual", "gan"), 0.0)
        nll_sum = kl_sum = g_sum = None
        batch.outputs = []
        for group, x in zip(batch.groups(), batch.stacked()):
            noise = torch.stack([batch.noises[i] for i in group]).to(x)
            total_frames = batch.full_frames[group[0]]
            posterior = DiagonalGaussian(vae.encode_moments(x, self.context))
            x_hat = vae.decode_latent(posterior.sample(noise=noise), self.context)
            terms = self.sample_terms(x, _at_least_fp32(x_hat), posterior, logvar, total_frames)
            batch.outputs.append((x, x_hat.detach(), total_frames))
            nll_sum = _add(nll_sum, terms["nll"].sum())
            kl_sum = _add(kl_sum, terms["kl"].sum())
            if "gan" in terms:
                g_sum = _add(g_sum, terms["gan"].sum())
            for key in sums:
                if key in terms:
                    sums[key] += float(terms[key].detach().sum())
        loss = nll_sum + cfg.kl_weight * kl_sum
        d_weight = 0.0
        if g_sum is not None:
            d_weight = self.adaptive_weight(nll_sum, g_sum, vae.last_layer, batch.count)
            loss = loss + d_weight * g_sum
        sums.update(weight=d_weight * batch.count, logvar=float(logvar.detach()) * batch.count,
                    factor=float(g_sum is not None) * batch.count)
        self.stats.append(sums)
        return loss

    def sample_terms(self, x: Tensor, x_hat: Tensor, posterior: DiagonalGaussian, logvar: Tensor,
                     total_frames: int) -> dict[str, Tensor]:
        """Per-sample terms [b] of a group of same-shape clips (this rank's frames of them)."""
        cfg = self.cfg
        b = x.shape[0]
        frames, frames_hat = frames_of(_at_least_fp32(x)), frames_of(x_hat)      # [b t, 3, H, W]
        rec = pixel_loss_per_frame(frames, frames_hat, cfg.pixel_loss).view(b, -1)  # [b, t]
        weighted = cfg.pixelloss_weight * rec
        out = {"rec": rec.sum(1) / total_frames}
        if cfg.perceptual_weight > 0:
            perceptual = self.lpips(frames, frames_hat).view(b, -1)
            weighted = weighted + cfg.perceptual_weight * perceptual
            out["perceptual"] = perceptual.sum(1) / total_frames
        nll = weighted / torch.exp(logvar) + logvar                              # [b, t]
        out["nll"] = nll.sum(1) / total_frames
        out["kl"] = posterior.kl().mean(dim=1)                                   # [b]
        if self.discriminator is not None:
            with frozen(self.discriminator):
                out["gan"] = -self.logit_means(self.discriminator, x_hat, total_frames)
        return out

    @staticmethod
    def logit_means(disc: nn.Module, clips: Tensor, total_frames: int) -> Tensor:
        """Per-sample mean of the discriminator's logits [b]: over frames (2-D, this rank's share of
        the clip's frames) or over the clip (3-D)."""
        b = clips.shape[0]
        if getattr(disc, "dims", 2) == 3:
            return disc(clips).flatten(1).mean(1)
        logits = disc(frames_of(clips))                                          # [b t, 1, h, w]
        return logits.flatten(1).mean(1).view(b, -1).sum(1) / total_frames

    def adaptive_weight(self, nll_sum: Tensor, g_sum: Tensor, last_layer: Tensor, count: float) -> float:
        """clamp(|d nll/dW| / (|d g/dW| + 1e-4), 0, 1e4) * disc_weight for the micro-batch's mean nll
        and g over every rank's samples (gradients summed over all ranks), W the decoder's last
        layer. Without a graph (evaluation) it is 0, as in the original."""
        if not torch.is_grad_enabled() or not g_sum.requires_grad:
            return 0.0
        nll_grad = torch.autograd.grad(nll_sum, last_layer, retain_graph=True)[0]
        g_grad = torch.autograd.grad(g_sum, last_layer, retain_graph=True)[0]
        packed = torch.cat([nll_grad.flatten().float(), g_grad.flatten().float(),
                            nll_grad.new_tensor([count], dtype=torch.float32)])
        if dist.is_initialized():
            dist.all_reduce(packed)
        n = nll_grad.numel()
        total = packed[-1]
        weight = packed[:n].norm() / total / (packed[n:2 * n].norm() / total + 1e-4)
        return float(torch.clamp(weight, 0.0, 1e4)) * self.cfg.disc_weight

    def discriminator_loss(self, disc: nn.Module, batch: ClipBatch) -> Tensor:
        """Sum over this rank's samples of the hinge loss on x and the detached x_hat."""
        total, real_sum, fake_sum = None, 0.0, 0.0
        for x, x_hat, total_frames in batch.outputs:
            real = self.logit_hinge(disc, _at_least_fp32(x), total_frames, real=True)
            fake = self.logit_hinge(disc, _at_least_fp32(x_hat), total_frames, real=False)
            total = _add(total, 0.5 * (real[0] + fake[0]).sum())
            real_sum += float(real[1].sum())
            fake_sum += float(fake[1].sum())
        self.stats.append({"disc_real": real_sum, "disc_fake": fake_sum})
        return total

    @staticmethod
    def logit_hinge(disc: nn.Module, clips: Tensor, total_frames: int, real: bool) -> tuple[Tensor, Tensor]:
        """(per-sample mean hinge term, per-sample mean logit), both [b]."""
        b = clips.shape[0]
        if getattr(disc, "dims", 2) == 3:
            logits = disc(clips).flatten(1)
            per = lambda v: v.mean(1)  # noqa: E731
        else:
            logits = disc(frames_of(clips)).flatten(1)                           # [b t, n]
            per = lambda v: v.mean(1).view(b, -1).sum(1) / total_frames  # noqa: E731
        hinge = F.relu(1.0 - logits) if real else F.relu(1.0 + logits)
        return per(hinge), per(logits.detach())


def _at_least_fp32(x: Tensor) -> Tensor:
    """Loss terms in fp32 (bf16 activations are cast up; float64 tests stay float64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _add(total: Tensor | None, value: Tensor) -> Tensor:
    return value if total is None else total + value


# ================================================================================================
# Data: random windows of real clips, each rank its own frames
# ================================================================================================

@dataclass(frozen=True)
class FrameShare:
    """Which frames of a clip of `total` frames this process keeps: [first, first + count)."""
    total: int
    first: int
    count: int


def decode_window(path: str, rules: FrameRules, share: FrameShare, pick: Callable[[int], int],
                  start: float = 0.0, end: float | None = None) -> tuple[Tensor, float]:
    """A window of `share.total` frames (after target_fps resampling) of the video's [start, end)
    seconds, at an offset `pick(latest possible offset in source frames)`; only the frames
    [share.first, share.first + share.count) of the window are converted (resized and cropped).
    Returns (uint8 frames [count, 3, H, W], output fps)."""
    import av
    import numpy as np

    with av.open(path) as container:
        stream, rate = video_stream(container)
        src_fps = float(rate)
        step = frame_step(src_fps, rules)
        bucket, h, w, scale = pick_bucket(stream.codec_context.height, stream.codec_context.width, rules)
        t0 = float(stream.start_time * stream.time_base) if stream.start_time is not None else 0.0
        duration = (float(stream.duration * stream.time_base) if stream.duration
                    else (container.duration or 0) / 1e6)
        total = stream.frames or round(duration * src_fps)
        first_src = round(start * src_fps)
        last_src = min(total, round(end * src_fps)) if end is not None else total
        span = round((share.total - 1) * step) + 1                 # source frames the window covers
        if last_src - first_src < span:
            raise SkipSample("too_short", f"{last_src - first_src} source frames, a window of {share.total} "
                                          f"frames at {src_fps / step:.3g} fps needs {span}")
        offset = first_src + pick(last_src - first_src - span)
        wanted = [offset + round((share.first + k) * step) for k in range(share.count)]
        if wanted[0] > 0:
            container.seek(int((t0 + wanted[0] / src_fps) / stream.time_base), stream=stream, backward=True)
        todo, kept = set(wanted), {}
        interpolation = "AREA" if scale < 1 else "BICUBIC"
        for frame in container.decode(stream):
            index = round(((frame.time or 0.0) - t0) * src_fps)
            if index in todo and index not in kept:
                rgb = frame.to_ndarray(format="rgb24", width=w, height=h, interpolation=interpolation)
                kept[index] = centre_crop(rgb, bucket)
            if index >= wanted[-1]:
                break
    if len(kept) < len(todo):
        raise SkipSample("too_short", f"decoded {len(kept)} of the window's {len(todo)} frames (the clip "
                                      "ends before its metadata says)")
    frames = np.stack([kept[i] for i in wanted])
    return torch.from_numpy(frames).permute(0, 3, 1, 2).contiguous(), src_fps / step


class ClipReader(SampleReader):
    """pan's sample reader with the VAE's sampling: each video a window of `max_frames` frames at a
    random offset (the same for every rank of a context group: drawn from the sample's reference),
    of which this process decodes only its own share; images are 1-frame clips. Sources: video CSVs
    (`path`), Pyramid-Flow annotation files (rows `{"video": path}` or `{"image": path}`; their
    `latent`, `text_fea` and `frames` are not used: the VAE reads pixels and picks its own windows)
    and image tars. Captions are not needed. The whole clip's shape is the sample's grid, so every
    rank of a group packs its batches alike."""

    def __init__(self, base: SampleReader, *, seed: int, temporal_factor: int, context_rank: int = 0,
                 context_size: int = 1, random_window: bool = True):
        super().__init__(base.sources, base.tars, base.rules, use_precomputed=False)
        self.seed, self.temporal_factor = seed, temporal_factor
        self.context_rank, self.context_size, self.random_window = context_rank, context_size, random_window
        self._window_rng = random.Random(0)

    def __getitem__(self, ref: Ref):
        self._window_rng = random.Random(stable_int(self.seed, "window", ref.stream, ref.epoch, ref.index))
        return super().__getitem__(ref)

    def share(self) -> FrameShare:
        total = self.rules.max_frames
        start, stop = frame_range(total, self.temporal_factor, self.context_size, self.context_rank)
        return FrameShare(total, start, stop - start)

    def video(self, sample_id: str, path: Path, start: float = 0.0, end: float | None = None) -> Sample:
        """The sample of a video file: this rank's frames of a (random) window of max_frames frames."""
        if not path.is_file():
            raise SkipSample("missing_file", str(path))
        pick = (lambda latest: self._window_rng.randint(0, latest)) if self.random_window else (lambda _: 0)
        frames, fps = decode_window(str(path), self.rules, self.share(), pick, start, end)
        grid = (self.rules.max_frames, frames.shape[2], frames.shape[3])
        return Sample(sample_id, "video", "", grid, 0, frames=frames, fps=fps)

    def image(self, sample_id: str, data: bytes) -> Sample:
        frames = decode_image(data, self.rules)
        return Sample(sample_id, "image", "", tuple(frames.shape[k] for k in (0, 2, 3)), 0, frames=frames)

    def _video_row(self, src, i: int) -> Sample:
        row = src.rows[i]
        path = src.field(row, "path")
        if path is None:
            raise SkipSample("missing_file", "the path cell is empty (a precomputed latent row? the VAE "
                                             "trains on pixels)")
        start = number(src, row, "start_time") or 0.0
        end = number(src, row, "end_time")
        self._precheck(src, row, start, end)
        return self.video(f"{src.name}:{i}", src.resolve(path), start, end)

    def _annotation_row(self, src, i: int) -> Sample:
        try:
            row = json.loads(src.rows[i])
        except ValueError as e:
            raise SkipSample("bad_row", f"not a JSON object: {e}") from None
        media = [k for k in ("video", "image") if isinstance(row, dict) and isinstance(row.get(k), str)]
        if len(media) != 1:
            raise SkipSample("bad_row", "a row for the VAE names a `video` or an `image` path (one of them)")
        path = src.resolve(row[media[0]].strip())
        if media[0] == "image":
            if not path.is_file():
                raise SkipSample("missing_file", str(path))
            return self.image(f"{src.name}:{i}", path.read_bytes())
        return self.video(f"{src.name}:{i}", path)

    def _image(self, i: int) -> Sample:
        image = self.tars.images[i]
        data, _ = self.tars.read(image)
        return self.image(self.tars.sample_id(image), data)


# ================================================================================================
# The task
# ================================================================================================

class CausalVAETask(Task):
    """The causal VAE recipe's side of the loop: parts, LPIPS, data, the two-part step, validation.

    Its data is one shard per context group and micro-batch (ShardedLoader; every rank of a group
    reads the group's shards), and each micro-batch's posterior noise is seeded by its shard and
    batch number: a run continues exactly on any layout with the same number of shards."""
    elastic_data = True

    def __init__(self, job: CausalVAEJobConfig, world, dims, cp=None):
        self.job, self.world, self.dims = job, world, dims
        self.vae_cfg = job.vae_config()
        size = job.context.context_size
        if world.size % size or world.local_size % size:
            raise ConfigError("context_size", f"({size}) must divide the world size ({world.size}) and the "
                                              f"processes per node ({world.local_size}): a context group is "
                                              "consecutive ranks of one node.")
        self.context_size = size
        self.context_rank = world.rank % size
        self.data_rank, self.data_size = world.rank // size, world.size // size
        self.reads_data = True              # every rank decodes its own frames of the group's clips
        self.dp_rank = world.rank           # (for the trainer: each rank's own record of what it saw)
        # Posterior noise: seeded for each micro-batch by its shard (the ranks of a context group draw alike).
        self.generator = torch.Generator().manual_seed(job.trainer.seed)
        self.group: ContextGroup | None = None
        self.lpips: LPIPS | None = None
        self.disc_copy: NLayerDiscriminator | None = None
        self._heldout: list | None = None
        self._flops: dict[tuple, float] = {}   # (frames, H, W) -> training FLOPs
        self.bad_samples = 0

    # -- parts ----------------------------------------------------------------------------------------
    def part_specs(self) -> list[PartSpec]:
        """`vae` (the main part), and `discriminator` when the GAN is on. A fresh run starts both from
        the stage-1 checkpoint (`warm_start_checkpoint`, through the trainer's warm start: a part
        that checkpoint lacks keeps its init), else the VAE from the released weights
        (model_path), else from random init."""
        released = self.released_weights if self.job.model.model_path and not self.warm_start_source() else None
        specs = [PartSpec(VAE, self.build_vae, self.job.optim, warm_start=True, pretrained=released)]
        if self.job.objective.add_discriminator:
            specs.append(PartSpec(DISCRIMINATOR, self.build_discriminator, self.job.disc_optim, warm_start=True))
        return specs

    def warm_start_source(self) -> str | None:
        path = self.job.model.warm_start_checkpoint
        return None if path is None else str(resolve_warm_start(path))

    def build_vae(self) -> TrainedCausalVAE:
        with torch.device("meta"):
            model = TrainedCausalVAE(self.vae_cfg, logvar_init=self.job.loss.logvar_init,
                                     freeze_encoder=self.job.model.freeze_encoder)
        if self.context_size > 1:
            attach_halo_hooks(model)
        return model

    def build_discriminator(self) -> TrainedDiscriminator:
        d = self.job.discriminator
        with torch.device("meta"):
            return TrainedDiscriminator(self.vae_cfg.decoder_out_channels, d.disc_channels, d.disc_num_layers,
                                        dims=2 if d.disc_type == "2d" else 3)

    def released_weights(self) -> dict[str, Tensor]:
        """The released folder's VAE weights, and logvar at logvar_init."""
        path = Path(self.job.model.model_path) / WEIGHTS_NAME
        state = renamed_legacy_attention_keys(_load_safetensors(path))
        with torch.device("meta"):
            check_state_dict(CausalVideoVAE(self.vae_cfg), state, str(path))
        state["logvar"] = torch.full((1,), float(self.job.loss.logvar_init))
        return state

    def load_encoders(self) -> None:
        """The frozen LPIPS, the context group, the discriminator's scoring copy; the run's VAE
        architecture is written to output_dir (a checkpoint-N/ of this run is then a frozen VAE
        for the DiT recipes: `vae_type: causal_video_vae`)."""
        device = self.world.device
        if self.job.objective.lpips_ckpt:
            self.lpips = LPIPS.from_file(self.job.objective.lpips_ckpt).to(device)
        self.group = ContextGroup.build(self.context_size)
        if self.job.objective.add_discriminator:
            d = self.job.discriminator
            self.disc_copy = NLayerDiscriminator(self.vae_cfg.decoder_out_channels, d.disc_channels,
                                                 d.disc_num_layers, dims=2 if d.disc_type == "2d" else 3)
            self.disc_copy.to(device).requires_grad_(False)
        if self.world.is_main:
            out = Path(self.job.checkpoint.output_dir) / VAE_CONFIG_FILE
            out.write_text(json.dumps(self.vae_cfg.to_json_dict(), indent=2, sort_keys=True) + "\n")

    # -- data -----------------------------------------------------------------------------------------
    def tokens_of(self, num_frames: int, height: int, width: int) -> int:
        """A sample's size for the packer: its pixels (frames x H x W of the whole clip)."""
        return num_frames * height * width

    def build_loader(self, dims):
        from pan.data.loader import build_sharded_loader
        from pan.data.sources import read_video_csv

        for path in self.job.data.video_csv_paths:
            src = read_video_csv(path)
            if "path" not in src.columns:
                raise SourceError(f"{path} holds precomputed latents (latent_path, no path column): the "
                                  "VAE trains on pixels; give it the CSV of the videos.")
        # Annotation rows that name a latent are decoded from their video (the reader uses no latents).
        loader = build_sharded_loader(self.job.data, tokens_of=self.tokens_of, dp_rank=self.data_rank,
                                      dp_size=self.data_size, seed=self.job.trainer.seed,
                                      accumulation=self.job.trainer.gradient_accumulation_steps,
                                      latent_tokens_of=self.tokens_of, writes_cursors=self.context_rank == 0)
        for shard in loader.loaders.values():
            shard.reader = ClipReader(shard.reader, seed=self.job.trainer.seed,
                                      temporal_factor=self.vae_cfg.temporal_factor,
                                      context_rank=self.context_rank, context_size=self.context_size)
        return loader

    def data_shards(self) -> int:
        return self.data_size * self.job.trainer.gradient_accumulation_steps

    def next_batch(self, loader) -> tuple[ClipBatch, float]:
        t0 = time.perf_counter()
        raw = next(loader)
        waited = time.perf_counter() - t0
        seed_draws(self.generator, None, self.job.trainer.seed, raw.shard, raw.number)
        self.bad_samples += sum(raw.skipped.values())
        batch = self.clip_batch(raw.samples)
        batch.bad_samples, batch.packing = self.bad_samples, raw.packing_efficiency
        self._check_group_agrees(batch)
        return batch, waited

    def clip_batch(self, samples: list[Sample], generator: torch.Generator | None = None) -> ClipBatch:
        """uint8 frames -> [-1, 1] clips on the device, with this rank's slice of the posterior noise
        (drawn from the task's stream unless `generator` is given)."""
        generator = generator or self.generator
        device, f = self.world.device, self.vae_cfg.temporal_factor
        clips, noises, totals = [], [], []
        for s in samples:
            total, height, width = s.grid
            clips.append(s.frames.to(device).float().div(127.5).sub(1.0).permute(1, 0, 2, 3))
            latent = (self.vae_cfg.latent_channels, (total - 1) // f + 1, height // self.vae_cfg.spatial_factor,
                      width // self.vae_cfg.spatial_factor)
            noise = torch.randn(latent, generator=generator)
            if total > 1 and self.context_size > 1:
                a, b = latent_range(total, f, self.context_size, self.context_rank)
                noise = noise[:, a:b]
            noises.append(noise.to(device))
            totals.append(total)
        count = float(len(samples)) if self.context_rank == 0 else 0.0
        return ClipBatch(clips, noises, totals, [s.sample_id for s in samples], count,
                         sum(c.shape[1] for c in clips))

    def _check_group_agrees(self, batch: ClipBatch) -> None:
        """Every rank of a context group must hold the same samples (each decodes its own frames;
        a clip that decodes on one rank and not on another would split the group)."""
        if self.group is None:
            return
        ids: list = [None] * self.context_size
        dist.all_gather_object(ids, batch.sample_ids, group=self.group.group)
        if any(other != ids[0] for other in ids):
            raise SourceError(f"the ranks of a context group read different samples ({ids}): a clip "
                              "decoded on some ranks and was skipped on others. Remove the damaged "
                              "clips named in the warnings above.")

    # -- one step -------------------------------------------------------------------------------------
    def gan_on(self, step: int) -> bool:
        return self.job.objective.add_discriminator and step >= self.job.loss.disc_start

    def train_step(self, ctx: StepContext, micro_batches: list[ClipBatch]) -> dict[str, float]:
        """The VAE's update, then (once step >= disc_start) the discriminator's on the same
        reconstructions. `ctx.step` counts the steps done before this one."""
        vae, disc = ctx.parts[VAE], ctx.parts.get(DISCRIMINATOR)
        gan = self.gan_on(ctx.step)
        if gan:
            self.disc_copy.load_state_dict(full_weights(disc.model))
        objective = Objective(self.job.loss, self.lpips, self.disc_copy if gan else None, self.group)
        count = lambda mb: mb.count  # noqa: E731
        loss = ctx.backward_mean(vae, micro_batches, lambda model, mb: model(mb, objective), count)
        out = {"loss": loss, "grad_norm": ctx.update(vae, loss)}
        out.update(self._summed(objective.stats, micro_batches, {
            "loss/nll": "nll", "loss/kl": "kl", "loss/rec": "rec", "loss/perceptual": "perceptual",
            "loss/gan": "gan", "loss/logvar": "logvar", "disc/weight": "weight", "disc/factor": "factor"}))
        if disc is not None:
            out.update(self.discriminator_step(ctx, disc, micro_batches, objective, gan))
        return out

    def discriminator_step(self, ctx: StepContext, disc, micro_batches, objective: Objective,
                           gan: bool) -> dict[str, float]:
        if not gan:
            # Not trained yet: no optimizer step (AdamW's weight decay alone would move it); its LR
            # schedule follows the run's steps.
            disc.scheduler.step()
            return {"loss/disc": 0.0}
        objective.stats = []
        d_loss = ctx.backward_mean(disc, micro_batches, lambda model, mb: objective.discriminator_loss(model, mb),
                                   lambda mb: mb.count)
        out = {"loss/disc": d_loss, "grad_norm/discriminator": ctx.update(disc, d_loss)}
        out.update(self._summed(objective.stats, micro_batches,
                                {"disc/logits_real": "disc_real", "disc/logits_fake": "disc_fake"}))
        return out

    @staticmethod
    def _summed(stats: list[dict], micro_batches, names: dict[str, str]) -> dict[str, float]:
        """Means over the step's samples of per-sample sums, summed over ranks."""
        keys = list(names.values())
        totals = global_sums([sum(s.get(k, 0.0) for s in stats) for k in keys]
                             + [sum(mb.count for mb in micro_batches)])
        n = max(totals[-1], 1.0)
        return {name: totals[keys.index(k)] / n for name, k in names.items()}

    def batch_stats(self, micro_batches: list[ClipBatch]) -> dict[str, float]:
        return {"samples": sum(mb.count for mb in micro_batches),
                "tokens": sum(mb.frames for mb in micro_batches),
                "flops": sum(self.flops(mb) for mb in micro_batches),
                "bad_samples": micro_batches[-1].bad_samples if self.context_rank == 0 else 0,
                "packing": sum(mb.packing for mb in micro_batches) / len(micro_batches)}

    def flops(self, batch: ClipBatch) -> float:
        """Training FLOPs of the VAE's encode + decode on this rank's frames (3x forward); LPIPS and
        the discriminator are not counted."""
        total = 0.0
        for clip in batch.clips:
            shape = tuple(clip.shape[1:])
            if shape not in self._flops:
                self._flops[shape] = 3 * vae_forward_flops(self.vae_cfg, *shape)
            total += self._flops[shape]
        return total

    # -- validation -----------------------------------------------------------------------------------
    def wants_validation(self, step: int) -> bool:
        interval = self.job.validation.validation_interval
        return bool(interval) and step % interval == 0

    def heldout_clips(self) -> list[Sample]:
        """The first validation_clips rows of validation_csv that decode: whole clips from their start."""
        if self._heldout is None:
            from pan.data.sources import read_video_csv
            v = self.job.validation
            rules = dataclasses.replace(rules_of(self.job.data), max_frames=v.validation_frames or self.job.data.max_frames)
            src = read_video_csv(v.validation_csv)
            reader = ClipReader(SampleReader({"video:heldout": src}, None, rules), seed=0,
                                temporal_factor=self.vae_cfg.temporal_factor, random_window=False)
            clips = []
            for i in range(len(src)):
                got = reader[Ref(0, "video:heldout", 0, 0, i)]
                if got.sample is not None:
                    clips.append(got.sample)
                if len(clips) == v.validation_clips:
                    break
            if not clips:
                raise SourceError(f"no clip of {v.validation_csv} decodes to {rules.max_frames} frames.")
            self._heldout = clips
        return self._heldout

    @torch.no_grad()
    def validate(self, parts, step: int, output_dir) -> dict[str, float]:
        """PSNR, SSIM and LPIPS of the held-out clips' reconstructions (posterior mean), and the
        reconstructions as video (input | reconstruction) in output_dir/reconstructions/step-N/."""
        from pan.media import to_uint8_frames, write_mp4

        clips = self.heldout_clips()
        model = parts[VAE].model
        scores = {"psnr": [], "ssim": [], "lpips": []}
        folder = Path(output_dir) / "reconstructions" / f"step-{step:08d}"
        for i, sample in enumerate(clips):
            batch = self.clip_batch([sample], torch.Generator())   # (the mean is reconstructed: no noise)
            x = batch.clips[0][None]                                               # [1, 3, T, H, W]
            with torch.autocast(self.world.device.type, dtype=torch.bfloat16,
                                enabled=self.job.trainer.dtype == "bf16"):
                x_hat = model(batch)[0].float().clamp(-1, 1)
            frames, frames_hat = frames_of(x), frames_of(x_hat)
            scores["psnr"].append(float(psnr(frames, frames_hat).mean()))
            scores["ssim"].append(float(ssim(frames, frames_hat).mean()))
            if self.lpips is not None:
                scores["lpips"].append(float(self.lpips(frames, frames_hat).mean()))
            if self.world.is_main:
                folder.mkdir(parents=True, exist_ok=True)
                side_by_side = torch.cat([frames, frames_hat], dim=3)              # [T, 3, H, 2W]
                write_mp4(folder / f"{i:02d}.mp4", to_uint8_frames(side_by_side), fps=sample.fps or 8.0)
        if self.world.is_main:
            (folder / "clips.txt").write_text("".join(f"{i:02d} {s.sample_id}\n" for i, s in enumerate(clips)))
        return {name: sum(v) / len(v) for name, v in scores.items() if v}

    # -- checkpoint -----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        warm = self.job.model.warm_start_checkpoint
        return {"bad_samples": self.bad_samples,   # (the noise is seeded per micro-batch)
                "warm_start": None if warm is None else str(Path(warm).resolve())}

    def load_state_dict(self, state: dict) -> None:
        self.bad_samples = state["bad_samples"]


# ================================================================================================
# Metrics and FLOPs
# ================================================================================================

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


def vae_forward_flops(cfg: CausalVAEConfig, frames: int, height: int, width: int) -> float:
    """FLOPs of one encode + decode of a [1, 3, frames, H, W] clip (counted on the meta device)."""
    from torch.utils.flop_counter import FlopCounterMode
    with torch.device("meta"):
        model = CausalVideoVAE(cfg)
        x = torch.empty(1, cfg.encoder_in_channels, frames, height, width)
    with FlopCounterMode(display=False) as counter:
        with torch.no_grad():
            model.decoder(model.post_quant_conv(model.quant_conv(model.encoder(x))[:, :cfg.latent_channels]))
    return float(counter.get_total_flops())


# ================================================================================================
# A checkpoint as a released folder
# ================================================================================================

def released_folder_of(checkpoint: str | Path, out: str | Path, *, ema: bool = False) -> Path:
    """Write a causal_vae checkpoint-N/ (its `vae` part, or EMA) as a released `causal_video_vae`
    folder (config.json + diffusion_pytorch_model.safetensors), without logvar."""
    checkpoint = Path(checkpoint)
    config = read_run_vae_config(checkpoint)
    weights = read_dcp_weights(checkpoint / (f"{VAE}_ema" if ema else VAE))
    weights.pop("logvar", None)
    with torch.device("meta"):
        model = CausalVideoVAE(config)
    check_state_dict(model, weights, str(checkpoint))
    model.load_state_dict(weights, assign=True)
    model.save_pretrained(out)
    return Path(out)


def read_run_vae_config(checkpoint: Path) -> CausalVAEConfig:
    """The VAE architecture of the run that wrote `checkpoint` (its output_dir/vae_config.json)."""
    path = checkpoint.parent / VAE_CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: {checkpoint} was not written by the causal_vae recipe "
                                "(which records its VAE architecture there).")
    config, _ = CausalVAEConfig.from_json_dict(json.loads(path.read_text()), str(path))
    return config


# ================================================================================================
# Registration: recipe, preflight checks, launch workflow
# ================================================================================================

RECIPE = Recipe(name="causal_vae", job_config=CausalVAEJobConfig, task=CausalVAETask,
                description="Pyramid-Flow's causal video VAE: reconstruction + LPIPS + KL, then a GAN, "
                            "with VAE context parallel")

register_workflow(Workflow(
    "causal-video-vae", "causal_vae", "config/causal_vae_stage1.yaml", "scripts/train_causal_video_vae.sh",
    "causal video VAE: stage 1 (images + 17-frame videos), stage 2 (33 frames, context 2, GAN)",
    stages={"1": "config/causal_vae_stage1.yaml", "2": "config/causal_vae_stage2.yaml"}))


# ---- pan check ---------------------------------------------------------------------------------

from pan.estimate import Phase, Probe, largest_batch, loader_bytes, register_probe  # noqa: E402
from pan.preflight import (Row, check_cpu, check_memory, check_output_dir, check_step_time,  # noqa: E402
                           register_check)

register_check("causal_vae")(check_output_dir)
register_check("causal_vae")(check_cpu)


@register_check("causal_vae")
def check_context(ctx) -> list[Row]:
    """GPUs against context_size: context groups are consecutive ranks of one node."""
    size, per_node = ctx.job.context.context_size, ctx.gpus_per_node
    if per_node % size:
        return [Row("context", "fail", f"context_size {size} does not divide the {per_node} processes per "
                    "node: a context group's halos travel in every causal conv, so it sits in one node.",
                    f"use a context_size that divides {per_node}, or {size}k GPUs per node.")]
    groups = ctx.world_size // size
    detail = (f"world {ctx.world_size} = {groups} context group(s) of {size}; each group reads its own "
              f"clips ({groups} data shares)")
    return [Row("context", "pass", detail + ("; every rank decodes only its own frames." if size > 1 else "."))]


@register_check("causal_vae")
def check_frames(ctx) -> list[Row]:
    """Frame counts and frame sizes against the VAE, the context split and the discriminator."""
    job = ctx.job
    cfg, data, size = job.vae_config(), job.data, job.context.context_size
    f = cfg.temporal_factor
    split = frame_split(data.max_frames, f, size)
    latent = (data.max_frames - 1) // f + 1
    detail = (f"windows of {data.max_frames} frames (1 + {f} x {(data.max_frames - 1) // f}) -> {latent} "
              f"latent frames at {', '.join(data.resolution_buckets)}")
    if size > 1:
        detail += f"; frames per rank of a context group: {split}"
        if (latent - 1) % size:
            return [Row("frames", "warn", detail + ": unbalanced, the first ranks carry one latent frame more.",
                        f"use 1 + {f}k x {size} frames (e.g. {1 + f * size * max(1, (latent - 1) // size)}) "
                        "to balance the ranks.")]
    return [Row("frames", "pass", detail + ".")]


@register_check("causal_vae")
def check_lpips(ctx) -> list[Row]:
    """The LPIPS file loads into the VGG16 LPIPS network (checked by the config loader too)."""
    path = ctx.job.objective.lpips_ckpt
    if ctx.job.loss.perceptual_weight == 0:
        return [Row("lpips", "pass", "perceptual_weight is 0: no LPIPS term.")]
    check_lpips_file(path)
    return [Row("lpips", "pass", f"{path}: every VGG16 LPIPS key and shape fits.")]


@register_check("causal_vae")
def check_gan(ctx) -> list[Row]:
    """Whether the GAN really trains: a discriminator, and a disc_start the run reaches."""
    job = ctx.job
    if not job.objective.add_discriminator:
        return [Row("gan", "warn", "add_discriminator is false: this run trains no discriminator and "
                    "adds no GAN term (right for stage 1; the original's stage-2 script forgets the flag "
                    "and silently trains without a GAN).", "set add_discriminator: true for stage 2.")]
    start, steps = job.loss.disc_start, job.trainer.max_steps
    if start >= steps:
        return [Row("gan", "warn", f"disc_start {start} >= max_steps {steps}: the GAN never switches on "
                    "(the original's script starts it at 250000 of 200000 steps).",
                    f"set disc_start below {steps}.")]
    return [Row("gan", "pass", f"{job.discriminator.disc_type} discriminator, GAN terms from step {start} "
                f"of {steps} (disc weight {job.loss.disc_weight}).")]


@register_check("causal_vae")
def check_warm_start(ctx) -> list[Row]:
    """The stage-1 checkpoint a stage-2 run starts from: readable, with VAE weights of this
    architecture (and a discriminator's, when there is one)."""
    source = ctx.job.model.warm_start_checkpoint
    if source is None:
        how = f"the released weights of {ctx.job.model.model_path}" if ctx.job.model.model_path else "random init"
        return [Row("warm start", "pass", f"none: the VAE starts from {how}.")]
    complete = layout.complete_checkpoints(Path(ctx.job.checkpoint.output_dir))
    if complete:
        return [Row("warm start", "pass", f"not used: output_dir has {complete[-1].name} of this run, "
                    "which the run resumes instead.")]
    path = resolve_warm_start(source)
    stored = {k: tuple(size) for k, (size, _) in layout.dcp_tensor_shapes(path / VAE).items()}
    model = ctx.model_shapes
    differ = [f"{n} {stored.get(n)} vs model {s}" for n, s in model.items() if stored.get(n) != s]
    if differ:
        return [Row("warm start", "fail", f"{path}/{VAE} holds another architecture: " + "; ".join(differ[:5]),
                    "use the stage-1 run's architecture keys (or model_path) in this config.")]
    disc = "and its discriminator" if (path / DISCRIMINATOR).is_dir() else "(it has no discriminator: " \
        "this run's starts from random init)"
    if not ctx.job.objective.add_discriminator:
        disc = "(this run trains no discriminator)"
    return [Row("warm start", "pass", f"{path}: the VAE's {len(model)} tensors fit {disc}.")]


@register_check("causal_vae")
def check_clips(ctx) -> list[Row]:
    """A few samples of every source (video CSVs, annotation files: rows with `video` or `image`,
    image tars) decoded as training reads them (random windows of max_frames frames, resized and
    cropped); images as 1-frame clips."""
    from pan.data.loader import IMAGE_STREAM, stream_name
    from pan.data.sources import read_annotations, read_image_tars, read_video_csv

    data, rows = ctx.job.data, []
    csvs, sources = {}, []
    readers = [(p, read_video_csv) for p in data.video_csv_paths] + [(p, read_annotations) for p in data.annotation_paths]
    for path, read in readers:
        try:
            src = read(path)
        except (SourceError, OSError, UnicodeDecodeError) as e:
            rows.append(Row("clips", "fail", f"{path}: {e}", "fix or remove the file."))
            continue
        if read is read_video_csv and "path" not in src.columns:
            rows.append(Row("clips", "fail", f"{path} holds precomputed latents (latent_path): the VAE "
                            "trains on pixels.", "give the CSV of the videos."))
            continue
        csvs[stream_name(src)] = src
        sources.append((path, stream_name(src), len(src)))
    tars = None
    if data.image_tar_paths:
        try:
            tars = read_image_tars(data.image_tar_paths)
            sources.append((", ".join(data.image_tar_paths), IMAGE_STREAM, len(tars)))
        except (SourceError, OSError) as e:
            rows.append(Row("clips", "fail", str(e), "fix or remove the tar(s)."))
    reader = ClipReader(SampleReader(csvs, tars, rules_of(data)), seed=ctx.job.trainer.seed,
                        temporal_factor=ctx.job.vae_config().temporal_factor)
    for label, stream, size in sources:
        n = min(ctx.sample_rows, size)
        picks = sorted({round(i * (size - 1) / max(n - 1, 1)) for i in range(n)})
        got = [reader[Ref(0, stream, 0, 0, i)] for i in picks]
        problems = [f"#{i} {g.reason}: {g.detail}" for i, g in zip(picks, got) if g.sample is None]
        good = len(picks) - len(problems)
        detail = f"{label}: {size} samples; decoded {good}/{len(picks)} of rows {picks}"
        if problems:
            detail += ". Skipped: " + "; ".join(problems)
        status = "fail" if good == 0 else ("warn" if problems else "pass")
        rows.append(Row("clips", status, detail + ".", "" if status == "pass" else
                        "fix the media or the frame rules named above (such samples are skipped)."))
    return rows


# ---- pan check: memory and step time (pan/estimate.py) ------------------------------------------

@register_probe("causal_vae")
def vae_probe(ctx) -> Probe:
    """The recipe's largest micro-batch: the data budget's fullest pack of its longest, largest clips,
    this rank's frames of them (context rank 0 holds the most); the VAE's phase (reconstruction,
    LPIPS, KL and, once the GAN is on, the generator term scored by the discriminator's copy), then
    the discriminator's phase on the same reconstructions."""
    import math

    job, task = ctx.job, ctx.task
    cfg, size, f = task.vae_cfg, task.context_size, task.vae_cfg.temporal_factor
    clips = largest_batch(job.data, task.tokens_of, images=bool(job.data.image_tar_paths))
    if not clips:
        raise ConfigError("max_tokens_per_batch", "no clip of the buckets and frame rules fits the "
                          "token budget.")
    own = [(frame_split(total, f, size)[0] if total > 1 and size > 1 else total, h, w) for total, h, w in clips]
    gan = job.objective.add_discriminator and job.loss.disc_start < job.trainer.max_steps
    helpers = {}
    if job.loss.perceptual_weight > 0:
        with torch.device("meta"):
            helpers["lpips"] = LPIPS()
    if gan:
        helpers["discriminator copy"] = task.build_discriminator().requires_grad_(False)
    made: dict[str, object] = {}

    def vae_loss(models):
        noises = [torch.empty(cfg.latent_channels, (t - 1) // f + 1, h // cfg.spatial_factor, w // cfg.spatial_factor)
                  for t, h, w in own]
        batch = ClipBatch([torch.empty(3, t, h, w) for t, h, w in own], noises, [total for total, _, _ in clips],
                          [f"clip{i}" for i in range(len(clips))], float(len(clips)), sum(t for t, _, _ in own))
        objective = Objective(job.loss, models.get("lpips"), models.get("discriminator copy"))
        made.update(batch=batch, objective=objective)
        return models[VAE](batch, objective)

    def discriminator_loss(models):
        return made["objective"].discriminator_loss(models[DISCRIMINATOR], made["batch"])

    phases = [Phase(VAE, vae_loss)] + ([Phase(DISCRIMINATOR, discriminator_loss)] if gan else [])
    # Both are loaded in fp32 on every rank.
    frozen = {name: sum(t.numel() * 4 for t in (*m.parameters(), *m.buffers())) for name, m in helpers.items()}
    shapes = ", ".join(f"{t}x{h}x{w}" for t, h, w in sorted(set(own), reverse=True))
    return Probe(phases, tokens=sum(math.prod(c) for c in own), samples=len(clips),
                 flops=sum(3 * vae_forward_flops(cfg, *c) for c in own), frozen=frozen,
                 loader=loader_bytes(job.data, clips), helpers=helpers,
                 describe=f"{len(clips)} clip(s) ({shapes} frames x H x W on this rank) = "
                          f"{sum(math.prod(c) for c in own)} pixels" + (", GAN on" if gan else ""))


register_check("causal_vae")(check_memory)
register_check("causal_vae")(check_step_time)


# ---- python -m pan.recipes.causal_vae export --------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m pan.recipes.causal_vae",
        description="Write a causal_vae checkpoint-N/ as a released causal_video_vae folder (config.json "
                    "+ diffusion_pytorch_model.safetensors), e.g. for the original's tools. pan's own "
                    "recipes read the checkpoint directly (vae_type: causal_video_vae).")
    parser.add_argument("command", choices=["export"])
    parser.add_argument("checkpoint", type=Path, help="a checkpoint-N/ folder of a causal_vae run")
    parser.add_argument("--out", type=Path, required=True, help="the folder to write")
    parser.add_argument("--ema", action="store_true", help="the EMA weights (the run kept an EMA)")
    args = parser.parse_args(argv)
    print(f"wrote {released_folder_of(args.checkpoint, args.out, ema=args.ema)}")
    return 0


if __name__ == "__main__":
    import sys
    sys.exit(main())

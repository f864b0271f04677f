"""Pyramid-Flow full-sequence training (`pyramid_flow`): spatial-pyramid flow matching of whole clips.

Each sample of a packed batch is trained at one pyramid stage (the stages follow `sample_ratios`
across the samples, 1:2:1 by default): its latent is normalised with the model's per-frame
statistics, taken down to the stage's resolution, noised on the stage's line
(`pan.diffusion.pyramid`), and enters the pack at that size (a 1/4-resolution stage costs 1/16 of the
tokens). The loss is the original's: the mean over samples of each sample's MSE, so every sample
weighs the same whatever its stage.

Models (`model_name`): the released Pyramid-Flow DiTs `pyramid_flux` (miniFLUX) and `pyramid_mmdit`
(SD3), loaded from `model_path`/`model_variant` as released and exported back to that layout; or
`pan` (PanVideoDiffusionTransformer from `transformer_config_overrides`): the method is not tied to
one architecture. Text: the released T5 + CLIP encoders (`pan.encoders.pyramid_text`) online, or the
precomputed `text_fea` files of Pyramid-Flow annotations (then the encoders are not loaded at all,
see `PyramidTask.load_encoders`). `PyramidTask` is what this recipe and the autoregressive one
(`pan.recipes.pyramid_flow_ar`) share on the loop.
"""

from __future__ import annotations

import abc
import dataclasses
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

import torch
from torch import Tensor, nn

from pan.checkpoint.manager import CheckpointConfig
from pan.config import JobConfig
from pan.config.core import ConfigError, knob, require
from pan.data.config import DataConfig
from pan.diffusion.flow import FlowConfig
from pan.diffusion.pyramid import (GeneratorDraws, PyramidConfig, PyramidSchedule, column_stages,
                                   denormalize_latent, latent_pyramid, noise_sample, normalize_latent)
from pan.encoders.pyramid_text import PyramidTextConfig, PyramidTextEncoder, TextFeatures
from pan.encoders.vae import VAEConfig
from pan.metrics import MetricsConfig
from pan.models.attention import ATTENTION_BACKENDS, set_attention_backend
from pan.models.packing import PackInfo, SampleLayout
from pan.models.pan_dit import PanDiTConfig
from pan.optim.config import OptimConfig
from pan.parallel.dims import ParallelConfig
from pan.recipes import Recipe
from pan.recipes.contract import PartSpec, Task
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
              "auto, sdpa, blockwise, flex, varlen (every one honours the block-causal rule or refuses)")
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
        folder = Path(self.model_path).expanduser() / self.model_variant
        require((folder / "config.json").is_file(), "model_variant",
                f"{folder} holds no config.json: model_variant names the DiT folder inside model_path "
                f"(diffusion_transformer_384p, ..._768p, ..._image).")
        dit_config(self)  # every key of the variant's config.json, or ConfigError naming it


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

    def check(self, job) -> None:
        require(len(self.sample_steps) == job.pyramid.stages, "sample_steps",
                f"needs one step count per pyramid stage ({job.pyramid.stages}), got {self.sample_steps}.")
        require(not self.validation_interval or self.validation_prompts, "validation_interval",
                "is set but there are no validation_prompts: give some, or set validation_interval: 0.")


@dataclass(kw_only=True)
class PyramidJobConfig(JobConfig):
    recipe: str = "pyramid_flow"
    model: PyramidModelConfig = knob(PyramidModelConfig(), "")
    text: PyramidTextConfig = knob(PyramidTextConfig(), "")
    vae: VAEConfig = knob(VAEConfig(), "")
    trainer: TrainerConfig = knob(TrainerConfig(), "")
    optim: OptimConfig = knob(OptimConfig(), "")
    pyramid: PyramidConfig = knob(PyramidConfig(), "")
    flow: FlowConfig = knob(FlowConfig(), "")
    data: DataConfig = knob(DataConfig(), "")
    tasks: PyramidTaskConfig = knob(PyramidTaskConfig(), "")
    parallel: ParallelConfig = knob(ParallelConfig(), "")
    checkpoint: CheckpointConfig = knob(CheckpointConfig(), "")
    logging: MetricsConfig = knob(MetricsConfig(), "")
    validation: PyramidValidationConfig = knob(PyramidValidationConfig(), "")

    def attention_heads(self) -> int:
        if self.model.model_name == "pan":
            return self.model.transformer_config_overrides.num_attention_heads
        return dit_config(self.model).num_attention_heads


# ------------------------------------------------------------------------------------------------
# The DiT: a released Pyramid-Flow model or pan's own
# ------------------------------------------------------------------------------------------------

def dit_class(model_name: str) -> type[nn.Module]:
    if model_name == "pyramid_mmdit":
        from pan.models.pyramid_mmdit import PyramidMMDiT
        return PyramidMMDiT
    from pan.models.pyramid_flux import PyramidFluxTransformer
    return PyramidFluxTransformer


def variant_folder(cfg: PyramidModelConfig) -> Path:
    return Path(cfg.model_path).expanduser() / cfg.model_variant


def dit_config(cfg: PyramidModelConfig):
    """The variant's config.json as the model's config (with the recipe's overrides applied)."""
    from pan.models.pyramid_io import load_config

    cls = dit_class(cfg.model_name)
    try:
        config = load_config(variant_folder(cfg), cls)
    except FileNotFoundError as e:
        raise ConfigError("model_variant", str(e)) from None
    except ConfigError as e:
        if "_class_name" not in str(e):
            raise
        other = "pyramid_mmdit" if cfg.model_name == "pyramid_flux" else "pyramid_flux"
        raise ConfigError("model_name", f"is {cfg.model_name} ({cls.RELEASED_CLASS_NAME}), but "
                          f"{variant_folder(cfg)} holds another architecture: set model_name: {other}, "
                          "or point model_path / model_variant at a folder of this one.") from None
    return dataclasses.replace(config, **cfg.switches())


class PanForPyramid(nn.Module):
    """PanVideoDiffusionTransformer with the interface of the released Pyramid-Flow DiTs: timesteps
    on the 0..1000 scale (pan's model takes sigma in [0, 1]); no pooled text (Pan has none)."""

    def __init__(self, config: PanDiTConfig, use_temporal_causal: bool, interp_condition_pos: bool):
        super().__init__()
        from pan.models.pan_dit import PanVideoDiffusionTransformer

        self.dit = PanVideoDiffusionTransformer(config, zero_init_modulation=True)
        self.patch = tuple(config.patch_size)
        self.use_temporal_causal, self.interp_condition_pos = use_temporal_causal, interp_condition_pos

    @property
    def num_attention_heads(self) -> int:
        return self.dit.config.num_attention_heads

    def patch_grid(self, latent_shape) -> tuple[int, int, int]:
        _, t, h, w = latent_shape
        return t // self.patch[0], h // self.patch[1], w // self.patch[2]

    def patchify(self, latent: Tensor) -> Tensor:
        from pan.models.packing import patchify
        return patchify(latent, self.patch)

    def target_tokens(self, latent: Tensor) -> Tensor:
        return self.patchify(latent)

    def unpatchify(self, tokens: Tensor, grid) -> Tensor:
        from pan.models.packing import unpatchify
        return unpatchify(tokens, grid, self.patch)

    def sample_layout(self, grids, text_len: int) -> SampleLayout:
        from pan.models.pyramid_flux import pyramid_sample_layout
        return pyramid_sample_layout(grids, text_len, self.use_temporal_causal, self.interp_condition_pos)

    def forward(self, x: Tensor, timesteps: Tensor, text: Tensor, pooled: Tensor, pack: PackInfo) -> Tensor:
        return self.dit(x, timesteps / 1000.0, text, pack)

    def init_weights(self) -> None:
        self.dit.init_weights()

    def fsdp_blocks(self) -> list[nn.Module]:
        return self.dit.fsdp_blocks()

    def hidden_matrices(self) -> dict[str, tuple[int, ...]]:
        return {f"dit.{name}": rows for name, rows in self.dit.hidden_matrices().items()}

    def forward_flops(self, pack: PackInfo) -> int:
        return self.dit.forward_flops(pack)


def build_dit(job: PyramidJobConfig) -> nn.Module:
    """The DiT on the meta device (the trainer initialises it, or loads its released weights)."""
    m = job.model
    with torch.device("meta"):
        if m.model_name == "pan":  # the released models' switches, on unless the run says otherwise
            switches = {"use_temporal_causal": True, "interp_condition_pos": True} | m.switches()
            model = PanForPyramid(m.transformer_config_overrides, **switches)
        else:
            # The run's enable_gradient_checkpointing decides whether blocks are checkpointed (the
            # variant's use_gradient_checkpointing was the original's command-line flag); the
            # variant's gradient_checkpointing_ratio decides which (pan.parallel.fsdp).
            config = dataclasses.replace(dit_config(m), use_gradient_checkpointing=
                                         job.parallel.enable_gradient_checkpointing)
            model = dit_class(m.model_name)(config)
    if m.attention_backend is not None:
        set_attention_backend(model, m.attention_backend)
    return model


def released_weights(job: PyramidJobConfig) -> dict[str, Tensor]:
    from pan.models.pyramid_io import read_weights
    return read_weights(variant_folder(job.model))


# ------------------------------------------------------------------------------------------------
# One micro-batch
# ------------------------------------------------------------------------------------------------

@dataclass
class PyramidInputs:
    """One packed micro-batch of stage samples as the DiT and the loss see it (this process's rows)."""
    CP_FIELDS: ClassVar[dict[str, str]] = {"x": "video", "target": "video", "weight": "video",
                                           "text": "text", "timesteps": "whole", "pooled": "whole"}
    x: Tensor           # [Nv, in] noisy tokens at each sample's stage resolution
    target: Tensor      # [Nv, out] velocity target (start - end of the stage line) as tokens
    weight: Tensor      # [Nv] 1 / (values of the sample's trained clip): per-sample MSE weights
    timesteps: Tensor   # [B] the DiT's timesteps (0..1000 scale)
    text: Tensor        # [Nt, D] valid caption rows
    pooled: Tensor      # [B, P] pooled text features
    pack: PackInfo
    sample_ids: list[str]
    samples: int        # samples in the micro-batch (0 on cp ranks > 0)
    tokens: int         # video tokens in the micro-batch (idem)
    packing: float
    bad_samples: int

    def to(self, device) -> PyramidInputs:
        moved = {k: getattr(self, k).to(device) for k in self.CP_FIELDS}
        return dataclasses.replace(self, pack=self.pack.to(device), **moved)


class PyramidTask(Task):
    """What both Pyramid-Flow recipes share on the one loop: the DiT (on meta here: shapes and token
    rules), the frozen encoders, the stage rotation, latents and captions as samples carry them, the
    loss, and validation samples. `PyramidFlowTask` trains whole clips; the autoregressive recipe's
    task (`pan.recipes.pyramid_flow_ar`) one unit of each."""

    def __init__(self, job: PyramidJobConfig, world, dims, cp=None):
        from pan.encoders.vae import vae_geometry

        self.job, self.world, self.dims, self.cp = job, world, dims, cp
        self.reads_data = cp is None or cp.rank == 0
        self.dp_rank = dims.dp_rank_of(world.rank)
        self.schedule = PyramidSchedule(job.pyramid)
        self.geometry = vae_geometry(job.vae)
        self.column_stages = column_stages(job.pyramid.sample_ratios)
        self.stage_slot = self.data_share()[0]   # where this rank's samples start in the stage rotation
        self.vae = self.empty = self._text_encoder = None
        self.bad_samples = 0
        self.model = build_dit(job)  # meta: shapes and token rules only

    @abc.abstractmethod
    def data_share(self) -> tuple[int, int]:
        """(index, count) of the data share this rank reads."""

    @abc.abstractmethod
    def latent_tokens_of(self, t: int, h: int, w: int) -> int:
        """Budgeted tokens of a sample whose full-resolution latent is (t, h, w)."""

    @abc.abstractmethod
    def sample_clips(self, model: nn.Module, prompts: list[str], seed: int) -> list[Tensor]:
        """Validation videos, one per prompt: decoded frames [T, 3, H, W] in [-1, 1]."""

    # -- what gets built ---------------------------------------------------------------------------
    def part_specs(self) -> list[PartSpec]:
        pretrained = None if self.job.model.model_name == "pan" else (lambda: released_weights(self.job))
        return [PartSpec("transformer", lambda: build_dit(self.job), self.job.optim, pretrained=pretrained)]

    def load_encoders(self) -> None:
        """The VAE and the empty caption's features. The text encoders load where a caption is
        encoded (`text_encoder`): not at all in a run whose rows all carry precomputed `text_fea`
        beside a precomputed empty caption, so that no T5 sits on the GPU for nothing."""
        if not self.reads_data:
            return
        from pan.encoders.vae import build_vae

        self.vae = build_vae(self.job.vae, device=self.world.device)
        self.empty = self.empty_caption()

    @property
    def text_encoder(self) -> PyramidTextEncoder:
        """The released T5 + CLIP encoders, loaded at their first use."""
        if self._text_encoder is None:
            from pan.encoders.pyramid_text import build_text_encoder

            m = self.job.model
            name = "pyramid_flux" if m.model_name == "pan" else m.model_name
            self._text_encoder = build_text_encoder(self.job.text, name, m.model_path or "", self.world.device)
        return self._text_encoder

    def encodes_captions(self) -> bool:
        """Whether training encodes captions: validation prompts, rows of video CSVs and image tars,
        annotation rows without a `text_fea` (a text search: rows are parsed only when read)."""
        from pan.data.sources import read_annotations

        data = self.job.data
        if self.job.validation.validation_interval or data.video_csv_paths or data.image_tar_paths:
            return True
        return any(b'"text_fea"' not in row for path in data.annotation_paths
                   for row in read_annotations(path).rows)

    def empty_caption(self) -> TextFeatures:
        """The empty caption's features (caption dropout, guidance): the text encoders' where training
        encodes captions anyway; else `text_fea/empty.pt` as `pan data precompute` writes it beside
        its annotation files (the first found); else the encoders' after all (the original's tools
        write no such file)."""
        from pan.data.precompute import EMPTY_TEXT_FEA
        from pan.encoders.pyramid_text import load_features

        if not self.encodes_captions():
            for path in self.job.data.annotation_paths:
                saved = Path(path).parent / EMPTY_TEXT_FEA
                if saved.is_file():
                    return load_features(saved).to(self.world.device)
        return self.text_encoder.empty_features()

    # -- data --------------------------------------------------------------------------------------
    def tokens_of(self, num_frames: int, height: int, width: int) -> int:
        _, t, h, w = self.geometry.latent_shape(num_frames, height, width)
        return self.latent_tokens_of(t, h, w)

    def build_loader(self, dims):
        from pan.data.loader import build_data_loader

        rank, size = self.data_share()
        return build_data_loader(self.job.data, tokens_of=self.tokens_of, dp_rank=rank, dp_size=size,
                                 seed=self.job.trainer.seed, latent_tokens_of=self.latent_tokens_of)

    def raw_latent(self, sample) -> Tensor:
        """The sample's latent as the VAE gives it (not normalised) [C, T, H, W], fp32."""
        if getattr(sample, "raw_latent", None) is not None:
            return sample.raw_latent.float().to(self.world.device)
        if getattr(sample, "latent", None) is not None:  # pan's precomputed CSVs: normalised by pan
            return self.vae.unnormalize(sample.latent.float().to(self.world.device))
        frames = sample.frames.to(self.world.device).float().div(127.5).sub(1.0)
        with torch.no_grad():
            return self.vae.unnormalize(self.vae.encode(frames))

    def caption_features(self, samples) -> list[TextFeatures]:
        """Each sample's precomputed text features, or its caption encoded (before any CFG drop)."""
        feats: list = [None] * len(samples)
        for i, s in enumerate(samples):
            pre = getattr(s, "text_features", None)
            if pre is not None:
                feats[i] = TextFeatures(pre["prompt_embed"], pre["prompt_attention_mask"],
                                        pre["pooled_prompt_embed"])
        need = [i for i, f in enumerate(feats) if f is None]
        if need:
            for i, f in zip(need, self.text_encoder.encode([samples[i].caption for i in need])):
                feats[i] = f
        return [f.to(self.world.device) for f in feats]

    def next_stages(self, n: int) -> list[int]:
        stages = [self.column_stages[(self.stage_slot + i) % len(self.column_stages)] for i in range(n)]
        self.stage_slot += n
        return stages

    # -- the loss ----------------------------------------------------------------------------------
    def loss_sum(self, model, inputs: PyramidInputs) -> Tensor:
        """Sum over this rank's rows of each sample's squared errors / its values: summed over ranks
        and divided by the sample count, the mean of per-sample MSEs (the original's loss)."""
        pred = model(inputs.x, inputs.timesteps, inputs.text, inputs.pooled, inputs.pack)
        return ((pred.float() - inputs.target).square().sum(dim=1) * inputs.weight).sum()

    def loss_count(self, inputs: PyramidInputs) -> float:
        return float(inputs.samples)

    def batch_stats(self, batches: list[PyramidInputs]) -> dict:
        flops = sum(3 * self.model.forward_flops(b.pack) for b in batches) / self.dims.cp
        return {"samples": sum(b.samples for b in batches), "tokens": sum(b.tokens for b in batches),
                "flops": flops, "bad_samples": batches[-1].bad_samples,
                "packing": sum(b.packing for b in batches) / len(batches)}

    # -- validation --------------------------------------------------------------------------------
    def wants_validation(self, step: int) -> bool:
        interval = self.job.validation.validation_interval
        return bool(interval) and step % interval == 0

    @torch.no_grad()
    def validate(self, parts, step: int, output_dir) -> dict:
        self.write_samples(parts["transformer"].model, self.job.validation.validation_prompts,
                           Path(output_dir) / "samples" / f"step-{step:08d}", seed=self.job.trainer.seed)
        return {}

    def write_samples(self, model: nn.Module, prompts: list[str], out_dir: Path, *, seed: int) -> list[Path]:
        """Validation samples: the ranks holding the encoders compute, the main rank writes each one
        as MP4, GIF and its prompt."""
        from pan.media import to_uint8_frames, write_gif, write_mp4

        if not self.reads_data:
            return []
        was_training = model.training
        model.eval()
        try:
            videos = self.sample_clips(model, prompts, seed)
        finally:
            model.train(was_training)
        written, fps = [], self.job.validation.sample_fps
        if self.world.is_main:
            out_dir.mkdir(parents=True, exist_ok=True)
            for i, (prompt, video) in enumerate(zip(prompts, videos)):
                frames = to_uint8_frames(video)
                write_mp4(out_dir / f"{i:02d}.mp4", frames, fps=fps)
                write_gif(out_dir / f"{i:02d}.gif", frames, fps=fps)
                (out_dir / f"{i:02d}.txt").write_text(prompt + "\n")
                written.append(out_dir / f"{i:02d}.mp4")
        return written


class PyramidFlowTask(PyramidTask):
    """The full-sequence spatial-pyramid recipe on the one loop (see the module docstring).

    Its data is read as one shard per micro-batch (ShardedLoader), and each micro-batch's draws
    (noise, table indices, caption dropout, its place in the stage rotation) follow from its shard
    and its number in it: a run continues exactly on any layout with the same number of shards.
    """
    elastic_data = True
    sharded_micro_batches = True

    def __init__(self, job: PyramidJobConfig, world, dims, cp=None):
        super().__init__(job, world, dims, cp)
        # Noise and table indices; caption dropout: seeded again for each micro-batch (seed_draws_for).
        self.generator = torch.Generator().manual_seed(job.trainer.seed)
        self.rng = random.Random(job.trainer.seed)

    def data_share(self) -> tuple[int, int]:
        return self.dp_rank, self.dims.dp

    def build_loader(self, dims):
        from pan.data.loader import build_step_shards

        return build_step_shards(self, dims)

    def seed_draws_for(self, batch) -> None:
        """The draws of one training micro-batch, from what names it: (seed, shard, batch number);
        its samples take the next places of the shard's stage rotation."""
        from pan.data.loader import seed_draws

        seed_draws(self.generator, self.rng, self.job.trainer.seed, batch.shard, batch.number)
        self.stage_slot = batch.shard + batch.first_sample

    # -- data --------------------------------------------------------------------------------------
    def stage_cost(self) -> float:
        """Expected share of a full-resolution sample's tokens a sample costs: the stages follow
        sample_ratios, and stage k has 1/4^(stages-1-k) of the tokens."""
        s = self.job.pyramid.stages
        return sum(4.0 ** -(s - 1 - k) for k in self.column_stages) / len(self.column_stages)

    def latent_tokens_of(self, t: int, h: int, w: int) -> int:
        gt, gh, gw = self.model.patch_grid((0, t, h, w))
        return max(1, math.ceil(gt * gh * gw * self.stage_cost()))

    def dropped_captions(self, samples) -> list[TextFeatures]:
        """Each sample's caption features, the empty caption's instead with probability cfg_drop_prob."""
        p = self.job.tasks.cfg_drop_prob
        return [self.empty.to(self.world.device) if self.rng.random() < p else f
                for f in self.caption_features(samples)]

    def prepare(self, batch) -> PyramidInputs:
        """Raw packed batch -> each sample noised at its stage, as tokens, with its layout."""
        samples = batch.samples
        feats = self.dropped_captions(samples)
        draws = GeneratorDraws(self.generator)
        xs, targets, weights, timesteps, layouts = [], [], [], [], []
        for sample, stage in zip(samples, self.next_stages(len(samples))):
            latent = normalize_latent(self.raw_latent(sample)[None], self.job.pyramid)   # [1, C, T, H, W]
            levels = latent_pyramid(latent.cpu(), self.job.pyramid.stages)
            noised = noise_sample(levels, stage, self.schedule, draws, flow=self.job.flow)
            noisy, target = noised.clips[-1][0].to(self.world.device), noised.target[0].to(self.world.device)
            grid = self.model.patch_grid(noisy.shape)
            xs.append(self.model.patchify(noisy))
            targets.append(self.model.target_tokens(target))
            weights.append(torch.full((xs[-1].shape[0],), 1.0 / target.numel(), device=self.world.device))
            timesteps.append(noised.timesteps)
            layouts.append(self.model.sample_layout([grid], 0))
        texts = [f.caption_rows().float() for f in feats]
        layouts = [dataclasses.replace(lay, text_len=t.shape[0]) for lay, t in zip(layouts, texts)]
        self.bad_samples += sum(batch.skipped.values())
        return PyramidInputs(
            x=torch.cat(xs), target=torch.cat(targets), weight=torch.cat(weights),
            timesteps=torch.cat(timesteps).float().to(self.world.device), text=torch.cat(texts),
            pooled=torch.stack([f.pooled_prompt_embed.float() for f in feats]),
            pack=PackInfo.from_layouts(layouts), sample_ids=[s.sample_id for s in samples],
            samples=len(samples), tokens=sum(x.shape[0] for x in xs), packing=batch.packing_efficiency,
            bad_samples=self.bad_samples)

    def next_batch(self, loader) -> tuple[PyramidInputs, float]:
        t0 = time.perf_counter()
        raw = next(loader) if self.reads_data else None
        waited = time.perf_counter() - t0
        inputs = None
        if self.reads_data:
            self.seed_draws_for(raw)
            inputs = self.prepare(raw)
        if self.cp is not None:
            inputs = self.cp.distribute(inputs)
        return inputs.to(self.world.device), waited

    def sample_clips(self, model: nn.Module, prompts: list[str], seed: int) -> list[Tensor]:
        v = self.job.validation
        return sample_videos(self, model, prompts, num_frames=v.sample_num_frames, height=v.sample_height,
                             width=v.sample_width, steps=v.sample_steps, guidance_scale=v.sample_guidance_scale,
                             seed=seed)

    # -- checkpoint --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"bad_samples": self.bad_samples}  # the draws are seeded per micro-batch

    def load_state_dict(self, state: dict) -> None:
        self.bad_samples = state["bad_samples"]


# ------------------------------------------------------------------------------------------------
# Sampling: validation and `pan sample`
# ------------------------------------------------------------------------------------------------

def velocity_fn(model: nn.Module, features: list[TextFeatures]):
    """velocity(x [b, C, T, h, w], t [b]) -> [b, C, T, h, w]: one packed forward of b samples, sample
    i with caption features[i]."""
    def velocity(x: Tensor, t: Tensor) -> Tensor:
        grid = model.patch_grid(x[0].shape)
        texts = [f.caption_rows().float() for f in features]
        pack = PackInfo.from_layouts([model.sample_layout([grid], tx.shape[0]) for tx in texts],
                                     device=x.device)
        tokens = torch.cat([model.patchify(xi) for xi in x])
        pooled = torch.stack([f.pooled_prompt_embed.float() for f in features]).to(x.device)
        out = model(tokens, t.to(x.device).float(), torch.cat(texts).to(x.device), pooled, pack)
        return torch.stack([model.unpatchify(o, grid) for o in out.chunk(len(features))]).float()
    return velocity


def sample_videos(task: PyramidFlowTask, model: nn.Module, prompts: list[str], *, num_frames: int,
                  height: int, width: int, steps, guidance_scale: float, seed: int) -> list[Tensor]:
    """Sample one latent clip per prompt with the pyramid sampler; decoded frames [T, 3, H, W] in [-1, 1]."""
    from pan.diffusion.pyramid_sampler import sample_full_sequence

    device = task.world.device
    c, t, h, w = task.geometry.latent_shape(num_frames, height, width)
    videos = []
    for i, prompt in enumerate(prompts):
        generator = torch.Generator().manual_seed(seed + i)
        draws = GeneratorDraws(generator)
        noise = torch.randn((1, c, t, h, w), generator=generator).to(device)
        cond = [task.text_encoder.encode([prompt])[0].to(device)]
        uncond = [task.empty.to(device)]
        latent = sample_full_sequence(velocity_fn(model, cond), noise, task.schedule, steps, draws,
                                      uncond_velocity=velocity_fn(model, uncond) if guidance_scale != 1 else None,
                                      guidance_scale=guidance_scale)
        raw = denormalize_latent(latent, task.job.pyramid)[0]
        videos.append(task.vae.decode(task.vae.normalize(raw)))
    return videos


def export_released(ckpt_dir: Path, out_dir: Path, *, ema: bool = False) -> Path:
    """Write a checkpoint's DiT as a released Pyramid-Flow folder (config.json + safetensors, the
    released keys) that the original's loaders and `model_path` read. Returns the folder."""
    from pan.checkpoint.export import consolidated_weights, part_source
    from pan.config import load_job_config
    from pan.models.pyramid_io import save_pretrained

    config = Path(ckpt_dir).parent / "config.yaml"
    if not config.is_file():
        raise ValueError(f"{config} not found: --format pyramid_flow reads the run's config.yaml beside "
                         "its checkpoints.")
    job = load_job_config(["--config", str(config)], warn=lambda msg: None)
    if getattr(job.model, "model_name", None) not in ("pyramid_flux", "pyramid_mmdit"):
        raise ValueError(f"{config} is not a run of a released Pyramid-Flow DiT (recipe {job.recipe}"
                         f"{', model ' + job.model.model_name if hasattr(job.model, 'model_name') else ''}): "
                         "export it as safetensors.")
    _, source = part_source(Path(ckpt_dir), "transformer", ema)
    model = build_dit(job)
    model.to_empty(device="cpu")
    model.load_state_dict(consolidated_weights(source), strict=True)
    save_pretrained(model, out_dir)
    return Path(out_dir)


RECIPE = Recipe(name="pyramid_flow", job_config=PyramidJobConfig, task=PyramidFlowTask,
                description="Pyramid-Flow full-sequence spatial-pyramid flow matching",
                sample="pan.recipes.pyramid_flow:sample_main")


def sample_main(job: PyramidJobConfig, argv: list[str]) -> int:
    """`pan sample` for a pyramid_flow run: text-to-video with the stage-by-stage sampler and CFG."""
    import argparse

    from pan.media import to_uint8_frames, write_gif, write_mp4
    from pan.parallel.dims import ParallelDims
    from pan.parallel.world import World
    from pan.sampling import resolve_weights

    v = job.validation
    parser = argparse.ArgumentParser(prog="pan sample", description="Generate videos from a "
                                     "pyramid_flow checkpoint (stage by stage, with CFG).")
    parser.add_argument("--checkpoint", required=True, type=Path)
    parser.add_argument("--config")
    parser.add_argument("--prompt", action="append", required=True)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--num-frames", type=int, default=v.sample_num_frames)
    parser.add_argument("--height", type=int, default=v.sample_height)
    parser.add_argument("--width", type=int, default=v.sample_width)
    parser.add_argument("--steps", type=int, nargs="+", default=v.sample_steps)
    parser.add_argument("--guidance-scale", type=float, default=v.sample_guidance_scale)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fps", type=float, default=v.sample_fps)
    parser.add_argument("--ema", action="store_true")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    world = World(rank=0, size=1, local_rank=0, local_size=1, device=device)
    task = PyramidFlowTask(job, world, ParallelDims.from_config(job.parallel, 1, 1))
    weights, _ = resolve_weights(args.checkpoint, args.ema)
    model = build_dit(job)
    model.to_empty(device="cpu")
    model.load_state_dict(weights)
    model.to(device).eval()
    task.load_encoders()
    videos = sample_videos(task, model, args.prompt, num_frames=args.num_frames, height=args.height,
                           width=args.width, steps=args.steps if len(args.steps) > 1 else args.steps[0],
                           guidance_scale=args.guidance_scale, seed=args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for i, (prompt, video) in enumerate(zip(args.prompt, videos)):
        out = args.out if len(args.prompt) == 1 else args.out.with_name(f"{args.out.stem}_{i:02d}.mp4")
        frames = to_uint8_frames(video)
        write_mp4(out, frames, args.fps)
        write_gif(out.with_suffix(".gif"), frames, args.fps)
        print(f"{out}  <- {prompt!r}")
    return 0


import pan.recipes.pyramid_checks  # noqa: E402, F401 - registers the launch workflow and `pan check` rows

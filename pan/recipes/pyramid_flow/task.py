"""Pyramid-Flow full-sequence training (`pyramid_flow`): spatial-pyramid flow matching of whole clips.

Each sample of a packed batch is trained at one pyramid stage (the stages follow `sample_ratios`
across the samples, 1:2:1 by default): its latent is normalised with the model's per-frame
statistics, taken down to the stage's resolution, noised on the stage's line
(`pan.diffusion.pyramid_noising`), and enters the pack at that size (a 1/4-resolution stage costs 1/16 of the
tokens). The loss is the original's: the mean over samples of each sample's MSE, so every sample
weighs the same whatever its stage.

Models (`model_name`): the released Pyramid-Flow DiTs `pyramid_flux` (miniFLUX) and `pyramid_mmdit`
(SD3), loaded from `model_path`/`model_variant` as released and exported back to that layout; or
`pan` (PanVideoDiffusionTransformer from `transformer_config_overrides`): the method is not tied to
one architecture. Text: the released T5 + CLIP encoders (`pan.encoders.pyramid_text`) online, or the
precomputed `text_fea` files of Pyramid-Flow annotations (then the encoders are not loaded at all,
see `PyramidTask.load_encoders`). `PyramidTask` is what this recipe and the autoregressive one
(`pan.recipes.pyramid_flow_ar`) share on the packed-DiT loop (`pan.recipes.packed.PackedTask`).
"""

from __future__ import annotations

import abc
import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from torch import Tensor, nn

from pan.data.fit import SampleFit
from pan.data.sources import read_annotations
from pan.diffusion.pyramid_draws import GeneratorDraws
from pan.diffusion.pyramid_latents import column_stages, latent_pyramid, normalize_latent
from pan.diffusion.pyramid_noising import noise_sample, regression_target
from pan.diffusion.pyramid_schedule import PyramidSchedule
from pan.encoders.pyramid_text import PyramidTextEncoder, TextFeatures, build_text_encoder, load_features
from pan.encoders.vae import build_vae
from pan.data.media import to_uint8_frames, write_gif, write_mp4
from pan.models.packing import PackInfo
from pan.models.pyramid_dit import trained_rows
from pan.recipes.packed import PackedInputs, PackedTask
from pan.recipes.pyramid_flow.config import PyramidJobConfig, variant_folder
from pan.recipes.pyramid_flow.model import build_dit, released_weights
from pan.recipes.pyramid_flow.precompute import EMPTY_TEXT_FEA
from pan.recipes.pyramid_flow.sample import sample_videos
from pan.task import PartSpec

# ------------------------------------------------------------------------------------------------
# One micro-batch
# ------------------------------------------------------------------------------------------------

@dataclass
class PyramidInputs(PackedInputs):
    """One packed micro-batch of stage samples as the DiT and the loss see it (this process's rows):

        x           [Nv, in] noisy tokens at each sample's stage resolution
        target      [Nv, out] regression target as tokens: the velocity (start - end of the stage
                    line), or x0 at the stage's resolution with prediction_type sample (`regression_target`)
        weight      [Nv] 1 / (values of the sample's trained clip), times the target's loss factor:
                    per-sample MSE weights
        timesteps   [B] the DiT's timesteps (0..1000 scale)
        text        [Nt, D] valid caption rows
        pooled      [B, P] pooled text features
    """
    CP_FIELDS: ClassVar[dict[str, str]] = {**PackedInputs.CP_FIELDS, "pooled": "whole"}
    pooled: Tensor


class PyramidTask(PackedTask):
    """What both Pyramid-Flow recipes share on the one loop: the DiT (on meta here: shapes and token
    rules), the frozen encoders, the stage rotation, latents and captions as samples carry them, the
    loss, and validation samples. `PyramidFlowTask` trains whole clips; the autoregressive recipe's
    task (`pan.recipes.pyramid_flow_ar`) one unit of each."""

    def __init__(self, job: PyramidJobConfig, world, dims, cp=None):
        super().__init__(job, world, dims, cp)
        self.schedule = PyramidSchedule(job.pyramid)
        self.column_stages = column_stages(job.pyramid.sample_ratios)
        self.stage_slot = self.data_share()[0]   # where this rank's samples start in the stage rotation
        self.vae = self.empty = self._text_encoder = None
        self.model = build_dit(job)  # meta: shapes and token rules only

    @abc.abstractmethod
    def data_share(self) -> tuple[int, int]:
        """(index, count) of the data share this rank reads."""

    @abc.abstractmethod
    def sample_clips(self, model: nn.Module, prompts: list[str], seed: int) -> list[Tensor]:
        """Validation videos, one per prompt: decoded frames [T, 3, H, W] in [-1, 1]."""

    # -- what gets built ---------------------------------------------------------------------------
    def part_specs(self) -> list[PartSpec]:
        # A warm start (`pretrained_transformer_path`: another run's checkpoint, an export) replaces
        # the released weights; model_path still gives the DiT's config.json.
        released = self.job.model.model_name != "pan" and self.warm_start_source() is None
        pretrained = (lambda: released_weights(self.job)) if released else None
        lora = self.job.lora if self.job.lora.enabled else None
        source = str(variant_folder(self.job.model)) if released else None
        return [PartSpec("transformer", lambda: build_dit(self.job), self.job.optim, warm_start=True,
                         pretrained=pretrained, pretrained_from=source, lora=lora)]

    def load_encoders(self) -> None:
        """The VAE and the empty caption's features. The text encoders load where a caption is
        encoded (`text_encoder`): not at all in a run whose rows all carry precomputed `text_fea`
        beside a precomputed empty caption, so that no T5 sits on the GPU for nothing."""
        if not self.reads_data:
            return
        self.vae = build_vae(self.job.vae, device=self.world.device)
        self.empty = self.empty_caption()

    @property
    def text_encoder(self) -> PyramidTextEncoder:
        """The released T5 + CLIP encoders, loaded at their first use."""
        if self._text_encoder is None:
            m = self.job.model
            name = "pyramid_flux" if m.model_name == "pan" else m.model_name
            self._text_encoder = build_text_encoder(self.job.text, name, m.model_path or "", self.world.device)
        return self._text_encoder

    def encodes_captions(self) -> bool:
        """Whether training encodes captions: validation prompts, rows of video CSVs and image tars,
        annotation rows without a `text_fea` (a text search: rows are parsed only when read)."""
        data = self.job.data
        if self.job.validation.validation_interval or data.video_csv_paths or data.image_tar_paths:
            return True
        return any(source.rows_naming("text_fea") < len(source)   # counted in the row index
                   for source in map(read_annotations, data.annotation_paths))

    def empty_caption(self) -> TextFeatures:
        """The empty caption's features (caption dropout, guidance): the text encoders' where training
        encodes captions anyway; else `text_fea/empty.pt` as `pan data precompute` writes it beside
        its annotation files (the first found); else the encoders' after all (the original's tools
        write no such file)."""
        if not self.encodes_captions():
            for path in self.job.data.annotation_paths:
                saved = Path(path).parent / EMPTY_TEXT_FEA
                if saved.is_file():
                    return load_features(saved).to(self.world.device)
        return self.text_encoder.empty_features()

    # -- data --------------------------------------------------------------------------------------
    def sample_fit(self) -> SampleFit:
        """What the DiT takes of a sample (checked as it is read; pan/data/fit.py): its latent
        channels; latent H and W in whole units of 2^(stages - 1) patches (every stage halves them,
        the smallest must still cut into patches), T in whole temporal patches; SD3's position
        table's reach; the widths of precomputed text features."""
        m, stages = self.job.model, self.job.pyramid.stages
        if m.model_name == "pan":
            c = self.model.dit.config
            channels, patch, caption, pooled, table = c.out_channels, tuple(c.patch_size), c.text_embed_dim, None, None
        else:
            c = self.model.config
            p = 2 if m.model_name == "pyramid_flux" else c.patch_size  # miniFLUX: 2x2 tokens always (quirk F1)
            channels, patch, caption, pooled = self.model.latent_channels, (1, p, p), c.joint_attention_dim, \
                c.pooled_projection_dim
            table = getattr(c, "pos_embed_max_size", None)
        down = 2 ** (stages - 1)
        return dataclasses.replace(
            super().sample_fit(), channels=channels, unit=(patch[0], down * patch[1], down * patch[2]),
            unit_from=f"{stages} pyramid stages of {patch[1]}x{patch[2]} patches",
            max_side=None if table is None else table * patch[1], caption_width=caption, pooled_width=pooled)

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
        and divided by the sample count, the mean of per-sample MSEs (the original's loss). Only the
        trained rows are predicted (history clips are conditioning: the model skips their last-block
        work)."""
        pred = model(inputs.x, inputs.timesteps, inputs.text, inputs.pooled, inputs.pack, trained_only=True)
        target, weight = (trained_rows(t, inputs.pack) for t in (inputs.target, inputs.weight))
        return ((pred.float() - target).square().sum(dim=1) * weight).sum()

    def forward_flops(self, pack: PackInfo) -> int:
        # the loss asks for the trained rows only: without context parallel the model skips the rest
        return self.model.forward_flops(pack, trained_only=self.dims.cp == 1)

    def loss_count(self, inputs: PyramidInputs) -> float:
        return float(inputs.samples)

    # -- validation --------------------------------------------------------------------------------
    @torch.no_grad()
    def validate(self, parts, step: int, output_dir) -> dict:
        self.write_samples(parts["transformer"].model, self.job.validation.validation_prompts,
                           Path(output_dir) / "samples" / f"step-{step:08d}", seed=self.job.trainer.seed)
        return {}

    def write_samples(self, model: nn.Module, prompts: list[str], out_dir: Path, *, seed: int) -> list[Path]:
        """Validation samples: the ranks holding the encoders compute, the main rank writes each one
        as MP4, GIF and its prompt."""
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

    def data_share(self) -> tuple[int, int]:
        return self.dp_rank, self.dims.dp

    def seed_draws_for(self, batch) -> None:
        """The draws of one training micro-batch, from what names it: (seed, shard, batch number);
        its samples take the next places of the shard's stage rotation."""
        super().seed_draws_for(batch)
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
            target, factor = regression_target(noised, self.job.flow, self.schedule)
            noisy, target = noised.clips[-1][0].to(self.world.device), target[0].to(self.world.device)
            grid = self.model.patch_grid(noisy.shape)
            xs.append(self.model.patchify(noisy))
            targets.append(self.model.target_tokens(target))
            weights.append(torch.full((xs[-1].shape[0],), factor.item() / target.numel(), device=self.world.device))
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

    def sample_clips(self, model: nn.Module, prompts: list[str], seed: int) -> list[Tensor]:
        v = self.job.validation
        return sample_videos(self, model, prompts, num_frames=v.sample_num_frames, height=v.sample_height,
                             width=v.sample_width, steps=v.sample_steps, guidance_scale=v.sample_guidance_scale,
                             seed=seed, batch_size=v.sample_batch_size)

"""The causal_vae recipe's Task: its parts, the frozen LPIPS, the data, the two-part step (the VAE's
update, then the discriminator's), validation and checkpoint state. The recipe as a whole (its
objective, data and stages): pan/recipes/causal_vae/__init__.py and docs/causal_vae.md."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from pan.config.core import ConfigError
from pan.data.batch import Sample
from pan.data.build import build_sharded_loader
from pan.data.fit import SampleFit
from pan.data.plan import Ref, seed_draws
from pan.data.reader import SampleReader, rules_of
from pan.data.sources import SourceError, read_video_csv
from pan.data.media import to_uint8_frames, write_mp4
from pan.models.causal_vae import CausalVideoVAE, check_state_dict, renamed_legacy_attention_keys
from pan.models.causal_vae_config import WEIGHTS_NAME
from pan.models.lpips import LPIPS
from pan.models.vae_discriminator import NLayerDiscriminator
from pan.models.vae_loss import frames_of
from pan.parallel.precision import compute_precision
from pan.parallel.vae_context import ContextGroup, attach_halo_hooks, latent_range
from pan.recipes.causal_vae.config import DISCRIMINATOR, VAE, VAE_CONFIG_FILE, CausalVAEJobConfig, resolve_warm_start
from pan.recipes.causal_vae.data import ClipBatch, ClipReader
from pan.recipes.causal_vae.model import (
    TrainedCausalVAE,
    TrainedDiscriminator,
    _load_safetensors,
    full_weights,
    vae_forward_flops,
)
from pan.recipes.causal_vae.objective import Objective
from pan.recipes.causal_vae.quality import psnr, ssim
from pan.task import PartSpec, StepContext, Task, global_sums


class CausalVAETask(Task):
    """The causal VAE recipe's side of the loop: parts, LPIPS, data, the two-part step, validation.

    Its data is one shard per context group and micro-batch (ShardedLoader; every rank of a group
    reads the group's shards), and each micro-batch's posterior noise is seeded by its shard and
    batch number: a run continues exactly on any layout with the same number of shards."""
    elastic_data = True

    def __init__(self, job: CausalVAEJobConfig, world, dims, cp=None):
        super().__init__(job, world, dims, cp)
        size = job.context.context_size
        if world.size % size or world.local_size % size:
            raise ConfigError("context_size", f"({size}) must divide the world size ({world.size}) and the "
                                              f"processes per node ({world.local_size}): a context group is "
                                              "consecutive ranks of one node (its halos travel in every "
                                              "causal conv).",
                              fix=f"use a context_size that divides {world.local_size}, or {size}k processes per node.")
        self.vae_cfg = job.vae_config()   # (after the layout's rule, which does not depend on it)
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
        # The key, not the checkpoint: a stage chained after another (`pan launch-command --stage
        # both`) plans its parts before the checkpoint it starts from is written.
        warm = self.job.model.warm_start_checkpoint is not None
        released = self.released_weights if self.job.model.model_path and not warm else None
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

    def sample_fit(self) -> SampleFit:
        """Clips this VAE can encode (1 + a multiple of its temporal factor frames, sides in whole
        spatial factors), checked as each is read: any other is skipped as a bad sample."""
        return SampleFit(temporal_factor=self.vae_cfg.temporal_factor, spatial_factor=self.vae_cfg.spatial_factor,
                         unit_from="the VAE", model="the VAE")

    def build_loader(self, dims):
        for path in self.job.data.video_csv_paths:
            src = read_video_csv(path)
            if "path" not in src.columns:
                raise SourceError(f"{path} holds precomputed latents (latent_path, no path column): the "
                                  "VAE trains on pixels; give it the CSV of the videos.")
        # Annotation rows that name a latent are decoded from their video (the reader uses no latents).
        loader = build_sharded_loader(self.job.data, tokens_of=self.tokens_of, dp_rank=self.data_rank,
                                      dp_size=self.data_size, seed=self.job.trainer.seed,
                                      accumulation=self.job.trainer.gradient_accumulation_steps,
                                      latent_tokens_of=self.tokens_of, writes_cursors=self.context_rank == 0,
                                      fit=self.sample_fit())
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
        clips = self.heldout_clips()
        model = parts[VAE].model
        scores = {"psnr": [], "ssim": [], "lpips": []}
        folder = Path(output_dir) / "reconstructions" / f"step-{step:08d}"
        for i, sample in enumerate(clips):
            batch = self.clip_batch([sample], torch.Generator())   # (the mean is reconstructed: no noise)
            x = batch.clips[0][None]                                               # [1, 3, T, H, W]
            # (autocast's weight cache as torch has it, as validation always ran)
            with compute_precision(self.job.trainer.dtype, self.world.device.type, weight_cache=None,
                                   fp32_disables=True):
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

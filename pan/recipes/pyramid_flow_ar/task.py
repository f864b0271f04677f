"""Pyramid-Flow autoregressive training (`pyramid_flow_ar`): temporal-pyramid flow matching of units.

A clip (at most the latent frames of `max_frames`) is cut into units of `frame_per_unit` latent
frames, the first unit being frame 0 alone (an image: image-to-video and continuation come for
free). Each packed sample trains ONE unit at one pyramid stage: that unit is noised on the stage's
line (`pan.diffusion.pyramid_noising.noise_unit`) and is the only clip in the loss; the units before it are
its history, clean latents corrupted with sigma ~ U(0, corrupt_ratio): the previous unit at the
stage's resolution, each older one a level lower, the oldest at the lowest (the temporal pyramid).
RoPE positions of lower-resolution history are interpolated onto the trained unit's grid
(`interp_condition_pos`), and attention is block-causal over latent frames (`use_temporal_causal`):
both are real switches of the layouts the recipe builds (`sample_layout`).

Video sync groups (`video_sync_group` = G). The G slots of a group read the same videos and train
different unit positions in the original's rotation: on its c-th batch slot p trains, in a sample
of the highest stage, unit p + 1 + G * ((c + 1) % (M / G)), and in a sample of a lower stage the
complementary unit M - p - G * (...) (M = units of max_frames), so that every column carries about the
same tokens; over a rotation (M / G batches) the slots cover every unit 1..M once. A sample
shorter than a slot's unit is not trained by that slot (the original trains its last unit again
instead), so with G = M every unit of every video is trained exactly once per group, whatever the
mix of clip lengths. A group's slots are its g = gcd(dp, G) consecutive data-parallel ranks times
k = G / g consecutive micro-batches of each (g x k = G): the same gradient on fewer GPUs. Each slot
has its own random streams, seeded by its place in the groups, so 1 rank x 4 micro-batches makes
the update of 4 ranks x 1. The ranks of a group read one data-parallel share (the group's index),
so they choose the same videos by construction: the group's data shard. The rotation counter and
the slots' streams follow from the number of the group's batch, so a checkpoint continues on any
layout with the same number of groups.

The loss is the original's: the mean over trained samples of each one's MSE over its trained unit.
Keys beyond the full-sequence recipe's: `frame_per_unit`, `video_sync_group`,
`interp_condition_pos`, and for sampling `sample_video_steps`, `sample_video_guidance_scale`,
`sample_max_history_units`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import random
import time
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from pan.config.core import require
from pan.data.build import build_sharded_loader
from pan.data.plan import seed_draws
from pan.diffusion.flow import FlowConfig
from pan.diffusion.pyramid_draws import Draws, GeneratorDraws
from pan.diffusion.pyramid_latents import latent_pyramids
from pan.diffusion.pyramid_noising import NoisedColumn, noise_unit, regression_target
from pan.diffusion.pyramid_schedule import PyramidSchedule
from pan.diffusion.pyramid_units import history_spans, stage_unit_counts, unit_frames
from pan.encoders.pyramid_text import TextFeatures
from pan.logging import get_logger
from pan.models.packing import PackInfo
from pan.recipes.pyramid_flow.task import PyramidInputs, PyramidTask
from pan.recipes.pyramid_flow_ar.config import PyramidARJobConfig, latent_window, window_units
from pan.recipes.pyramid_flow_ar.sample import decode, sample_ar_latents
from pan.sampling import prompt_batches
from pan.task import StepContext, global_sum

# ------------------------------------------------------------------------------------------------
# Sync groups: which videos a rank reads and which unit positions its micro-batches train
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SyncPlan:
    """A rank's place in the video sync groups. Group slots 0..G-1 are g consecutive data-parallel
    ranks x k consecutive micro-batches of each; the rank reads one batch per k micro-batches."""
    group: int                  # G, video_sync_group
    ranks: int                  # g: data-parallel ranks per group
    loader_rank: int            # the group's index: the data share its ranks read
    loader_size: int            # number of groups across the data-parallel ranks
    slots: tuple[int, ...]      # this rank's slots, one per micro-batch of a batch (k of them)

    @classmethod
    def of(cls, group: int, dp: int, dp_rank: int, accumulation: int) -> SyncPlan:
        require(dp * accumulation % group == 0, "video_sync_group",
                f"is {group}, but {dp} data-parallel rank(s) x gradient_accumulation_steps "
                f"{accumulation} = {dp * accumulation} micro-batches per step cannot be split into "
                f"groups of {group} (the original needs GPUs % video_sync_group == 0; pan spreads a "
                f"group over ranks x micro-batches). Use a group dividing {dp * accumulation}, or "
                f"more ranks or micro-batches.")
        ranks = math.gcd(dp, group)
        per_rank = group // ranks   # divides accumulation: group | dp * accumulation
        first = (dp_rank % ranks) * per_rank
        return cls(group, ranks, dp_rank // ranks, dp // ranks, tuple(range(first, first + per_rank)))

    def virtual_rank(self, slot: int) -> int:
        """The slot's place among all groups' slots: what seeds its random streams."""
        return self.loader_rank * self.group + slot


@dataclass
class HeldSample:
    """One sample of the batch a rank's slots share: its pyramid levels and what it trains on."""
    sample_id: str
    levels: list[Tensor]       # normalised latent pyramid [1, C, T, h_k, w_k], lowest first (CPU)
    units: int                 # whole units of its (window-cut) clip
    stage: int                 # the stage its column trains at (the same for every slot)
    text: TextFeatures         # caption features before the CFG drop


@dataclass
class UnitSample:
    """A sample as one slot trains it: its noised unit and history, and its caption."""
    sample_id: str
    noised: NoisedColumn
    text: TextFeatures
    trained: bool = True       # False: a placeholder that keeps the collectives in step, weight 0


def unit_inputs(model: nn.Module, samples: list[UnitSample], device, flow: FlowConfig,
                schedule: PyramidSchedule) -> PyramidInputs:
    """Pack unit samples: each sample's clips (history oldest first, the noisy unit last) as one
    stacked layout of the model's rule; only the last clip's tokens carry a target and a weight
    (`regression_target` of the unit under `flow`'s prediction_type, on `schedule`'s stage lines)."""
    xs, targets, weights, timesteps, layouts, texts = [], [], [], [], [], []
    for s in samples:
        clips = [c[0] for c in s.noised.clips]                                   # [C, t, h, w] each
        grids = [model.patch_grid(c.shape) for c in clips]
        tokens = [model.patchify(c.to(device)) for c in clips]
        target, factor = regression_target(s.noised, flow, schedule)
        unit = model.target_tokens(target[0].to(device))                         # [n, out]
        history_rows = sum(t.shape[0] for t in tokens[:-1])
        xs.append(torch.cat(tokens))
        targets.append(torch.cat([unit.new_zeros(history_rows, unit.shape[1]), unit]))
        scale = factor.item() / target.numel() if s.trained else 0.0
        weights.append(torch.cat([torch.zeros(history_rows, device=device),
                                  torch.full((unit.shape[0],), scale, device=device)]))
        timesteps.append(s.noised.timesteps)
        texts.append(s.text.caption_rows().float().to(device))
        layouts.append(model.sample_layout(grids, texts[-1].shape[0]))
    trained = [s for s in samples if s.trained]
    return PyramidInputs(
        x=torch.cat(xs), target=torch.cat(targets), weight=torch.cat(weights),
        timesteps=torch.cat(timesteps).float().to(device), text=torch.cat(texts),
        pooled=torch.stack([s.text.pooled_prompt_embed.float() for s in samples]).to(device),
        pack=PackInfo.from_layouts(layouts), sample_ids=[s.sample_id for s in trained],
        samples=len(trained), tokens=sum(x.shape[0] for x in xs), packing=0.0, bad_samples=0)


class PyramidFlowARTask(PyramidTask):
    """The autoregressive temporal-pyramid recipe on the one loop (see the module docstring).

    Its data is one shard per sync group (ShardedLoader; every rank of a group reads it, the
    group's first rank writes its cursor), and each slot's draws on a batch are seeded by the
    slot's place among all groups' slots and the batch's number: a run continues exactly on any
    layout with the same number of groups (data-parallel ranks x micro-batches / video_sync_group).
    """
    sharded_micro_batches = False  # one shard per sync group (data_shards), not per micro-batch

    def __init__(self, job: PyramidARJobConfig, world, dims, cp=None):
        # Refused before anything is built: ranks x micro-batches that cannot hold whole groups.
        self.plan = SyncPlan.of(job.ar.video_sync_group, dims.dp, dims.dp_rank_of(world.rank),
                                job.trainer.gradient_accumulation_steps)
        super().__init__(job, world, dims, cp)
        self.window, self.units_max = latent_window(job), window_units(job)
        # Noise, positions and history; caption dropout: one stream per slot, seeded for each batch
        # (in place of PackedTask's `generator` and `rng`, which this task does not draw from).
        self.generators = [torch.Generator() for _ in self.plan.slots]
        self.rngs = [random.Random() for _ in self.plan.slots]
        self.batches = 0                            # the held batch's number: the rotation counter
        self.slot_index = 0                         # which of this rank's slots the next micro-batch is
        # Checkpoints are saved at step boundaries, where every slot of the held batch has trained (k
        # divides the micro-batches of a step), so the next step starts with a new batch: nothing held
        # is saved; the streams, the rotation counter and the stage rotation follow from that batch.
        self.held: list[HeldSample] = []
        self.held_packing = 0.0

    def data_share(self) -> tuple[int, int]:
        # Every rank of a sync group reads the group's share: the same videos, by construction.
        return self.plan.loader_rank, self.plan.loader_size

    def build_loader(self, dims):
        return build_sharded_loader(self.job.data, tokens_of=self.tokens_of, dp_rank=self.plan.loader_rank,
                                    dp_size=self.plan.loader_size, seed=self.job.trainer.seed,
                                    latent_tokens_of=self.latent_tokens_of, fit=self.sample_fit(),
                                    writes_cursors=self.plan.slots[0] == 0)

    def data_shards(self) -> int:
        return self.plan.loader_size

    def seed_draws_for(self, batch) -> None:
        """Each slot's streams for a new batch of the group, from (seed, the slot's place among all
        groups' slots, the batch's number); its samples take the next places of the stage rotation."""
        for generator, rng, slot in zip(self.generators, self.rngs, self.plan.slots):
            seed_draws(generator, rng, self.job.trainer.seed, self.plan.virtual_rank(slot), batch.number)
        self.batches = batch.number
        self.stage_slot = self.plan.loader_rank + batch.first_sample

    # -- token budget ------------------------------------------------------------------------------
    @functools.lru_cache(maxsize=4096)  # noqa: B019 - the task lives as long as the run
    def latent_tokens_of(self, t: int, h: int, w: int) -> int:
        """Budgeted tokens of a sample whose latent is (t, h, w): the most any slot packs for it
        (its highest unit at the full-resolution stage carries the longest history)."""
        units = 1 + (min(t, self.window) - 1) // self.job.ar.frame_per_unit
        return max(self.unit_tokens(stage, u, h, w) for stage in set(self.column_stages)
                   for u in range(1, units + 1))

    def unit_tokens(self, stage: int, units: int, h: int, w: int) -> int:
        """Tokens of a sample of `stage` training its `units`-th unit (history included)."""
        fpu, top = self.job.ar.frame_per_unit, self.job.pyramid.stages - 1
        frames = unit_frames(units, fpu)

        def tokens(level: int, t: int) -> int:
            gt, gh, gw = self.model.patch_grid((0, t, h >> (top - level), w >> (top - level)))
            return gt * gh * gw

        spans = history_spans(stage, units, frames, fpu)
        history = sum(tokens(level, end - start) for level, start, end in spans)
        return history + tokens(stage, min(fpu, frames))

    # -- one micro-batch ---------------------------------------------------------------------------
    def hold(self, batch) -> None:
        """Take a new batch for this rank's slots: window-cut pyramids, stages, caption features."""
        fpu = self.job.ar.frame_per_unit
        self.seed_draws_for(batch)
        stages = self.next_stages(len(batch.samples))
        feats = self.caption_features(batch.samples)
        raws = [self.raw_latent(sample)[:, :self.window] for sample in batch.samples]   # [C, T, H, W] each
        units = [1 + (raw.shape[1] - 1) // fpu for raw in raws]
        pyramids = latent_pyramids([raw[None, :, :unit_frames(n, fpu)] for raw, n in zip(raws, units)],
                                   self.job.pyramid)
        self.held = [HeldSample(sample.sample_id, levels, n, stage, text)
                     for sample, levels, n, stage, text in zip(batch.samples, pyramids, units, stages, feats)]
        self.held_packing = batch.packing_efficiency
        self.bad_samples += sum(batch.skipped.values())

    def slot_units(self, slot: int) -> list[int]:
        """The unit each stage's samples train in `slot` for the current batch (the rotation)."""
        return stage_unit_counts(step=self.batches, rank=slot, video_sync_group=self.plan.group,
                                 frame_per_unit=self.job.ar.frame_per_unit, max_frames=self.window,
                                 clip_units=self.units_max, stages=self.job.pyramid.stages)

    def prepare_slot(self, slot_index: int, draws: Draws | None = None) -> PyramidInputs:
        """The held batch as slot `slot_index` trains it: each sample noised at its unit, with the
        slot's random stream (or `draws`, e.g. recorded ones)."""
        draws = draws or GeneratorDraws(self.generators[slot_index])
        rng, p = self.rngs[slot_index], self.job.tasks.cfg_drop_prob
        units = self.slot_units(self.plan.slots[slot_index])
        texts = [self.empty if rng.random() < p else h.text for h in self.held]  # every sample, every slot
        chosen = [(h, units[h.stage], text, True) for h, text in zip(self.held, texts)
                  if units[h.stage] <= h.units]
        if not chosen:  # every clip is shorter than this slot's units: a zero-weight placeholder
            chosen = [(self.held[0], 1, texts[0], False)]
        samples = [UnitSample(f"{h.sample_id}#unit{u}", noise_unit(h.levels, h.stage, u, self.schedule, draws,
                                                      frame_per_unit=self.job.ar.frame_per_unit,
                                                      flow=self.job.flow), text, trained)
                   for h, u, text, trained in chosen]
        inputs = unit_inputs(self.model, samples, self.world.device, self.job.flow, self.schedule)
        return dataclasses.replace(inputs, packing=self.held_packing, bad_samples=self.bad_samples)

    def next_batch(self, loader) -> tuple[PyramidInputs, float]:
        t0 = time.perf_counter()
        inputs = None
        if self.reads_data:
            if self.slot_index == 0:
                self.hold(next(loader))
            inputs = self.prepare_slot(self.slot_index)
        waited = time.perf_counter() - t0
        self.slot_index = (self.slot_index + 1) % len(self.plan.slots)
        return self.share(inputs), waited

    def train_step(self, ctx: StepContext, micro_batches: list) -> dict[str, float]:
        """The default step; a step whose every micro-batch is a placeholder (all clips shorter than
        all slots' units) changes no weight: the LR schedule still advances."""
        part = ctx.parts["transformer"]
        if global_sum(sum(self.loss_count(mb) for mb in micro_batches)) == 0:
            part.scheduler.step()
            return {"loss": 0.0, "grad_norm": 0.0}
        return super().train_step(ctx, micro_batches)

    # -- validation --------------------------------------------------------------------------------
    def sample_clips(self, model: nn.Module, prompts: list[str], seed: int) -> list[Tensor]:
        """One clip a prompt (prompt i from seed + i), generated unit by unit, `sample_batch_size`
        prompts together; each unit and each prompt logged as it is done (sampling a demo's prompts
        takes tens of seconds on a CPU, a real model's minutes on a GPU)."""
        v, log, clips = self.job.validation, get_logger(), []
        for first, batch, seeds in prompt_batches(prompts, seed, v.sample_batch_size):
            t0 = time.perf_counter()
            which = f"prompt {first + 1}" if len(batch) == 1 else f"prompts {first + 1}-{first + len(batch)}"
            latents = sample_ar_latents(
                self, model, batch, seeds, num_frames=v.sample_num_frames,
                height=v.sample_height, width=v.sample_width,
                on_unit=lambda done, units: log.info("sampling %s of %d: unit %d/%d (%.1f s)", which, len(prompts),
                                                     done, units, time.perf_counter() - t0))
            clips += [decode(self, latent) for latent in latents.split(1)]
            for i, prompt in enumerate(batch):
                log.info("sampled %d/%d (%.1f s): %s", first + i + 1, len(prompts), time.perf_counter() - t0, prompt)
        return clips

"""Pyramid-Flow autoregressive training (`pyramid_flow_ar`): temporal-pyramid flow matching of units.

A clip (at most the latent frames of `max_frames`) is cut into units of `frame_per_unit` latent
frames, the first unit being frame 0 alone (an image: image-to-video and continuation come for
free). Each packed sample trains ONE unit at one pyramid stage: that unit is noised on the stage's
line (`pan.diffusion.pyramid.noise_unit`) and is the only clip in the loss; the units before it are
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
from pathlib import Path
from typing import ClassVar

import torch
from torch import Tensor, nn

from pan.config.core import knob, require
from pan.diffusion.pyramid import (Draws, GeneratorDraws, NoisedColumn, denormalize_latent, history_spans,
                                   latent_pyramid, noise_unit, normalize_latent, stage_unit_counts,
                                   unit_frames)
from pan.encoders.pyramid_text import TextFeatures
from pan.models.packing import PackInfo
from pan.recipes import Recipe
from pan.recipes.contract import StepContext, global_sum
from pan.recipes.pyramid_flow import (PyramidInputs, PyramidJobConfig, PyramidModelConfig, PyramidTask,
                                      PyramidValidationConfig, build_dit)

# Template values left in a run YAML (the original's `/PATH/...`, `/path/to/...`, `<...>`).
PLACEHOLDER_MARKS = ("/PATH/", "/path/to/", "<")


# ------------------------------------------------------------------------------------------------
# Keys
# ------------------------------------------------------------------------------------------------

@dataclass(kw_only=True)
class PyramidARModelConfig(PyramidModelConfig):
    interp_condition_pos: bool | None = knob(
        None, "history clips take RoPE h/w positions interpolated onto the trained unit's grid "
              "(false: each clip's own integer grid); null = the variant's config.json value (true "
              "as released; pan model: true)")

    SWITCHES: ClassVar[tuple[str, ...]] = ("use_temporal_causal", "interp_condition_pos")

    def check(self, job) -> None:
        path = self.model_path or ""
        require(not any(mark in path for mark in PLACEHOLDER_MARKS), "model_path",
                f"is still the template's placeholder {path}: set it to the folder of your downloaded "
                "release (e.g. pyramid-flow-miniflux), in the YAML or as --model_path <dir>.")
        require(self.model_variant != "diffusion_transformer_image", "model_variant",
                "is the image DiT, which the original trains on images only (--task t2i); "
                "autoregressive video training starts from diffusion_transformer_384p or _768p.")
        super().check(job)


@dataclass(kw_only=True)
class AutoregressiveConfig:
    SECTION: ClassVar[str] = "autoregressive"

    frame_per_unit: int = knob(1, "latent frames per autoregressive unit (the first unit is frame 0 "
                                  "alone); the original's --frame_per_unit", ge=1)
    video_sync_group: int = knob(
        8, "slots that read the same videos and train different unit positions of them: g "
           "data-parallel ranks x k micro-batches of each (g = gcd(data-parallel size, group)); "
           "the units of max_frames must be a multiple of it (the original's --video_sync_group)", ge=1)

    def check(self, job) -> None:
        window = latent_window(job)
        units = window_units(job)
        fpu, group = self.frame_per_unit, self.video_sync_group
        require((window - 1) % fpu == 0, "frame_per_unit",
                f"is {fpu}, but max_frames {job.data.max_frames} gives {window} latent frames, and "
                f"(latent frames - 1) % frame_per_unit must be 0 (units of {fpu} frames after the "
                f"first frame). Use a max_frames of 1 + a multiple of {fpu} latent frames.")
        require(units % group == 0, "video_sync_group",
                f"is {group}, but max_frames {job.data.max_frames} gives {units} units of "
                f"{fpu} latent frame(s) (the original's max_frames % video_sync_group == 0, in units): "
                f"the group's rotation must cover every unit. Use a divisor of {units} "
                f"({', '.join(str(d) for d in range(1, units + 1) if units % d == 0)}).")
        ratio_total = sum(job.pyramid.sample_ratios)
        require(job.data.max_samples_per_batch % ratio_total == 0, "max_samples_per_batch",
                f"is {job.data.max_samples_per_batch}, but samples take the pyramid stages in turn in "
                f"cycles of sum(sample_ratios) = {ratio_total}: a full batch must hold whole cycles "
                f"(the original's per-device batch_size % {ratio_total} == 0). Use a multiple of "
                f"{ratio_total}.")


@dataclass(kw_only=True)
class PyramidARValidationConfig(PyramidValidationConfig):
    sample_video_steps: list[int] = knob([10, 10, 10], "Euler steps of each pyramid stage for every "
                                                       "unit after the first (sample_steps: the first)", ge=1)
    sample_video_guidance_scale: float = knob(
        5.0, "classifier-free guidance scale of every unit after the first (sample_guidance_scale: "
             "the first, an image)", ge=0.0)
    sample_max_history_units: int | None = knob(
        None, "when sampling, condition each unit on at most this many previous units (long clips "
              "beyond max_frames); null = the whole clip so far, as the original", ge=1)

    def check(self, job) -> None:
        super().check(job)
        require(len(self.sample_video_steps) == job.pyramid.stages, "sample_video_steps",
                f"needs one step count per pyramid stage ({job.pyramid.stages}), got {self.sample_video_steps}.")


@dataclass(kw_only=True)
class PyramidARJobConfig(PyramidJobConfig):
    recipe: str = "pyramid_flow_ar"
    model: PyramidARModelConfig = knob(PyramidARModelConfig(), "")
    ar: AutoregressiveConfig = knob(AutoregressiveConfig(), "")
    validation: PyramidARValidationConfig = knob(PyramidARValidationConfig(), "")


def latent_window(job) -> int:
    """Latent frames of `max_frames` pixel frames: the longest clip a sample trains on."""
    from pan.encoders.vae import vae_geometry
    return (job.data.max_frames - 1) // vae_geometry(job.vae).temporal_factor + 1


def window_units(job) -> int:
    """M: units in the latent frames of max_frames (the original's max_units_in_training)."""
    return 1 + (latent_window(job) - 1) // job.ar.frame_per_unit


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


def unit_inputs(model: nn.Module, samples: list[UnitSample], device) -> PyramidInputs:
    """Pack unit samples: each sample's clips (history oldest first, the noisy unit last) as one
    stacked layout of the model's rule; only the last clip's tokens carry a target and a weight."""
    xs, targets, weights, timesteps, layouts, texts = [], [], [], [], [], []
    for s in samples:
        clips = [c[0] for c in s.noised.clips]                                   # [C, t, h, w] each
        grids = [model.patch_grid(c.shape) for c in clips]
        tokens = [model.patchify(c.to(device)) for c in clips]
        unit = model.target_tokens(s.noised.target[0].to(device))                # [n, out]
        history_rows = sum(t.shape[0] for t in tokens[:-1])
        xs.append(torch.cat(tokens))
        targets.append(torch.cat([unit.new_zeros(history_rows, unit.shape[1]), unit]))
        scale = 1.0 / s.noised.target.numel() if s.trained else 0.0
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
    elastic_data = True

    def __init__(self, job: PyramidARJobConfig, world, dims, cp=None):
        # Refused before anything is built: ranks x micro-batches that cannot hold whole groups.
        self.plan = SyncPlan.of(job.ar.video_sync_group, dims.dp, dims.dp_rank_of(world.rank),
                                job.trainer.gradient_accumulation_steps)
        super().__init__(job, world, dims, cp)
        self.window, self.units_max = latent_window(job), window_units(job)
        # Noise, positions and history; caption dropout: one stream per slot, seeded for each batch.
        self.generators = [torch.Generator() for _ in self.plan.slots]
        self.rngs = [random.Random() for _ in self.plan.slots]
        self.batches = 0                            # the held batch's number: the rotation counter
        self.slot_index = 0                         # which of this rank's slots the next micro-batch is
        self.held: list[HeldSample] = []
        self.held_packing = 0.0

    def data_share(self) -> tuple[int, int]:
        # Every rank of a sync group reads the group's share: the same videos, by construction.
        return self.plan.loader_rank, self.plan.loader_size

    def build_loader(self, dims):
        from pan.data.loader import build_sharded_loader

        return build_sharded_loader(self.job.data, tokens_of=self.tokens_of, dp_rank=self.plan.loader_rank,
                                    dp_size=self.plan.loader_size, seed=self.job.trainer.seed,
                                    latent_tokens_of=self.latent_tokens_of,
                                    writes_cursors=self.plan.slots[0] == 0)

    def data_shards(self) -> int:
        return self.plan.loader_size

    def seed_draws_for(self, batch) -> None:
        """Each slot's streams for a new batch of the group, from (seed, the slot's place among all
        groups' slots, the batch's number); its samples take the next places of the stage rotation."""
        from pan.data.loader import seed_draws

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
        self.held = []
        for sample, stage, text in zip(batch.samples, stages, feats):
            raw = self.raw_latent(sample)[:, :self.window]                       # [C, T, H, W]
            units = 1 + (raw.shape[1] - 1) // fpu
            latent = normalize_latent(raw[None, :, :unit_frames(units, fpu)], self.job.pyramid)
            self.held.append(HeldSample(sample.sample_id, latent_pyramid(latent.cpu(), self.job.pyramid.stages),
                                        units, stage, text))
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
        inputs = unit_inputs(self.model, samples, self.world.device)
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
        if self.cp is not None:
            inputs = self.cp.distribute(inputs)
        return inputs.to(self.world.device), waited

    def train_step(self, ctx: StepContext, micro_batches: list) -> dict[str, float]:
        """The default step; a step whose every micro-batch is a placeholder (all clips shorter than
        all slots' units) changes no weight: the LR schedule still advances."""
        part = ctx.parts["transformer"]
        if global_sum(sum(self.loss_count(mb) for mb in micro_batches)) == 0:
            part.scheduler.step()
            return {"loss": 0.0, "grad_norm": 0.0}
        return super().train_step(ctx, micro_batches)

    # -- checkpoint --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        # Saved at step boundaries, where every slot of the held batch has trained (k divides the
        # micro-batches of a step), so the next step starts with a new batch: nothing held to save;
        # the streams, the rotation counter and the stage rotation follow from that batch.
        return {"bad_samples": self.bad_samples}

    def load_state_dict(self, state: dict) -> None:
        self.bad_samples = state["bad_samples"]

    # -- validation --------------------------------------------------------------------------------
    def sample_clips(self, model: nn.Module, prompts: list[str], seed: int) -> list[Tensor]:
        v = self.job.validation
        return [decode(self, sample_ar_latent(self, model, prompt, num_frames=v.sample_num_frames,
                                              height=v.sample_height, width=v.sample_width, seed=seed + i))
                for i, prompt in enumerate(prompts)]


# ------------------------------------------------------------------------------------------------
# Sampling: unit by unit (validation and `pan sample`)
# ------------------------------------------------------------------------------------------------

def history_velocity(model: nn.Module, features: list[TextFeatures]):
    """velocity_given(history, stage) -> velocity(x [b, C, f, h, w], t [b]): one packed forward of the
    b samples, sample i = [its history clips; x[i]] with caption features[i]; the prediction of
    the last clip only."""
    def given(history: list[Tensor], stage: int):
        def velocity(x: Tensor, t: Tensor) -> Tensor:
            texts = [f.caption_rows().float().to(x.device) for f in features]
            tokens, layouts = [], []
            for i, text in enumerate(texts):
                clips = [h[i] for h in history] + [x[i]]
                layouts.append(model.sample_layout([model.patch_grid(c.shape) for c in clips], text.shape[0]))
                tokens.append(torch.cat([model.patchify(c) for c in clips]))
            pooled = torch.stack([f.pooled_prompt_embed.float() for f in features]).to(x.device)
            out = model(torch.cat(tokens), t.to(x.device).float(), torch.cat(texts), pooled,
                        PackInfo.from_layouts(layouts, device=x.device))
            preds, end = [], 0
            for layout in layouts:
                end += layout.video_len
                last = layout.clips[-1]
                preds.append(model.unpatchify(out[end - last.tokens:end], last.grid))
            return torch.stack(preds).float()
        return velocity
    return given


def sample_ar_latent(task: PyramidFlowARTask, model: nn.Module, prompt: str, *, num_frames: int, height: int,
                     width: int, seed: int, context: Tensor | None = None, steps=None, video_steps=None,
                     guidance_scale: float | None = None, video_guidance_scale: float | None = None,
                     max_history_units: int | None = None) -> Tensor:
    """One normalised latent clip [1, C, T, H, W] for `prompt`, generated unit by unit after the
    normalised `context` (whole units: a first image, or a clip to continue)."""
    from pan.diffusion.pyramid_sampler import sample_autoregressive

    v, device = task.job.validation, task.world.device
    c, t, h, w = task.geometry.latent_shape(num_frames, height, width)
    fpu = task.job.ar.frame_per_unit
    t = unit_frames(1 + (t - 1) // fpu, fpu)  # whole units
    generator = torch.Generator().manual_seed(seed)
    noise = torch.randn((1, c, t, h, w), generator=generator).to(device)
    cond = history_velocity(model, [task.text_encoder.encode([prompt])[0].to(device)])
    uncond = history_velocity(model, [task.empty.to(device)])
    return sample_autoregressive(
        cond, noise, task.schedule, steps or v.sample_steps, GeneratorDraws(generator), frame_per_unit=fpu,
        video_steps=video_steps or v.sample_video_steps, context=context,
        max_history_units=max_history_units if max_history_units is not None else v.sample_max_history_units,
        uncond_given=uncond,
        guidance_scale=v.sample_guidance_scale if guidance_scale is None else guidance_scale,
        video_guidance_scale=(v.sample_video_guidance_scale if video_guidance_scale is None
                              else video_guidance_scale))


def decode(task: PyramidFlowARTask, latent: Tensor) -> Tensor:
    """Normalised latent [1, C, T, H, W] -> frames [T', 3, H', W'] in [-1, 1]."""
    raw = denormalize_latent(latent, task.job.pyramid)[0]
    return task.vae.decode(task.vae.normalize(raw))


def context_latent(task: PyramidFlowARTask, path: str, *, frames: int, height: int, width: int) -> Tensor:
    """An image (first frame) or the first `frames` frames of a video -> normalised latent
    [1, C, Tc, H, W] cut to whole units."""
    from pan.sampling import SampleSettings, load_condition

    settings = SampleSettings(num_frames=frames, height=height, width=width)
    encoded = load_condition(path, frames, settings, task.vae, task.world.device)     # pan-normalised
    raw = task.vae.unnormalize(encoded)
    fpu = task.job.ar.frame_per_unit
    units = 1 + (raw.shape[1] - 1) // fpu
    return normalize_latent(raw[None, :, :unit_frames(units, fpu)], task.job.pyramid)


RECIPE = Recipe(name="pyramid_flow_ar", job_config=PyramidARJobConfig, task=PyramidFlowARTask,
                description="Pyramid-Flow autoregressive temporal-pyramid flow matching with video sync groups",
                sample="pan.recipes.pyramid_flow_ar:sample_main")


def sample_main(job: PyramidARJobConfig, argv: list[str]) -> int:
    """`pan sample` for a pyramid_flow_ar run: unit by unit, each through the spatial pyramid, with
    CFG; from text, from a first image (--image) or continuing a clip (--video)."""
    import argparse

    from pan.media import to_uint8_frames, write_gif, write_mp4
    from pan.parallel.dims import ParallelDims
    from pan.parallel.world import World
    from pan.sampling import resolve_weights

    v = job.validation
    parser = argparse.ArgumentParser(prog="pan sample", description="Generate videos autoregressively "
                                     "from a pyramid_flow_ar checkpoint (unit by unit, with CFG).")
    parser.add_argument("--checkpoint", required=True, type=Path)
    parser.add_argument("--config")
    parser.add_argument("--prompt", action="append", required=True)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--image", help="first frame (image-to-video): generation continues after it")
    parser.add_argument("--video", help="a clip whose first --video-frames frames are continued")
    parser.add_argument("--video-frames", type=int, default=None,
                        help="pixel frames taken from --video (default: 1 + one VAE frame group)")
    parser.add_argument("--num-frames", type=int, default=v.sample_num_frames, help="pixel frames in all")
    parser.add_argument("--height", type=int, default=v.sample_height)
    parser.add_argument("--width", type=int, default=v.sample_width)
    parser.add_argument("--steps", type=int, nargs="+", default=v.sample_steps, help="first unit")
    parser.add_argument("--video-steps", type=int, nargs="+", default=v.sample_video_steps, help="later units")
    parser.add_argument("--guidance-scale", type=float, default=v.sample_guidance_scale)
    parser.add_argument("--video-guidance-scale", type=float, default=v.sample_video_guidance_scale)
    parser.add_argument("--max-history-units", type=int, default=v.sample_max_history_units,
                        help="condition each unit on at most this many previous units")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fps", type=float, default=v.sample_fps)
    parser.add_argument("--ema", action="store_true")
    args = parser.parse_args(argv)
    if args.image and args.video:
        parser.error("give --image or --video, not both")
    if args.max_history_units is not None and args.max_history_units < 1:
        parser.error("--max-history-units must be >= 1")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    world = World(rank=0, size=1, local_rank=0, local_size=1, device=device)
    dims = ParallelDims.from_config(job.parallel, 1, 1)
    task = PyramidFlowARTask(dataclasses.replace(job, ar=dataclasses.replace(job.ar, video_sync_group=1)),
                             world, dims)
    weights, _ = resolve_weights(args.checkpoint, args.ema)
    model = build_dit(job)
    model.to_empty(device="cpu")
    model.load_state_dict(weights)
    model.to(device).eval()
    task.load_encoders()
    context = None
    if args.image or args.video:
        frames = 1 if args.image else (args.video_frames or 1 + task.geometry.temporal_factor)
        context = context_latent(task, args.image or args.video, frames=frames, height=args.height,
                                 width=args.width)
    steps = lambda s: s if len(s) > 1 else s[0]  # noqa: E731 - one count for every stage
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for i, prompt in enumerate(args.prompt):
        latent = sample_ar_latent(task, model, prompt, num_frames=args.num_frames, height=args.height,
                                  width=args.width, seed=args.seed + i, context=context,
                                  steps=steps(args.steps), video_steps=steps(args.video_steps),
                                  guidance_scale=args.guidance_scale,
                                  video_guidance_scale=args.video_guidance_scale,
                                  max_history_units=args.max_history_units)
        frames = to_uint8_frames(decode(task, latent))
        out = args.out if len(args.prompt) == 1 else args.out.with_name(f"{args.out.stem}_{i:02d}.mp4")
        write_mp4(out, frames, args.fps)
        write_gif(out.with_suffix(".gif"), frames, args.fps)
        print(f"{out}  <- {prompt!r}")
    return 0


import pan.recipes.pyramid_ar_checks  # noqa: E402, F401 - registers the launch workflow and `pan check` rows

"""Launch rules, `pan check` rows and the memory probe of the `pyramid_flow_ar` recipe (its `checks`,
`probe` and workflow `check` hooks).

The workflow `pyramid-flow-ar` (declared in the recipe's `RECIPE`) is the original's
`scripts/train_pyramid_flow.sh`: autoregressive temporal-pyramid fine-tuning of a released DiT with
video sync groups. `pan launch-command` refuses it for the full-sequence workflow's launch rules
(template placeholders, a variant of another resolution than the buckets, buckets whose pyramid
stages do not cut into patches) and for the autoregressive invariants: those of the config alone
are refused when it loads (`(latent frames of max_frames - 1) % frame_per_unit == 0`, units of
max_frames a multiple of video_sync_group, max_samples_per_batch a multiple of sum(sample_ratios));
the one of the layout, data-parallel size x gradient_accumulation_steps a multiple of
video_sync_group, by `pan check` and by the trainer before anything is built (see
`sync_group_rule`).

`pan check` adds to the full-sequence recipe's rows: the sync groups of the planned world, the unit
rule, and for annotation files whether a sample of rows has a `latent` and `text` or `text_fea`,
and how their latent frame counts compare with the latent frames of max_frames.
"""

from __future__ import annotations

import math

from pan.config.core import ErrorCollector
from pan.data.decode import SkipSample
from pan.data.reader import open_sources, read_raw_latent
from pan.diffusion.pyramid_units import history_spans, stage_unit_counts, unit_frames
from pan.encoders.vae import vae_geometry
from pan.preflight.checks import (
    check_cpu,
    check_layout,
    check_memory,
    check_output_dir,
    check_resume,
    check_step_time,
    check_warm_start,
    spread_rows,
    unopened_row,
)
from pan.preflight.core import Preflight, Row
from pan.recipes.pyramid_flow import checks as shared
from pan.recipes.pyramid_flow.probe import largest_batch_clips, level_shape, pyramid_probe
from pan.recipes.pyramid_flow.rules import (
    check_frame_rule,
    check_stage_sizes_rule,
    check_variant_resolution_rule,
    refuse_placeholders,
)
from pan.recipes.pyramid_flow_ar.config import latent_window, window_units
from pan.recipes.pyramid_flow_ar.task import SyncPlan

# ------------------------------------------------------------------------------------------------
# Launch rules
# ------------------------------------------------------------------------------------------------

def sync_group_rule(job, dims) -> None:
    """Data-parallel ranks x micro-batches must split into whole sync groups (raises ConfigError)."""
    SyncPlan.of(job.ar.video_sync_group, dims.dp, 0, job.trainer.gradient_accumulation_steps)


def check_launch(job, dims=None) -> None:
    """The workflow's refusals, all reported together (the sync-group rule when the layout is known)."""
    problems = ErrorCollector()
    rules = [refuse_placeholders, check_variant_resolution_rule, check_stage_sizes_rule, check_frame_rule]
    if dims is not None:
        rules.append(lambda j: sync_group_rule(j, dims))
    for rule in rules:
        with problems.gather():
            rule(job)
    problems.raise_any()


# ------------------------------------------------------------------------------------------------
# `pan check`
# ------------------------------------------------------------------------------------------------

def check_sync_group(ctx: Preflight) -> list[Row]:
    """GPU count and accumulation against video_sync_group: how the groups are laid out."""
    job = ctx.job
    sync_group_rule(job, ctx.dims)
    plan = ctx.task.plan
    group, units = job.ar.video_sync_group, window_units(job)
    micro = job.trainer.gradient_accumulation_steps
    detail = (f"{ctx.dims.dp} data-parallel rank(s) x {micro} micro-batch(es) = {plan.loader_size} sync "
              f"group(s) per batch read, each {plan.ranks} rank(s) x {group // plan.ranks} micro-batch(es) "
              f"= video_sync_group {group}")
    if group < units:
        return [Row("sync group", "warn", detail + f"; each video trains {group} of its {units} units (the "
                    f"rotation moves the group's units batch by batch).", f"set video_sync_group: {units} "
                    "(with gradient_accumulation_steps so that ranks x micro-batches is a multiple of it) "
                    "to train every unit of every video.")]
    return [Row("sync group", "pass", detail + "; every unit of every video is trained once per group.")]


def check_units(ctx: Preflight) -> list[Row]:
    job = ctx.job
    task = ctx.task
    largest = max(job.data.buckets(), key=lambda hw: hw[0] * hw[1])
    _, t, h, w = task.geometry.latent_shape(job.data.frame_count_range()[-1], *largest)
    tokens = task.latent_tokens_of(t, h, w)
    row = Row("units", "pass", f"max_frames {job.data.max_frames} pixel frames = {latent_window(job)} latent frames = "
              f"{window_units(job)} units of {job.ar.frame_per_unit} frame(s); a {t}-frame "
              f"{largest[1]}x{largest[0]} clip packs at most {tokens} tokens (its last unit at full "
              f"resolution with its history)")
    budget = job.data.max_tokens_per_batch
    if tokens > budget:
        return [Row("units", "fail", row.detail + f", over max_tokens_per_batch {budget}: such clips are "
                    "skipped.", f"raise max_tokens_per_batch to at least {tokens} or use smaller clips.")]
    return [Row("units", "pass", row.detail + f", within max_tokens_per_batch {budget}.")]


def check_annotation_rows(ctx: Preflight) -> list[Row]:
    """A sample of each annotation file's video rows: a `latent` (the original's AR training reads
    precomputed latents) and a caption (`text`, encoded online unless `text_fea` is given); latent
    frame counts against the latent frames of max_frames."""

    job, rows = ctx.job, []
    window, fpu = latent_window(job), job.ar.frame_per_unit
    tf = vae_geometry(job.vae).temporal_factor
    for opened in open_sources(job.data, ("annotations",)):
        if opened.source is None:
            rows.append(unopened_row("annotation rows", opened))
            continue
        path, source = opened.label, opened.source
        size = len(source)
        picks = spread_rows(ctx.sample_rows, size)   # first, last, between
        no_text, no_latent, short, long, frames = [], [], [], [], []
        for index in picks:
            try:
                row = source.parse(index)
            except SkipSample as e:
                no_text.append(f"#{index} {e.reason}")
                continue
            if row.kind != "video":
                continue
            if row.latent is None:
                no_latent.append(index)
                continue
            try:
                t = read_raw_latent(row.latent).shape[1]
            except Exception as e:  # noqa: BLE001 - reported as the row's problem
                rows.append(Row("annotation rows", "fail", f"{path} row {index}: {e}", "fix the latent file."))
                continue
            frames.append(t)
            if t < window:
                short.append(f"#{index} ({t})")
            elif t > window:
                long.append(f"#{index} ({t})")
        detail = f"{path}: rows {picks}, latent frames {frames or 'none'} against {window} (max_frames)"
        if no_text:
            rows.append(Row("annotation rows", "fail", detail + f"; rows {', '.join(no_text)} cannot be "
                            "read (a row needs a caption `text`, with `text_fea` optional, and a `latent` "
                            "or `video`).", "fix those rows; `pan data precompute` writes `latent` and "
                            "`text_fea` beside `text`."))
        elif no_latent and job.vae.vae_type == "identity":
            rows.append(Row("annotation rows", "fail", detail + f"; rows {no_latent} have no `latent` and "
                            "vae_type is identity, so they would train on pixels.", "precompute the latents "
                            "(`pan data precompute`) or set vae_type: causal_video_vae."))
        elif short or no_latent or long:
            notes, fixes = [], []
            if long:
                notes.append(f"rows {', '.join(long)} are longer: only their first {window} latent frame(s) "
                             f"train, the rest is never seen (max_frames {job.data.max_frames} counts pixel "
                             f"frames: {window} latent frame(s) through the {job.vae.vae_type} VAE)")
                longest = max(frames)
                fixes.append(f"to train whole latents of {longest} frames set max_frames: "
                             f"{1 + (longest - 1) * tf} (1 + {tf} x ({longest} - 1) pixel frames)")
            if short:
                notes.append(f"rows {', '.join(short)} are shorter: slots whose unit they lack skip them")
            if no_latent:
                notes.append(f"rows {no_latent} have no `latent` and are encoded online by the VAE")
            if short or no_latent:
                fixes.append("precompute latents of max_frames for every row to train every unit")
            rows.append(Row("annotation rows", "warn", detail + "; " + "; ".join(notes) + ".",
                            "; ".join(fixes) + "."))
        else:
            cut = any((t - 1) % fpu for t in frames)
            rows.append(Row("annotation rows", "pass", detail + ("; frames past the last whole unit are "
                            "dropped." if cut else "; every sampled row fills the window.")))
    if not rows:
        rows.append(Row("annotation rows", "pass", "no annotation files (video CSVs / image tars only)."))
    return rows


# ------------------------------------------------------------------------------------------------
# Memory and step time (pan/estimate/)
# ------------------------------------------------------------------------------------------------

def unit_sample(task, stage: int, unit: int, t: int, h: int, w: int) -> list[tuple[int, int, int]]:
    """Latent shapes of a sample of `stage` training its `unit`-th unit: its history clips oldest
    first, then the unit (as `pan.diffusion.pyramid.noise_unit` makes them)."""
    fpu = task.job.ar.frame_per_unit
    frames = unit_frames(unit, fpu)
    history = [level_shape(task, end - start, h, w, level)
               for level, start, end in reversed(history_spans(stage, unit, frames, fpu))]
    return history + [level_shape(task, min(fpu, frames), h, w, stage)]


def slot_batches(task, clips: list[tuple[int, int, int]]):
    """Every micro-batch a slot can make of `clips` (full-resolution latent shapes): for each turn
    of the rotation, slot of the group and place the stage rotation starts at, the samples whose
    clip holds the slot's unit at the sample's stage (`PyramidFlowARTask.prepare_slot`)."""
    job, cycle = task.job, task.column_stages
    group, fpu = job.ar.video_sync_group, job.ar.frame_per_unit
    for turn in range(task.units_max // group):
        for slot in range(group):
            units = stage_unit_counts(step=turn, rank=slot, video_sync_group=group, frame_per_unit=fpu,
                                      max_frames=task.window, clip_units=task.units_max, stages=job.pyramid.stages)
            for start in range(len(cycle)):
                stages = [cycle[(start + i) % len(cycle)] for i in range(len(clips))]
                yield [unit_sample(task, stage, units[stage], *clip) for stage, clip in zip(stages, clips)
                       if units[stage] <= 1 + (min(clip[0], task.window) - 1) // fpu]


def ar_probe(ctx: Preflight):
    """The recipe's largest micro-batch: the fullest pack of the largest clips, each trained at the
    unit the sync slot gives its stage, history included; of all slots, turns of the rotation and
    stage orders, the one with the most tokens."""
    task = ctx.task
    clips = largest_batch_clips(ctx, task)
    tokens = lambda samples: sum(math.prod(task.model.patch_grid((0, *c))) for s in samples for c in s)  # noqa: E731
    fullest = max(slot_batches(task, clips), key=tokens)
    return pyramid_probe(ctx, task, fullest, f"{len(fullest)} unit sample(s) of {len(clips)} clip(s), "
                                f"{sum(len(s) for s in fullest)} clips with their history")



# `pan check`'s table, in order: the layout and the sync groups, the units, the full-sequence
# recipe's rows of the launch rules and of what the run reads, the annotation rows, the machine and
# the output folder, then memory and step time (with `ar_probe`).
CHECKS = [check_layout, check_sync_group, check_units, shared.check_placeholders,
          shared.check_variant_resolution, shared.check_stage_sizes, shared.check_model_folder,
          check_warm_start, shared.check_text_encoders, shared.check_vae, shared.check_data,
          check_annotation_rows,
          check_cpu, check_output_dir, check_resume,
          check_memory, check_step_time]


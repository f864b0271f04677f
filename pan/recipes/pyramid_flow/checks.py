"""`pan check`'s rows of the `pyramid_flow` recipe (its `checks` hook; the autoregressive recipe
lists most of them too): the launch rules (rules.py) as rows, then what a launch will read: the
variant's weights (shapes from the safetensors headers), the text encoders (configs and tokenizer
files, their widths against the DiT's), the VAE against the DiT's latent channels, and a sample of
every data source's rows (annotation rows parse, their files exist, precomputed latents and text
features fit the DiT). The memory and step-time rows trace the probe (probe.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from pan.config.core import ConfigError, ErrorCollector, require
from pan.data.plan import Ref
from pan.data.reader import SampleReader, open_sources, rules_of
from pan.data.sources import AnnotationSource, SourceError, VideoCsvSource
from pan.encoders.pyramid_text import TextFeatureFileError, check_dit_widths, load_features
from pan.encoders.pyramid_text import check_text_encoders as released_layout
from pan.encoders.vae import vae_geometry
from pan.models.pyramid_io import WEIGHTS_INDEX_NAME, WEIGHTS_NAME
from pan.models.state_dict import ShapeDiff
from pan.preflight.checks import (
    check_cpu,
    check_layout,
    check_memory,
    check_output_dir,
    check_resume,
    check_step_time,
    check_warm_start,
    source_sizes,
    spread_rows,
    unopened_row,
    with_annotation_scan,
)
from pan.preflight.core import Preflight, Row
from pan.recipes.pyramid_flow.config import dit_config, variant_folder
from pan.recipes.pyramid_flow.precompute import EMPTY_TEXT_FEA
from pan.recipes.pyramid_flow.rules import (
    RELEASED_RESOLUTIONS,
    DiTShape,
    bucket_text,
    check_frame_rule,
    check_stage_batch_rule,
    check_stage_sizes_rule,
    check_variant_resolution_rule,
    dit_shape,
    path_keys,
    refuse_placeholders,
    resolution_class,
    stage_cycle,
    stage_unit,
)

# ------------------------------------------------------------------------------------------------
# The launch rules as rows
# ------------------------------------------------------------------------------------------------

def check_placeholders(ctx: Preflight) -> list[Row]:
    refuse_placeholders(ctx.job)
    return [Row("placeholders", "pass", f"no template path left in the {len(path_keys(ctx.job))} path keys.")]


def check_stage_batch(ctx: Preflight) -> list[Row]:
    """The batch rule, streams with a share per data-parallel rank, and whether a full stage cycle of
    the largest clips fits the token budget."""
    check_stage_batch_rule(ctx.job)
    job, task, rows = ctx.job, ctx.task, []
    cycle = stage_cycle(job)
    for name, size in source_sizes(job.data).items():
        if size < ctx.dims.dp:
            rows.append(Row("stage batch", "fail", f"{name} has {size} samples, fewer than the "
                            f"{ctx.dims.dp} data-parallel ranks that share it.", "add samples or use fewer ranks."))
    budget = job.data.max_tokens_per_batch
    summary = (f"stages rotate in cycles of {len(cycle)} ({cycle}); max_samples_per_batch "
               f"{job.data.max_samples_per_batch} holds whole cycles")
    if not _sources_encoded_online(job):  # precomputed latents: the data row checks each one's size
        return rows or [Row("stage batch", "pass", summary + "; every source is precomputed.")]
    frames = job.data.frame_count_range()[-1]
    largest = max(job.data.buckets(), key=lambda hw: hw[0] * hw[1])
    per_stage = [_stage_tokens(task, frames, *largest, stage, len(job.pyramid.sample_ratios)) for stage in cycle]
    summary += (f"; a cycle of {frames}-frame {bucket_text(*largest)} clips is {sum(per_stage)} tokens "
                f"({per_stage})")
    if sum(per_stage) > budget:
        rows.append(Row("stage batch", "warn", summary + f", over max_tokens_per_batch {budget}: batches "
                        "of such clips hold less than a cycle, so a step may miss a stage (the ratio "
                        "still holds over consecutive batches).", "raise max_tokens_per_batch to a "
                        "cycle's tokens, or use smaller clips."))
    if not rows:
        rows.append(Row("stage batch", "pass", summary + f", within max_tokens_per_batch {budget}."))
    return rows


def _stage_tokens(task, frames: int, height: int, width: int, stage: int, stages: int) -> int:
    """Tokens of one clip at a pyramid stage (the full-resolution latent halved stages-1-stage times)."""
    _, t, h, w = task.geometry.latent_shape(frames, height, width)
    down = 2 ** (stages - 1 - stage)
    gt, gh, gw = task.model.patch_grid((0, t, h // down, w // down))
    return gt * gh * gw


def check_variant_resolution(ctx: Preflight) -> list[Row]:
    check_variant_resolution_rule(ctx.job)
    m = ctx.job.model
    trained = RELEASED_RESOLUTIONS.get(m.model_variant)
    if m.model_name == "pan":
        return [Row("variant resolution", "pass", "pan's transformer: no released resolution to keep.")]
    if trained is None:
        return [Row("variant resolution", "warn", f"{m.model_variant} is not a released variant name, so "
                    "its training resolution is unknown and the buckets are not compared with it.",
                    "make sure resolution_buckets are the resolution this DiT was trained at.")]
    return [Row("variant resolution", "pass", f"{m.model_variant} was trained at {trained}; every bucket "
                f"({', '.join(ctx.job.data.resolution_buckets)}) is {trained}.")]


def check_stage_sizes(ctx: Preflight) -> list[Row]:
    problems = ErrorCollector()
    for rule in (check_stage_sizes_rule, check_frame_rule):
        with problems.gather():
            rule(ctx.job)
    problems.raise_any()
    uh, uw = stage_unit(ctx.job)
    return [Row("stage sizes", "pass", f"every bucket's latent is a multiple of {uw}x{uh} (W x H): "
                f"{ctx.job.pyramid.stages} stages of {dit_shape(ctx.job).patch} patches.")]


# ------------------------------------------------------------------------------------------------
# What the run will read
# ------------------------------------------------------------------------------------------------

def check_model_folder(ctx: Preflight) -> list[Row]:
    """The variant's config.json (read when the config loaded) and its weights' recorded shapes
    against the DiT built from it; no tensor data is read."""
    m = ctx.job.model
    if m.model_name == "pan":
        return [Row("model folder", "pass", "pan's transformer starts from its own init "
                    "(transformer_config_overrides); model_path only provides the text encoders.")]
    folder = variant_folder(m)
    stored = _weight_shapes(folder)
    diff = ShapeDiff.of(stored, ctx.model_shapes)
    missing, unexpected = diff.missing, diff.unexpected
    mismatched = [f"{n} {a} vs model {b}" for n, a, b in diff.mismatched]
    if missing or unexpected or mismatched:
        detail = "; ".join(f"{label}: {', '.join(items[:4])}{' ...' if len(items) > 4 else ''}"
                           for label, items in (("missing", missing), ("unexpected", unexpected),
                                                ("other shape", mismatched)) if items)
        return [Row("model folder", "fail", f"{folder}'s weights do not fit the {m.model_name} its "
                    f"config.json describes ({detail}).", "copy the variant folder of the release whole "
                    "(config.json and its safetensors together).")]
    rows = [Row("model folder", "pass", f"{folder}: config.json and {len(stored)} tensors of the shapes "
                f"it describes ({sum(math.prod(s) for s in stored.values()) / 1e6:,.1f}M parameters).")]
    config = dit_config(m)
    if config.use_gradient_checkpointing and not ctx.job.parallel.enable_gradient_checkpointing:
        rows.append(Row("model folder", "warn", f"{folder}/config.json sets use_gradient_checkpointing "
                        "(the original's command-line flag), but in pan enable_gradient_checkpointing "
                        "decides and it is false: the run keeps every activation.",
                        "set enable_gradient_checkpointing: true to checkpoint the blocks the variant's "
                        "gradient_checkpointing_ratio names (the original's docs ask for it at 768p)."))
    return rows


def _weight_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """name -> shape from the safetensors headers of a released folder (one file or shards)."""
    from safetensors import safe_open

    if (folder / WEIGHTS_NAME).is_file():
        files = [folder / WEIGHTS_NAME]
    elif (folder / WEIGHTS_INDEX_NAME).is_file():
        index = json.loads((folder / WEIGHTS_INDEX_NAME).read_text())
        files = [folder / f for f in sorted(set(index["weight_map"].values()))]
    else:
        raise ConfigError("model_variant", f"{folder} holds neither {WEIGHTS_NAME} nor {WEIGHTS_INDEX_NAME}: "
                                           "copy the variant folder of the release whole.")
    shapes = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})  # noqa: SIM118
    return shapes


def saved_empty_caption(job) -> Path | None:
    """The precomputed empty caption's features a run reads instead of loading the text encoders
    (`PyramidTask.empty_caption`): `text_fea/empty.pt` beside the first annotation file that has one."""
    for path in job.data.annotation_paths:
        saved = Path(path).parent / EMPTY_TEXT_FEA
        if saved.is_file():
            return saved
    return None


def _encodes_captions(ctx: Preflight) -> bool:
    try:
        return ctx.task.encodes_captions()
    except (SourceError, OSError, ConfigError):   # an unreadable file, a layout refused: other rows say it
        return True


def check_text_encoders(ctx: Preflight) -> list[Row]:
    """The released text encoders: every file, config and tokenizer length (no weights loaded), and
    their feature widths against the DiT's. A run whose rows all carry `text_fea`, with the empty
    caption's features precomputed beside them, never loads them: then the empty caption's file is
    checked instead, and missing encoders only matter to `pan sample` and validation prompts."""
    m = ctx.job.model
    name = "pyramid_flux" if m.model_name == "pan" else m.model_name
    shape = dit_shape(ctx.job)
    empty = None if _encodes_captions(ctx) else saved_empty_caption(ctx.job)
    if empty is not None:
        return [_precomputed_text_row(ctx, name, empty, shape)]
    layout = fitting_encoders(ctx, name, shape)
    roles = ", ".join(f"{s.role} ({s.model_dir})" for s in layout.slots)
    return [Row("text encoders", "pass", f"{roles} in {layout.folder}: captions {layout.caption_width} wide, "
                f"pooled {layout.pooled_width}; they fit the DiT.")]


def fitting_encoders(ctx: Preflight, name: str, shape: DiTShape):
    """The released text encoders' layout, refused (ConfigError) unless their widths fit the DiT."""
    layout = released_layout(ctx.job.text, name, ctx.job.model.model_path or "")
    if shape.pooled_width is None:
        require(layout.caption_width == shape.caption_width, "transformer_config_overrides.text_embed_dim",
                f"is {shape.caption_width}, but the T5 in {layout.folder} gives {layout.caption_width}-wide "
                f"features: set text_embed_dim: {layout.caption_width}.")
    else:
        check_dit_widths(layout, joint_attention_dim=shape.caption_width, pooled_projection_dim=shape.pooled_width)
    return layout


def _precomputed_text_row(ctx: Preflight, name: str, empty: Path, shape: DiTShape) -> Row:
    """The text encoders row of a run that reads every caption's features from `text_fea` files."""
    pooled = shape.pooled_width
    try:
        load_features(empty, caption_width=shape.caption_width, pooled_width=pooled)
    except TextFeatureFileError as e:
        return Row("text encoders", "fail", f"every annotation row carries `text_fea`, so training reads "
                   f"the empty caption's features from {empty} instead of loading the encoders: {e}",
                   "recompute it with `pan data precompute` (the encoders of this DiT), or delete it to "
                   "let the encoders make it.")
    detail = (f"not loaded in training: every annotation row carries `text_fea`, and the empty "
              f"caption's features (caption dropout) come from {empty}, which fits the DiT")
    folder, _ = ctx.job.text.folder(ctx.job.model.model_path or "")
    if not any((folder / slot).exists() for slot in ("text_encoder", "text_encoder_2", "text_encoder_3")):
        return Row("text encoders", "pass", detail + f"; {folder} holds no text encoders (`pan sample` and "
                   "validation prompts would need them: text_encoder_dir).")
    # Encoders that are there are what `pan sample` and validation prompts load: they must fit.
    layout = fitting_encoders(ctx, name, shape)
    return Row("text encoders", "pass", detail + f"; the encoders in {layout.folder} fit it too (`pan "
               "sample` and validation prompts load them).")


def check_vae(ctx: Preflight) -> list[Row]:
    """The VAE's latent channels against the DiT's: a must where rows are encoded online, else only
    validation samples (and `pan sample`) decode with it."""
    geometry = vae_geometry(ctx.job.vae)
    channels = dit_shape(ctx.job).latent_channels
    detail = (f"{ctx.job.vae.vae_type}: {geometry.latent_channels} latent channels, {geometry.temporal_factor}x "
              f"temporal, {geometry.spatial_factor}x spatial; the DiT takes {channels}")
    if geometry.latent_channels == channels:
        return [Row("vae", "pass", detail + ".")]
    online = _sources_encoded_online(ctx.job)
    if online:
        return [Row("vae", "fail", detail + f": {', '.join(online)} would be encoded by it and could not "
                    "train.", "use the VAE the DiT was trained with, or precompute the latents (annotation "
                    "rows with `latent`; `pan data precompute`).")]
    return [Row("vae", "warn", detail + ": every data source is precomputed, but validation samples and "
                "`pan sample` decode with this VAE.", "keep validation_interval: 0 until the DiT's VAE is "
                "configured.")]


def _sources_encoded_online(job) -> list[str]:
    """Data files some rows of which go through the VAE (no precomputed latent)."""
    online = list(job.data.image_tar_paths)
    for opened in open_sources(job.data, ("video_csv", "annotations")).opened:
        source = opened.source
        if (not source.precomputed if isinstance(source, VideoCsvSource) else
                source.rows_naming("latent") < len(source)):   # counted in the row index
            online.append(opened.label)
    return online


def check_data(ctx: Preflight) -> list[Row]:
    """Parse every source; read a sample of each one's rows as training will (files exist, latents
    and text features load or media decode) and check them against the DiT."""

    job = ctx.job
    opened = open_sources(job.data)
    rows = [unopened_row("data", o) for o in opened.failed]
    # The reader training uses, with what the DiT takes (the task's sample_fit, from the built model):
    # a row that does not fit is skipped as `unfit` here as it is in training.
    ctx.models  # noqa: B018 - the task's meta DiT, which sample_fit reads
    reader = SampleReader(opened.row_sources, opened.tars, rules_of(job.data), fit=ctx.task.sample_fit())
    for stream, o in {o.stream: o for o in opened.opened}.items():   # one row a stream, as the reader reads it
        row = _sample_rows(ctx, reader, o.label, stream, len(o.source))
        rows.append(with_annotation_scan(row, o.source) if isinstance(o.source, AnnotationSource) else row)
    return rows


def _sample_rows(ctx: Preflight, reader, label: str, stream: str, size: int) -> Row:
    """Read `sample_rows` rows spread over a source (first, last, between) and judge them."""
    picks = spread_rows(ctx.sample_rows, size)
    good, skipped, unlike = 0, [], []
    for index in picks:
        got = reader[Ref(seq=0, stream=stream, epoch=0, pos=0, index=index)]
        over = _over_budget(ctx, got.sample) if got.sample is not None else None
        if got.sample is None:
            skipped.append(f"#{index} {got.reason}: {got.detail}")
        elif over:
            skipped.append(f"#{index} over_budget: {over}")
        else:
            good += 1
            unlike += [f"#{index} {why}" for why in [_unlike_the_variant(ctx.job, got.sample)] if why]
    detail = f"{label}: {size} rows; {good}/{len(picks)} of rows {picks} fit the DiT"
    if unlike:
        return _variant_row(ctx.job, detail, unlike)
    # One problem a line.
    if skipped and not good:
        return Row("data", "fail", detail + ". Skipped:\n" + "\n".join(skipped),
                   "fix the paths, files or frame rules named above.")
    if skipped:
        return Row("data", "warn", detail + ". Skipped:\n" + "\n".join(skipped),
                   "such rows are skipped in training; fix or remove them.")
    return Row("data", "pass", detail + ".")


def _unlike_the_variant(job, sample) -> str | None:
    """What of a readable sample the released variant was not trained on: a precomputed latent of
    another resolution (the bucket rule's, for rows that bypass the buckets), a video on the image
    DiT. None when it is like its training data (or the DiT is pan's own)."""
    m = job.model
    trained = RELEASED_RESOLUTIONS.get(m.model_variant)
    if m.model_name == "pan" or trained is None:
        return None
    latent = _latent_of(sample)
    if latent is not None:
        factor = vae_geometry(job.vae).spatial_factor
        frames, height, width = latent.shape[1], latent.shape[2] * factor, latent.shape[3] * factor
        found = resolution_class(height, width)
        if found != trained:
            return (f"is a {latent.shape[2]}x{latent.shape[3]} latent = {bucket_text(height, width)} pixels "
                    f"({found}), not {trained}")
    else:
        frames = sample.grid[0]
    if m.model_variant == "diffusion_transformer_image" and sample.kind == "video" and frames > 1:
        return f"is a video ({frames} {'latent ' if latent is not None else ''}frames)"
    return None


def _variant_row(job, detail: str, unlike: list[str]) -> Row:
    """The data row of a source whose samples are not what the variant was trained on."""
    m = job.model
    trained = RELEASED_RESOLUTIONS[m.model_variant]
    text = detail + f", but {m.model_variant} was trained on {trained}" + (
        " images" if m.model_variant == "diffusion_transformer_image" else "") + ":\n" + "\n".join(unlike)
    if any("latent =" in u for u in unlike):
        return Row("data", "fail", text, f"precompute the latents at {trained} (resolution_buckets of "
                   f"{trained}, `pan data precompute`), or train the variant of their resolution (model_variant).")
    return Row("data", "warn", text, "train videos on diffusion_transformer_384p or _768p (the original trains "
               "the image DiT on images only, --task t2i), or keep image rows for this one.")


def _latent_of(sample) -> torch.Tensor | None:
    return sample.raw_latent if sample.raw_latent is not None else sample.latent


def _over_budget(ctx: Preflight, sample) -> str | None:
    """The budgeted tokens of a sample when over max_tokens_per_batch (training skips it)."""
    task, budget = ctx.task, ctx.job.data.max_tokens_per_batch
    latent = _latent_of(sample)
    tokens = task.latent_tokens_of(*latent.shape[1:]) if latent is not None else task.tokens_of(*sample.grid)
    return f"{tokens} tokens > max_tokens_per_batch {budget}" if tokens > budget else None


# `pan check`'s table, in order: the layout, the launch rules as rows, what the run will read, the
# machine and the output folder, then memory and step time (with `full_sequence_probe`).
CHECKS = [check_layout, check_placeholders, check_stage_batch, check_variant_resolution,
          check_stage_sizes, check_model_folder, check_warm_start, check_text_encoders,
          check_vae, check_data, check_cpu, check_output_dir, check_resume,
          check_memory, check_step_time]

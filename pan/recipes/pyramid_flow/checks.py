"""Launch rules, `pan check` rows and the memory probe of the `pyramid_flow` recipe (its `checks`,
`probe` and workflow `check` hooks; the autoregressive recipe reuses most of them).

The workflow `pyramid-flow-no-ar` (declared in the recipe's `RECIPE`) is the original's
`scripts/train_pyramid_flow_without_ar.sh`: full-sequence spatial-pyramid fine-tuning of a released
DiT. `pan launch-command` refuses it, after the layout checks every workflow gets, for the launch
rules below (config only, nothing is read but the variant's config.json):

- placeholder paths left from a template (`/path/to/...`, the original's `/PATH/...`, `<...>`);
- `max_samples_per_batch` not a multiple of sum(sample_ratios): pan's form of the original's
  `batch_size % 4 == 0` (see `check_stage_batch`);
- resolution buckets of another resolution than the variant's (a 384p variant with 768p buckets),
  and for the SD3 DiT buckets its position table cannot hold;
- buckets whose latent, taken down the pyramid, no longer divides into patches.

`pan check` runs the same rules as rows, and reads what a launch will read: the variant's weights
(shapes from the safetensors headers), the text encoders (configs and tokenizer files, their widths
against the DiT's), the VAE against the DiT's latent channels, and a sample of every data source's
rows (annotation rows parse, their files exist, precomputed latents and text features fit the DiT).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from pan import preflight
from pan.checkpoint.warm_start import ShapeDiff
from pan.config.core import ConfigError, ErrorCollector, placeholder_in, require
from pan.config.job import components
from pan.data.plan import IMAGE_STREAM, Ref
from pan.data.reader import SampleReader, rules_of, stream_name
from pan.data.sources import AnnotationSource, SourceError, read_annotations, read_image_tars, read_video_csv
from pan.encoders.pyramid_text import TextFeatureFileError, check_dit_widths, load_features
from pan.encoders.pyramid_text import check_text_encoders as released_layout
from pan.encoders.text import frozen_dtype
from pan.encoders.vae import vae_geometry
from pan.estimate import Phase, Probe, frozen_vae_bytes, largest_batch, loader_bytes, module_bytes, run_device
from pan.models.packing import PackInfo
from pan.models.pyramid_io import WEIGHTS_INDEX_NAME, WEIGHTS_NAME
from pan.preflight import Preflight, Row, spread_rows, with_annotation_scan
from pan.recipes.pyramid_flow.config import dit_config, variant_folder
from pan.recipes.pyramid_flow.precompute import EMPTY_TEXT_FEA
from pan.recipes.pyramid_flow.task import PyramidInputs

# The resolution each released DiT variant was trained at, as the original's --resolution names
# it (its non-AR script trains the image variant at 768p), and that resolution's pixel area
# (H x W): 384p video is 640x384 (images 512x512, 384x640), 768p video 1280x768 (images 1024x1024).
RELEASED_RESOLUTIONS = {"diffusion_transformer_384p": "384p", "diffusion_transformer_768p": "768p",
                        "diffusion_transformer_image": "768p"}
RESOLUTION_AREAS = {"384p": 384 * 640, "768p": 768 * 1280}

# Template values a run YAML must not keep: pan.config.core.placeholder_in, the rule of every recipe.


# ------------------------------------------------------------------------------------------------
# What the DiT takes, from its config alone
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DiTShape:
    """The latent and text features a job's DiT takes (no model is built)."""
    latent_channels: int
    patch: tuple[int, int]          # latent cells per token along (H, W)
    caption_width: int              # D of the caption features
    pooled_width: int | None        # P of the pooled text feature (None: the model takes none)
    grid_limit: int | None          # largest token grid side (SD3's sin-cos table), None: any


def dit_shape(job) -> DiTShape:
    m = job.model
    if m.model_name == "pan":
        arch = m.transformer_config_overrides
        return DiTShape(arch.out_channels, tuple(arch.patch_size[1:]), arch.text_embed_dim, None, None)
    c = dit_config(m)
    if m.model_name == "pyramid_flux":  # 2x2 patches whatever the config says (quirk F1)
        return DiTShape(c.in_channels // 4, (2, 2), c.joint_attention_dim, c.pooled_projection_dim, None)
    return DiTShape(c.in_channels, (c.patch_size, c.patch_size), c.joint_attention_dim,
                    c.pooled_projection_dim, c.pos_embed_max_size)


def stage_unit(job) -> tuple[int, int]:
    """Latent H and W must be multiples of these: every stage halves them (stages - 1 times) and the
    smallest stage must still cut into whole patches."""
    ph, pw = dit_shape(job).patch
    down = 2 ** (job.pyramid.stages - 1)
    return down * ph, down * pw


def stage_cycle(job) -> list[int]:
    """The stages samples take in turn: sample_ratios [1, 2, 1] -> [0, 1, 1, 2]."""
    return [stage for stage, count in enumerate(job.pyramid.sample_ratios) for _ in range(count)]


def resolution_class(height: int, width: int) -> str:
    """The released resolution nearest a pixel size, by area on a log scale (the boundary between
    384p and 768p is ~0.5 MP)."""
    area = height * width
    return min(RESOLUTION_AREAS, key=lambda name: abs(math.log(area / RESOLUTION_AREAS[name])))


def _bucket_text(height: int, width: int) -> str:
    return f"{width}x{height}"


# ------------------------------------------------------------------------------------------------
# Launch rules: config only, each raises ConfigError naming the key and the fix
# ------------------------------------------------------------------------------------------------

def path_keys(job) -> dict[str, object]:
    """Every key naming a path (`*_path`, `*_paths`, `*_dir`) -> its value."""
    found = {}
    for attr in components(type(job)):
        component = getattr(job, attr)
        for f in dataclasses.fields(component):
            if f.name.endswith(("_path", "_paths", "_dir")):
                found[f.name] = getattr(component, f.name)
    return found


def refuse_placeholders(job) -> None:
    problems = ErrorCollector()
    for key, value in path_keys(job).items():
        values = value if isinstance(value, list) else [value]
        left = [v for v in values if placeholder_in(v)]
        if left:
            problems.add(ConfigError(key, f"is still the template's placeholder {', '.join(left)}: set it "
                                          f"to your own path (in the YAML, or --{key} <path>)."))
    problems.raise_any()


def check_stage_batch_rule(job) -> None:
    """The original asserts that its per-device batch (`--batch_size`) is a multiple of
    sum(sample_ratios), so that each batch splits into the stage columns. A pan batch is packed to a
    token budget and holds a varying number of samples; the stages rotate over each rank's samples
    in the cycle [0, 1, 1, 2], continuing across batches, so any run of 4 consecutive samples holds
    every stage in the 1:2:1 ratio. The rule that keeps the original's guarantee: the per-rank cap
    `max_samples_per_batch` (what `--batch_size` becomes) is a multiple of the cycle, so a full batch
    holds whole cycles."""
    cycle = stage_cycle(job)
    n = job.data.max_samples_per_batch
    require(n % len(cycle) == 0, "max_samples_per_batch",
            f"is {n}, but each rank's samples take the pyramid stages in turn, in cycles of "
            f"sum(sample_ratios {job.pyramid.sample_ratios}) = {len(cycle)} (stages {cycle}): a full "
            f"packed batch must hold whole cycles to train every stage in that ratio (the original's "
            f"per-device --batch_size % {len(cycle)} == 0). Use a multiple of {len(cycle)}, e.g. "
            f"{max(len(cycle), n - n % len(cycle))}.")


def check_variant_resolution_rule(job) -> None:
    """Buckets of the variant's resolution (384p variant, 384p buckets); SD3 token grids that fit its
    position table."""
    m = job.model
    if m.model_name == "pan":
        return
    buckets = job.data.buckets()
    trained = RELEASED_RESOLUTIONS.get(m.model_variant)
    if trained is not None:
        other = [_bucket_text(h, w) for h, w in buckets if resolution_class(h, w) != trained]
        require(not other, "resolution_buckets",
                f"{', '.join(other)} {'is' if len(other) == 1 else 'are'} not {trained}, the resolution "
                f"{m.model_variant} was trained at (384p: ~640x384 = 0.25 MP, 768p: ~1280x768 = 1 MP "
                f"pixels). Use {trained} buckets (as the original's --resolution {trained}), or the "
                f"variant of that resolution (model_variant diffusion_transformer_"
                f"{'768p' if trained == '384p' else '384p'}).")
    shape = dit_shape(job)
    if shape.grid_limit is None:
        return
    factor = vae_geometry(job.vae).spatial_factor
    too_big = [_bucket_text(h, w) for h, w in buckets
               if max(h // factor // shape.patch[0], w // factor // shape.patch[1]) > shape.grid_limit]
    require(not too_big, "resolution_buckets",
            f"{', '.join(too_big)} give token grids wider than the {shape.grid_limit} x {shape.grid_limit} "
            f"position table of {variant_folder(m)} (pos_embed_max_size): the SD3 DiT cannot place "
            "them. Use smaller buckets.")


def check_stage_sizes_rule(job) -> None:
    """Every bucket's latent, halved stages - 1 times, still cuts into whole patches."""
    geometry = vae_geometry(job.vae)
    uh, uw = stage_unit(job)
    bad = []
    for h, w in job.data.buckets():
        error = geometry.clip_shape_error(1, h, w)
        if error:
            bad.append(f"{_bucket_text(h, w)}: {error}")
            continue
        lh, lw = h // geometry.spatial_factor, w // geometry.spatial_factor
        if lh % uh or lw % uw:
            bad.append(f"{_bucket_text(h, w)} has a {lw}x{lh} latent")
    require(not bad, "resolution_buckets",
            f"{'; '.join(bad)}: with {job.pyramid.stages} stages and {dit_shape(job).patch} patches the "
            f"latent height must be a multiple of {uh} and its width of {uw} (each stage halves it, and "
            f"the smallest must still cut into patches), i.e. buckets of multiples of "
            f"{uw * geometry.spatial_factor} x {uh * geometry.spatial_factor} pixels (W x H).")


def check_frame_rule(job) -> None:
    """Every clip length the frame rules allow (frames_mod, frames_remainder, min/max_frames) must be
    one the VAE encodes (1 + k x its temporal factor): a clip decoded online is cut to such a length."""
    geometry = vae_geometry(job.vae)
    tf, data = geometry.temporal_factor, job.data
    bad = [n for n in data.frame_count_range() if (n - 1) % tf]
    require(not bad, "frames_mod",
            f"is {data.frames_mod} with frames_remainder {data.frames_remainder}: clips of "
            f"{', '.join(map(str, bad[:4]))}{' ...' if len(bad) > 4 else ''} frames are allowed, but the "
            f"{job.vae.vae_type} VAE ({tf}x in time) encodes only 1 + {tf}k frames. Set frames_mod: {tf} "
            f"and frames_remainder: 1 (as the released YAMLs do).")


LAUNCH_RULES = (refuse_placeholders, check_stage_batch_rule, check_variant_resolution_rule,
                check_stage_sizes_rule, check_frame_rule)


def check_launch(job, dims=None) -> None:
    """The workflow's own refusals, all reported together."""
    problems = ErrorCollector()
    for rule in LAUNCH_RULES:
        with problems.gather():
            rule(job)
    problems.raise_any()


# ------------------------------------------------------------------------------------------------
# `pan check`: the launch rules as rows, then what the run will read
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
    for name, size in _source_sizes(job).items():
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
    summary += (f"; a cycle of {frames}-frame {_bucket_text(*largest)} clips is {sum(per_stage)} tokens "
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


def _source_sizes(job) -> dict[str, int]:
    """Samples per row source and of the image tars; unreadable ones are left to the data row."""
    readers = [(Path(p).name, lambda p=p: read_video_csv(p)) for p in job.data.video_csv_paths]
    readers += [(Path(p).name, lambda p=p: read_annotations(p)) for p in job.data.annotation_paths]
    if job.data.image_tar_paths:
        readers.append(("image tars", lambda: read_image_tars(job.data.image_tar_paths)))
    sizes = {}
    for name, read in readers:
        try:
            sizes[name] = len(read())
        except (SourceError, OSError, UnicodeDecodeError):
            continue
    return sizes


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
    for path in job.data.video_csv_paths:
        try:
            if not read_video_csv(path).precomputed:
                online.append(path)
        except (SourceError, OSError, UnicodeDecodeError):
            continue
    for path in job.data.annotation_paths:
        try:
            rows = read_annotations(path).rows
        except (SourceError, OSError):
            continue
        if any(b'"latent"' not in row for row in rows):
            online.append(path)
    return online


def check_data(ctx: Preflight) -> list[Row]:
    """Parse every source; read a sample of each one's rows as training will (files exist, latents
    and text features load or media decode) and check them against the DiT."""

    job, rows, sources = ctx.job, [], {}
    readers = [(p, read_video_csv) for p in job.data.video_csv_paths]
    readers += [(p, read_annotations) for p in job.data.annotation_paths]
    for path, read in readers:
        try:
            source = read(path)
            sources[stream_name(source)] = (path, source)
        except (SourceError, OSError, UnicodeDecodeError) as e:
            rows.append(Row("data", "fail", f"{path}: {e}", "fix or remove the file."))
    tars = None
    if job.data.image_tar_paths:
        try:
            tars = read_image_tars(job.data.image_tar_paths)
        except (SourceError, OSError) as e:
            rows.append(Row("data", "fail", str(e), "fix or remove the tar(s)."))
    # The reader training uses, with what the DiT takes (the task's sample_fit, from the built model):
    # a row that does not fit is skipped as `unfit` here as it is in training.
    ctx.models  # noqa: B018 - the task's meta DiT, which sample_fit reads
    reader = SampleReader({name: src for name, (_, src) in sources.items()}, tars, rules_of(job.data),
                          fit=ctx.task.sample_fit())
    streams = [(path, name, len(src)) for name, (path, src) in sources.items()]
    if tars is not None:
        streams.append((", ".join(job.data.image_tar_paths), IMAGE_STREAM, len(tars)))
    for label, stream, size in streams:
        row = _sample_rows(ctx, reader, label, stream, size)
        source = sources.get(stream, (None, None))[1]
        rows.append(with_annotation_scan(row, source) if isinstance(source, AnnotationSource) else row)
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
            return (f"is a {latent.shape[2]}x{latent.shape[3]} latent = {_bucket_text(height, width)} pixels "
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


# ------------------------------------------------------------------------------------------------
# Memory and step time (pan/estimate.py): what both Pyramid-Flow recipes' micro-batches hold
# ------------------------------------------------------------------------------------------------

def text_encoder_bytes(job, dtype: torch.dtype) -> int:
    """The released T5 and CLIP(s) in `dtype`, as `pan.encoders.pyramid_text` loads them."""
    m = job.model
    layout = released_layout(job.text, "pyramid_flux" if m.model_name == "pan" else m.model_name, m.model_path or "")
    return sum(_text_model_bytes(layout.folder / slot.model_dir, slot.kind, slot.projected, dtype)
               for slot in layout.slots)


@functools.cache  # building even a meta model imports its modeling code: once per process
def _text_model_bytes(model_dir: Path, kind: str, projected: bool, dtype: torch.dtype) -> int:
    from transformers import CLIPTextModel, CLIPTextModelWithProjection, T5EncoderModel

    cls = T5EncoderModel if kind == "t5" else (CLIPTextModelWithProjection if projected else CLIPTextModel)
    config = cls.config_class.from_pretrained(model_dir, local_files_only=True)
    return module_bytes(lambda: cls(config), dtype)


def pyramid_probe(ctx: Preflight, task, samples: list[list[tuple[int, int, int]]], describe: str) -> Probe:
    """One micro-batch of `samples`, each the latent shapes (t, h, w) of its clips in packing order
    (the trained one last), every caption at t5_max_length rows; one phase, the DiT's loss. Frozen
    where the data is read (cp rank 0): the VAE, and the text encoders when captions are encoded
    during training."""

    job, cp, model = ctx.job, ctx.dims.cp, task.model
    # The DiT's latent channels, which the latents it trains on have (the `vae` row compares the
    # VAE's with them: they must agree where clips are encoded online).
    shape, text_len = dit_shape(job), job.text.t5_max_length
    channels = shape.latent_channels
    layouts = [model.sample_layout([model.patch_grid((0, *clip)) for clip in clips], text_len) for clips in samples]
    whole = PackInfo.from_layouts(layouts)
    pack = whole.shard(0, cp) if cp > 1 else whole
    one = torch.empty(channels, *samples[0][-1], device="meta")   # token widths, from one clip
    widths = model.patchify(one).shape[1], model.target_tokens(one).shape[1]

    def loss(models):
        nv, b = pack.num_video_tokens, len(samples)
        inputs = PyramidInputs(x=torch.empty(nv, widths[0]), target=torch.empty(nv, widths[1]),
                               weight=torch.empty(nv), timesteps=torch.empty(b),
                               text=torch.empty(pack.num_text_tokens, shape.caption_width),
                               pooled=torch.empty(b, shape.pooled_width or 0), pack=pack, sample_ids=[],
                               samples=b, tokens=whole.num_video_tokens, packing=1.0, bad_samples=0)
        return task.loss_sum(models["transformer"], inputs)

    dtype = frozen_dtype(run_device())
    frozen = {"vae": frozen_vae_bytes(job.vae, dtype)}
    online_text = task.encodes_captions()
    if online_text:
        frozen["text encoders"] = text_encoder_bytes(job, job.text.dtype(run_device()))
    data = job.data
    clips = largest_batch(data, task.tokens_of, images=bool(data.image_tar_paths))
    shapes = "; ".join(" + ".join("x".join(map(str, clip)) for clip in sample) for sample in samples)
    return Probe([Phase("transformer", loss)], tokens=whole.num_video_tokens // cp, samples=len(samples),
                 flops=3 * task.forward_flops(whole) / cp, frozen=frozen, loader=loader_bytes(data, clips),
                 online_text=online_text,
                 describe=f"{describe} (latent clips t x h x w: {shapes}) = {whole.num_video_tokens} video + "
                          f"{whole.num_text_tokens} caption tokens per data-parallel rank")


def level_shape(task, t: int, h: int, w: int, level: int) -> tuple[int, int, int]:
    """(t, h, w) of a full-resolution latent's frames at pyramid `level` (each level below the top
    halves the sides)."""
    down = task.job.pyramid.stages - 1 - level
    return t, h >> down, w >> down


def largest_batch_clips(ctx: Preflight, task) -> list[tuple[int, int, int]]:
    """Full-resolution latent shapes (t, h, w) of the data budget's fullest micro-batch."""
    data = ctx.job.data
    # Clips the VAE cannot encode, or whose stages do not cut into patches: the `stage sizes` row's failures.
    check_stage_sizes_rule(ctx.job)
    check_frame_rule(ctx.job)
    clips = largest_batch(data, task.tokens_of, images=bool(data.image_tar_paths))
    if not clips:
        raise ConfigError("max_tokens_per_batch", "no clip of the buckets and frame rules fits the "
                          "token budget (see the batch row).")
    return [task.geometry.latent_shape(*clip)[1:] for clip in clips]


def full_sequence_probe(ctx: Preflight) -> Probe:
    """The fullest pack of the largest clips, each at the stage the rotation gives it: of every
    place the rotation can start a batch at, the one with the most tokens."""
    task = ctx.task
    clips = largest_batch_clips(ctx, task)
    cycle = task.column_stages

    def batch(start: int) -> list[list[tuple[int, int, int]]]:
        return [[level_shape(task, *clip, cycle[(start + i) % len(cycle)])] for i, clip in enumerate(clips)]
    tokens = lambda samples: sum(math.prod(task.model.patch_grid((0, *s[-1]))) for s in samples)  # noqa: E731
    fullest = max((batch(start) for start in range(len(cycle))), key=tokens)
    return pyramid_probe(ctx, task, fullest, f"{len(clips)} clip(s) at their pyramid stages")



# `pan check`'s table, in order: the layout, the launch rules as rows, what the run will read, the
# machine and the output folder, then memory and step time (with `full_sequence_probe`).
CHECKS = [preflight.check_layout, check_placeholders, check_stage_batch, check_variant_resolution,
          check_stage_sizes, check_model_folder, preflight.check_warm_start, check_text_encoders,
          check_vae, check_data, preflight.check_cpu, preflight.check_output_dir, preflight.check_resume,
          preflight.check_memory, preflight.check_step_time]

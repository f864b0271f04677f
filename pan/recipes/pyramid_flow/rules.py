"""The launch rules of the `pyramid_flow` recipe (its workflow `check` hook, which the autoregressive
recipe reuses), and what the DiT takes, from its config alone.

The workflow `pyramid-flow-no-ar` (declared in the recipe's `RECIPE`) is the original's
`scripts/train_pyramid_flow_without_ar.sh`: full-sequence spatial-pyramid fine-tuning of a released
DiT. `pan launch-command` refuses it, after the layout checks every workflow gets, for the launch
rules below (config only, nothing is read but the variant's config.json):

- placeholder paths left from a template (`/path/to/...`, the original's `/PATH/...`, `<...>`);
- `max_samples_per_batch` not a multiple of sum(sample_ratios): pan's form of the original's
  `batch_size % 4 == 0` (see `check_stage_batch_rule`);
- resolution buckets of another resolution than the variant's (a 384p variant with 768p buckets),
  and for the SD3 DiT buckets its position table cannot hold;
- buckets whose latent, taken down the pyramid, no longer divides into patches.

`pan check` runs the same rules as rows (checks.py).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from pan.config.core import ConfigError, ErrorCollector, require
from pan.config.job import path_keys
from pan.config.job import refuse_placeholders as refuse_placeholders_into
from pan.encoders.vae import vae_geometry
from pan.recipes.pyramid_flow.config import dit_config, variant_folder

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


def bucket_text(height: int, width: int) -> str:
    return f"{width}x{height}"


# ------------------------------------------------------------------------------------------------
# Launch rules: config only, each raises ConfigError naming the key and the fix
# ------------------------------------------------------------------------------------------------

def refuse_placeholders(job) -> None:
    """The loader's refusal of template placeholders in path keys (pan.config.job), as a launch rule:
    `pan launch-command` and `pan check` list it with the others."""
    problems = ErrorCollector()
    refuse_placeholders_into(job, problems, lambda e: e)
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
        other = [bucket_text(h, w) for h, w in buckets if resolution_class(h, w) != trained]
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
    too_big = [bucket_text(h, w) for h, w in buckets
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
            bad.append(f"{bucket_text(h, w)}: {error}")
            continue
        lh, lw = h // geometry.spatial_factor, w // geometry.spatial_factor
        if lh % uh or lw % uw:
            bad.append(f"{bucket_text(h, w)} has a {lw}x{lh} latent")
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

"""The `pyramid_flow_ar` recipe's keys: the full-sequence recipe's plus the autoregressive ones
(`frame_per_unit`, `video_sync_group`, `interp_condition_pos`, and for sampling
`sample_video_steps`, `sample_video_guidance_scale`, `sample_max_history_units`), and the window
of latent frames they cut into units.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pan.config.core import ConfigError, knob, placeholder_in, require
from pan.encoders.vae import vae_geometry
from pan.recipes.pyramid_flow.config import PyramidJobConfig, PyramidModelConfig, PyramidValidationConfig

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
        require(not placeholder_in(path), "model_path",
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
        tf, n = temporal_factor(job), job.data.max_frames
        require(tf == 1 or (n - 1) % tf == 0, "max_frames",
                f"is {n}, not 1 + a multiple of {tf}: max_frames counts pixel frames, of which the "
                f"{job.vae.vae_type} VAE ({tf}x in time) makes 1 + {tf}k into 1 + k latent frames, so the "
                f"window would be {window} latent frame(s). The original's --max_frames (NUM_FRAMES) counts "
                f"latent frames: for {n} of them set max_frames: {1 + (n - 1) * tf} (1 + {tf} x ({n} - 1)); "
                f"to keep {window}, max_frames: {1 + (window - 1) * tf}.")
        if (window - 1) % fpu == 0 and units % group == 0:
            return self._check_batch(job)
        latent_typed = frames_read_as_latent(job, fpu, group)
        if latent_typed is not None:
            raise ConfigError("max_frames", f"is {job.data.max_frames} pixel frames, {window} latent "
                              f"frame(s) through the {job.vae.vae_type} VAE ({temporal_factor(job)}x in time): "
                              f"a window that frame_per_unit {fpu} and video_sync_group {group} do not "
                              f"cut into whole units and groups ({units} unit(s)). max_frames counts pixel "
                              f"frames, where the original's --max_frames (NUM_FRAMES) counts latent frames: "
                              f"for {job.data.max_frames} latent frames set max_frames: {latent_typed}.")
        hint = pixel_frames_note(job)
        require((window - 1) % fpu == 0, "frame_per_unit",
                f"is {fpu}, but max_frames {job.data.max_frames} gives {window} latent frames, and "
                f"(latent frames - 1) % frame_per_unit must be 0 (units of {fpu} frames after the "
                f"first frame). Use a max_frames of 1 + a multiple of {fpu} latent frames.{hint}")
        require(units % group == 0, "video_sync_group",
                f"is {group}, but max_frames {job.data.max_frames} gives {units} units of "
                f"{fpu} latent frame(s) (the original's max_frames % video_sync_group == 0, in units): "
                f"the group's rotation must cover every unit. Use a divisor of {units} "
                f"({', '.join(str(d) for d in range(1, units + 1) if units % d == 0)}).{hint}")
        self._check_batch(job)

    def _check_batch(self, job) -> None:
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
    HISTORY_CLIPS: ClassVar[bool] = True
    model: PyramidARModelConfig = knob(PyramidARModelConfig(), "")
    ar: AutoregressiveConfig = knob(AutoregressiveConfig(), "")
    validation: PyramidARValidationConfig = knob(PyramidARValidationConfig(), "")


def latent_window(job) -> int:
    """Latent frames of `max_frames` pixel frames: the longest clip a sample trains on."""
    return (job.data.max_frames - 1) // vae_geometry(job.vae).temporal_factor + 1


def window_units(job) -> int:
    """M: units in the latent frames of max_frames (the original's max_units_in_training)."""
    return 1 + (latent_window(job) - 1) // job.ar.frame_per_unit


def temporal_factor(job) -> int:
    return vae_geometry(job.vae).temporal_factor


def pixel_frames_note(job) -> str:
    """What max_frames counts, for messages about the window (the original counts latent frames)."""
    tf = temporal_factor(job)
    if tf == 1:
        return ""
    return (f" (max_frames counts pixel frames: {job.data.max_frames} are {latent_window(job)} latent "
            f"frame(s) through the {job.vae.vae_type} VAE, {tf}x in time; the original's --max_frames "
            f"counts latent frames: 1 + {tf} x (N - 1) pixel frames here for its N, 121 for 16.)")


def frames_read_as_latent(job, fpu: int, group: int) -> int | None:
    """The pixel max_frames meaning `max_frames` latent frames, when the window it gives is refused
    and that one would not be (the original's --max_frames, typed as is); else None."""
    tf, n = temporal_factor(job), job.data.max_frames
    if tf == 1 or n == 1:
        return None
    units = 1 + (n - 1) // fpu
    return 1 + (n - 1) * tf if (n - 1) % fpu == 0 and units % group == 0 else None


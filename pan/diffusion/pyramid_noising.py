"""Training-time noising of pyramid flow matching (`pan.diffusion.pyramid_schedule` has the math):
whole clips by batch column (`noise_full_sequence`, and with the temporal pyramid's history
`noise_temporal_pyramid`), or one sample of a packed batch (`noise_sample`, and autoregressive
`noise_unit`); what the DiT is regressed on (`regression_target`), and the stage velocity a clean
latent stands for (`clean_velocity`, which the sampler reads a sample prediction with).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from pan.diffusion.flow import FlowConfig, sample_timesteps
from pan.diffusion.pyramid_draws import Draws
from pan.diffusion.pyramid_latents import column_stages, halve, noise_pyramid, upsample_nearest
from pan.diffusion.pyramid_schedule import PyramidSchedule
from pan.diffusion.pyramid_units import history_clips, unit_frames


@dataclass
class NoisedColumn:
    """One column of a noised batch: the DiT input clips of its samples and what they are trained on.

    A column holds batch rows `column::num_columns` (so its b samples have the same clip shapes).
    """
    column: int
    stage: int
    rows: slice                 # batch rows of this column
    clips: list[Tensor]         # [b, C, t_j, h_j, w_j] oldest first; the last is noisy and trained
    ratios: Tensor              # [b] f32 in-stage position r (1 = stage start, 0 = stage end)
    timesteps: Tensor           # [b] f32 the DiT's timestep (0..num_train_timesteps scale)
    target: Tensor              # like clips[-1]: start - end, the velocity to regress
    clean: Tensor               # like clips[-1]: x0_k, the clean latent at the stage's resolution


def line_sigmas(schedule: PyramidSchedule, stage: int) -> tuple[float, float]:
    """(s_k, e_k): the noise shares of stage k's start and end points (stage 0 starts at pure noise,
    the last stage ends at x0), as `_stage_points` builds them."""
    s = 1.0 if stage == 0 else schedule.start_sigmas[stage]
    e = 0.0 if stage == schedule.stages - 1 else schedule.end_sigmas[stage]
    return s, e


def clean_velocity(x0: Tensor, x: Tensor, r: float | Tensor, stage: int, schedule: PyramidSchedule) -> Tensor:
    """The stage velocity that a clean latent `x0` (x0_k, at the stage's resolution) stands for at the
    point `x` = x(r) of stage k's line. The point fixes the noise once x0 is known,

        noise = (x - r (1 - s) up(halve(x0)) - (1 - r)(1 - e) x0) / sigma(r),   sigma(r) = r s + (1 - r) e

    and the velocity is start - end = (s - e) noise + (1 - s) up(halve(x0)) - (1 - e) x0. At the last
    stage (e = 0) this is (x - x0) / r. `r` is a float or [b] per sample; sigma(r) > 0 wherever the
    sampler steps (r >= 0.001)."""
    s, e = line_sigmas(schedule, stage)
    r = torch.as_tensor(r, dtype=x.dtype, device=x.device).reshape(-1, *([1] * (x.ndim - 1)))
    coarse = upsample_nearest(halve(x0)) if s < 1 else torch.zeros_like(x0)
    noise = (x - r * (1 - s) * coarse - (1 - r) * (1 - e) * x0) / (r * s + (1 - r) * e)
    return (s - e) * noise + (1 - s) * coarse - (1 - e) * x0


def regression_target(noised: NoisedColumn, flow: FlowConfig | None, schedule: PyramidSchedule) -> tuple[Tensor, Tensor]:
    """What the DiT's output of the trained clip is regressed on, and each sample's loss factor [b].

    velocity (`flow` None or prediction_type velocity): start - end, factor 1. sample: the clean
    latent x0_k at the stage's resolution (`clean_velocity` reads an output as a velocity), factor
    (s (1 - e) / max(sigma(r), prediction_sigma_min))^2: an error d in x0_k's detail finer than the
    stage's coarser level (what up(halve(.)) drops) moves that velocity by -s (1 - e) d / sigma(r),
    so this is the velocity loss of that detail; at the last stage, (1 / max(r, min))^2 as pan's flow.
    """
    if flow is None or flow.prediction_type == "velocity":
        return noised.target, torch.ones_like(noised.ratios)
    s, e = line_sigmas(schedule, noised.stage)
    sigma = (noised.ratios * s + (1 - noised.ratios) * e).clamp(min=flow.prediction_sigma_min)
    return noised.clean, (s * (1 - e) / sigma).square()


def _columns(latents: Sequence[Tensor], schedule: PyramidSchedule) -> tuple[list[int], int]:
    """(stage of each column, samples per column), checking the pyramid and the batch size."""
    cfg = schedule.config
    if len(latents) != schedule.stages:
        raise ValueError(f"need {schedule.stages} pyramid levels, got {len(latents)}")
    stages = column_stages(cfg.sample_ratios)
    batch = latents[0].shape[0]
    if batch % len(stages):
        raise ValueError(f"batch size {batch} must be a multiple of sum(sample_ratios) = {len(stages)}")
    return stages, batch // len(stages)


def _stage_points(latents: Sequence[Tensor], noises: Sequence[Tensor], schedule: PyramidSchedule,
                  stage: int, rows: slice) -> tuple[Tensor, Tensor]:
    """The straight line of `stage` for `rows`: (start, end), each [b, C, T, h, w]."""
    noise = noises[stage][rows]
    ss, es = schedule.start_sigmas[stage], schedule.end_sigmas[stage]
    if stage == 0:
        start = noise
    else:
        start = ss * noise + (1 - ss) * upsample_nearest(latents[stage - 1][rows])
    clean = latents[stage][rows]
    end = clean if stage == schedule.stages - 1 else es * noise + (1 - es) * clean
    return start, end


def _draw_table_indices(schedule: PyramidSchedule, b: int, draws: Draws,
                        flow: FlowConfig | None) -> Tensor:
    """[b] int64 indices into the stage tables: where in its stage each sample is trained.

    uniform: u ~ U[0, 1), i = floor(u N) (the original). flow: t from pan's flow samplers (pan's
    sigma convention, 1 = noisiest) is the in-stage position r, rounded up onto the table grid
    r_i = 1 - i/N: i = floor((1 - t) N). Both clamp i to [0, N - 1].
    """
    n = schedule.num_train_timesteps
    if schedule.config.stage_timestep_sampling == "uniform":
        u = draws.rand((b,))
        return (u * n).long().clamp(0, n - 1).cpu()
    t = sample_timesteps(flow, b, [1] * b, draws.generator)  # token counts only matter when dynamic
    return ((1 - t) * n).long().clamp(0, n - 1).cpu()


def _check_position_source(schedule: PyramidSchedule, draws: Draws, flow: FlowConfig | None) -> None:
    """Fail before drawing anything when flow-mode positions cannot be drawn."""
    if schedule.config.stage_timestep_sampling == "uniform":
        return
    if flow is None or flow.train_timestep_shift_mode != "fixed":
        raise ValueError("stage_timestep_sampling 'flow' needs a FlowConfig with a fixed shift")
    if getattr(draws, "generator", None) is None:
        raise TypeError("stage_timestep_sampling 'flow' draws through pan.diffusion.flow, which needs "
                        "a Draws with a `generator` (GeneratorDraws)")


def _corrupt(clean: Tensor, sigma: Tensor, draws: Draws) -> Tensor:
    """History corruption sigma * eps + (1 - sigma) * clean, sigma [b, 1, 1, 1, 1]."""
    eps = draws.randn(clean.shape).to(clean.device, clean.dtype)
    return sigma * eps + (1 - sigma) * clean


def _noised_point(start: Tensor, end: Tensor, r: Tensor) -> Tensor:
    """r * start + (1 - r) * end in float64 (r is), cast back: the original's exact arithmetic."""
    r = r.reshape(-1, *([1] * (start.ndim - 1)))
    return (r * start + (1 - r) * end).to(start.dtype)


def noise_full_sequence(latents: Sequence[Tensor], schedule: PyramidSchedule, draws: Draws,
                        *, flow: FlowConfig | None = None) -> list[NoisedColumn]:
    """Spatial-pyramid noising of whole clips (non-autoregressive training).

    `latents` are the normalised pyramid levels [B, C, T, h_k, w_k], lowest first. Draw order:
    full-resolution noise, then per column its timestep draw and one corruption draw that is
    unused here, kept so the stream stays in step with the original (and with the AR mode).
    """
    stages, b = _columns(latents, schedule)
    _check_position_source(schedule, draws, flow)
    noises = noise_pyramid(draws.randn(latents[-1].shape).to(latents[-1]), schedule.stages)
    columns = []
    for c, stage in enumerate(stages):
        rows = slice(c, None, len(stages))
        start, end = _stage_points(latents, noises, schedule, stage, rows)
        idx = _draw_table_indices(schedule, b, draws, flow)
        r = schedule.sigmas_per_stage[stage][idx].to(start.device)               # [b] f64
        draws.rand((b,))  # the corruption level, unused without history
        columns.append(NoisedColumn(
            column=c, stage=stage, rows=rows, clips=[_noised_point(start, end, r)],
            ratios=r.to(start.dtype), target=start - end, clean=latents[stage][rows],
            timesteps=schedule.timesteps_per_stage[stage][idx].to(start.device, start.dtype)))
    return columns


def noise_sample(latents: Sequence[Tensor], stage: int, schedule: PyramidSchedule, draws: Draws,
                 *, flow: FlowConfig | None = None) -> NoisedColumn:
    """One sample trained at `stage` (packed batches mix shapes, so each sample is noised on its
    own): `latents` are its normalised pyramid levels [1, C, T, h_k, w_k], lowest first. The same
    arithmetic as `noise_full_sequence`; the noise, then the table index, are drawn per sample."""
    _check_position_source(schedule, draws, flow)
    noises = noise_pyramid(draws.randn(latents[-1].shape).to(latents[-1]), schedule.stages)
    start, end = _stage_points(latents, noises, schedule, stage, slice(None))
    idx = _draw_table_indices(schedule, 1, draws, flow)
    r = schedule.sigmas_per_stage[stage][idx].to(start.device)
    return NoisedColumn(column=0, stage=stage, rows=slice(None), clips=[_noised_point(start, end, r)],
                        ratios=r.to(start.dtype), target=start - end, clean=latents[stage],
                        timesteps=schedule.timesteps_per_stage[stage][idx].to(start.device, start.dtype))


def _unit(x: Tensor, k: int, fpu: int) -> Tensor:
    """The k-th unit counted back from the newest (k = 0 newest) of x [b, C, frames, h, w]."""
    frames = x.shape[2]
    return x[:, :, max(frames - (k + 1) * fpu, 0):frames - k * fpu]


def _history(latents: Sequence[Tensor], rows: slice, stage: int, units: int, frames: int, fpu: int,
             sigma: Tensor, draws: Draws) -> list[Tensor]:
    """Corrupted clean history before the trained unit, newest first: the previous unit at the
    column's stage, then one unit per lower stage down to stage 1, then all older frames at stage 0."""
    if units < 2:
        return []
    clean = lambda s: latents[s][rows][:, :, :frames]  # noqa: E731
    clips = [_corrupt(_unit(clean(stage), 1, fpu), sigma, draws)]
    taken, s = 2, stage
    while taken < units:
        s = max(s - 1, 0)
        if s == 0:
            break
        clips.append(_corrupt(_unit(clean(s), taken, fpu), sigma, draws))
        taken += 1
    if s == 0 and taken < units:
        clips.append(_corrupt(clean(0)[:, :, :frames - taken * fpu], sigma, draws))
    return clips


def noise_temporal_pyramid(latents: Sequence[Tensor], schedule: PyramidSchedule,
                           unit_counts: Sequence[int], draws: Draws, *, frame_per_unit: int = 1,
                           flow: FlowConfig | None = None) -> list[NoisedColumn]:
    """Spatial + temporal pyramid noising (autoregressive training).

    A column of stage k trains the last of its `unit_counts[k]` units (see `stage_unit_counts`),
    noised on stage k's line; the units before it are clean latents corrupted with one noise level
    sigma ~ U(0, corrupt_ratio) per sample, at decreasing resolution going back in time. Returns the
    clips oldest first with the noisy unit last, and the target of that unit only. Draw order:
    full-resolution noise, then per column its timestep draw, the corruption level, and one normal
    draw per history clip, newest first.
    """
    stages, b = _columns(latents, schedule)
    _check_position_source(schedule, draws, flow)
    if len(unit_counts) != schedule.stages:
        raise ValueError(f"need one unit count per stage ({schedule.stages}), got {list(unit_counts)}")
    t = latents[-1].shape[2]
    clip_units = 1 + (t - 1) // frame_per_unit
    noises = noise_pyramid(draws.randn(latents[-1].shape).to(latents[-1]), schedule.stages)
    columns = []
    for c, stage in enumerate(stages):
        rows = slice(c, None, len(stages))
        units = min(unit_counts[stage], clip_units)
        frames = 1 + (units - 1) * frame_per_unit
        start, end = _stage_points(latents, noises, schedule, stage, rows)
        trained_unit = lambda x: x[:, :, :frames][:, :, -frame_per_unit:]  # noqa: E731
        start, end = trained_unit(start), trained_unit(end)
        idx = _draw_table_indices(schedule, b, draws, flow)
        r = schedule.sigmas_per_stage[stage][idx].to(start.device)               # [b] f64
        sigma = (draws.rand((b,)) * schedule.config.corrupt_ratio).to(start).reshape(b, 1, 1, 1, 1)
        history = _history(latents, rows, stage, units, frames, frame_per_unit, sigma, draws)
        columns.append(NoisedColumn(
            column=c, stage=stage, rows=rows, clips=history[::-1] + [_noised_point(start, end, r)],
            ratios=r.to(start.dtype), target=start - end, clean=trained_unit(latents[stage][rows]),
            timesteps=schedule.timesteps_per_stage[stage][idx].to(start.device, start.dtype)))
    return columns


# ----------------------------------------------------------------------------------------------
# One sample of autoregressive training (packed batches: each sample has its own stage and unit)
# ----------------------------------------------------------------------------------------------

def noise_unit(latents: Sequence[Tensor], stage: int, units: int, schedule: PyramidSchedule,
               draws: Draws, *, frame_per_unit: int = 1, flow: FlowConfig | None = None) -> NoisedColumn:
    """Temporal-pyramid noising of one sample that trains its `units`-th unit at `stage`.

    `latents` are its normalised pyramid levels [1, C, T, h_k, w_k], lowest first, with
    T >= unit_frames(units). The same arithmetic as a column of `noise_temporal_pyramid`, for one
    sample: only the trained unit is noised (on the stage's line) and regressed; the history is
    clean latents corrupted with one level sigma ~ U(0, corrupt_ratio). Draw order: the trained
    unit's full-resolution noise, its table index, sigma, then one normal draw per history clip,
    newest first. Returns the clips oldest first, the noisy unit last.
    """
    _check_position_source(schedule, draws, flow)
    frames = unit_frames(units, frame_per_unit)
    if latents[-1].shape[2] < frames:
        raise ValueError(f"unit {units} needs {frames} latent frames, the clip has {latents[-1].shape[2]}")
    trained = [x[:, :, max(frames - frame_per_unit, 0):frames] for x in latents]
    noises = noise_pyramid(draws.randn(trained[-1].shape).to(trained[-1]), schedule.stages)
    start, end = _stage_points(trained, noises, schedule, stage, slice(None))
    idx = _draw_table_indices(schedule, 1, draws, flow)
    r = schedule.sigmas_per_stage[stage][idx].to(start.device)                   # [1] f64
    sigma = (draws.rand((1,)) * schedule.config.corrupt_ratio).to(start).reshape(1, 1, 1, 1, 1)
    history = [_corrupt(clip, sigma, draws)
               for clip in history_clips(latents, stage, units, frames, frame_per_unit)]
    return NoisedColumn(column=0, stage=stage, rows=slice(None),
                        clips=history[::-1] + [_noised_point(start, end, r)],
                        ratios=r.to(start.dtype), target=start - end, clean=trained[stage],
                        timesteps=schedule.timesteps_per_stage[stage][idx].to(start.device, start.dtype))

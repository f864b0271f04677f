"""Stage-by-stage Euler sampling for pyramid flow models (see `pan.diffusion.pyramid_schedule` for the math).

One unit of latent frames is denoised stage by stage: stage 0 starts from noise at the lowest
resolution; each stage runs its Euler steps on the stage's line from r = 1 (its start point) to
r = 0 (its end point); between stages the latent is upsampled (nearest x2) and renoised with
correlated block noise, which makes the upsampled noise i.i.d. again at the next stage's start sigma.
The last stage ends at sigma 0, at full resolution.

`denoise_unit` is that loop for one unit and takes the velocity per stage, `velocity_at(stage)`: a
full-sequence model uses one velocity function for all stages (`sample_full_sequence`); the
autoregressive driver `sample_autoregressive` runs it one unit after another, each stage's velocity
closing over that stage's clean history clips (the temporal pyramid of the frames generated so far),
as the original's `generate`.

A velocity function is `velocity(x, t) -> v` with x [b, C, T, h, w] at the stage's resolution and
t [b] float32 the DiT's timesteps (0..num_train_timesteps scale, the values it was trained on); v is
the stage velocity start - end (pan's convention: the sample moves by (r_next - r) * v). With a
`flow` whose prediction_type is sample, the function returns the DiT's output as it is, the clean
latent at the stage's resolution, and each step reads it as the velocity it stands for
(`pan.diffusion.pyramid_noising.clean_velocity`, exact: no floor on r, the stages' last steps start at
r = 0.001); guidance combines outputs either way (the reading is affine).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor

from pan.diffusion.pyramid_draws import Draws
from pan.diffusion.pyramid_latents import latent_pyramid, noise_pyramid, upsample_nearest
from pan.diffusion.pyramid_noising import clean_velocity
from pan.diffusion.pyramid_schedule import PyramidSchedule
from pan.diffusion.pyramid_units import history_clips, unit_frames
from pan.diffusion.flow import FlowConfig
from pan.diffusion.sampler import guided_velocity

VelocityFn = Callable[[Tensor, Tensor], Tensor]
# (history clips [b, C, t_j, h_j, w_j] oldest first, stage) -> the stage's velocity for the next unit
HistoryVelocityFn = Callable[[list[Tensor], int], VelocityFn]


def block_noise(shape: Sequence[int], gamma: float, draws: Draws) -> Tensor:
    """N(0, 1) noise [B, C, T, H, W] whose 4 values in each 2x2 block have correlation -gamma.

    Covariance (1 + gamma) I - gamma J per block (J all ones): variance 1 + gamma across the block
    and 1 - 3 gamma along its mean, so gamma <= 1/3 (at 1/3 each block sums to zero). The original
    draws the same distribution block by block (MultivariateNormal in a Python loop); this is one draw.
    """
    b, c, t, h, w = shape
    z = draws.randn((b, c, t, h // 2, w // 2, 4))
    mean = z.mean(-1, keepdim=True)
    x = (1 + gamma) ** 0.5 * (z - mean) + max(1 - 3 * gamma, 0.0) ** 0.5 * mean
    # [b, c, t, h/2, w/2, (p q)] -> [b, c, t, h, w]
    x = x.reshape(b, c, t, h // 2, w // 2, 2, 2).permute(0, 1, 2, 3, 5, 4, 6)
    return x.reshape(b, c, t, h, w)


def enter_stage(x: Tensor, schedule: PyramidSchedule, stage: int, draws: Draws) -> Tensor:
    """The end latent of stage - 1 -> the start latent of `stage`: upsample, then renoise."""
    x = upsample_nearest(x)
    alpha, beta = schedule.renoise_coefficients(stage)
    return alpha * x + beta * block_noise(x.shape, schedule.gamma, draws).to(x)


def _steps_per_stage(steps: int | Sequence[int], stages: int) -> list[int]:
    steps = [steps] * stages if isinstance(steps, int) else list(steps)
    if len(steps) != stages or min(steps) < 1:
        raise ValueError(f"need {stages} step counts >= 1 (or one int), got {steps}")
    return steps


def run_stage(velocity: VelocityFn, x: Tensor, schedule: PyramidSchedule, stage: int,
              steps: int, flow: FlowConfig | None = None) -> Tensor:
    """Euler steps on one stage's line, from its start point (r = 1) to its end point (r = 0)."""
    timesteps, ratios = schedule.set_timesteps(steps, stage)
    ratios = ratios.tolist()
    for i, t in enumerate(timesteps.tolist()):
        t_batch = torch.full((x.shape[0],), t, dtype=torch.float32, device=x.device)
        v = velocity(x, t_batch).to(x.dtype)
        if flow is not None and flow.prediction_type == "sample":
            v = clean_velocity(v, x, ratios[i], stage, schedule)  # the output is x0_k
        x = x + (ratios[i + 1] - ratios[i]) * v
    return x


@torch.no_grad()
def denoise_unit(velocity_at: Callable[[int], VelocityFn], start: Tensor, schedule: PyramidSchedule,
                 steps: int | Sequence[int], draws: Draws, flow: FlowConfig | None = None) -> list[Tensor]:
    """Denoise one unit from its stage-0 start latent `start` [b, C, T, h0, w0] (pure noise at the
    lowest resolution); returns each stage's end latent, lowest resolution first (the last is the
    sample). `draws` supplies the block noise of the stage jumps; `flow`, what the model outputs."""
    steps = _steps_per_stage(steps, schedule.stages)
    x, ends = start, []
    for stage in range(schedule.stages):
        if stage > 0:
            x = enter_stage(x, schedule, stage, draws)
        x = run_stage(velocity_at(stage), x, schedule, stage, steps[stage], flow)
        ends.append(x)
    return ends


def sample_full_sequence(velocity: VelocityFn, noise: Tensor, schedule: PyramidSchedule,
                         steps: int | Sequence[int], draws: Draws, *,
                         uncond_velocity: VelocityFn | None = None,
                         guidance_scale: float = 1.0, flow: FlowConfig | None = None) -> Tensor:
    """Sample whole clips with a full-sequence pyramid model.

    `noise` [b, C, T, H, W] is drawn at full resolution (as in training, stage 0 starts from its
    bilinear halving, scaled to unit variance); returns the sample at full resolution, sigma 0.
    With `uncond_velocity`, classifier-free guidance v_u + g (v_c - v_u) with g = `guidance_scale`.
    """
    if uncond_velocity is not None:
        velocity = guided_velocity(velocity, uncond_velocity, guidance_scale)
    elif guidance_scale != 1.0:
        raise ValueError("guidance_scale needs an uncond_velocity")
    start = noise_pyramid(noise, schedule.stages)[0]
    return denoise_unit(lambda stage: velocity, start, schedule, steps, draws, flow)[-1]


# ----------------------------------------------------------------------------------------------
# Autoregressive sampling: one unit after another, each through the spatial pyramid
# ----------------------------------------------------------------------------------------------

def unit_span(unit: int, frame_per_unit: int) -> tuple[int, int]:
    """Latent frames [start, end) of unit `unit` (0-based): unit 0 is frame 0 alone."""
    if unit == 0:
        return 0, 1
    start = unit_frames(unit, frame_per_unit)
    return start, start + frame_per_unit


def stage_histories(generated: Tensor, stages: int, frame_per_unit: int,
                    max_history_units: int | None) -> list[list[Tensor]]:
    """Per stage, the clean history clips (oldest first) for the unit after `generated`
    [b, C, T, H, W] (whole units), keeping only its last `max_history_units` units when given."""
    units = 1 + (generated.shape[2] - 1) // frame_per_unit
    if max_history_units is not None and units > max_history_units:
        keep = max_history_units * frame_per_unit
        generated, units = generated[:, :, -keep:], max_history_units
    levels = latent_pyramid(generated, stages)
    frames = generated.shape[2] + frame_per_unit  # the history and the unit being generated
    return [history_clips(levels, stage, units + 1, frames, frame_per_unit)[::-1] for stage in range(stages)]


@torch.no_grad()
def sample_autoregressive(velocity_given: HistoryVelocityFn, noise: Tensor, schedule: PyramidSchedule,
                          steps: int | Sequence[int], draws: Draws, *, frame_per_unit: int = 1,
                          video_steps: int | Sequence[int] | None = None, context: Tensor | None = None,
                          max_history_units: int | None = None,
                          uncond_given: HistoryVelocityFn | None = None, guidance_scale: float = 1.0,
                          video_guidance_scale: float | None = None, flow: FlowConfig | None = None,
                          on_unit: Callable[[int, int], None] | None = None) -> Tensor:
    """Generate a clip unit by unit with an autoregressive pyramid model.

    `noise` [b, C, T, H, W] (T = 1 + k * frame_per_unit) is drawn at full resolution for the whole
    clip; each unit starts from its frames' lowest-resolution level (as in training) and is
    denoised stage by stage (`denoise_unit`), every stage seeing the clean frames generated so far
    as its temporal-pyramid history (`velocity_given(history, stage)`). `context` [b, C, Tc, H, W]
    (whole units: an image, or a clip to continue) replaces the first units instead of being
    generated. `max_history_units` keeps only the last units as history (long clips); None keeps all.
    The first unit uses `steps` and `guidance_scale`, later ones `video_steps` and
    `video_guidance_scale` (default: the same). `on_unit(done, units)` is called after each unit
    (progress). Returns the clip [b, C, T, H, W], sigma 0.
    """
    if (noise.shape[2] - 1) % frame_per_unit:
        raise ValueError(f"{noise.shape[2]} latent frames are not 1 + a multiple of frame_per_unit "
                         f"({frame_per_unit})")
    if max_history_units is not None and max_history_units < 1:
        raise ValueError(f"max_history_units must be >= 1 (or None), got {max_history_units}")
    video_steps = steps if video_steps is None else video_steps
    video_guidance_scale = guidance_scale if video_guidance_scale is None else video_guidance_scale
    units = 1 + (noise.shape[2] - 1) // frame_per_unit
    starts = noise_pyramid(noise, schedule.stages)[0]
    out = noise.new_zeros(noise.shape)
    done = 0
    if context is not None:
        done = 1 + (context.shape[2] - 1) // frame_per_unit
        if context.shape[2] != unit_frames(done, frame_per_unit) or done > units:
            raise ValueError(f"context of {context.shape[2]} latent frames must be whole units and "
                             f"at most the clip's {noise.shape[2]}")
        out[:, :, :context.shape[2]] = context
    for unit in range(done, units):
        first, end = unit_span(unit, frame_per_unit)
        histories = (stage_histories(out[:, :, :first], schedule.stages, frame_per_unit, max_history_units)
                     if unit else [[] for _ in range(schedule.stages)])
        scale = guidance_scale if unit == 0 else video_guidance_scale

        def velocity_at(stage: int, histories=histories, scale=scale) -> VelocityFn:
            cond = velocity_given(histories[stage], stage)
            if uncond_given is None or scale == 1.0:
                return cond
            return guided_velocity(cond, uncond_given(histories[stage], stage), scale)

        ends = denoise_unit(velocity_at, starts[:, :, first:end], schedule,
                            steps if unit == 0 else video_steps, draws, flow)
        out[:, :, first:end] = ends[-1]
        if on_unit is not None:
            on_unit(unit + 1, units)
    return out

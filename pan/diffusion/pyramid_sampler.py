"""Stage-by-stage Euler sampling for pyramid flow models (see `pan.diffusion.pyramid` for the math).

One unit of latent frames is denoised stage by stage: stage 0 starts from noise at the lowest
resolution; each stage runs its Euler steps on the stage's line from r = 1 (its start point) to
r = 0 (its end point); between stages the latent is upsampled (nearest x2) and renoised with
correlated block noise, which makes the upsampled noise i.i.d. again at the next stage's start sigma.
The last stage ends at sigma 0, at full resolution.

`denoise_unit` is that loop for one unit and takes the velocity per stage, `velocity_at(stage)`: a
full-sequence model uses one velocity function for all stages (`sample_full_sequence`); the
autoregressive driver (one unit after another, each stage's velocity closing over that stage's
history clips, as the original's `generate`) is to be built on the same function.

A velocity function is `velocity(x, t) -> v` with x [b, C, T, h, w] at the stage's resolution and
t [b] float32 the DiT's timesteps (0..num_train_timesteps scale, the values it was trained on); v is
the stage velocity start - end (pan's convention: the sample moves by (r_next - r) * v).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor

from pan.diffusion.pyramid import Draws, PyramidSchedule, noise_pyramid, upsample_nearest
from pan.diffusion.sampler import guided_velocity

VelocityFn = Callable[[Tensor, Tensor], Tensor]


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
              steps: int) -> Tensor:
    """Euler steps on one stage's line, from its start point (r = 1) to its end point (r = 0)."""
    timesteps, ratios = schedule.set_timesteps(steps, stage)
    ratios = ratios.tolist()
    for i, t in enumerate(timesteps.tolist()):
        t_batch = torch.full((x.shape[0],), t, dtype=torch.float32, device=x.device)
        v = velocity(x, t_batch)
        x = x + (ratios[i + 1] - ratios[i]) * v.to(x.dtype)
    return x


@torch.no_grad()
def denoise_unit(velocity_at: Callable[[int], VelocityFn], start: Tensor, schedule: PyramidSchedule,
                 steps: int | Sequence[int], draws: Draws) -> list[Tensor]:
    """Denoise one unit from its stage-0 start latent `start` [b, C, T, h0, w0] (pure noise at the
    lowest resolution); returns each stage's end latent, lowest resolution first (the last is the
    sample). `draws` supplies the block noise of the stage jumps."""
    steps = _steps_per_stage(steps, schedule.stages)
    x, ends = start, []
    for stage in range(schedule.stages):
        if stage > 0:
            x = enter_stage(x, schedule, stage, draws)
        x = run_stage(velocity_at(stage), x, schedule, stage, steps[stage])
        ends.append(x)
    return ends


def sample_full_sequence(velocity: VelocityFn, noise: Tensor, schedule: PyramidSchedule,
                         steps: int | Sequence[int], draws: Draws, *,
                         uncond_velocity: VelocityFn | None = None,
                         guidance_scale: float = 1.0) -> Tensor:
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
    return denoise_unit(lambda stage: velocity, start, schedule, steps, draws)[-1]

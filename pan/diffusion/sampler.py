"""Euler sampler for flow-matching models, with classifier-free guidance and known-frame conditioning.

The sampler integrates dx/dsigma = v(x, sigma) from sigma = 1 (noise) to sigma = 0 (data) on the
grid sigma_i = shift(linspace(1, 0, steps + 1), s) with shift(t, s) = s t / (1 + (s - 1) t), the
training shift rule (the released Pan samples with 50 steps, s = 9, CFG 2.5).

It only sees a `velocity_fn(x_t, sigma) -> v` with `sigma` a Python float, so it is independent of
how a model packs its inputs: the caller closes over the model, the text features and the packing
and maps sigma to whatever the model takes. Keep x in fp32 (the released model samples fp32 latents).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

from pan.diffusion.flow import shift_timesteps

VelocityFn = Callable[[Tensor, float], Tensor]
ConditionFn = Callable[[Tensor, float], Tensor]


def sampling_sigmas(steps: int, shift: float = 1.0) -> Tensor:
    """Noise levels [steps + 1] from 1 down to 0 (fp64), shifted like the training timesteps."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if shift <= 0:
        raise ValueError(f"shift must be > 0, got {shift}")
    return shift_timesteps(torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64), shift)


def guided_velocity(cond_fn: VelocityFn, uncond_fn: VelocityFn, guidance_scale: float) -> VelocityFn:
    """Classifier-free guidance: v = v_uncond + g (v_cond - v_uncond).

    With g = 1 the guided velocity is v_cond, so the unconditional pass is skipped (half the cost).
    """
    if guidance_scale == 1.0:
        return cond_fn

    def velocity(x: Tensor, sigma: float) -> Tensor:
        v_uncond = uncond_fn(x, sigma)
        return v_uncond + guidance_scale * (cond_fn(x, sigma) - v_uncond)

    return velocity


def known_frames(known: Tensor, num_frames: int, noise: Tensor | None = None,
                 frame_dim: int = -3) -> ConditionFn:
    """A condition hook that re-imposes the first `num_frames` latent frames of `known`.

    Image-to-video: `num_frames=1` with the image's latent; video continuation: the first k latent
    frames of the given clip. Latents are [C, T, H, W] or [B, C, T, H, W] (frames at dim -3).
    With `noise=None` the known frames are written clean (models trained with clean condition
    frames); with `noise` (same shape as `known`) they are written at the current noise level,
    (1 - sigma) * known + sigma * noise, which is the replacement method for models trained without
    condition frames. Either way the final sample holds `known` exactly in those frames.
    """
    if not 0 < num_frames <= known.shape[frame_dim]:
        raise ValueError(f"num_frames must be in [1, {known.shape[frame_dim]}], got {num_frames}")
    if noise is not None and noise.shape != known.shape:
        raise ValueError(f"noise shape {tuple(noise.shape)} != known shape {tuple(known.shape)}")
    known_part = known.narrow(frame_dim, 0, num_frames)
    noise_part = None if noise is None else noise.narrow(frame_dim, 0, num_frames)

    def impose(x: Tensor, sigma: float) -> Tensor:
        frames = known_part if noise_part is None else (1 - sigma) * known_part + sigma * noise_part
        x = x.clone()
        x.narrow(frame_dim, 0, num_frames).copy_(frames)
        return x

    return impose


@torch.no_grad()
def euler_sample(velocity_fn: VelocityFn, noise: Tensor, steps: int, shift: float = 1.0,
                 condition_fn: ConditionFn | None = None, fresh_noise: float = 0.0,
                 generator: torch.Generator | None = None) -> Tensor:
    """Integrate from `noise` (sigma = 1) to a sample (sigma = 0) with `steps` Euler steps.

    `condition_fn(x, sigma) -> x`, if given, is applied before every velocity evaluation and once
    more at sigma = 0, so conditioned regions (see `known_frames`) hold exactly what it imposes.
    `fresh_noise` > 0 makes the steps stochastic (`renoise_step`), drawing from `generator`.
    """
    sigmas = sampling_sigmas(steps, shift).tolist()
    x = noise
    for sigma, sigma_next in zip(sigmas[:-1], sigmas[1:]):
        if condition_fn is not None:
            x = condition_fn(x, sigma)
        v = velocity_fn(x, sigma).to(x.dtype)
        x = renoise_step(x, v, sigma, sigma_next, fresh_noise, generator)
    if condition_fn is not None:
        x = condition_fn(x, 0.0)
    return x


def renoise_step(x: Tensor, v: Tensor, sigma: float, sigma_next: float, fresh_noise: float,
                 generator: torch.Generator | None) -> Tensor:
    """One step from sigma to sigma_next. The velocity splits x into its predicted clean sample
    x0 = x - sigma v and noise eps = x + (1 - sigma) v; the step rebuilds x at sigma_next as
    (1 - sigma_next) x0 + sigma_next (sqrt(1 - f^2) eps + f z), z fresh from `generator`.

    f = 0 is exactly the Euler step x + (sigma_next - sigma) v. f = 1 re-noises the predicted clean
    sample with fresh noise only (the multistep sampling of consistency models): each step starts
    again from the model's current guess instead of carrying the noise along the ODE. That samples
    less diversely than the model's distribution, but a small or briefly trained model's errors do
    not pile up: the CPU demo's squares come out square (docs/demo.md).
    """
    if fresh_noise == 0.0 or sigma_next == 0.0:
        return x + (sigma_next - sigma) * v
    x0, eps = x - sigma * v, x + (1 - sigma) * v
    z = torch.randn(x.shape, generator=generator, dtype=x.dtype).to(x.device)
    mixed = math.sqrt(1 - fresh_noise ** 2) * eps + fresh_noise * z
    return (1 - sigma_next) * x0 + sigma_next * mixed

"""Rectified-flow matching: how training timesteps are drawn and shifted, and the noising rule.

Convention (as in SD3 and the released Pan): t = sigma in [0, 1], t = 1 is pure noise,

    x_t = (1 - t) * x0 + t * eps,        target velocity v = dx_t/dt = eps - x0.

Timesteps are drawn per sample (`flow_snr_type`), then shifted towards noise (`train_timestep_shift`):

    shift(t, s) = s * t / (1 + (s - 1) * t)        (s = 1: identity, s > 1: noisier)

With `train_timestep_shift_mode: dynamic` the shift grows with each sample's token count L (SD3's
resolution rule: a sequence with k times as many tokens keeps its signal-to-noise ratio when the
shift grows like sqrt(k)):

    s(L) = train_timestep_shift * sqrt(L / train_timestep_shift_ref_tokens)

so s equals `train_timestep_shift` at L = `train_timestep_shift_ref_tokens` (the anchor) and, e.g.,
doubles at 4x the anchor's tokens. L is the sample's latent (video) token count, text excluded.

What the transformer outputs (`prediction_type`): the velocity itself (the released Pan model), or
the clean sample x0_hat, which stands for the velocity

    v_hat = (x_t - x0_hat) / max(t, prediction_sigma_min)

in the loss and the sampler alike (x-prediction, as in Li & He 2025, "Back to Basics: Let Denoising
Generative Models Denoise"). The loss is the same velocity loss either way; what changes is the
function the network has to learn: a clean frame is flat colour and edges, the velocity is mostly
noise, which a small pixel-space model reproduces poorly (the CPU demo's squares came out round).
Every draw comes from an explicit `torch.Generator`, so a resumed run that restores the generator's
state reproduces the same timesteps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import Tensor

from pan.config.core import knob, reject_unused

# `flow_snr_type: mix` draws logit-normal timesteps with this probability, uniform ones otherwise
# (the uniform share keeps the extremes t -> 0 and t -> 1 trained).
MIX_LOGNORM_PROB = 0.7

# `flow_mode_scale` keeps SD3's mode map f(u) monotone (a bijection of [0, 1]) only in this range:
# f'(u) = -1 - s + s * pi/2 * sin(pi u) <= 0 for all u  <=>  -1 <= s <= 2 / (pi - 2).
MODE_SCALE_MAX = 2.0 / (math.pi - 2.0)


@dataclass(kw_only=True)
class FlowConfig:
    """Flow-matching timestep sampling (see the module docstring for the formulas)."""

    SECTION: ClassVar[str] = "diffusion"

    flow_snr_type: Literal["uniform", "lognorm", "mix", "mode"] = knob(
        "lognorm", "how training timesteps are drawn: uniform, logit-normal, mix (logit-normal with "
        "probability 0.7, else uniform) or SD3 mode sampling")
    flow_lognorm_loc: float = knob(0.0, "mean of the normal whose sigmoid is t (lognorm and mix)")
    flow_lognorm_scale: float = knob(1.0, "std of the normal whose sigmoid is t (lognorm and mix)",
                                     gt=0)
    flow_mode_scale: float = knob(1.29, "scale s of SD3 mode sampling f(u) = 1 - u - s(cos^2(pi u/2) "
                                  "- 1 + u) (mode only)", ge=-1.0, le=MODE_SCALE_MAX)
    train_timestep_shift: float = knob(1.0, "shift s of training timesteps, t' = s t / (1 + (s - 1) t); "
                                       "1.0 = no shift; in dynamic mode the shift at the anchor", gt=0)
    train_timestep_shift_mode: Literal["fixed", "dynamic"] = knob(
        "fixed", "fixed: one shift for all samples; dynamic: shift * sqrt(tokens / anchor tokens) "
        "per sample")
    train_timestep_shift_ref_tokens: int = knob(
        4096, "anchor of the dynamic shift: the token count at which the shift equals "
        "train_timestep_shift (dynamic only)", gt=0)
    prediction_type: Literal["velocity", "sample"] = knob(
        "velocity", "what the transformer outputs: velocity (noise - x0; the released Pan model) or "
        "sample (x0, read as the velocity (x_t - x0) / max(t, prediction_sigma_min); in the Pyramid-Flow "
        "recipes x0 at the stage's resolution, read as the stage velocity it implies); pan and Pyramid-Flow "
        "recipes only")
    prediction_sigma_min: float = knob(
        0.05, "floor of t in that division, which bounds the loss weight of nearly clean inputs "
        "(sample only)", gt=0, lt=1)

    def check(self, job) -> None:
        uses_lognorm = self.flow_snr_type in ("lognorm", "mix")
        reject_unused(self, job, "flow_lognorm_loc", uses_lognorm,
                       "applies only with flow_snr_type lognorm or mix")
        reject_unused(self, job, "flow_lognorm_scale", uses_lognorm,
                       "applies only with flow_snr_type lognorm or mix")
        reject_unused(self, job, "flow_mode_scale", self.flow_snr_type == "mode",
                       "applies only with flow_snr_type mode")
        reject_unused(self, job, "train_timestep_shift_ref_tokens",
                       self.train_timestep_shift_mode == "dynamic",
                       "applies only with train_timestep_shift_mode dynamic")
        reject_unused(self, job, "prediction_type", job.READS_PREDICTION_TYPE,
                      f"the {job.recipe} recipe's models predict the velocity")
        reject_unused(self, job, "prediction_sigma_min", self.prediction_type == "sample",
                      "applies only with prediction_type sample")


def shift_timesteps(t: Tensor, shift: float | Tensor) -> Tensor:
    """t' = s t / (1 + (s - 1) t): moves t towards 1 (noise) for s > 1; keeps 0 and 1 fixed."""
    return shift * t / (1 + (shift - 1) * t)


def dynamic_shift(cfg: FlowConfig, tokens_per_sample: Tensor) -> Tensor:
    """Per-sample shift s(L) = train_timestep_shift * sqrt(L / train_timestep_shift_ref_tokens)."""
    tokens = tokens_per_sample.to(torch.float64)
    return (cfg.train_timestep_shift * torch.sqrt(tokens / cfg.train_timestep_shift_ref_tokens)).float()


def mode_map(u: Tensor, scale: float) -> Tensor:
    """SD3 mode sampling (Esser et al. 2024, eq. 20): f(u) = 1 - u - s (cos^2(pi u / 2) - 1 + u)."""
    return 1 - u - scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)


def _draw_unshifted(cfg: FlowConfig, num_samples: int, generator: torch.Generator) -> Tensor:
    """Timesteps [num_samples] in [0, 1] from `flow_snr_type`, before any shift."""
    def uniform() -> Tensor:
        return torch.rand(num_samples, generator=generator)

    def lognorm() -> Tensor:
        normal = torch.randn(num_samples, generator=generator)
        return torch.sigmoid(cfg.flow_lognorm_loc + cfg.flow_lognorm_scale * normal)

    if cfg.flow_snr_type == "uniform":
        return uniform()
    if cfg.flow_snr_type == "lognorm":
        return lognorm()
    if cfg.flow_snr_type == "mix":
        # Draw all three streams every time so the generator advances by the same amount whatever
        # the coin flips say (a resumed run then stays in step).
        from_lognorm = torch.rand(num_samples, generator=generator) < MIX_LOGNORM_PROB
        return torch.where(from_lognorm, lognorm(), uniform())
    return mode_map(uniform(), cfg.flow_mode_scale).clamp(0.0, 1.0)


def sample_timesteps(cfg: FlowConfig, num_samples: int, tokens_per_sample: list[int] | Tensor,
                     generator: torch.Generator) -> Tensor:
    """Training timesteps t [num_samples] (fp32, CPU) in [0, 1], shifted per `cfg`.

    `tokens_per_sample` (the latent token count L of each sample) sets the shift in dynamic mode
    and is checked for length in both modes. `generator` is a CPU generator; move t where needed.
    """
    tokens = torch.as_tensor(tokens_per_sample).cpu()  # draws live on the CPU, like the generator
    if tokens.shape != (num_samples,):
        raise ValueError(f"tokens_per_sample needs {num_samples} entries, got shape {tuple(tokens.shape)}")
    t = _draw_unshifted(cfg, num_samples, generator)
    if cfg.train_timestep_shift_mode == "dynamic":
        return shift_timesteps(t, dynamic_shift(cfg, tokens))
    if cfg.train_timestep_shift != 1.0:
        return shift_timesteps(t, cfg.train_timestep_shift)
    return t


def _expand_like(t: Tensor, x: Tensor) -> Tensor:
    """Broadcast t over x's trailing dims: t [B] (or [N] per token) -> [B, 1, ..., 1]."""
    t = torch.as_tensor(t, device=x.device, dtype=x.dtype)
    return t.reshape(t.shape + (1,) * (x.ndim - t.ndim))


def add_noise(x0: Tensor, noise: Tensor, t: Tensor | float) -> Tensor:
    """x_t = (1 - t) x0 + t noise. `t` is a scalar or covers x0's leading dims ([B] or per token [N])."""
    t = _expand_like(t, x0)
    return (1 - t) * x0 + t * noise


def velocity_target(x0: Tensor, noise: Tensor) -> Tensor:
    """The regression target v = d x_t / dt = noise - x0."""
    return noise - x0


def output_velocity(cfg: FlowConfig, out: Tensor, x_t: Tensor, t: Tensor | float) -> Tensor:
    """The velocity the transformer's output `out` stands for (`prediction_type`). `x_t` is laid out
    like `out`; `t` is a scalar or covers their leading dims ([N] per token row)."""
    if cfg.prediction_type == "velocity":
        return out
    t = _expand_like(t, out).clamp(min=cfg.prediction_sigma_min)
    return (x_t - out) / t

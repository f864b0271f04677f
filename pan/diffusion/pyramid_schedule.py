"""Pyramid flow matching (Pyramid-Flow, Jin et al. 2024): the math, the config and the stage schedule.

The flow from noise to data is cut into `stages` pieces; stage k runs at resolution 1/2^(S-1-k) of
the latent (stage 0 lowest). In global noise level sigma (t = 1 - sigma), stage k covers
[start_sigma_k, end_sigma_k], and inside a stage a sample is a straight line between two points:

    start_k = s_k * noise_k + (1 - s_k) * up(x0_{k-1})      (stage 0: start = noise)
    end_k   = e_k * noise_k + (1 - e_k) * x0_k              (last stage: end = x0)
    x(r)    = r * start_k + (1 - r) * end_k,    target v = start_k - end_k

with r in (0, 1] the in-stage position (1 = stage start, the noisier end), x0_k the data at the
stage's resolution (bilinear halving), up() nearest x2 upsampling and noise_k the full-resolution
noise halved bilinearly and scaled by 2 (unit variance kept). This is pan's flow convention
(`pan.diffusion.flow`: x_t = (1 - t) x0 + t eps, v = eps - x0) with end in place of x0, start in
place of eps and r in place of t.

Jump between stages. Upsampling makes the noise of each 2x2 block identical; sampling renoises with
correlated block noise so that it becomes i.i.d. again. With s the signal coefficient at the jump
(s = 1 - sigma at the boundary) and gamma the block-noise correlation (`gamma`):

    alpha = 1 / (sqrt(1 + 1/gamma) (1 - s) + s),   beta = alpha (1 - s) / sqrt(gamma)
    x <- alpha * up(x) + beta * block_noise

so the next stage starts at signal alpha * s, i.e. start_sigma = 1 - alpha * s (the "corrected"
start sigma of the tables). With the defaults the stages cover t in [0, 1/3], [1/5, 2/3], [1/2, 1].

Tables. The DiT is conditioned on `timesteps_per_stage[k][i]` (0..num_train_timesteps scale, the
stage's share of the global timestep range, proportional to its sigma distance) and trained at
r = `sigmas_per_stage[k][i]` = 1 - i/N, for a table index i drawn per sample. The tables are built
in float64 the way the original's numpy-1 code does (numpy >= 2 would build one of them in float32).

Here: the config and the schedule's tables. The rest of pyramid flow matching lives beside it: random
numbers in `pan.diffusion.pyramid_draws`, latent normalisation and the resolution pyramids in
`pan.diffusion.pyramid_latents`, training-time noising (and the velocity a clean latent stands for) in
`pan.diffusion.pyramid_noising`, the units and history clips of autoregressive training in
`pan.diffusion.pyramid_units`, and sampling in `pan.diffusion.pyramid_sampler`.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, fields
from typing import ClassVar, Literal

import torch
from torch import Tensor

from pan.config.core import ConfigError, ErrorCollector, knob, require
from pan.diffusion.flow import FlowConfig

# Latent statistics of the released Pyramid-Flow models: a latent is normalised as (x - shift) * scale.
# The causal VAE encodes frame 0 like an image, so frame 0 has its own statistics; both released DiTs
# share the video statistics. A recipe applies a row as the defaults of the four keys.
LATENT_STATS: dict[str, dict[str, float]] = {
    "pyramid_flux": {"image_latent_shift": -0.04, "image_latent_scale": 1 / 1.8726,
                     "video_latent_shift": -0.2343, "video_latent_scale": 1 / 3.0986},
    "pyramid_mmdit": {"image_latent_shift": 0.1490, "image_latent_scale": 1 / 1.8415,
                      "video_latent_shift": -0.2343, "video_latent_scale": 1 / 3.0986},
}

# The flow keys a pyramid recipe reads whichever way it draws stage positions (what the DiT outputs).
STAGE_SAMPLING_FREE_FLOW_KEYS = ("prediction_type", "prediction_sigma_min")


@dataclass(kw_only=True)
class PyramidConfig:
    """Pyramid flow matching: the stages, how training points are drawn in them, latent statistics."""

    SECTION: ClassVar[str] = "diffusion"

    stages: int = knob(3, "number of pyramid stages; stage k runs at 1/2^(stages-1-k) of the latent "
                          "resolution", ge=2)
    stage_range: list[float] = knob([0.0, 1 / 3, 2 / 3, 1.0],
                                    "stage boundaries in t = 1 - sigma before the renoising correction: "
                                    "stages + 1 increasing values from 0 to 1", ge=0, le=1)
    gamma: float = knob(1 / 3, "correlation -gamma of the block noise added at each stage jump "
                               "(<= 1/3 keeps its covariance valid)", gt=0, le=1 / 3)
    sample_ratios: list[int] = knob([1, 2, 1], "columns per stage in a batch: [1, 2, 1] splits it into "
                                               "4 columns with stages 0, 1, 1, 2", ge=1)
    corrupt_ratio: float = knob(1 / 3, "history clips (autoregressive training) are corrupted with "
                                       "noise level sigma ~ U(0, corrupt_ratio)", ge=0, le=1)
    num_train_timesteps: int = knob(1000, "entries of each stage's timestep table", ge=2)
    stage_timestep_sampling: Literal["uniform", "flow"] = knob(
        "uniform", "how the in-stage position is drawn: uniform over the stage's table (the "
                   "original), or flow: t from the flow_* keys (flow_snr_type, train_timestep_shift) "
                   "taken as the in-stage noise level r")
    image_latent_shift: float = knob(LATENT_STATS["pyramid_flux"]["image_latent_shift"],
                                     "latent frame 0 is normalised as (x - shift) * scale (image "
                                     "statistics; pyramid_mmdit: 0.1490)")
    image_latent_scale: float = knob(LATENT_STATS["pyramid_flux"]["image_latent_scale"],
                                     "scale for latent frame 0 (pyramid_flux 1/1.8726, "
                                     "pyramid_mmdit 1/1.8415)", gt=0)
    video_latent_shift: float = knob(LATENT_STATS["pyramid_flux"]["video_latent_shift"],
                                     "latent frames 1.. are normalised as (x - shift) * scale "
                                     "(video statistics)")
    video_latent_scale: float = knob(LATENT_STATS["pyramid_flux"]["video_latent_scale"],
                                     "scale for latent frames 1..", gt=0)

    def check(self, job) -> None:
        problems = ErrorCollector()
        for rule in (self._check_stage_range, self._check_sample_ratios,
                     lambda: self._check_timestep_source(job), lambda: self._check_corruption(job)):
            with problems.gather():
                rule()
        problems.raise_any()

    def _check_stage_range(self) -> None:
        r = self.stage_range
        require(len(r) == self.stages + 1, "stage_range",
                f"needs stages + 1 = {self.stages + 1} boundaries (stages is {self.stages}), got "
                f"{len(r)}: {r}. Give one more boundary than stages, from 0 to 1.")
        require(r[0] == 0 and r[-1] == 1, "stage_range",
                f"must start at 0 and end at 1 (the whole flow), got {r}.")
        indices = [int(b * self.num_train_timesteps) for b in r]
        require(all(a < b for a, b in zip(indices, indices[1:])), "stage_range",
                f"must increase, with every stage at least 1/num_train_timesteps wide "
                f"(num_train_timesteps {self.num_train_timesteps}), got {r}.")

    def _check_sample_ratios(self) -> None:
        require(len(self.sample_ratios) == self.stages, "sample_ratios",
                f"needs one column count per stage ({self.stages}), got {self.sample_ratios}.")

    def _check_timestep_source(self, job) -> None:
        flow = getattr(job, "flow", None)
        if self.stage_timestep_sampling == "flow":
            require(isinstance(flow, FlowConfig), "stage_timestep_sampling",
                    "is flow, but this recipe has no flow_* keys. Use uniform.")
            require(flow.train_timestep_shift_mode == "fixed", "train_timestep_shift_mode",
                    "must be fixed with pyramid stages (the stage already sets the resolution). "
                    "Remove it, or set train_timestep_shift_mode: fixed.")
            return
        if isinstance(flow, FlowConfig):
            for key in _changed_keys(flow, job):
                if key in STAGE_SAMPLING_FREE_FLOW_KEYS:
                    continue
                raise ConfigError(key, "only applies with stage_timestep_sampling: flow (it is "
                                       "uniform), so it would be ignored. Remove it, or set "
                                       "stage_timestep_sampling: flow.")

    def _check_corruption(self, job) -> None:
        # A recipe without history clips (its job's HISTORY_CLIPS) has nothing for corrupt_ratio to corrupt.
        if not job.HISTORY_CLIPS and "corrupt_ratio" in _changed_keys(self, job):
            raise ConfigError("corrupt_ratio", f"only applies to autoregressive training (history "
                                               f"clips); recipe {job.recipe} has none, so it would "
                                               "be ignored. Remove it.")


def _changed_keys(component, job) -> list[str]:
    """Keys of `component` the user set to a value other than the default."""
    explicit = getattr(job, "explicit_keys", set())
    return [f.name for f in fields(component)
            if f.name in explicit and getattr(component, f.name) != _default(f)]


def _default(f):
    return f.default_factory() if f.default is MISSING else f.default


# ----------------------------------------------------------------------------------------------
# Schedule
# ----------------------------------------------------------------------------------------------

def numpy_linspace(start: float, stop: float, num: int) -> Tensor:
    """float64 [num] equal to numpy 1.x `np.linspace(start, stop, num)` bit for bit.

    numpy computes start + i * ((stop - start) / (num - 1)) and writes `stop` last; torch.linspace
    uses another formula (and rounds differently), so the tables would differ in the last ulp.
    """
    if num == 1:
        return torch.tensor([start], dtype=torch.float64)
    step = (stop - start) / (num - 1)
    y = torch.arange(num, dtype=torch.float64) * step + start
    y[-1] = stop
    return y


def renoise_alpha(signal: float, gamma: float) -> float:
    """Scale applied to the upsampled latent at a stage jump whose signal coefficient is `signal`."""
    return 1 / (math.sqrt(1 + (1 / gamma)) * (1 - signal) + signal)


class PyramidSchedule:
    """The per-stage tables of pyramid flow matching (see the module docstring)."""

    def __init__(self, config: PyramidConfig):
        self.config = config
        n, r = config.num_train_timesteps, config.stage_range
        if len(r) != config.stages + 1:
            raise ValueError(f"stage_range needs {config.stages + 1} values, got {r}")
        self.num_train_timesteps = n
        self.stages = config.stages
        self.gamma = config.gamma
        # Global grid: sigma_i = (N - i) / N in float32, timesteps = sigma * N (the original's, no shift).
        self.global_sigmas = torch.arange(n, 0, -1, dtype=torch.float32) / n      # [N] f32
        self.global_timesteps = self.global_sigmas * n                               # [N] f32
        self.ori_start_sigmas, self.start_sigmas, self.end_sigmas = [], [], []
        for k in range(self.stages):
            start, end = int(r[k] * n), min(int(r[k + 1] * n), n)
            if start >= end:
                raise ValueError(f"stage {k} of stage_range {r} is narrower than one of {n} steps")
            ori_start = self.global_sigmas[start].item()
            self.ori_start_sigmas.append(ori_start)
            self.end_sigmas.append(self.global_sigmas[end].item() if end < n else 0.0)
            if k == 0:
                self.start_sigmas.append(ori_start)
            else:  # the renoising jump raises the signal from 1 - ori_start to alpha * (1 - ori_start)
                signal = 1 - ori_start
                self.start_sigmas.append(1 - renoise_alpha(signal, self.gamma) * signal)
        self.timestep_ratios = self._timestep_ratios()
        self.timesteps_per_stage = [self._stage_timesteps(k) for k in range(self.stages)]  # f64 [N]
        ratios = numpy_linspace(1.0, 0.0, n + 1)[:-1]                                      # f64 [N]
        self.sigmas_per_stage = [ratios.clone() for _ in range(self.stages)]

    def _timestep_ratios(self) -> list[tuple[float, float]]:
        """Each stage's share [a, b] of the global timestep range, proportional to its sigma distance."""
        distance = [s - e for s, e in zip(self.start_sigmas, self.end_sigmas)]
        total = sum(distance)
        last = self.stages - 1
        return [(0.0 if k == 0 else sum(distance[:k]) / total,
                 1.0 if k == last else sum(distance[:k + 1]) / total) for k in range(self.stages)]

    def _stage_timesteps(self, k: int) -> Tensor:
        n = self.num_train_timesteps
        a, b = self.timestep_ratios[k]
        t_max = self.global_timesteps[int(a * n)].item()
        t_min = self.global_timesteps[min(int(b * n), n - 1)].item()
        return numpy_linspace(t_max, t_min, n + 1)[:-1]

    def stage_windows(self) -> list[tuple[float, float]]:
        """Each stage's [start, end] in time t = 1 - sigma (after the renoising correction)."""
        return [(1 - s, 1 - e) for s, e in zip(self.start_sigmas, self.end_sigmas)]

    def set_timesteps(self, steps: int, stage: int) -> tuple[Tensor, Tensor]:
        """Inference grid of one stage: (timesteps f64 [steps], ratios r f64 [steps + 1] ending at 0).

        The DiT is called at timesteps[i]; an Euler step moves r from ratios[i] to ratios[i + 1].
        """
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        table, ratios = self.timesteps_per_stage[stage], self.sigmas_per_stage[stage]
        timesteps = numpy_linspace(table[0].item(), table[-1].item(), steps)
        r = numpy_linspace(ratios[0].item(), ratios[-1].item(), steps)
        return timesteps, torch.cat([r, torch.zeros(1, dtype=torch.float64)])

    def renoise_coefficients(self, stage: int) -> tuple[float, float]:
        """(alpha, beta) of the jump into `stage` (> 0): x <- alpha * up(x) + beta * block_noise."""
        if not 0 < stage < self.stages:
            raise ValueError(f"stage must be in [1, {self.stages - 1}], got {stage}")
        signal = 1 - self.ori_start_sigmas[stage]
        alpha = renoise_alpha(signal, self.gamma)
        return alpha, alpha * (1 - signal) / math.sqrt(self.gamma)

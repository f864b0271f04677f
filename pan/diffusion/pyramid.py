"""Pyramid flow matching (Pyramid-Flow, Jin et al. 2024): stage schedule, latent/noise pyramids, noising.

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

Randomness. Every function that draws takes a `Draws` (`rand(shape)`, `randn(shape)`); the default
`GeneratorDraws` reads one `torch.Generator`, whose state a recipe saves for an exact resume. The
draw order is the original's, so replaying its recorded draws reproduces its outputs bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, fields
from typing import ClassVar, Literal, Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from pan.config.core import ConfigError, ErrorCollector, knob, require
from pan.diffusion.flow import FlowConfig, sample_timesteps

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


# ----------------------------------------------------------------------------------------------
# Random numbers
# ----------------------------------------------------------------------------------------------

class Draws(Protocol):
    """A source of random numbers, consumed in a fixed order (float32 tensors)."""

    def rand(self, shape: Sequence[int]) -> Tensor: ...   # U[0, 1)

    def randn(self, shape: Sequence[int]) -> Tensor: ...  # N(0, 1)


class GeneratorDraws:
    """Draws from one `torch.Generator`, on its device. Save `generator.get_state()` to resume exactly.

    `stage_timestep_sampling: flow` draws through `pan.diffusion.flow`, which needs a CPU generator.
    """

    def __init__(self, generator: torch.Generator):
        self.generator = generator

    def rand(self, shape: Sequence[int]) -> Tensor:
        return torch.rand(tuple(shape), generator=self.generator, device=self.generator.device)

    def randn(self, shape: Sequence[int]) -> Tensor:
        return torch.randn(tuple(shape), generator=self.generator, device=self.generator.device)


class PerSampleDraws:
    """Draws for a batch whose row i (the leading dimension) comes from generator i: samples drawn
    together get exactly the numbers each would draw alone from its own generator (a validation
    prompt keeps its seed's noise whatever batch it is sampled in)."""

    def __init__(self, generators: Sequence[torch.Generator]):
        self.draws = [GeneratorDraws(g) for g in generators]

    def _rows(self, shape: Sequence[int], draw) -> Tensor:
        if shape[0] != len(self.draws):
            raise ValueError(f"a draw of {shape[0]} rows from {len(self.draws)} per-sample generators")
        return torch.cat([draw(d, (1, *shape[1:])) for d in self.draws])

    def rand(self, shape: Sequence[int]) -> Tensor:
        return self._rows(shape, GeneratorDraws.rand)

    def randn(self, shape: Sequence[int]) -> Tensor:
        return self._rows(shape, GeneratorDraws.randn)


# ----------------------------------------------------------------------------------------------
# Latents and pyramids
# ----------------------------------------------------------------------------------------------

def normalize_latent(latent: Tensor, cfg: PyramidConfig) -> Tensor:
    """[B, C, T, H, W] VAE latent -> normalised: frame 0 with image statistics, frames 1.. with video's."""
    first = (latent[:, :, :1] - cfg.image_latent_shift) * cfg.image_latent_scale
    rest = (latent[:, :, 1:] - cfg.video_latent_shift) * cfg.video_latent_scale
    return torch.cat([first, rest], dim=2)


def denormalize_latent(latent: Tensor, cfg: PyramidConfig) -> Tensor:
    """Inverse of `normalize_latent`, for decoding a sample with the VAE."""
    first = latent[:, :, :1] / cfg.image_latent_scale + cfg.image_latent_shift
    rest = latent[:, :, 1:] / cfg.video_latent_scale + cfg.video_latent_shift
    return torch.cat([first, rest], dim=2)


def _per_frame(fn, x: Tensor) -> Tensor:
    """Apply a 2-D image op `fn` ([N, C, H, W] -> [N, C, H', W']) to every frame of [B, C, T, H, W]."""
    b, c, t, h, w = x.shape
    frames = x.transpose(1, 2).reshape(b * t, c, h, w)
    out = fn(frames)
    return out.reshape(b, t, c, *out.shape[-2:]).transpose(1, 2)


def halve(x: Tensor) -> Tensor:
    """[B, C, T, H, W] -> [B, C, T, H//2, W//2]: per-frame bilinear (align_corners=False)."""
    h, w = x.shape[-2:]
    return _per_frame(lambda f: F.interpolate(f, size=(h // 2, w // 2), mode="bilinear"), x)


def upsample_nearest(x: Tensor) -> Tensor:
    """[B, C, T, H, W] -> [B, C, T, 2H, 2W]: per-frame nearest (each value fills a 2x2 block)."""
    h, w = x.shape[-2:]
    return _per_frame(lambda f: F.interpolate(f, size=(2 * h, 2 * w), mode="nearest"), x)


def _check_divisible(x: Tensor, stages: int) -> None:
    factor = 2 ** (stages - 1)
    if x.shape[-2] % factor or x.shape[-1] % factor:
        raise ValueError(f"latent H, W {tuple(x.shape[-2:])} must be divisible by 2^(stages-1) = {factor}")


def latent_pyramid(latent: Tensor, stages: int) -> list[Tensor]:
    """[B, C, T, H, W] -> `stages` latents, lowest resolution first (each level halves H and W)."""
    _check_divisible(latent, stages)
    levels = [latent]
    for _ in range(stages - 1):
        levels.append(halve(levels[-1]))
    return levels[::-1]


def latent_pyramids(latents: list[Tensor], cfg: PyramidConfig) -> list[list[Tensor]]:
    """`latent_pyramid` of each [1, C, T, H, W] VAE latent after `normalize_latent`, on the CPU; the
    latents of one shape computed as one batch: the same values as one by one (elementwise ops and
    per-frame resizes), in a few ops instead of ~30 per sample."""
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for i, latent in enumerate(latents):
        by_shape.setdefault(tuple(latent.shape), []).append(i)
    pyramids: list[list[Tensor]] = [[] for _ in latents]
    for members in by_shape.values():
        stacked = normalize_latent(torch.cat([latents[i] for i in members]), cfg).cpu()
        levels = latent_pyramid(stacked, cfg.stages)
        for j, i in enumerate(members):
            pyramids[i] = [level[j:j + 1] for level in levels]
    return pyramids


def noise_pyramid(noise: Tensor, stages: int) -> list[Tensor]:
    """Full-resolution noise -> `stages` levels, lowest first. Halving averages 2x2 blocks, which
    divides the variance by 4, so each level is scaled by 2 to keep unit variance."""
    _check_divisible(noise, stages)
    levels = [noise]
    for _ in range(stages - 1):
        levels.append(halve(levels[-1]) * 2)
    return levels[::-1]


def column_stages(sample_ratios: Sequence[int]) -> list[int]:
    """The stage of each batch column: [1, 2, 1] -> [0, 1, 1, 2]."""
    return [stage for stage, count in enumerate(sample_ratios) for _ in range(count)]


# ----------------------------------------------------------------------------------------------
# Training-time noising
# ----------------------------------------------------------------------------------------------

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


def stage_unit_counts(*, step: int, rank: int, video_sync_group: int, frame_per_unit: int,
                      max_frames: int, clip_units: int, stages: int = 3) -> list[int]:
    """Units (groups of `frame_per_unit` latent frames; the first unit is frame 0 alone) each stage's
    columns train on, for the `step`-th call on this rank (0 for the first call).

    The highest stage's count walks through 1..M (M = units of `max_frames` latent frames) as the
    rank within its video sync group and the call count advance; lower stages take the rest,
    1 + M - high, so every column carries about the same number of tokens. Counts are clipped to
    [1, clip_units], the units of this batch's clip. Returns [low, ..., low, high].
    """
    units_max = 1 + (max_frames - 1) // frame_per_unit
    turns = units_max // video_sync_group
    if turns < 1:
        raise ValueError(f"video_sync_group ({video_sync_group}) must be <= the units of max_frames "
                         f"({units_max})")
    turn = (step + 1) % turns  # the original advances its counter before using it
    high = rank % video_sync_group + 1 + turn * video_sync_group
    low = max(1 + units_max - high, 1)
    return [min(n, clip_units) for n in [low] * (stages - 1) + [high]]


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

def unit_frames(units: int, frame_per_unit: int) -> int:
    """Latent frames of the first `units` units: the first unit is frame 0 alone (an image)."""
    return 1 + (units - 1) * frame_per_unit


def history_spans(stage: int, units: int, frames: int, frame_per_unit: int) -> list[tuple[int, int, int]]:
    """(pyramid level, first frame, end frame) of each history clip of a column of `stage` that
    trains its `units`-th unit, newest first; `frames` = frames up to and including that unit.

    The temporal pyramid: the previous unit at the column's own stage, then one older unit per lower
    stage down to stage 1, then every older frame as one clip at stage 0. Units are counted back
    from the end, so any prefix (a truncated history at sampling time) works the same.
    """
    if units < 2:
        return []

    def unit_back(k: int) -> tuple[int, int]:  # the k-th unit before the trained one (k = 0: it)
        return max(frames - (k + 1) * frame_per_unit, 0), frames - k * frame_per_unit

    spans = [(stage, *unit_back(1))]
    taken, level = 2, stage
    while taken < units:
        level = max(level - 1, 0)
        if level == 0:
            break
        spans.append((level, *unit_back(taken)))
        taken += 1
    if level == 0 and taken < units:
        spans.append((0, 0, frames - taken * frame_per_unit))
    return spans


def history_clips(latents: Sequence[Tensor], stage: int, units: int, frames: int,
                  frame_per_unit: int) -> list[Tensor]:
    """The clean history clips (see `history_spans`) of pyramid levels [b, C, T, h_k, w_k], newest first."""
    return [latents[level][:, :, start:end]
            for level, start, end in history_spans(stage, units, frames, frame_per_unit)]


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

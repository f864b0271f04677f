"""Pyramid flow matching: the stage tables, the training-time noising and the stage-by-stage sampler.

Tables, unit counts and the noising (given the recorded draws) must equal the original's
Pyramid-Flow numbers exactly (the fixture README, sections 1 and 4); the sampler has no fixture
(the original only samples autoregressively), so it is tested on its properties: the grid it visits,
the scale of each stage jump, and exact transport of a known data point.
"""

from types import SimpleNamespace

import pytest
import torch

from pan.config.core import ConfigError, ConfigErrors
from pan.config.loader import build_dataclass
from pan.diffusion.flow import FlowConfig, sample_timesteps
from pan.diffusion.pyramid_draws import GeneratorDraws
from pan.diffusion.pyramid_latents import (column_stages, denormalize_latent, latent_pyramid, latent_pyramids,
                                           noise_pyramid, normalize_latent)
from pan.diffusion.pyramid_noising import (clean_velocity, line_sigmas, noise_full_sequence, noise_sample,
                                           noise_temporal_pyramid, regression_target)
from pan.diffusion.pyramid_schedule import LATENT_STATS, PyramidConfig, PyramidSchedule
from pan.diffusion.pyramid_units import stage_unit_counts
from pan.diffusion.pyramid_sampler import block_noise, enter_stage, sample_full_sequence
from pyramid_reference import load_fixture, needs_reference, read_json

F64 = torch.float64


class ReplayDraws:
    """Serves a fixture's recorded draws in call order, checking each one's kind and shape."""

    def __init__(self, tensors: dict, sidecar: dict):
        self.queue = [(d["fn"], d["tensor"], tensors[d["tensor"]]) for d in sidecar["random_draws"]]

    def _next(self, kinds: tuple[str, ...], shape) -> torch.Tensor:
        assert self.queue, "more draws than the original made"
        fn, name, value = self.queue.pop(0)
        assert fn in kinds and tuple(value.shape) == tuple(shape), (name, fn, tuple(shape))
        return value

    def rand(self, shape):
        return self._next(("torch.rand", "torch.rand_like"), shape)

    def randn(self, shape):
        return self._next(("torch.randn", "torch.randn_like"), shape)


@pytest.fixture(scope="module")
def schedule() -> PyramidSchedule:
    return PyramidSchedule(PyramidConfig())


def as_tensor(table: dict) -> torch.Tensor:
    return torch.tensor(table["values"], dtype=getattr(torch, table["dtype"].removeprefix("torch.")))


# ----------------------------------------------------------------------------------------------
# Schedule tables
# ----------------------------------------------------------------------------------------------

@needs_reference
def test_every_scheduler_table_equals_the_original(schedule):
    # Exact equality (JSON floats hold every float32/float64 value at full precision).
    ref = read_json("scheduler/scheduler_tables.json")
    cfg = ref["config"]
    assert cfg["shift"] == 1.0  # pan's schedule has no global shift: the training value is 1
    assert (cfg["num_train_timesteps"], cfg["stages"], cfg["stage_range"], cfg["gamma"]) == (
        schedule.num_train_timesteps, schedule.stages, PyramidConfig().stage_range, schedule.gamma)
    per_stage = lambda key: [ref[key][str(k)] for k in range(schedule.stages)]  # noqa: E731
    assert schedule.start_sigmas == per_stage("start_sigmas")
    assert schedule.end_sigmas == per_stage("end_sigmas")
    assert schedule.ori_start_sigmas == per_stage("ori_start_sigmas")
    assert [list(r) for r in schedule.timestep_ratios] == per_stage("timestep_ratios")
    assert torch.equal(schedule.global_sigmas, as_tensor(ref["global_sigmas"]))
    assert torch.equal(schedule.global_timesteps, as_tensor(ref["global_timesteps"]))
    assert schedule.global_sigmas[-1].item() == ref["sigma_min"]
    assert schedule.global_sigmas[0].item() == ref["sigma_max"]
    for k in range(schedule.stages):
        timesteps = as_tensor(ref["timesteps_per_stage"][str(k)])
        assert timesteps.dtype == F64 and torch.equal(schedule.timesteps_per_stage[k], timesteps)
        assert torch.equal(schedule.sigmas_per_stage[k], as_tensor(ref["sigmas_per_stage"][str(k)]))
        inference = ref["inference_set_timesteps_20_20_20"][str(k)]
        timesteps, ratios = schedule.set_timesteps(inference["num_inference_steps"], k)
        assert torch.equal(timesteps, as_tensor(inference["timesteps"]))
        assert torch.equal(ratios, as_tensor(inference["sigmas"]))


@needs_reference
def test_float64_tables_differ_from_the_numpy2_float32_ones_by_one_ulp(schedule):
    # numpy >= 2 builds `timesteps_per_stage` in float32; pan builds the numpy-1 float64 table.
    # Cast to float32 (as the noising does), the two differ in the entries the fixture counts.
    ref = read_json("scheduler/scheduler_tables.json")
    for k in range(schedule.stages):
        numpy2 = as_tensor(ref["numpy2_timesteps_per_stage"][str(k)])
        ours = schedule.timesteps_per_stage[k].float()
        summary = ref["numpy2_comparison"][str(k)]
        assert int((ours != numpy2).sum()) == summary["n_differ_after_float32_cast"]
        assert (ours - numpy2).abs().max().item() == summary["max_abs_diff"]


def test_stage_windows_follow_the_renoising_correction():
    # In t = 1 - sigma the default stages cover [0, 1/3], [1/5, 2/3], [1/2, 1]: the jump at signal s
    # lands at alpha * s with alpha = 1 / (2 (1 - s) + s) for gamma = 1/3 (s = 1/3 -> 1/5, 2/3 -> 1/2).
    # The 1000-step grid rounds the boundaries (2/3 -> 0.666, 1/3 -> 0.333): compare to 2e-3 there,
    # and to 1e-5 on a 300000-step grid.
    exact = [(0.0, 1 / 3), (1 / 5, 2 / 3), (1 / 2, 1.0)]
    for steps, tol in ((1000, 2e-3), (300_000, 1e-5)):
        windows = PyramidSchedule(PyramidConfig(num_train_timesteps=steps)).stage_windows()
        flat = [t for window in windows for t in window]
        assert flat == pytest.approx([t for window in exact for t in window], abs=tol)
    windows = PyramidSchedule(PyramidConfig()).stage_windows()
    assert all(a < b for a, b in windows)
    assert windows[1][0] < windows[0][1] and windows[2][0] < windows[1][1]  # stages overlap in t


def test_set_timesteps_spans_the_stage_table(schedule):
    for k in range(schedule.stages):
        timesteps, ratios = schedule.set_timesteps(5, k)
        assert timesteps[0] == schedule.timesteps_per_stage[k][0]
        assert timesteps[-1] == schedule.timesteps_per_stage[k][-1]
        assert ratios[0] == 1.0 and ratios[-1] == 0.0 and len(ratios) == 6
        assert (timesteps.diff() < 0).all() and (ratios.diff() < 0).all()


# ----------------------------------------------------------------------------------------------
# Training-time noising against the original
# ----------------------------------------------------------------------------------------------

def _pyramid_from_raw(tensors: dict, runner: dict, cfg: PyramidConfig) -> list[torch.Tensor]:
    stats = LATENT_STATS[runner["model_name"]]
    assert stats["image_latent_shift"] == runner["vae_shift_factor"]
    assert stats["image_latent_scale"] == runner["vae_scale_factor"]
    assert stats["video_latent_shift"] == runner["vae_video_shift_factor"]
    assert stats["video_latent_scale"] == runner["vae_video_scale_factor"]
    normalized = normalize_latent(tensors["in.latent_raw"], cfg)
    assert torch.equal(normalized, tensors["built.latent_normalized"])
    levels = latent_pyramid(normalized, cfg.stages)
    for k, level in enumerate(levels):
        assert torch.equal(level, tensors[f"in.latents_list.stage{k}"])
    return levels


def _config_of(sidecar: dict) -> PyramidConfig:
    runner = sidecar["runner_settings"]
    return PyramidConfig(stages=len(runner["stages"]), stage_range=runner["stage_range"],
                         gamma=runner["scheduler_gamma"], sample_ratios=runner["sample_ratios"],
                         corrupt_ratio=runner["corrupt_ratio"],
                         **LATENT_STATS[sidecar["runner_extra"]["model_name"]])


def _assert_columns_equal(columns, tensors: dict, sidecar: dict) -> None:
    assert [c.stage for c in columns] == sidecar["column_to_stage"]
    for col in columns:
        c = col.column
        names = sorted(k for k in tensors if k.startswith(f"out.noisy.col{c}.clip"))
        assert len(col.clips) == len(names)
        for j, clip in enumerate(col.clips):
            assert torch.equal(clip, tensors[f"out.noisy.col{c}.clip{j}"]), (c, j)
        assert torch.equal(col.ratios, tensors[f"out.ratios.col{c}"].flatten())
        assert torch.equal(col.timesteps, tensors[f"out.timesteps.col{c}"])
        assert torch.equal(col.target, tensors[f"out.target.col{c}"])


@needs_reference
def test_full_sequence_noising_equals_the_original_given_its_draws():
    tensors, sidecar = load_fixture("scheduler/noise_full_sequence")
    cfg = _config_of(sidecar)
    levels = _pyramid_from_raw(tensors, sidecar["runner_extra"], cfg)
    draws = ReplayDraws(tensors, sidecar)
    columns = noise_full_sequence(levels, PyramidSchedule(cfg), draws)
    assert not draws.queue  # every recorded draw consumed, in order
    _assert_columns_equal(columns, tensors, sidecar)
    batch = levels[0].shape[0]
    assert sorted(i for c in columns for i in range(batch)[c.rows]) == list(range(batch))


@needs_reference
def test_temporal_pyramid_noising_equals_the_original_given_its_draws():
    tensors, sidecar = load_fixture("scheduler/noise_temporal_pyramid")
    cfg = _config_of(sidecar)
    levels = _pyramid_from_raw(tensors, sidecar["runner_extra"], cfg)
    rule = sidecar["sample_stage_length"]
    units = stage_unit_counts(step=rule["accumulate_steps_before"], rank=rule["rank"],
                              video_sync_group=sidecar["runner_extra"]["video_sync_group"],
                              frame_per_unit=sidecar["runner_settings"]["frame_per_unit"],
                              max_frames=sidecar["runner_extra"]["max_temporal_length"],
                              clip_units=rule["args"]["max_units"], stages=rule["args"]["num_stages"])
    assert units == rule["result_units_per_stage"]      # the public set's [4, 4, 5]; read from the set
    draws = ReplayDraws(tensors, sidecar)
    columns = noise_temporal_pyramid(levels, PyramidSchedule(cfg), units, draws,
                                     frame_per_unit=sidecar["runner_settings"]["frame_per_unit"])
    assert not draws.queue
    assert [[list(x.shape) for x in c.clips] for c in columns] == sidecar["clip_structure"]
    _assert_columns_equal(columns, tensors, sidecar)


# ----------------------------------------------------------------------------------------------
# Pure rules
# ----------------------------------------------------------------------------------------------

def test_column_stages_follow_sample_ratios():
    assert column_stages([1, 2, 1]) == [0, 1, 1, 2]
    assert column_stages([2, 1]) == [0, 0, 1]


def test_unit_counts_walk_every_position_once_per_sync_group_cycle():
    # M = 8 units, sync group 4 -> 2 turns: over ranks 0..3 and two consecutive calls the highest
    # stage trains each position 1..8 once, and the other stages take the rest (low + high = M + 1).
    seen = []
    for step in range(2):
        for rank in range(4):
            low, mid, high = stage_unit_counts(step=step, rank=rank, video_sync_group=4,
                                               frame_per_unit=1, max_frames=8, clip_units=8)
            assert low == mid and low + high == 9
            seen.append(high)
    assert sorted(seen) == list(range(1, 9))
    # A shorter clip clips every count; frame_per_unit groups frames (1 + 2 * 4 = 9 frames = 5 units).
    assert stage_unit_counts(step=0, rank=3, video_sync_group=4, frame_per_unit=1, max_frames=8,
                             clip_units=3) == [1, 1, 3]
    assert stage_unit_counts(step=1, rank=0, video_sync_group=2, frame_per_unit=2, max_frames=9,
                             clip_units=5) == [5, 5, 1]
    with pytest.raises(ValueError, match="video_sync_group"):
        stage_unit_counts(step=0, rank=0, video_sync_group=16, frame_per_unit=1, max_frames=8,
                          clip_units=8)


def test_normalisation_uses_image_stats_on_frame_zero_and_inverts():
    cfg = PyramidConfig(**LATENT_STATS["pyramid_mmdit"])
    x = torch.randn(2, 4, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    y = normalize_latent(x, cfg)
    torch.testing.assert_close(y[:, :, 0], (x[:, :, 0] - 0.1490) / 1.8415)
    torch.testing.assert_close(y[:, :, 1:], (x[:, :, 1:] + 0.2343) / 3.0986)
    torch.testing.assert_close(denormalize_latent(y, cfg), x)  # fp32 round trip


def test_pyramids_of_a_batch_are_each_samples_own_to_the_bit():
    # The AR task builds a held batch's pyramids together, a batch per clip shape: each must be what
    # normalising and halving that clip alone gives, bit for bit (its draws and losses depend on it).
    cfg = PyramidConfig(**LATENT_STATS["pyramid_mmdit"])
    g = torch.Generator().manual_seed(0)
    shapes = [(4, 3, 8, 8), (4, 2, 8, 8), (4, 3, 8, 8), (4, 3, 8, 16), (4, 3, 8, 8)]
    latents = [torch.randn(1, *shape, generator=g) for shape in shapes]
    together = latent_pyramids(latents, cfg)
    for latent, levels in zip(latents, together):
        alone = latent_pyramid(normalize_latent(latent, cfg), cfg.stages)
        assert [tuple(t.shape) for t in levels] == [tuple(t.shape) for t in alone]
        assert all(torch.equal(a, b) for a, b in zip(levels, alone))


def test_noise_pyramid_keeps_unit_variance():
    noise = torch.randn(4, 8, 4, 64, 64, generator=torch.Generator().manual_seed(0))
    levels = noise_pyramid(noise, 3)
    assert [tuple(x.shape[-2:]) for x in levels] == [(16, 16), (32, 32), (64, 64)]
    for level in levels:  # >= 32k values each: the std is within 2% of 1
        assert abs(level.std().item() - 1) < 0.02
    with pytest.raises(ValueError, match="divisible"):
        latent_pyramid(torch.zeros(1, 1, 1, 6, 8), 3)


# ----------------------------------------------------------------------------------------------
# Draws: flow samplers, resume
# ----------------------------------------------------------------------------------------------

def test_flow_mode_draws_the_in_stage_position_from_the_flow_sampler():
    flow = FlowConfig(flow_snr_type="lognorm", train_timestep_shift=3.0)
    cfg = PyramidConfig(stage_timestep_sampling="flow")
    schedule = PyramidSchedule(cfg)
    levels = latent_pyramid(torch.randn(8, 2, 1, 8, 8, generator=torch.Generator().manual_seed(1)), 3)
    columns = noise_full_sequence(levels, schedule, GeneratorDraws(torch.Generator().manual_seed(5)),
                                  flow=flow)
    # Replay by hand: full-res noise, then per column the flow draw (r = t rounded up onto the table
    # grid 1 - i/N) and the unused corruption level.
    gen = torch.Generator().manual_seed(5)
    torch.randn(levels[-1].shape, generator=gen)
    for col in columns:
        t = sample_timesteps(flow, 2, [1, 1], gen)
        idx = ((1 - t) * 1000).long().clamp(0, 999)
        assert torch.equal(col.ratios, schedule.sigmas_per_stage[col.stage][idx].float())
        assert (col.ratios >= t - 1e-6).all() and (col.ratios - t < 1e-3 + 1e-6).all()
        torch.rand(2, generator=gen)
    with pytest.raises(TypeError, match="generator"):
        noise_full_sequence(levels, schedule, ReplayDraws({}, {"random_draws": []}), flow=flow)


def test_generator_draws_resume_exactly_and_ignore_the_global_rng(schedule):
    levels = latent_pyramid(torch.randn(4, 2, 3, 8, 8, generator=torch.Generator().manual_seed(2)), 3)
    gen = torch.Generator().manual_seed(7)
    noise_full_sequence(levels, schedule, GeneratorDraws(gen))          # an earlier step
    state = gen.get_state()
    torch.manual_seed(0)
    first = noise_temporal_pyramid(levels, schedule, [2, 2, 3], GeneratorDraws(gen))
    gen.set_state(state)                                                 # resume from a checkpoint
    torch.manual_seed(1)
    again = noise_temporal_pyramid(levels, schedule, [2, 2, 3], GeneratorDraws(gen))
    for a, b in zip(first, again):
        assert all(torch.equal(x, y) for x, y in zip(a.clips + [a.target], b.clips + [b.target]))


# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------

def job_with(cfg: PyramidConfig, recipe: str = "pyramid_flow_ar", **extra):
    return SimpleNamespace(pyramid=cfg, explicit_keys=set(), recipe=recipe,
                           HISTORY_CLIPS=recipe == "pyramid_flow_ar", **extra)


@pytest.mark.parametrize("kwargs, key", [
    (dict(stage_range=[0, 0.5, 1]), "stage_range"),
    (dict(stage_range=[0.1, 0.4, 0.7, 1]), "stage_range"),
    (dict(stage_range=[0, 0.6, 0.4, 1]), "stage_range"),
    (dict(stage_range=[0, 0.3333, 0.3334, 1]), "stage_range"),   # a stage narrower than one step
    (dict(sample_ratios=[1, 1]), "sample_ratios"),
    (dict(stage_timestep_sampling="flow"), "stage_timestep_sampling"),  # job without flow_* keys
])
def test_config_rejects_inconsistent_keys(kwargs, key):
    with pytest.raises(ConfigError) as err:
        PyramidConfig(**kwargs).check(job_with(PyramidConfig(**kwargs)))
    assert err.value.key == key


def test_config_rules_that_involve_other_components():
    PyramidConfig().check(job_with(PyramidConfig()))  # defaults pass
    flow_dynamic = FlowConfig(train_timestep_shift_mode="dynamic")
    cfg = PyramidConfig(stage_timestep_sampling="flow")
    with pytest.raises(ConfigError) as err:
        cfg.check(job_with(cfg, flow=flow_dynamic))
    assert err.value.key == "train_timestep_shift_mode"
    cfg.check(job_with(cfg, flow=FlowConfig()))
    with pytest.raises(ConfigError) as err:  # a flow key that uniform sampling would ignore
        job = job_with(PyramidConfig(), flow=FlowConfig(flow_snr_type="mode"))
        job.explicit_keys = {"flow_snr_type"}
        PyramidConfig().check(job)
    assert err.value.key == "flow_snr_type"
    job.explicit_keys = {"flow_snr_type"}  # set to its default value: nothing is ignored
    job.flow = FlowConfig()
    PyramidConfig().check(job)
    with pytest.raises(ConfigError) as err:  # no history clips in full-sequence training
        job = job_with(PyramidConfig(corrupt_ratio=0.5), recipe="pyramid_flow")
        job.explicit_keys = {"corrupt_ratio"}
        job.pyramid.check(job)
    assert err.value.key == "corrupt_ratio"
    job.recipe, job.HISTORY_CLIPS = "pyramid_flow_ar", True
    job.pyramid.check(job)


def test_config_loads_from_yaml_values_and_reports_problems_together():
    cfg = build_dataclass(PyramidConfig, {"stage_range": "0, 0.25, 0.5, 1", "sample_ratios": [2, 1, 1],
                                          "stage_timestep_sampling": "flow"})
    assert cfg.stage_range == [0.0, 0.25, 0.5, 1.0] and cfg.sample_ratios == [2, 1, 1]
    with pytest.raises(ConfigError) as err:  # covariance (1 + g) I - g J of the block noise needs g <= 1/3
        build_dataclass(PyramidConfig, {"gamma": 0.4})
    assert err.value.key == "gamma"
    with pytest.raises(ConfigErrors) as err:  # 4 stages: both lists are one short
        PyramidConfig(stages=4).check(job_with(PyramidConfig(stages=4)))
    assert {e.key for e in err.value.errors} == {"stage_range", "sample_ratios"}


# ----------------------------------------------------------------------------------------------
# Sampler
# ----------------------------------------------------------------------------------------------

def test_sampler_visits_the_set_timesteps_grid_of_each_stage(schedule):
    visited = []

    def velocity(x, t):
        visited.append((tuple(x.shape[-2:]), t.clone()))
        return torch.zeros_like(x)

    steps = [3, 4, 5]
    noise = torch.randn(2, 4, 1, 16, 16, generator=torch.Generator().manual_seed(0))
    out = sample_full_sequence(velocity, noise, schedule, steps, GeneratorDraws(torch.Generator()))
    assert out.shape == noise.shape
    offsets = [0, 3, 7, 12]
    for k, size in enumerate([(4, 4), (8, 8), (16, 16)]):
        calls = visited[offsets[k]:offsets[k + 1]]
        assert all(shape == size for shape, _ in calls)
        expected = schedule.set_timesteps(steps[k], k)[0].float()
        assert torch.equal(torch.stack([t for _, t in calls]), expected[:, None].expand(-1, 2))
    assert len(visited) == 12


def test_stage_jump_lands_on_the_tables_start_sigma(schedule):
    g = torch.Generator().manual_seed(0)
    for k in range(1, schedule.stages):
        alpha, beta = schedule.renoise_coefficients(k)
        # Signal: the end of stage k - 1 holds (1 - end_sigma) x0, scaled by alpha to 1 - start_sigma.
        assert alpha * (1 - schedule.end_sigmas[k - 1]) == pytest.approx(1 - schedule.start_sigmas[k],
                                                                         abs=1e-12)
        # Noise: pure noise at the end of stage k - 1 (std end_sigma, i.i.d.) becomes i.i.d. noise of
        # std start_sigma; without the block noise the upsampled copies would be fully correlated.
        x_end = schedule.end_sigmas[k - 1] * torch.randn(4, 16, 2, 64, 64, generator=g)
        x = enter_stage(x_end, schedule, k, GeneratorDraws(g))
        assert x.std().item() == pytest.approx(schedule.start_sigmas[k], rel=0.01)  # 1M values
        same_block = torch.stack([x[..., ::2, ::2].flatten(), x[..., ::2, 1::2].flatten()])
        assert abs(torch.corrcoef(same_block)[0, 1].item()) < 0.01


@pytest.mark.parametrize("gamma", [1 / 3, 0.2])
def test_block_noise_has_unit_variance_and_correlation_minus_gamma(gamma):
    x = block_noise((4, 16, 2, 64, 64), gamma, GeneratorDraws(torch.Generator().manual_seed(0)))
    assert x.std().item() == pytest.approx(1.0, rel=0.01)
    pairs = torch.stack([x[..., ::2, ::2].flatten(), x[..., 1::2, 1::2].flatten()])
    assert torch.corrcoef(pairs)[0, 1].item() == pytest.approx(-gamma, abs=0.01)
    outside = torch.stack([x[..., 1::2, ::2][..., :-1, :].flatten(), x[..., 2::2, ::2].flatten()])
    assert abs(torch.corrcoef(outside)[0, 1].item()) < 0.01  # independent across blocks


def position_of(schedule: PyramidSchedule, steps: list[int], stage: int, t: torch.Tensor) -> float:
    """The in-stage position r of the timestep t[0], looked up as the original's scheduler does."""
    timesteps, ratios = schedule.set_timesteps(steps[stage], stage)
    return ratios[(timesteps.float() == t[0]).nonzero()[0, 0]].item()


def exact_velocity(x0: torch.Tensor, schedule: PyramidSchedule, steps: list[int], starts=None):
    """The stage velocity that carries every point onto x0's pyramid: in stage k a sample is
    sigma(r) eps + r (1 - s_k) up(x0_{k-1}) + (1 - r)(1 - e_k) x0_k with sigma(r) = r s_k + (1 - r) e_k,
    so eps follows from x and r, and v = start - end = (s_k - e_k) eps + (1 - s_k) up(x0_{k-1})
    - (1 - e_k) x0_k. r is looked up from the timestep, as the original's scheduler does.
    `starts` (a dict), if given, receives each stage's eps at its start point (r = 1)."""
    levels = latent_pyramid(x0, schedule.stages)
    stage_of = {tuple(level.shape[-2:]): k for k, level in enumerate(levels)}

    def velocity(x, t):
        k = stage_of[tuple(x.shape[-2:])]
        r = position_of(schedule, steps, k, t)
        s, e = schedule.start_sigmas[k], schedule.end_sigmas[k]
        up = torch.zeros_like(x) if k == 0 else (levels[k - 1].repeat_interleave(2, -2)
                                                .repeat_interleave(2, -1))
        eps = (x - r * (1 - s) * up - (1 - r) * (1 - e) * levels[k]) / (r * s + (1 - r) * e)
        if starts is not None and r == 1.0:
            starts[k] = eps
        return (s - e) * eps + (1 - s) * up - (1 - e) * levels[k]

    return velocity


@pytest.mark.parametrize("steps", [[1, 1, 1], [6, 4, 8]])
def test_exact_velocity_returns_x0_at_full_resolution(schedule, steps):
    g = torch.Generator().manual_seed(3)
    x0 = torch.randn(2, 4, 2, 16, 16, generator=g)
    noise = torch.randn(x0.shape, generator=g)
    out = sample_full_sequence(exact_velocity(x0, schedule, steps), noise, schedule, steps,
                               GeneratorDraws(g))
    # Straight lines are integrated exactly by Euler; what is left is fp32 rounding (|x| ~ 4).
    torch.testing.assert_close(out, x0, atol=1e-5, rtol=1e-5)


def test_each_stage_starts_from_unit_iid_noise_around_the_upsampled_data(schedule):
    # Along an exact run, the noise implied at each stage start (given the table's start sigma and
    # the upsampled previous level as signal) must be N(0, 1) and uncorrelated within 2x2 blocks: a
    # jump with the wrong scale leaves signal in it (std != 1), one without block noise leaves the
    # upsampled copies (correlation 1). 1024 values at stage 0: std within 10%, correlation < 0.1.
    g = torch.Generator().manual_seed(5)
    x0 = torch.randn(2, 4, 2, 32, 32, generator=g)
    starts = {}
    sample_full_sequence(exact_velocity(x0, schedule, [2, 2, 2], starts), torch.randn(x0.shape, generator=g),
                         schedule, 2, GeneratorDraws(g))
    assert sorted(starts) == [0, 1, 2]
    for k, eps in starts.items():
        assert eps.std().item() == pytest.approx(1.0, abs=0.1)
        pairs = torch.stack([eps[..., ::2, ::2].flatten(), eps[..., ::2, 1::2].flatten()])
        assert abs(torch.corrcoef(pairs)[0, 1].item()) < 0.1


def test_guidance_combines_cond_and_uncond_velocities(schedule):
    g = torch.Generator().manual_seed(4)
    x0 = torch.randn(1, 4, 1, 16, 16, generator=g)
    noise = torch.randn(x0.shape, generator=g)
    exact = exact_velocity(x0, schedule, [5, 5, 5])
    # v_u + g (v_c - v_u) with v_c = v + 1, v_u = v + 2 is the exact v for g = 2 only.
    cond, uncond = (lambda x, t: exact(x, t) + 1), (lambda x, t: exact(x, t) + 2)
    out = sample_full_sequence(cond, noise, schedule, 5, GeneratorDraws(g), uncond_velocity=uncond,
                               guidance_scale=2.0)
    torch.testing.assert_close(out, x0, atol=1e-5, rtol=1e-5)
    # Velocities that do not correct themselves: guided sampling = sampling the combined velocity.
    cond = lambda x, t: 0.3 * x + 1  # noqa: E731
    uncond = lambda x, t: -0.2 * x + t[:, None, None, None, None] / 1000  # noqa: E731
    combined = lambda x, t: uncond(x, t) + 2.5 * (cond(x, t) - uncond(x, t))  # noqa: E731
    draws = lambda: GeneratorDraws(torch.Generator().manual_seed(0))  # noqa: E731
    guided = sample_full_sequence(cond, noise, schedule, 5, draws(), uncond_velocity=uncond,
                                  guidance_scale=2.5)
    torch.testing.assert_close(guided, sample_full_sequence(combined, noise, schedule, 5, draws()))
    assert (guided - sample_full_sequence(cond, noise, schedule, 5, draws())).abs().max() > 0.1
    with pytest.raises(ValueError, match="uncond"):
        sample_full_sequence(cond, noise, schedule, 5, GeneratorDraws(g), guidance_scale=3.0)


# ----------------------------------------------------------------------------------------------
# x-prediction (prediction_type: sample): the DiT outputs the stage's end point
# ----------------------------------------------------------------------------------------------

def test_sample_prediction_regresses_the_clean_latent_that_reads_as_the_velocity(schedule):
    """x-prediction's target is x0 at the stage's resolution, which `clean_velocity` reads back as the
    stage's velocity target exactly; the factor weighs its error as the velocity loss of its fine
    detail (at the last stage exactly that loss, (x - out) / r against the target)."""
    g = torch.Generator().manual_seed(6)
    levels = latent_pyramid(torch.randn(4, 4, 3, 16, 16, generator=g), schedule.stages)
    flow = FlowConfig(prediction_type="sample", prediction_sigma_min=0.05)
    columns = noise_temporal_pyramid(levels, schedule, [2, 3, 2], GeneratorDraws(g))
    columns += [noise_sample([x[:1] for x in levels], k, schedule, GeneratorDraws(g)) for k in range(3)]
    for noised in columns:
        x, k = noised.clips[-1], noised.stage
        assert regression_target(noised, None, schedule)[0] is noised.target
        assert torch.equal(regression_target(noised, FlowConfig(), schedule)[1], torch.ones_like(noised.ratios))
        target, factor = regression_target(noised, flow, schedule)
        assert target is noised.clean and target.shape == x.shape
        torch.testing.assert_close(clean_velocity(target, x, noised.ratios, k, schedule), noised.target,
                                   atol=2e-4, rtol=1e-4)
        s, e = line_sigmas(schedule, k)
        sigma = noised.ratios * s + (1 - noised.ratios) * e
        torch.testing.assert_close(factor, (s * (1 - e) / sigma.clamp(min=0.05)) ** 2)
        if k == schedule.stages - 1 and noised.ratios.min() >= 0.05:
            out = torch.randn(x.shape, generator=g)
            r = noised.ratios.reshape(-1, 1, 1, 1, 1)
            velocity_loss = ((x - out) / r - noised.target).square().sum((1, 2, 3, 4))
            torch.testing.assert_close(factor * (out - target).square().sum((1, 2, 3, 4)), velocity_loss,
                                       rtol=1e-4, atol=0)


@pytest.mark.parametrize("steps", [[1, 1, 1], [6, 4, 8]])
def test_sampling_reads_an_exact_clean_latent_as_the_exact_velocity(schedule, steps):
    """A model that outputs x0 at each stage's resolution samples x0, as the exact velocity does;
    read as a velocity instead, the same outputs give another clip."""
    g = torch.Generator().manual_seed(3)
    x0 = torch.randn(2, 4, 2, 16, 16, generator=g)
    noise = torch.randn(x0.shape, generator=g)
    levels = {tuple(level.shape[-2:]): level for level in latent_pyramid(x0, schedule.stages)}
    clean = lambda x, t: levels[tuple(x.shape[-2:])]  # noqa: E731
    draws = lambda: GeneratorDraws(torch.Generator().manual_seed(0))  # noqa: E731
    flow = FlowConfig(prediction_type="sample")
    torch.testing.assert_close(sample_full_sequence(clean, noise, schedule, steps, draws(), flow=flow),
                               x0, atol=1e-5, rtol=1e-5)
    assert (sample_full_sequence(clean, noise, schedule, steps, draws()) - x0).abs().max() > 0.1
    # A velocity run is unchanged by a velocity FlowConfig.
    velocity = exact_velocity(x0, schedule, steps)
    torch.testing.assert_close(sample_full_sequence(velocity, noise, schedule, steps, draws(), flow=FlowConfig()),
                               sample_full_sequence(velocity, noise, schedule, steps, draws()), atol=0, rtol=0)


def test_prediction_type_applies_with_either_stage_timestep_sampling():
    job = SimpleNamespace(flow=FlowConfig(prediction_type="sample"), explicit_keys={"prediction_type"},
                          recipe="pyramid_flow_ar", HISTORY_CLIPS=True)
    PyramidConfig().check(job)  # uniform stage positions: still what the DiT outputs
    job.flow = FlowConfig(flow_snr_type="uniform")
    job.explicit_keys = {"flow_snr_type"}
    with pytest.raises(ConfigError, match="stage_timestep_sampling"):
        PyramidConfig().check(job)


def test_per_sample_draws_give_each_row_its_own_generators_numbers():
    """A batch sampled together draws, row by row, what each sample draws alone (validation prompts
    keep their seeds' noise in any batch)."""
    from pan.diffusion.pyramid_draws import GeneratorDraws, PerSampleDraws

    together = PerSampleDraws([torch.Generator().manual_seed(s) for s in (3, 4)])
    alone = [GeneratorDraws(torch.Generator().manual_seed(s)) for s in (3, 4)]
    for shape in ((2, 3, 4), (2, 5)):
        assert torch.equal(together.randn(shape), torch.cat([d.randn((1, *shape[1:])) for d in alone]))
        assert torch.equal(together.rand(shape), torch.cat([d.rand((1, *shape[1:])) for d in alone]))
    with pytest.raises(ValueError, match="3 rows from 2"):
        together.randn((3, 4))

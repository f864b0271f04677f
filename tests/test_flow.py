"""Flow-matching timesteps: each sampler against its analytic distribution, shifts, noising, rejections."""

import dataclasses
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy import stats

from pan.config.core import ConfigError, check_bounds
from pan.diffusion.flow import (MIX_LOGNORM_PROB, MODE_SCALE_MAX, FlowConfig, add_noise, dynamic_shift,
                                mode_map, output_velocity, sample_timesteps, shift_timesteps,
                                velocity_target)

N = 20_000


def draw(cfg: FlowConfig, tokens=None, seed: int = 0) -> np.ndarray:
    gen = torch.Generator().manual_seed(seed)
    tokens = [1024] * N if tokens is None else tokens
    return sample_timesteps(cfg, len(tokens), tokens, gen).double().numpy()


def lognorm_cdf(x, loc, scale):
    x = np.clip(x, 1e-12, 1 - 1e-12)
    return stats.norm.cdf((np.log(x / (1 - x)) - loc) / scale)


def mode_cdf(x, scale):
    # SD3's f(u) = 1 - u - s (cos^2(pi u / 2) - 1 + u) decreases from f(0) = 1 to f(1) = 0, so
    # P(f(U) <= x) = 1 - f^-1(x); invert by vectorised bisection.
    def f(u):
        return 1 - u - scale * (np.cos(np.pi * u / 2) ** 2 - 1 + u)
    lo, hi = np.zeros_like(x), np.ones_like(x)
    for _ in range(60):
        mid = (lo + hi) / 2
        above = f(mid) > x
        lo, hi = np.where(above, mid, lo), np.where(above, hi, mid)
    return 1.0 - (lo + hi) / 2


def unshift(x, s):
    # inverse of t' = s t / (1 + (s - 1) t)
    return x / (s - (s - 1) * x)


@pytest.mark.parametrize("cfg, cdf", [
    (FlowConfig(flow_snr_type="uniform"), lambda x: x),
    (FlowConfig(flow_snr_type="lognorm"), lambda x: lognorm_cdf(x, 0.0, 1.0)),
    (FlowConfig(flow_snr_type="lognorm", flow_lognorm_loc=0.5, flow_lognorm_scale=0.7),
     lambda x: lognorm_cdf(x, 0.5, 0.7)),
    (FlowConfig(flow_snr_type="mix", flow_lognorm_loc=-0.3, flow_lognorm_scale=1.2),
     lambda x: MIX_LOGNORM_PROB * lognorm_cdf(x, -0.3, 1.2) + (1 - MIX_LOGNORM_PROB) * x),
    (FlowConfig(flow_snr_type="mode", flow_mode_scale=1.29), lambda x: mode_cdf(x, 1.29)),
    (FlowConfig(flow_snr_type="mode", flow_mode_scale=-0.8), lambda x: mode_cdf(x, -0.8)),
    (FlowConfig(flow_snr_type="uniform", train_timestep_shift=3.0), lambda x: unshift(x, 3.0)),
    (FlowConfig(flow_snr_type="lognorm", train_timestep_shift=0.5),
     lambda x: lognorm_cdf(unshift(x, 0.5), 0.0, 1.0)),
])
def test_sampler_matches_its_distribution(cfg, cdf):
    t = draw(cfg)
    assert t.min() >= 0.0 and t.max() <= 1.0
    assert stats.kstest(t, cdf).pvalue > 1e-3


def test_ks_check_detects_a_wrong_distribution():
    t = draw(FlowConfig(flow_snr_type="lognorm"))
    assert stats.kstest(t, lambda x: x).pvalue < 1e-6
    t = draw(FlowConfig(flow_snr_type="mix"))
    assert stats.kstest(t, lambda x: lognorm_cdf(x, 0.0, 1.0)).pvalue < 1e-6


def test_fixed_shift_is_the_formula_applied_to_the_unshifted_draw():
    base = draw(FlowConfig(flow_snr_type="lognorm"), seed=3)
    shifted = draw(FlowConfig(flow_snr_type="lognorm", train_timestep_shift=5.0), seed=3)
    np.testing.assert_allclose(shifted, 5.0 * base / (1 + 4.0 * base), rtol=1e-6, atol=1e-7)
    assert (shifted >= base - 1e-7).all()  # shift > 1 moves towards noise


def test_shift_keeps_endpoints_and_identity_at_one():
    t = torch.tensor([0.0, 0.25, 0.5, 1.0])
    torch.testing.assert_close(shift_timesteps(t, 1.0), t)
    out = shift_timesteps(t, 3.0)
    assert out[0] == 0.0 and out[-1] == 1.0
    assert out[2].item() == pytest.approx(0.75)  # 3 * 0.5 / (1 + 2 * 0.5)


def test_dynamic_shift_formula_anchor_and_monotone():
    cfg = FlowConfig(flow_snr_type="uniform", train_timestep_shift=3.0,
                     train_timestep_shift_mode="dynamic", train_timestep_shift_ref_tokens=4096)
    tokens = torch.tensor([256, 1024, 4096, 16384, 26598])
    shifts = dynamic_shift(cfg, tokens)
    torch.testing.assert_close(shifts, 3.0 * torch.sqrt(tokens / 4096.0))
    assert shifts[2].item() == pytest.approx(3.0)  # equals the base at the anchor
    assert shifts[3].item() == pytest.approx(6.0)  # 4x the tokens -> 2x the shift

    # Same draws (same seed), growing token counts -> every sample's t grows.
    n = 200
    fixed_u = draw(FlowConfig(flow_snr_type="uniform"), tokens=[1] * n, seed=7)
    previous = None
    for count in (256, 1024, 4096, 16384, 65536):
        t = draw(cfg, tokens=[count] * n, seed=7)
        s = 3.0 * math.sqrt(count / 4096)
        np.testing.assert_allclose(t, s * fixed_u / (1 + (s - 1) * fixed_u), rtol=1e-5, atol=1e-6)
        if previous is not None:
            assert (t >= previous).all() and (t > previous).any()
        previous = t

    # At the anchor the dynamic mode equals the fixed mode with the same base shift.
    fixed = draw(FlowConfig(flow_snr_type="uniform", train_timestep_shift=3.0), tokens=[4096] * n, seed=7)
    np.testing.assert_allclose(draw(cfg, tokens=[4096] * n, seed=7), fixed, rtol=1e-6)


def test_dynamic_shift_is_per_sample():
    cfg = FlowConfig(flow_snr_type="uniform", train_timestep_shift_mode="dynamic",
                     train_timestep_shift_ref_tokens=100)
    u = draw(FlowConfig(flow_snr_type="uniform"), tokens=[1, 1, 1], seed=1)
    t = draw(cfg, tokens=[25, 100, 400], seed=1)
    expected = [s * x / (1 + (s - 1) * x) for s, x in zip((0.5, 1.0, 2.0), u)]
    np.testing.assert_allclose(t, expected, rtol=1e-5)


@pytest.mark.parametrize("snr", ["uniform", "lognorm", "mix", "mode"])
def test_generator_state_reproduces_draws(snr):
    cfg = FlowConfig(flow_snr_type=snr)
    gen = torch.Generator().manual_seed(11)
    sample_timesteps(cfg, 5, [10] * 5, gen)
    state = gen.get_state()
    after = sample_timesteps(cfg, 5, [10] * 5, gen)
    gen.set_state(state)
    torch.testing.assert_close(sample_timesteps(cfg, 5, [10] * 5, gen), after)


def test_mix_consumes_the_generator_independently_of_the_coin_flips():
    cfg = FlowConfig(flow_snr_type="mix")
    a, b = torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)
    sample_timesteps(cfg, 64, [1] * 64, a)
    sample_timesteps(cfg, 64, [1] * 64, b)
    # Both generators advanced by the same number of draws: three streams of 64 values.
    ref = torch.Generator().manual_seed(0)
    torch.rand(64, generator=ref), torch.randn(64, generator=ref), torch.rand(64, generator=ref)
    assert torch.equal(a.get_state(), ref.get_state())


def test_tokens_per_sample_length_is_checked():
    with pytest.raises(ValueError, match="tokens_per_sample"):
        sample_timesteps(FlowConfig(), 3, [1, 2], torch.Generator())


def test_add_noise_and_velocity_target():
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(3, 4, 5, generator=g), torch.randn(3, 4, 5, generator=g)
    torch.testing.assert_close(add_noise(x0, noise, torch.zeros(3)), x0)
    torch.testing.assert_close(add_noise(x0, noise, torch.ones(3)), noise)
    t = torch.tensor([0.1, 0.5, 0.9])
    xt = add_noise(x0, noise, t)
    torch.testing.assert_close(xt[1], 0.5 * x0[1] + 0.5 * noise[1])
    # The target is the time derivative of the noising path.
    tt = t.clone().requires_grad_(True)
    grad, = torch.autograd.grad(add_noise(x0, noise, tt).sum(), tt)
    torch.testing.assert_close(grad, velocity_target(x0, noise).sum(dim=(1, 2)))


def test_add_noise_per_token_timesteps_on_packed_tokens():
    x0, noise = torch.randn(7, 16), torch.randn(7, 16)
    t = torch.tensor([0.2] * 3 + [0.8] * 4)  # sample 0 has 3 tokens, sample 1 has 4
    xt = add_noise(x0, noise, t)
    torch.testing.assert_close(xt[:3], 0.8 * x0[:3] + 0.2 * noise[:3])
    torch.testing.assert_close(xt[3:], 0.2 * x0[3:] + 0.8 * noise[3:])


def test_a_clean_sample_prediction_stands_for_the_velocity_target():
    """prediction_type sample: the exact x0 reads as exactly the target velocity wherever t is above
    prediction_sigma_min (below it, as that share of it); the velocity type passes the output on."""
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g)
    t = torch.tensor([0.9, 0.5, 0.2, 0.06, 0.03, 0.01])  # per token row
    x_t = add_noise(x0, noise, t)
    cfg = FlowConfig(prediction_type="sample", prediction_sigma_min=0.05)
    v = output_velocity(cfg, x0, x_t, t)
    torch.testing.assert_close(v[:4], velocity_target(x0, noise)[:4])
    torch.testing.assert_close(v[4:], (t[4:, None] / 0.05) * velocity_target(x0, noise)[4:])
    wrong = output_velocity(cfg, x0 + 0.1, x_t, t)
    assert not torch.allclose(wrong, velocity_target(x0, noise))
    assert output_velocity(FlowConfig(), x0, x_t, t) is x0
    # A scalar t (the sampler's) on a latent
    torch.testing.assert_close(output_velocity(cfg, x0, add_noise(x0, noise, 0.4), 0.4), noise - x0)


# --- config rejections -----------------------------------------------------------------------------

def job_with(cfg: FlowConfig, explicit: set[str], recipe: str = "pan"):
    """A stand-in job of `recipe` (whether it reads prediction_type is its job config's to say)."""
    from pan.recipe import get_recipe

    reads = get_recipe(recipe).job_config.READS_PREDICTION_TYPE
    return SimpleNamespace(flow=cfg, explicit_keys=explicit, recipe=recipe, READS_PREDICTION_TYPE=reads)


def test_sample_prediction_is_refused_by_recipes_that_do_not_read_it():
    cfg = FlowConfig(prediction_type="sample")
    for recipe in ("pan", "pyramid_flow", "pyramid_flow_ar"):
        cfg.check(job_with(cfg, {"prediction_type"}, recipe=recipe))
    with pytest.raises(ConfigError, match="predict the velocity") as err:
        cfg.check(job_with(cfg, {"prediction_type"}, recipe="toy_gan"))
    assert err.value.key == "prediction_type"


@pytest.mark.parametrize("kwargs, key", [
    (dict(flow_snr_type="uniform", flow_lognorm_loc=0.5), "flow_lognorm_loc"),
    (dict(flow_snr_type="mode", flow_lognorm_scale=2.0), "flow_lognorm_scale"),
    (dict(flow_snr_type="lognorm", flow_mode_scale=0.5), "flow_mode_scale"),
    (dict(train_timestep_shift_mode="fixed", train_timestep_shift_ref_tokens=1000),
     "train_timestep_shift_ref_tokens"),
    (dict(prediction_type="velocity", prediction_sigma_min=0.1), "prediction_sigma_min"),
])
def test_keys_without_effect_are_rejected(kwargs, key):
    cfg = FlowConfig(**kwargs)
    with pytest.raises(ConfigError) as err:
        cfg.check(job_with(cfg, set(kwargs)))
    assert err.value.key == key


@pytest.mark.parametrize("kwargs", [
    dict(flow_snr_type="uniform", flow_lognorm_loc=0.0),  # explicit but equal to the default
    dict(flow_snr_type="mix", flow_lognorm_loc=0.5, flow_lognorm_scale=2.0),
    dict(flow_snr_type="mode", flow_mode_scale=0.5),
    dict(train_timestep_shift=2.0, train_timestep_shift_mode="dynamic",
         train_timestep_shift_ref_tokens=1000),
    dict(train_timestep_shift=3.0),
    dict(prediction_type="sample", prediction_sigma_min=0.1),
])
def test_keys_with_effect_are_accepted(kwargs):
    cfg = FlowConfig(**kwargs)
    cfg.check(job_with(cfg, set(kwargs)))


@pytest.mark.parametrize("key, value", [
    ("flow_mode_scale", MODE_SCALE_MAX + 0.01), ("flow_mode_scale", -1.01),
    ("flow_lognorm_scale", 0.0), ("train_timestep_shift", 0.0), ("train_timestep_shift_ref_tokens", 0),
    ("prediction_sigma_min", 0.0), ("prediction_sigma_min", 1.0),
])
def test_bounds_reject_bad_values(key, value):
    meta = {f.name: f.metadata for f in dataclasses.fields(FlowConfig)}[key]
    with pytest.raises(ConfigError):
        check_bounds(key, value, meta)


def test_mode_scale_bound_is_where_the_map_stops_being_monotone():
    u = torch.linspace(0, 1, 10001, dtype=torch.float64)
    assert (mode_map(u, MODE_SCALE_MAX).diff() <= 1e-12).all()
    assert (mode_map(u, MODE_SCALE_MAX + 0.1).diff() > 0).any()

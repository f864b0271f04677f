"""Euler flow sampler on toy problems whose exact velocity is known in closed form."""

import pytest
import torch

from pan.diffusion.sampler import euler_sample, guided_velocity, known_frames, sampling_sigmas


def point_velocity(x0: torch.Tensor):
    """Data = the single point x0. x_t = (1 - t) x0 + t eps gives eps = (x_t - (1 - t) x0) / t, so
    v = eps - x0 = (x_t - x0) / t. Each Euler step scales x - x0 by t_next / t: exact on any grid."""
    return lambda x, sigma: (x - x0) / sigma


def gaussian_velocity(mu: float, std: float):
    """Data ~ N(mu, std^2) per coordinate. With a = 1 - t, b = t, x_t ~ N(a mu, a^2 std^2 + b^2) and
    E[x0 | x_t] = mu + a std^2 (x_t - a mu) / var, E[eps | x_t] = b (x_t - a mu) / var, v = E[eps] - E[x0].
    The flow's transport map sends eps at t = 1 to mu + std * eps at t = 0."""
    def velocity(x, sigma):
        a, b = 1 - sigma, sigma
        var = a * a * std * std + b * b
        centred = x - a * mu
        return b * centred / var - (mu + a * std * std * centred / var)
    return velocity


def test_sigmas_are_shifted_linspace():
    sigmas = sampling_sigmas(4, shift=3.0)
    plain = torch.linspace(1, 0, 5, dtype=torch.float64)
    torch.testing.assert_close(sigmas, 3 * plain / (1 + 2 * plain))
    assert sigmas[0] == 1.0 and sigmas[-1] == 0.0
    torch.testing.assert_close(sampling_sigmas(4), plain)


@pytest.mark.parametrize("steps, shift", [(1, 1.0), (3, 1.0), (10, 9.0)])
def test_lands_on_a_point_mass(steps, shift):
    x0 = torch.tensor([[0.5, -2.0, 3.0]])
    noise = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    out = euler_sample(point_velocity(x0), noise, steps, shift)
    torch.testing.assert_close(out, x0.expand_as(out), atol=1e-5, rtol=0)


def test_gaussian_data_converges_to_the_transport_map():
    mu, std = 1.5, 0.3
    noise = torch.randn(1000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    exact = mu + std * noise
    errors = [(euler_sample(gaussian_velocity(mu, std), noise, steps, shift=3.0) - exact).abs().max().item()
              for steps in (16, 64, 256)]
    assert errors[-1] < 0.02
    assert errors[0] > 3 * errors[1] > 9 * errors[2]  # first order: 4x the steps, ~1/4 the error


def test_guidance_one_is_the_conditional_velocity_without_the_unconditional_pass():
    calls = []

    def uncond(x, sigma):
        calls.append(sigma)
        return torch.zeros_like(x)

    cond = point_velocity(torch.ones(2))
    noise = torch.randn(2)
    torch.testing.assert_close(euler_sample(guided_velocity(cond, uncond, 1.0), noise, 5),
                               euler_sample(cond, noise, 5))
    assert calls == []


def test_guidance_combines_cond_and_uncond():
    cond = point_velocity(torch.tensor([1.0, 1.0]))
    uncond = point_velocity(torch.tensor([-1.0, 0.0]))
    x, g = torch.tensor([0.3, -0.4]), 2.5
    expected = uncond(x, 0.5) + g * (cond(x, 0.5) - uncond(x, 0.5))
    torch.testing.assert_close(guided_velocity(cond, uncond, g)(x, 0.5), expected)
    # For two point masses, guided sampling extrapolates: x0_uncond + g (x0_cond - x0_uncond).
    out = euler_sample(guided_velocity(cond, uncond, g), torch.randn(2), 7)
    torch.testing.assert_close(out, torch.tensor([-1.0 + g * 2.0, g * 1.0]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("with_noise", [False, True])
def test_known_frames_are_reimposed(with_noise):
    g = torch.Generator().manual_seed(0)
    data = torch.randn(4, 5, 3, 3, generator=g)  # [C, T, H, W]
    noise = torch.randn(4, 5, 3, 3, generator=g)
    known = torch.randn(4, 5, 3, 3, generator=g)
    seen = []

    def velocity(x, sigma):
        seen.append((sigma, x[:, :2].clone()))
        return point_velocity(data)(x, sigma)

    hook = known_frames(known, num_frames=2, noise=noise if with_noise else None)
    out = euler_sample(velocity, noise, 6, shift=2.0, condition_fn=hook)
    torch.testing.assert_close(out[:, :2], known[:, :2], atol=0, rtol=0)
    torch.testing.assert_close(out[:, 2:], data[:, 2:], atol=1e-5, rtol=0)
    for sigma, frames in seen:  # the model always saw the known frames at the right noise level
        expected = (1 - sigma) * known[:, :2] + sigma * noise[:, :2] if with_noise else known[:, :2]
        torch.testing.assert_close(frames, expected)


def test_known_frames_batched_image_to_video():
    known = torch.randn(2, 4, 1, 3, 3)  # [B, C, T=1, H, W]: one given image latent per sample
    x = torch.randn(2, 4, 6, 3, 3)
    out = known_frames(known, 1)(x, 0.7)
    torch.testing.assert_close(out[:, :, :1], known)
    torch.testing.assert_close(out[:, :, 1:], x[:, :, 1:])
    with pytest.raises(ValueError, match="num_frames"):
        known_frames(known, 2)


def test_a_model_predicting_the_clean_sample_lands_on_it():
    """`pan sample` and validation under prediction_type sample: a model whose output is always the
    same clean latent x0 (as a perfectly trained one on a single clip) samples exactly x0, with CFG."""
    from pan.diffusion.flow import FlowConfig
    from pan.models.packing import patchify
    from pan.recipes.pan.sample import SampleSettings, sample_latent

    x0 = torch.randn(3, 2, 4, 4, generator=torch.Generator().manual_seed(1))
    patch = (1, 2, 2)

    def oracle(x, timesteps, text, pack):  # [tokens of every caption, C * patch volume]
        return patchify(x0, patch).repeat(len(timesteps), 1)

    settings = SampleSettings(num_frames=2, height=4, width=4, steps=6, guidance_scale=3.0, shift=2.0)
    sample = lambda flow: sample_latent(oracle, schema="none", patch=patch, latent_shape=x0.shape,  # noqa: E731
                                        text=torch.zeros(3, 8), empty_text=torch.zeros(1, 8),
                                        settings=settings, flow=flow)
    torch.testing.assert_close(sample(FlowConfig(prediction_type="sample")), x0, atol=1e-5, rtol=0)
    settings = SampleSettings(num_frames=2, height=4, width=4, steps=6, guidance_scale=3.0, shift=2.0,
                              fresh_noise=1.0)  # re-noised at every step: still x0
    torch.testing.assert_close(sample(FlowConfig(prediction_type="sample")), x0, atol=1e-5, rtol=0)
    assert not torch.allclose(sample(FlowConfig()), x0, atol=0.1)  # read as a velocity: elsewhere


def test_fresh_noise_zero_is_euler_and_one_renoises_the_predicted_sample():
    """renoise_step: f = 0 is the Euler step; f = 1 rebuilds x at the next level from the predicted
    clean sample and fresh noise alone; every f lands on a point mass, whatever noise is drawn."""
    from pan.diffusion.sampler import renoise_step

    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(5, generator=g), torch.randn(5, generator=g)
    torch.testing.assert_close(renoise_step(x, v, 0.6, 0.4, 0.0, None), x - 0.2 * v)
    z = torch.randn(5, generator=torch.Generator().manual_seed(3))
    out = renoise_step(x, v, 0.6, 0.4, 1.0, torch.Generator().manual_seed(3))
    torch.testing.assert_close(out, 0.6 * (x - 0.6 * v) + 0.4 * z)
    torch.testing.assert_close(renoise_step(x, v, 0.3, 0.0, 1.0, None), x - 0.3 * v)  # last step: x0
    x0 = torch.tensor([[0.5, -2.0, 3.0]])
    noise = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    for fresh in (0.5, 1.0):
        out = euler_sample(point_velocity(x0), noise, 6, 2.0, fresh_noise=fresh,
                           generator=torch.Generator().manual_seed(1))
        torch.testing.assert_close(out, x0.expand_as(out), atol=1e-5, rtol=0)


def test_fresh_noise_is_drawn_from_the_generator():
    """Stochastic steps repeat with the generator's seed and differ with another seed."""
    velocity = gaussian_velocity(1.5, 0.3)
    noise = torch.randn(64, generator=torch.Generator().manual_seed(0))
    run = lambda seed: euler_sample(velocity, noise, 8, 2.0, fresh_noise=1.0,  # noqa: E731
                                    generator=torch.Generator().manual_seed(seed))
    torch.testing.assert_close(run(1), run(1))
    assert not torch.allclose(run(1), run(2))
    assert not torch.allclose(run(1), euler_sample(velocity, noise, 8, 2.0))

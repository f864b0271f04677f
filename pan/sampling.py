"""Generate videos with a trained Pan transformer: Euler flow matching with CFG on packed inputs."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from pan.diffusion.sampler import euler_sample, known_frames
from pan.models.packing import PackInfo, patchify, unpatchify


@dataclass
class SampleSettings:
    num_frames: int
    height: int
    width: int
    steps: int = 30
    guidance_scale: float = 2.5
    shift: float = 9.0
    seed: int = 0


def latent_velocity(model, schema: str, patch, texts: list[Tensor], given: int,
                    known: Tensor | None):
    """velocity_fn(x [C, T, H, W], sigma) for each caption in `texts` (one packed forward for all)."""
    def velocity(x: Tensor, sigma: float) -> list[Tensor]:
        from pan.recipes.pan import model_input_latent

        cond = known if known is not None else torch.zeros_like(x)
        tokens = patchify(model_input_latent(x, cond, given, schema), patch)
        grid = (x.shape[1] // patch[0], x.shape[2] // patch[1], x.shape[3] // patch[2])
        pack = PackInfo.build([grid] * len(texts), [t.shape[0] for t in texts], device=x.device)
        out = model(tokens.repeat(len(texts), 1), torch.full((len(texts),), sigma, device=x.device),
                    torch.cat(texts), pack)
        return [unpatchify(o, grid, patch).float() for o in out.chunk(len(texts))]
    return velocity


@torch.no_grad()
def sample_latent(model, *, schema: str, patch, latent_shape, text: Tensor, empty_text: Tensor,
                  settings: SampleSettings, known: Tensor | None = None, given: int = 0,
                  device=None) -> Tensor:
    """One latent [C, T, H, W] for one caption. `known`/`given`: the first `given` latent frames of
    `known` are the condition (image-to-video: 1; continuation: k)."""
    generator = torch.Generator().manual_seed(settings.seed)
    noise = torch.randn(latent_shape, generator=generator).to(device)
    guided = settings.guidance_scale != 1.0
    both = latent_velocity(model, schema, patch, [text, empty_text] if guided else [text], given, known)

    def velocity(x, sigma):
        v = both(x, sigma)
        return v[1] + settings.guidance_scale * (v[0] - v[1]) if guided else v[0]

    # Given frames follow the noise level, as they did in training (x_t covers every frame).
    condition = known_frames(known, given, noise=noise) if given else None
    return euler_sample(velocity, noise, settings.steps, settings.shift, condition_fn=condition)


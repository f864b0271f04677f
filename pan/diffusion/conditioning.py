"""The conditioning layout shared by training and sampling: which latent frames are given, and the
channels the model reads for them (the released Pan model's image-to-video / continuation layout)."""

from __future__ import annotations

import random

import torch
from torch import Tensor


def condition_frames(tasks, latent_frames: int, rng: random.Random) -> int:
    """How many leading latent frames a sample is given as condition (0: plain text-to-video), with
    the probabilities of the `tasks` keys (image_cond_prob, video_cond_prob).

    Images (one latent frame) are never conditioned: nothing would be left to predict.
    """
    r = rng.random()  # drawn for every sample, so the draws stay in step whatever the sample is
    if latent_frames == 1:
        return 0
    if r < tasks.image_cond_prob:
        return 1
    if r < tasks.image_cond_prob + tasks.video_cond_prob and latent_frames > 1:
        return rng.randint(1, latent_frames - 1)
    return 0


def model_input_latent(x_t: Tensor, x0: Tensor, given: int, schema: str) -> Tensor:
    """Channels the model reads for one sample: [x_t ; condition latents ; mask], or x_t alone.

    Condition latents are the clean latents on the first `given` frames and zeros elsewhere; the
    mask channel is 1 on those frames (the released model's image-to-video layout).
    """
    if schema == "none":
        return x_t
    cond = torch.zeros_like(x0)
    mask = torch.zeros_like(x0[:1])
    if given:
        cond[:, :given] = x0[:, :given]
        mask[:, :given] = 1.0
    return torch.cat([x_t, cond, mask], dim=0)

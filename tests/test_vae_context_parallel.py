"""VAE context parallel (pan/parallel/vae_context.py): a clip's frames split in time over a context
group of real gloo processes give the single-process loss and gradients, for the VAE's objective
(pixel + LPIPS + KL + the adaptive GAN term) and the discriminator's hinge loss; and the frame rule.

The comparison runs in float64 (so "equal" means equal up to float64 rounding: rtol 1e-9): every
causal conv computes the same sums on another rank, in another order of frames only.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed

from pan.models.lpips import LPIPS
from pan.models.vae_discriminator import NLayerDiscriminator
from pan.models.vae_loss import VAELossConfig
from pan.parallel.vae_context import (ContextGroup, attach_halo_hooks, context_frames_problem, frame_range,
                                      frame_split, latent_range, latent_split)
from pan.recipes.causal_vae.config import CausalVAEModelConfig
from pan.recipes.causal_vae.data import ClipBatch
from pan.recipes.causal_vae.model import TrainedCausalVAE
from pan.recipes.causal_vae.objective import Objective

TOL = dict(rtol=1e-9, atol=1e-12)   # float64: the same sums in another order
FACTOR = 4                           # the tiny VAE's temporal compression (2 stages)


def tiny_vae() -> TrainedCausalVAE:
    """Two down stages in space and time, every parameter random (N(0,1)/sqrt(fan_in)) so that
    every path contributes, in float64."""
    cfg = CausalVAEModelConfig(block_out_channels=[8, 16, 16], latent_channels=4, norm_num_groups=4,
                               encoder_layers_per_block=1, decoder_layers_per_block=1,
                               spatial_down_stages=2, temporal_down_stages=2).vae_config()
    vae = TrainedCausalVAE(cfg, logvar_init=0.3)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in vae.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(noise / math.sqrt(p[0].numel()) if p.dim() >= 2 else 0.1 * noise)
    return vae.double().train()


def inputs(frames: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = torch.rand(3, frames, 16, 16, generator=gen, dtype=torch.float64) * 2 - 1
    noise = torch.randn(4, (frames - 1) // FACTOR + 1, 4, 4, generator=gen, dtype=torch.float64)
    return x, noise


def parts():
    torch.manual_seed(2)
    lpips = LPIPS().double()
    disc = NLayerDiscriminator(3, 8, 2).double()
    cfg = VAELossConfig(pixelloss_weight=10.0, perceptual_weight=1.0, kl_weight=1e-2, disc_weight=0.5)
    return tiny_vae(), lpips, disc, cfg


def one_step(vae, lpips, disc, cfg, batch: ClipBatch, group) -> tuple[float, float, torch.Tensor, torch.Tensor]:
    """(VAE loss, discriminator loss, VAE gradients, discriminator gradients) of this process."""
    objective = Objective(cfg, lpips, disc, group)
    loss = vae(batch, objective)
    loss.backward()
    d_loss = objective.discriminator_loss(disc, batch)
    d_loss.backward()
    flat = lambda m: torch.cat([p.grad.flatten() for p in m.parameters()])  # noqa: E731
    return float(loss.detach()), float(d_loss.detach()), flat(vae), flat(disc)


def group_step(size: int, frames: int) -> dict:
    """One step on every rank of this process's context group of `size` ranks, summed over the group."""
    group = ContextGroup.build(size)
    vae, lpips, disc, cfg = parts()
    attach_halo_hooks(vae)
    x, noise = inputs(frames)
    a, b = frame_range(frames, FACTOR, group.size, group.rank)
    la, lb = latent_range(frames, FACTOR, group.size, group.rank)
    batch = ClipBatch([x[:, a:b]], [noise[:, la:lb]], [frames], ["clip"], float(group.first), b - a)
    loss, d_loss, grads, d_grads = one_step(vae, lpips, disc, cfg, batch, group)
    summed = torch.tensor([loss, d_loss], dtype=torch.float64)
    for t in (summed, grads, d_grads):
        dist.all_reduce(t, group=group.group)
    return {"loss": summed, "grads": grads, "disc_grads": d_grads, "frames": b - a}


def context_runs(cases: list[tuple[int, int]]) -> list[dict]:
    """Each (group size, frames) case on the same 4 processes: groups of 2 (two groups train the same
    clip; the adaptive weight sums both, which leaves it unchanged), then one group of 4."""
    return [group_step(size, frames) for size, frames in cases]


CASES = [(2, 13), (4, 17)]   # 13 frames over 2 ranks: an uneven split [9, 4]


def test_context_groups_of_2_and_4_give_the_single_process_loss_and_gradients():
    results = run_distributed(context_runs, world_size=4, args=(CASES,))
    for case, (size, frames) in enumerate(CASES):
        vae, lpips, disc, cfg = parts()
        x, noise = inputs(frames)
        loss, d_loss, grads, d_grads = one_step(vae, lpips, disc, cfg,
                                                ClipBatch([x], [noise], [frames], ["clip"], 1.0, frames), None)
        ranks = [r[case] for r in results]
        assert [r["frames"] for r in ranks] == frame_split(frames, FACTOR, size) * (4 // size)
        for r in ranks:  # every rank ends with its group's sums
            torch.testing.assert_close(r["loss"], torch.tensor([loss, d_loss], dtype=torch.float64), **TOL)
            torch.testing.assert_close(r["grads"], grads, **TOL)
            torch.testing.assert_close(r["disc_grads"], d_grads, **TOL)
        assert grads.abs().max() > 0 and d_grads.abs().max() > 0


def test_the_frame_rule_splits_latent_frames_and_refuses_too_few():
    # T = 1 + 8k frames, k >= context size: rank 0 holds the first frame and a share of the rest.
    assert frame_split(33, 8, 2) == [17, 16]            # the original's stage 2: balanced
    assert frame_split(25, 8, 2) == [17, 8]             # k = 3 over 2 ranks: uneven, still exact
    assert frame_split(17, 8, 2) == [9, 8] and frame_split(33, 8, 4) == [9, 8, 8, 8]
    assert latent_split(5, 4) == [2, 1, 1, 1] and latent_range(33, 8, 4, 2) == (3, 4)
    assert frame_range(33, 8, 2, 1) == (17, 33)
    assert "1 + 8k frames" in context_frames_problem(35, 8, 2)   # the original docs' 17 x 2 + 1
    assert "at least 17 frames" in context_frames_problem(9, 8, 2)
    with pytest.raises(ValueError):
        frame_split(9, 8, 2)

"""The toy GAN's `pan check` rows, its memory probe and its launch workflow's rule."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pan.config.core import require
from pan.estimate import Phase, Probe
from pan.preflight import (Row, check_cpu, check_layout, check_memory, check_output_dir,
                           check_resume, check_step_time)
from pan_toy_gan.task import DIM, NOISE


def enough_samples(job, dp: int) -> int:
    """Samples the data set needs: one micro-batch for each data-parallel rank."""
    return job.toy.toy_batch * dp


def check_toy_data(ctx) -> list[Row]:
    """The data set holds at least one batch per data-parallel rank (`launch_rule`: one wording for
    the row, train.py's start and `pan launch-command`)."""
    launch_rule(ctx.job, ctx.dims)
    return [Row("toy data", "pass", f"{ctx.job.toy.toy_samples} samples")]


def launch_rule(job, dims) -> None:
    """`pan launch-command --workflow toy-gan`'s own rule (run before the rows): the toy data one."""
    need = enough_samples(job, dims.dp)
    require(job.toy.toy_samples >= need, "toy_samples", f"is {job.toy.toy_samples}, fewer than "
            f"{job.toy.toy_batch} samples for each of {dims.dp} data-parallel ranks: set toy_samples >= {need}.")


def toy_probe(ctx) -> Probe:
    """One micro-batch of toy_batch samples: the generator's phase, then the discriminator's."""
    batch, width = ctx.job.toy.toy_batch, ctx.job.toy.toy_width
    with_disc = ctx.job.toy.toy_discriminator

    def gen_loss(models):
        fake = models["generator"](torch.empty(batch, NOISE))
        if not with_disc:
            return (fake - torch.empty(batch, DIM)).square().sum()
        return F.softplus(-models["discriminator"](fake)).sum()

    def disc_loss(models):
        real, fake = torch.empty(batch, DIM), torch.empty(batch, DIM)
        disc = models["discriminator"]
        return (F.softplus(-disc(real)) + F.softplus(disc(fake))).sum()

    # A linear layer of n_in x n_out costs 2 n_in n_out FLOPs per sample forward, twice that backward.
    def mlp_flops(n_in: int, n_out: int) -> int:
        return 6 * batch * (n_in * width + width * n_out)

    phases = [Phase("generator", gen_loss)]
    flops = mlp_flops(NOISE, DIM)
    if with_disc:
        phases.append(Phase("discriminator", disc_loss))
        flops += 3 * mlp_flops(DIM, 1)  # through it for the generator, then on real and fake
    return Probe(phases, tokens=batch, samples=batch, flops=flops,
                 describe=f"{batch} samples of {DIM} values per data-parallel rank")


# The table's rows, in order: the generic run checks around the toy's own.
CHECKS = [check_layout, check_toy_data, check_cpu, check_output_dir, check_resume, check_memory,
          check_step_time]

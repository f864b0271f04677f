"""The toy GAN's models, data and train step: a generator and a discriminator trained by pan's
trainer through the task contract alone (pan/task.py)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pan.task import PartSpec, StepContext, Task, global_sums
from pan_toy_gan.config import ToyConfig, ToyGanJobConfig

DIM = 8     # width of a "real" sample and of the generator's output
NOISE = 4   # width of the generator's input


class MLP(nn.Module):
    """Two linears with a GELU: no blocks, so FSDP shards it as one unit."""

    def __init__(self, n_in: int, width: int, n_out: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(n_in, width), nn.Linear(width, n_out)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))

    def init_weights(self) -> None:
        for fc in (self.fc1, self.fc2):
            nn.init.normal_(fc.weight, std=fc.in_features ** -0.5)
            nn.init.zeros_(fc.bias)

    def fsdp_blocks(self) -> list[nn.Module]:
        return []

    def hidden_matrices(self) -> dict[str, tuple[int, ...]]:
        return {"fc1.weight": (self.fc1.out_features,)}


@dataclass
class Batch:
    real: Tensor        # [b, DIM]
    noise: Tensor       # [b, NOISE]
    sample_ids: list[str]


def real_sample(i: int) -> Tensor:
    """Sample i of the data set: a ramp with a sample-specific scale and offset."""
    g = torch.Generator().manual_seed(i)
    scale, offset = torch.rand(2, generator=g)
    return torch.linspace(-1, 1, DIM) * (0.5 + scale) + offset


class ToyLoader:
    """Rank r of n reads samples r, r + n, r + 2n, ... of a seeded permutation per pass; the cursor
    is the number of samples it has handed out."""

    def __init__(self, cfg: ToyConfig, rank: int, size: int, seed: int):
        self.cfg, self.rank, self.size, self.seed = cfg, rank, size, seed
        self.position = 0

    def __next__(self) -> list[int]:
        ids = []
        for _ in range(self.cfg.toy_batch):
            n = self.cfg.toy_samples
            epoch, index = divmod(self.position * self.size + self.rank, n)
            order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed * 1000 + epoch))
            ids.append(int(order[index]))
            self.position += 1
        return ids

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]

    def close(self) -> None:
        pass


class ToyGanTask(Task):
    def __init__(self, job: ToyGanJobConfig, world, dims, cp=None):
        super().__init__(job, world, dims, cp)
        self.dp_rank = dims.dp_rank_of(world.rank)
        self.reads_data = True
        self.generator = torch.Generator().manual_seed(job.trainer.seed + 17 * self.dp_rank)

    def part_specs(self) -> list[PartSpec]:
        width = self.job.toy.toy_width

        def build(n_in: int, n_out: int):
            def meta_model() -> nn.Module:
                with torch.device("meta"):
                    return MLP(n_in, width, n_out)
            return meta_model

        specs = [PartSpec("generator", build(NOISE, DIM), self.job.optim)]
        if self.job.toy.toy_discriminator:
            specs.append(PartSpec("discriminator", build(DIM, 1), self.job.disc_optim))
        return specs

    def build_loader(self, dims):
        return ToyLoader(self.job.toy, self.dp_rank, dims.dp, self.job.trainer.seed)

    def next_batch(self, loader) -> tuple[Batch, float]:
        ids = next(loader)
        real = torch.stack([real_sample(i) for i in ids])
        noise = torch.randn(len(ids), NOISE, generator=self.generator)
        return Batch(real, noise, [str(i) for i in ids]), 0.0

    def train_step(self, ctx: StepContext, micro_batches: list[Batch]) -> dict[str, float]:
        """Generator first (non-saturating loss through the discriminator, or a plain regression
        onto the real samples without one), then the discriminator on detached fakes."""
        if not (self.job.toy.toy_sleep_first_run_only and os.environ.get("SLURM_RESTART_COUNT", "0") != "0"):
            time.sleep(self.job.toy.toy_step_sleep)
        gen = ctx.parts["generator"]
        disc = ctx.parts.get("discriminator")
        count = lambda mb: float(len(mb.sample_ids))  # noqa: E731

        def gen_loss(model, mb: Batch) -> Tensor:
            fake = model(mb.noise)
            if disc is None:
                return (fake - mb.real).square().mean(dim=1).sum()
            return F.softplus(-disc.model(fake)).sum()

        loss = ctx.backward_mean(gen, micro_batches, gen_loss, count)
        out = {"loss": loss, "grad_norm": ctx.update(gen, loss)}
        if disc is None:
            return out
        disc.optimizer.zero_grad(set_to_none=True)  # the generator's backward went through it
        logits = []

        def disc_loss(model, mb: Batch) -> Tensor:
            with torch.no_grad():
                fake = gen.model(mb.noise)
            real_logits, fake_logits = model(mb.real), model(fake)
            logits.append((real_logits.detach().sum().item(), fake_logits.detach().sum().item()))
            return (F.softplus(-real_logits) + F.softplus(fake_logits)).sum()

        d_loss = ctx.backward_mean(disc, micro_batches, disc_loss, count)
        out["grad_norm/discriminator"] = ctx.update(disc, d_loss)
        real_sum, fake_sum, n = global_sums([sum(r for r, _ in logits), sum(f for _, f in logits),
                                             sum(count(mb) for mb in micro_batches)])
        out.update({"loss/disc": d_loss, "disc/logits_real": real_sum / n, "disc/logits_fake": fake_sum / n})
        return out

    def batch_stats(self, micro_batches: list[Batch]) -> dict[str, float]:
        return {"samples": sum(len(mb.sample_ids) for mb in micro_batches), "tokens": 0, "flops": 0,
                "bad_samples": 0, "packing": 1.0}

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])

"""The packed-DiT micro-batch path the Pan and Pyramid-Flow recipes share (`PackedTask`).

A packed task trains one DiT on packed micro-batches of video tokens (`PackedInputs`: the tokens,
their targets and loss weights, and the `PackInfo` that says whose tokens are where). Only cp rank 0
of each context-parallel group reads data and runs the frozen encoders; it prepares the micro-batch
(`prepare`), which is broadcast to the group, and each rank keeps its share (`share`). By default
each micro-batch of a step is a data shard of its own (ShardedLoader, `build_step_shards`) whose
draws (noise, timesteps, caption dropout) are seeded afresh from what names it (`seed_draws_for`),
so a resumed run, on any layout with the same number of shards, draws exactly what the
uninterrupted run would have drawn.

This module sits below the recipe packages (pyproject.toml's importlinter contracts): it imports
none of them.
"""

from __future__ import annotations

import abc
import dataclasses
import random
import time
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from pan.data.build import build_step_shards
from pan.data.fit import SampleFit
from pan.data.plan import seed_draws
from pan.encoders.vae import vae_geometry
from pan.models.packing import PackInfo
from pan.task import Task


def to_device(t: Tensor, device: torch.device | str) -> Tensor:
    """`t` on `device`. A host tensor bound for a GPU is staged in pinned memory and copied without
    blocking the host, which goes on preparing the batch while the copy runs (the caching host
    allocator keeps the pinned buffer until the copy is done)."""
    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@dataclass
class PackedInputs:
    """One packed micro-batch as the model and the loss see it (this process's rows of it). A recipe
    subclasses it to say what the fields hold and to add its own (listed in CP_FIELDS)."""
    # How context parallel splits each tensor (pan.parallel.context_parallel.ContextParallel).
    CP_FIELDS: ClassVar[dict[str, str]] = {"x": "video", "target": "video", "weight": "video",
                                           "text": "text", "timesteps": "whole"}
    x: Tensor           # [Nv, in] the model's input tokens
    target: Tensor      # [Nv, out] the velocity target as tokens
    weight: Tensor      # [Nv] each token's weight in the loss
    timesteps: Tensor   # [B] one per sample
    text: Tensor        # [Nt, D] caption rows
    pack: PackInfo
    sample_ids: list[str]
    samples: int        # samples in the micro-batch (0 on cp ranks > 0, which only hold a share)
    tokens: int         # video tokens in the micro-batch (idem)
    packing: float      # real tokens / token budget of the packed batch
    bad_samples: int    # samples this rank's data loader has skipped so far

    def to(self, device) -> PackedInputs:
        moved = {k: to_device(getattr(self, k), device) for k in self.CP_FIELDS}
        return dataclasses.replace(self, pack=self.pack.to(device), **moved)


class PackedTask(Task):
    """What the packed-DiT recipes share on the loop: who reads data, the micro-batch path (read,
    prepare on cp rank 0, share over the cp group, move to the device), one data shard per
    micro-batch with its draws seeded from its name, the token budget of a clip, the throughput
    numbers, the validation interval and the checkpointed skip count.

    A subclass sets `self.model` (its DiT: `forward_flops(pack)`) and defines `latent_tokens_of`,
    `prepare` (or its own `next_batch`) and the loss."""
    elastic_data = True           # PackedLoader.load_elastic_state: resumable on another data-parallel size
    sharded_micro_batches = True  # ShardedLoader: exact on any dp x accumulation of the same product

    def __init__(self, job, world, dims, cp=None):
        super().__init__(job, world, dims, cp)
        self.reads_data = cp is None or cp.rank == 0
        self.dp_rank = dims.dp_rank_of(world.rank)
        self.geometry = vae_geometry(job.vae)
        # The micro-batch's draws: seeded again for each micro-batch by `seed_draws_for`.
        self.generator = torch.Generator().manual_seed(job.trainer.seed)
        self.rng = random.Random(job.trainer.seed)
        self.bad_samples = 0  # skipped by this rank's data loader since the run started

    # -- data ---------------------------------------------------------------------------------------
    @abc.abstractmethod
    def latent_tokens_of(self, t: int, h: int, w: int) -> int:
        """Budgeted tokens of a sample whose full-resolution latent is (t, h, w)."""

    def sample_fit(self) -> SampleFit:
        """What the DiT takes, checked on every sample as it is read (pan/data/fit.py): a row that
        does not fit is skipped as a bad sample instead of stopping the step. Here, clips the VAE
        can encode; a recipe adds its DiT's latent channels, units and text widths."""
        return SampleFit(temporal_factor=self.geometry.temporal_factor, spatial_factor=self.geometry.spatial_factor,
                         model="the DiT")

    def tokens_of(self, num_frames: int, height: int, width: int) -> int:
        """Model tokens of a clip of this pixel shape (what the data packer budgets)."""
        _, t, h, w = self.geometry.latent_shape(num_frames, height, width)
        return self.latent_tokens_of(t, h, w)

    def build_loader(self, dims):
        return build_step_shards(self, dims)

    def seed_draws_for(self, batch) -> None:
        """Seed the draws of one training micro-batch from what names it: (seed, shard, batch number)."""
        seed_draws(self.generator, self.rng, self.job.trainer.seed, batch.shard, batch.number)

    # -- one micro-batch ----------------------------------------------------------------------------
    def prepare(self, batch) -> PackedInputs:
        """Raw packed batch -> the whole micro-batch (on cp rank 0, after `seed_draws_for`)."""
        raise NotImplementedError(f"{type(self).__name__} uses the default next_batch: define prepare")

    def next_batch(self, loader) -> tuple[PackedInputs, float]:
        """The next micro-batch for this process (its cp share when context parallel is on), and the
        seconds spent waiting for the data loader (encoding and noising are not waiting)."""
        t0 = time.perf_counter()
        raw = next(loader) if self.reads_data else None
        waited = time.perf_counter() - t0
        inputs = None
        if self.reads_data:
            self.seed_draws_for(raw)
            inputs = self.prepare(raw)
        return self.share(inputs), waited

    def share(self, inputs: PackedInputs | None) -> PackedInputs:
        """cp rank 0's whole micro-batch (None on the other ranks) -> this process's share of it, on
        its device."""
        if self.cp is not None:
            inputs = self.cp.distribute(inputs)
        return inputs.to(self.world.device)

    def flops(self, batches: list[PackedInputs]) -> float:
        """Training FLOPs this process executes for these micro-batches (3x forward)."""
        return sum(3 * self.forward_flops(b.pack) for b in batches) / self.dims.cp

    def forward_flops(self, pack: PackInfo) -> int:
        """FLOPs of the forward `loss_sum` runs on this whole pack."""
        return self.model.forward_flops(pack)

    def batch_stats(self, batches: list[PackedInputs]) -> dict:
        return {"samples": sum(b.samples for b in batches), "tokens": sum(b.tokens for b in batches),
                "flops": self.flops(batches), "bad_samples": batches[-1].bad_samples,
                "packing": sum(b.packing for b in batches) / len(batches)}

    # -- validation ---------------------------------------------------------------------------------
    def wants_validation(self, step: int) -> bool:
        interval = self.job.validation.validation_interval
        return bool(interval) and step % interval == 0

    # -- what a checkpoint keeps of the task --------------------------------------------------------
    def state_dict(self) -> dict:
        return {"bad_samples": self.bad_samples}  # the draws are seeded per micro-batch

    def load_state_dict(self, state: dict) -> None:
        self.bad_samples = state["bad_samples"]

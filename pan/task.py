"""The recipe contract: what a recipe gives the trainer, the checkpointer, preflight, `pan sample`.

A recipe is registered as a `Recipe` (pan/recipe.py): its job config class and its `Task`, built
once per process as `task(job, world, dims, cp)`, and the models its parts train follow
`TrainableModel` below. The trainer only ever talks to the
task through the members below; nothing else about a recipe is guessed from attribute names.

    trainer                                   task
    -------                                   ----
    build the parts                           part_specs(): [PartSpec(name, build, optim)]
    parallelise each part                     (the model's own fsdp_blocks(); see pan/parallel/fsdp.py)
    load frozen encoders                      load_encoders()
    build the data loader (reading ranks)     reads_data, dp_rank, build_loader(dims)
    per step: k micro-batches                 next_batch(loader) -> (batch, seconds waited)
    per step: forward, backward, update       train_step(ctx, micro_batches) -> {metric: float}
    per step: throughput numbers              batch_stats(micro_batches) -> {samples, tokens, ...}
    validation                                wants_validation(step), validate(parts, step, dir)
    checkpoint: the task's own state          state_dict() / load_state_dict() (RNG streams...)

The default `train_step` is one part trained on the sum of the recipe's loss over the global count
of loss elements (`loss_sum` / `loss_count`), so the update is the same for any dp x cp x
accumulation layout. A recipe with several parts (a VAE and its discriminator) replaces it, using
the `StepContext` tools so that gradient sync, autocast, clipping, the non-finite guard, the EMA and
the LR schedules work exactly as for the default step.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from pan.checkpoint.warm_start import WarmStartConfig
from pan.logging import get_logger
from pan.lora.adapters import untrained_adapters_warning
from pan.optim.config import OptimConfig
from pan.parallel.fsdp import clip_grad_norm, set_gradient_sync
from pan.parallel.names import unwrapped_name
from pan.parallel.precision import compute_precision


@runtime_checkable
class TrainableModel(Protocol):
    """What the trainer, pan/parallel/ and the estimate ask of a part's model. Models are
    single-device code; parallelism (FSDP2, activation checkpointing, Ulysses, compile) is applied
    from outside through these members.

    Required:
      init_weights()          real values for every parameter; called after sharding on the
                              materialised (to_empty) model
      fsdp_blocks()           the submodules sharded, checkpointed and compiled one by one (may be [])
    Optional (looked up by name, skipped when absent):
      checkpointed_blocks()   the blocks activation checkpointing wraps (default: fsdp_blocks())
      hidden_matrices()       name -> shape of the matrices Muon updates (the rest: AdamW)
      inner_attention         submodules named so are wrapped by Ulysses context parallel
      forward_flops(pack)     exact FLOPs of one forward (a training step counts 3x) for MFU
    """

    def init_weights(self) -> None: ...

    def fsdp_blocks(self) -> list[nn.Module]: ...


@dataclass(frozen=True)
class PartSpec:
    """One trainable part as a recipe declares it (built by the trainer, in declaration order)."""
    name: str                          # "transformer", "vae", "discriminator": names checkpoint folders
    build: Callable[[], TrainableModel]  # the model on the meta device (or real weights to start from)
    optim: OptimConfig                 # its optimizer, LR schedule, clipping and EMA keys
    warm_start: bool = False           # whether the run's warm-start keys load into this part
    # The full state dict the part starts from when the run starts fresh (a released checkpoint),
    # loaded strictly after sharding; None: the model's own init_weights().
    pretrained: Callable[[], dict[str, Tensor]] | None = None
    pretrained_from: str | None = None  # where `pretrained` reads from (a LoRA checkpoint records it)
    lora: object | None = None          # pan.lora.adapters.LoraConfig: adapters on this part's frozen base


@dataclass
class Part:
    """A built part: its parallelised model, optimizer, LR schedule and EMA (None without)."""
    name: str
    model: nn.Module
    optimizer: object                  # pan.optim.builder.OptimizerSet
    scheduler: object                  # pan.optim.schedule.LRSchedulers
    ema: object | None = None          # pan.optim.ema.EMA
    optim: OptimConfig | None = None   # its keys (clipping); None: no clipping
    lora: dict | None = None           # a LoRA part's reference (pan.lora.adapters.add_adapters): only its
                                       # adapters train and are saved; None: every weight
    gradients_seen: bool = False       # whether a step of this process has updated it (`StepContext.update`)


def global_sums(values: list[float], group=None) -> list[float]:
    """Sum host numbers over all ranks (every rank calls this), in one collective."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return [float(v) for v in values]
    t = torch.tensor([float(v) for v in values], dtype=torch.float64)
    if dist.get_backend(group) == "nccl":
        t = t.cuda()
    dist.all_reduce(t, group=group)
    return t.tolist()


def global_sum(value: float, group=None) -> float:
    return global_sums([value], group)[0]


def autocast_context(dtype: str, device: torch.device):
    """The train step's precision on `device` (pan/parallel/precision.py): bf16 autocast without
    its weight cache under `dtype: bf16`, nothing under fp32."""
    return compute_precision(dtype, device.type)


class StepContext:
    """What a train step works with: the built parts by name, the step number, and the tools that
    make every recipe's update exact for any layout. One context per optimizer step."""

    def __init__(self, parts: dict[str, Part], step: int, dtype: str, device: torch.device):
        self.parts, self.step, self.dtype, self.device = parts, step, dtype, device
        self.finite = True   # False once any part's update was skipped for a non-finite value

    def autocast(self):
        return autocast_context(self.dtype, self.device)

    def backward_mean(self, part: Part, micro_batches: list,
                      loss_sum: Callable[[nn.Module, object], Tensor],
                      loss_count: Callable[[object], float]) -> float:
        """Backward of sum(loss_sum) / global count over the micro-batches (gradients reduced with
        the last one); returns the global mean loss. The count is summed over all ranks first, so
        every dp x cp x accumulation layout gives the gradient of the one global batch."""
        count = global_sum(sum(loss_count(mb) for mb in micro_batches))
        total = 0.0
        for i, mb in enumerate(micro_batches):
            set_gradient_sync(part.model, i == len(micro_batches) - 1)
            with self.autocast():
                loss = loss_sum(part.model, mb)
            (loss / count).backward()
            total += loss.detach().float().item()
        return global_sum(total) / count

    def update(self, part: Part, loss: float) -> float:
        """Clip, then step the part's optimizer (and EMA) unless the loss or the gradient norm is
        not finite; always zero the gradients and advance the LR schedule. Returns the gradient
        norm before clipping (the same on every rank)."""
        grad_norm = clip_grad_norm(part.model, part.optim.max_grad_norm if part.optim else None)
        if not part.gradients_seen:
            part.gradients_seen = True
            self.first_gradients(part, loss, grad_norm)
        if math.isfinite(loss) and math.isfinite(grad_norm):
            part.optimizer.step()
            if part.ema is not None:
                part.ema.update()
        else:
            self.finite = False
        part.optimizer.zero_grad(set_to_none=True)
        part.scheduler.step()
        return grad_norm

    def first_gradients(self, part: Part, loss: float, grad_norm: float) -> None:
        """The first step this process runs: a LoRA part whose adapters all got a gradient of 0 (the
        norm is global: every rank takes this branch alike) would train nothing, silently; say why."""
        if part.lora is not None and grad_norm == 0.0 and math.isfinite(loss):
            get_logger().warning("%s: %s", part.name, untrained_adapters_warning(
                part.model, self.step + 1, global_sums, unwrapped_name))


class Task(abc.ABC):
    """A recipe's side of the loop. Subclasses call `Task.__init__` and set `reads_data` and
    `dp_rank` in their own `__init__`."""

    reads_data: bool = True   # whether this process runs a data loader (cp rank 0 of its group)
    dp_rank: int = 0          # which share of the data this process reads
    # Whether the loader continues on another data-parallel size from all old ranks' cursors
    # (`load_elastic_state`); otherwise such a resume is refused (or restarts the data streams).
    elastic_data: bool = False
    # Whether each micro-batch of a step comes from a data shard of its own (ShardedLoader: shard
    # dp_rank x accumulation + m): a step's data then depends on dp x accumulation only, and the
    # checkpoint keeps one cursor per shard.
    sharded_micro_batches: bool = False

    def __init__(self, job, world, dims, cp=None):
        """Keep what the other members need; build nothing heavy (no model, no encoder). A subclass
        keeps more (its own `__init__`, calling this first)."""
        self.job = job      # the recipe's job config
        self.world = world  # pan.parallel.world.World: this process's rank and device
        self.dims = dims    # pan.parallel.dims.ParallelDims: the run's layout
        self.cp = cp        # pan.parallel.context_parallel.ContextParallel, or None (cp_size 1)

    # -- what is trained ---------------------------------------------------------------------------
    @abc.abstractmethod
    def part_specs(self) -> list[PartSpec]:
        """The trainable parts, in order; the first is the main part (its loss and grad norm are the
        run's `loss` and `grad_norm`, `pan export` reads it by default). Each model must offer
        `init_weights()` and `fsdp_blocks()` (the submodules sharded, checkpointed and compiled one
        by one; may be empty), and optionally `hidden_matrices()` (Muon) and `inner_attention`
        submodules (Ulysses context parallel wraps them)."""

    def data_shards(self) -> int:
        """How many data cursors a checkpoint of this run keeps (see ShardedLoader): one per
        data-parallel rank, or per micro-batch of a step with `sharded_micro_batches`. A resume
        with the same number continues every cursor as it is, on any layout."""
        accumulation = self.job.trainer.gradient_accumulation_steps if self.sharded_micro_batches else 1
        return self.dims.dp * accumulation

    def warm_start_source(self) -> str | None:
        """Where a fresh run's `warm_start` parts start from (see pan/checkpoint/warm_start.py): a
        state dict or another run's checkpoint; None: their init. Default: the source its job
        declares with a `WarmStartConfig` component (`pretrained_transformer_path`), None without
        one; a recipe that names its source otherwise overrides this (causal_vae:
        `warm_start_checkpoint`)."""
        sources = [getattr(self.job, f.name).source for f in dataclasses.fields(self.job)
                   if isinstance(getattr(self.job, f.name), WarmStartConfig)]
        return sources[0] if sources else None

    def load_encoders(self) -> None:
        """Frozen encoders (text encoder, VAE), on the processes that need them."""

    # -- data ---------------------------------------------------------------------------------------
    @abc.abstractmethod
    def build_loader(self, dims):
        """The data loader of this process (only called where `reads_data`); it must offer
        `state_dict()` / `load_state_dict()` (the exact cursor) and `close()`."""

    @abc.abstractmethod
    def next_batch(self, loader) -> tuple[object, float]:
        """The next micro-batch as the train step consumes it (this process's share under context
        parallel), and the seconds spent waiting for the loader. It must carry `sample_ids`."""

    # -- one step -----------------------------------------------------------------------------------
    def train_step(self, ctx: StepContext, micro_batches: list) -> dict[str, float]:
        """Forward, backward and update of every part; returns scalar metrics (at least `loss` and
        `grad_norm`; any others, e.g. `loss/kl`, are logged as they are)."""
        part = ctx.parts[self.part_specs()[0].name]
        loss = ctx.backward_mean(part, micro_batches, self.loss_sum, self.loss_count)
        return {"loss": loss, "grad_norm": ctx.update(part, loss)}

    def loss_sum(self, model: nn.Module, batch) -> Tensor:
        """Sum of the loss over this process's loss elements (for the default train step)."""
        raise NotImplementedError(f"{type(self).__name__} uses the default train_step: define loss_sum")

    def loss_count(self, batch) -> float:
        """Number of loss elements of this process's rows (for the default train step)."""
        raise NotImplementedError(f"{type(self).__name__} uses the default train_step: define loss_count")

    @abc.abstractmethod
    def batch_stats(self, micro_batches: list) -> dict[str, float]:
        """This process's share of `samples`, `tokens`, `flops` (executed here), `bad_samples`
        (skipped so far) and `packing` (mean fill of the token budget), summed over ranks by the
        trainer for the log."""

    # -- validation ---------------------------------------------------------------------------------
    def wants_validation(self, step: int) -> bool:
        return False

    def validate(self, parts: dict[str, Part], step: int, output_dir) -> dict[str, float]:
        """Held-out metrics and samples (every rank takes part; the main rank writes files). Called
        with the EMA weights swapped in where a part keeps an EMA."""
        return {}

    # -- checkpoint ---------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The task's own state a resume must restore (its RNG streams, counters)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

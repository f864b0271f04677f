"""The one training loop: build, step, log, validate, save."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

import torch
import torch.distributed as dist

from pan.config.core import knob, require
from pan.logging import get_logger
from pan.parallel.fsdp import clip_grad_norm, set_gradient_sync


@dataclass(kw_only=True)
class TrainerConfig:
    SECTION: ClassVar[str] = "training"

    max_steps: int = knob(1000, "optimizer steps to train for", ge=1)
    gradient_accumulation_steps: int = knob(
        1, "packed micro-batches per optimizer step; k micro-batches of b give the update of one "
           "batch of k*b", ge=1)
    seed: int = knob(0, "seed of model init, data order, timesteps and noise", ge=0)
    dtype: Literal["fp32", "bf16"] = knob(
        "bf16", "compute dtype: bf16 autocast with fp32 master weights, or fp32 throughout (use fp32 "
                "on CPU: bf16 matmuls there are ~90x slower)")
    legacy_eager_mode: bool = knob(
        True, "the validated eager execution (no CUDA graphs, autocast without its weight cache, "
              "FSDP resharding after forward, NCCL async error handling); must stay true")
    compile_transformer: bool = knob(False, "torch.compile each transformer block")
    max_nonfinite_steps: int = knob(
        5, "stop the run after this many consecutive steps with a NaN/inf loss or gradient (each "
           "such step is skipped)", ge=1)

    def check(self, job) -> None:
        require(self.legacy_eager_mode, "legacy_eager_mode",
                "false is not supported: the validated eager mode is the only execution mode (there "
                "is no CUDA-graph mode). Remove the key or set legacy_eager_mode: true.")


# ------------------------------------------------------------------------------------------------
# The loop
# ------------------------------------------------------------------------------------------------


@dataclass
class TrainState:
    """What the loop itself must carry across a resume (besides model, optimizer and data cursors)."""
    step: int = 0
    nonfinite_streak: int = 0
    skipped_steps: int = 0
    samples_seen: int = 0
    tokens_seen: int = 0

    def state_dict(self) -> dict:
        return dict(vars(self))

    def load_state_dict(self, d: dict) -> None:
        for k, v in d.items():
            setattr(self, k, v)


class NonFiniteLossError(RuntimeError):
    pass


class StoppedBySignal(RuntimeError):
    """A signal asked the run to stop; the checkpoint of the step it stopped at is written."""

    def __init__(self, signum: int, step: int):
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}: checkpoint-{step} "
                         "is saved and the next launch resumes from it")
        self.exit_code = 128 + signum  # what the signal itself would have given


@contextlib.contextmanager
def sigterm_recorded(enabled: bool):
    """While active, SIGTERM only sets `received[0]` (the loop stops at the next step boundary).
    Python takes signals in the main thread only: a loop run elsewhere keeps SIGTERM as it was."""
    received = [0]
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield received
        return

    def record(signum, frame):
        received[0] = signum

    previous = signal.signal(signal.SIGTERM, record)
    try:
        yield received
    finally:
        signal.signal(signal.SIGTERM, previous)


def global_sums(values: list[float], group=None) -> list[float]:
    """Sum host numbers over all ranks (every rank calls this), in one collective."""
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
    if dtype == "fp32":
        return contextlib.nullcontext()
    # Autocast's weight-cast cache is off in the validated eager mode: FSDP frees the unsharded
    # weights after each block, so a cached cast would keep a stale copy alive.
    return torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=False)


class Trainer:
    """Runs one recipe's job: everything recipe-specific lives in `task` (see pan/recipes)."""

    def __init__(self, job, task, world, dims, model, optimizer, scheduler, loader, checkpointer,
                 metrics, ema=None):
        self.job, self.task, self.world, self.dims = job, task, world, dims
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.loader, self.checkpointer, self.metrics = loader, checkpointer, metrics
        self.ema = ema
        self.state = TrainState()
        self._consumed = None  # the file of sample ids seen (record_samples)
        self.log = get_logger()

    # -- one optimizer step --------------------------------------------------------------------
    def next_micro_batches(self) -> tuple[list, float]:
        """The k micro-batches of one step, prepared for the model; and the seconds spent waiting
        for the data loader."""
        got = [self.task.next_batch(self.loader) for _ in range(self.job.trainer.gradient_accumulation_steps)]
        return [batch for batch, _ in got], sum(waited for _, waited in got)

    def train_step(self, micro_batches: list) -> dict:
        cfg = self.job.trainer
        # Normalise by the number of loss elements of the whole global batch (all micro-batches,
        # all ranks), so the loss and gradients are the same for any dp x cp x accumulation layout.
        global_count = global_sum(sum(self.task.loss_count(mb) for mb in micro_batches))
        sse_total = 0.0
        for i, mb in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            set_gradient_sync(self.model, last)
            with autocast_context(cfg.dtype, self.world.device):
                sse = self.task.loss_sum(self.model, mb)
            (sse / global_count).backward()
            sse_total += sse.detach().float().item()
        loss = global_sum(sse_total) / global_count
        grad_norm = clip_grad_norm(self.model, self.job.optim.max_grad_norm)
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        if finite:
            self.optimizer.step()
            if self.ema is not None:
                self.ema.update()
            self.state.nonfinite_streak = 0
        else:
            self.state.nonfinite_streak += 1
            self.state.skipped_steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        if self.state.nonfinite_streak >= cfg.max_nonfinite_steps:
            raise NonFiniteLossError(
                f"{self.state.nonfinite_streak} steps in a row had a non-finite loss or gradient "
                f"(last loss {loss}, grad norm {grad_norm}); each was skipped. Lower learning_rate, "
                "check the data, or resume from an earlier checkpoint.")
        return {"loss": loss, "grad_norm": grad_norm, "finite": finite}

    # -- the loop ----------------------------------------------------------------------------
    def fit(self) -> None:
        cfg = self.job.trainer
        ckpt_cfg = self.job.checkpoint
        self.metrics.start(self.state.step, cfg.max_steps)
        with sigterm_recorded(ckpt_cfg.save_on_sigterm) as signalled:
            while self.state.step < cfg.max_steps:
                stop_asked = self.step_and_log(signalled[0])
                last = self.state.step == cfg.max_steps
                stop = stop_asked and not last
                # Validation is skipped when stopping: the grace period before SIGKILL is for the save.
                if self.task.wants_validation(self.state.step) and not stop:
                    # Validation sees the EMA weights when there are any: they are what gets exported.
                    with self.ema.swapped_in() if self.ema is not None else contextlib.nullcontext():
                        self.task.validate(self.model, self.state.step, self.checkpointer.output_dir)
                if self.state.step % ckpt_cfg.save_interval == 0 or last or stop:
                    self.checkpointer.save(self.state.step, self.checkpoint_parts())
                if stop:
                    self.metrics.close()
                    raise StoppedBySignal(signal.SIGTERM, self.state.step)
        self.metrics.close()

    def step_and_log(self, signal_received: int) -> bool:
        """Train one step and log it; returns whether a stop signal reached any rank by now."""
        t0 = time.perf_counter()
        micro_batches, data_wait = self.next_micro_batches()
        out = self.train_step(micro_batches)
        self.state.step += 1
        self.record_samples(micro_batches)
        stats = self.task.batch_stats(micro_batches)  # this rank's share
        # The signal rides on the step's sums, so every rank stops after the same step even when
        # the signal reached them at different moments.
        totals = global_sums([stats["samples"], stats["tokens"], stats["flops"], stats["bad_samples"],
                              signal_received])
        self.state.samples_seen += int(totals[0])
        self.state.tokens_seen += int(totals[1])
        self.metrics.step(self.state.step, {
            **out, "samples": totals[0], "tokens": totals[1], "flops": totals[2],
            "bad_samples": int(totals[3]), "packing": stats["packing"],
            "lr": self.scheduler.get_last_lr()[0], "step_time": time.perf_counter() - t0,
            "data_wait": data_wait, "skipped_steps": self.state.skipped_steps})
        return totals[4] > 0

    def record_samples(self, micro_batches: list) -> None:
        """Append this step's sample ids to output_dir/consumed/<dp rank>.txt (one line per step).

        An audit trail of what the model saw: after a resume the steps since the last checkpoint
        are trained again and appear twice; the later line of a step is the one that counted.
        """
        if not self.task.reads_data:
            return
        if self._consumed is None:
            path = self.checkpointer.output_dir / "consumed" / f"{self.task.dp_rank}.txt"
            path.parent.mkdir(parents=True, exist_ok=True)
            self._consumed = open(path, "a")
        ids = [i for mb in micro_batches for i in mb.sample_ids]
        self._consumed.write(f"{self.state.step} {' '.join(ids)}\n")
        self._consumed.flush()

    def checkpoint_parts(self) -> dict:
        """Everything a resume restores, by name (the checkpointer decides how each is stored)."""
        return {"model": self.model, "optimizer": self.optimizer, "scheduler": self.scheduler,
                "loader": self.loader, "train_state": self.state, "task": self.task, "ema": self.ema}


def build_trainer(job) -> Trainer:
    """World, model (parallelised and initialised), optimizer, data, checkpoints: ready to fit()."""
    from pan.checkpoint.manager import Checkpointer
    from pan.checkpoint.warm_start import plan_warm_start
    from pan.config import dump_job
    from pan.metrics import Metrics
    from pan.optim.builder import build_optimizer, build_scheduler
    from pan.optim.ema import EMA
    from pan.parallel.context_parallel import ContextParallel
    from pan.parallel.dims import ParallelDims
    from pan.parallel.fsdp import materialize_and_init, parallelize_model
    from pan.parallel.mesh import build_mesh, cp_group, cp_rank
    from pan.parallel.world import init_world
    from pan.recipes import get_recipe

    log = get_logger()
    world = init_world()
    dims = ParallelDims.from_config(job.parallel, world.size, world.local_size)
    cfg = job.trainer
    if cfg.gradient_accumulation_steps > 1:
        log.warning("gradient_accumulation_steps is %d: Pan's production runs validated the eager mode "
                    "with 1; pan accumulates exactly (tested against one large batch).",
                    cfg.gradient_accumulation_steps)
    output_dir = Path(job.checkpoint.output_dir)
    if world.is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "config.yaml").write_text(dump_job(job))
    mesh = build_mesh(dims, world)
    cp = None
    if dims.cp > 1:
        comm_device = world.device if world.device.type == "cuda" else torch.device("cpu")
        cp = ContextParallel(cp_rank(mesh), dims.cp, cp_group(mesh), comm_device)
    task = get_recipe(job.recipe).task(job, world, dims, cp)
    log.info("world: %d processes (dp_replicate %d x dp_shard %d x cp %d) on %s",
             world.size, dims.dp_replicate, dims.dp_shard, dims.cp, world.device)

    checkpointer = Checkpointer(job.checkpoint, world, dims,
                                restart_data_on_dp_change=job.data.restart_data_on_dp_change)
    warm_start = plan_warm_start(job.warm_start, checkpointer.latest_step())
    model = materialize_and_init(task.build_model(), world.device, cfg.seed, mesh)
    if warm_start is not None:
        warm_start.before_sharding(model)
    model = parallelize_model(model, mesh, dims, job.parallel, cfg)
    if warm_start is not None:
        warm_start.after_sharding(model)
    log.info("model: %.1fM parameters", sum(p.numel() for p in model.parameters()) / 1e6)
    optimizer, report = build_optimizer(model, job.optim)
    log.info("optimizer split:\n%s", report)
    scheduler = build_scheduler(optimizer, job.optim, cfg.max_steps)
    ema = EMA(model, job.optim.ema_decay) if job.optim.ema_decay > 0 else None
    task.load_encoders()
    loader = task.build_loader(dims) if task.reads_data else None
    metrics = Metrics(job.logging, output_dir, world, world.device, cfg.dtype)
    trainer = Trainer(job, task, world, dims, model, optimizer, scheduler, loader, checkpointer,
                      metrics, ema)
    resumed = checkpointer.resume(trainer.checkpoint_parts())
    if resumed is not None:
        log.info("resuming from checkpoint-%d", resumed)
    return trainer


def world_is_main() -> bool:
    return os.environ.get("RANK", "0") == "0"


def train(job) -> int:
    """Entry point of `train.py` / `pan train`: build everything from the job config and train."""
    from pan.checkpoint.manager import UnreadableRunError
    from pan.config import ConfigError
    from pan.data.loader import DataResumeError
    from pan.parallel.world import close_world

    log = get_logger()
    trainer = None
    try:
        trainer = build_trainer(job)
        trainer.fit()
        log.info("training finished at step %d", trainer.state.step)
        return 0
    except NonFiniteLossError as e:
        log.error("%s", e)
        return 1
    except StoppedBySignal as e:
        log.warning("%s", e)
        return e.exit_code
    except (DataResumeError, UnreadableRunError, ConfigError) as e:
        # Refusals found while resuming: another number of data-parallel ranks than the
        # checkpoints', or checkpoints none of which can be read (never silently start over them).
        if world_is_main():
            print(f"pan: cannot start: {e}", file=sys.stderr)
        return 2
    finally:
        if trainer is not None and hasattr(trainer.loader, "close"):
            trainer.loader.close()
        close_world()

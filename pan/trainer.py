"""The one training loop: build, step, log, validate, save."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal

import torch
import torch.distributed as dist

from pan.checkpoint.lease import LeaseHeldError, refuse_if_held, run_lease
from pan.checkpoint.manager import Checkpointer, UnreadableRunError, first_problem
from pan.checkpoint.warm_start import plan_warm_start
from pan.config import ConfigError
from pan.config.core import knob, require
from pan.config.job import dump_sections, job_to_sections
from pan.data.audit import SampleAudit
from pan.data.packed import DataResumeError
from pan.data.sources import SourceError
from pan.data.storage import StorageError
from pan.logging import get_logger, quiet_library_progress_bars
from pan.lora.runs import base_with_adapters
from pan.runtime.metrics import Metrics
from pan.optim.builder import build_optimizer, build_scheduler
from pan.optim.ema import EMA
from pan.parallel.auto_attention import settle_auto_attention
from pan.parallel.context_parallel import ContextParallel
from pan.parallel.dims import ParallelDims
from pan.parallel.fsdp import materialize_and_init, parallelize_model
from pan.parallel.mesh import build_mesh, cp_group, cp_rank
from pan.parallel.threads import set_cpu_threads
from pan.parallel.world import close_world, init_world, is_main_process
from pan.recipe import get_recipe
from pan.task import Part, PartSpec, StepContext, global_sums
from pan.runtime.watchdog import (STARTUP, exit_if_launcher_gone, record_sigterm, sigterm_received,
                                  stop_recording_sigterm, stop_watching_launcher, watch_launcher,
                                  watchdog_running)


@dataclass(kw_only=True)
class TrainerConfig:
    SECTION: ClassVar[str] = "training"
    TRAINING_ONLY: ClassVar[bool] = True  # not checked where a trained model is only used (pan sample)

    max_steps: int = knob(1000, "optimizer steps to train for", ge=1)
    gradient_accumulation_steps: int = knob(
        1, "packed micro-batches per optimizer step; k micro-batches of b give the update of one "
           "batch of k*b", ge=1)
    seed: int = knob(0, "seed of model init, data order, timesteps and noise", ge=0)
    dtype: Literal["fp32", "bf16"] = knob(
        "bf16", "compute dtype: bf16 autocast with fp32 master weights, or fp32 throughout (on a CPU "
                "`pan check`'s devices row measures which is faster there: bf16 matmuls run ~90x slower "
                "than fp32 on AVX2 CPUs, faster on CPUs with AMX)")
    legacy_eager_mode: bool = knob(
        True, "the validated eager execution, pan's only mode, so this switch must stay true (false is "
              "refused; the key exists so that Pan's configs load): autocast without its weight cache "
              "(pan/task.py), FSDP resharding after forward (pan/parallel/fsdp.py), NCCL "
              "async error handling (pan/parallel/world.py), no CUDA graphs")
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
    # part name -> the backend its `attention_backend: auto` became (pan/parallel/auto_attention.py)
    attention_backends: dict[str, str] = field(default_factory=dict)

    def state_dict(self) -> dict:
        return dict(vars(self))

    def load_state_dict(self, d: dict) -> None:
        for k, v in d.items():
            setattr(self, k, v)


class NonFiniteLossError(RuntimeError):
    pass


class LeaseLostError(RuntimeError):
    """Another launch took over output_dir's lease: this run stops without writing anything more."""


class StoppedBySignal(RuntimeError):
    """A signal asked the run to stop; the checkpoint of the step it stopped at is written."""

    def __init__(self, signum: int, step: int):
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}: checkpoint-{step} "
                         "is saved and the next launch resumes from it")
        self.exit_code = 128 + signum  # what the signal itself would have given


class StoppedBeforeTraining(RuntimeError):
    """A SIGTERM came during the start-up: every rank stops at the end of the phase it came in,
    before anything is trained or saved (a resumed checkpoint is left as it was)."""

    def __init__(self, phase: str):
        super().__init__(f"SIGTERM during start-up ({phase}): nothing trained yet, exiting "
                         f"{128 + signal.SIGTERM} so the job is requeued")
        self.exit_code = 128 + signal.SIGTERM  # what the signal itself would have given


@contextlib.contextmanager
def sigterm_recorded(enabled: bool):
    """While active, SIGTERM only sets `received[0]` (the loop stops at the next step boundary).
    Under train() the start-up's record carries on (pan.runtime.watchdog.record_sigterm): a SIGTERM
    after the start-up's last look stops the run after its first step. Python takes signals in the
    main thread only: a loop run elsewhere keeps SIGTERM as it was."""
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield [0]
        return
    installed = record_sigterm()
    try:
        yield sigterm_received()
    finally:
        if installed:
            stop_recording_sigterm()


_startup_looks = False  # train()'s start-up runs: it looks for a SIGTERM at the end of each phase


@contextlib.contextmanager
def sigterm_stops_the_start_up():
    """train()'s start-up: SIGTERM is recorded from here on (not fatal), and `stop_if_sigterm` looks
    for it at the end of each phase (rendezvous, pan check, model build, loader build, resume).
    On the way out SIGTERM's action is restored, unless an outer caller (`pan train`) recorded it
    first: that caller restores it."""
    global _startup_looks
    installed = record_sigterm()
    _startup_looks = True
    try:
        yield
    finally:
        _startup_looks = False
        if installed:
            stop_recording_sigterm()


def stop_if_sigterm(phase: str) -> None:
    """The end of one phase of train()'s start-up: when a SIGTERM has reached any rank by now, every
    rank raises StoppedBeforeTraining here, together (a collective, so that ranks the signal reached
    at different moments, or only one of them, stop at the same point). A phase blocks until it
    ends (a collective or a file half read cannot be interrupted safely): a SIGTERM within it stops
    the run at its end. Nothing (no collective either) outside train(): build_trainer(...).fit()."""
    if not _startup_looks:
        return
    if global_sums([float(sigterm_received()[0] != 0)])[0] > 0:
        raise StoppedBeforeTraining(phase)


class Trainer:
    """Runs one recipe's job: everything recipe-specific lives in `task` (pan/task.py)."""

    def __init__(self, job, task, world, dims, parts: dict[str, Part], loader, checkpointer, metrics):
        self.job, self.task, self.world, self.dims = job, task, world, dims
        self.parts = parts
        self.loader, self.checkpointer, self.metrics = loader, checkpointer, metrics
        self.state = TrainState()
        # What each step trained and the bad samples met, in output_dir (pan/data/audit.py).
        self.audit = SampleAudit(checkpointer.output_dir, task.dp_rank, task.reads_data)
        self._bad_logged = 0   # distinct bad samples over all ranks, when last logged
        self.lease = None      # rank 0's RunLease of output_dir, when train() holds one
        self.watchdog = None   # this rank's Watchdog, when train() runs one
        self._attention_settled = False   # no part's attention is left on `auto` (pan/parallel/auto_attention.py)
        self.log = get_logger()

    def close(self) -> None:
        """Stop the data loader's decoding workers (train() and the demos call it when done)."""
        if self.loader is not None and hasattr(self.loader, "close"):
            self.loader.close()

    # The main part (the first declared): what `loss`, `grad_norm`, export and samples refer to.
    @property
    def main(self) -> Part:
        return next(iter(self.parts.values()))

    @property
    def model(self):
        return self.main.model

    @property
    def optimizer(self):
        return self.main.optimizer

    @property
    def scheduler(self):
        return self.main.scheduler

    @property
    def ema(self):
        return self.main.ema

    # -- one optimizer step --------------------------------------------------------------------
    def next_micro_batches(self) -> tuple[list, float]:
        """The k micro-batches of one step, prepared for the model; and the seconds spent waiting
        for the data loader."""
        got = [self.task.next_batch(self.loader) for _ in range(self.job.trainer.gradient_accumulation_steps)]
        return [batch for batch, _ in got], sum(waited for _, waited in got)

    def train_step(self, micro_batches: list) -> dict:
        """The recipe's step (forward, backward, update of every part), then the non-finite guard."""
        cfg = self.job.trainer
        ctx = StepContext(self.parts, self.state.step, cfg.dtype, self.world.device)
        try:
            out = dict(self.task.train_step(ctx, micro_batches))
        except torch.OutOfMemoryError as e:
            e.add_note(out_of_memory_advice(self.state.step + 1))
            raise
        if ctx.finite:
            self.state.nonfinite_streak = 0
        else:
            self.state.nonfinite_streak += 1
            self.state.skipped_steps += 1
        if self.state.nonfinite_streak >= cfg.max_nonfinite_steps:
            raise NonFiniteLossError(
                f"{self.state.nonfinite_streak} steps in a row had a non-finite loss or gradient "
                f"(last loss {out.get('loss')}, grad norm {out.get('grad_norm')}); each was skipped. "
                "Lower learning_rate, check the data, or resume from an earlier checkpoint.")
        out["finite"] = ctx.finite
        return out

    # -- the loop ----------------------------------------------------------------------------
    def fit(self) -> None:
        cfg = self.job.trainer
        ckpt_cfg = self.job.checkpoint
        self.metrics.start(self.state.step, cfg.max_steps)
        self.settle_attention(measure=False)   # a resumed run's choice, before its first step
        with sigterm_recorded(ckpt_cfg.save_on_sigterm) as signalled:
            while self.state.step < cfg.max_steps:
                with self.watched("step", f"step {self.state.step + 1}"):
                    stop_asked = self.step_and_log(signalled[0])
                last = self.state.step == cfg.max_steps
                stop = stop_asked and not last
                # Validation is skipped when stopping: the grace period before SIGKILL is for the save.
                if self.task.wants_validation(self.state.step) and not stop:
                    with self.watched("validation", f"the validation at step {self.state.step}"):
                        self.validate()
                if self.state.step % ckpt_cfg.save_interval == 0 or last or stop:
                    with self.watched("save", f"the save of step {self.state.step}"):
                        self.checkpointer.save(self.state.step, self.checkpoint_parts())
                if stop:
                    self.metrics.close()
                    raise StoppedBySignal(signal.SIGTERM, self.state.step)
        self.metrics.close()

    def watched(self, phase: str, what: str):
        """The watchdog's timing of one phase of the loop (nothing when no watchdog runs)."""
        if self.watchdog is None:
            return contextlib.nullcontext()
        return self.watchdog.watching(phase, what)

    def validate(self) -> dict:
        """The recipe's validation, with every part's EMA weights swapped in (they are what gets
        exported); its metrics go to the log."""
        with contextlib.ExitStack() as stack:
            for part in self.parts.values():
                if part.ema is not None:
                    stack.enter_context(part.ema.swapped_in())
            results = self.task.validate(self.parts, self.state.step, self.checkpointer.output_dir)
        if results:
            self.metrics.record(self.state.step, results)
        return results

    def step_and_log(self, signal_received: int) -> bool:
        """Train one step and log it; returns whether a stop signal reached any rank by now."""
        t0 = time.perf_counter()
        micro_batches, data_wait = self.next_micro_batches()
        out = self.train_step(micro_batches)
        self.state.step += 1
        self.audit.record_samples(self.state.step, micro_batches)
        distinct_bad = self.audit.record_bad_samples(self.loader, self.checkpointer.cp_rank)
        stats = self.task.batch_stats(micro_batches)  # this rank's share
        # The signal and a lost lease ride on the step's sums, so every rank stops after the same
        # step even when the signal reached them at different moments.
        lease_lost = self.lease is not None and self.lease.lost
        totals = global_sums([stats["samples"], stats["tokens"], stats["flops"], stats["bad_samples"],
                              signal_received, lease_lost, distinct_bad])
        if totals[5] > 0:
            raise LeaseLostError(f"another launch took over the lease of {self.checkpointer.output_dir} "
                                 f"after step {self.state.step}: this run stopped without saving")
        self.state.samples_seen += int(totals[0])
        self.state.tokens_seen += int(totals[1])
        if int(totals[6]) > self._bad_logged:
            self._bad_logged = int(totals[6])
            self.log.info("%d bad sample%s found so far, listed in %s: each was read once and is skipped "
                          "unread from then on (rows skipped since the run started: %d)", self._bad_logged,
                          "" if self._bad_logged == 1 else "s", self.checkpointer.output_dir / "bad_samples",
                          int(totals[3]))
        lrs = {f"lr/{name}": part.scheduler.get_last_lr()[0] for name, part in self.parts.items()}
        lrs = {"lr": lrs.pop(f"lr/{self.main.name}"), **lrs}
        self.metrics.step(self.state.step, {
            **out, "samples": totals[0], "tokens": totals[1], "flops": totals[2],
            "bad_samples": int(totals[3]), "bad_samples_distinct": int(totals[6]),
            "packing": stats["packing"], **lrs,
            "step_time": time.perf_counter() - t0, "data_wait": data_wait,
            "skipped_steps": self.state.skipped_steps})
        self.settle_attention()
        return totals[4] > 0

    def settle_attention(self, measure: bool = True) -> None:
        """Each part's `attention_backend: auto` made one backend, rank 0's choice (pan/parallel/auto_attention.py)."""
        self._attention_settled = self._attention_settled or settle_auto_attention(
            {name: part.model for name, part in self.parts.items()}, self.world, self.job.trainer.dtype,
            self.state.attention_backends, measure)

    def checkpoint_parts(self) -> dict:
        """Everything a resume restores, by name (the checkpointer decides how each is stored)."""
        return {"parts": self.parts, "loader": self.loader, "train_state": self.state, "task": self.task}


def out_of_memory_advice(step: int) -> str:
    """What pan adds to torch's out-of-memory error: the keys that lower the peak."""
    return (f"pan: out of memory in step {step}. `pan check --config <yaml> --explain-memory` estimates "
            "the peak and what each change saves. Cheapest first: enable_gradient_checkpointing: true, "
            "a smaller max_tokens_per_batch, a larger cp_size, hybrid_shard: false (shard over every "
            "rank), precomputed text features (pan data precompute).")


def build_part(spec: PartSpec, world, dims, mesh, cfg: TrainerConfig, parallel, warm_start,
               fresh: bool, lora_base=None) -> Part:
    """One part: model materialised and initialised (or loaded from its pretrained weights when the
    run starts `fresh`), warm-started, parallelised (`parallel`: the job's ParallelConfig); its
    optimizer, LR schedule and EMA. A LoRA part (`spec.lora`) loads its base from `lora_base` (the
    warm-start source, planned also when resuming) and trains adapters only."""
    log = get_logger()
    model = materialize_and_init(spec.build(), world.device, cfg.seed, mesh)
    lora = None
    if spec.lora is not None:
        lora = base_with_adapters(model, spec, cfg, lora_base)
        model = parallelize_model(model, mesh, dims, parallel, cfg)
    else:
        if warm_start is not None and spec.warm_start:
            warm_start.before_sharding(model)
        model = parallelize_model(model, mesh, dims, parallel, cfg)
        if warm_start is not None and spec.warm_start:
            warm_start.after_sharding(model, spec.name)
        if fresh and spec.pretrained is not None:
            load_full_state_dict(model, spec.pretrained())
            log.info("%s: started from its pretrained weights", spec.name)
    total = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log.info("%s: %.1fM parameters (%.2fM trained)", spec.name, total / 1e6, trained / 1e6)
    optim = spec.optim.optim()
    optimizer, report = build_optimizer(model, optim)
    log.info("%s optimizer split:\n%s", spec.name, report)
    scheduler = build_scheduler(optimizer, optim, cfg.max_steps)
    ema = EMA(model, optim.ema_decay) if optim.ema_decay > 0 else None
    return Part(spec.name, model, optimizer, scheduler, ema, optim, lora)


def load_full_state_dict(model, state: dict) -> None:
    """Load whole (unsharded) tensors into a model, sharded or not, strictly: every rank passes the
    same full state dict and keeps its shard."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=True))


def build_trainer(job) -> Trainer:
    """World, parts (parallelised and initialised), optimizers, data, checkpoints: ready to fit()."""

    log = get_logger()
    quiet_library_progress_bars()
    world = init_world(getattr(job, "process", None))
    if world.device.type == "cpu":
        log.info("CPU threads: %s", set_cpu_threads())
    dims = ParallelDims.from_config(job.parallel, world.size, world.local_size)
    cfg = job.trainer
    if cfg.gradient_accumulation_steps > 1:
        # A note, not a warning: accumulation is exact; a recipe says why it warns (ACCUMULATION_WARNING).
        reason = job.ACCUMULATION_WARNING
        (log.warning if reason else log.info)(
            "gradient_accumulation_steps is %d: pan accumulates exactly (tested against one large "
            "batch)%s.", cfg.gradient_accumulation_steps, f"; {reason}" if reason else "")
    output_dir = Path(job.checkpoint.output_dir)
    sections = job_to_sections(job)  # the resolved config, once: config.yaml and the metrics backend
    if world.is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "config.yaml").write_text(dump_sections(sections))
    mesh = build_mesh(dims, world)
    cp = None
    if dims.cp > 1:
        comm_device = world.device if world.device.type == "cuda" else torch.device("cpu")
        cp = ContextParallel(cp_rank(mesh), dims.cp, cp_group(mesh), comm_device)
    task = get_recipe(job.recipe).build_task(job, world, dims, cp)
    log.info("world: %d processes (dp_replicate %d x dp_shard %d x cp %d) on %s",
             world.size, dims.dp_replicate, dims.dp_shard, dims.cp, world.device)

    data_cfg = getattr(job, "data", None)
    checkpointer = Checkpointer(job.checkpoint, world, dims,
                                restart_data_on_dp_change=getattr(data_cfg, "restart_data_on_dp_change", False),
                                elastic_data=task.elastic_data, accumulation=cfg.gradient_accumulation_steps,
                                data_shards=task.data_shards())
    specs = task.part_specs()
    # Before any model is built: a run of other parts (or another dp size) in output_dir is refused.
    latest = checkpointer.latest_step([spec.name for spec in specs])
    # A LoRA part loads its base from the warm-start source on every launch, resumes included.
    lora_base = plan_warm_start(task.warm_start_source(), None) if any(s.lora for s in specs) else None
    warm_start = None if all(s.lora for s in specs) else plan_warm_start(task.warm_start_source(), latest)
    parts = {}
    for spec in specs:
        parts[spec.name] = build_part(spec, world, dims, mesh, cfg, job.parallel, warm_start,
                                      fresh=latest is None, lora_base=lora_base)
        stop_if_sigterm("model build")
    task.load_encoders()
    stop_if_sigterm("encoder load")
    loader = build_loader_everywhere(task, dims)
    try:
        stop_if_sigterm("loader build")
    except StoppedBeforeTraining:
        if loader is not None and hasattr(loader, "close"):
            loader.close()  # its decoding workers
        raise
    metrics = Metrics(job.logging, output_dir, world, world.device, cfg.dtype, sections)
    trainer = Trainer(job, task, world, dims, parts, loader, checkpointer, metrics)
    resumed = checkpointer.resume(trainer.checkpoint_parts())
    if resumed is not None:
        log.info("resuming from checkpoint-%d", resumed)
    return trainer


def build_loader_everywhere(task, dims):
    """The task's data loader on the ranks that read data. A data source that cannot be used (a CSV
    without a caption column, fewer rows than ranks) is raised on every rank together, so the run
    stops with one message instead of some ranks waiting for the others forever (so is a manifest
    whose store stayed unreachable through every retry)."""

    loader, problem = None, None
    if task.reads_data:
        try:
            loader = task.build_loader(dims)
        except (SourceError, StorageError) as e:
            problem = str(e)
    problem = first_problem(problem)
    if problem is not None:
        raise SourceError(problem)
    return loader


def train(job, preflight=None) -> int:
    """Entry point of `train.py` / `pan train`: build everything from the job config and train.

    `preflight(job, world)`, when given, runs once the process group is up and before anything is
    written or built; a ConfigError it raises on every rank refuses the launch (exit 2, rank 0
    printing it). `pan.cli.cmd_train` passes `pan check`'s rows (`pan.preflight.refuse_at_start`).

    A SIGTERM (preemption, scancel, the time limit) during the start-up is recorded from the first
    line on (`pan train` records it before the config loads): every rank stops at the end of the
    phase it came in (`stop_if_sigterm`), with one log line, the lease released, nothing trained or
    saved (a resumed checkpoint untouched), and returns 143 so that the job is requeued. Once the
    loop runs, SIGTERM saves the step it stopped at (`save_on_sigterm`)."""
    log = get_logger()
    trainer = None
    guards = contextlib.ExitStack()
    cfg = job.watchdog
    try:
        # First: a SIGTERM (preemption, scancel, the time limit) during the start-up stops every rank
        # with 143 at the end of the phase it came in, instead of killing them (a crash, status 1).
        guards.enter_context(sigterm_stops_the_start_up())
        if cfg.exit_when_launcher_dies:
            watch_launcher()  # started by train.py's first line already; here for other callers
        else:
            stop_watching_launcher()
        dog = None
        if cfg.watchdog:
            dog = guards.enter_context(watchdog_running(cfg.watchdog_factor, cfg.watchdog_min_timeout,
                                                        cfg.watchdog_first_timeout,
                                                        cfg.watchdog_startup_timeout))
        # The start-up is watched as a phase of its own: a rank frozen or stuck on a dead file system
        # while the others wait for it in a collective (the resume's broadcasts) is a hang too.
        with dog.watching(STARTUP, "the start-up") if dog is not None else contextlib.nullcontext():
            # The process config's process_group_timeout also bounds the rendezvous.
            world = init_world(getattr(job, "process", None))
            if dog is not None:
                dog.use_process_group()
            stop_if_sigterm("rendezvous")
            # A folder held by a live run is refused first, reading only: `pan check`'s rows below
            # probe whether output_dir can be written, which must not touch a held folder.
            refuse_if_held(job.checkpoint.output_dir, job.checkpoint.lease_timeout, world)
            # What `pan check` fails, the launch refuses (train.py and `pan train` pass its rows for
            # this world, pan.preflight.refuse_at_start): before the lease, config.yaml or any model.
            if preflight is not None:
                preflight(job, world)
                stop_if_sigterm("pan check")
            # Before anything is written to output_dir: one run per folder.
            lease = guards.enter_context(run_lease(job.checkpoint.output_dir, job.checkpoint.lease_timeout,
                                                   world))
            log.info("lease of %s held (lease_timeout %g s)", job.checkpoint.output_dir,
                     job.checkpoint.lease_timeout)
            trainer = build_trainer(job)
            stop_if_sigterm("resume")
        if not job.checkpoint.save_on_sigterm:
            # SIGTERM ends the loop at once (as it would without pan): its action again, and one
            # that came since the last look above takes it now.
            stop_recording_sigterm()
            if sigterm_received()[0] != 0:
                signal.raise_signal(signal.SIGTERM)
        trainer.lease = lease
        trainer.watchdog = dog
        trainer.fit()
        log.info("training finished at step %d", trainer.state.step)
        return 0
    except NonFiniteLossError as e:
        log.error("%s", e)
        return 1
    except StoppedBySignal as e:
        log.warning("%s", e)
        return e.exit_code
    except StoppedBeforeTraining as e:
        if trainer is not None:
            trainer.metrics.close()
        log.warning("%s", e)
        return e.exit_code
    except LeaseLostError as e:
        log.error("%s", e)
        return 2
    except (DataResumeError, UnreadableRunError, ConfigError, SourceError, LeaseHeldError) as e:
        # Refusals found while starting (every rank raises them together, rank 0 says why): another
        # number of data-parallel ranks than the checkpoints', checkpoints none of which can be read
        # (never silently start over them), other parts, unusable data sources. A data source that
        # fails later (no usable sample in a whole pass) fails on the rank that reads it: it says so.
        if is_main_process() or trainer is not None:
            print(f"pan: {'cannot start' if trainer is None else 'stopped'}: {e}", file=sys.stderr)
        return 2
    except StorageError as e:
        # A store unreachable through every retry (or refusing the credentials) while training: said
        # by the rank that read it, naming the URL. Nothing was taken for a bad sample, and the
        # checkpoints hold the data cursors: a resume once the store answers continues exactly.
        print(f"pan: stopped: {e}. Resume once it answers: the data continues exactly where the last "
              "checkpoint left it.", file=sys.stderr)
        return 1
    except dist.DistBackendError as e:
        # A peer process died (its own error is above): one line here, not a traceback per rank.
        # When the launcher is gone, that is why (the peers stopped on seeing it): say so instead.
        exit_if_launcher_gone(grace_s=1.0)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"pan: rank {os.environ.get('RANK', '0')} lost a peer process ({first[:200]}); the "
              "first error above says why.", file=sys.stderr)
        return 1
    except Exception:
        # The launcher's store vanishes with it: an error of the rendezvous or of a new process group
        # ("Broken pipe") can come before the launcher watch sees the launcher gone.
        exit_if_launcher_gone(grace_s=1.0)
        raise
    finally:
        if trainer is not None:
            trainer.close()
        guards.close()  # the watchdog stops, the lease is released
        close_world()

"""Checkpoint folders of a run: `output_dir/checkpoint-N/`, written atomically, pruned, resumed."""

from __future__ import annotations

import io
import random
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

# A world of one saves and loads DCP without a process group, as intended: not worth a warning.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from pan.checkpoint import checksums, durable, layout, reader
from pan.config.core import ConfigError, knob
from pan.logging import get_logger
from pan.lora.adapters import LORA_KEY
from pan.lora.adapters import reference_differences as lora_reference_differences


@dataclass(kw_only=True)
class CheckpointConfig:
    SECTION: ClassVar[str] = "output"
    TRAINING_ONLY: ClassVar[bool] = True  # not checked where a trained model is only used (pan sample)

    output_dir: str = knob("runs/default", "the run's directory: checkpoints, logs, samples, "
                           "config.yaml; a run resumes from the latest checkpoint here", non_empty=True)
    save_interval: int = knob(1000, "write checkpoint-N/ every this many steps (and at the last step)",
                              ge=1)
    save_total_limit: int | None = knob(
        None, "keep at most this many complete checkpoints, deleting the oldest (null: keep all)", ge=1)
    save_on_sigterm: bool = knob(
        True, "on SIGTERM (Slurm preemption or time limit, scancel, torchrun stopping) finish the "
              "step, write checkpoint-N and exit with 143 (128 + SIGTERM); false: SIGTERM ends the "
              "run at once and it resumes from the last regular save")
    lease_timeout: float = knob(
        120.0, "seconds without a heartbeat after which a run's lease on output_dir (lease.json, "
               "refreshed every few seconds) is stale and a new launch on another node takes it "
               "over; on the run's own node a lease whose processes are all gone is taken over at "
               "once", gt=0)
    save_checksums: bool = knob(
        True, "record a CRC32 of every file of a checkpoint in its COMPLETE.json (computed while "
              "the file is written)")
    verify_checksums: bool = knob(
        True, "a resume reads every file of the checkpoint and compares its CRC32 with the recorded "
              "one (the ranks share the files); a mismatch falls back to the previous checkpoint. "
              "false: only sizes and metadata are checked")


# ------------------------------------------------------------------------------------------------
# Saving and resuming
# ------------------------------------------------------------------------------------------------

class UnreadableRunError(RuntimeError):
    """Every checkpoint in output_dir is unreadable: starting fresh would overwrite the run."""


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _broadcast_from_main(obj: Any) -> Any:
    """Rank 0's value of `obj` on every rank (so that all ranks take the same decision)."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def first_problem(problem: str | None) -> str | None:
    """The first rank's problem (by rank) when any rank has one, on every rank; None when none has."""
    if not dist.is_initialized():
        return problem
    problems: list = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    return next((p for p in problems if p is not None), None)


def _all_ok(ok: bool, reason: str | None) -> tuple[bool, str | None]:
    """True on every rank when `ok` holds on every rank; else the first failing rank's reason."""
    if not dist.is_initialized():
        return ok, reason
    reasons: list = [None] * dist.get_world_size()
    dist.all_gather_object(reasons, None if ok else f"rank {dist.get_rank()}: {reason}")
    failed = [r for r in reasons if r is not None]
    return not failed, (failed[0] if failed else None)


def _dcp_save(state: dict, path: Path, sums: dict[str, int] | None) -> None:
    """DCP save of `state` into `path`; with `sums`, the CRC32 of each file it writes goes there."""
    writer = None if sums is None else checksums.checksumming_writer(path, sums)
    dcp.save(state, checkpoint_id=str(path), storage_writer=writer, no_dist=not dist.is_initialized())


def _first_line(e: BaseException) -> str:
    """The gist of an error (DCP's carry every rank's full traceback)."""
    lines = [line for line in str(e).splitlines() if line.strip()]
    if isinstance(e, CheckpointException):
        # "CheckpointException ranks:..." then each rank's traceback: keep the ranks and the cause
        causes = [line for line in lines if not line.startswith(" ") and "Traceback" not in line]
        return " / ".join(c[:160] for c in causes[:2])
    return (lines[0] if lines else type(e).__name__)[:300]


def _saved_entries_only(optim_state: dict, saved_keys: set[str]) -> dict:
    """Drop the per-parameter optimizer state the checkpoint does not hold.

    A fresh optimizer's state dict is built by a zero-lr step over every parameter, but a parameter
    that never had a gradient (e.g. the text output of the last joint block) has no state in the
    saved run; keeping the made-up entry would make DCP refuse the load and the resumed run differ.
    """
    optim_state["state"] = {
        fqn: kept for fqn, entries in optim_state["state"].items()
        if (kept := {k: v for k, v in entries.items() if f"state.{fqn}.{k}" in saved_keys})}
    return optim_state


def _model_state(part) -> dict:
    """The part's model state as a checkpoint holds it: a LoRA part's trained adapters only (its
    frozen base, buffers included, is loaded from its source on every launch), every tensor otherwise."""
    if part.lora is None:
        return get_model_state_dict(part.model)
    state = get_model_state_dict(part.model, options=StateDictOptions(ignore_frozen_params=True))
    # ignore_frozen_params drops the frozen parameters but keeps persistent buffers (SD3's sin-cos
    # position table): those are the base's too.
    return {key: value for key, value in state.items() if LORA_KEY.search(key)}


def _optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The real torch optimizers behind the trainer's optimizer (an OptimizerSet or a plain one)."""
    return list(getattr(optimizer, "optimizers", [optimizer]))


def _has_cursor(loader) -> bool:
    """Only cp rank 0 of each cp group holds a real data loader."""
    return loader is not None and (hasattr(loader, "shard_states") or hasattr(loader, "state_dict"))


def loader_shards(loader, dp_rank: int) -> list[int]:
    """The data shards whose cursors a loader keeps: its own list (ShardedLoader), or for a loader
    that offers only state_dict / load_state_dict, this rank's (the file named by its dp rank)."""
    return list(getattr(loader, "shards", [dp_rank]))


def loader_cursors(loader, dp_rank: int) -> dict[int, dict]:
    if hasattr(loader, "shard_states"):
        return loader.shard_states()
    return {dp_rank: loader.state_dict()}


def load_loader_cursors(loader, cursors: dict[int, dict]) -> None:
    if hasattr(loader, "load_shard_states"):
        loader.load_shard_states(cursors)
    else:
        loader.load_state_dict(next(iter(cursors.values())))


def rank_rng_state(task) -> dict:
    """This process's random state: torch CPU (and CUDA) generators, Python's, and the task's."""
    state = {"cpu": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    if task is not None and hasattr(task, "state_dict"):
        state["task"] = task.state_dict()
    return state


def restore_rng_state(state: dict, task) -> None:
    torch.set_rng_state(state["cpu"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "task" in state and task is not None:
        task.load_state_dict(state["task"])


def same_shards(meta: dict, data_shards: int) -> bool:
    """Whether a checkpoint's data cursors are those of a run with `data_shards` shards."""
    return meta.get("data_shards", meta["dp_size"]) == data_shards


class Checkpointer:
    """Writes and resumes `output_dir/checkpoint-N/` (layout in pan/checkpoint/layout.py).

    Every method is collective: all ranks call it together, and all ranks take the same decision.
    A resume with another number of data-parallel ranks continues the data where every old rank
    left it when the recipe's loader can (`elastic_data`: `PackedLoader.load_elastic_state`); with
    `restart_data_on_dp_change` (the data config's key) the data streams restart instead; otherwise
    it is refused. Model and optimizer states reshard through DCP either way. `accumulation` (the
    run's micro-batches per step) goes into meta.json, so a new layout can say how the global batch
    changed. The data cursors are one per data shard (`data_shards`: `Task.data_shards()`); a run
    of the same shard count continues every shard exactly, whatever its data-parallel size.
    """

    def __init__(self, cfg: CheckpointConfig, world, dims, *, restart_data_on_dp_change: bool = False,
                 elastic_data: bool = False, accumulation: int = 1, data_shards: int | None = None):
        self.cfg, self.world, self.dims = cfg, world, dims
        self.output_dir = Path(cfg.output_dir)
        self.restart_data_on_dp_change = restart_data_on_dp_change
        self.elastic_data = elastic_data and not restart_data_on_dp_change
        self.accumulation = accumulation
        self.data_shards = data_shards or dims.dp
        self.log = get_logger()
        # (checkpoint, what was wrong) for each checkpoint the last resume skipped.
        self.skipped: list[tuple[Path, str]] = []

    # -- ranks ------------------------------------------------------------------------------------
    @property
    def dp_rank(self) -> int:
        return self.dims.dp_rank_of(self.world.rank)

    @property
    def cp_rank(self) -> int:
        return self.dims.cp_rank_of(self.world.rank)

    def _meta(self, step: int, parts: dict) -> dict:
        return {"format": layout.FORMAT_VERSION, "step": step, "parts": list(parts),
                "world_size": self.world.size,
                "cp_size": self.dims.cp, "dp_size": self.dims.dp,
                "dp_replicate": self.dims.dp_replicate, "dp_shard": self.dims.dp_shard,
                "gradient_accumulation_steps": self.accumulation, "data_shards": self.data_shards,
                "torch": torch.__version__, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "lora": {name: part.lora for name, part in parts.items() if part.lora is not None}}

    # -- save -------------------------------------------------------------------------------------
    def save(self, step: int, parts: dict) -> Path:
        """Write checkpoint-`step`/ atomically, then prune old ones. Returns the folder."""
        t0 = time.perf_counter()
        final = self.output_dir / layout.checkpoint_name(step)
        tmp = final.with_name(final.name + ".tmp")
        if self.world.is_main:
            durable.remove_tree(tmp)  # a save of this step that was killed earlier
            tmp.mkdir(parents=True)
        _barrier()
        sums: dict[str, int] | None = {} if self.cfg.save_checksums else None  # this rank's files

        for name, part in parts["parts"].items():
            model_dir, optimizer_dir, ema_dir = layout.part_dirs(name)
            # Optimizer state is keyed by parameter name, so it reloads under any sharding.
            _dcp_save(_model_state(part), tmp / model_dir, sums)
            _dcp_save(get_optimizer_state_dict(part.model, _optimizers(part.optimizer)), tmp / optimizer_dir, sums)
            if part.ema is not None:
                _dcp_save(part.ema.state_dict(), tmp / ema_dir, sums)

        loader = parts.get("loader")
        # (A loader whose shards other ranks hold too, a VAE context group's or an AR sync group's,
        # leaves them to one of them: `writes_cursors`.)
        if _has_cursor(loader) and self.cp_rank == 0 and getattr(loader, "writes_cursors", True):
            for shard, cursor in loader_cursors(loader, self.dp_rank).items():
                self._write_json(tmp / layout.DATALOADER / f"{shard}.json", cursor, sums)

        mine = {"rng": rank_rng_state(parts.get("task")),
                "crc32": None if sums is None else {str(Path(p).relative_to(tmp).as_posix()): crc
                                                    for p, crc in sums.items()}}
        ranks = [None] * self.world.size
        if dist.is_initialized():
            dist.all_gather_object(ranks, mine)
        else:
            ranks = [mine]
        if self.world.is_main:
            buffer = io.BytesIO()
            torch.save({"step": step,
                        "schedulers": {n: p.scheduler.state_dict() for n, p in parts["parts"].items()},
                        "train_state": parts["train_state"].state_dict(), "rng": [r["rng"] for r in ranks],
                        "world_size": self.world.size, "cp_size": self.dims.cp}, buffer)
            self._write_bytes(tmp / layout.TRAINING_STATE, buffer.getvalue(), sums)
            self._write_json(tmp / layout.META, self._meta(step, parts["parts"]), sums)
        _barrier()  # every rank's files are written and fsynced

        if self.world.is_main:
            crcs = None
            if sums is not None:
                crcs = {rel: crc for r in ranks for rel, crc in r["crc32"].items()}
                crcs.update({str(Path(p).relative_to(tmp).as_posix()): crc for p, crc in sums.items()})
            self._commit(tmp, final, step, crcs)
            self._prune(keep=final)
        _barrier()
        self.log.info("saved %s in %.1f s", final, time.perf_counter() - t0)
        return final

    @staticmethod
    def _write_bytes(path: Path, data: bytes, sums: dict[str, int] | None) -> None:
        durable.write_bytes_durably(path, data)
        if sums is not None:
            sums[str(path)] = checksums.crc32(data)

    def _write_json(self, path: Path, obj, sums: dict[str, int] | None) -> None:
        self._write_bytes(path, durable.json_bytes(obj), sums)

    def _commit(self, tmp: Path, final: Path, step: int, crcs: dict[str, int] | None) -> None:
        """Marker last, then one rename: nothing named checkpoint-N exists until it is whole.

        `crcs` (relative path -> CRC32, None: no checksums) holds what the ranks computed while
        writing; a file it misses is hashed here, from the page cache."""
        durable.fsync_tree(tmp)
        sizes = durable.file_sizes(tmp)
        marker = {"step": step, "files": sizes}
        if crcs is not None:
            missed = [rel for rel in sizes if rel not in crcs]
            if missed:
                self.log.debug("hashing %d files at commit: %s", len(missed), missed)
            crcs.update({rel: checksums.crc32_of_file(tmp / rel) for rel in missed})
            marker["crc32"] = {rel: f"{crcs[rel]:08x}" for rel in sizes}
        durable.write_json_durably(tmp / layout.MARKER, marker)
        durable.fsync_path(tmp)
        if final.exists():  # an unreadable checkpoint of this step that a resume skipped
            old = final.with_name(final.name + ".old")
            durable.remove_tree(old)
            final.rename(old)
            tmp.rename(final)
            durable.remove_tree(old)
        else:
            tmp.rename(final)
        durable.fsync_path(final.parent)

    def _prune(self, keep: Path) -> None:
        """Delete the oldest complete checkpoints beyond save_total_limit (never `keep`)."""
        if self.cfg.save_total_limit is None:
            return
        complete = layout.complete_checkpoints(self.output_dir)
        excess = [p for p in complete if p != keep][:max(len(complete) - self.cfg.save_total_limit, 0)]
        for path in excess:
            # Rename first: a kill half-way through the delete leaves a `.old`, never a broken
            # checkpoint-N that still carries its marker.
            doomed = path.with_name(path.name + ".old")
            path.rename(doomed)
            durable.remove_tree(doomed)
            self.log.info("save_total_limit %d: deleted %s", self.cfg.save_total_limit, path.name)

    # -- resume -----------------------------------------------------------------------------------
    def latest_step(self, part_names: list[str] | None = None) -> int | None:
        """The step of the newest complete checkpoint in output_dir (None: the run starts fresh).

        Call it before building the model: it decides whether the warm start applies, and it
        refuses a data-parallel size change now rather than after minutes of model building.
        """
        complete = _broadcast_from_main([layout.step_of(p) for p in layout.complete_checkpoints(self.output_dir)])
        if not complete:
            return None
        meta = _broadcast_from_main(self._read_meta(self.output_dir / layout.checkpoint_name(complete[-1])))
        if meta is not None:
            self._check_layout(meta)
            if part_names is not None:
                self._check_parts(meta, part_names)
        return complete[-1]

    def _read_meta(self, path: Path) -> dict | None:
        try:
            return layout.read_json(path / layout.META)
        except Exception:
            return None  # resume() reports it when it gets to this checkpoint

    def _check_layout(self, meta: dict) -> None:
        if same_shards(meta, self.data_shards) or self.restart_data_on_dp_change or self.elastic_data:
            return
        raise ConfigError(
            "restart_data_on_dp_change",
            f"{self.output_dir} holds checkpoint-{meta['step']} of a run with {meta['dp_size']} data-"
            f"parallel ranks (world_size {meta['world_size']}, cp_size {meta['cp_size']}); this run "
            f"has {self.dims.dp} (world_size {self.world.size}, cp_size {self.dims.cp}). Each rank's "
            f"data cursor covers its own share of the data, so they cannot be carried over. Relaunch "
            f"with {meta['dp_size']} data-parallel ranks, or set restart_data_on_dp_change: true to "
            f"load the model and optimizer and restart every data stream.")

    def _check_parts(self, meta: dict, names: list[str]) -> None:
        """Refuse a checkpoint of other parts: nothing may be dropped or left untrained silently."""
        saved = list(meta.get("parts", layout.DEFAULT_PARTS))
        if saved == list(names):
            return
        missing, extra = [n for n in saved if n not in names], [n for n in names if n not in saved]
        raise ConfigError(
            "output_dir",
            f"{self.output_dir} holds checkpoint-{meta['step']} of a run that trained the parts "
            f"{saved}; this run trains {list(names)} ("
            + "; ".join(filter(None, [f"not in this run: {missing}" if missing else "",
                                      f"not in the checkpoint: {extra}" if extra else ""]))
            + "). A resume restores every part by name. Use another output_dir, or the recipe and "
              "settings that wrote it (to start new parts from its weights, warm-start instead).")

    def _check_lora(self, meta: dict, parts: dict) -> None:
        """Refuse adapters trained on another base, or of another shape, and a full run resumed as a
        LoRA run (or the reverse): the adapters only mean something on the base they were trained on."""
        saved = meta.get("lora", {})
        for name, part in parts.items():
            mine = part.lora
            if mine is None and name not in saved:
                continue
            if mine is None or name not in saved:
                was, now = ("LoRA" if name in saved else "full"), ("LoRA" if mine is not None else "full")
                raise ConfigError("lora_rank", f"{self.output_dir} holds checkpoint-{meta['step']} of a {was} "
                                  f"fine-tuning of {name}; this run is {now} fine-tuning. Use the same "
                                  "lora_rank as the run that wrote it, or another output_dir.")
            differences = lora_reference_differences(saved[name], mine)
            if differences:
                raise ConfigError("lora_rank", f"{self.output_dir} holds checkpoint-{meta['step']} whose {name} "
                                  f"adapters were trained otherwise: {'; '.join(differences)}. Resume with "
                                  "the same base and LoRA keys, or use another output_dir.")

    def resume(self, parts: dict) -> int | None:
        """Load the newest readable checkpoint of output_dir into `parts`; its step, or None if none.

        An unreadable checkpoint (truncated shard, missing metadata, bad json...) is skipped with a
        warning that says what was wrong, and the previous one is tried. Raises UnreadableRunError
        when checkpoints exist but none is readable, ConfigError when the data-parallel size changed
        without restart_data_on_dp_change.
        """
        self.skipped = []
        if self.world.is_main:
            for leftover in layout.partial_dirs(self.output_dir):
                self.log.info("removing %s (left by an interrupted save)", leftover.name)
                durable.remove_tree(leftover)
        steps = _broadcast_from_main([layout.step_of(p) for p in layout.complete_checkpoints(self.output_dir)])
        for step in reversed(steps):
            path = self.output_dir / layout.checkpoint_name(step)
            problem = self._try_load(path, parts)
            if problem is None:
                for bad, why in self.skipped:
                    self.log.warning("%s is unreadable (%s); resumed from %s instead", bad.name, why,
                                     path.name)
                return step
            self.skipped.append((path, problem))
            self.log.warning("cannot resume from %s: %s; trying the previous checkpoint", path, problem)
        if self.skipped:
            listing = "; ".join(f"{p.name}: {why}" for p, why in self.skipped)
            raise UnreadableRunError(
                f"{self.output_dir} has checkpoints but none is readable ({listing}). Starting from "
                f"scratch would overwrite this run: repair them, or move them out of output_dir to "
                f"start fresh.")
        return None

    def _try_load(self, path: Path, parts: dict) -> str | None:
        """Load one checkpoint; what was wrong with it (None once it is loaded)."""
        verdict = _broadcast_from_main(layout.verify_checkpoint(path) if self.world.is_main else None)
        if verdict is not None:
            return verdict
        if self.cfg.verify_checksums:
            ok, verdict = _all_ok(*self._verify_my_share_of_checksums(path))
            if not ok:
                return verdict
        meta = _broadcast_from_main(self._read_meta(path))
        self._check_layout(meta)
        self._check_parts(meta, list(parts["parts"]))
        self._check_lora(meta, parts["parts"])
        same_data = same_shards(meta, self.data_shards)

        # Small files first, each rank its own; all ranks agree before any collective load.
        local, problem = None, None
        try:
            local = self._read_local_state(path, meta, same_data, parts.get("loader"), list(parts["parts"]))
        except Exception as e:
            problem = f"{type(e).__name__}: {e}"
        ok, problem = _all_ok(problem is None, problem)
        if not ok:
            return problem

        states = {}
        try:
            for name, part in parts["parts"].items():
                states[name] = self._load_part(path, name, part, local["optim_keys"][name])
        except (Exception, CheckpointException) as e:
            # DCP gathers every rank's read errors (as a CheckpointException, a BaseException),
            # so all ranks land here together.
            return f"{type(e).__name__}: {_first_line(e)}"
        for name, part in parts["parts"].items():
            self._apply_part(path, part, *states[name])
        self._apply_local_state(local, parts, same_data)
        return None

    def _verify_my_share_of_checksums(self, path: Path) -> tuple[bool, str | None]:
        """Check the CRC32 of this rank's share of the checkpoint's files (the ranks read them all
        between them, each a round-robin share of the files sorted by size)."""
        try:
            share = checksums.checksummed_files(path)[self.world.rank::self.world.size]
        except Exception as e:  # noqa: BLE001 - verify_checkpoint parsed this marker already
            return False, f"{type(e).__name__}: {e}"
        problem = checksums.verify_checksums(path, share)
        return problem is None, problem

    def _load_part(self, path: Path, name: str, part, optim_keys: set[str]) -> tuple:
        """Read one part's model, optimizer and EMA state from `path` (collective); nothing is
        applied to the part until every part has been read."""
        model_dir, optimizer_dir, ema_dir = layout.part_dirs(name)
        optimizers = _optimizers(part.optimizer)
        # The optimizer's state dict is built first: on a fresh optimizer that runs one zero-lr
        # step to create the state, which must not touch the weights loaded next.
        optim_state = _saved_entries_only(get_optimizer_state_dict(part.model, optimizers), optim_keys)
        model_state = _model_state(part)
        reader.load_dcp(model_state, path / model_dir)
        reader.load_dcp(optim_state, path / optimizer_dir)
        ema_state = None
        if part.ema is not None and (path / ema_dir).is_dir():
            ema_state = part.ema.state_dict()
            reader.load_dcp(ema_state, path / ema_dir)
        return model_state, optim_state, ema_state

    def _apply_part(self, path: Path, part, model_state: dict, optim_state: dict, ema_state) -> None:
        # A LoRA part's state holds its adapters only: the frozen base is not in it (nor loaded).
        set_model_state_dict(part.model, model_state, options=StateDictOptions(strict=part.lora is None))
        set_optimizer_state_dict(part.model, _optimizers(part.optimizer), optim_state)
        if ema_state is not None:
            part.ema.load_state_dict(ema_state)
        elif part.ema is not None:
            # An EMA turned on since the checkpoint was written starts from the loaded weights.
            self.log.warning("%s holds no EMA of %s: the EMA starts from the loaded weights", path.name,
                             part.name)
            part.ema.load_state_dict({n: p.detach() for n, p in part.model.named_parameters()
                                      if p.requires_grad})

    def _read_local_state(self, path: Path, meta: dict, same_data: bool, loader, part_names) -> dict:
        state = torch.load(path / layout.TRAINING_STATE, map_location="cpu", weights_only=True)
        optim_keys = {name: set(layout.dcp_metadata(path / layout.part_dirs(name)[1]).state_dict_metadata)
                      for name in part_names}
        local = {"state": state, "cursor": None, "optim_keys": optim_keys, "meta": meta}
        if not _has_cursor(loader):
            return local
        if same_data:  # each shard its own cursor (written by whichever rank served it)
            local["cursor"] = {s: layout.read_json(path / layout.DATALOADER / f"{s}.json")
                               for s in loader_shards(loader, self.dp_rank)}
        elif self.elastic_data:  # every old shard's cursor: the loader deals the rest
            local["cursors"] = [layout.read_json(path / layout.DATALOADER / f"{r}.json")
                                for r in range(meta.get("data_shards", meta["dp_size"]))]
        else:
            # After a dp change with restart_data_on_dp_change, hand the loader any cursor: it sees
            # the other size and restarts its streams (resume_video_csv is handled there too).
            first = layout.read_json(path / layout.DATALOADER / "0.json")
            local["cursor"] = {s: first for s in loader_shards(loader, self.dp_rank)}
        return local

    def _rng_source(self, state: dict) -> int | None:
        """Which saved rank's RNG state this rank continues (None: the dp layout changed)."""
        if state["world_size"] == self.world.size and state["cp_size"] == self.dims.cp:
            return self.world.rank
        if state["world_size"] // state["cp_size"] == self.dims.dp:
            # Same data-parallel ranks, other cp size: continue cp rank 0 of the same dp group,
            # the rank that drew the group's noise and timesteps.
            return self.dp_rank * state["cp_size"]
        return None

    def _apply_local_state(self, local: dict, parts: dict, same_data: bool) -> None:
        state = local["state"]
        schedulers = state.get("schedulers") or {layout.TRANSFORMER: state["scheduler"]}
        for name, part in parts["parts"].items():
            part.scheduler.load_state_dict(schedulers[name])
        parts["train_state"].load_state_dict(state["train_state"])
        source = self._rng_source(state)
        if source is None:
            self.log.warning("data-parallel size changed: the processes' global RNG streams start from the seed")
        else:
            restore_rng_state(state["rng"][source], parts.get("task"))
        if local["cursor"] is not None:
            load_loader_cursors(parts["loader"], local["cursor"])
        if local.get("cursors"):
            parts["loader"].load_elastic_state(local["cursors"])
        if local["meta"]["dp_size"] != self.dims.dp or not same_data:
            self._log_global_batch(local["meta"], same_data)

    def _log_global_batch(self, meta: dict, same_data: bool) -> None:
        """Say how a new data-parallel size changes the micro-batches of one step, and the key that
        keeps it (the LR schedule continues by step either way)."""
        old = meta["dp_size"] * meta.get("gradient_accumulation_steps", 1)
        new = self.dims.dp * self.accumulation
        if same_data:
            self.log.info("data-parallel size %d -> %d: each of the %d data shards continues exactly (a step "
                          "trains the micro-batches the old layout would have)", meta["dp_size"], self.dims.dp,
                          self.data_shards)
            return
        if old == new:
            self.log.info("data-parallel size %d -> %d: the global batch is kept (%d micro-batches a step)",
                          meta["dp_size"], self.dims.dp, new)
            return
        keep = (f"set gradient_accumulation_steps: {old // self.dims.dp} to keep it"
                if old % self.dims.dp == 0 else "no whole gradient_accumulation_steps keeps it")
        self.log.warning("data-parallel size %d -> %d: a step now trains %d micro-batches instead of %d "
                         "(the global batch changes by x%.3g); %s", meta["dp_size"], self.dims.dp, new, old,
                         new / old, keep)

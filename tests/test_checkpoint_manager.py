"""Checkpointer on one process: exact round trip, atomic saves, fallback from unreadable checkpoints,
retention, inspect. (Several ranks, FSDP and resharding: test_checkpoint_dist.py.)"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from pan.checkpoint import durable, layout
from pan.checkpoint.consolidate import format_inspection, inspect_run, main_inspect
from pan.checkpoint.manager import CheckpointConfig, Checkpointer, UnreadableRunError
from pan.optim.builder import build_optimizer
from pan.optim.config import OptimConfig
from pan.optim.ema import EMA
from pan.optim.schedule import LRSchedulers
from pan.parallel.dims import ParallelConfig, ParallelDims
from pan.parallel.world import World
from pan.task import Part
from pan.trainer import TrainState

# --------------------------------------------------------------------------------------------------
# A small stand-in of everything a trainer hands the checkpointer (shared with the other test files)
# --------------------------------------------------------------------------------------------------


class Toy(nn.Module):
    """Blocks of matrices (Muon), a norm and biases (AdamW): both optimizers get state."""

    def __init__(self, width: int = 16, depth: int = 2):
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width, bias=False))
                                    for _ in range(depth))
        self.out = nn.Linear(width, 4)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)

    def muon_param_names(self) -> set[str]:
        return {n for n, p in self.named_parameters() if n.startswith("blocks") and p.ndim == 2}


class ToyTask:
    """Draws each step's inputs from its own generator, like the Pan task's noise and timesteps."""

    def __init__(self, seed: int):
        self.generator = torch.Generator().manual_seed(seed)

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])


class ToyLoader:
    """A JSON cursor per data-parallel rank, as the packed loader keeps."""

    def __init__(self, dp_rank: int = 0, dp_size: int = 1):
        self.dp_rank, self.dp_size, self.position = dp_rank, dp_size, 0

    def __next__(self) -> str:
        self.position += 1
        return f"{self.dp_rank}/{self.position}"

    def state_dict(self) -> dict:
        return {"dp_rank": self.dp_rank, "dp_size": self.dp_size, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        assert state["dp_rank"] == self.dp_rank and state["dp_size"] == self.dp_size
        self.position = state["position"]


OPTIM = OptimConfig(learning_rate=1e-2, weight_decay=0.1, warmup_steps=2, lr_scheduler_type="cosine",
                    ema_decay=0.9)


def make_parts(seed: int, shard=None, loader=None, ema: bool = True, width: int = 16) -> dict:
    """A fresh run's parts; `seed` changes the init, so only a real resume makes two runs agree."""
    torch.manual_seed(seed)
    model = Toy(width)
    if shard is not None:
        shard(model)
    optimizer, _ = build_optimizer(model, OPTIM)
    return with_part({"model": model, "optimizer": optimizer, "scheduler": LRSchedulers(optimizer, OPTIM, 20),
                      "loader": loader if loader is not None else ToyLoader(), "train_state": TrainState(),
                      "task": ToyTask(seed), "ema": EMA(model, OPTIM.ema_decay) if ema else None})


def with_part(flat: dict) -> dict:
    """The checkpointer's view of a one-part run (`parts`), beside the flat names the tests use."""
    part = Part("transformer", flat["model"], flat["optimizer"], flat["scheduler"], flat.get("ema"))
    return {**flat, "parts": {"transformer": part}}


def train(parts: dict, steps: int) -> None:
    model = parts["model"]
    for _ in range(steps):
        x = torch.randn(6, 8, generator=parts["task"].generator)
        noise = torch.randn(6, 4)  # the global CPU generator, restored from the checkpoint too
        (model(x) - noise).square().mean().backward()
        parts["optimizer"].step()
        parts["optimizer"].zero_grad(set_to_none=True)
        parts["scheduler"].step()
        if parts["ema"] is not None:
            parts["ema"].update()
        if parts["loader"] is not None:
            batch = next(parts["loader"])
            parts.setdefault("consumed", []).append(
                [x.sample_id for x in batch.samples] if hasattr(batch, "samples") else batch)
        parts["train_state"].step += 1


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def snapshot(parts: dict) -> dict:
    """Everything that must be equal after a resume, as plain tensors and numbers."""
    model = parts["model"]
    out = {"weights": {n: full(p.detach()).clone() for n, p in model.named_parameters()},
           "lr": parts["scheduler"].get_last_lr()[0], "train_state": parts["train_state"].state_dict(),
           "optim": {name: {i: {k: full(v).clone() if torch.is_tensor(v) else v for k, v in s.items()}
                            for i, s in enumerate(opt.state.values())}
                     for name, opt in parts["optimizer"].by_name.items()}}
    if parts["ema"] is not None:
        out["ema"] = {n: full(t).clone() for n, t in parts["ema"].state_dict().items()}
    if parts["loader"] is not None:
        out["cursor"] = parts["loader"].state_dict()
    return out


def assert_same(a, b, path="") -> None:
    """Bit-identical nested snapshots."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_same(a[k], b[k], f"{path}/{k}")
    elif torch.is_tensor(a):
        assert torch.equal(a, b), path
    else:
        assert a == b, path


def single_process(output_dir: Path, limit: int | None = None, **kw) -> Checkpointer:
    world = World.planned()
    dims = ParallelDims.from_config(ParallelConfig(), world_size=1, local_world_size=1)
    return Checkpointer(CheckpointConfig(output_dir=str(output_dir), save_total_limit=limit), world, dims, **kw)


@pytest.fixture
def pan_log(caplog):
    """pan's logger does not propagate: attach caplog's handler to it directly."""
    logger = logging.getLogger("pan")
    logger.addHandler(caplog.handler)
    yield caplog
    logger.removeHandler(caplog.handler)


@pytest.fixture(autouse=True)
def _quiet_dcp_warnings():
    import warnings
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


# --------------------------------------------------------------------------------------------------
# Round trip
# --------------------------------------------------------------------------------------------------

def test_resume_continues_bit_identically(tmp_path):
    ckpt = single_process(tmp_path)
    assert ckpt.latest_step() is None and ckpt.resume(make_parts(0)) is None  # fresh run

    run = make_parts(0)
    train(run, 3)
    path = ckpt.save(3, run)
    train(run, 4)
    straight = snapshot(run)

    resumed = make_parts(seed=1)  # another init and RNG: only the checkpoint can make it agree
    assert ckpt.latest_step() == 3
    assert ckpt.resume(resumed) == 3
    assert resumed["train_state"].step == 3 and resumed["loader"].position == 3
    train(resumed, 4)
    assert_same(straight, snapshot(resumed))

    meta = json.loads((path / layout.META).read_text())
    assert (meta["world_size"], meta["cp_size"], meta["dp_size"], meta["step"]) == (1, 1, 1, 3)
    names = {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()}
    assert {"transformer/.metadata", "optimizer/.metadata", "ema/.metadata", "dataloader/0.json",
            "training_state.pt", "meta.json", "COMPLETE.json"} <= names
    assert json.loads((path / layout.MARKER).read_text())["files"]["training_state.pt"] == \
        (path / "training_state.pt").stat().st_size


# --------------------------------------------------------------------------------------------------
# Atomicity: an interrupted save is never picked
# --------------------------------------------------------------------------------------------------


class Killed(BaseException):
    """Stands for SIGKILL: nothing after it runs (not even `except Exception` handlers)."""


@pytest.mark.parametrize("moment", ["transformer", "optimizer", "training_state", "marker", "rename"])
def test_a_save_interrupted_at_any_moment_is_never_picked(tmp_path, monkeypatch, moment):
    ckpt = single_process(tmp_path)
    run = make_parts(0)
    train(run, 2)
    ckpt.save(2, run)
    train(run, 2)

    import pan.checkpoint.manager as manager
    real_save, real_write, real_rename = manager.dcp.save, durable.write_bytes_durably, Path.rename

    def dcp_save(state, checkpoint_id, **kw):
        if checkpoint_id.endswith(moment):
            real_save({k: v for i, (k, v) in enumerate(state.items()) if i % 2}, checkpoint_id=checkpoint_id, **kw)
            raise Killed
        return real_save(state, checkpoint_id=checkpoint_id, **kw)

    def write_bytes(path, data):
        if (moment, path.name) in (("training_state", layout.TRAINING_STATE), ("marker", layout.MARKER)):
            path.write_bytes(data[:len(data) // 2])  # half-written
            raise Killed
        real_write(path, data)

    def rename(self, target):
        if moment == "rename" and self.name == "checkpoint-4.tmp":
            raise Killed
        return real_rename(self, target)

    monkeypatch.setattr(manager.dcp, "save", dcp_save)
    monkeypatch.setattr(durable, "write_bytes_durably", write_bytes)
    monkeypatch.setattr(Path, "rename", rename)
    with pytest.raises(Killed):
        ckpt.save(4, run)
    monkeypatch.undo()

    assert (tmp_path / "checkpoint-4.tmp").is_dir() and not (tmp_path / "checkpoint-4").exists()
    assert [i.complete for i in inspect_run(tmp_path)] == [True, False]
    resumed = make_parts(1)
    assert single_process(tmp_path).resume(resumed) == 2
    assert not (tmp_path / "checkpoint-4.tmp").exists()  # cleaned up by the resume


KILL_SCRIPT = """
import sys, warnings
import torch
from pan.checkpoint.manager import CheckpointConfig, Checkpointer
from pan.parallel.dims import ParallelConfig, ParallelDims
from pan.parallel.world import World
from pan.task import Part
from pan.trainer import TrainState
warnings.filterwarnings("ignore")
model = torch.nn.Linear(1024, 256)
optimizer = torch.optim.AdamW(model.parameters())
model(torch.ones(1, 1024)).sum().backward()
optimizer.step()
state = TrainState(step=int(sys.argv[2]))
parts = {"parts": {"transformer": Part("transformer", model, optimizer,
                                        torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0))},
         "train_state": state, "task": None, "loader": None}
world = World.planned()
dims = ParallelDims.from_config(ParallelConfig(), world_size=1, local_world_size=1)
ckpt = Checkpointer(CheckpointConfig(output_dir=sys.argv[1]), world, dims)
while True:
    state.step += 1
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(state.step)      # the weights say which step they belong to
    ckpt.save(state.step, parts)
    print(state.step, flush=True)
"""


def test_sigkill_during_saves_never_leaves_a_complete_looking_broken_checkpoint(tmp_path):
    """A real process writing checkpoints back to back, SIGKILLed at random moments."""
    rng = random.Random(0)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    last = 0
    for _ in range(3):
        proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(tmp_path), str(last)],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
        assert proc.stdout.readline().strip()  # running, and has saved once
        time.sleep(rng.uniform(0.0, 0.3))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        for info in inspect_run(tmp_path):
            assert info.problem is None or not info.complete, info
        model = torch.nn.Linear(1024, 256)
        optimizer = torch.optim.AdamW(model.parameters())
        state = TrainState()
        parts = with_part({"model": model, "optimizer": optimizer, "train_state": state, "task": None,
                           "loader": None, "scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)})
        step = single_process(tmp_path).resume(parts)
        assert step is not None and step > last and step == state.step
        assert all(torch.all(p == step) for p in model.parameters())
        assert not layout.partial_dirs(tmp_path)
        last = step


# --------------------------------------------------------------------------------------------------
# Unreadable checkpoints: fall back to the previous one
# --------------------------------------------------------------------------------------------------

def _truncate_shard(path: Path) -> str:
    shard = next((path / "transformer").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    return "truncated"


def _delete_metadata(path: Path) -> str:
    (path / "optimizer" / ".metadata").unlink()
    return "optimizer/.metadata is missing"


def _bad_cursor(path: Path) -> str:
    cursor = path / "dataloader" / "0.json"
    size = cursor.stat().st_size
    cursor.write_text("{" + "x" * (size - 1))  # same size: only parsing finds it
    return "JSONDecodeError"




@pytest.mark.parametrize("corrupt", [_truncate_shard, _delete_metadata, _bad_cursor])
def test_unreadable_latest_falls_back_to_the_previous_with_a_warning(tmp_path, pan_log, corrupt):
    ckpt = single_process(tmp_path)
    run = make_parts(0)
    train(run, 2)
    ckpt.save(2, run)
    at_two = snapshot(run)
    train(run, 2)
    ckpt.save(4, run)
    expected = corrupt(tmp_path / "checkpoint-4")

    resumed = make_parts(1)
    assert ckpt.resume(resumed) == 2
    assert_same(at_two, snapshot(resumed))
    assert [p.name for p, _ in ckpt.skipped] == ["checkpoint-4"]
    assert expected in ckpt.skipped[0][1]
    warnings = [r.getMessage() for r in pan_log.records if r.levelno == logging.WARNING]
    assert any("checkpoint-4" in w and expected in w for w in warnings), warnings

    # The run goes on and saves step 4 again: the unreadable folder is replaced.
    train(resumed, 2)
    ckpt.save(4, resumed)
    assert layout.verify_checkpoint(tmp_path / "checkpoint-4") is None
    assert single_process(tmp_path).resume(make_parts(2)) == 4


def test_a_folder_without_its_marker_is_not_a_checkpoint(tmp_path):
    ckpt = single_process(tmp_path)
    run = make_parts(0)
    for step in (1, 2):
        train(run, 1)
        ckpt.save(step, run)
    (tmp_path / "checkpoint-2" / layout.MARKER).unlink()
    assert ckpt.latest_step() == 1
    assert ckpt.resume(make_parts(1)) == 1


def test_when_every_checkpoint_is_unreadable_the_run_refuses_to_start_over(tmp_path):
    ckpt = single_process(tmp_path)
    run = make_parts(0)
    train(run, 1)
    ckpt.save(1, run)
    _truncate_shard(tmp_path / "checkpoint-1")
    with pytest.raises(UnreadableRunError, match="checkpoint-1: .*truncated"):
        ckpt.resume(make_parts(1))


# --------------------------------------------------------------------------------------------------
# Retention
# --------------------------------------------------------------------------------------------------

def test_save_total_limit_prunes_the_oldest_complete_checkpoints(tmp_path):
    ckpt = single_process(tmp_path, limit=2)
    run = make_parts(0, ema=False)
    (tmp_path / "checkpoint-0.tmp").mkdir()  # an interrupted save: not counted, not a checkpoint
    for step in range(1, 6):
        train(run, 1)
        ckpt.save(step, run)
        kept = [layout.step_of(p) for p in layout.complete_checkpoints(tmp_path)]
        assert kept == list(range(max(1, step - 1), step + 1))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-0.tmp", "checkpoint-4", "checkpoint-5"]

    one = single_process(tmp_path / "one", limit=1)  # the newest is never pruned, even at limit 1
    one.save(6, run)
    one.save(7, run)
    assert [p.name for p in (tmp_path / "one").iterdir()] == ["checkpoint-7"]


# --------------------------------------------------------------------------------------------------
# inspect
# --------------------------------------------------------------------------------------------------

def test_inspect_lists_steps_completeness_and_size(tmp_path, capsys):
    ckpt = single_process(tmp_path)
    run = make_parts(0, ema=False)
    for step in (5, 10):
        train(run, 1)
        ckpt.save(step, run)
    (tmp_path / "checkpoint-15.tmp").mkdir()
    _bad_cursor(tmp_path / "checkpoint-10")
    infos = inspect_run(tmp_path)
    assert [(i.path.name, i.step, i.complete) for i in infos] == [
        ("checkpoint-5", 5, True), ("checkpoint-10", 10, True), ("checkpoint-15.tmp", 15, False)]
    assert infos[0].problem is None and "JSONDecodeError" in infos[1].problem
    assert infos[0].size_bytes == layout.folder_size(tmp_path / "checkpoint-5") > 1000
    assert main_inspect([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "resume would start from: checkpoint-5" in out and out == format_inspection(infos) + "\n"
    assert main_inspect([str(tmp_path / "nope")]) == 2

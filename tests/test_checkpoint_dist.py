"""Checkpoints across real gloo process groups: FSDP2 save/resume, collective fallback, resharding
warm starts (2 ranks -> 1 and 1 -> 2), export of a sharded checkpoint, data-parallel size changes."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from dist_utils import run_distributed
from pan.checkpoint import layout
from pan.checkpoint.consolidate import export_checkpoint
from pan.export import main_export
from pan.checkpoint.manager import CheckpointConfig, Checkpointer
from pan.checkpoint.warm_start import load_checkpoint_weights, load_state_dict_weights
from pan.config.core import ConfigError
from pan.data import build_data_loader
from pan.parallel.dims import ParallelConfig, ParallelDims
from pan.parallel.world import init_world
from test_checkpoint_manager import (ToyLoader, Toy, assert_same, full, make_parts, single_process,
                                     snapshot, train)
from test_data_sources import clips_csv, small_config, tokens_of

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def fsdp(model) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def real_loader(csv: str, dp_rank: int, dp_size: int, **data_keys):
    return build_data_loader(small_config(video_csv_paths=[csv], **data_keys), tokens_of=tokens_of,
                             dp_rank=dp_rank, dp_size=dp_size, seed=0)


def weights(model) -> dict:
    return {n: full(t.detach()).clone() for n, t in model.state_dict().items()}


def _two_ranks(out: str, csv: str, one_rank_ckpt: str) -> dict:
    """Everything that needs two ranks, in one process group (starting one costs seconds)."""
    warnings.filterwarnings("ignore")
    world = init_world()
    dims = ParallelDims.from_config(ParallelConfig(), world.size, world.size)  # dp_shard 2
    run_dir = Path(out) / "fsdp"
    ckpt = Checkpointer(CheckpointConfig(output_dir=str(run_dir)), world, dims)
    result = {}

    # Save at step 3 from an FSDP2-sharded run, go on to 6; a fresh run resumed at 3 must agree.
    run = make_parts(0, shard=fsdp, loader=ToyLoader(world.rank, 2))
    train(run, 3)
    ckpt.save(3, run)
    result["at_3"] = weights(run["model"])
    train(run, 3)
    result["straight"] = {**snapshot(run), "consumed": run["consumed"][3:]}
    again = make_parts(1, shard=fsdp, loader=ToyLoader(world.rank, 2))
    result["resumed_step"] = ckpt.resume(again)
    train(again, 3)
    result["resumed"] = {**snapshot(again), "consumed": again["consumed"]}
    ckpt.save(6, again)

    # A read that fails on rank 1 alone (its own cursor): both ranks fall back together.
    real_read = layout.read_json
    if world.rank == 1:
        layout.read_json = lambda p: (_ for _ in ()).throw(OSError("flaky mount")) \
            if p.name == "1.json" and p.parent.parent.name == "checkpoint-6" else real_read(p)
    result["fallback_local"] = (ckpt.resume(make_parts(2, shard=fsdp, loader=ToyLoader(world.rank, 2))),
                                [why for _, why in ckpt.skipped])
    layout.read_json = real_read

    # Bit rot inside a shard (sizes unchanged, so only DCP's read notices): both ranks fall back.
    if world.is_main:
        shard = run_dir / "checkpoint-6" / "transformer" / "__1_0.distcp"
        data = bytearray(shard.read_bytes())
        data[:64] = b"\xff" * 64
        shard.write_bytes(bytes(data))
    dist.barrier()
    # DCP's own read-error fallback (the checksums would catch the corruption first).
    ckpt = Checkpointer(CheckpointConfig(output_dir=str(run_dir), verify_checksums=False), world, dims)
    result["fallback_dcp"] = (ckpt.resume(make_parts(3, shard=fsdp, loader=ToyLoader(world.rank, 2))),
                              [why for _, why in ckpt.skipped])

    # Warm start (b) from a checkpoint written by one process, into a 2-rank sharded model.
    torch.manual_seed(7)
    model = Toy()
    fsdp(model)
    report = load_checkpoint_weights(model, Path(one_rank_ckpt))
    result["warm_1_to_2"] = (weights(model), len(report.loaded))

    # A cp 2 layout (dp 1): only cp rank 0 has a data loader and writes a cursor.
    cp_dims = ParallelDims.from_config(ParallelConfig(cp_size=2), world.size, world.size)
    cp_run = make_parts(4, ema=False, loader=ToyLoader())
    if world.rank != 0:
        cp_run["loader"] = None
    train(cp_run, 2)
    Checkpointer(CheckpointConfig(output_dir=str(Path(out) / "cp")), world, cp_dims).save(2, cp_run)
    result["cp_next"] = torch.randn(3, generator=cp_run["task"].generator)

    # Real packed loaders, one batch in, for the data-parallel size change.
    data_run = make_parts(6, ema=False, shard=fsdp, loader=real_loader(csv, world.rank, 2))
    train(data_run, 1)
    Checkpointer(CheckpointConfig(output_dir=str(Path(out) / "data")), world, dims).save(1, data_run)
    result["data_weights"] = weights(data_run["model"])
    return result


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    csv = clips_csv(root / "clips.csv", seconds=3)
    one = single_process(root / "one")
    source = make_parts(5)
    train(source, 1)
    one.save(1, source)
    results = run_distributed(_two_ranks, world_size=2,
                              args=(str(root / "out"), str(csv), str(root / "one" / "checkpoint-1")))
    return {"root": root, "csv": csv, "results": results, "one_rank_weights": weights(source["model"])}


def test_fsdp_resume_continues_bit_identically_on_every_rank(two_rank_run):
    for r in two_rank_run["results"]:
        assert r["resumed_step"] == 3
        assert_same(r["straight"], r["resumed"])
    assert [r["resumed"]["consumed"] for r in two_rank_run["results"]] == [
        ["0/4", "0/5", "0/6"], ["1/4", "1/5", "1/6"]]  # each rank continues its own cursor


def test_ranks_agree_on_falling_back(two_rank_run):
    for r in two_rank_run["results"]:
        step, why = r["fallback_local"]  # rank 1 alone could not read its cursor
        assert step == 3 and why == ["rank 1: OSError: flaky mount"]
        step, why = r["fallback_dcp"]    # rank 1 alone read a corrupt shard
        assert step == 3 and len(why) == 1 and "CheckpointException ranks:dict_keys([1])" in why[0]


def test_warm_start_from_a_checkpoint_of_another_world_size(two_rank_run):
    # 1 -> 2: written by one process, loaded into a 2-rank FSDP model.
    for r in two_rank_run["results"]:
        loaded, count = r["warm_1_to_2"]
        assert_same(two_rank_run["one_rank_weights"], loaded)
        assert count == len(loaded)
    # 2 -> 1: written by two ranks, loaded into a plain model (its checkpoint-N/ or transformer/).
    ckpt3 = two_rank_run["root"] / "out" / "fsdp" / "checkpoint-3"
    torch.manual_seed(11)
    model = Toy()
    report = load_checkpoint_weights(model, ckpt3 / "transformer")
    assert_same(two_rank_run["results"][0]["at_3"], weights(model))
    assert not report.missing and not report.mismatched and not report.unexpected


def test_export_of_a_sharded_checkpoint_is_plain_safetensors_that_warm_start_reads(two_rank_run, tmp_path, capsys):
    ckpt3 = two_rank_run["root"] / "out" / "fsdp" / "checkpoint-3"
    at_3 = two_rank_run["results"][0]["at_3"]
    out = tmp_path / "model.safetensors"
    assert main_export([str(ckpt3), "--out", str(out)]) == 0
    assert f"{len(at_3)} tensors" in capsys.readouterr().out
    assert_same(at_3, load_file(str(out)))
    assert main_export([str(ckpt3), str(tmp_path / "positional.safetensors")]) == 0  # the short form
    assert_same(at_3, load_file(str(tmp_path / "positional.safetensors")))
    for twice_or_never in ([str(ckpt3)], [str(ckpt3), str(out), "--out", str(out)]):
        with pytest.raises(SystemExit) as exited:
            main_export(twice_or_never)
        assert exited.value.code == 2 and "--out model.safetensors" in capsys.readouterr().err
    torch.manual_seed(12)
    model = Toy()
    report = load_state_dict_weights(model, out)
    assert_same(at_3, weights(model))
    assert len(report.loaded) == len(at_3)

    ema = export_checkpoint(ckpt3, tmp_path / "ema.safetensors", ema=True, dtype=torch.bfloat16)
    assert ema.keys() == at_3.keys() and all(t.dtype == torch.bfloat16 for t in ema.values())
    assert not torch.equal(ema["out.weight"].float(), at_3["out.weight"].bfloat16().float())
    assert main_export([str(tmp_path / "missing"), str(tmp_path / "x.safetensors")]) == 2


def test_resume_with_another_data_parallel_size_is_refused_unless_data_restarts(two_rank_run, tmp_path):
    run_dir = tmp_path / "data"
    shutil.copytree(two_rank_run["root"] / "out" / "data" / "checkpoint-1", run_dir / "checkpoint-1")
    csv = str(two_rank_run["csv"])

    refusing = single_process(run_dir)
    with pytest.raises(ConfigError, match="2 data-parallel ranks.*restart_data_on_dp_change: true") as e:
        refusing.latest_step()
    assert e.value.key == "restart_data_on_dp_change"
    with pytest.raises(ConfigError):
        refusing.resume(make_parts(1, loader=real_loader(csv, 0, 1)))

    parts = make_parts(1, loader=real_loader(csv, 0, 1, restart_data_on_dp_change=True))
    assert single_process(run_dir, restart_data_on_dp_change=True).resume(parts) == 1
    assert_same(two_rank_run["results"][0]["data_weights"], weights(parts["model"]))
    assert_same(two_rank_run["results"][0]["data_weights"], parts["ema"].state_dict())  # saved without
    assert parts["train_state"].step == 1
    fresh = real_loader(csv, 0, 1)
    assert parts["loader"].state_dict() == fresh.state_dict()  # the streams restarted
    assert [s.sample_id for s in next(parts["loader"]).samples] == [s.sample_id for s in next(fresh).samples]


def test_a_cp_size_change_with_the_same_data_parallel_size_resumes(two_rank_run):
    """cp 2 x dp 1 -> one process (dp 1): cursors still fit; RNG continues cp rank 0's."""
    parts = make_parts(9, ema=False, loader=ToyLoader())
    assert single_process(two_rank_run["root"] / "out" / "cp").resume(parts) == 2
    assert parts["loader"].position == 2
    assert torch.equal(torch.randn(3, generator=parts["task"].generator), two_rank_run["results"][0]["cp_next"])

"""Warm start from plain state dicts (.pt, .safetensors, model_state.pt dir) and from a checkpoint of a
pan run; the report; source resolution and config errors; no warm start while resuming."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from pan.checkpoint.warm_start import (WarmStart, WarmStartConfig, load_state_dict_weights,
                                       plan_warm_start, resolve_source)
from pan.config.core import ConfigError
from test_checkpoint_manager import Toy, make_parts, single_process, train

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def plain_sources(tmp_path, state: dict) -> dict:
    """The same weights in every plain form the warm start accepts."""
    pt = tmp_path / "weights.pt"
    torch.save({f"_orig_mod.{k}": v for k, v in state.items()}, pt)  # as saved from a compiled model
    st = tmp_path / "weights.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(st))
    folder = tmp_path / "dir"
    folder.mkdir()
    torch.save(state, folder / "model_state.pt")
    return {"pt": pt, "safetensors": st, "dir": folder}


@pytest.mark.parametrize("form", ["pt", "safetensors", "dir"])
def test_plain_state_dict_loads_matching_tensors_and_reports_the_rest(tmp_path, form):
    torch.manual_seed(0)
    source = Toy().state_dict()
    source["out.weight"] = torch.randn(5, 16)        # another shape: left at init, reported
    del source["embed.bias"]                          # missing: left at init, reported
    source["extra.weight"] = torch.ones(2)            # unused, reported
    path = plain_sources(tmp_path, source)[form]

    kind, file = resolve_source(str(path))
    assert kind == "state_dict"
    torch.manual_seed(1)
    model = Toy()
    init = {k: v.clone() for k, v in model.state_dict().items()}
    warm = WarmStart(kind, file)
    warm.before_sharding(model)
    warm.after_sharding(model)  # a plain source does nothing after sharding

    report = warm.report
    assert report.mismatched == [("out.weight", (5, 16), (4, 16))]
    assert report.missing == ["embed.bias"] and report.unexpected == ["extra.weight"]
    for name, value in model.state_dict().items():
        expected = source[name] if name in report.loaded else init[name]
        assert torch.equal(value, expected), name
    assert len(report.loaded) == len(init) - 2
    assert "1 shape-mismatched, 1 missing" in report.summary()


def test_a_pan_checkpoint_is_read_through_dcp_after_sharding(tmp_path):
    run = make_parts(0)
    train(run, 2)
    single_process(tmp_path / "pretrain").save(2, run)
    for path in (tmp_path / "pretrain" / "checkpoint-2", tmp_path / "pretrain" / "checkpoint-2" / "transformer"):
        kind, source = resolve_source(str(path))
        assert kind == "checkpoint" and source == path
        torch.manual_seed(3)
        model = Toy()
        warm = WarmStart(kind, source)
        warm.before_sharding(model)
        assert warm.report is None  # a checkpoint is read only after FSDP wrapping
        warm.after_sharding(model)
        for name, value in run["model"].state_dict().items():
            assert torch.equal(model.state_dict()[name], value), name


def test_each_part_reads_its_own_folder_and_a_missing_part_keeps_its_init(tmp_path):
    run = make_parts(0)
    train(run, 2)
    single_process(tmp_path / "pretrain").save(2, run)
    ckpt = tmp_path / "pretrain" / "checkpoint-2"
    warm = WarmStart(*resolve_source(str(ckpt)))
    torch.manual_seed(3)
    other = Toy()
    init = {k: v.clone() for k, v in other.state_dict().items()}
    warm.after_sharding(other, "discriminator")   # the checkpoint holds no such part
    assert warm.report is None
    assert all(torch.equal(v, init[k]) for k, v in other.state_dict().items())


def test_warm_start_applies_only_while_the_run_has_no_checkpoint(tmp_path):
    torch.save(Toy().state_dict(), tmp_path / "w.pt")
    cfg = WarmStartConfig(pretrained_transformer_path=str(tmp_path / "w.pt"), load_transformer_weights=True)
    assert plan_warm_start(cfg.source, resume_step=None) == WarmStart("state_dict", tmp_path / "w.pt")
    assert plan_warm_start(cfg.source, resume_step=200) is None
    assert WarmStartConfig().source is None and plan_warm_start(None, resume_step=None) is None
    # the path alone, without load_transformer_weights, is no source (the config check refuses it)
    assert WarmStartConfig(pretrained_transformer_path=str(tmp_path / "w.pt")).source is None


def test_unusable_sources_are_rejected_when_the_config_loads(tmp_path):
    cfg = WarmStartConfig(pretrained_transformer_path=str(tmp_path / "nope.pt"), load_transformer_weights=True)
    with pytest.raises(ConfigError, match="does not exist") as e:
        cfg.check(job=None)
    assert e.value.key == "pretrained_transformer_path"
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="neither kind"):
        resolve_source(str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="load_transformer_weights is false"):
        WarmStartConfig(pretrained_transformer_path=str(tmp_path), load_transformer_weights=False).check(None)

    nested = tmp_path / "nested.pt"
    torch.save({"model": Toy().state_dict(), "step": 3}, nested)
    with pytest.raises(ValueError, match="not a flat state dict"):
        load_state_dict_weights(Toy(), nested)

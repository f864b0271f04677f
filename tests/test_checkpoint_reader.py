"""DirectReader: DCP items read straight into their destination tensors, or copied when they can't be."""

import torch
import torch.distributed.checkpoint as dcp
import pytest

from pan.checkpoint import reader


def _saved(tmp_path):
    g = torch.Generator().manual_seed(0)
    state = {
        "big": torch.randn(256, 256, generator=g),                      # direct read
        "transposed": torch.randn(128, 256, generator=g).t(),           # stored non-contiguous: copied
        "bf16": torch.randn(200, 200, generator=g).to(torch.bfloat16),  # direct read, 2-byte dtype
        "ids": torch.arange(20_000),                                    # direct read, int64
        "small": torch.randn(3, generator=g),                           # too small for the edges: copied
        "scalar": torch.tensor(7.0),
        "step": 12,                                                     # a bytes item
    }
    dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    return state


def _empty_like(state):
    return {k: torch.zeros_like(v).contiguous() if isinstance(v, torch.Tensor) else 0 for k, v in state.items()}


def test_every_kind_of_item_comes_back_exactly(tmp_path, monkeypatch):
    state = _saved(tmp_path)
    direct = []
    real = reader._read_into

    def spy(f, info, item, target):
        took = real(f, info, item, target)
        if took:
            direct.append(item.storage_index.fqn)
        return took

    monkeypatch.setattr(reader, "_read_into", spy)
    loaded = _empty_like(state)
    reader.load_dcp(loaded, tmp_path)
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(loaded[key], value), key
        else:
            assert loaded[key] == value
    assert sorted(direct) == ["bf16", "big", "ids"]


def test_a_destination_that_is_not_contiguous_is_filled_by_copy(tmp_path):
    state = _saved(tmp_path)
    loaded = _empty_like(state)
    loaded["big"] = torch.zeros(256, 256).t()  # a transposed destination
    reader.load_dcp(loaded, tmp_path)
    assert torch.equal(loaded["big"], state["big"])


def test_a_truncated_shard_raises_instead_of_loading_garbage(tmp_path):
    state = _saved(tmp_path)
    shard = next(tmp_path.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(BaseException, match="ends"):  # DCP wraps it in a CheckpointException
        reader.load_dcp(_empty_like(state), tmp_path)

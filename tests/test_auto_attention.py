"""`attention_backend: auto` chooses by measurement: what it records, how it times, and what the
trainer does with the choice (rank 0's on every rank, kept in the checkpoint, logged)."""

from __future__ import annotations

import dataclasses
import logging
import shutil
import sys
from pathlib import Path

import pytest
import torch
import yaml

from dist_utils import run_distributed
from pan.data.synth import synth_dataset
from pan.models.attention import (AttentionCall, InnerAttention, auto_candidates, fastest, measure_backends,
                                  set_attention_backend)
from pan.models.packing import AttnSegments
from pyramid_tiny import final_weights, load, released_fixture  # noqa: F401

# the module (pan.models re-exports its `attention` function under the module's name)
attention_module = sys.modules["pan.models.attention"]


def block_causal_segments(lengths=(12, 20, 12), frames_per_segment=4) -> AttnSegments:
    """Segments under the block-causal rule: each split into `frames_per_segment` equal frames."""
    frames = tuple(torch.arange(n) * frames_per_segment // n for n in lengths)
    return dataclasses.replace(AttnSegments.from_lengths(list(lengths)), frames=frames)


def call_of(segments: AttnSegments, heads: int = 2, head_dim: int = 8) -> AttentionCall:
    rows = segments.total
    return AttentionCall(torch.Size([rows, heads, head_dim]), torch.Size([rows, heads, head_dim]),
                         torch.float32, torch.device("cpu"), segments)


def test_an_auto_module_records_its_first_training_call_only():
    module, segments = InnerAttention(), block_causal_segments()
    q = torch.randn(segments.total, 2, 8)
    with torch.no_grad():
        module(q, q, q, segments)
    assert module.first_call is None                 # sampling and validation do not decide
    module(q.requires_grad_(), q, q, segments)
    first = module.first_call
    assert (first.q_shape, first.kv_shape, first.dtype, first.segments) == (q.shape, q.shape, q.dtype, segments)
    other = block_causal_segments((8, 8))
    module(q[:16], q[:16], q[:16], other)
    assert module.first_call is first                # the first pack's call is the one timed
    set_attention_backend(module, "auto")
    assert module.first_call is None
    set_attention_backend(module, "sdpa")
    module(q, q, q, segments)
    assert module.first_call is None                 # a chosen backend records nothing


def test_each_distinct_call_is_timed_once_and_counted_as_often_as_it_occurs(monkeypatch):
    """Per call: the median of the timed runs after one warm-up; a refusing backend gets its reason
    and is never chosen."""
    a, b = call_of(block_causal_segments()), call_of(block_causal_segments((8, 8)))
    clock = {("sdpa", a.key): iter([9.0, 1.0, 3.0, 2.0]), ("blockwise", a.key): iter([9.0, 1.5, 1.5, 1.5]),
             ("sdpa", b.key): iter([9.0, 4.0, 4.0, 5.0]), ("blockwise", b.key): iter([9.0, 1.0, 1.0, 1.0])}
    timed = []

    def seconds(backend, call, q, k, v, grad):
        timed.append((backend, call.key))
        return next(clock[backend, call.key])

    monkeypatch.setattr(attention_module, "_forward_backward_seconds", seconds)
    times = measure_backends([a, a, a, b], repeats=3)
    assert times == {"sdpa": 3 * 2.0 + 4.0, "blockwise": 3 * 1.5 + 1.0}
    assert len(timed) == 2 * 2 * 4                   # 2 distinct calls x 2 backends x (warm-up + 3)
    assert fastest(times) == "blockwise"

    def refuse(backend, call, q, k, v, grad):
        if backend == "blockwise":
            raise ValueError("cannot run these inputs")
        return 1.0

    monkeypatch.setattr(attention_module, "_forward_backward_seconds", refuse)
    times = measure_backends([a])
    assert times == {"sdpa": 1.0, "blockwise": "ValueError: cannot run these inputs"}
    assert fastest(times) == "sdpa"
    with pytest.raises(RuntimeError, match="no attention backend ran"):
        fastest({"sdpa": "RuntimeError: out of memory"})


def test_a_real_measurement_times_every_exact_candidate_without_touching_the_training_streams():
    rng = torch.get_rng_state()
    times = measure_backends([call_of(block_causal_segments())] * 2, repeats=2)
    assert set(times) == {"sdpa", "blockwise"}       # varlen: CUDA with fp16/bf16 only; flex: never
    assert all(isinstance(t, float) and t > 0 for t in times.values()), times
    assert torch.equal(torch.get_rng_state(), rng)
    # On full segments blockwise makes sdpa's own calls: only sdpa is timed, so noise decides nothing
    assert set(measure_backends([call_of(AttnSegments.from_lengths([12, 20]))], repeats=1)) == {"sdpa"}
    assert auto_candidates(torch.device("cuda"), torch.bfloat16, causal=False) == ["sdpa", "varlen"]


# ------------------------------------------------------------------------------------------------
# In the trainer: two ranks, a resume
# ------------------------------------------------------------------------------------------------

STEPS = 4


def ar_config(path: Path, model_path: Path, videos: Path, output_dir: Path, max_steps: int) -> Path:
    """The tiny AR run of tests/test_pyramid_flow_ar.py (block-causal packs: `auto`'s rule would
    take blockwise), left on `auto`."""
    cfg = {"recipe": "pyramid_flow_ar",
           "model": {"model_name": "pyramid_flux", "model_path": str(model_path), "vae_type": "identity",
                     "attention_backend": "auto"},
           "autoregressive": {"frame_per_unit": 1, "video_sync_group": 2},
           "training": {"learning_rate": 3e-3, "max_steps": max_steps, "dtype": "fp32", "use_muon": False},
           "data": {"video_csv_paths": [str(videos)], "resolution_buckets": ["16x16"], "min_frames": 1,
                    "max_frames": 4, "frames_mod": 1, "frames_remainder": 0, "max_tokens_per_batch": 1000,
                    "max_samples_per_batch": 4, "packed_dataloader_num_workers": 0},
           "output": {"output_dir": str(output_dir), "save_interval": 2, "log_interval": 1, "progress_bar": False}}
    path.write_text(yaml.safe_dump(cfg))
    return path


def fit_with_measurements(config: Path, faster: str) -> dict:
    """Train `config` where every rank's measurement (if it made one) would find `faster` faster:
    rank 1 measures the other way round, so ranks deciding alone would disagree. Returns what this
    rank measured, the backends its modules ended on, and rank 0's log lines about it."""
    import torch.distributed as dist

    import pan.parallel.auto_attention
    import pan.trainer
    from pan.logging import get_logger
    from pan.models.attention import InnerAttention

    rank = dist.get_rank()
    slower = {"sdpa": "blockwise", "blockwise": "sdpa"}[faster]
    mine = faster if rank == 0 else slower
    measured = []

    def measure(calls):
        measured.append(len(calls))
        return {mine: 1e-3, {"sdpa": "blockwise", "blockwise": "sdpa"}[mine]: 2e-3}

    pan.parallel.auto_attention.measure_backends = measure
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    get_logger().addHandler(handler)
    try:
        trainer = pan.trainer.build_trainer(load(config))
        trainer.fit()
    finally:
        get_logger().removeHandler(handler)
    backends = {m.backend for m in trainer.model.modules() if isinstance(m, InnerAttention)}
    trainer.close()
    return {"measured": measured, "backends": backends,
            "log": [r.getMessage() for r in records if "attention_backend auto" in r.getMessage()]}


def straight_then_resumed(root: str, model_path: str, videos: str) -> dict:
    """A spawned rank's work: a straight run, then a run resumed from its checkpoint-2 whose
    measurement (were one made) would choose the other backend."""
    import torch.distributed as dist

    root_dir = Path(root)
    straight, resumed = root_dir / "straight", root_dir / "resumed"
    config = ar_config(root_dir / f"straight{dist.get_rank()}.yaml", Path(model_path), Path(videos), straight, STEPS)
    out = {"straight": fit_with_measurements(config, faster="sdpa")}
    if dist.get_rank() == 0:
        shutil.copytree(straight / "checkpoint-2", resumed / "checkpoint-2")
    dist.barrier()
    config = ar_config(root_dir / f"resumed{dist.get_rank()}.yaml", Path(model_path), Path(videos), resumed, STEPS)
    out["resumed"] = fit_with_measurements(config, faster="blockwise")
    return out


def test_every_rank_takes_rank_0s_choice_and_a_resumed_run_keeps_it_to_the_bit(tmp_path, released):
    videos = synth_dataset(tmp_path / "data", num_train=8, num_heldout=1, size=16, num_frames=4)["train_csv"]
    ranks = run_distributed(straight_then_resumed, world_size=2, args=(str(tmp_path), str(released), str(videos)))

    # Rank 0 alone measured, once, on its 2 blocks' attention calls; both ranks took its choice (not
    # the rule's blockwise), though rank 1 would have chosen the other.
    assert [r["straight"]["measured"] for r in ranks] == [[2], []]
    assert [r["straight"]["backends"] for r in ranks] == [{"sdpa"}, {"sdpa"}]
    assert ranks[0]["straight"]["log"] == [
        "attention_backend auto of transformer: sdpa (the fastest on rank 0's first pack, forward and "
        "backward of its 2 attention calls: sdpa 1.00 ms, blockwise 2.00 ms)"]
    # The resumed run measured nothing (its measurement would have chosen blockwise): it took the
    # checkpoint's choice before its first step, and so trained the straight run's bits.
    assert [r["resumed"]["measured"] for r in ranks] == [[], []]
    assert [r["resumed"]["backends"] for r in ranks] == [{"sdpa"}, {"sdpa"}]
    assert ranks[0]["resumed"]["log"] == ["attention_backend auto of transformer: sdpa (kept from the checkpoint)"]
    reference, continued = final_weights(tmp_path / "straight", STEPS), final_weights(tmp_path / "resumed", STEPS)
    for folder in reference:
        for key, value in reference[folder].items():
            assert torch.equal(value, continued[folder][key]), (folder, key)

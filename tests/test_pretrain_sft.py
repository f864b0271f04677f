"""Pretrain -> SFT through the real trainer: a warm start from the pretrain run's checkpoint (or an
exported state dict) gives SFT the pretrained weights with a fresh optimizer, schedule, step and data
cursor, and a restarted SFT job resumes itself instead of warm-starting again."""

from pathlib import Path

import pytest
import torch

from pan.checkpoint.consolidate import export_checkpoint
from pan.config import load_job_config
from pan.data.synth import synth_dataset
from pan.trainer import build_trainer

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return synth_dataset(tmp_path_factory.mktemp("data"), num_train=8, num_heldout=1, size=32,
                         num_frames=5)["train_csv"]


def job(data, out: Path, *extra):
    return load_job_config(["--config", str(REPO / "config/tiny_cpu.yaml"), "--output_dir", str(out),
                            "--video_csv_paths", str(data), "--save_interval", "3", *extra],
                           warn=lambda m: None)


def weights(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


@pytest.fixture(scope="module")
def pretrain(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("pretrain")
    trainer = build_trainer(job(data, out, "--max_steps", "3"))
    trainer.fit()
    return out, weights(trainer)


@pytest.mark.parametrize("source", ["checkpoint", "transformer_dcp", "safetensors"])
def test_sft_warm_starts_from_the_pretrain_run(data, pretrain, tmp_path, source):
    pre_dir, pre_weights = pretrain
    path = {"checkpoint": pre_dir / "checkpoint-3", "transformer_dcp": pre_dir / "checkpoint-3/transformer",
            "safetensors": tmp_path / "model.safetensors"}[source]
    if source == "safetensors":
        export_checkpoint(pre_dir / "checkpoint-3", path)
    sft = job(data, tmp_path / "sft", "--max_steps", "4", "--warmup_steps", "2",
              "--pretrained_transformer_path", str(path), "--load_transformer_weights", "true")
    trainer = build_trainer(sft)
    start = weights(trainer)
    assert all(torch.equal(start[k], pre_weights[k]) for k in pre_weights)  # the pretrained weights
    assert trainer.state.step == 0                                          # a fresh run ...
    assert trainer.scheduler.get_last_lr()[0] < sft.optim.learning_rate     # ... in its own warmup
    assert all(torch.count_nonzero(t) == 0 for opt in trainer.optimizer.optimizers
               for st in opt.state.values() for name, t in st.items() if name != "step")
    assert trainer.loader.shard_states() == build_trainer(job(data, tmp_path / "fresh")).loader.shard_states()


def test_a_restarted_sft_job_resumes_itself(data, pretrain, tmp_path):
    pre_dir, pre_weights = pretrain
    args = ("--pretrained_transformer_path", str(pre_dir / "checkpoint-3"),
            "--load_transformer_weights", "true", "--warmup_steps", "1")
    first = build_trainer(job(data, tmp_path / "sft", "--max_steps", "3", *args))
    first.fit()
    trained = weights(first)
    assert any(not torch.equal(trained[k], pre_weights[k]) for k in trained)
    again = build_trainer(job(data, tmp_path / "sft", "--max_steps", "5", *args))
    assert again.state.step == 3                                   # resumed its own checkpoint-3 ...
    now = weights(again)
    assert all(torch.equal(now[k], trained[k]) for k in trained)   # ... not the pretrain weights

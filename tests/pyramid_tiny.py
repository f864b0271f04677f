"""Tiny Pyramid-Flow model folders and runs for the recipe tests, laid out as `model_path` expects.

Fixtures (module-scoped; a test module imports the `*_fixture` functions of the ones it uses):
- `released`: a tiny miniFLUX for 3-channel latents (the identity VAE's pixels) under the 384p
  variant's name, beside pyramid_text_models' tiny T5 / CLIP encoders;
- `fixture_model_path`: the reference fixtures as a release: the original's miniFLUX
  (`flux_dit/diffusion_transformer_384p`: 64 input channels = 16 latent channels x a 2x2 patch)
  and causal VAE (`causal_vae/causal_video_vae`: 16 channels, 8x in time and space), with the same
  tiny text encoders, whose widths (captions 24, pooled 20) are the fixture DiT's;
- `vae_videos`: synthetic clips the fixture VAE takes: 64x64, 9 frames (latents 16 x 2 x 8 x 8).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from pyramid_reference import REFERENCE

VARIANT = "diffusion_transformer_384p"
ENCODER_FOLDERS = ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")
# The widths of pyramid_text_models' tiny encoders: captions 24, pooled 20.
TINY_FLUX = dict(in_channels=12, num_layers=1, num_single_layers=1, attention_head_dim=16,
                 num_attention_heads=2, joint_attention_dim=24, pooled_projection_dim=20,
                 axes_dims_rope=[4, 6, 6])
FIXTURE_DIT = REFERENCE / "flux_dit" / VARIANT
FIXTURE_VAE = REFERENCE / "causal_vae" / "causal_video_vae"
# `data` keys of runs on `vae_videos`: whole 9-frame clips, as the causal VAE takes them (1 + 8k).
VAE_CLIP_DATA = {"resolution_buckets": ["64x64"], "min_frames": 9, "max_frames": 9, "frames_mod": 8,
                 "frames_remainder": 1}


def save_tiny_flux(folder: Path, seed: int = 0, **changes) -> None:
    from pan.models.pyramid_flux import PyramidFluxConfig, PyramidFluxTransformer
    from pan.models.pyramid_io import save_pretrained

    torch.manual_seed(seed)
    save_pretrained(PyramidFluxTransformer(PyramidFluxConfig(**{**TINY_FLUX, **changes})), folder)


def write_released(root: Path, variants: tuple[str, ...] = (VARIANT,)) -> Path:
    """A model folder: the tiny DiT under each variant name, and the tiny text encoders."""
    from pyramid_text_models import write_pyramid_text_encoders

    for variant in variants:
        save_tiny_flux(root / variant)
    write_pyramid_text_encoders(root, "pyramid_flux")
    return root


@pytest.fixture(scope="module", name="released")
def released_fixture(tmp_path_factory) -> Path:
    return write_released(tmp_path_factory.mktemp("pyramid_model"))


@pytest.fixture(scope="module", name="fixture_model_path")
def fixture_model_path_fixture(tmp_path_factory, released) -> Path:
    root = tmp_path_factory.mktemp("fixture_model")
    (root / VARIANT).symlink_to(FIXTURE_DIT)
    (root / "causal_video_vae").symlink_to(FIXTURE_VAE)
    for folder in ENCODER_FOLDERS:
        (root / folder).symlink_to(released / folder)
    return root


@pytest.fixture(scope="module", name="vae_videos")
def vae_videos_fixture(tmp_path_factory) -> Path:
    from pan.data.synth import synth_dataset

    return synth_dataset(tmp_path_factory.mktemp("synth_vae"), num_train=12, num_heldout=1, size=64,
                         num_frames=9)["train_csv"]


def causal_vae_keys(model_path: Path) -> dict[str, str]:
    """`model` keys of the released VAE in a model folder, as the released YAMLs set them."""
    return {"vae_type": "causal_video_vae", "vae_path": str(model_path / "causal_video_vae")}


def load(path: Path, *extra):
    from pan.config import load_job_config

    return load_job_config(["--config", str(path), *map(str, extra)], warn=lambda m: None)


def final_weights(output_dir: Path, step: int) -> dict:
    """{transformer, optimizer} -> the consolidated tensors of a run's checkpoint."""
    from pan.checkpoint import layout
    from pan.checkpoint.consolidate import consolidated_weights

    ckpt = output_dir / layout.checkpoint_name(step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {folder: consolidated_weights(ckpt / folder) for folder in ("transformer", "optimizer")}


def batch_loss(trainer, micro_batches: list) -> float:
    """The recipe's loss of given micro-batches under the trainer's current weights."""
    task = trainer.task
    with torch.no_grad():
        total = sum(float(task.loss_sum(trainer.model, mb)) for mb in micro_batches)
    return total / sum(task.loss_count(mb) for mb in micro_batches)


def released_config(folder: Path) -> dict:
    """A DiT folder's config.json without diffusers' version stamp (the writer's, not the model's)."""
    config = json.loads((folder / "config.json").read_text())
    config.pop("_diffusers_version")
    return config

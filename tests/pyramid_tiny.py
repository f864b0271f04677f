"""Tiny Pyramid-Flow model folders and runs for the recipe tests, laid out as `model_path` expects.

Fixtures (module-scoped; a test module imports the `*_fixture` functions of the ones it uses):
- `released`: a tiny miniFLUX for 3-channel latents (the identity VAE's pixels) under the 384p
  variant's name, beside pyramid_text_models' tiny T5 / CLIP encoders;
- `fixture_model_path`: the reference fixtures as a release: the original's miniFLUX
  (`flux_dit/diffusion_transformer_384p`: 4 x the latent channels in, a 2x2 patch; the public set's
  64 = 16 x 4) and causal VAE (`causal_vae/causal_video_vae`: the public set's 16 channels, 8x in time
  and space), with tiny text encoders of the fixture DiT's widths (`joint_attention_dim`,
  `pooled_projection_dim` of its config.json: the public set's 24 and 20);
- `vae_videos`: synthetic clips the fixture VAE takes: 2 latent frames of 8 x 8 (the public set's VAE:
  64x64 px, 9 frames).
Every fixture size is read from the set (`PAN_PYRAMID_FIXTURES`, tests/pyramid_reference.py).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from pyramid_reference import REFERENCE, dit_config

VARIANT = "diffusion_transformer_384p"
ENCODER_FOLDERS = ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")
# The widths of pyramid_text_models' tiny encoders: captions 24, pooled 20.
TINY_FLUX = dict(in_channels=12, num_layers=1, num_single_layers=1, attention_head_dim=16,
                 num_attention_heads=2, joint_attention_dim=24, pooled_projection_dim=20,
                 axes_dims_rope=[4, 6, 6])
FIXTURE_DIT = REFERENCE / "flux_dit" / VARIANT
FIXTURE_VAE = REFERENCE / "causal_vae" / "causal_video_vae"


def fixture_vae_factors() -> tuple[int, int]:
    """(temporal, spatial) compression of the fixture VAE, from its config.json (8, 8 for the public
    set's; each down-sampling block halves), or (8, 8) where the fixtures are absent."""
    if not (FIXTURE_VAE / "config.json").is_file():
        return 8, 8
    config = json.loads((FIXTURE_VAE / "config.json").read_text())
    return (2 ** sum(map(bool, config["encoder_temporal_down_sample"])),
            2 ** sum(map(bool, config["encoder_spatial_down_sample"])))


# `vae_videos`: 2 latent frames (1 + tf pixel frames, as the causal VAE takes them) of 8 x 8 latents
# (the pyramid halves them twice, the DiT's 2 x 2 patch once more): 9 frames of 64 x 64 px for 8x / 8x.
VAE_TEMPORAL, VAE_SPATIAL = fixture_vae_factors()
VAE_FRAMES, VAE_SIZE = 1 + VAE_TEMPORAL, 8 * VAE_SPATIAL
# `data` keys of runs on `vae_videos`: whole clips of VAE_FRAMES frames (1 + tf k).
VAE_CLIP_DATA = {"resolution_buckets": [f"{VAE_SIZE}x{VAE_SIZE}"], "min_frames": VAE_FRAMES, "max_frames": VAE_FRAMES,
                 "frames_mod": VAE_TEMPORAL, "frames_remainder": 1}


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


def write_fixture_text_encoders(root: Path, model_name: str = "pyramid_flux") -> Path:
    """Tiny text encoders of `model_name` in `root`, of the widths of the fixture set's DiT of that
    kind (its config.json's `joint_attention_dim` and `pooled_projection_dim`)."""
    from pyramid_text_models import write_pyramid_text_encoders

    config = dit_config({"pyramid_flux": "flux_dit", "pyramid_mmdit": "mmdit_dit"}[model_name])
    return write_pyramid_text_encoders(root, model_name, pooled_width=config["pooled_projection_dim"],
                                       caption_width=config["joint_attention_dim"])


@pytest.fixture(scope="module", name="fixture_model_path")
def fixture_model_path_fixture(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fixture_model")
    (root / VARIANT).symlink_to(FIXTURE_DIT)
    (root / "causal_video_vae").symlink_to(FIXTURE_VAE)
    return write_fixture_text_encoders(root)


@pytest.fixture(scope="module", name="vae_videos")
def vae_videos_fixture(tmp_path_factory) -> Path:
    from pan.data.synth import synth_dataset

    return synth_dataset(tmp_path_factory.mktemp("synth_vae"), num_train=12, num_heldout=1, size=VAE_SIZE,
                         num_frames=VAE_FRAMES)["train_csv"]


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

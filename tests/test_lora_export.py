"""Export and sampling of LoRA runs (pan/lora/files.py): `pan export --merge` writes the base
with W + scale * B @ A exactly (fp32), also as a released Pyramid-Flow folder that pan's loader
reads; `pan export --format peft` loads with `peft.PeftModel.from_pretrained` onto the same model
class and gives pan's LoRA model's outputs; `pan sample` of a LoRA checkpoint (or `--lora` over its
base) samples what the merged export samples; a plain export of adapters alone is refused. The merged
Pyramid-Flow folder also loads with the ORIGINAL implementation's released-folder loader (in a
subprocess, tests/original_pyramid_dit.py, with the dependencies `make test` installs into the venv's
`original-deps`) to the same tensors, and the original's forward of it is pan's forward of the export.

Runs: a tiny Pan run (config/tiny_cpu.yaml, 2 steps) and a LoRA run warm-started from it (3 steps,
with an EMA of the adapters); a LoRA run of the reference fixture miniFLUX through the fixture
causal VAE (2 steps)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from pyramid_reference import ORIGINAL, REFERENCE, load_fixture, needs_reference, read_json
from pyramid_tiny import (  # noqa: F401
    FIXTURE_DIT,
    VAE_CLIP_DATA,
    VARIANT,
    causal_vae_keys,
    fixture_model_path_fixture,
    load,
    released_config,
    released_fixture,
    vae_videos_fixture,
)
from safetensors.torch import load_file
from test_pyramid_dit import CASES, Batch

from pan.checkpoint.consolidate import consolidated_weights
from pan.data.synth import synth_dataset
from pan.export import main_export
from pan.models.packing import PackInfo
from pan.sampling import resolve_weights
from pan.trainer import build_trainer

# pan's exported DiT against the original's code on the same weights, both fp32 (the tolerance the
# fixture DiT tests used before they measured their noise; not yet derived here).
TOL = dict(atol=1e-5, rtol=1e-4)

REPO = Path(__file__).resolve().parents[1]
LORA_KEYS = ("--lora_rank", "4", "--use_muon", "false")


def train(*argv) -> None:
    build_trainer(load(*argv)).fit()


@pytest.fixture(scope="module")
def pan_runs(tmp_path_factory) -> dict[str, Path]:
    """{full: checkpoint-2 of a full tiny run, lora: checkpoint-3 of a LoRA run on it (EMA 0.9)}."""
    root = tmp_path_factory.mktemp("lora_runs")
    videos = synth_dataset(root / "synth", num_train=8, num_heldout=1, size=32, num_frames=5)["train_csv"]
    common = ["--video_csv_paths", str(videos), "--log_interval", "1"]
    train(REPO / "config/tiny_cpu.yaml", "--output_dir", root / "full", "--max_steps", "2",
          "--save_interval", "2", *common)
    # A larger learning rate than the full run's and scale 16 / 4: the adapters move visibly in 3 steps.
    train(REPO / "config/tiny_cpu.yaml", "--output_dir", root / "lora", *LORA_KEYS, "--lora_alpha", "16",
          "--max_steps", "3", "--save_interval", "3", "--learning_rate", "2e-2", "--ema_decay", "0.9",
          "--pretrained_transformer_path", root / "full/checkpoint-2", "--load_transformer_weights", "true",
          *common)
    return {"full": root / "full/checkpoint-2", "lora": root / "lora/checkpoint-3"}


def reference_of(ckpt: Path) -> dict:
    return json.loads((ckpt / "meta.json").read_text())["lora"]["transformer"]


def expected_merge(base: dict, adapters: dict, scale: float) -> dict:
    """base + scale * B @ A in fp32 for every adapted weight, computed here from the tensors."""
    out = dict(base)
    for key, a in adapters.items():
        if ".lora_A.default.weight" in key:
            module = key.removesuffix(".lora_A.default.weight")
            b = adapters[f"{module}.lora_B.default.weight"]
            out[f"{module}.weight"] = base[f"{module}.weight"].float() + scale * (b.float() @ a.float())
    return out


def test_a_plain_export_of_adapters_is_refused(pan_runs, tmp_path, capsys):
    assert main_export([str(pan_runs["lora"]), "--out", str(tmp_path / "x.safetensors")]) == 2
    said = capsys.readouterr().err
    assert "LoRA" in said and "--merge" in said and "--format peft" in said
    assert main_export([str(pan_runs["lora"] / "transformer"), "--out", str(tmp_path / "x.safetensors")]) == 2
    assert main_export([str(pan_runs["full"]), "--merge", "--out", str(tmp_path / "y.safetensors")]) == 2
    assert main_export([str(pan_runs["full"]), "--format", "peft", "--out", str(tmp_path / "p")]) == 2
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("ema", [False, True], ids=["weights", "ema"])
def test_merge_is_the_base_plus_scale_times_b_a_exactly(pan_runs, tmp_path, ema):
    out = tmp_path / "merged.safetensors"
    assert main_export([str(pan_runs["lora"]), "--merge", "--out", str(out), *(["--ema"] if ema else [])]) == 0
    merged = load_file(str(out))
    base = consolidated_weights(pan_runs["full"] / "transformer")
    adapters = consolidated_weights(pan_runs["lora"] / ("ema" if ema else "transformer"))
    reference = reference_of(pan_runs["lora"])
    want = expected_merge(base, adapters, reference["alpha"] / reference["rank"])
    assert merged.keys() == base.keys()
    for key, value in want.items():
        assert value.dtype == torch.float32 and torch.equal(merged[key], value), key
    changed = [k for k in base if not torch.equal(merged[k], base[k])]
    assert changed and all(k.removesuffix(".weight") in reference["targets"] for k in changed)


def test_the_peft_export_loads_with_peft_and_gives_pan_s_outputs(pan_runs, tmp_path):
    from peft import PeftModel

    from pan.lora.runs import lora_model
    from pan.models.pan_dit import PanVideoDiffusionTransformer

    out = tmp_path / "peft"
    assert main_export([str(pan_runs["lora"]), "--format", "peft", "--out", str(out)]) == 0
    config = json.loads((out / "adapter_config.json").read_text())
    reference = reference_of(pan_runs["lora"])
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (
        reference["rank"], reference["alpha"], reference["dropout"])
    assert sorted(config["target_modules"]) == sorted(reference["targets"])
    assert config["base_model_name_or_path"] == reference["base_source"]

    pan_model, _ = lora_model(pan_runs["lora"])
    arch = pan_model.config
    base = PanVideoDiffusionTransformer(arch, zero_init_modulation=True)
    base.load_state_dict(consolidated_weights(pan_runs["full"] / "transformer"))
    plain = PanVideoDiffusionTransformer(arch, zero_init_modulation=True)
    plain.load_state_dict(base.state_dict())
    peft_model = PeftModel.from_pretrained(base, str(out))

    g = torch.Generator().manual_seed(0)
    grids, text_lens = [(2, 2, 2), (1, 2, 3)], [3, 4]
    x = torch.randn(sum(t * h * w for t, h, w in grids), arch.in_channels * arch.patch_volume, generator=g)
    text = torch.randn(sum(text_lens), arch.text_embed_dim, generator=g)
    sigmas = torch.rand(len(grids), generator=g)
    with torch.no_grad():
        ours = pan_model.eval()(x, sigmas, text, PackInfo.build(grids, text_lens))
        theirs = peft_model.eval()(x, sigmas, text, PackInfo.build(grids, text_lens))
        without = plain.eval()(x, sigmas, text, PackInfo.build(grids, text_lens))
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-6)  # fp32 noise of another op order
    effect = (ours - without).abs().max()                           # what the adapters change
    assert effect > 1e-4 and (theirs - ours).abs().max() < 1e-3 * effect


def video_frames(path: Path) -> np.ndarray:
    import av

    with av.open(str(path)) as f:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in f.decode(video=0)])


def test_pan_sample_of_a_lora_checkpoint_samples_the_merged_export(pan_runs, tmp_path):
    from pan.sampling import main as sample_main

    merged, adapters = tmp_path / "merged.safetensors", tmp_path / "peft"
    assert main_export([str(pan_runs["lora"]), "--merge", "--out", str(merged)]) == 0
    assert main_export([str(pan_runs["lora"]), "--format", "peft", "--out", str(adapters)]) == 0
    common = ["--prompt", "a red square moving left", "--steps", "2", "--seed", "3"]
    runs = {"checkpoint": ["--checkpoint", str(pan_runs["lora"])],
            "merged": ["--checkpoint", str(merged), "--config", str(pan_runs["lora"].parent / "config.yaml")],
            "peft over the base": ["--checkpoint", str(pan_runs["full"]), "--lora", str(adapters)],
            "run over the base": ["--checkpoint", str(pan_runs["full"]), "--lora", str(pan_runs["lora"])],
            "base": ["--checkpoint", str(pan_runs["full"])]}
    videos = {}
    for name, argv in runs.items():
        out = tmp_path / f"{name.replace(' ', '_')}.mp4"
        assert sample_main([*argv, *common, "--out", str(out)]) == 0, name
        videos[name] = video_frames(out)
    for name in ("merged", "peft over the base", "run over the base"):
        assert np.array_equal(videos[name], videos["checkpoint"]), name
    assert not np.array_equal(videos["base"], videos["checkpoint"])


def pyramid_flow_config(path: Path, model_path: Path, videos: Path, output_dir: Path, **sections) -> Path:
    """A 2-step fp32 Pyramid-Flow run's config of the release `model_path` through its causal VAE."""
    import yaml

    path.write_text(yaml.safe_dump({
        "recipe": "pyramid_flow",
        "model": {"model_name": "pyramid_flux", "model_path": str(model_path), **causal_vae_keys(model_path),
                  **sections.pop("model_extra", {})},
        "training": {"learning_rate": 1e-2, "max_steps": 2, "dtype": "fp32", "use_muon": False},
        "data": {"video_csv_paths": [str(videos)], "max_tokens_per_batch": 400,
                 "max_samples_per_batch": 2, "packed_dataloader_num_workers": 0, **VAE_CLIP_DATA},
        "output": {"output_dir": str(output_dir), "save_interval": 2, "log_interval": 1, "progress_bar": False},
        **sections}))
    return path


@pytest.fixture(scope="module")
def pyramid_lora_run(tmp_path_factory, fixture_model_path, vae_videos) -> Path:
    """checkpoint-2 of a LoRA run (rank 4, alpha 8) of the fixture miniFLUX through the fixture VAE."""
    root = tmp_path_factory.mktemp("pyramid_lora")
    train(pyramid_flow_config(root / "lora.yaml", fixture_model_path, vae_videos, root / "run",
                              lora={"lora_rank": 4, "lora_alpha": 8}))
    return root / "run" / "checkpoint-2"


def pyramid_expected_merge(ckpt: Path) -> dict:
    """The fixture miniFLUX plus the run's scaled adapters, in fp32 (computed here from the tensors)."""
    from pan.models.pyramid_io import read_weights

    reference = reference_of(ckpt)
    return expected_merge(read_weights(FIXTURE_DIT), consolidated_weights(ckpt / "transformer"),
                          reference["alpha"] / reference["rank"])


@needs_reference
def test_a_pyramid_flow_lora_run_merges_into_the_released_layout(tmp_path, pyramid_lora_run, fixture_model_path,
                                                                  vae_videos):
    from pan.models.pyramid_flux import PyramidFluxTransformer
    from pan.models.pyramid_io import load_pretrained, read_weights

    ckpt = pyramid_lora_run
    reference = reference_of(ckpt)
    assert reference["base_source"] == str(fixture_model_path / VARIANT)

    # A plain released-layout export of adapters alone is refused; --merge writes the whole DiT.
    out = tmp_path / "export" / VARIANT
    assert main_export([str(ckpt), "--format", "pyramid_flow", "--out", str(out)]) == 2
    assert main_export([str(ckpt), "--merge", "--format", "pyramid_flow", "--out", str(out)]) == 0
    assert released_config(out) == released_config(FIXTURE_DIT)
    exported = load_pretrained(out, PyramidFluxTransformer)
    assert exported.config.in_channels == read_json("flux_dit/model_info.json")["init_config"]["in_channels"]
    state, base = exported.state_dict(), read_weights(FIXTURE_DIT)
    want = pyramid_expected_merge(ckpt)
    assert state.keys() == base.keys()
    for key, value in want.items():
        assert torch.equal(state[key], value.float()), key
    changed = [k for k in base if not torch.equal(state[k], base[k].float())]
    assert changed and all(k.removesuffix(".weight") in reference["targets"] for k in changed)
    # `pan sample` of the checkpoint samples these weights (its samplers read them through this).
    sampled, _ = resolve_weights(ckpt, False)
    assert sampled.keys() == state.keys() and all(torch.equal(sampled[k], state[k]) for k in state)

    # The merged folder is a release again: a run's `model_path` loads it as its base.
    for link in fixture_model_path.iterdir():
        if link.name != VARIANT:
            (out.parent / link.name).symlink_to(link.resolve())
    config = pyramid_flow_config(tmp_path / "full.yaml", fixture_model_path, vae_videos, tmp_path / "r1")
    again = build_trainer(load(config, "--model_path", out.parent, "--output_dir", tmp_path / "r2"))
    assert all(torch.equal(p.detach(), state[n]) for n, p in again.model.named_parameters())


@needs_reference
def test_a_pyramid_flow_lora_run_on_a_pan_checkpoint_merges_onto_that_checkpoint(tmp_path, fixture_model_path,
                                                                                  vae_videos):
    """A full fine-tuning run's checkpoint, not the release, is the base (`pretrained_transformer_path`):
    a full run warm-started from it starts from its weights; a LoRA run trains adapters on it, records
    it as the base, and merges onto it in the released layout."""
    from pan.models.pyramid_flux import PyramidFluxTransformer
    from pan.models.pyramid_io import load_pretrained, read_weights

    train(pyramid_flow_config(tmp_path / "full.yaml", fixture_model_path, vae_videos, tmp_path / "full"))
    base_ckpt = tmp_path / "full" / "checkpoint-2"
    base, released = consolidated_weights(base_ckpt / "transformer"), read_weights(FIXTURE_DIT)
    assert base.keys() == released.keys() and any(not torch.equal(base[k], released[k]) for k in base)
    warm = {"pretrained_transformer_path": str(base_ckpt), "load_transformer_weights": True}

    again = build_trainer(load(pyramid_flow_config(tmp_path / "again.yaml", fixture_model_path, vae_videos,
                                                   tmp_path / "again", model_extra=warm)))
    assert all(torch.equal(p.detach(), base[n]) for n, p in again.model.named_parameters())
    again.close()

    train(pyramid_flow_config(tmp_path / "lora.yaml", fixture_model_path, vae_videos, tmp_path / "lora",
                              model_extra=warm, lora={"lora_rank": 4, "lora_alpha": 8}))
    ckpt = tmp_path / "lora" / "checkpoint-2"
    reference = reference_of(ckpt)
    assert reference["base_source"] == str(base_ckpt)
    out = tmp_path / "export" / VARIANT
    assert main_export([str(ckpt), "--merge", "--format", "pyramid_flow", "--out", str(out)]) == 0
    state = load_pretrained(out, PyramidFluxTransformer).state_dict()
    want = expected_merge(base, consolidated_weights(ckpt / "transformer"), reference["alpha"] / reference["rank"])
    assert state.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(state[key], value.float()), key
    changed = [k for k in base if not torch.equal(state[k], base[k])]
    assert changed and all(k.removesuffix(".weight") in reference["targets"] for k in changed)


def original_deps() -> Path:
    """The folder of the original's own dependencies: the venv's `original-deps` (`make test`)."""
    return Path(os.environ.get("PAN_ORIGINAL_DEPS") or Path(sys.prefix) / "original-deps")


@needs_reference
def test_the_merged_pyramid_flow_export_loads_with_the_original_s_released_folder_loader(tmp_path,
                                                                                       pyramid_lora_run):
    from pan.models.pyramid_flux import PyramidFluxTransformer
    from pan.models.pyramid_io import load_pretrained

    deps = original_deps()
    missing = [name for name in ("einops", "timm", "accelerate") if not (deps / name).is_dir()]
    if missing:
        pytest.fail(f"{', '.join(missing)} not in {deps}: the original Pyramid-Flow's own dependencies, which "
                    "`make test` installs there (pip install --target <venv>/original-deps einops timm "
                    "accelerate --no-deps; PAN_ORIGINAL_DEPS names another folder)")
    out = tmp_path / "export" / VARIANT
    assert main_export([str(pyramid_lora_run), "--merge", "--format", "pyramid_flow", "--out", str(out)]) == 0
    result = tmp_path / "original.safetensors"
    cases = [str(REFERENCE / "flux_dit" / f"{case}.safetensors") for case in CASES]
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("original_pyramid_dit.py")),
                           str(ORIGINAL), str(deps), str(out.parent), VARIANT, str(result), *cases],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    theirs = load_file(str(result))

    # The original's runner loads exactly the merged weights, every tensor, in fp32.
    state = {k.removeprefix("state."): v for k, v in theirs.items() if k.startswith("state.")}
    want = pyramid_expected_merge(pyramid_lora_run)
    assert state.keys() == want.keys()
    for key, value in want.items():
        assert value.dtype == torch.float32 and state[key].dtype == torch.float32, key
        assert torch.equal(state[key], value), key

    # Its forward of the folder is pan's forward of the export on both fixture calls, up to the fp32
    # rounding of another order of operations.
    model = load_pretrained(out, PyramidFluxTransformer).train()
    for case in CASES:
        t, _ = load_fixture(f"flux_dit/{case}")
        batch = Batch(model, t)
        with torch.no_grad():
            preds = batch.predictions(model, model(*batch.inputs()))
        for (c, i), pred in zip(batch.where, preds):
            torch.testing.assert_close(pred, theirs[f"{case}.out.col{c}"][i], **TOL, msg=f"{case} column {c} row {i}")


def test_pan_sample_of_a_pyramid_flow_ar_lora_run_samples_its_merged_export(tmp_path, released):
    """The AR recipe (video sync groups of 2 over 2 micro-batches): its LoRA checkpoint is rebuilt in
    the run's layout, merged, and samples what the merged export samples."""
    import yaml

    from pan.sampling import main as sample_main

    videos = synth_dataset(tmp_path / "synth", num_train=8, num_heldout=1, size=16, num_frames=5)["train_csv"]
    run, config = tmp_path / "run", tmp_path / "ar.yaml"
    config.write_text(yaml.safe_dump({
        "recipe": "pyramid_flow_ar",
        "model": {"model_name": "pyramid_flux", "model_path": str(released), "vae_type": "identity"},
        "autoregressive": {"frame_per_unit": 1, "video_sync_group": 2},
        "training": {"learning_rate": 1e-2, "max_steps": 2, "dtype": "fp32", "use_muon": False,
                     "gradient_accumulation_steps": 2},
        "lora": {"lora_rank": 4},
        "data": {"video_csv_paths": [str(videos)], "resolution_buckets": ["16x16"], "min_frames": 1,
                 "max_frames": 4, "frames_mod": 1, "frames_remainder": 0, "max_tokens_per_batch": 1000,
                 "max_samples_per_batch": 4, "packed_dataloader_num_workers": 0},
        "output": {"output_dir": str(run), "save_interval": 2, "log_interval": 1, "progress_bar": False}}))
    train(config)
    merged = tmp_path / "merged.safetensors"
    assert main_export([str(run / "checkpoint-2"), "--merge", "--out", str(merged)]) == 0
    common = ["--prompt", "a red square moving left", "--num-frames", "3", "--height", "16", "--width", "16",
              "--steps", "2", "--video-steps", "2"]
    videos = {}
    for name, argv in {"checkpoint": ["--checkpoint", str(run / "checkpoint-2")],
                       "merged": ["--checkpoint", str(merged), "--config", str(run / "config.yaml")]}.items():
        assert sample_main([*argv, *common, "--out", str(tmp_path / f"{name}.mp4")]) == 0, name
        videos[name] = video_frames(tmp_path / f"{name}.mp4")
    assert np.array_equal(videos["merged"], videos["checkpoint"])

"""A Pyramid-Flow user's first day (issue 29), through the commands a user types: `pan launch-command`,
`pan check`, `pan sample`, `pan data precompute` (their main(argv) functions), each asserting the exit
code, the message naming the key or the fix, and no traceback.

- The original's `--max_frames 16` (latent frames) typed as pan's `max_frames` (pixel frames) is
  refused naming `max_frames` and the pixel count it meant; annotation latents longer than the window
  are a warning of `pan check`'s `annotation rows`.
- A run whose rows all carry `text_fea`, with `text_fea/empty.pt` beside them, passes the `text
  encoders` row without any encoder; `pan sample` and `pan data precompute` without encoders refuse
  (exit 2) instead of a traceback.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from preflight_table import parse_table
from pyramid_reference import needs_reference
from pyramid_tiny import FIXTURE_VAE, TINY_FLUX, VARIANT, fixture_model_path_fixture, released_fixture, save_tiny_flux  # noqa: F401

from pan.encoders.vae import VAEConfig, vae_geometry
from pan.launch_command import main_launch_command
from pan.preflight import main_check

REPO = Path(__file__).resolve().parents[1]


def no_traceback(*texts: str) -> None:
    assert all("Traceback" not in t for t in texts), texts


def table(capsys) -> dict[str, list[tuple[str, str]]]:
    """`pan check`'s printed table: check -> [(status, detail with its continuation lines)]."""
    return parse_table(capsys.readouterr().out)


def text_features(length: int = 6) -> dict[str, torch.Tensor]:
    """A text-feature file's tensors of the tiny DiT's widths (tests/pyramid_tiny.py TINY_FLUX)."""
    return {"prompt_embed": torch.randn(1, length, TINY_FLUX["joint_attention_dim"]),
            "prompt_attention_mask": torch.ones(1, length, dtype=torch.long),
            "pooled_prompt_embed": torch.randn(1, TINY_FLUX["pooled_projection_dim"])}


# ------------------------------------------------------------------------------------------------
# Item 4: max_frames counts pixel frames
# ------------------------------------------------------------------------------------------------

@needs_reference
def test_the_originals_max_frames_typed_as_is_is_refused_naming_max_frames(tmp_path, released, capsys):
    annotations = tmp_path / "anno.jsonl"
    annotations.write_text(json.dumps({"video": "v.mp4", "text": "a clip", "latent": "v.pt"}) + "\n")
    tf = vae_geometry(VAEConfig(vae_type="causal_video_vae", vae_path=str(FIXTURE_VAE))).temporal_factor
    base = ["--workflow", "pyramid-flow-ar", "--nodes", "1", "--gpus-per-node", "8",
            "--config", str(REPO / "config" / "pyramid_flow_ar_384p.yaml"), "--model_path", str(released),
            "--vae_path", str(FIXTURE_VAE), "--annotation_paths", f"[{annotations}]",
            "--output_dir", str(tmp_path / "run")]
    for latent_frames in (16, 8):   # NUM_FRAMES of the AR script, --max_frames of the non-AR one
        assert main_launch_command([*base, "--max_frames", str(latent_frames)]) == 2
        captured = capsys.readouterr()
        no_traceback(captured.out, captured.err)
        assert "`max_frames`" in captured.err and "pixel frames" in captured.err
        assert f"max_frames: {1 + tf * (latent_frames - 1)}" in captured.err, captured.err
    # A group that does not divide the units of a window that is right in pixel frames stays the
    # group's fault, and says what max_frames counts.
    assert main_launch_command([*base, "--video_sync_group", "3"]) == 2
    err = capsys.readouterr().err
    assert "`video_sync_group`" in err and "max_frames counts pixel frames" in err


@needs_reference
def test_pan_check_warns_when_annotation_latents_are_longer_than_the_window(tmp_path, fixture_model_path, capsys):
    vae = {"vae_type": "causal_video_vae", "vae_path": str(fixture_model_path / "causal_video_vae")}
    geometry = vae_geometry(VAEConfig(**vae))
    channels, tf, factor = geometry.latent_channels, geometry.temporal_factor, geometry.spatial_factor
    side = 8 * factor   # 8 latent cells: whole patches at every one of the 3 stages
    latent_frames = 4
    (tmp_path / "text_fea").mkdir()
    rows = []
    for i in range(2):
        torch.save(torch.randn(1, channels, latent_frames, 8, 8), tmp_path / f"{i}.pt")
        rows.append(json.dumps({"video": f"{i}.mp4", "text": f"clip {i}", "latent": f"{i}.pt"}))
    (tmp_path / "anno.jsonl").write_text("\n".join(rows) + "\n")
    full = 1 + tf * (latent_frames - 1)
    cfg = {"recipe": "pyramid_flow_ar",
           "model": {"model_name": "pyramid_flux", "model_path": str(fixture_model_path), **vae},
           "autoregressive": {"frame_per_unit": 1, "video_sync_group": 2},
           "training": {"max_steps": 2, "dtype": "fp32", "use_muon": False, "gradient_accumulation_steps": 2},
           "data": {"annotation_paths": [str(tmp_path / "anno.jsonl")], "resolution_buckets": [f"{side}x{side}"],
                    "min_frames": 1, "max_frames": full, "frames_mod": tf, "frames_remainder": 1,
                    "max_tokens_per_batch": 4000, "max_samples_per_batch": 4, "packed_dataloader_num_workers": 0},
           "output": {"output_dir": str(tmp_path / "run"), "save_total_limit": 2}}
    config = tmp_path / "ar.yaml"
    config.write_text(yaml.safe_dump(cfg))
    main_check(["--config", str(config), "--video_sync_group", "4"])
    rows = table(capsys)
    assert rows["annotation rows"][0][0] == "pass", rows["annotation rows"]
    # The window of 2 latent frames (max_frames 1 + tf pixel frames) trains 2 of every 4.
    code = main_check(["--config", str(config), "--max_frames", str(1 + tf)])
    rows = table(capsys)
    assert code == 0, rows
    status, detail = rows["annotation rows"][0]
    assert status == "warn" and "longer" in detail and f"max_frames: {full}" in detail, detail
    assert "pixel frames" in rows["units"][0][1]


# ------------------------------------------------------------------------------------------------
# Item 5: precomputed text features, and commands without the encoders
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def precomputed(tmp_path_factory) -> dict[str, Path]:
    """A model folder with the tiny DiT and no text encoders, and annotation rows that all carry
    their latent and `text_fea`, with `text_fea/empty.pt` beside them; a 2-step run of it."""
    from pan.config import load_job_config
    from pan.trainer import build_trainer

    root = tmp_path_factory.mktemp("precomputed")
    save_tiny_flux(root / "model" / VARIANT)
    data = root / "data"
    (data / "text_fea").mkdir(parents=True)
    torch.save(text_features(), data / "text_fea" / "empty.pt")
    channels = TINY_FLUX["in_channels"] // 4   # miniFLUX: 2x2 patches of latent channels
    rows = []
    for i in range(4):
        torch.save(torch.randn(1, channels, 2, 16, 16), data / f"{i}.pt")
        torch.save(text_features(), data / f"{i}-text.pt")
        rows.append(json.dumps({"video": f"{i}.mp4", "text": f"clip {i}", "latent": f"{i}.pt",
                                "text_fea": f"{i}-text.pt"}))
    (data / "anno.jsonl").write_text("\n".join(rows) + "\n")
    cfg = {"recipe": "pyramid_flow",
           "model": {"model_name": "pyramid_flux", "model_path": str(root / "model"), "vae_type": "identity"},
           "training": {"max_steps": 2, "dtype": "fp32", "use_muon": False},
           "data": {"annotation_paths": [str(data / "anno.jsonl")], "resolution_buckets": ["16x16"],
                    "min_frames": 1, "max_frames": 2, "frames_mod": 1, "frames_remainder": 0,
                    "max_tokens_per_batch": 400, "max_samples_per_batch": 4, "packed_dataloader_num_workers": 0},
           "output": {"output_dir": str(root / "run"), "save_interval": 2, "save_total_limit": 2,
                      "progress_bar": False}}
    config = root / "p.yaml"
    config.write_text(yaml.safe_dump(cfg))
    assert build_trainer(load_job_config(["--config", str(config)])).fit() is not False  # never loads encoders
    return {"config": config, "run": root / "run", "data": data}


def test_pan_check_passes_text_encoders_a_run_never_loads(precomputed, capsys):
    code = main_check(["--config", str(precomputed["config"]), "--output_dir",
                       str(precomputed["run"].parent / "fresh")])
    rows = table(capsys)
    status, detail = rows["text encoders"][0]
    assert status == "pass" and "text_fea" in detail and "empty.pt" in detail, detail
    assert code == 0, rows
    # A broken empty caption file is that row's failure.
    empty = precomputed["data"] / "text_fea" / "empty.pt"
    saved = empty.read_bytes()
    try:
        torch.save({"prompt_embed": torch.zeros(1, 3, TINY_FLUX["joint_attention_dim"] + 1)}, empty)
        assert main_check(["--config", str(precomputed["config"])]) == 1
        assert table(capsys)["text encoders"][0][0] == "fail"
    finally:
        empty.write_bytes(saved)


def test_sample_and_precompute_without_encoders_refuse_without_a_traceback(precomputed, tmp_path, capsys):
    from pan.data.precompute import main as precompute_main
    from pan.sampling import main as sample_main

    code = sample_main(["--checkpoint", str(precomputed["run"]), "--prompt", "a clip", "--out",
                        str(tmp_path / "x.mp4"), "--num-frames", "2", "--height", "16", "--width", "16",
                        "--steps", "1"])
    captured = capsys.readouterr()
    no_traceback(captured.out, captured.err)
    assert code == 2 and "pan sample: refused" in captured.err and "text_encoder_dir" in captured.err
    code = precompute_main(["--config", str(precomputed["config"]), "--out", str(tmp_path / "pre")])
    captured = capsys.readouterr()
    no_traceback(captured.out, captured.err)
    assert code == 2 and "refused" in captured.err and "text_encoder_dir" in captured.err


# ------------------------------------------------------------------------------------------------
# Misleading: data the variant was not trained on, frame rules the VAE cannot encode
# ------------------------------------------------------------------------------------------------

def fixture_release(root: Path) -> Path:
    """The fixture DiT under every released variant name, the fixture VAE and tiny encoders of the
    fixture DiT's widths."""
    from pyramid_tiny import FIXTURE_DIT, write_fixture_text_encoders

    root.mkdir()
    for variant in ("diffusion_transformer_384p", "diffusion_transformer_768p", "diffusion_transformer_image"):
        (root / variant).symlink_to(FIXTURE_DIT)
    (root / "causal_video_vae").symlink_to(FIXTURE_VAE)
    return write_fixture_text_encoders(root)


@needs_reference
def test_latents_the_variant_was_not_trained_on_are_the_data_rows_problem(tmp_path, capsys):
    model = fixture_release(tmp_path / "model")
    vae = {"vae_type": "causal_video_vae", "vae_path": str(model / "causal_video_vae")}
    geometry = vae_geometry(VAEConfig(**vae))
    factor, tf = geometry.spatial_factor, geometry.temporal_factor

    def annotations(name: str, height: int, width: int, frames: int) -> Path:
        """Precomputed rows of latents of `height` x `width` pixels."""
        torch.save(torch.randn(1, geometry.latent_channels, frames, height // factor, width // factor),
                   tmp_path / f"{name}.pt")
        path = tmp_path / f"{name}.jsonl"
        path.write_text(json.dumps({"video": f"{name}.mp4", "text": "a clip", "latent": f"{name}.pt"}) + "\n")
        return path

    small = annotations("small", 384, 640, 2)            # 384p latents
    large = annotations("large", 768, 1280, 2)           # 768p latents
    cfg = {"recipe": "pyramid_flow", "model": {"model_name": "pyramid_flux", "model_path": str(model), **vae},
           "training": {"max_steps": 2, "dtype": "fp32", "use_muon": False},
           "data": {"annotation_paths": [str(small)], "resolution_buckets": ["1280x768"], "min_frames": 1,
                    "max_frames": 1 + tf, "frames_mod": tf, "frames_remainder": 1, "max_tokens_per_batch": 40000,
                    "max_samples_per_batch": 4, "packed_dataloader_num_workers": 0},
           "output": {"output_dir": str(tmp_path / "run"), "save_total_limit": 2}}
    config = tmp_path / "p.yaml"
    config.write_text(yaml.safe_dump(cfg))
    args = ["--config", str(config), "--sample-rows", "1"]
    # 384p latents on the 768p variant: not what it was trained on, as 384p buckets would be refused.
    assert main_check([*args, "--model_variant", "diffusion_transformer_768p"]) == 1
    status, detail = table(capsys)["data"][0]
    assert status == "fail" and "(384p), not 768p" in detail, detail
    # 768p latents on it: they are.
    main_check([*args, "--model_variant", "diffusion_transformer_768p", "--annotation_paths", f"[{large}]"])
    assert table(capsys)["data"][0][0] == "pass"
    # Video rows on the image variant (the original trains it on images only).
    main_check([*args, "--model_variant", "diffusion_transformer_image", "--annotation_paths", f"[{large}]"])
    status, detail = table(capsys)["data"][0]
    assert status == "warn" and "is a video" in detail, detail


@needs_reference
def test_frame_rules_the_vae_cannot_encode_are_refused_before_anything_is_built(tmp_path, released, capsys):
    annotations = tmp_path / "anno.jsonl"
    annotations.write_text(json.dumps({"video": "v.mp4", "text": "a clip", "latent": "v.pt"}) + "\n")
    tf = vae_geometry(VAEConfig(vae_type="causal_video_vae", vae_path=str(FIXTURE_VAE))).temporal_factor
    for workflow, yaml_name in (("pyramid-flow-no-ar", "pyramid_flow_384p.yaml"),
                                ("pyramid-flow-ar", "pyramid_flow_ar_384p.yaml")):
        code = main_launch_command([
            "--workflow", workflow, "--nodes", "1", "--gpus-per-node", "8",
            "--config", str(REPO / "config" / yaml_name),
            "--model_path", str(released), "--vae_path", str(FIXTURE_VAE), "--annotation_paths", f"[{annotations}]",
            "--output_dir", str(tmp_path / "run"), "--frames_mod", str(tf // 2)])
        captured = capsys.readouterr()
        no_traceback(captured.out, captured.err)
        assert code == 2 and "`frames_mod`" in captured.err and f"frames_mod: {tf}" in captured.err, captured.err


@needs_reference
def test_pan_check_says_the_frame_rule_once_and_not_as_a_memory_traceback(tmp_path, fixture_model_path, capsys):
    vae = {"vae_type": "causal_video_vae", "vae_path": str(fixture_model_path / "causal_video_vae")}
    geometry = vae_geometry(VAEConfig(**vae))
    side = 8 * geometry.spatial_factor
    annotations = tmp_path / "anno.jsonl"
    torch.save(torch.randn(1, geometry.latent_channels, 2, 8, 8), tmp_path / "v.pt")
    annotations.write_text(json.dumps({"video": "v.mp4", "text": "a clip", "latent": "v.pt"}) + "\n")
    cfg = {"recipe": "pyramid_flow",
           "model": {"model_name": "pyramid_flux", "model_path": str(fixture_model_path), **vae},
           "training": {"max_steps": 2, "dtype": "fp32", "use_muon": False},
           "data": {"annotation_paths": [str(annotations)], "resolution_buckets": [f"{side}x{side}"],
                    "min_frames": 1, "max_frames": 1 + geometry.temporal_factor,
                    "frames_mod": geometry.temporal_factor // 2, "frames_remainder": 1,
                    "max_tokens_per_batch": 4000, "max_samples_per_batch": 4, "packed_dataloader_num_workers": 0},
           "output": {"output_dir": str(tmp_path / "run"), "save_total_limit": 2}}
    config = tmp_path / "p.yaml"
    config.write_text(yaml.safe_dump(cfg))
    assert main_check(["--config", str(config)]) == 1
    rows = table(capsys)
    assert rows["stage sizes"][0][0] == "fail" and "`frames_mod`" in rows["stage sizes"][0][1]
    assert "ValueError" not in rows["memory"][0][1] and "stage sizes" in rows["memory"][0][1]


# ------------------------------------------------------------------------------------------------
# Misleading: help, file modes, warnings that are noise
# ------------------------------------------------------------------------------------------------

def help_entries(text: str) -> dict[str, str]:
    """--option -> its help text, from an argparse help page."""
    entries, current = {}, None
    for line in text.split("options:", 1)[1].splitlines():
        stripped = line.strip()
        if line.startswith("  -") and not line.startswith("   "):
            names = stripped.split("  ", 1)
            current = names[0].split(",")[-1].split()[0]
            entries[current] = names[1].strip() if len(names) > 1 else ""
        elif current and stripped:
            entries[current] += " " + stripped
    return entries


def test_every_sampler_option_has_help_and_its_default(precomputed, capsys):
    from pan.config import load_job_config
    from pan.recipes.pyramid_flow.sample import sample_main
    from pan.sampling import main as sample

    with pytest.raises(SystemExit):
        sample(["--help"])                                  # the Pan recipe's sampler
    pan_help = help_entries(capsys.readouterr().out)
    job = load_job_config(["--config", str(precomputed["config"])])
    with pytest.raises(SystemExit):
        sample_main(job, ["--help"])                        # the pyramid_flow recipe's
    pyramid_help = help_entries(capsys.readouterr().out)
    for entries in (pan_help, pyramid_help):
        assert all(text for text in entries.values()), [k for k, v in entries.items() if not v]
        assert "(default: 0)" in entries["--seed"]
    assert f"(default: {job.validation.sample_num_frames})" in pyramid_help["--num-frames"]
    assert "the run's sample_num_frames" in pan_help["--num-frames"]


def test_exports_honour_the_umask_without_warnings(precomputed, tmp_path, recwarn):
    import os

    from pan.export import main_export

    mask = os.umask(0o022)
    try:
        checkpoint = precomputed["run"] / "checkpoint-2"
        assert main_export([str(checkpoint), "--out", str(tmp_path / "model.safetensors")]) == 0
        assert main_export([str(checkpoint), "--format", "pyramid_flow", "--out", str(tmp_path / "released")]) == 0
    finally:
        os.umask(mask)
    written = [tmp_path / "model.safetensors", *(tmp_path / "released").rglob("*.safetensors")]
    assert len(written) == 2 and all(f.stat().st_mode & 0o777 == 0o644 for f in written)
    assert not [w for w in recwarn if "torch.distributed is disabled" in str(w.message)]


def test_the_shipped_accumulation_is_no_warning(precomputed, caplog):
    import logging

    from pan.config import load_job_config
    from pan.trainer import build_trainer

    job = load_job_config(["--config", str(precomputed["config"]), "--gradient_accumulation_steps", "2",
                           "--output_dir", str(precomputed["run"].parent / "accumulated")])
    with caplog.at_level(logging.INFO):
        build_trainer(job)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "accumulation" in r.getMessage()]
    assert any("accumulates exactly" in r.getMessage() for r in caplog.records)

"""The LoRA memory plan (issue 26): `pan check --device-memory 24` on config/pyramid_flow_384p_lora.yaml
with the released miniFLUX's shapes says it fits one 24 GB GPU, and the same config trained fully
says it does not, naming its fixes (LoRA among them); the estimate counts a LoRA part's frozen base
at its dtype with nothing else of it, and its adapters with fp32 weights and AdamW's moments.

The released model is its config.json alone (shapes, no weights: the memory plan builds the DiT on
the meta device): a folder in the released layout with the 2B miniFLUX's `config.json` and the
causal VAE's, and an annotation file of precomputed rows (`latent`, `text_fea`), whose files need
not exist for the memory row (the data row reports them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from pyramid_reference import REFERENCE, needs_reference

from pan.config import load_job_config
from pan.preflight import Preflight, lora_base_too_large, main_check

REPO = Path(__file__).resolve().parents[1]
REFERENCE_VAE = REFERENCE / "causal_vae" / "causal_video_vae"

# pyramid-flow-miniflux's diffusion_transformer_384p/config.json (the 768p variant's is the same DiT):
# 30 heads of 64 (width 1920), 8 double- and 16 single-stream blocks, 1.97B parameters.
MINIFLUX = {"_class_name": "PyramidFluxTransformer", "_diffusers_version": "0.30.3", "attention_head_dim": 64,
            "axes_dims_rope": [16, 24, 24], "in_channels": 64, "interp_condition_pos": True,
            "joint_attention_dim": 4096, "num_attention_heads": 30, "num_layers": 8, "num_single_layers": 16,
            "patch_size": 1, "pooled_projection_dim": 768, "use_flash_attn": False,
            "use_gradient_checkpointing": False, "use_temporal_causal": True}
# The released causal_video_vae/config.json: the original's defaults (widths 128-512, 32 groups), 16 channels.
VAE_WIDTHS = {"encoder_block_out_channels": [128, 256, 512, 512], "decoder_block_out_channels": [128, 256, 512, 512],
              "encoder_norm_num_groups": 32, "decoder_norm_num_groups": 32}


@pytest.fixture(scope="module")
def released(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pyramid-flow-miniflux")
    for variant in ("diffusion_transformer_384p", "diffusion_transformer_768p"):
        (root / variant).mkdir()
        (root / variant / "config.json").write_text(json.dumps(MINIFLUX))
    vae = root / "causal_video_vae"
    vae.mkdir()
    config = json.loads((REFERENCE_VAE / "config.json").read_text())
    (vae / "config.json").write_text(json.dumps({**config, **VAE_WIDTHS}))
    (vae / "diffusion_pytorch_model.safetensors").touch()
    rows = [{"video": f"v{i}.mp4", "text": "a caption", "latent": f"latent/{i}.pt", "text_fea": f"text_fea/{i}.pt"}
            for i in range(4)]
    (root / "precomputed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def argv(released: Path, tmp_path: Path, variant: str = "384p", *extra: str) -> list[str]:
    return ["--config", str(REPO / f"config/pyramid_flow_{variant}_lora.yaml"), "--model_path", str(released),
            "--vae_path", str(released / "causal_video_vae"),
            "--annotation_paths", f"[{released / 'precomputed.jsonl'}]", "--output_dir", str(tmp_path / "run"),
            *extra]


def memory_row(args: list[str], capsys) -> dict:
    main_check(args + ["--json"])
    out = json.loads(capsys.readouterr().out)
    [row] = [r for r in out["rows"] if r["check"] == "memory"]
    return {**row, "estimate": out.get("estimate"), "fitting_changes": out.get("fitting_changes", [])}


@needs_reference
def test_the_384p_lora_config_fits_24_gb_and_full_fine_tuning_does_not(released, tmp_path, capsys):
    lora = memory_row(argv(released, tmp_path, "384p", "--device-memory", "24"), capsys)
    assert lora["status"] == "pass", lora["detail"]
    assert lora["estimate"]["total"] <= 24 * 2**30

    # The same config trained fully (every LoRA key back to its default), planned for the same card.
    full = memory_row(argv(released, tmp_path, "384p", "--device-memory", "24", "--lora_rank", "0",
                           "--lora_alpha", "null", "--lora_base_dtype", "auto"), capsys)
    assert full["status"] == "fail" and "does not fit" in full["detail"], full
    parts = full["estimate"]["device"]
    assert parts["parameters"] + parts["optimizer states"] > 20 * 2**30   # 12 B x 1.97B: fp32 weights, AdamW
    # Its fixes: each single change that fits, LoRA among them, each with its estimate.
    assert "--lora_rank 16" in full["fix"], full["fix"]
    changes = {tuple(c["keys"]): c["estimate"]["total"] for c in full["fitting_changes"]}
    assert ("lora_rank",) in changes and all(total <= 24 * 2**30 for total in changes.values()), changes


@needs_reference
def test_the_estimate_counts_a_lora_part_from_its_meta_parameters(released, tmp_path):
    job = load_job_config(argv(released, tmp_path), warn=lambda m: None)
    ctx = Preflight(job, 1, 1, device_memory=24)
    params = dict(ctx.model.named_parameters())
    adapters = {n: p for n, p in params.items() if ".lora_A." in n or ".lora_B." in n}
    base = {n: p for n, p in params.items() if n not in adapters}
    assert {n for n, p in params.items() if p.requires_grad} == set(adapters)
    # the base's matrices in bf16; its vectors (norm scales, biases) stay fp32
    assert all(p.dtype == (torch.bfloat16 if p.ndim >= 2 else torch.float32) for p in base.values())
    assert all(p.dtype == torch.float32 for p in adapters.values())
    base_count, adapter_count = (sum(p.numel() for p in group.values()) for group in (base, adapters))
    assert 1.9e9 < base_count < 2.0e9 and 10e6 < adapter_count < 30e6, (base_count, adapter_count)

    device = ctx.estimate.device
    frozen = sum(p.numel() * p.element_size() for p in base.values())
    assert frozen < 2.01 * base_count                            # bf16 (vectors fp32), once: no master copy
    assert device["frozen parameters"] == frozen
    assert device["parameters"] == 4 * adapter_count            # the adapters' fp32 weights
    assert device["optimizer states"] == 8 * adapter_count      # AdamW's two moments, adapters only
    assert device["ema"] == 0
    assert device["gradients"] <= 4 * adapter_count             # only the adapters get gradients
    # The released base's names and shapes, for the model-folder and warm-start rows.
    assert not any("lora_" in n or "base_layer" in n for n in ctx.model_shapes)
    assert len(ctx.model_shapes) == len(base)


@needs_reference
def test_the_768p_lora_config_fits_one_80_gb_gpu(released, tmp_path, capsys):
    row = memory_row(argv(released, tmp_path, "768p", "--device-memory", "80"), capsys)
    assert row["status"] == "pass", row["detail"]


def test_lora_on_a_base_over_2b_is_refused_for_several_processes_only(tmp_path, capsys):
    """LoRA loads its frozen base whole on every rank before sharding (pan does that up to 2B
    parameters; larger models are initialised shard by shard): `pan check` says so in the memory
    row for a world of several processes, as the trainer would refuse it after building; one
    process holds the whole model anyway."""
    csv = tmp_path / "clips.csv"
    csv.write_text("path,caption\n")
    args = ["--config", str(REPO / "config/tiny_cpu.yaml"), "--video_csv_paths", str(csv),
            "--output_dir", str(tmp_path / "run"), "--transformer_config_overrides.hidden_size", "8192",
            "--transformer_config_overrides.num_attention_heads", "512",
            "--transformer_config_overrides.num_layers", "3", "--lora_rank", "4", "--use_muon", "false"]
    row = memory_row([*args, "--gpus-per-node", "2"], capsys)
    assert row["status"] == "fail" and "LoRA on transformer" in row["detail"] and "2B" in row["detail"], row
    assert "lora_rank: 0" in row["fix"]
    one_process = Preflight(load_job_config(args, warn=lambda m: None), 1, 1)
    assert lora_base_too_large(one_process) is None

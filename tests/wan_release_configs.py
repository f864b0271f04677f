"""Config-only diffusers Wan folders with the released sizes, for `pan check` at the real scale.

    folder = write_release_folder(tmp / "wan", "wan2.1_t2v_1.3b")   # or wan2.1_t2v_14b, wan2.2_t2v_a14b

Each holds what `pan check` reads and nothing else: model_index.json, transformer/config.json (and
transformer_2/ for A14B), text_encoder/config.json, vae/config.json and scheduler/scheduler_config.json.
No weight is written (the 14B experts are 57 GB each in fp32): the check builds the models on the meta
device from the configs. The one exception is an empty `vae/diffusion_pytorch_model.safetensors` (no
tensor in it): pan's VAE geometry asks for a weights file beside the config, and reads none.

The values are the releases' (Wan-AI/Wan2.1-T2V-1.3B-Diffusers, Wan2.1-T2V-14B-Diffusers,
Wan2.2-T2V-A14B-Diffusers), as diffusers' scripts/convert_wan_to_diffusers.py lists each transformer
config and Wan's own configs (wan/configs/wan_t2v_*.py) give dim, ffn_dim, heads and layers:
    1.3B: 30 blocks, 12 heads x 128, ffn 8960;  14B and each A14B expert: 40 blocks, 40 x 128, ffn 13824;
every one patch (1, 2, 2), 16 channels in and out, text_dim 4096, freq_dim 256. umT5-XXL's encoder
(google/umt5-xxl: d_model 4096, d_ff 10240, 64 heads of 64, 24 layers, vocabulary 256384). The 2.1
VAE is AutoencoderKLWan's defaults, which are the release's (base_dim 96, z_dim 16, 4x in time, 8x in
space, its latents_mean / latents_std). A14B's boundary_ratio is 0.875 (Wan 2.2's T2V config). The
scheduler's flow_shift (3.0 here for every folder) changes no memory figure.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

TRANSFORMER = dict(added_kv_proj_dim=None, attention_head_dim=128, cross_attn_norm=True, eps=1e-06, freq_dim=256,
                   image_dim=None, in_channels=16, out_channels=16, patch_size=[1, 2, 2],
                   qk_norm="rms_norm_across_heads", rope_max_seq_len=1024, text_dim=4096)
RELEASES = {
    "wan2.1_t2v_1.3b": dict(num_layers=30, num_attention_heads=12, ffn_dim=8960, experts=1),
    "wan2.1_t2v_14b": dict(num_layers=40, num_attention_heads=40, ffn_dim=13824, experts=1),
    "wan2.2_t2v_a14b": dict(num_layers=40, num_attention_heads=40, ffn_dim=13824, experts=2, boundary_ratio=0.875),
}
UMT5_XXL = dict(d_model=4096, d_ff=10240, d_kv=64, num_heads=64, num_layers=24, num_decoder_layers=24,
                vocab_size=256384, feed_forward_proj="gated-gelu", relative_attention_num_buckets=32,
                relative_attention_max_distance=128, layer_norm_epsilon=1e-6, tie_word_embeddings=False)


def _write(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))


def write_release_folder(folder: str | Path, release: str, **transformer) -> Path:
    """The release's config-only folder; `transformer` replaces some of its transformer's values (a
    small model with the release's encoders and VAE, for the measured tests)."""
    from diffusers import AutoencoderKLWan
    from transformers import UMT5Config

    folder, spec = Path(folder), {**RELEASES[release], **transformer}
    experts, boundary = spec.pop("experts"), spec.pop("boundary_ratio", None)
    names = ["transformer", "transformer_2"][:experts]
    index = {"_class_name": "WanPipeline", "boundary_ratio": boundary, "expand_timesteps": False,
             "scheduler": ["diffusers", "UniPCMultistepScheduler"],
             "text_encoder": ["transformers", "UMT5EncoderModel"],
             "tokenizer": ["transformers", "T5TokenizerFast"], "vae": ["diffusers", "AutoencoderKLWan"],
             "transformer_2": [None, None]}
    for name in names:
        index[name] = ["diffusers", "WanTransformer3DModel"]
        _write(folder / name / "config.json", {"_class_name": "WanTransformer3DModel", **TRANSFORMER, **spec})
    _write(folder / "model_index.json", index)
    _write(folder / "scheduler" / "scheduler_config.json",
           {"_class_name": "UniPCMultistepScheduler", "flow_shift": 3.0, "num_train_timesteps": 1000,
            "prediction_type": "flow_prediction", "use_flow_sigmas": True})
    UMT5Config(**UMT5_XXL, architectures=["UMT5EncoderModel"]).save_pretrained(folder / "text_encoder")
    with torch.device("meta"):
        AutoencoderKLWan().save_config(folder / "vae")
    save_file({}, str(folder / "vae" / "diffusion_pytorch_model.safetensors"))
    return folder


def write_precomputed_rows(folder: str | Path, latent: tuple[int, int, int, int], text_rows: int = 24,
                           text_dim: int = 4096) -> Path:
    """A precomputed CSV of one row (a zero latent [C, T, H, W] and `text_rows` caption rows) and the
    empty caption's features beside it, as `pan data precompute` writes them; returns the CSV."""
    folder = Path(folder)
    (folder / "clips").mkdir(parents=True, exist_ok=True)
    save_file({"latent": torch.zeros(latent), "text": torch.zeros(text_rows, text_dim)},
              str(folder / "clips" / "0.safetensors"))
    save_file({"text": torch.zeros(1, text_dim)}, str(folder / "empty_text.safetensors"))
    (folder / "clips.csv").write_text("caption,latent_path\na clip,clips/0.safetensors\n")
    return folder / "clips.csv"

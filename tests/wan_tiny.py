"""Tiny random Wan diffusers folders, written by diffusers itself, for the Wan recipe's tests.

    folder = write_wan_folder(tmp / "wan", "t2v")     # Wan 2.1 T2V layout
    folder = write_wan_folder(tmp / "wan", "ti2v")    # Wan 2.2 TI2V 5B layout (expand_timesteps, residual VAE)
    folder = write_wan_folder(tmp / "wan", "a14b")    # Wan 2.2 A14B layout (transformer + transformer_2)
    folder = write_wan_folder(tmp / "wan", "i2v")     # Wan 2.1 I2V layout (condition channels, CLIP image_encoder/)
    folder = write_wan_folder(tmp / "wan", "i2v_a14b")   # Wan 2.2 I2V A14B layout (condition channels, no CLIP)
    write_weight_headers(config_only_folder)   # weights that are headers only, for `pan check` at any size

Each is a `WanPipeline` built from tiny parts (pan/recipes/wan/tiny.py, which the demo's folder uses too)
and written with `save_pretrained`, so the folder is laid
out exactly as a released `*-Diffusers` repository: `model_index.json` (with `boundary_ratio` and
`expand_timesteps`), `transformer/` (and `transformer_2/`), `vae/` (AutoencoderKLWan), `text_encoder/`
(transformers' UMT5EncoderModel), `tokenizer/` (a T5 unigram tokenizer trained offline with the
`tokenizers` library on a small caption corpus, as tests/pyramid_text_models.py builds one) and
`scheduler/` (UniPCMultistepScheduler with flow sigmas and `flow_shift`, as the releases ship). The I2V
variants are `WanImageToVideoPipeline`s: transformers taking [noisy latent ; 4 mask channels ;
condition latent], and for 2.1 a transformers `CLIPVisionModel` (`image_encoder/`, its rows through
`image_dim` and the added k/v projections) with its `CLIPImageProcessor` (`image_processor/`).

Every size is written once, in VARIANTS; tests read them back from the folder's config.json files.
The VAEs keep Wan's structure (4x in time; 8x in space for 2.1, 16x with 2.2's 2x2 pixel patches) at a
tiny width. Transformer weights are diffusers' seeded init moved by seeded noise (as
tests/test_wan_model.py does), so no tensor is a plain zero or one; the VAE's latent statistics are
made up, not 0 and 1, so normalisation is exercised.
"""

from __future__ import annotations

import json
import struct
import tempfile
from pathlib import Path

from pan.recipes.wan import tiny

# The only place sizes are written. `vae`: AutoencoderKLWan keys; `transformer`: WanTransformer3DModel
# keys (in/out channels and text_dim are filled in from the VAE and the text encoder); `text`: UMT5.
TEXT = dict(d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2)
TRANSFORMER = dict(patch_size=[1, 2, 2], num_attention_heads=2, attention_head_dim=12, freq_dim=16, ffn_dim=32,
                   num_layers=2, cross_attn_norm=True, eps=1e-6)
VAE_21 = dict(base_dim=8, z_dim=4, dim_mult=[1, 2, 4, 4], num_res_blocks=1, temperal_downsample=[False, True, True],
              scale_factor_temporal=4, scale_factor_spatial=8)
# Wan 2.2's VAE: residual blocks, 2x2 pixel patches folded into 12 input channels, 16x in space
VAE_22 = dict(base_dim=8, decoder_base_dim=12, z_dim=6, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
              temperal_downsample=[False, True, True], is_residual=True, in_channels=12, out_channels=12,
              patch_size=2, scale_factor_temporal=4, scale_factor_spatial=16)
# Wan 2.1 I2V's image encoder: transformers' CLIPVisionConfig keys (its width is the transformer's image_dim)
CLIP = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=32,
            patch_size=8, projection_dim=16)
VARIANTS = {
    "t2v": dict(vae=VAE_21, experts=1, boundary_ratio=None, expand_timesteps=False, flow_shift=3.0),
    "ti2v": dict(vae=VAE_22, experts=1, boundary_ratio=None, expand_timesteps=True, flow_shift=5.0),
    "a14b": dict(vae=VAE_21, experts=2, boundary_ratio=0.875, expand_timesteps=False, flow_shift=12.0),
    "i2v": dict(vae=VAE_21, experts=1, boundary_ratio=None, expand_timesteps=False, flow_shift=3.0, clip=CLIP),
    "i2v_a14b": dict(vae=VAE_21, experts=2, boundary_ratio=0.9, expand_timesteps=False, flow_shift=5.0),
}


def tiny_tokenizer():
    """A T5 unigram tokenizer (`<pad>` 0, `</s>` 1, `<unk>` 2), trained offline on a caption corpus."""
    from pyramid_text_models import write_t5_tokenizer
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        write_t5_tokenizer(Path(tmp))
        return AutoTokenizer.from_pretrained(tmp, local_files_only=True)


def build_pipeline(variant: str = "t2v", seed: int = 0):
    """The tiny `WanPipeline` of a variant (seeded), not yet written: pan.recipes.wan.tiny's builder
    with this file's sizes, every part moved by seeded noise."""
    spec = VARIANTS[variant]
    vae = dict(spec["vae"])
    z = vae["z_dim"]
    # made-up latent statistics (released ones are per channel, neither 0 nor 1)
    vae["latents_mean"] = [round(0.1 * (i - z / 2), 4) for i in range(z)]
    vae["latents_std"] = [round(0.5 + 0.25 * i, 4) for i in range(z)]
    pipe = tiny.build_pipeline(tiny_tokenizer(), text=TEXT, vae=vae, transformer=TRANSFORMER, experts=spec["experts"],
                               boundary_ratio=spec["boundary_ratio"], expand_timesteps=spec["expand_timesteps"],
                               flow_shift=spec["flow_shift"], seed=seed)
    return image_to_video(pipe, spec, seed) if variant.startswith("i2v") else pipe


def image_to_video(pipe, spec: dict, seed: int):
    """`pipe`'s parts as a WanImageToVideoPipeline: I2V transformers (the noisy latent, 4 mask channels
    and the condition latent on the channels; with `clip`, CLIP image rows) and, with `clip`, a seeded
    tiny CLIPVisionModel and its processor."""
    import torch
    from diffusers import WanImageToVideoPipeline, WanTransformer3DModel
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    z, clip = pipe.vae.config.z_dim, spec.get("clip")
    inner = TRANSFORMER["num_attention_heads"] * TRANSFORMER["attention_head_dim"]
    image = {} if clip is None else dict(image_dim=clip["hidden_size"], added_kv_proj_dim=inner)
    with torch.random.fork_rng():
        torch.manual_seed(seed + 20)
        experts = [tiny.perturbed(WanTransformer3DModel(**TRANSFORMER, in_channels=2 * z + 4, out_channels=z,
                                                        text_dim=TEXT["d_model"], **image), seed + 20 + i)
                   for i in range(spec["experts"])]
        encoder = None if clip is None else tiny.perturbed(CLIPVisionModel(CLIPVisionConfig(**clip)), seed + 30).eval()
    side = None if clip is None else clip["image_size"]
    processor = None if clip is None else CLIPImageProcessor(size={"shortest_edge": side},
                                                             crop_size={"height": side, "width": side})
    return WanImageToVideoPipeline(tokenizer=pipe.tokenizer, text_encoder=pipe.text_encoder, vae=pipe.vae,
                                   scheduler=pipe.scheduler, image_processor=processor, image_encoder=encoder,
                                   transformer=experts[0], transformer_2=experts[1] if len(experts) > 1 else None,
                                   boundary_ratio=spec["boundary_ratio"], expand_timesteps=spec["expand_timesteps"])


def write_wan_folder(folder: str | Path, variant: str = "t2v", seed: int = 0) -> Path:
    """A complete tiny diffusers Wan folder of `variant` in `folder` (created); returns it."""
    return tiny.write_folder(build_pipeline(variant, seed), folder)


def write_weight_headers(folder: str | Path) -> Path:
    """Give each transformer of a config-only folder a diffusion_pytorch_model.safetensors whose header
    names every tensor of the model its config.json builds (fp32) and whose data is a hole of their
    length (a sparse file: the 14B's 57 GB take no disk and no time). `pan check` reads the headers
    only; the run's config check asks that the files be there."""
    import torch

    from pan.models.pyramid_io import WEIGHTS_NAME
    from pan.recipes.wan.model import WanTransformer
    from pan.recipes.wan.weights import load_config

    folder = Path(folder)
    for expert in ("transformer", "transformer_2"):
        if not (folder / expert / "config.json").is_file():
            continue
        with torch.device("meta"):
            model = WanTransformer(load_config(folder / expert))
        header, end = {"__metadata__": {"format": "pt"}}, 0
        for name, tensor in model.state_dict().items():
            size = 4 * tensor.numel()
            header[name] = {"dtype": "F32", "shape": list(tensor.shape), "data_offsets": [end, end + size]}
            end += size
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(folder / expert / WEIGHTS_NAME, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            f.truncate(8 + len(raw) + end)
    return folder


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def clip_geometry(folder: Path, latent_frames: int = 2, latent_cells: int = 2) -> dict:
    """A clip size this folder's models take, from its config.json files alone: `latent_frames` latent
    frames of `latent_cells` x `latent_cells` transformer patches. Keys: frames, size (pixels, square),
    latent (C, T, H, W), tokens (per clip)."""
    vae, transformer = read_json(folder / "vae/config.json"), read_json(folder / "transformer/config.json")
    temporal = 2 ** sum(vae["temperal_downsample"])
    spatial = 2 ** (len(vae["dim_mult"]) - 1) * (vae.get("patch_size") or 1)
    pt, ph, pw = transformer["patch_size"]
    assert ph == pw, "the tests' clips are square"
    frames = 1 + temporal * (latent_frames * pt - 1)
    side = latent_cells * ph
    return dict(frames=frames, size=side * spatial, latent=(vae["z_dim"], latent_frames * pt, side, side),
                tokens=latent_frames * latent_cells * latent_cells)


def prepare_variant(here: Path, variant: str, num_clips: int, num_heldout: int = 1) -> dict:
    """A variant's folder, synthetic clips of its geometry, a small fp32 config and the clips
    precomputed by `pan data precompute` under `here` (`rc`: precompute's exit code)."""
    from pan.data.precompute import main as precompute_main
    from pan.data.synth import synth_dataset

    folder = write_wan_folder(here / "model", variant)
    geometry = clip_geometry(folder)
    clips = synth_dataset(here / "clips", num_train=num_clips, num_heldout=num_heldout, size=geometry["size"],
                          num_frames=geometry["frames"])["train_csv"]
    yaml = here / "wan.yaml"
    yaml.write_text(f"""recipe: wan
model:
  model_path: {folder}
data:
  resolution_buckets: ["{geometry['size']}x{geometry['size']}"]
  min_frames: {geometry['frames']}
  max_frames: {geometry['frames']}
  max_tokens_per_batch: {2 * geometry['tokens']}
  max_samples_per_batch: 2
  packed_dataloader_num_workers: 0
training:
  dtype: fp32
  learning_rate: 1.0e-3
output:
  save_interval: 2
  log_interval: 1
  progress_bar: false
""")
    rc = precompute_main(["--config", str(yaml), "--video_csv_paths", str(clips),
                          "--output_dir", str(here / "unused"), "--out", str(here / "pre")])
    return dict(folder=folder, geometry=geometry, clips=clips, yaml=yaml, rc=rc,
                pre=here / "pre", precomputed=here / "pre" / "train.csv")

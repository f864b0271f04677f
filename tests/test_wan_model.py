"""pan's Wan 2.1 / 2.2 transformer (pan/recipes/wan/) against diffusers' `WanTransformer3DModel`.

Every variant's tiny config is written once, in VARIANTS; diffusers builds the model from it (seeded
random init, then every parameter moved by seeded noise so that unit norms, zero biases and zero tables
matter too) and writes its folder(s) with `save_pretrained`. Everything else reads config.json, so these
tests run unchanged on other configs (widths, depths, heads, patch sizes, text and image widths).

The float64 reference. diffusers' Wan computes its LayerNorms, the modulation sums, the residual sums
and the timestep sinusoid after `.float()` (fp32 islands around bf16 matmuls). In a float64 model those
casts round the stream to fp32, so plain diffusers in float64 is only fp32-accurate: its outputs differ
from the float64 evaluation by 3.3e-7 .. 3.2e-6, as much as its own fp32-vs-fp64 noise. pan runs
the islands in fp32 *at least* (bf16/fp32 as diffusers, float64 stays float64), and the reference is
diffusers' own code with `.float()` leaving float64 tensors as they are (`float64_islands`): a float64
evaluation of exactly diffusers' functions. `test_matches_diffusers_in_float64` also checks that the
plain fp64 run stays within the fp32 noise of that reference.

Tolerances. The fp32-vs-fp64 noise of diffusers (its fp32 model vs the float64 reference, same inputs),
measured on VARIANTS: output 3.2e-7 .. 3.3e-6 relative; per-tensor gradients from 6.7e-8 (the smallest
over all tensors and variants) to 2.4e-5. FP64_TOL = 1e-11 sits more than three orders of magnitude
under the smallest of those (and the test checks the noise of the config it runs stays NOISE_MARGIN
times above it); pan measured <= 5.2e-16 (output) and <= 2.2e-14 (gradients). "Relative" is
max |a - b| / max |b| over a tensor.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pan.models.packing import PackInfo, patchify
from pan.recipes.wan.model import WanTransformer
from pan.recipes.wan.weights import load_config, load_transformer, save_transformer

diffusers = pytest.importorskip("diffusers")
WanTransformer3DModel = diffusers.WanTransformer3DModel

# The only place sizes are written. `folders`: the transformer folders of one release (A14B: two
# experts of one config); `per_token_timesteps`: the pipeline's expand_timesteps (Wan 2.2 TI2V).
VARIANTS = {
    "wan2.1-t2v": dict(folders=("transformer",), per_token_timesteps=False, config=dict(
        patch_size=[1, 2, 2], num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
        text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2, cross_attn_norm=True, eps=1e-6)),
    # I2V: in_channels = noisy latent + 4 mask channels + condition latent (WanImageToVideoPipeline)
    "wan2.1-i2v": dict(folders=("transformer",), per_token_timesteps=False, config=dict(
        patch_size=[1, 2, 2], num_attention_heads=2, attention_head_dim=12, in_channels=2 * 4 + 4, out_channels=4,
        text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2, cross_attn_norm=True, eps=1e-6, image_dim=10,
        added_kv_proj_dim=24)),
    # FLF2V: two images a sample with a learnt position table; patch and cross_attn_norm off the
    # released values here, to cover those paths
    "wan2.1-flf2v": dict(folders=("transformer",), per_token_timesteps=False, config=dict(
        patch_size=[2, 2, 2], num_attention_heads=3, attention_head_dim=8, in_channels=2 * 4 + 4, out_channels=4,
        text_dim=12, freq_dim=15, ffn_dim=40, num_layers=2, cross_attn_norm=False, eps=1e-5, image_dim=6,
        added_kv_proj_dim=24, pos_embed_seq_len=6)),
    "wan2.2-ti2v": dict(folders=("transformer",), per_token_timesteps=True, config=dict(
        patch_size=[1, 2, 2], num_attention_heads=2, attention_head_dim=16, in_channels=6, out_channels=6,
        text_dim=16, freq_dim=16, ffn_dim=48, num_layers=2, cross_attn_norm=True, eps=1e-6)),
    "wan2.2-a14b": dict(folders=("transformer", "transformer_2"), per_token_timesteps=False, config=dict(
        patch_size=[1, 2, 2], num_attention_heads=4, attention_head_dim=6, in_channels=4, out_channels=4,
        text_dim=20, freq_dim=16, ffn_dim=36, num_layers=3, cross_attn_norm=True, eps=1e-6)),
}

FP64_TOL = 1e-11          # relative; see the module docstring for the measured noise it sits under
NOISE_MARGIN = 100        # the measured fp32 noise must stay this far above FP64_TOL on any config
# diffusers' Wan cross-attention takes the last 512 context rows as text and the rest as image rows
# (the umT5 length, hard-coded): its I2V models need exactly 512 text rows
DIFFUSERS_I2V_TEXT_LEN = 512
DENSE_GRID = (2, 3, 2)                       # post-patch (t, h, w) of the dense comparisons
PACKED_GRIDS = ((2, 3, 2), (3, 2, 4))        # two samples of other frame counts and resolutions
TEXT_LEN, PACKED_TEXT_LENS, IMAGE_LEN = 6, (5, 9), 5


def make_folders(name: str, root: Path) -> list[Path]:
    """diffusers' model(s) of a variant, seeded, written as its release lays them out."""
    variant, out = VARIANTS[name], []
    for i, sub in enumerate(variant["folders"]):
        torch.manual_seed(1000 + i)
        model = WanTransformer3DModel(**variant["config"])
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * torch.randn_like(p))
        model.save_pretrained(root / sub)
        out.append(root / sub)
    return out


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory) -> tuple[str, list[Path]]:
    return request.param, make_folders(request.param, tmp_path_factory.mktemp(request.param))


def read_config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


# ------------------------------------------------------------------------------------------------
# Inputs, runs and comparisons
# ------------------------------------------------------------------------------------------------

def latent_shape(cfg: dict, grid) -> tuple[int, int, int]:
    return tuple(n * p for n, p in zip(grid, cfg["patch_size"]))


def draw_timesteps(gen: torch.Generator, cfg: dict, name: str, grids) -> torch.Tensor:
    """One timestep per sample [B], or (TI2V) one per token, the first frame's tokens at 0 (the
    pipeline's expand_timesteps), samples after one another [sum of tokens]."""
    t = torch.rand(len(grids), generator=gen, dtype=torch.float64) * 1000
    if not VARIANTS[name]["per_token_timesteps"]:
        return t
    return torch.cat([torch.cat([torch.zeros(h * w, dtype=torch.float64), ti.repeat((f - 1) * h * w)])
                      for ti, (f, h, w) in zip(t, grids)])


def image_rows(gen: torch.Generator, cfg: dict, samples: int) -> torch.Tensor | None:
    """[B, Li, image_dim] image rows, or None for a model without image input."""
    if cfg["image_dim"] is None:
        return None
    rows = cfg["pos_embed_seq_len"] or IMAGE_LEN
    return torch.randn(samples, rows, cfg["image_dim"], generator=gen, dtype=torch.float64)


def dense_inputs(cfg: dict, name: str, seed: int = 0, batch: int = 2) -> dict:
    """diffusers' forward arguments (float64) for `batch` samples of DENSE_GRID."""
    gen = torch.Generator().manual_seed(seed)
    text_len = DIFFUSERS_I2V_TEXT_LEN if cfg["added_kv_proj_dim"] else TEXT_LEN
    image = image_rows(gen, cfg, batch)
    if image is not None and cfg["pos_embed_seq_len"]:
        image = image.reshape(2 * batch, -1, cfg["image_dim"])   # diffusers' FLF2V layout: images one by one
    timestep = draw_timesteps(gen, cfg, name, [DENSE_GRID] * batch)
    text = torch.randn(batch, text_len, cfg["text_dim"], generator=gen, dtype=torch.float64)
    text[0, max(1, text_len // 3):] = 0   # the first caption zero-padded, as WanPipeline pads them; the rest full
    return dict(hidden_states=torch.randn(batch, cfg["in_channels"], *latent_shape(cfg, DENSE_GRID),
                                          generator=gen, dtype=torch.float64),
                timestep=timestep.reshape(batch, -1).squeeze(1), encoder_hidden_states=text,
                encoder_hidden_states_image=image)


def cast(inputs: dict, dtype: torch.dtype) -> dict:
    return {k: None if v is None else v.to(dtype) for k, v in inputs.items()}


@contextlib.contextmanager
def float64_islands():
    """diffusers' code with `.float()` leaving float64 tensors as they are: its fp32 islands (meant for
    bf16 weights) then compute in float64 like the rest of a float64 model."""
    with pytest.MonkeyPatch.context() as patch:
        to_fp32 = torch.Tensor.float
        patch.setattr(torch.Tensor, "float",
                      lambda self, *a, **k: self if self.dtype == torch.float64 else to_fp32(self, *a, **k))
        yield


def run(model, forward, weight: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Output and every parameter's gradient of (output * weight).sum()."""
    model.zero_grad(set_to_none=True)
    out = forward()
    (out * weight.to(out.dtype)).sum().backward()
    return out.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.abs().max().item()
    diff = (a.double() - b.double()).abs().max().item()
    return diff / scale if scale else diff


def gradient_differences(grads: dict, reference: dict) -> dict[str, float]:
    assert grads.keys() == reference.keys()
    return {n: relative(grads[n], reference[n]) for n in reference}


# ------------------------------------------------------------------------------------------------
# Tests
# ------------------------------------------------------------------------------------------------

def test_matches_diffusers_in_float64(variant):
    name, folders = variant
    for i, folder in enumerate(folders):
        cfg = read_config(folder)
        inputs = dense_inputs(cfg, name, seed=i)
        out_shape = (2, cfg["out_channels"], *latent_shape(cfg, DENSE_GRID))
        weight = torch.randn(out_shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
        reference = WanTransformer3DModel.from_pretrained(folder).double()
        pan = load_transformer(folder, dtype=torch.float64)

        with float64_islands():
            ref_out, ref_grads = run(reference, lambda: reference(**inputs).sample, weight)
        plain_out, _ = run(reference, lambda: reference(**inputs).sample, weight)
        pan_out, pan_grads = run(pan, lambda: pan.forward_dense(**inputs), weight)
        fp32 = reference.float()
        fp32_out, fp32_grads = run(fp32, lambda: fp32(**cast(inputs, torch.float32)).sample, weight)

        out_diff, grad_diff = relative(pan_out, ref_out), gradient_differences(pan_grads, ref_grads)
        noise_out, noise_grads = relative(fp32_out, ref_out), gradient_differences(fp32_grads, ref_grads)
        print(f"\n{name}/{folder.name}: pan vs diffusers fp64 output {out_diff:.1e}, gradients "
              f"{max(grad_diff.values()):.1e} (worst {max(grad_diff, key=grad_diff.get)}); diffusers fp32 "
              f"noise output {noise_out:.1e}, gradients {min(noise_grads.values()):.1e}.."
              f"{max(noise_grads.values()):.1e}; plain diffusers fp64 output {relative(plain_out, ref_out):.1e}")
        assert out_diff <= FP64_TOL
        assert not {n: d for n, d in grad_diff.items() if d > FP64_TOL}
        # the tolerance means something on this config: far under the noise fp32 would make
        assert min(noise_out, *noise_grads.values()) >= NOISE_MARGIN * FP64_TOL
        # plain diffusers in float64 (its fp32 islands rounding) stays within that noise of the reference
        assert relative(plain_out, ref_out) <= 2 * noise_out


def test_packed_samples_equal_alone(variant):
    """Two samples of other frame counts, resolutions and text lengths packed together give each what it
    gives alone (float64): attention, modulation and RoPE never mix samples."""
    name, folders = variant
    cfg = read_config(folders[0])
    model = load_transformer(folders[0], dtype=torch.float64)
    gen = torch.Generator().manual_seed(3)
    p = math.prod(cfg["patch_size"])
    tokens = [torch.randn(math.prod(g), cfg["in_channels"] * p, generator=gen, dtype=torch.float64)
              for g in PACKED_GRIDS]
    texts = [torch.randn(n, cfg["text_dim"], generator=gen, dtype=torch.float64) for n in PACKED_TEXT_LENS]
    image = image_rows(gen, cfg, len(PACKED_GRIDS))
    timesteps = draw_timesteps(gen, cfg, name, PACKED_GRIDS)
    per_token = timesteps.shape[0] != len(PACKED_GRIDS)
    t_alone = timesteps.split([math.prod(g) for g in PACKED_GRIDS]) if per_token else timesteps.split(1)

    with torch.no_grad():
        packed = model(torch.cat(tokens), timesteps, torch.cat(texts), PackInfo.build(PACKED_GRIDS, PACKED_TEXT_LENS),
                       image).split([math.prod(g) for g in PACKED_GRIDS])
        for i, grid in enumerate(PACKED_GRIDS):
            alone = model(tokens[i], t_alone[i], texts[i], PackInfo.build([grid], [PACKED_TEXT_LENS[i]]),
                          None if image is None else image[i:i + 1])
            print(f"\n{name}: sample {i} packed vs alone {relative(packed[i], alone):.1e}")
            assert packed[i].shape == (math.prod(grid), cfg["out_channels"] * p)
            assert relative(packed[i], alone) <= FP64_TOL


def test_forward_dense_is_patchify_of_packed(variant):
    """forward_dense packs as pan's patchify does: the same numbers as the packed call."""
    name, folders = variant
    cfg = read_config(folders[0])
    model = load_transformer(folders[0], dtype=torch.float64)
    inputs = dense_inputs(cfg, name, seed=5, batch=1)
    with torch.no_grad():
        dense = model.forward_dense(**inputs)
        image, text = inputs["encoder_hidden_states_image"], inputs["encoder_hidden_states"][0]
        packed = model(patchify(inputs["hidden_states"][0], cfg["patch_size"]), inputs["timestep"].flatten(),
                       text, PackInfo.build([DENSE_GRID], [text.shape[0]]),
                       None if image is None else image.reshape(1, -1, cfg["image_dim"]))
    assert torch.equal(patchify(dense[0], cfg["patch_size"]), packed)


def test_written_folder_loads_in_diffusers(variant, tmp_path):
    """pan's folder (single file, and sharded with an index) loads in diffusers with every tensor and
    the config as they were, and gives the same output; pan reads diffusers' sharded folders too."""
    name, folders = variant
    for folder in folders:
        original = WanTransformer3DModel.from_pretrained(folder)
        inputs = cast(dense_inputs(read_config(folder), name), torch.float32)
        with torch.no_grad():
            expected = original(**inputs).sample
        model = load_transformer(folder)
        for layout, max_bytes in (("single", 10**12), ("sharded", 4096)):
            out = tmp_path / folder.name / layout
            save_transformer(model, out, max_shard_bytes=max_bytes)
            assert (out / "diffusion_pytorch_model.safetensors.index.json").exists() == (layout == "sharded")
            again = WanTransformer3DModel.from_pretrained(out)
            assert {k: v for k, v in dict(again.config).items() if not k.startswith("_")} == \
                   {k: v for k, v in dict(original.config).items() if not k.startswith("_")}
            state, expected_state = again.state_dict(), original.state_dict()
            assert state.keys() == expected_state.keys()
            assert all(torch.equal(state[k], expected_state[k]) for k in state)
            with torch.no_grad():
                assert torch.equal(again(**inputs).sample, expected)
            reread = load_transformer(out).state_dict()
            assert all(torch.equal(reread[k], v) for k, v in model.state_dict().items())
        original.save_pretrained(tmp_path / folder.name / "diffusers-sharded", max_shard_size="4KB")
        sharded = load_transformer(tmp_path / folder.name / "diffusers-sharded").state_dict()
        assert all(torch.equal(sharded[k], v) for k, v in model.state_dict().items())


def test_strict_loading_names_every_problem(tmp_path):
    """One missing, one unknown and one mis-shaped tensor are all named in one refusal; the unused
    `norm_added_q` that older diffusers wrote into I2V folders is dropped, as diffusers drops it."""
    (folder,) = make_folders("wan2.1-i2v", tmp_path)
    weights = folder / "diffusion_pytorch_model.safetensors"
    state = load_file(str(weights))
    state["blocks.0.attn2.norm_added_q.weight"] = torch.ones_like(state["blocks.0.attn2.norm_k.weight"])
    save_file(state, str(weights))
    assert load_transformer(folder).state_dict().keys() == {k for k in state if "norm_added_q" not in k}

    missing, misshaped = "blocks.1.attn1.to_k.bias", "condition_embedder.time_proj.weight"
    del state[missing]
    state["blocks.0.attn1.to_kv.weight"] = torch.zeros(2)
    state[misshaped] = state[misshaped][:-1]
    save_file(state, str(weights))
    with pytest.raises(ValueError) as refusal:
        load_transformer(folder)
    message = str(refusal.value)
    assert missing in message and "blocks.0.attn1.to_kv.weight" in message and misshaped in message
    assert "norm_added_q" not in message


def test_config_json_is_read_strictly(tmp_path):
    from pan.config.core import ConfigError

    (folder,) = make_folders("wan2.1-t2v", tmp_path)
    raw = read_config(folder)
    (folder / "config.json").write_text(json.dumps({**raw, "_name_or_path": "somewhere"}))
    assert load_config(folder).num_layers == raw["num_layers"]   # diffusers' stamps are not config
    for bad, key in (({"window_size": [-1, -1]}, "window_size"), ({"_class_name": "FluxTransformer2DModel"},
                     "_class_name"), ({"image_dim": 8}, "added_kv_proj_dim"), ({"qk_norm": None}, "qk_norm")):
        (folder / "config.json").write_text(json.dumps({**raw, **bad}))
        with pytest.raises(ConfigError) as refusal:
            load_config(folder)
        assert key in str(refusal.value)


def test_init_weights_sets_every_parameter_of_a_meta_model(tmp_path):
    (folder,) = make_folders("wan2.1-i2v", tmp_path)
    config = load_config(folder)
    with torch.device("meta"):
        model = WanTransformer(config)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    model.init_weights()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert model.fsdp_blocks() == list(model.blocks)
    inputs = cast(dense_inputs(read_config(folder), "wan2.1-i2v"), torch.float32)
    with torch.no_grad():
        assert torch.equal(model.forward_dense(**inputs), torch.zeros(2, config.out_channels,
                                                                      *latent_shape(read_config(folder), DENSE_GRID)))


def test_trains_under_bf16_autocast(variant):
    """bf16 weights run under autocast in pan: the forward and backward run, and the output stays within
    bf16 rounding of the fp32 one (measured 5e-3 relative on I2V; bf16's epsilon is 7.8e-3)."""
    name, folders = variant
    model = load_transformer(folders[0])
    inputs = cast(dense_inputs(read_config(folders[0]), name), torch.float32)
    with torch.no_grad():
        fp32 = model.forward_dense(**inputs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model.forward_dense(**inputs)
    out.float().square().sum().backward()
    assert out.dtype == torch.bfloat16 and relative(out, fp32) < 0.05
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())

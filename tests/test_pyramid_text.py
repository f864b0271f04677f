"""Pyramid-Flow's text encoders (tiny random CLIP/T5 models in the released folder layout): features
equal the original's, masks, the empty caption, feature files, refusals, and one rank encoding for a
process group."""

import importlib.util
import json
import shutil

import pytest
import torch

from dist_utils import run_distributed
from pan.config.core import ConfigError
from pan.config.loader import build_dataclass
from pan.encoders.pyramid_text import (FluxTextEncoder, PyramidTextConfig, SD3TextEncoder, TextFeatureFileError,
                                       broadcast_features, build_text_encoder, check_dit_widths,
                                       check_text_encoders, encode_on_one_rank, load_features, save_features)
from pyramid_reference import ORIGINAL, needs_reference, read_json
from pyramid_text_models import write_clip, write_pyramid_text_encoders

PROMPTS = ["a cat plays the piano in a sunny room", "", "Zebra QUIET harbour!! 123",
           "the quick brown fox jumps over the lazy dog " * 20]   # longer than CLIP's 77 and T5's 128


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """model name -> a model folder holding that model's tiny text encoders."""
    return {name: write_pyramid_text_encoders(tmp_path_factory.mktemp(name), name)
            for name in ("pyramid_flux", "pyramid_mmdit")}


@pytest.fixture(scope="module")
def encoders(folders):
    return {name: build_text_encoder(PyramidTextConfig(), name, folder) for name, folder in folders.items()}


def copy_folder(src, dst):
    shutil.copytree(src, dst)
    return dst


# ----------------------------------------------------------------------------------------------
# Features
# ----------------------------------------------------------------------------------------------

def _original_encoder(model_name, folder):
    """The original's encoder class, loaded from its file: it imports only torch and transformers,
    so no extra packages are needed (its package __init__ would pull in einops and timm)."""
    sub = {"pyramid_flux": ("flux_modules", "FluxTextEncoderWithMask"),
           "pyramid_mmdit": ("mmdit_modules", "SD3TextEncoderWithMask")}[model_name]
    path = ORIGINAL / "src" / "pyramid_dit" / sub[0] / "modeling_text_encoder.py"
    spec = importlib.util.spec_from_file_location(f"original_{model_name}_text_encoder", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, sub[1])(str(folder), torch.float32)


@needs_reference
@pytest.mark.parametrize("model_name", ["pyramid_flux", "pyramid_mmdit"])
def test_features_equal_the_originals(model_name, folders, encoders):
    expected = _original_encoder(model_name, folders[model_name])(list(PROMPTS), torch.device("cpu"))
    got = encoders[model_name].encode_batch(list(PROMPTS))
    # Exact: the same tokenizers and models run the same calls (measured max |diff| 0.0 in fp32 and bf16).
    for name, e, g in zip(("prompt_embed", "prompt_attention_mask", "pooled_prompt_embed"), expected, got):
        assert e.dtype == g.dtype and torch.equal(e, g), name


@pytest.mark.parametrize("model_name", ["pyramid_flux", "pyramid_mmdit"])
def test_shapes_masks_and_frozen(model_name, encoders):
    encoder = encoders[model_name]
    t5 = encoder.tokenizers[-1]
    features = encoder.encode(PROMPTS)
    for prompt, f in zip(PROMPTS, features):
        assert f.prompt_embed.shape == (128, 24) and f.pooled_prompt_embed.shape == (20,)
        assert f.prompt_embed.dtype == torch.float32 and f.prompt_attention_mask.dtype == torch.int64
        real = min(len(t5(prompt).input_ids), 128)   # the caption's tokens and its end token, cut at 128
        assert f.prompt_attention_mask.tolist() == [1] * real + [0] * (128 - real)
        assert f.caption_rows().shape == (real, 24)
    assert features[-1].prompt_attention_mask.all()   # the long caption is cut to 128 tokens
    for model in encoder.models:
        assert not model.training and not any(p.requires_grad for p in model.parameters())
    short = type(encoder)(PyramidTextConfig(t5_max_length=16), encoder.layout.folder)
    assert short.encode(PROMPTS[:1])[0].prompt_embed.shape == (16, 24)


def test_sd3_pools_clip_l_then_clip_g(encoders):
    encoder = encoders["pyramid_mmdit"]
    pooled = encoder.encode(PROMPTS[:1])[0].pooled_prompt_embed
    with torch.no_grad():
        for tokenizer, model, part in zip(encoder.tokenizers[:2], encoder.models[:2], (pooled[:10], pooled[10:])):
            # Both CLIPs pad to the CLIP-L tokenizer's length (77), as the original does.
            ids = tokenizer(PROMPTS[:1], padding="max_length", max_length=77, return_tensors="pt").input_ids
            torch.testing.assert_close(part, model(ids).text_embeds[0], rtol=0, atol=0)
    assert isinstance(encoder, SD3TextEncoder) and isinstance(build_text_encoder(
        PyramidTextConfig(), "pyramid_flux", encoders["pyramid_flux"].layout.folder), FluxTextEncoder)


@pytest.mark.parametrize("model_name", ["pyramid_flux", "pyramid_mmdit"])
def test_empty_features(model_name, encoders):
    encoder = encoders[model_name]
    empty = encoder.empty_features()
    assert encoder.empty_features() is empty                      # computed once
    assert empty.prompt_attention_mask.sum() == 1                 # T5's end token only
    alone = encoder.encode([""])[0]
    assert all(torch.equal(a, b) for a, b in zip(empty.tensors(), alone.tensors()))
    # What a dropped caption becomes inside a batch (as the original encodes "" online): the same
    # features up to fp32 batching order.
    in_batch = encoder.encode([PROMPTS[0], ""])[1]
    for a, b in zip(empty.tensors(), in_batch.tensors()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_dtype_rule(folders):
    assert PyramidTextConfig().dtype("cpu") == torch.float32
    assert PyramidTextConfig().dtype(torch.device("cuda", 0)) == torch.bfloat16
    assert PyramidTextConfig(text_encoder_dtype="fp32").dtype("cuda") == torch.float32
    bf16 = build_text_encoder(PyramidTextConfig(text_encoder_dtype="bf16"), "pyramid_flux", folders["pyramid_flux"])
    f = bf16.encode(PROMPTS[:1])[0]
    assert f.prompt_embed.dtype == f.pooled_prompt_embed.dtype == torch.bfloat16
    with pytest.raises(ConfigError) as err:
        build_dataclass(PyramidTextConfig, {"text_encoder_dtype": "fp16"})
    assert err.value.key == "text_encoder_dtype"


# ----------------------------------------------------------------------------------------------
# Feature files
# ----------------------------------------------------------------------------------------------

def test_feature_files_round_trip(encoders, tmp_path):
    features = encoders["pyramid_flux"].encode(PROMPTS[:2])
    path = tmp_path / "text_fea" / "a" / "0.pt"                 # folders are created
    save_features(features[0], path)
    raw = torch.load(path, weights_only=True)
    # The original's layout: each tensor with a leading batch dim of 1, not a view of the batch.
    assert sorted(raw) == ["pooled_prompt_embed", "prompt_attention_mask", "prompt_embed"]
    assert raw["prompt_embed"].shape == (1, 128, 24) and raw["prompt_attention_mask"].shape == (1, 128)
    assert raw["pooled_prompt_embed"].shape == (1, 20)
    assert raw["prompt_embed"].untyped_storage().nbytes() == 128 * 24 * 4
    assert [p.name for p in path.parent.iterdir()] == ["0.pt"]   # no temporary file left
    loaded = load_features(path, caption_width=24, pooled_width=20)
    assert all(torch.equal(a, b) for a, b in zip(loaded.tensors(), features[0].tensors()))
    # Without the batch dim, in bf16, with a bool mask: read as well.
    bare = {"prompt_embed": features[1].prompt_embed.bfloat16(), "pooled_prompt_embed": features[1].pooled_prompt_embed,
            "prompt_attention_mask": features[1].prompt_attention_mask.bool()}
    torch.save(bare, tmp_path / "bare.pt")
    loaded = load_features(tmp_path / "bare.pt")
    assert loaded.prompt_embed.dtype == torch.bfloat16 and loaded.prompt_attention_mask.dtype == torch.int64
    assert torch.equal(loaded.prompt_attention_mask, features[1].prompt_attention_mask)


def test_feature_file_refusals(encoders, tmp_path):
    f = encoders["pyramid_flux"].encode(PROMPTS[:1])[0]
    good = {"prompt_embed": f.prompt_embed[None], "prompt_attention_mask": f.prompt_attention_mask[None],
            "pooled_prompt_embed": f.pooled_prompt_embed[None]}
    cases = [
        ({k: v for k, v in good.items() if k != "pooled_prompt_embed"}, {}, "no tensor pooled_prompt_embed"),
        ({**good, "prompt_embed": torch.zeros(2, 128, 24)}, {}, r"shape \(2, 128, 24\)"),
        ({**good, "prompt_attention_mask": torch.ones(1, 64, dtype=torch.long)}, {}, "64 entries for 128 rows"),
        ({**good, "prompt_attention_mask": torch.full((1, 128), 0.5)}, {}, "not a 0/1 integer mask"),
        (good, {"caption_width": 4096}, "24 wide, the model takes 4096"),
        (good, {"pooled_width": 768}, "20 wide, the model takes 768"),
    ]
    for i, (payload, widths, words) in enumerate(cases):
        torch.save(payload, tmp_path / f"{i}.pt")
        with pytest.raises(TextFeatureFileError, match=words) as err:
            load_features(tmp_path / f"{i}.pt", **widths)
        assert f"{i}.pt" in str(err.value)
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    for name in ("junk.pt", "missing.pt"):
        with pytest.raises(TextFeatureFileError, match="cannot read text features"):
            load_features(tmp_path / name)


# ----------------------------------------------------------------------------------------------
# Refusals
# ----------------------------------------------------------------------------------------------

def test_layout_widths_and_dit_check(folders):
    layout = check_text_encoders(PyramidTextConfig(), "pyramid_mmdit", folders["pyramid_mmdit"])
    assert (layout.caption_width, layout.pooled_width, layout.key) == (24, 20, "model_path")
    check_dit_widths(layout, joint_attention_dim=24, pooled_projection_dim=20)
    with pytest.raises(ConfigError, match="`joint_attention_dim` is 4096.*`pooled_projection_dim` is 2048") as err:
        check_dit_widths(layout, joint_attention_dim=4096, pooled_projection_dim=2048)
    assert err.value.key == "model_path"


@needs_reference
def test_tiny_encoders_fit_the_fixture_dits(tmp_path):
    # The encoders the fixture tests pair with the fixture DiTs (pyramid_tiny.fixture_model_path and
    # the LoRA tests' SD3 folder) take their widths from each DiT's config.json, whatever the set.
    from pyramid_tiny import write_fixture_text_encoders

    for model_name, dit in (("pyramid_flux", "flux_dit"), ("pyramid_mmdit", "mmdit_dit")):
        dit_config = read_json(f"{dit}/diffusion_transformer_384p/config.json")
        folder = write_fixture_text_encoders(tmp_path / model_name, model_name)
        check_dit_widths(check_text_encoders(PyramidTextConfig(), model_name, folder),
                         joint_attention_dim=dit_config["joint_attention_dim"],
                         pooled_projection_dim=dit_config["pooled_projection_dim"])


def test_folder_refusals(folders, tmp_path):
    flux, mmdit = folders["pyramid_flux"], folders["pyramid_mmdit"]
    with pytest.raises(ConfigError, match="not a folder") as err:
        PyramidTextConfig(text_encoder_dir=str(tmp_path / "nowhere")).check(None)
    assert err.value.key == "text_encoder_dir"
    PyramidTextConfig(text_encoder_dir=str(flux)).check(None)

    # A flux folder has no text_encoder_3: the key that named the folder is blamed.
    with pytest.raises(ConfigError, match="text_encoder_3 has no config.json") as err:
        check_text_encoders(PyramidTextConfig(), "pyramid_mmdit", flux)
    assert err.value.key == "model_path"
    with pytest.raises(ConfigError) as err:
        check_text_encoders(PyramidTextConfig(text_encoder_dir=str(flux)), "pyramid_mmdit", tmp_path)
    assert err.value.key == "text_encoder_dir"
    with pytest.raises(ConfigError, match="pyramid_flux, pyramid_mmdit") as err:
        check_text_encoders(PyramidTextConfig(), "pan", flux)
    assert err.value.key == "model_name"

    swapped = copy_folder(flux, tmp_path / "swapped")   # T5 where CLIP-L belongs
    shutil.rmtree(swapped / "text_encoder")
    shutil.copytree(flux / "text_encoder_2", swapped / "text_encoder")
    with pytest.raises(ConfigError, match="holds a `t5` model.*needs a CLIP-L"):
        check_text_encoders(PyramidTextConfig(), "pyramid_flux", swapped)

    unprojected = copy_folder(mmdit, tmp_path / "unprojected")   # SD3 needs the text projection
    shutil.rmtree(unprojected / "text_encoder_2")
    write_clip(unprojected / "text_encoder_2", vocab_size=600, hidden_size=12, projection_dim=None,
               pad_token_id=0, seed=0)
    with pytest.raises(ConfigError, match="without the text projection"):
        check_text_encoders(PyramidTextConfig(), "pyramid_mmdit", unprojected)

    no_weights = copy_folder(flux, tmp_path / "no_weights")
    for f in (no_weights / "text_encoder_2").glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ConfigError, match="no weights"):
        check_text_encoders(PyramidTextConfig(), "pyramid_flux", no_weights)

    no_tokenizer = copy_folder(flux, tmp_path / "no_tokenizer")
    shutil.rmtree(no_tokenizer / "tokenizer_2")
    with pytest.raises(ConfigError, match="holds no T5 tokenizer"):
        FluxTextEncoder(PyramidTextConfig(), no_tokenizer)

    no_length = copy_folder(flux, tmp_path / "no_length")   # padding to "max length" needs a length
    config_path = no_length / "tokenizer" / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    del config["model_max_length"]
    config_path.write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="model_max_length"):
        check_text_encoders(PyramidTextConfig(), "pyramid_flux", no_length)
    config_path.write_text(json.dumps({**config, "model_max_length": 100}))   # CLIP has 77 positions
    with pytest.raises(ConfigError, match="pads captions to 100 tokens.*only 77 positions"):
        check_text_encoders(PyramidTextConfig(), "pyramid_flux", no_length)


# ----------------------------------------------------------------------------------------------
# One rank encodes for its group
# ----------------------------------------------------------------------------------------------

def _share_encoder(folder: str) -> dict:
    """Rank 0 holds the encoder; every rank gets features of its own captions."""
    rank = torch.distributed.get_rank()
    encoder = build_text_encoder(PyramidTextConfig(), "pyramid_flux", folder) if rank == 0 else None
    mine = [PROMPTS[:1], PROMPTS[1:]][rank]                       # 1 and 3 captions: padded scatter
    features = encode_on_one_rank(mine, encoder)
    only_rank1 = encode_on_one_rank([] if rank == 0 else PROMPTS[:2], encoder)
    nobody = encode_on_one_rank([], encoder)
    empty = broadcast_features([encoder.empty_features()] if rank == 0 else None)
    return {"features": [f.tensors() for f in features], "only_rank1": [f.tensors() for f in only_rank1],
            "nobody": nobody, "empty": [f.tensors() for f in empty]}


def test_one_rank_encodes_for_the_group(folders, encoders):
    results = run_distributed(_share_encoder, world_size=2, args=(str(folders["pyramid_flux"]),))
    local = encoders["pyramid_flux"]
    # Exact: rank 0 encodes every rank's captions in one batch, in rank order; the same batch here.
    expected = local.encode(PROMPTS)
    assert len(results[0]["features"]) == 1 and len(results[1]["features"]) == 3
    for got, want in zip(results[0]["features"] + results[1]["features"], expected):
        assert all(torch.equal(g, w) for g, w in zip(got, want.tensors()))
    assert results[0]["only_rank1"] == []
    for got, want in zip(results[1]["only_rank1"], local.encode(PROMPTS[:2])):
        assert all(torch.equal(g, w) for g, w in zip(got, want.tensors()))
    assert results[0]["nobody"] == results[1]["nobody"] == []
    for r in results:
        assert all(torch.equal(g, w) for g, w in zip(r["empty"][0], local.empty_features().tensors()))

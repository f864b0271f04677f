"""Frozen encoders: the real MiniLM, a tiny random Qwen3 with a chat template, and tiny Wan VAEs."""

import json
from types import SimpleNamespace

import pytest
import torch
from diffusers import AutoencoderKLHunyuanVideo, AutoencoderKLWan
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModel, AutoTokenizer, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from pan.config.core import ConfigError
from pan.encoders.text import (DEFAULT_SYSTEM_MESSAGE, TextEncoder, TextEncoderConfig,
                               resolve_text_encoder_path)
from pan.encoders.vae import IdentityVAE, VAEConfig, VAEGeometry, build_vae, vae_geometry

PROMPTS = ["a cat plays the piano in a sunny room", "", "the camera pans over a quiet harbour at dusk"]

# A Qwen-style chat template: <|im_start|>role\ncontent<|im_end|>\n per message.
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


# ----------------------------------------------------------------------------------------------
# Fixtures
# ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def minilm() -> TextEncoder:
    return TextEncoder(TextEncoderConfig())


@pytest.fixture(scope="module")
def minilm_reference():
    """The packaged MiniLM loaded directly with transformers, to compare against."""
    model_dir = resolve_text_encoder_path("minilm")
    return AutoTokenizer.from_pretrained(model_dir), AutoModel.from_pretrained(model_dir).eval()


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    """A tiny random Qwen3 causal LM and a BPE tokenizer with a chat template, saved locally."""
    path = tmp_path_factory.mktemp("tiny_qwen3")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(PROMPTS + [DEFAULT_SYSTEM_MESSAGE, "system user assistant"], trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=bpe.get_vocab_size(), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         max_position_embeddings=512)
    Qwen3ForCausalLM(config).save_pretrained(path)
    return path


def save_tiny_wan(path, **overrides) -> AutoencoderKLWan:
    """A tiny random AutoencoderKLWan with non-trivial latent statistics, saved to `path`."""
    torch.manual_seed(0)
    kwargs = dict(base_dim=16, z_dim=4, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
                  temperal_downsample=[False, True, True],
                  latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[2.0, 0.5, 1.0, 1.5])
    kwargs.update(overrides)
    model = AutoencoderKLWan(**kwargs).eval()
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_wan")
    return path, save_tiny_wan(path)


def clip(num_frames: int, height: int, width: int) -> torch.Tensor:
    torch.manual_seed(1)
    return torch.rand(num_frames, 3, height, width) * 2 - 1


# ----------------------------------------------------------------------------------------------
# Text encoder: MiniLM
# ----------------------------------------------------------------------------------------------

def test_minilm_features_are_the_skipped_hidden_state(minilm, minilm_reference):
    tokenizer, model = minilm_reference
    assert minilm.dim == 384
    features = minilm.encode(PROMPTS)
    for prompt, feat in zip(PROMPTS, features):
        ids = tokenizer(prompt or " ", return_tensors="pt")
        with torch.no_grad():
            hidden = model(**ids, output_hidden_states=True).hidden_states
        assert feat.shape == (ids["input_ids"].shape[1], 384)  # one row per token, no padding rows
        torch.testing.assert_close(feat, hidden[-3][0], rtol=1e-5, atol=1e-5)  # skip 2 = hidden_states[-3]
        assert not torch.allclose(feat, hidden[-1][0], atol=1e-3)


@pytest.mark.parametrize("skip", [0, 5, 6])  # 6 = MiniLM's token embeddings (hidden_states[0])
def test_minilm_skip_layer_values(skip, minilm_reference):
    tokenizer, model = minilm_reference
    encoder = TextEncoder(TextEncoderConfig(text_encoder_hidden_state_skip_layer=skip))
    ids = tokenizer(PROMPTS[0], return_tensors="pt")
    with torch.no_grad():
        expected = model(**ids, output_hidden_states=True).hidden_states[-(skip + 1)][0]
    torch.testing.assert_close(encoder.encode(PROMPTS[:1])[0], expected, rtol=1e-5, atol=1e-5)


def test_minilm_is_frozen_and_truncates(minilm):
    assert not minilm.model.training
    assert not any(p.requires_grad for p in minilm.model.parameters())
    short = TextEncoder(TextEncoderConfig(text_encoder_max_length=5))
    assert short.encode(["one two three four five six seven eight"])[0].shape == (5, 384)


def test_empty_prompt_is_a_space_and_cached(minilm):
    empty = minilm.empty_embedding()
    torch.testing.assert_close(empty, minilm.encode([" "])[0])
    assert empty.shape == (2, 384)  # [CLS] [SEP]
    assert minilm.empty_embedding() is empty


def test_text_encoder_config_errors(tmp_path):
    too_deep = TextEncoderConfig(text_encoder_hidden_state_skip_layer=7)  # MiniLM has 6 layers: 0-6
    with pytest.raises(ConfigError, match="only 6 layers") as err:
        too_deep.check(None)
    assert err.value.key == "text_encoder_hidden_state_skip_layer"
    with pytest.raises(ConfigError, match="only 6 layers"):
        TextEncoder(too_deep)
    TextEncoderConfig(text_encoder_hidden_state_skip_layer=6).check(None)  # the token embeddings
    with pytest.raises(ConfigError, match="at most 512"):
        TextEncoderConfig(text_encoder_max_length=1536).check(None)
    with pytest.raises(ConfigError, match="no chat template"):
        TextEncoderConfig(text_encoder_chat_template=True).check(None)
    # A hub id is not a local dir: refused at once, nothing is downloaded.
    for path in ("Qwen/Qwen3-0.6B", str(tmp_path)):
        with pytest.raises(ConfigError, match="not a local Hugging Face model dir") as err:
            TextEncoderConfig(text_encoder_path=path).check(None)
        assert err.value.key == "text_encoder_path"


# ----------------------------------------------------------------------------------------------
# Text encoder: tiny Qwen3 with a chat template
# ----------------------------------------------------------------------------------------------

def test_qwen_chat_template_crops_after_user_header(qwen_dir):
    system = "You describe videos."
    encoder = TextEncoder(TextEncoderConfig(text_encoder_path=str(qwen_dir), text_encoder_chat_template=system,
                                            text_encoder_hidden_state_skip_layer=1))
    assert encoder.dim == 32
    tokenizer = encoder.tokenizer
    header = f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n"
    header_len = len(tokenizer(header, add_special_tokens=False)["input_ids"])
    features = encoder.encode(PROMPTS)
    for prompt, feat in zip(PROMPTS, features):
        full = tokenizer(f"{header}{prompt or ' '}<|im_end|>\n", add_special_tokens=False,
                         return_tensors="pt")["input_ids"]
        kept = full[0, header_len:]
        # The kept tokens are exactly the prompt and its end-of-turn: no system message, no header.
        assert tokenizer.decode(kept) == f"{prompt or ' '}<|im_end|>\n"
        with torch.no_grad():
            hidden = encoder.model(input_ids=full, output_hidden_states=True).hidden_states[-2][0]
        # Batched, right-padded features equal an unpadded run on the whole chat, cropped.
        torch.testing.assert_close(feat, hidden[header_len:], rtol=1e-5, atol=1e-5)


def test_qwen_default_system_message_and_max_length(qwen_dir):
    on = TextEncoder(TextEncoderConfig(text_encoder_path=str(qwen_dir), text_encoder_chat_template=True,
                                       text_encoder_max_length=4))
    ids, start = on.tokenize(PROMPTS[0])
    assert DEFAULT_SYSTEM_MESSAGE in on.tokenizer.decode(ids[:start])
    assert on.encode(PROMPTS[:1])[0].shape == (4, 32)
    off = TextEncoder(TextEncoderConfig(text_encoder_path=str(qwen_dir), text_encoder_chat_template=False))
    ids, start = off.tokenize(PROMPTS[0])
    assert start == 0 and off.tokenizer.decode(ids) == PROMPTS[0]
    with pytest.raises(ConfigError, match="only 3 layers"):
        TextEncoderConfig(text_encoder_path=str(qwen_dir), text_encoder_hidden_state_skip_layer=4).check(None)


# ----------------------------------------------------------------------------------------------
# VAE
# ----------------------------------------------------------------------------------------------

def test_identity_round_trip():
    vae = build_vae(VAEConfig())
    assert isinstance(vae, IdentityVAE)
    assert (vae.latent_channels, vae.temporal_factor, vae.spatial_factor) == (3, 1, 1)
    frames = clip(6, 8, 10)
    latent = vae.encode(frames)
    assert latent.shape == vae.latent_shape(6, 8, 10) == (3, 6, 8, 10)
    torch.testing.assert_close(vae.decode(latent), frames, rtol=0, atol=0)


def test_wan_encode_normalises_and_decode_inverts(wan):
    path, model = wan
    vae = build_vae(VAEConfig(vae_type="diffusers", vae_path=str(path)))
    assert (vae.latent_channels, vae.temporal_factor, vae.spatial_factor) == (4, 4, 8)
    assert not any(p.requires_grad for p in vae.model.parameters())
    mean = torch.tensor([0.1, -0.2, 0.3, 0.0]).view(4, 1, 1, 1)
    std = torch.tensor([2.0, 0.5, 1.0, 1.5]).view(4, 1, 1, 1)
    for num_frames in (9, 1):  # a video and an image (one frame)
        frames = clip(num_frames, 64, 48)
        latent = vae.encode(frames)
        assert latent.shape == vae.latent_shape(num_frames, 64, 48)
        assert latent.shape == (4, (num_frames - 1) // 4 + 1, 8, 6)
        with torch.no_grad():
            raw = model.encode(frames.permute(1, 0, 2, 3)[None]).latent_dist.mode()[0]
            pixels = model.decode(raw[None]).sample[0].permute(1, 0, 2, 3)
        torch.testing.assert_close(latent, (raw - mean) / std, rtol=1e-5, atol=1e-5)
        decoded = vae.decode(latent)
        assert decoded.shape == frames.shape
        torch.testing.assert_close(decoded, pixels, rtol=1e-4, atol=1e-4)


def test_wan22_style_patchified_vae_is_16x(tmp_path):
    save_tiny_wan(tmp_path, is_residual=True, patch_size=2, in_channels=12, out_channels=12,
                  scale_factor_spatial=16)
    vae = build_vae(VAEConfig(vae_type="diffusers", vae_path=str(tmp_path)))
    assert vae.spatial_factor == 16
    assert vae.encode(clip(5, 32, 64)).shape == vae.latent_shape(5, 32, 64) == (4, 2, 2, 4)


def test_frame_rule():
    wan = VAEGeometry(latent_channels=48, temporal_factor=4, spatial_factor=16)
    assert wan.latent_shape(121, 704, 1248) == (48, 31, 44, 78)
    assert wan.clip_shape_error(241, 704, 1248) is None
    assert "(T - 1) % 4 == 0" in wan.clip_shape_error(120, 704, 1248)
    assert "multiples of 16" in wan.clip_shape_error(121, 700, 1248)
    with pytest.raises(ValueError, match="frame count"):
        wan.latent_shape(8, 64, 64)


def test_vae_encode_rejects_bad_clip(wan):
    vae = build_vae(VAEConfig(vae_type="diffusers", vae_path=str(wan[0])))
    with pytest.raises(ValueError, match=r"\(T - 1\) % 4"):
        vae.encode(clip(8, 64, 64))


def test_vae_config_errors(wan, tmp_path):
    path = str(wan[0])
    cases = [
        (VAEConfig(vae_path=path), "vae_path", "does nothing"),
        (VAEConfig(vae_spatial_factor=8), "vae_spatial_factor", "does nothing"),
        (VAEConfig(vae_type="diffusers"), "vae_path", "is required"),
        (VAEConfig(vae_type="diffusers", vae_path=str(tmp_path)), "vae_path", "no config.json"),
        (VAEConfig(vae_type="diffusers", vae_path=path, vae_class="LlamaModel"), "vae_class", "not a diffusers"),
        (VAEConfig(vae_type="diffusers", vae_path=path, vae_temporal_factor=8), "vae_temporal_factor", "says 4"),
    ]
    for cfg, key, words in cases:
        with pytest.raises(ConfigError, match=words) as err:
            cfg.check(SimpleNamespace(explicit_keys=set()))
        assert err.value.key == key
    with pytest.raises(ConfigError, match="does nothing") as err:
        VAEConfig().check(SimpleNamespace(explicit_keys={"vae_class"}))
    assert err.value.key == "vae_class"
    # A key that agrees with the VAE config is accepted.
    VAEConfig(vae_type="diffusers", vae_path=path, vae_temporal_factor=4).check(SimpleNamespace(explicit_keys=set()))


def test_vae_latent_stats_must_match_channels(tmp_path):
    save_tiny_wan(tmp_path, latents_mean=[0.0] * 3, latents_std=[1.0] * 3)
    with pytest.raises(ConfigError, match="3 latents_mean"):
        vae_geometry(VAEConfig(vae_type="diffusers", vae_path=str(tmp_path)))


def test_generic_diffusers_vae_uses_config_ratios_and_scaling_factor(tmp_path):
    torch.manual_seed(0)
    model = AutoencoderKLHunyuanVideo(latent_channels=4, block_out_channels=(8, 16, 32, 32), layers_per_block=1,
                                      norm_num_groups=4, scaling_factor=0.5, mid_block_add_attention=False).eval()
    model.save_pretrained(tmp_path)
    vae = build_vae(VAEConfig(vae_type="diffusers", vae_path=str(tmp_path), vae_class="AutoencoderKLHunyuanVideo"))
    frames = clip(5, 32, 32)
    latent = vae.encode(frames)
    assert latent.shape == vae.latent_shape(5, 32, 32) == (4, 2, 4, 4)
    with torch.no_grad():
        raw = model.encode(frames.permute(1, 0, 2, 3)[None]).latent_dist.mode()[0]
    torch.testing.assert_close(latent, raw * 0.5, rtol=1e-5, atol=1e-5)  # no latents_mean: scaling_factor


def test_factor_keys_fill_in_what_the_vae_config_lacks(tmp_path):
    # CogVideoX's config names its temporal but not its spatial compression.
    (tmp_path / "config.json").write_text(json.dumps(
        {"_class_name": "AutoencoderKLCogVideoX", "latent_channels": 16, "temporal_compression_ratio": 4}))
    (tmp_path / "diffusion_pytorch_model.safetensors").write_bytes(b"")
    cfg = dict(vae_type="diffusers", vae_path=str(tmp_path), vae_class="AutoencoderKLCogVideoX")
    with pytest.raises(ConfigError, match="does not say it") as err:
        vae_geometry(VAEConfig(**cfg))
    assert err.value.key == "vae_spatial_factor"
    assert vae_geometry(VAEConfig(**cfg, vae_spatial_factor=8)) == VAEGeometry(
        latent_channels=16, temporal_factor=4, spatial_factor=8)

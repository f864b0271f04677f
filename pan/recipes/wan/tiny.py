"""Tiny Wan diffusers folders, written by diffusers itself: the demo's (`pan demo --recipe wan`) and the
tests' (tests/wan_tiny.py), laid out exactly as a released `*-Diffusers` repository.

    pipe = build_pipeline(tokenizer, text=dict(d_model=16, ...), vae=dict(z_dim=4, ...),
                          transformer=dict(num_layers=2, ...), seed=0)
    pipe.save_pretrained(folder)      # model_index.json, transformer/ [+ transformer_2/], vae/, text_encoder/,
                                      # tokenizer/, scheduler/

The parts: transformers' `UMT5EncoderModel` (`text`: its config keys) with the given tokenizer;
diffusers' `AutoencoderKLWan` (`vae`: its config keys, or a built model such as `pixel_vae()`);
diffusers' `WanTransformer3DModel` per expert (`transformer`: its keys; in/out channels and text_dim
come from the VAE and the text encoder); `UniPCMultistepScheduler` with flow sigmas and `flow_shift`
(what the releases ship). Seeded: the same folder every time.

What the demo adds, so that a model trained for minutes on a CPU can show what it learnt:

- `word_tokenizer`: a T5 unigram tokenizer whose pieces are the words of a caption corpus, so a caption
  reaches the text encoder word by word (a unigram trainer on a few dozen captions keeps single
  characters, and a caption becomes ~25 tokens whose embeddings say little);
- a umT5 of no layers (`text=dict(num_layers=0, ...)`): its features are the token embeddings after the
  final RMSNorm, one fixed random vector per word, which the transformer's cross-attention learns to
  read (the Pan demo reads MiniLM's token embeddings for the same reason, docs/demo.md);
- `pixel_vae`: an `AutoencoderKLWan` with no compression in space or time whose weights make it a
  codec of the pixels themselves (latent = RGB in [-1, 1], to ~1e-6), the Wan form of the identity VAE
  the other demos train in: a random VAE's decoder would draw noise whatever the transformer learnt.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from torch import nn

from pan.recipes.wan.model import WanTransformer
from pan.recipes.wan.weights import config_from_dict

WORD_START = "\u2581"          # sentencepiece's word-start mark
SPECIAL_PIECES = ("<pad>", "</s>", "<unk>")    # ids 0, 1, 2: what umT5's tokenizer and config expect
# pixel_vae: the constant channel that keeps the codec's RMS norms linear (see pixel_vae)
PIXEL_VAE_CONSTANT = 1.0e3
PIXEL_VAE_LOGVAR = -30.0       # diffusers clamps the log-variance here: sampling the posterior = its mode


def perturbed(model: nn.Module, seed: int, scale: float = 0.1) -> nn.Module:
    """`model` with every parameter moved by seeded N(0, scale^2) noise (no tensor a plain 0 or 1)."""
    with torch.random.fork_rng(), torch.no_grad():
        torch.manual_seed(seed)
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))
    return model


def word_tokenizer(corpus: Iterable[str], model_max_length: int = 512):
    """A T5 unigram tokenizer (`<pad>` 0, `</s>` 1, `<unk>` 2) whose pieces are the corpus's words,
    scored by their frequency, then its single characters, each scored below any word: a corpus word
    is always one piece, other text falls back to characters."""
    from transformers import T5Tokenizer

    texts = list(corpus)
    counts = Counter(WORD_START + word for text in texts for word in text.split())
    total = sum(counts.values())
    pieces = [(piece, 0.0) for piece in SPECIAL_PIECES]
    pieces += [(word, math.log(n / total)) for word, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
    floor = math.log(1 / total) - 10.0
    characters = sorted({c for text in texts for c in text if not c.isspace()} | {WORD_START})
    pieces += [(c, floor) for c in characters if c not in counts]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=model_max_length)


def pixel_vae(latents_mean: Sequence[float], latents_std: Sequence[float], width: int = 8, place: bool = False):
    """An `AutoencoderKLWan` (Wan 2.1 layout: no spatial or temporal compression, one resolution level)
    that encodes RGB frames in [-1, 1] as themselves and decodes them back, to ~1e-6.

    How: every residual branch (each residual block's last conv, each attention block's output
    projection) is zero, so the blocks pass their input through. The first conv of the encoder and of
    the decoder writes (v, -v, K) on its channels (v: the three values of a pixel, K a constant); the
    closing RMS norm divides by the channels' norm sqrt(2|v|^2 + K^2) = K (1 + O(|v|^2 / K^2)) and its
    gains multiply by K again; SiLU(a) - SiLU(-a) = a exactly, so the last conv takes the difference of
    the v and -v channels. 1x1 quant convs are identities; the log-variance is diffusers' floor.

    `place`: a fourth latent channel, the share of each pixel's 3 x 3 x 3 causal neighbourhood that lies
    inside the clip (the encoder's last conv over the constant channel, zero-padded): lower on the
    frame's border and in the first two frames, as a real Wan VAE's zero-padded convolutions and its
    single-frame first chunk make border and first-frame latents differ. The decoder ignores it.
    `latents_mean` / `latents_std` (one per latent channel) normalise the latents as a release's
    statistics do."""
    from diffusers import AutoencoderKLWan

    z = 4 if place else 3
    if width < 7:
        raise ValueError(f"width {width}: the codec needs 7 channels (v, -v, the constant)")
    if len(latents_mean) != z or len(latents_std) != z:
        raise ValueError(f"latents_mean and latents_std: one value per latent channel ({z})")
    vae = AutoencoderKLWan(base_dim=width, z_dim=z, dim_mult=[1], num_res_blocks=1, temperal_downsample=[],
                           scale_factor_temporal=1, scale_factor_spatial=1, latents_mean=list(latents_mean),
                           latents_std=list(latents_std))
    with torch.no_grad():
        for module in vae.modules():
            name = type(module).__name__
            if name == "WanResidualBlock":
                nn.init.zeros_(module.conv2.weight)
                nn.init.zeros_(module.conv2.bias)
            elif name == "WanAttentionBlock":
                nn.init.zeros_(module.proj.weight)
                nn.init.zeros_(module.proj.bias)
        for coder in (vae.encoder, vae.decoder):
            _split_signs(coder.conv_in)
            _take_difference(coder.norm_out, coder.conv_out)
        # the encoder's head gives (mean, log-variance): the mean as above, the log-variance at the floor
        conv_out = vae.encoder.conv_out
        conv_out.weight[z:] = 0.0
        conv_out.bias[z:] = PIXEL_VAE_LOGVAR
        if place:   # the constant channel, normalised to K / |x| ~ 1, through SiLU, summed over the kernel
            vae.encoder.norm_out.gamma[6] = 1.0 / math.sqrt(width)
            conv_out.weight[3, 6] = 1.0 / (conv_out.weight[3, 6].numel() * torch.nn.functional.silu(torch.tensor(1.0)))
        for quant in (vae.quant_conv, vae.post_quant_conv):
            quant.weight.zero_()
            quant.weight[:, :, 0, 0, 0] = torch.eye(quant.weight.shape[0])
            quant.bias.zero_()
    return vae.eval()


def _split_signs(conv) -> None:
    """A causal conv (3 -> width channels) that writes (v, -v, K, 0...) from the current frame's pixel."""
    conv.weight.zero_()
    conv.bias.zero_()
    now, centre = conv.weight.shape[2] - 1, conv.weight.shape[3] // 2     # causal: the last time tap
    for c in range(3):
        conv.weight[c, c, now, centre, centre] = 1.0
        conv.weight[3 + c, c, now, centre, centre] = -1.0
    conv.bias[6] = PIXEL_VAE_CONSTANT


def _take_difference(norm, conv) -> None:
    """The RMS norm's gains undo its division by ~K on the v channels (0 on the rest); the conv then
    reads SiLU(v) - SiLU(-v) = v for its first three outputs."""
    width = norm.gamma.shape[0]
    norm.gamma.zero_()
    norm.gamma[:6] = PIXEL_VAE_CONSTANT / math.sqrt(width)
    conv.weight.zero_()
    conv.bias.zero_()
    now, centre = conv.weight.shape[2] - 1, conv.weight.shape[3] // 2
    for c in range(3):
        conv.weight[c, c, now, centre, centre] = 1.0
        conv.weight[c, 3 + c, now, centre, centre] = -1.0


def build_pipeline(tokenizer, *, text: dict, vae: dict | nn.Module, transformer: dict, experts: int = 1,
                   boundary_ratio: float | None = None, expand_timesteps: bool = False, flow_shift: float = 3.0,
                   seed: int = 0, perturb: bool = True, wan_init: bool = False):
    """A tiny `WanPipeline`, not yet written. `text`: UMT5Config keys; `vae`: AutoencoderKLWan keys (a
    seeded random VAE) or a built VAE (used as it is); `transformer`: WanTransformer3DModel keys, less
    the channels and text_dim. `perturb`: move every random part's parameters by seeded noise (the
    tests: no zero bias or unit norm left untested); `wan_init`: give each transformer Wan's init for
    training from scratch (pan's `WanTransformer.init_weights`: zero output layer, xavier linears)
    instead of diffusers' constructor's."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    def moved(model: nn.Module, offset: int) -> nn.Module:
        return perturbed(model, seed + offset) if perturb else model

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        text_config = UMT5Config(vocab_size=len(tokenizer), **text, relative_attention_num_buckets=8,
                                 relative_attention_max_distance=32, feed_forward_proj="gated-gelu",
                                 is_encoder_decoder=False, use_cache=False, pad_token_id=tokenizer.pad_token_id,
                                 eos_token_id=tokenizer.eos_token_id)
        text_encoder = UMT5EncoderModel(text_config).eval()
        if isinstance(vae, dict):
            vae = moved(AutoencoderKLWan(**vae), 1).eval()
        z = vae.config.z_dim
        models = [moved(WanTransformer3DModel(**transformer, in_channels=z, out_channels=z,
                                              text_dim=text["d_model"]), 10 + i) for i in range(experts)]
        if wan_init:
            for model in models:
                model.load_state_dict(wan_initial_state(model.config))
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        num_train_timesteps=1000, flow_shift=flow_shift)
    return WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler,
                       transformer=models[0], transformer_2=models[1] if experts > 1 else None,
                       boundary_ratio=boundary_ratio, expand_timesteps=expand_timesteps)


def wan_initial_state(config) -> dict[str, torch.Tensor]:
    """The state dict of pan's WanTransformer for a diffusers config, initialised as Wan trains from
    scratch (drawn from the current RNG)."""
    keys = {k: v for k, v in dict(config).items() if not k.startswith("_")}
    return WanTransformer(config_from_dict(keys)).state_dict()


def write_folder(pipe, folder: str | Path) -> Path:
    """`pipe` written with `save_pretrained` into `folder` (created); returns it."""
    folder = Path(folder)
    pipe.save_pretrained(folder)
    return folder

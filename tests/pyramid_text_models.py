"""Tiny random Pyramid-Flow text encoders, saved as the released `model_path` lays them out.

    write_pyramid_text_encoders(folder, "pyramid_flux")    # text_encoder/ (CLIP-L), text_encoder_2/ (T5)
    write_pyramid_text_encoders(folder, "pyramid_mmdit")   # + CLIP-G: text_encoder_2/, T5: text_encoder_3/

Each `text_encoder*/` is a transformers `save_pretrained` folder (config.json + safetensors) and each
`tokenizer*/` holds the files the release ships: CLIP tokenizers as `vocab.json` + `merges.txt` +
`tokenizer_config.json` (no tokenizer.json), the T5 tokenizer as `tokenizer.json`. Vocabularies are
trained on a small caption corpus with the `tokenizers` library (CLIP's byte-level BPE with `</w>`
word ends and the start/end tokens last, T5's unigram with `<pad>`, `</s>`, `<unk>` first), so
captions tokenize into real sub-words rather than unknowns.

The default widths fit the DiT fixtures of `../shared/reference/pyramid_flow` (caption features 24 =
`joint_attention_dim`, pooled 20 = `pooled_projection_dim`); a test that pairs them with a DiT should
pass that DiT's widths. Weights are the models' own random init under a fixed seed.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

# transformers is imported in the functions that use it: a test module importing this one stays light
# for worker processes that never build a model.

CORPUS = [
    "a cat plays the piano in a sunny room",
    "the camera pans over a quiet harbour at dusk",
    "a red square moving left, a green circle moving right",
    "a blue triangle moving up and a yellow star moving down",
    "slow motion waves crash on the rocks under a grey sky",
    "the quick brown fox jumps over the lazy dog",
]
CLIP_BOS, CLIP_EOS = "<|startoftext|>", "<|endoftext|>"
# CLIP's pre-tokenizer split (the words, digits and punctuation runs it byte-encodes).
CLIP_SPLIT = r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""
CLIP_MAX_LENGTH = 77  # the released CLIP tokenizers' model_max_length


def write_clip_tokenizer(folder: Path, *, pad_token: str = CLIP_EOS,
                         model_max_length: int | None = CLIP_MAX_LENGTH) -> int:
    """A CLIP BPE tokenizer in `folder` (vocab.json, merges.txt, tokenizer_config.json); its vocab size.

    FLUX's and SD3's CLIP-L pad with the end token, SD3's CLIP-G (`tokenizer_2`) with "!".
    `model_max_length=None` leaves it out of the config (a misfit the encoders refuse)."""
    bpe = Tokenizer(models.BPE(end_of_word_suffix="</w>", unk_token=CLIP_EOS))
    bpe.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "),
                                           normalizers.Lowercase()])
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(CLIP_SPLIT), behavior="removed", invert=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    trainer = trainers.BpeTrainer(vocab_size=600, end_of_word_suffix="</w>",
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(CORPUS, trainer)
    learned = json.loads(bpe.to_str())["model"]
    # CLIP's order: every byte, every byte ending a word, the merges, then start and end last (the
    # end token has the largest id, which CLIP's legacy pooling relies on).
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    base = alphabet + [c + "</w>" for c in alphabet]
    tokens = base + [t for t in learned["vocab"] if t not in set(base)] + [CLIP_BOS, CLIP_EOS]
    merges = [" ".join(m) if isinstance(m, list) else m for m in learned["merges"]]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(tokens)}))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    config = {"tokenizer_class": "CLIPTokenizer", "bos_token": CLIP_BOS, "eos_token": CLIP_EOS,
              "unk_token": CLIP_EOS, "pad_token": pad_token}
    if model_max_length is not None:
        config["model_max_length"] = model_max_length
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return len(tokens)


def write_t5_tokenizer(folder: Path) -> int:
    """A T5 unigram tokenizer in `folder` (tokenizer.json, tokenizer_config.json); its vocab size."""
    unigram = Tokenizer(models.Unigram())
    unigram.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    trainer = trainers.UnigramTrainer(vocab_size=300, special_tokens=["<pad>", "</s>", "<unk>"],
                                      unk_token="<unk>")
    unigram.train_from_iterator(CORPUS, trainer)
    from transformers import T5Tokenizer
    pieces = [tuple(p) for p in json.loads(unigram.to_str())["model"]["vocab"]]
    tokenizer = T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=512)
    tokenizer.save_pretrained(folder)
    return len(tokenizer)


def write_clip(folder: Path, *, vocab_size: int, hidden_size: int, projection_dim: int | None,
               pad_token_id: int, seed: int, hidden_act: str = "quick_gelu") -> None:
    """A tiny CLIP text tower: `CLIPTextModelWithProjection` when `projection_dim` is given (SD3's
    CLIP-L / CLIP-G), else `CLIPTextModel` (FLUX's CLIP-L)."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection
    heads = 2 if hidden_size % 2 == 0 else 1   # any width a DiT's pooled_projection_dim asks for
    config = CLIPTextConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                            num_hidden_layers=2, num_attention_heads=heads, max_position_embeddings=CLIP_MAX_LENGTH,
                            hidden_act=hidden_act, projection_dim=projection_dim or hidden_size,
                            bos_token_id=vocab_size - 2, eos_token_id=vocab_size - 1, pad_token_id=pad_token_id)
    cls = CLIPTextModel if projection_dim is None else CLIPTextModelWithProjection
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        cls(config).save_pretrained(folder)


def write_t5(folder: Path, *, vocab_size: int, d_model: int, seed: int) -> None:
    """A tiny T5 v1.1-style encoder (gated GELU, relative position buckets)."""
    from transformers import T5Config, T5EncoderModel
    config = T5Config(vocab_size=vocab_size, d_model=d_model, d_kv=8, d_ff=2 * d_model, num_layers=2,
                      num_heads=2, relative_attention_num_buckets=8, relative_attention_max_distance=32,
                      feed_forward_proj="gated-gelu", is_encoder_decoder=False, use_cache=False)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        T5EncoderModel(config).save_pretrained(folder)


def write_flux_text_encoders(folder: Path, *, pooled_width: int = 20, caption_width: int = 24) -> Path:
    """`pyramid_flux`'s encoders: CLIP-L (`CLIPTextModel`, pooled width = its hidden size) + T5."""
    folder = Path(folder)
    clip_vocab = write_clip_tokenizer(folder / "tokenizer")
    write_clip(folder / "text_encoder", vocab_size=clip_vocab, hidden_size=pooled_width, projection_dim=None,
               pad_token_id=clip_vocab - 1, seed=1)
    write_t5(folder / "text_encoder_2", vocab_size=write_t5_tokenizer(folder / "tokenizer_2"),
             d_model=caption_width, seed=2)
    return folder


def write_sd3_text_encoders(folder: Path, *, clip_l_width: int = 8, clip_g_width: int = 12,
                            caption_width: int = 24) -> Path:
    """`pyramid_mmdit`'s encoders: CLIP-L and CLIP-G (`CLIPTextModelWithProjection`, pooled width =
    the sum of their projections) + T5."""
    folder = Path(folder)
    clip_vocab = write_clip_tokenizer(folder / "tokenizer")
    write_clip(folder / "text_encoder", vocab_size=clip_vocab, hidden_size=16, projection_dim=clip_l_width,
               pad_token_id=clip_vocab - 1, seed=1)
    clip_g_vocab = write_clip_tokenizer(folder / "tokenizer_2", pad_token="!")
    write_clip(folder / "text_encoder_2", vocab_size=clip_g_vocab, hidden_size=24, projection_dim=clip_g_width,
               pad_token_id=0, seed=2, hidden_act="gelu")
    write_t5(folder / "text_encoder_3", vocab_size=write_t5_tokenizer(folder / "tokenizer_3"),
             d_model=caption_width, seed=3)
    return folder


def write_pyramid_text_encoders(folder: Path, model_name: str, *, pooled_width: int = 20,
                                caption_width: int = 24) -> Path:
    """The text encoders of `model_name` ("pyramid_flux" or "pyramid_mmdit") with the given widths
    (a DiT's `pooled_projection_dim` and `joint_attention_dim`)."""
    if model_name == "pyramid_flux":
        return write_flux_text_encoders(folder, pooled_width=pooled_width, caption_width=caption_width)
    if model_name == "pyramid_mmdit":
        clip_l = pooled_width // 2
        return write_sd3_text_encoders(folder, clip_l_width=clip_l, clip_g_width=pooled_width - clip_l,
                                       caption_width=caption_width)
    raise ValueError(f"no Pyramid-Flow text encoders for {model_name!r}")

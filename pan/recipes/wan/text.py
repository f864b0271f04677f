"""Captions -> umT5 features as WanPipeline encodes its prompts.

WanPipeline (diffusers) cleans a prompt (HTML entities unescaped twice, whitespace runs collapsed,
stripped; ftfy's repair first where ftfy is installed), tokenizes it with the folder's tokenizer
(special tokens added: the closing `</s>`; truncated and padded to `max_sequence_length` = 512),
runs transformers' `UMT5EncoderModel` with the attention mask, keeps the rows of the real tokens and
pads them with zero rows to 512. Here the encoder returns only the real rows [L, D] (that is what
`pan data precompute` stores); the task pads them with zeros to `max_text_tokens` rows, so the
transformer sees exactly what it sees in the pipeline. The empty caption (the pipeline's default
negative prompt, and the caption dropout's features) is `</s>` alone: one row.
"""

from __future__ import annotations

import html
import re
from pathlib import Path

import torch
from torch import Tensor

from pan.config.core import require


def clean_prompt(text: str) -> str:
    """WanPipeline's `prompt_clean`: ftfy's repair where installed, HTML entities unescaped twice,
    whitespace runs collapsed to one space, stripped."""
    try:
        import ftfy
    except ImportError:
        ftfy = None
    if ftfy is not None:
        text = ftfy.fix_text(text)
    text = html.unescape(html.unescape(text)).strip()
    return re.sub(r"\s+", " ", text).strip()


class UMT5Encoder:
    """The folder's frozen umT5 encoder and tokenizer on one device; `dtype`: the weights' (features
    come in it)."""

    def __init__(self, folder: Path, max_tokens: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32):
        from transformers import AutoTokenizer, UMT5EncoderModel

        folder = Path(folder)
        for sub in ("text_encoder", "tokenizer"):
            require((folder / sub).is_dir(), "model_path",
                    f"{folder / sub} is missing: captions are encoded with the folder's umT5. Download the "
                    "folder whole, or train from precomputed features (pan data precompute).")
        self.tokenizer = AutoTokenizer.from_pretrained(folder / "tokenizer", local_files_only=True)
        self.model = UMT5EncoderModel.from_pretrained(folder / "text_encoder", local_files_only=True, dtype=dtype)
        self.model.to(device).eval().requires_grad_(False)
        self.device, self.max_tokens = torch.device(device), max_tokens

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> list[Tensor]:
        """Features of each prompt's real tokens, [L_i, D] (L_i <= max_tokens), in the model's dtype."""
        tokens = self.tokenizer([clean_prompt(p) for p in prompts], padding="max_length", max_length=self.max_tokens,
                                truncation=True, add_special_tokens=True, return_attention_mask=True,
                                return_tensors="pt")
        mask = tokens.attention_mask
        hidden = self.model(tokens.input_ids.to(self.device), mask.to(self.device)).last_hidden_state
        return [h[:n] for h, n in zip(hidden, mask.gt(0).sum(dim=1).tolist())]


def padded(text: Tensor, rows: int) -> Tensor:
    """Caption features [L, D] as the transformer takes them: the first `rows` rows, zero rows after."""
    text = text[:rows]
    return torch.cat([text, text.new_zeros(rows - text.shape[0], text.shape[1])])

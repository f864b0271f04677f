"""Pyramid-Flow's frozen text encoders, loaded as released from a model folder's `text_encoder*/` and
`tokenizer*/` folders (offline), and its precomputed text-feature files.

Per caption the encoders give what the released DiTs were trained on:

- `prompt_embed [L, D]`: T5's last hidden state, the caption padded to L = `t5_max_length` (128 as
  released) with `prompt_attention_mask [L]` (int64, 1 = a real token, the end token included);
- `pooled_prompt_embed [P]`: `pyramid_flux` (FLUX-style): CLIP-L's pooled output (`text_encoder`,
  a `CLIPTextModel`, P = its width); `pyramid_mmdit` (SD3-style): the projected pooled outputs of
  CLIP-L and CLIP-G (`text_encoder`, `text_encoder_2`, both `CLIPTextModelWithProjection`) side by
  side. The T5 is `text_encoder_2` (flux) or `text_encoder_3` (mmdit).

Every tokenizer pads to a fixed length as the original does (CLIP: the CLIP-L tokenizer's
`model_max_length` for both CLIPs, as the original's SD3 encoder does; T5: `t5_max_length`). CLIP
gets no attention mask (the original passes none; its causal mask keeps the pooled end token blind to
the padding after it). Unlike SD3 itself, the original's mmdit encoder does not concatenate the
CLIPs' hidden states into `prompt_embed`: the DiT's captions are T5's alone (`joint_attention_dim` =
T5's width); pan follows the original.

Precomputed features are `.pt` files holding a dict of the three tensors, each with a leading batch
dim of 1 (as the original's `tools/extract_text_features.py` writes them); `load_features` reads
them with or without that dim. The empty caption's features (`empty_features()`) stand in for a
dropped caption: the original never precomputes them, and its precomputed-feature training crashes
on the first classifier-free-guidance drop.

A large T5 need not sit on every GPU: `encode_on_one_rank` gathers the captions of a process group
on one rank, which encodes them and scatters each rank's features back.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from pan.config.core import ConfigError, knob, require

if TYPE_CHECKING:   # transformers is imported where models load: reading feature files needs only torch
    from transformers import PretrainedConfig

FLUX = "pyramid_flux"
MMDIT = "pyramid_mmdit"
FEATURE_KEYS = ("prompt_embed", "prompt_attention_mask", "pooled_prompt_embed")
TOKENIZER_FILES = {"clip": ("tokenizer.json", "vocab.json"), "t5": ("tokenizer.json", "spiece.model")}


# ------------------------------------------------------------------------------------------------
# Config
# ------------------------------------------------------------------------------------------------

@dataclass(kw_only=True)
class PyramidTextConfig:
    SECTION: ClassVar[str] = "model"

    text_encoder_dir: str | None = knob(
        None, "folder holding the text encoders as released (text_encoder*/ and tokenizer*/); null = "
              "the model folder (`model_path`)")
    t5_max_length: int = knob(
        128, "T5 tokens per caption: captions are cut or padded to this length, with a mask (128 as "
             "the released models were trained)", gt=0)
    text_encoder_dtype: Literal["auto", "bf16", "fp32"] = knob(
        "auto", "weights and features of the text encoders: auto = bf16 on CUDA, fp32 on CPU (no "
                "fp16: T5 overflows in it)")

    def check(self, job) -> None:
        if self.text_encoder_dir is not None:
            require(Path(self.text_encoder_dir).expanduser().is_dir(), "text_encoder_dir",
                    f"{self.text_encoder_dir} is not a folder. Point it at a folder holding text_encoder/, "
                    "tokenizer/, ... as the released model has them, or set it to null to use `model_path`.")

    def folder(self, model_path: str | Path) -> tuple[Path, str]:
        """The folder holding the encoders, and the key that named it (for error messages)."""
        if self.text_encoder_dir is None:
            return Path(model_path).expanduser(), "model_path"
        return Path(self.text_encoder_dir).expanduser(), "text_encoder_dir"

    def dtype(self, device: torch.device | str) -> torch.dtype:
        if self.text_encoder_dtype == "auto":
            return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
        return torch.bfloat16 if self.text_encoder_dtype == "bf16" else torch.float32


# ------------------------------------------------------------------------------------------------
# Layout: which folder holds what, checked without loading weights
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Slot:
    """One model + tokenizer pair of the released layout."""
    role: str              # "CLIP-L", "CLIP-G", "T5"
    model_dir: str         # e.g. "text_encoder"
    tokenizer_dir: str     # e.g. "tokenizer"
    projected: bool        # CLIP: its pooled output goes through `text_projection` (SD3)

    @property
    def kind(self) -> str:
        return "t5" if self.role == "T5" else "clip"


LAYOUTS: dict[str, tuple[Slot, ...]] = {
    FLUX: (Slot("CLIP-L", "text_encoder", "tokenizer", projected=False),
           Slot("T5", "text_encoder_2", "tokenizer_2", projected=False)),
    MMDIT: (Slot("CLIP-L", "text_encoder", "tokenizer", projected=True),
            Slot("CLIP-G", "text_encoder_2", "tokenizer_2", projected=True),
            Slot("T5", "text_encoder_3", "tokenizer_3", projected=False)),
}


@dataclass(frozen=True)
class TextEncoderLayout:
    """What `check_text_encoders` found: the folder, its slots' configs, and the feature widths."""
    folder: Path
    key: str                                # the config key that named `folder`
    slots: tuple[Slot, ...]
    configs: tuple[PretrainedConfig, ...]   # per slot
    caption_width: int                      # D of prompt_embed: T5's d_model
    pooled_width: int                       # P of pooled_prompt_embed


def check_text_encoders(cfg: PyramidTextConfig, model_name: str, model_path: str | Path) -> TextEncoderLayout:
    """The text encoders of `model_name` in the configured folder, checked from their configs and
    tokenizer files (no weights loaded); ConfigError naming the key and the fix otherwise."""
    require(model_name in LAYOUTS, "model_name",
            f"has no Pyramid-Flow text encoders: {model_name!r}; use one of {', '.join(LAYOUTS)}.")
    folder, key = cfg.folder(model_path)
    slots = LAYOUTS[model_name]
    require(folder.is_dir(), key, f"{folder} is not a folder: it should hold the text encoders "
                                  f"({', '.join(s.model_dir for s in slots)}) and their tokenizers.")
    for slot in slots:   # every file first: a model folder of the other kind fails here, clearly
        _check_files(folder, key, slot, model_name)
    configs = tuple(_check_config(folder / slot.model_dir, key, slot, model_name) for slot in slots)
    clips = [(s, c) for s, c in zip(slots, configs) if s.kind == "clip"]
    pooled = sum(c.projection_dim if s.projected else c.hidden_size for s, c in clips)
    # The original pads every CLIP to the CLIP-L tokenizer's length: each tower must take it.
    clip_length = _clip_length(folder / slots[0].tokenizer_dir, key)
    for slot, config in clips:
        require(clip_length <= config.max_position_embeddings, key,
                f"{folder / slot.tokenizer_dir}'s tokenizer pads captions to {clip_length} tokens, but the "
                f"{slot.role} in {folder / slot.model_dir} has only {config.max_position_embeddings} "
                "positions: the tokenizer and the model do not belong together; copy both from one release.")
    return TextEncoderLayout(folder, key, slots, configs, caption_width=configs[-1].d_model, pooled_width=pooled)


def _check_files(folder: Path, key: str, slot: Slot, model_name: str) -> None:
    model_dir, tokenizer_dir = folder / slot.model_dir, folder / slot.tokenizer_dir
    require((model_dir / "config.json").is_file(), key,
            f"{model_dir} has no config.json: `{model_name}` needs its {slot.role} there (and its tokenizer "
            f"in {tokenizer_dir}), as the released model folder has them (is `model_name` the model's?). "
            "Models are never downloaded: copy the whole release, or set `text_encoder_dir` to a folder "
            "that holds them.")
    require(any(model_dir.glob("*.safetensors")) or any(model_dir.glob("*.bin")), key,
            f"{model_dir} has a config but no weights (*.safetensors or *.bin): copy the whole folder.")
    names = TOKENIZER_FILES[slot.kind]
    require(any((tokenizer_dir / n).is_file() for n in names), key,
            f"{tokenizer_dir} holds no {slot.role} tokenizer (none of {', '.join(names)}): copy the "
            "tokenizer folder of the release beside the model.")


def _check_config(model_dir: Path, key: str, slot: Slot, model_name: str) -> PretrainedConfig:
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    expected = "t5" if slot.kind == "t5" else "clip_text_model"
    require(config.model_type == expected, key,
            f"{model_dir} holds a `{config.model_type}` model, but `{model_name}` needs a {slot.role} "
            f"({expected}) there: the folders are not in the released order, or are another model's.")
    if slot.projected:
        # Without its projection a CLIPTextModelWithProjection would load with a random one.
        archs = config.architectures or []
        require("CLIPTextModelWithProjection" in archs, key,
                f"{model_dir} holds a {'/'.join(archs) or 'CLIP text model'} without the text projection "
                f"`{model_name}` pools through (CLIPTextModelWithProjection): use the release's {slot.role}.")
    return config


def _clip_length(tokenizer_dir: Path, key: str) -> int:
    config_path = tokenizer_dir / "tokenizer_config.json"
    length = json.loads(config_path.read_text()).get("model_max_length") if config_path.is_file() else None
    require(isinstance(length, int) and length > 0, key,
            f"{tokenizer_dir} does not say how long its captions are (`model_max_length` in "
            "tokenizer_config.json; the released CLIP tokenizers say 77): copy the release's tokenizer folder.")
    return length


def check_dit_widths(layout: TextEncoderLayout, *, joint_attention_dim: int, pooled_projection_dim: int) -> None:
    """Refuse text encoders whose features do not have the widths the DiT takes (its config.json)."""
    wrong = []
    if layout.caption_width != joint_attention_dim:
        wrong.append(f"T5 features are {layout.caption_width} wide, the DiT's `joint_attention_dim` is "
                     f"{joint_attention_dim}")
    if layout.pooled_width != pooled_projection_dim:
        wrong.append(f"pooled CLIP features are {layout.pooled_width} wide, the DiT's "
                     f"`pooled_projection_dim` is {pooled_projection_dim}")
    require(not wrong, layout.key,
            f"the text encoders in {layout.folder} do not fit the DiT: {'; '.join(wrong)}. Use the text "
            "encoders the DiT was released with (set `text_encoder_dir` to their folder), or a DiT "
            "variant made for these.")


# ------------------------------------------------------------------------------------------------
# Features
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TextFeatures:
    """One caption's features, as the original stores them (without the batch dim)."""
    prompt_embed: Tensor            # [L, D] T5 rows, padding rows included
    prompt_attention_mask: Tensor   # [L] int64, 1 = a real token
    pooled_prompt_embed: Tensor     # [P]

    def to(self, device: torch.device | str) -> TextFeatures:
        return TextFeatures(*(t.to(device) for t in self.tensors()))

    def tensors(self) -> tuple[Tensor, Tensor, Tensor]:
        return self.prompt_embed, self.prompt_attention_mask, self.pooled_prompt_embed

    def caption_rows(self) -> Tensor:
        """[L_valid, D]: the real tokens' rows (what a packed batch keeps)."""
        return self.prompt_embed[self.prompt_attention_mask.bool()]


def stack_features(features: list[TextFeatures]) -> tuple[Tensor, Tensor, Tensor]:
    """[B, L, D], [B, L], [B, P]: a batch as the original's DiT takes it."""
    return tuple(torch.stack(parts) for parts in zip(*(f.tensors() for f in features)))


def unstack_features(embed: Tensor, mask: Tensor, pooled: Tensor) -> list[TextFeatures]:
    return [TextFeatures(*row) for row in zip(embed, mask, pooled)]


# ------------------------------------------------------------------------------------------------
# The encoders
# ------------------------------------------------------------------------------------------------

class PyramidTextEncoder:
    """The frozen text encoders of one Pyramid-Flow model on one device: prompts -> TextFeatures."""

    MODEL_NAME: ClassVar[str]

    def __init__(self, cfg: PyramidTextConfig, model_path: str | Path, device: torch.device | str = "cpu"):
        self.layout = check_text_encoders(cfg, self.MODEL_NAME, model_path)
        self.device = torch.device(device)
        self.dtype = cfg.dtype(self.device)
        self.t5_max_length = cfg.t5_max_length
        folder = self.layout.folder
        self.tokenizers, self.models = [], []
        for slot in self.layout.slots:
            self.tokenizers.append(_load_tokenizer(folder / slot.tokenizer_dir, slot, self.layout.key))
            self.models.append(_load_model(folder / slot.model_dir, slot, self.dtype).to(self.device))
        self.clip_length = self.tokenizers[0].model_max_length
        self._empty: TextFeatures | None = None

    @property
    def caption_width(self) -> int:
        return self.layout.caption_width

    @property
    def pooled_width(self) -> int:
        return self.layout.pooled_width

    # no_grad, not inference_mode: the features feed a DiT that is trained, and autograd refuses to
    # save inference tensors for its backward.
    @torch.no_grad()
    def encode_batch(self, prompts: list[str]) -> tuple[Tensor, Tensor, Tensor]:
        """[B, L, D] T5 features, [B, L] mask, [B, P] pooled features of `prompts`, on the device."""
        clips = [(t, m, s) for t, m, s in zip(self.tokenizers, self.models, self.layout.slots) if s.kind == "clip"]
        pooled = torch.cat([self._clip_pooled(t, m, s, prompts) for t, m, s in clips], dim=-1)  # [B, P]
        embed, mask = self._t5_captions(self.tokenizers[-1], self.models[-1], prompts)
        return embed, mask, pooled

    def encode(self, prompts: list[str]) -> list[TextFeatures]:
        return unstack_features(*self.encode_batch(prompts))

    def empty_features(self) -> TextFeatures:
        """Features of the empty caption (caption dropout, the negative prompt), computed once."""
        if self._empty is None:
            self._empty = self.encode([""])[0]
        return self._empty

    def _clip_pooled(self, tokenizer, model, slot: Slot, prompts: list[str]) -> Tensor:
        ids = tokenizer(prompts, padding="max_length", max_length=self.clip_length, truncation=True,
                        return_tensors="pt").input_ids.to(self.device)       # [B, 77]
        out = model(ids)
        pooled = out.text_embeds if slot.projected else out.pooler_output    # [B, width]
        return pooled.to(self.dtype)

    def _t5_captions(self, tokenizer, model, prompts: list[str]) -> tuple[Tensor, Tensor]:
        tokens = tokenizer(prompts, padding="max_length", max_length=self.t5_max_length, truncation=True,
                           return_tensors="pt")
        mask = tokens.attention_mask.to(self.device)                        # [B, L] int64
        hidden = model(tokens.input_ids.to(self.device), attention_mask=mask).last_hidden_state  # [B, L, D]
        return hidden.to(self.dtype), mask


class FluxTextEncoder(PyramidTextEncoder):
    """`pyramid_flux`: CLIP-L pooled output + T5 captions."""
    MODEL_NAME = FLUX


class SD3TextEncoder(PyramidTextEncoder):
    """`pyramid_mmdit`: CLIP-L and CLIP-G projected pooled outputs, concatenated, + T5 captions."""
    MODEL_NAME = MMDIT


ENCODERS: dict[str, type[PyramidTextEncoder]] = {FLUX: FluxTextEncoder, MMDIT: SD3TextEncoder}


def build_text_encoder(cfg: PyramidTextConfig, model_name: str, model_path: str | Path,
                       device: torch.device | str = "cpu") -> PyramidTextEncoder:
    require(model_name in ENCODERS, "model_name",
            f"has no Pyramid-Flow text encoders: {model_name!r}; use one of {', '.join(ENCODERS)}.")
    return ENCODERS[model_name](cfg, model_path, device)


def _load_tokenizer(folder: Path, slot: Slot, key: str):
    from transformers import CLIPTokenizer, T5Tokenizer
    cls = T5Tokenizer if slot.kind == "t5" else CLIPTokenizer
    try:
        return cls.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, ImportError) as e:
        raise ConfigError(key, f"cannot load the {slot.role} tokenizer in {folder}: {e}. Copy the release's "
                               "tokenizer folder (a T5 tokenizer with only spiece.model also needs the "
                               "`sentencepiece` package).") from None


def _load_model(folder: Path, slot: Slot, dtype: torch.dtype):
    from transformers import CLIPTextModel, CLIPTextModelWithProjection, T5EncoderModel
    cls = T5EncoderModel if slot.kind == "t5" else (CLIPTextModelWithProjection if slot.projected else CLIPTextModel)
    model = cls.from_pretrained(folder, local_files_only=True, dtype=dtype)
    return model.eval().requires_grad_(False)


# ------------------------------------------------------------------------------------------------
# Precomputed feature files
# ------------------------------------------------------------------------------------------------

class TextFeatureFileError(ValueError):
    """A text-feature file that is not what the original writes (names the file and the problem)."""


def save_features(features: TextFeatures, path: str | Path) -> None:
    """Write `path` as the original does: {key: tensor with a leading batch dim of 1} on CPU.

    Atomically (a temporary file renamed into place): a precompute killed mid-write leaves no
    truncated file that a rerun, skipping what exists, would keep."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # clone: a row of a batch is a view, and torch.save would write the whole batch's storage.
    payload = {k: t.detach().unsqueeze(0).cpu().clone() for k, t in zip(FEATURE_KEYS, features.tensors())}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_features(path: str | Path, *, caption_width: int | None = None,
                  pooled_width: int | None = None) -> TextFeatures:
    """Read a text-feature `.pt` file (with or without the leading batch dim of 1), checked; widths
    are checked when given. The mask comes back as int64, as the original's tokenizer makes it."""
    path = Path(path)
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:   # a missing, truncated or foreign file: one error type for the data layer
        raise TextFeatureFileError(f"{path}: cannot read text features: {e}") from None
    missing = [k for k in FEATURE_KEYS if not isinstance(raw, dict) or not isinstance(raw.get(k), Tensor)]
    if missing:
        raise TextFeatureFileError(f"{path}: not a text-feature file (no tensor {', '.join(missing)}); "
                                   f"it should hold {', '.join(FEATURE_KEYS)}.")
    embed, mask, pooled = (_without_batch_dim(raw[k], ndim, k, path)
                           for k, ndim in zip(FEATURE_KEYS, (2, 1, 1)))
    problems = []
    if mask.shape[0] != embed.shape[0]:
        problems.append(f"prompt_attention_mask has {mask.shape[0]} entries for {embed.shape[0]} rows")
    if mask.dtype.is_floating_point or not bool(((mask == 0) | (mask == 1)).all()):
        problems.append("prompt_attention_mask is not a 0/1 integer mask")
    if caption_width is not None and embed.shape[1] != caption_width:
        problems.append(f"prompt_embed is {embed.shape[1]} wide, the model takes {caption_width}")
    if pooled_width is not None and pooled.shape[0] != pooled_width:
        problems.append(f"pooled_prompt_embed is {pooled.shape[0]} wide, the model takes {pooled_width}")
    if problems:
        raise TextFeatureFileError(f"{path}: {'; '.join(problems)}. Recompute it with this model's "
                                   "text encoders (`pan data precompute`).")
    return TextFeatures(embed, mask.long(), pooled)


def _without_batch_dim(t: Tensor, ndim: int, key: str, path: Path) -> Tensor:
    if t.dim() == ndim + 1 and t.shape[0] == 1:
        return t[0]
    if t.dim() != ndim:
        raise TextFeatureFileError(f"{path}: {key} has shape {tuple(t.shape)}; one caption's is "
                                   f"{ndim}-D, optionally with a leading batch dim of 1.")
    return t


# ------------------------------------------------------------------------------------------------
# Sharing one encoder across a process group
# ------------------------------------------------------------------------------------------------

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def encode_on_one_rank(prompts: list[str], encoder: PyramidTextEncoder | None,
                       group: dist.ProcessGroup | None = None, *, src: int = 0,
                       device: torch.device | str = "cpu") -> list[TextFeatures]:
    """Features of this rank's `prompts`, computed by the one rank of `group` holding the encoder.

    A collective: every rank of `group` calls it, each with its own prompts (possibly none), and
    only group rank `src` passes an encoder (the others None). The captions are gathered on `src`,
    encoded there in one batch, and each rank's features scattered back to it, on `device` (the
    rank's GPU under NCCL, CPU under gloo). Without a process group it encodes locally.
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        _check_source(0, src, encoder is not None, "the text encoder")
        return encoder.encode(prompts) if prompts else []
    me = dist.get_rank(group)
    _check_source(me, src, encoder is not None, "the text encoder")
    gathered = [None] * dist.get_world_size(group) if me == src else None
    dist.gather_object(list(prompts), gathered, group=group, group_dst=src)
    batch, counts = None, []
    if me == src:
        counts = [len(p) for p in gathered]
        everyone = [p for rank_prompts in gathered for p in rank_prompts]
        batch = encoder.encode_batch(everyone) if everyone else None
    header = _Header.broadcast(batch, max(counts, default=0), group, src, device)
    mine = []
    for part, (shape, dtype) in enumerate(header.parts()):
        out = torch.empty(shape, dtype=dtype, device=device)
        chunks = _padded_chunks(batch[part], counts, header.rows, device) if me == src else None
        dist.scatter(out, chunks, group=group, group_src=src)
        mine.append(out[:len(prompts)])
    return unstack_features(*mine) if header.rows else []


def broadcast_features(features: list[TextFeatures] | None, group: dist.ProcessGroup | None = None, *,
                       src: int = 0, device: torch.device | str = "cpu") -> list[TextFeatures]:
    """The same features on every rank of `group`, from group rank `src` (the others pass None):
    for captions every rank shares, e.g. the empty caption's or the validation prompts'."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [f.to(device) for f in features]
    me = dist.get_rank(group)
    _check_source(me, src, features is not None, "the features")
    batch = stack_features(features) if me == src and features else None
    header = _Header.broadcast(batch, len(features) if me == src else 0, group, src, device)
    out = []
    for part, (shape, dtype) in enumerate(header.parts()):
        t = (batch[part].to(device, dtype).contiguous() if me == src
             else torch.empty(shape, dtype=dtype, device=device))
        dist.broadcast(t, group=group, group_src=src)
        out.append(t)
    return unstack_features(*out) if header.rows else []


def _check_source(me: int, src: int, has_it: bool, what: str) -> None:
    # Refused before any collective, so a misuse fails instead of hanging the group.
    if has_it != (me == src):
        raise ValueError(f"exactly group rank {src} passes {what}; group rank {me} "
                         f"{'does' if has_it else 'does not'}.")


@dataclass(frozen=True)
class _Header:
    """What receivers need to allocate: rows per rank, L, D, P and the features' dtype."""
    rows: int
    length: int
    width: int
    pooled_width: int
    dtype: torch.dtype

    @staticmethod
    def broadcast(batch: tuple[Tensor, Tensor, Tensor] | None, rows: int, group, src: int, device) -> _Header:
        values = [0] * 5   # nothing to send
        if batch is not None:
            embed, _, pooled = batch
            values = [rows, embed.shape[1], embed.shape[2], pooled.shape[1], _DTYPES.index(embed.dtype)]
        header = torch.tensor(values, dtype=torch.int64, device=device)
        dist.broadcast(header, group=group, group_src=src)
        rows, length, width, pooled_width, dtype = header.tolist()
        return _Header(rows, length, width, pooled_width, _DTYPES[dtype])

    def parts(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """(shape, dtype) of prompt_embed, prompt_attention_mask, pooled_prompt_embed; none if no rows."""
        if self.rows == 0:
            return []
        return [((self.rows, self.length, self.width), self.dtype), ((self.rows, self.length), torch.int64),
                ((self.rows, self.pooled_width), self.dtype)]


def _padded_chunks(t: Tensor, counts: list[int], rows: int, device) -> list[Tensor]:
    """`t`'s rows split by rank, each padded with zeros to `rows` (scatter sends equal shapes)."""
    chunks = []
    for chunk in torch.split(t.to(device), counts):
        pad = t.new_zeros((rows - chunk.shape[0], *t.shape[1:]), device=device)
        chunks.append(torch.cat([chunk, pad]).contiguous())
    return chunks

"""What the trainer receives: a `RawBatch` of `Sample`s, and how a sample crosses from a decoding
worker to the trainer (small tensors by value)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

# Pyramid-Flow's text features, per sample after the leading batch dim of 1 is dropped:
# prompt_embed [L, D], prompt_attention_mask [L] (1 = a real token), pooled_prompt_embed [P].
TEXT_FEATURE_DIMS = {"prompt_embed": 2, "prompt_attention_mask": 1, "pooled_prompt_embed": 1}


@dataclass
class Sample:
    """One clip or image. Decoded samples carry `frames`; pan's precomputed CSV rows carry `latent` +
    `text` (and `extras`: the file's other tensors, which a recipe's precompute wrote for its task);
    annotation rows with a `latent` carry `raw_latent`, and with a `text_fea`, `text_features`."""
    sample_id: str                       # "<csv|jsonl stem>:<row>" (0 = first data row) or "<tar stem>:<key>"
    kind: Literal["video", "image"]
    caption: str
    grid: tuple[int, int, int]           # (T, H, W) of frames (pixels) or of the latent (latent cells)
    tokens: int                          # model tokens, as tokens_of / latent_tokens_of count them
    frames: torch.Tensor | None = None   # uint8 [T, 3, H, W], RGB, 0..255
    fps: float | None = None             # frame rate of `frames` (after target_fps resampling)
    latent: torch.Tensor | None = None   # [C, T, H, W], already normalised (pan's precomputed CSVs)
    text: torch.Tensor | None = None     # [L, D] text features (pan's precomputed CSVs)
    raw_latent: torch.Tensor | None = None  # [C, T, H, W] as the VAE gave it, NOT normalised, in the
    #                                         dtype it was saved in (annotation rows' `latent`)
    text_features: dict[str, torch.Tensor] | None = None  # annotation rows' `text_fea` (TEXT_FEATURE_DIMS)
    extras: dict[str, torch.Tensor] | None = None  # a precomputed row's other tensors (SampleFit.extras)

    # Between a decoding worker and the trainer, a tensor normally travels as a shared-memory file
    # descriptor, handed over through a fresh authenticated connection per tensor: about 1 ms each,
    # which for small clips costs the trainer more than the clip itself. Tensors up to this size
    # travel inside the pickled message instead.
    BY_VALUE_BYTES: ClassVar[int] = 1 << 20
    TENSORS: ClassVar[tuple[str, ...]] = ("frames", "latent", "text", "raw_latent")
    TENSOR_DICTS: ClassVar[tuple[str, ...]] = ("text_features", "extras")

    def copy(self) -> Sample:
        """A copy with tensors of its own (what a cache hands out: a consumer may change its sample)."""
        def own(t):
            return t.clone() if isinstance(t, torch.Tensor) else t
        dicts = {d: None if getattr(self, d) is None else {k: own(t) for k, t in getattr(self, d).items()}
                 for d in self.TENSOR_DICTS}
        return dataclasses.replace(self, **{k: own(getattr(self, k)) for k in self.TENSORS}, **dicts)

    @property
    def nbytes(self) -> int:
        """Bytes of its tensors."""
        tensors = [getattr(self, k) for k in self.TENSORS]
        tensors += [t for d in self.TENSOR_DICTS for t in (getattr(self, d) or {}).values()]
        return sum(t.nbytes for t in tensors if isinstance(t, torch.Tensor))

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        for key in self.TENSORS:
            state[key] = _by_value(state[key], self.BY_VALUE_BYTES)
        for d in self.TENSOR_DICTS:
            if state.get(d) is not None:
                state[d] = {k: _by_value(t, self.BY_VALUE_BYTES) for k, t in state[d].items()}
        return state

    def __setstate__(self, state: dict) -> None:
        for key in self.TENSORS:
            state[key] = _from_value(state[key])
        for d in self.TENSOR_DICTS:
            if state.get(d) is not None:
                state[d] = {k: _from_value(t) for k, t in state[d].items()}
        self.__dict__.update(state)


def _by_value(t, limit: int):
    """A tensor of at most `limit` bytes as _TensorBytes; anything else as it is."""
    if isinstance(t, torch.Tensor) and t.nbytes <= limit:
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return _TensorBytes(raw, t.dtype, tuple(t.shape))
    return t


def _from_value(t):
    return t.tensor() if isinstance(t, _TensorBytes) else t


@dataclass
class _TensorBytes:
    """A small tensor pickled by value (see Sample.BY_VALUE_BYTES)."""
    raw: bytes
    dtype: torch.dtype
    shape: tuple[int, ...]

    def tensor(self) -> torch.Tensor:
        flat = torch.frombuffer(bytearray(self.raw), dtype=torch.uint8) if self.raw else torch.empty(0, dtype=torch.uint8)
        return flat.view(self.dtype).reshape(self.shape)


@dataclass
class RawBatch:
    """One packed batch for one data-parallel rank: samples of different shapes, no padding."""
    samples: list[Sample]
    tokens: int                          # sum of the samples' tokens
    token_budget: int                    # max_tokens_per_batch
    skipped: dict[str, int]              # bad samples dropped since the previous batch, by reason
    shard: int = 0                       # the data shard that made it (see ShardedLoader) ...
    number: int = 0                      # ... and its count of batches made before it
    first_sample: int = 0                # ... and of samples batched before it

    @property
    def packing_efficiency(self) -> float:
        """Real tokens / budget: the share of the batch's compute spent on data."""
        return self.tokens / self.token_budget

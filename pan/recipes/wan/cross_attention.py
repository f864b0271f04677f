"""Cross-attention on packed batches: the query rows of sample i attend to the key rows of sample i only,
with per-sample lengths that differ between the two sides (Wan: a sample's video tokens to its text
tokens, or to its image tokens).

pan's attention (`pan.models.attention`) is self-attention over segments whose queries are rows of the
key sequence (every row, or some: `AttnSegments.query_lens`). Its kernels already take `query_len`
queries against `key_len` keys per segment: the sdpa path batches the segments of one (query_len,
key_len) layout into one call (`LayoutBatches`), varlen passes separate query and key offsets. So a
cross-attention is that same machinery with segments = each sample's key rows and `query_lens` =
each sample's query rows, the query rows being another stream's. Only `flex`, which places queries
by `query_rows` inside the key sequence, has no meaning here: this module never runs it.

Under Ulysses context parallel a rank holds a strided share of each sample's video rows, and the
text (and image) rows whole: a query row needs no other rank's rows (it attends to keys only), so the
cross-attention runs locally with `query_lens` = this rank's video rows of each sample and the whole
key rows, with no exchange (`WanPlan.of` in model.py; the task gives every cp rank the whole text).
The text projections then run on every rank: at Wan's sizes 512 text rows against thousands of video
rows a rank, about 1% of a block's FLOPs, where an all-gather of k and v would cost two exchanges a
block. Each rank's gradients of the text-side weights come from its own queries; FSDP's sum over the
ranks makes them the whole batch's.

A sample's keys may carry an additive bias (`biased_attention`, sdpa in fp32 / float64 only): Wan
passes each sample's distinct text rows once, its zero padding rows as one key with log(count) added
(model.py, `distinct_text_rows`), exactly their attention with a fraction of the scores.

What should move to shared code (`pan/models/attention.py`, `pan/models/packing.py`): a constructor
`AttnSegments.cross(query_lens, key_lens)` that says so (today `query_lens` is documented as a subset
of the key rows), and this module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pan.models.attention import attention, auto_backend
from pan.models.packing import AttnSegments

CrossBackend = Literal["auto", "sdpa", "varlen"]
CROSS_BACKENDS = ("auto", "sdpa", "varlen")


def cross_segments(query_lens: Sequence[int], key_lens: Sequence[int], device=None) -> AttnSegments:
    """Segments where the `query_lens[i]` query rows of sample i attend to its `key_lens[i]` key rows
    (queries and keys each packed sample after sample, in two tensors)."""
    if len(query_lens) != len(key_lens):
        raise ValueError(f"need one query and one key length per sample, got {len(query_lens)} and {len(key_lens)}.")
    if any(n == 0 for q, n in zip(query_lens, key_lens) if q):
        raise ValueError(f"a sample with queries has no keys to attend to (query lengths {list(query_lens)}, "
                         f"key lengths {list(key_lens)}): softmax over no keys is undefined.")
    keys = AttnSegments.from_lengths([int(n) for n in key_lens], device)
    return dataclasses.replace(keys, query_lens=tuple(int(n) for n in query_lens))


class InnerCrossAttention(nn.Module):
    """The cross-attention call of a layer: (q [Nq, H, d], k, v [Nk, H, d], segments) -> [Nq, H, d].

    Not an `InnerAttention`: `set_attention_backend` (which may choose flex) and Ulysses (which
    exchanges q, k and v alike) must not reach it; its backend is set here, among sdpa and varlen.
    """

    def __init__(self, backend: CrossBackend = "auto"):
        super().__init__()
        if backend not in CROSS_BACKENDS:
            raise ValueError(f"unknown cross-attention backend {backend!r}; choose one of {CROSS_BACKENDS}.")
        self.backend = backend

    @torch.compiler.disable   # as InnerAttention: whole kernels, and a loop over layouts
    def forward(self, q: Tensor, k: Tensor, v: Tensor, segments: AttnSegments, key_bias: Tensor | None = None
                ) -> Tensor:
        """`key_bias` [Nk]: added to every query's score of each key (`takes_key_bias`)."""
        if segments.query_lens is None or q.shape[0] != sum(segments.query_lens) or k.shape[0] != segments.total:
            raise ValueError(f"cross-attention got {q.shape[0]} query and {k.shape[0]} key rows for segments of "
                             f"{segments.query_lens} queries and {segments.seqlens} keys (see cross_segments).")
        if key_bias is None:
            return attention(q, k, v, segments, self.backend)
        if not self.takes_key_bias(q, segments):
            raise ValueError(f"the {self.backend!r} cross-attention takes no key bias for {q.dtype} on {q.device}.")
        return biased_attention(q, k, v, segments, key_bias)

    def takes_key_bias(self, q: Tensor, segments: AttnSegments) -> bool:
        """Whether a key bias runs on these queries: with sdpa (flash varlen takes none), in fp32 or float64
        (a bias of a few units rounded to bf16 would move its key's weight by ~1%)."""
        backend = self.backend if self.backend != "auto" else auto_backend(q, segments)
        return backend == "sdpa" and q.dtype in (torch.float32, torch.float64)

    def extra_repr(self) -> str:
        return f"backend={self.backend}"


def biased_attention(q: Tensor, k: Tensor, v: Tensor, segments: AttnSegments, key_bias: Tensor) -> Tensor:
    """Cross-attention with `key_bias[j]` added to every query's score of key j: one SDPA call a sample
    (its bias a broadcast [1, 1, 1, keys] mask; samples' key counts differ, so calls are not batched).
    A key standing for m equal keys with bias log(m) gives exactly their attention: m e^s = e^(s + log m)."""
    outs = []
    for qs, ks, vs, bias in zip(q.split(segments.query_lens), k.split(segments.seqlens),
                                v.split(segments.seqlens), key_bias.split(segments.seqlens)):
        if qs.shape[0] == 0:   # this context-parallel rank holds none of the sample's video rows
            outs.append(qs)
            continue
        heads_first = [t.unsqueeze(0).transpose(1, 2) for t in (qs, ks, vs)]               # [1, H, n, d] views
        out = F.scaled_dot_product_attention(*heads_first, attn_mask=bias.to(qs.dtype)[None, None, None, :])
        outs.append(out.transpose(1, 2).squeeze(0))   # squeeze, not [0]: its backward is a view, no zero fill
    return torch.cat(outs)

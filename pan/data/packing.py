"""Packing variable-size samples into token-budgeted batches without padding.

The loader keeps a small lookahead buffer of decoded samples. Each batch takes the oldest sample
first, so no sample waits more than about `lookahead` batches, then fills the rest of the budget
best-fit decreasing: the largest buffered sample that still fits, again and again. Small samples
(images, short clips) end up in the gaps large ones leave.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Pending:
    """A decoded sample waiting in the lookahead buffer."""
    seq: int      # position in the rank's sample sequence: the buffer's age order and tie-break
    tokens: int
    item: Any


def take_batch(buffer: list[Pending], budget: int, max_samples: int) -> list[Pending]:
    """Remove one batch from `buffer` (kept in arrival order) and return it in packing order.

    Every sample in the buffer must fit the budget on its own. Deterministic: ties go to the older
    sample.
    """
    oldest = min(buffer, key=lambda p: p.seq)
    chosen = [oldest]
    room = budget - oldest.tokens
    for p in sorted(buffer, key=lambda p: (-p.tokens, p.seq)):
        if len(chosen) == max_samples:
            break
        if p is not oldest and p.tokens <= room:
            chosen.append(p)
            room -= p.tokens
    taken = {id(p) for p in chosen}
    buffer[:] = [p for p in buffer if id(p) not in taken]
    return chosen


class LookaheadPacker:
    """The lookahead buffer and its batching policy: keep at least `lookahead` samples, and enough
    tokens to fill a batch, then take one batch with `take_batch`."""

    def __init__(self, budget: int, max_samples: int, lookahead: int):
        self.budget, self.max_samples, self.lookahead = budget, max_samples, lookahead
        self.buffer: list[Pending] = []

    def wants_more(self) -> bool:
        if len(self.buffer) < self.lookahead:
            return True
        # Many small samples (images) may be needed to fill one batch.
        return sum(p.tokens for p in self.buffer) < self.budget and len(self.buffer) < self.max_samples

    def add(self, seq: int, tokens: int, item: Any) -> None:
        if tokens > self.budget:
            raise ValueError(f"a sample of {tokens} tokens cannot fit the budget of {self.budget}")
        self.buffer.append(Pending(seq, tokens, item))

    def take(self) -> list[Pending]:
        return take_batch(self.buffer, self.budget, self.max_samples)

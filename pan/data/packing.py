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

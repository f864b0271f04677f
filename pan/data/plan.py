"""Planning: streams, shares and the mixing RNG (runs in the training process). Which sample a data
shard draws next, from counters alone (pan/data/packed.py tells how that makes resume exact): each
epoch's order a `Shuffle` computed slot by slot, an elastic resume's `Head` computed as it is drawn;
and `seed_draws`, the seeding of a micro-batch's random draws from what names it."""

from __future__ import annotations

import bisect
import collections
import hashlib
import itertools
import random
from dataclasses import dataclass

import numpy as np
import torch

IMAGE_STREAM = "images"


@dataclass(frozen=True)
class Ref:
    """A reference to one sample of one rank's sequence."""
    seq: int      # the sample's number in this rank's sequence
    stream: str   # "video:<csv stem>", "annotations:<jsonl stem>" or "images"
    epoch: int
    pos: int      # position within this rank's share of the epoch (-1: dealt from an elastic head)
    index: int    # row (CSV, JSONL) or image (tars) index in the source


def stable_int(*parts) -> int:
    """A 64-bit integer from the parts, equal in every process (unlike hash())."""
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little")


def seed_draws(generator: torch.Generator, rng: random.Random | None, seed: int, drawer: int, number: int) -> None:
    """Seed the random streams of one micro-batch from what names it: the run's seed, who draws (a
    data shard, or an AR slot's place among all slots) and the drawer's batch number. The draws
    then do not depend on which rank holds the shard, so a run continues exactly on another layout."""
    value = stable_int(seed, "draws", drawer, number)
    generator.manual_seed(value >> 1)  # torch takes 63 bits
    if rng is not None:
        rng.seed(value)


MASK64 = (1 << 64) - 1
FEISTEL_ROUNDS = 4  # Luby-Rackoff: four rounds of a pseudo-random function give a pseudo-random permutation


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a cheap 64-bit mixing function (the Feistel network's round function)."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


class Shuffle:
    """A seeded bijection of [0, size): a Feistel network over the smallest even number of bits that
    holds `size`, cycle-walked back into range (a value past the end is permuted again: still a
    bijection, and at most four tries on average).

    Why not `rng.permutation(size)`: that array is 8 bytes per row in every process (800 MB at a
    hundred million rows, per rank and per epoch) and costs seconds to draw. This is O(1) memory,
    any slot is computed on its own, and every process computes the same order from the key."""

    def __init__(self, size: int, key: int):
        self.size = size
        bits = max(2, (size - 1).bit_length())
        self.half = (bits + 1) // 2
        self.mask = (1 << self.half) - 1
        self.keys = [_mix64(key + (r + 1) * 0x9E3779B97F4A7C15 & MASK64) for r in range(FEISTEL_ROUNDS)]

    def __call__(self, slot: int) -> int:
        if not 0 <= slot < self.size:
            raise IndexError(f"slot {slot} of a shuffle of {self.size}")
        x = slot
        while True:
            x = self._permute(x)
            if x < self.size:
                return x

    def _permute(self, x: int) -> int:
        left, right = x >> self.half, x & self.mask
        for key in self.keys:
            left, right = right, left ^ (_mix64(right ^ key) & self.mask)
        return (left << self.half) | right


class StreamOrder:
    """A source's per-epoch seeded shuffle (a Shuffle keyed by seed, stream and epoch) and one rank's
    share of it: positions r, r + dp_size, ... of each epoch."""

    def __init__(self, name: str, size: int, seed: int, dp_rank: int, dp_size: int):
        self.name, self.size, self.seed = name, size, seed
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.share = size // dp_size  # equal shares keep ranks in the same epoch; the rest waits
        self._cache: collections.OrderedDict[int, Shuffle] = collections.OrderedDict()

    def index(self, epoch: int, pos: int) -> int:
        return self.at(epoch, pos * self.dp_size + self.dp_rank)

    def at(self, epoch: int, slot: int) -> int:
        """The sample at `slot` of the epoch's shuffle (the same for every data-parallel size)."""
        return self._shuffle(epoch)(slot)

    def _shuffle(self, epoch: int) -> Shuffle:
        if epoch not in self._cache:
            self._cache[epoch] = Shuffle(self.size, stable_int(self.seed, self.name, epoch))
            while len(self._cache) > 4:  # the planner, its replica and elastic heads sit in nearby epochs
                self._cache.popitem(last=False)
        return self._cache[epoch]


class Listed:
    """Samples named one by one: (epoch, index) pairs (what sat in the old ranks' buffers)."""

    def __init__(self, items: list[tuple[int, int]]):
        self.items = [tuple(item) for item in items]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, j: int) -> tuple[int, int]:
        return self.items[j]

    def state_dict(self) -> dict:
        return {"listed": [list(item) for item in self.items]}


class Undrawn:
    """The slots of a stream's epochs that old ranks had not drawn, from their cursors alone: old
    rank r (of `dp`) draws positions pos * dp + r of each epoch's shuffle, and had drawn those before
    its cursor. In order: epoch, old rank, position. O(dp) numbers, however many rows."""

    def __init__(self, order: StreamOrder, dp: int, cursors: list[tuple[int, int]]):
        self.order, self.dp, self.cursors = order, dp, [tuple(c) for c in cursors]
        share = order.size // dp
        self.first_epoch = min(e for e, _ in self.cursors)
        self.starts: list[int] = []   # per (epoch, rank): the first undrawn position
        self.ends = [0]               # cumulative counts
        for epoch in range(self.first_epoch, max(e for e, _ in self.cursors) + 1):
            for e, pos in self.cursors:
                start = pos if epoch == e else 0 if epoch > e else share
                self.starts.append(start)
                self.ends.append(self.ends[-1] + share - start)

    def __len__(self) -> int:
        return self.ends[-1]

    def __getitem__(self, j: int) -> tuple[int, int]:
        segment = bisect.bisect_right(self.ends, j) - 1
        epoch, rank = self.first_epoch + segment // self.dp, segment % self.dp
        pos = self.starts[segment] + j - self.ends[segment]
        return epoch, self.order.at(epoch, pos * self.dp + rank)

    def state_dict(self) -> dict:
        return {"undrawn": {"dp": self.dp, "cursors": [list(c) for c in self.cursors]}}


class Left:
    """What old ranks left of a stream's unfinished epochs, as one lazy sequence of (epoch, index):
    their own heads' remainders, their buffers, and their undrawn slots (nothing listed row by row
    but the buffers)."""

    def __init__(self, parts: list):
        self.parts = [part for part in parts if len(part)]
        self.ends = list(itertools.accumulate((len(part) for part in self.parts), initial=0))

    def __len__(self) -> int:
        return self.ends[-1]

    def __getitem__(self, j: int) -> tuple[int, int]:
        k = bisect.bisect_right(self.ends, j) - 1
        return self.parts[k][j - self.ends[k]]

    def state_dict(self) -> list[dict]:
        return [part.state_dict() for part in self.parts]

    @classmethod
    def from_state(cls, parts: list[dict], order: StreamOrder) -> Left:
        return cls([_part_from_state(part, order) for part in parts])


class Head:
    """A rank's deal of what old ranks left (`left`): items first, first + step, ... (the rank's
    place among the new ranks, and their count), of which `taken` are drawn. O(1) beyond `left`."""

    def __init__(self, left: Left, first: int, step: int, taken: int = 0):
        self.left, self.first, self.step, self.taken = left, first, step, taken

    def __len__(self) -> int:
        return max(0, -(-(len(self.left) - self.next_item) // self.step))

    @property
    def next_item(self) -> int:
        return self.first + self.taken * self.step

    def popleft(self) -> tuple[int, int]:
        item = self.left[self.next_item]
        self.taken += 1
        return item

    def rest(self) -> Dealt:
        """The items not drawn yet (what an elastic resume deals again)."""
        return Dealt(self.left, self.next_item, self.step)

    def copy(self) -> Head:
        return Head(self.left, self.first, self.step, self.taken)

    def state_dict(self) -> dict:
        return {"left": self.left.state_dict(), "first": self.first, "step": self.step, "taken": self.taken}

    @classmethod
    def from_state(cls, state: dict | list, order: StreamOrder) -> Head:
        if isinstance(state, list):  # a cursor of an older pan: (epoch, index) pairs
            return cls(Left([Listed(state)]), 0, 1)
        return cls(Left.from_state(state["left"], order), state["first"], state["step"], state["taken"])


class Dealt:
    """Items start, start + step, ... of `left` (the rest of an old rank's head)."""

    def __init__(self, left: Left, start: int, step: int):
        self.left, self.start, self.step = left, start, step

    def __len__(self) -> int:
        return max(0, -(-(len(self.left) - self.start) // self.step))

    def __getitem__(self, j: int) -> tuple[int, int]:
        return self.left[self.start + j * self.step]

    def state_dict(self) -> dict:
        return {"dealt": {"left": self.left.state_dict(), "start": self.start, "step": self.step}}


def _part_from_state(part: dict, order: StreamOrder):
    if "listed" in part:
        return Listed(part["listed"])
    if "undrawn" in part:
        return Undrawn(order, part["undrawn"]["dp"], part["undrawn"]["cursors"])
    dealt = part["dealt"]
    return Dealt(Left.from_state(dealt["left"], order), dealt["start"], dealt["step"])


class Planner:
    """Which sample comes next: the mixing draw for step n, then that stream's next position."""

    def __init__(self, streams: dict[str, StreamOrder], weights: dict[str, float], image_prob: float,
                 seed: int, dp_rank: int):
        self.streams, self.seed, self.dp_rank = streams, seed, dp_rank
        self.image_prob = image_prob
        self.video_names = list(weights)
        total = sum(weights.values())
        self.cumulative = np.cumsum([weights[n] / total for n in self.video_names]).tolist()
        self.step = 0
        self.cursor = {name: (0, 0) for name in streams}  # stream -> (epoch, pos)
        # stream -> what to draw before its cursor: an elastic resume's share of the old ranks'
        # unfinished epochs.
        self.head: dict[str, Head] = {}

    def next_ref(self) -> Ref:
        rng = random.Random(f"{self.seed}/{self.dp_rank}/{self.step}")
        if rng.random() < self.image_prob:
            name = IMAGE_STREAM
        else:
            u = rng.random()
            name = self.video_names[min(np.searchsorted(self.cumulative, u, side="right"),
                                        len(self.video_names) - 1)]
        head = self.head.get(name)
        if head:
            epoch, index = head.popleft()
            ref = Ref(self.step, name, epoch, -1, index)
            self.step += 1
            return ref
        epoch, pos = self.cursor[name]
        stream = self.streams[name]
        ref = Ref(self.step, name, epoch, pos, stream.index(epoch, pos))
        self.cursor[name] = (epoch + 1, 0) if pos + 1 == stream.share else (epoch, pos + 1)
        self.step += 1
        return ref

    def copy(self) -> Planner:
        twin = Planner.__new__(Planner)
        twin.__dict__.update(self.__dict__)
        twin.cursor = dict(self.cursor)
        twin.head = {name: head.copy() for name, head in self.head.items()}
        return twin

    def state_dict(self) -> dict:
        return {"step": self.step,
                "streams": {n: {"epoch": e, "pos": p, "size": self.streams[n].size}
                            for n, (e, p) in self.cursor.items()},
                "head": {n: head.state_dict() for n, head in self.head.items() if head}}

"""Planning: streams, shares and the mixing RNG (runs in the training process). Which sample a data
shard draws next, from counters alone (pan/data/packed.py tells how that makes resume exact), and
`seed_draws`, the seeding of a micro-batch's random draws from what names it."""

from __future__ import annotations

import collections
import hashlib
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


class StreamOrder:
    """A source's per-epoch seeded shuffle and one rank's share of it."""

    def __init__(self, name: str, size: int, seed: int, dp_rank: int, dp_size: int):
        self.name, self.size, self.seed = name, size, seed
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.share = size // dp_size  # equal shares keep ranks in the same epoch; the rest waits
        self._cache: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()

    def index(self, epoch: int, pos: int) -> int:
        return self.at(epoch, pos * self.dp_size + self.dp_rank)

    def at(self, epoch: int, slot: int) -> int:
        """The sample at `slot` of the epoch's shuffle (the same for every data-parallel size)."""
        return int(self._permutation(epoch)[slot])

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._cache:
            rng = np.random.default_rng([self.seed, stable_int(self.name), epoch])
            self._cache[epoch] = rng.permutation(self.size).astype(np.int64)
            while len(self._cache) > 2:  # the planner and its replica may sit in adjacent epochs
                self._cache.popitem(last=False)
        return self._cache[epoch]


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
        # stream -> (epoch, index) still to draw before its cursor: an elastic resume's share of the
        # old ranks' unfinished epochs.
        self.head: dict[str, collections.deque[tuple[int, int]]] = {}

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
        twin.head = {name: collections.deque(items) for name, items in self.head.items()}
        return twin

    def state_dict(self) -> dict:
        return {"step": self.step,
                "streams": {n: {"epoch": e, "pos": p, "size": self.streams[n].size}
                            for n, (e, p) in self.cursor.items()},
                "head": {n: [list(item) for item in items] for n, items in self.head.items() if items}}

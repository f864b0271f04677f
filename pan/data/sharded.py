"""The data of one data-parallel rank as data shards, each a PackedLoader of its own (see
ShardedLoader)."""

from __future__ import annotations

from pan.data.batch import RawBatch
from pan.data.packed import PackedLoader


class ShardedLoader:
    """The data of one data-parallel rank as `accumulation` shards of the run's data: micro-batch m
    of every step comes from shard dp_rank x accumulation + m, each shard a PackedLoader of its own
    (its share of every stream, its cursor, its buffer).

    The data a step trains is then a function of the shard count alone (data-parallel ranks x
    gradient_accumulation_steps), not of how the shards are spread over ranks: a resume on another
    data-parallel size whose accumulation keeps the count continues every shard exactly, and each
    step trains the same micro-batches as the uninterrupted run would have. Another count continues
    through `load_elastic_state` (nothing lost or repeated, but other batches). The shards of a rank
    share one record of bad samples (and one account of the rows being read) and split its decoding
    workers.
    """

    def __init__(self, loaders: dict[int, PackedLoader], writes_cursors: bool = True):
        self.loaders = loaders
        # Whether this rank writes its shards' cursors into checkpoints: False where other ranks
        # read the same shards and one of them writes (a context group, an AR sync group).
        self.writes_cursors = writes_cursors
        self._turn = 0  # the shard of the next micro-batch
        self._share_bad_sample_record()

    @property
    def shards(self) -> list[int]:
        return list(self.loaders)

    def __iter__(self) -> ShardedLoader:
        return self

    def __next__(self) -> RawBatch:
        loader = self.loaders[self.shards[self._turn]]
        self._turn = (self._turn + 1) % len(self.loaders)
        return next(loader)

    def shard_states(self) -> dict[int, dict]:
        return {shard: loader.state_dict() for shard, loader in self.loaders.items()}

    def load_shard_states(self, states: dict[int, dict]) -> None:
        """Continue each shard exactly (states: shard -> its state_dict, from any data-parallel size)."""
        for shard, loader in self.loaders.items():
            loader.load_state_dict(states[shard])
        self._turn = 0
        self._share_bad_sample_record()

    def load_elastic_state(self, states: list[dict]) -> None:
        """Continue a run of another shard count from all its shards' cursors."""
        for loader in self.loaders.values():
            loader.load_elastic_state(states)
        self._turn = 0
        self._share_bad_sample_record()

    def _share_bad_sample_record(self) -> None:
        """One record of bad samples for the rank's shards, and one account of the rows their
        workers are reading (pan.data.packed.Visits): a bad row is read once by all of them."""
        record = {}
        for loader in self.loaders.values():
            record.update(loader.known_bad)
        visits = next(iter(self.loaders.values())).visits
        others = [loader for loader in self.loaders.values() if loader.visits is not visits]
        visits.remembered += sum(loader.visits.remembered for loader in others)
        for loader in self.loaders.values():
            loader.known_bad = record
        for loader in others:  # (at the start: nothing is in flight yet)
            visits.shards.update(loader.visits.shards)
            loader.visits = visits

    @property
    def known_bad(self) -> dict[tuple[str, int], tuple[str, str]]:
        return next(iter(self.loaders.values())).known_bad

    @property
    def bad_samples(self) -> dict[str, tuple[str, str]]:
        return next(iter(self.loaders.values())).bad_samples

    def close(self) -> None:
        for loader in self.loaders.values():
            loader.close()

"""The packed data loader: seeded streams -> decoding workers -> lookahead buffer -> packed batches.

How exact resume works. Every rank walks its own sequence of sample references, planned in the
training process from nothing but counters:
- each source (a video CSV, an annotation file, or all image tars together) is a stream: a seeded
  shuffle per epoch, of which rank r owns positions r, r + dp_size, r + 2 dp_size, ...;
- the n-th sample's stream (the image tars, or which CSV or annotation file) is drawn from an RNG
  seeded by (seed, rank, n), so the "mixing RNG" state is the counter n.
Worker processes only turn references into samples (or skip reasons), in order; each sends its
share of a batch as one message (Chunks), the training process takes them one by one. The training
process replays the plan in step with what it receives, so its cursor (n, and each stream's epoch
and position) describes exactly what reached the buffer, however far the workers ran ahead. The
buffer's samples are saved as references and decoded again on resume.

A "rank" here is a data shard: one per data-parallel rank, or with `build_sharded_loader` one per
micro-batch of a step (ShardedLoader), so that the data a step trains depends on the shard count
only and a run continues exactly on any layout with the same count.

Elastic resume (another number of shards, `load_elastic_state`): from every old rank's cursor, the
samples of each stream's unfinished epochs that no old rank consumed (their buffers included) are
dealt round robin to the new ranks as a head, drawn before the stream continues with the new
shares from the next epoch. No sample is lost or trained twice in any epoch. The head is computed
as it is drawn (pan.data.plan.Head): its state is the old ranks' cursors, not a list of rows.
"""

from __future__ import annotations

import atexit
import collections
import itertools
import logging
import signal
import weakref
from typing import Callable

import torch
from torch.utils.data import DataLoader

from pan.data.batch import RawBatch, Sample
from pan.data.config import DataConfig
from pan.data.fit import SampleFit
from pan.data.packing import LookaheadPacker
from pan.data.plan import IMAGE_STREAM, Head, Left, Listed, Planner, Ref, StreamOrder, Undrawn
from pan.data.reader import Deferred, KnownBad, Loaded, RowSource, SampleReader, rules_of
from pan.data.sources import ImageTarSet, SourceError

logger = logging.getLogger(__name__)

STATE_VERSION = 2     # 2: epochs shuffled by pan.data.plan.Shuffle, elastic heads as cursors
READABLE_VERSIONS = (1, 2)
TokensOf = Callable[[int, int, int], int]


class DataResumeError(ValueError):
    """A dataloader state that cannot be restored under the current config."""


def _keep(item: Loaded) -> Loaded:
    return item  # the DataLoader's collate step: samples travel as they are


def _ignore_sigterm(worker_id: int) -> None:
    """Decoding workers outlive a SIGTERM sent to every process of a job step (Slurm does so on
    preemption): the trainer still needs batches until its last save, then stops them itself; and
    a worker gone mid-epoch would fail the trainer's next fetch before it can save."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _stop_workers(batches) -> None:
    """Stop a DataLoader iterator's worker processes now (torch's orderly stop), not when the iterator
    is collected (an exception raised through it, a store gone past its retries, keeps it alive in
    its traceback); then `_kill`."""
    shutdown = getattr(batches, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()
        _kill(getattr(batches, "_workers", ()))


def _kill(workers) -> None:
    """SIGKILL the workers still alive. torch's last resort is SIGTERM, which they ignore
    (`_ignore_sigterm`), and a worker waiting on a store that is gone (its reads, its read-ahead
    threads) outlasts torch's stop; multiprocessing would then wait for it at exit, forever. Nothing a
    worker holds is kept."""
    for worker in workers:
        if worker.is_alive():
            worker.kill()
            worker.join()


Key = tuple[str, int]  # a row: (stream, index)


class Visits:
    """The rows a rank's decoding workers are reading now (a visit sent, its sample not arrived yet:
    row -> the data shard whose workers read it) and the rows read good lately. The shards of a
    rank share one (ShardedLoader), as they share the record of bad samples.

    Why: the sampler sends a visit of a row in the run's record of bad samples as KnownBad, but a
    row joins the record only when its sample arrives, and the workers keep many visits in flight.
    With fewer rows than that, every pass over the data sent a bad row again before its first visit
    had come back, and each copy was read. Now a visit of a row that is being read and not known to
    be good is sent as Deferred: not read by the worker, settled by the training process once the
    earlier visit is in (a skip when that found the row bad; else read there)."""

    def __init__(self, remembered: int):
        self.reading: dict[Key, int] = {}   # row -> the data shard whose workers read it
        self.good: collections.OrderedDict[Key, None] = collections.OrderedDict()
        self.remembered = remembered  # how many good rows are kept (the most recent ones)
        # shard -> its loader (weakly: a loader must stay collectable, its workers stop with it)
        self.shards: dict[int, weakref.ref[PackedLoader]] = {}

    def reader_of(self, key: Key) -> PackedLoader | None:
        """The loader whose workers are reading row `key` (None: no one)."""
        shard = self.reading.get(key)
        return None if shard is None else self.shards[shard]()

    def read_good(self, key: Key) -> None:
        self.good[key] = None
        self.good.move_to_end(key)
        while len(self.good) > self.remembered:
            self.good.popitem(last=False)


class RefSequence:
    """The DataLoader's sampler: buffered references to re-read first, then the plan onwards, in
    which a sample of the run's record of bad samples is sent as KnownBad (not read again), and a
    visit of a row being read already (and not known to be good) as Deferred. It runs in the
    training process, so it sees the record as it grows."""

    def __init__(self, replay: list[Ref], planner: Planner, known_bad: dict[Key, tuple[str, str]],
                 visits: Visits | None = None, shard: int = 0):
        self.replay, self.planner, self.known_bad = replay, planner, known_bad
        self.visits, self.shard = visits, shard

    def __iter__(self):
        for ref in self.replay:
            yield self._visit(ref)
        while True:
            ref = self.planner.next_ref()
            bad = self.known_bad.get((ref.stream, ref.index))
            yield self._visit(ref) if bad is None else KnownBad(ref, bad[0])

    def _visit(self, ref: Ref) -> Ref | Deferred:
        key = (ref.stream, ref.index)
        if self.visits is None or key in self.visits.good:
            return ref
        if key in self.visits.reading:
            return Deferred(ref)
        self.visits.reading[key] = self.shard
        return ref


# A message's round trip is paid for by then; more would only grow the message (samples up to
# Sample.BY_VALUE_BYTES travel inside it: a batch of 256 images would be one 200 MB pickle).
MAX_SAMPLES_PER_MESSAGE = 16


class Chunks:
    """The DataLoader's sampler with workers: the visits of `sequence` in lists of `size`, so that a
    worker reads a list and sends its samples back as one message. Each visit's round trip (its
    reference sent, its sample pickled back, the threads and processes woken on both sides) cost the
    training process ~0.5 ms on a 2-core CPU: for small samples, more than the sample itself."""

    def __init__(self, sequence: RefSequence, size: int):
        self.sequence, self.size = sequence, size

    def __iter__(self):
        visits = iter(self.sequence)
        while chunk := list(itertools.islice(visits, self.size)):
            yield chunk


class ChunkReader(torch.utils.data.Dataset):
    """The workers' dataset for Chunks: a list of visits read in order, the members of remote shards
    among them fetched ahead, concurrently (SampleReader.read_all)."""

    def __init__(self, reader: SampleReader):
        self.reader = reader

    def __getitem__(self, visits: list) -> list[Loaded]:
        return self.reader.read_all(visits)


class PackedLoader:
    """An endless iterator of RawBatch for one data-parallel rank, with exact state_dict/load."""

    def __init__(self, cfg: DataConfig, *, sources: dict[str, RowSource], tars: ImageTarSet | None,
                 planner: Planner, tokens_of: TokensOf, latent_tokens_of: TokensOf | None,
                 dp_rank: int, dp_size: int, seed: int, fit: SampleFit | None = None):
        self.cfg, self.seed, self.dp_rank, self.dp_size = cfg, seed, dp_rank, dp_size
        self.tokens_of, self.latent_tokens_of = tokens_of, latent_tokens_of
        # `fit`: what the run's model takes; a sample that does not fit is a bad sample (pan/data/fit.py).
        self.reader = SampleReader(sources, tars, rules_of(cfg), fit=fit,
                                   cache_bytes=int(cfg.sample_cache_mb * 2**20))
        self._initial = planner.copy()
        self.planner = planner              # advanced only by samples that reached this process
        self.packer = LookaheadPacker(cfg.max_tokens_per_batch, cfg.max_samples_per_batch,
                                      cfg.packing_lookahead)  # items: (Ref, Sample)
        self.replay: list[Ref] = []         # buffered references still to be re-read after a resume
        self.skipped_total: collections.Counter[str] = collections.Counter()  # skips, by reason
        self._skipped_since: collections.Counter[str] = collections.Counter()
        # The run's record of bad samples: (stream, index) -> (reason, detail). Each is read once
        # per run (carried in the checkpoint); later visits are skipped without reading it.
        self.known_bad: dict[Key, tuple[str, str]] = {}
        # Rows being read by the workers and rows read good lately (see Visits); shared by the shards.
        self.visits = Visits(max(4096, 4 * self.samples_in_flight()))
        self.visits.shards[dp_rank] = weakref.ref(self)
        self._arrived: collections.deque[Loaded] = collections.deque()  # taken in ahead (settle)
        self.batches = 0                    # batches made so far (saved: it numbers the next one)
        self.batched_samples = 0            # samples in them
        self._results = None
        self._batches = None   # the DataLoader's iterator (its worker processes), when running

    # --- iteration -------------------------------------------------------------------------------

    def __iter__(self) -> PackedLoader:
        return self

    def __next__(self) -> RawBatch:
        last_good = dict(self.planner.cursor)
        while self.packer.wants_more():
            if self._receive():
                last_good = dict(self.planner.cursor)
            elif self._passed_everything_since(last_good):
                raise SourceError(f"no usable sample in a whole pass over the data of data shard "
                                  f"{self.dp_rank}; skipped so far: {dict(self.skipped_total)}. "
                                  "See the warnings above for why each was skipped.")
        chosen = self.packer.take()
        skipped, self._skipped_since = dict(self._skipped_since), collections.Counter()
        batch = RawBatch(samples=[p.item[1] for p in chosen], tokens=sum(p.tokens for p in chosen),
                         token_budget=self.cfg.max_tokens_per_batch, skipped=skipped, shard=self.dp_rank,
                         number=self.batches, first_sample=self.batched_samples)
        self.batches += 1
        self.batched_samples += len(chosen)
        return batch

    def _passed_everything_since(self, cursor: dict[str, tuple[int, int]]) -> bool:
        """Has every stream gone through one whole epoch (not just `share` samples: epochs are
        shuffled apart) since `cursor`?"""
        for name, (epoch, _) in self.planner.cursor.items():
            first_full_epoch = cursor[name][0] + (1 if cursor[name][1] > 0 else 0)
            if epoch <= first_full_epoch:
                return False
        return True

    def _receive(self) -> bool:
        """Take the next sample into the buffer; False if it was skipped."""
        got = self._next_arrival()
        if self.replay:
            expected = self.replay.pop(0)
        else:
            expected = self.planner.next_ref()
        assert got.ref == expected, f"decoded {got.ref}, expected {expected}"
        if got.deferred:
            got = self._settle_deferred(got)
        if got.sample is None:
            self._skip(got)
            return False
        self.packer.add(got.ref.seq, got.sample.tokens, (got.ref, got.sample))
        return True

    def _next_arrival(self) -> Loaded:
        if self._arrived:
            return self._arrived.popleft()
        if self._results is None:
            self._start_workers()
        return self._arrive(next(self._results))

    def _arrive(self, got: Loaded) -> Loaded:
        """A visit's outcome as it comes in: a sample's tokens counted (over the budget, or of a
        shape the recipe's token count refuses: skipped), its row no longer being read, and a bad
        row recorded (the first time)."""
        if got.deferred:
            return got
        sample = got.sample
        if sample is not None:
            try:
                sample.tokens = self._tokens(sample)
            except ValueError as e:  # the recipe cannot count it: a shape its model cannot take
                got = Loaded(got.ref, None, "unfit", str(e))
            else:
                if sample.tokens > self.cfg.max_tokens_per_batch:
                    got = Loaded(got.ref, None, "over_budget", f"{sample.tokens} tokens > "
                                                               f"max_tokens_per_batch {self.cfg.max_tokens_per_batch}")
        if not got.known:
            key = (got.ref.stream, got.ref.index)
            if self.visits.reading.get(key) == self.dp_rank:
                del self.visits.reading[key]
            if got.sample is not None:
                self.visits.read_good(key)
            else:
                self._record(got)
        return got

    def _settle_deferred(self, got: Loaded) -> Loaded:
        """A Deferred visit, when the trainer reaches it: skipped if its row was found bad meanwhile,
        else read here (its row's earlier visit came back good, or was dropped by a restart). The
        earlier visit came first on this shard; on another shard of the rank, that shard takes its
        samples in until it has come."""
        key = (got.ref.stream, got.ref.index)
        reading = self.visits.reader_of(key)
        if reading is not None and reading is not self:
            reading.settle(key)
        bad = self.known_bad.get(key)
        if bad is not None:
            return Loaded(got.ref, None, bad[0], known=True)
        return self._arrive(self.reader[got.ref])

    def settle(self, key: Key) -> None:
        """Take this shard's samples in (kept, in order, for its own batches) until its visit of row
        `key` has come back."""
        while self._results is not None and self.visits.reading.get(key) == self.dp_rank:
            self._arrived.append(self._arrive(next(self._results)))

    def _tokens(self, sample: Sample) -> int:
        if sample.latent is not None or sample.raw_latent is not None:
            return int(self.latent_tokens_of(*sample.grid))
        return int(self.tokens_of(*sample.grid))

    def _skip(self, got: Loaded) -> None:
        """Count a skip (its row was recorded when it came in: `_arrive`)."""
        self.skipped_total[got.reason] += 1
        self._skipped_since[got.reason] += 1

    def _record(self, got: Loaded) -> None:
        """Record (and log) a bad sample the first time it is found: it is not read again this run."""
        key = (got.ref.stream, got.ref.index)
        if key not in self.known_bad:
            self.known_bad[key] = (got.reason, got.detail[:300])  # the record travels in every cursor
            logger.warning("skipping %s (%s): %s", self._sample_id(got.ref), got.reason, got.detail)

    @property
    def bad_samples(self) -> dict[str, tuple[str, str]]:
        """The distinct bad samples found so far in this run: sample id -> (reason, detail)."""
        return {self._id_of(stream, index): why for (stream, index), why in self.known_bad.items()}

    def _sample_id(self, ref: Ref) -> str:
        return self._id_of(ref.stream, ref.index)

    def _id_of(self, stream: str, index: int) -> str:
        if stream == IMAGE_STREAM:
            return self.reader.tars.sample_id(self.reader.tars.images[index])
        return f"{self.reader.sources[stream].name}:{index}"

    def _start_workers(self) -> None:
        loader, workers = self._data_loader(), self.cfg.packed_dataloader_num_workers
        self._batches = iter(loader)
        self._results = itertools.chain.from_iterable(self._batches) if workers else self._batches  # workers: lists
        if workers:   # before multiprocessing's exit-time join (atexit runs the newest handler first)
            atexit.register(_kill, list(getattr(self._batches, "_workers", ())))

    def _data_loader(self) -> DataLoader:
        workers = self.cfg.packed_dataloader_num_workers
        sampler = RefSequence(list(self.replay), self.planner.copy(), self.known_bad, self.visits, self.dp_rank)
        # Our own generator: otherwise each new iterator draws its base seed from the global torch
        # RNG, and a resumed run's global RNG would be one draw away from the uninterrupted run's.
        generator = torch.Generator().manual_seed(self.seed)
        if not workers:
            return DataLoader(self.reader, batch_size=None, sampler=sampler, collate_fn=_keep, generator=generator)
        return DataLoader(ChunkReader(self.reader), batch_size=None,
                          sampler=Chunks(sampler, self.samples_per_message()), collate_fn=_keep,
                          num_workers=workers, generator=generator,
                          prefetch_factor=self.messages_in_flight_per_worker(), worker_init_fn=_ignore_sigterm)

    def worker_share(self) -> int:
        """Samples of a batch each decoding worker reads."""
        return -(-self.cfg.max_samples_per_batch // self.cfg.packed_dataloader_num_workers)  # ceil

    def samples_per_message(self) -> int:
        """A worker's share of a batch, sent back as one message, at most MAX_SAMPLES_PER_MESSAGE."""
        return min(self.worker_share(), MAX_SAMPLES_PER_MESSAGE)

    def messages_in_flight_per_worker(self) -> int:
        """`packed_dataloader_prefetch_factor` whole batches' shares, in messages: fewer, and the
        trainer waits for most of each batch to be decoded."""
        share_samples = self.cfg.packed_dataloader_prefetch_factor * self.worker_share()
        return -(-share_samples // self.samples_per_message())

    def samples_in_flight(self) -> int:
        """Visits the decoding workers hold at most (0 without workers: each is read when needed)."""
        workers = self.cfg.packed_dataloader_num_workers
        return workers * self.messages_in_flight_per_worker() * self.samples_per_message() if workers else 0

    def close(self) -> None:
        """Stop the decoding workers (they restart on the next batch, from what the trainer took)."""
        _stop_workers(self._batches)
        self._batches = self._results = None
        self._arrived.clear()
        for key in [key for key, shard in self.visits.reading.items() if shard == self.dp_rank]:
            del self.visits.reading[key]

    # --- state -----------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The cursor of what the trainer has consumed (JSON-serialisable)."""
        pending = [p.item[0] for p in sorted(self.packer.buffer, key=lambda p: p.seq)] + self.replay
        return {"version": STATE_VERSION, "dp_rank": self.dp_rank, "dp_size": self.dp_size,
                "seed": self.seed, "batches": self.batches,
                "batched_samples": self.batched_samples, "planner": self.planner.state_dict(),
                "buffer": [[r.seq, r.stream, r.epoch, r.pos, r.index] for r in pending],
                "skipped_total": dict(self.skipped_total),
                "bad_samples": [[stream, index, reason, detail]
                                for (stream, index), (reason, detail) in sorted(self.known_bad.items())]}

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly where `state` (from state_dict) left off; restarts the workers."""
        self.close()
        self.packer.buffer, self.replay = [], []
        self._skipped_since = collections.Counter()
        self.known_bad = {}
        if state.get("version") not in READABLE_VERSIONS:
            raise DataResumeError(f"dataloader state version {state.get('version')} is not one of "
                                  f"{READABLE_VERSIONS}: it was written by another pan version.")
        _warn_if_shuffled_otherwise([state])
        if state["dp_size"] != self.dp_size:
            if not self.cfg.restart_data_on_dp_change:
                raise DataResumeError(
                    f"the checkpoint's data cursors were written by {state['dp_size']} data-parallel "
                    f"ranks, this run has {self.dp_size}: each rank's cursor covers its own share of "
                    "the data, so they cannot be carried over. Resume with the same world_size / "
                    "cp_size, or set restart_data_on_dp_change: true to restart every data stream.")
            logger.warning("data-parallel size changed from %d to %d: restarting every data stream "
                           "(restart_data_on_dp_change)", state["dp_size"], self.dp_size)
            self.planner = self._initial.copy()
            self.skipped_total = collections.Counter()
            return
        if state["dp_rank"] != self.dp_rank:
            raise DataResumeError(f"this is the cursor of rank {state['dp_rank']}, loaded on rank "
                                  f"{self.dp_rank}: load dataloader/<rank>.json of your own rank.")
        if state["seed"] != self.seed:
            logger.warning("data seed changed from %s to %s: the streams keep their positions in "
                           "differently shuffled epochs", state["seed"], self.seed)
        self.skipped_total = collections.Counter(state.get("skipped_total", {}))
        self.batches = state.get("batches", 0)
        self.batched_samples = state.get("batched_samples", 0)
        self.planner, restarted = self._restored_planner(state["planner"])
        for seq, stream, epoch, pos, *index in state["buffer"]:
            if stream not in restarted:
                index = index[0] if index else self.planner.streams[stream].index(epoch, pos)
                self.replay.append(Ref(seq, stream, epoch, pos, index))
        # A restarted stream's rows may have changed: its bad samples are looked at again.
        self.known_bad = {(stream, index): (reason, detail)
                          for stream, index, reason, detail in state.get("bad_samples", [])
                          if stream not in restarted}

    def load_elastic_state(self, states: list[dict]) -> None:
        """Continue a run of another data-parallel size from all its ranks' cursors (`states[r]`:
        old rank r's state_dict): the samples of each stream's unfinished epochs that no old rank
        consumed are dealt round robin to the new ranks, then each stream goes on with the new
        shares from the next epoch."""
        self.close()
        self.packer.buffer, self.replay = [], []
        self._skipped_since = collections.Counter()
        old_dp = len(states)
        for r, state in enumerate(states):
            if state.get("version") not in READABLE_VERSIONS or state["dp_rank"] != r or state["dp_size"] != old_dp:
                raise DataResumeError(f"the {old_dp} data cursors of the checkpoint are not those of one run "
                                      f"(cursor {r}: rank {state.get('dp_rank')} of {state.get('dp_size')}, "
                                      f"version {state.get('version')})")
        _warn_if_shuffled_otherwise(states)
        planner = self._initial.copy()
        planner.step = max(state["planner"]["step"] for state in states)  # fresh mixing draws
        self.batches = max(state.get("batches", 0) for state in states)
        self.batched_samples = max(state.get("batched_samples", 0) for state in states)
        restarted = set()
        for name, order in planner.streams.items():
            saved = [state["planner"]["streams"].get(name) for state in states]
            if any(c is None or c["size"] != order.size for c in saved) or (
                    name != IMAGE_STREAM and not self.cfg.resume_video_csv):
                logger.warning("data stream %s restarts from the top (new, resized, or resume_video_csv "
                               "is false)", name)
                restarted.add(name)
                continue
            planner.head[name] = Head(unconsumed(order, states, name), self.dp_rank, self.dp_size)
            planner.cursor[name] = (max(c["epoch"] for c in saved) + 1, 0)
        self.planner = planner
        self.known_bad = {(stream, index): (reason, detail) for state in states
                          for stream, index, reason, detail in state.get("bad_samples", [])
                          if stream not in restarted}
        self.skipped_total = collections.Counter()
        if self.dp_rank == 0:  # the old ranks' skip counts, once
            for state in states:
                self.skipped_total.update(state.get("skipped_total", {}))
        logger.info("data-parallel size %d -> %d: this rank finishes %d samples of the old ranks' "
                    "unfinished epochs first", old_dp, self.dp_size, sum(map(len, planner.head.values())))

    def _restored_planner(self, saved: dict) -> tuple[Planner, set[str]]:
        """The saved cursor applied to today's streams, and the streams that restart from the top."""
        planner = self._initial.copy()
        planner.step = saved["step"]
        restarted = set()
        for name, order in planner.streams.items():
            cursor = saved["streams"].get(name)
            if cursor is None:
                logger.warning("data stream %s is new since the checkpoint: it starts from the top", name)
            elif cursor["size"] != order.size:
                logger.warning("data stream %s has %d samples, %d when saved: it restarts from the top",
                               name, order.size, cursor["size"])
            elif name != IMAGE_STREAM and not self.cfg.resume_video_csv:
                logger.info("resume_video_csv is false: video stream %s restarts from the top", name)
            else:
                planner.cursor[name] = (cursor["epoch"], cursor["pos"])
                head = saved.get("head", {}).get(name)
                if head:
                    planner.head[name] = Head.from_state(head, order)
                continue
            restarted.add(name)
        restarted |= set(saved["streams"]) - set(planner.streams)
        return planner, restarted


def _warn_if_shuffled_otherwise(states: list[dict]) -> None:
    old = sorted({state["version"] for state in states if state["version"] < STATE_VERSION})
    if old:
        logger.warning("the data cursors were written by a pan that shuffled epochs otherwise (state version "
                       "%s): the streams keep their positions in differently shuffled epochs",
                       ", ".join(map(str, old)))


def unconsumed(order: StreamOrder, states: list[dict], name: str) -> Left:
    """(epoch, index) of every sample of stream `name` that the ranks of `states` (old rank r:
    positions r, r + dp, ... of each epoch's shuffle) had not consumed, as a lazy sequence: the rest
    of their own elastic heads, what sat in their buffers, and what is left of their unfinished
    epochs (described by their cursors, not listed: O(ranks), not O(rows))."""
    old_dp = len(states)
    heads, buffered = [], []
    for r, state in enumerate(states):
        head = state["planner"].get("head", {}).get(name)
        if head:
            heads.append(Head.from_state(head, order).rest())
        # Buffered samples were drawn (possibly epochs ago: packing keeps a long one waiting) but
        # not trained. (Cursors of older pan versions carry no index.)
        buffered += [(epoch, index[0] if index else order.at(epoch, pos * old_dp + r))
                     for _seq, stream, epoch, pos, *index in state["buffer"] if stream == name]
    cursors = [(c["epoch"], c["pos"]) for c in (s["planner"]["streams"][name] for s in states)]
    return Left([*heads, Listed(sorted(buffered, key=lambda item: item[0])), Undrawn(order, old_dp, cursors)])

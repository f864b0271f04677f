"""Read-ahead of the members of remote shards: a decoding worker knows the visits of a message before
it reads the first, so the members they read are fetched concurrently ahead of it (in bounded
memory), and `Storage.read_member` takes them from here when the reader gets there
(`Storage.read_ahead`, `SampleReader.read_all`)."""

from __future__ import annotations

import collections
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

Span = tuple[str, int, int]   # a member of a remote object: (url, offset, size)


class Fetcher(Protocol):
    """What read-ahead asks of the storage (pan/data/storage.py Storage)."""

    def cached_member(self, url: str, offset: int, size: int) -> bool: ...

    def fetch_member(self, url: str, offset: int, size: int) -> bytes: ...

    def threads(self) -> ThreadPoolExecutor: ...


class ReadAhead:
    """The remote members a reader will read next (`spans`, in its order), fetched ahead by the
    storage's threads (`Storage.threads`): `depth` of them fetched or being fetched at most (so at
    most `depth` members' bytes held), the next started each time the reader takes one. A fetch is
    `Storage.fetch_member`: one try of each request, the bytes put in the local cache as well. It
    only warms bytes: a member whose fetch failed, or that was not fetched (never started, passed
    over, already taken once), is read by `read_member` as without read-ahead, with its retries
    and its errors (a missing object: missing_file; a store gone: StorageError)."""

    def __init__(self, store: Fetcher, spans: Iterable[Span], depth: int):
        self.store, self.depth = store, depth
        self.order = list(dict.fromkeys(spans))           # each member once, in the reader's order
        self.position = {span: i for i, span in enumerate(self.order)}
        self.next = 0                                      # the next of `order` to start
        self.started: collections.OrderedDict[Span, Future] = collections.OrderedDict()
        self.fill()

    def fill(self) -> None:
        """Start fetches until `depth` are started and not taken (a member the local cache holds
        is not fetched: the reader's own read is a local one)."""
        while self.next < len(self.order) and len(self.started) < self.depth:
            span = self.order[self.next]
            self.next += 1
            if not self.store.cached_member(*span):
                self.started[span] = self.store.threads().submit(self.store.fetch_member, *span)

    def take(self, span: Span) -> bytes | None:
        """The member's bytes, waiting for its fetch; None where it was not fetched or its fetch
        failed. The members started before it, which the reader passed over, are dropped."""
        at = self.position.get(span)
        if at is None:
            return None
        if span not in self.started:
            if at >= self.next:  # the reader is ahead of the fetches: they start after it
                self.drop()
                self.next = at + 1
                self.fill()
            return None
        while True:
            first, future = self.started.popitem(last=False)
            if first == span:
                break
            future.cancel()
        self.fill()   # the next fetch starts before this one is waited on
        try:
            return future.result()
        except Exception:  # noqa: BLE001 - read_member reads it again, with the retries
            return None

    def drop(self) -> None:
        for future in self.started.values():
            future.cancel()
        self.started.clear()

    def close(self) -> None:
        """Stop: fetches not started are cancelled, bytes not taken are let go."""
        self.drop()
        self.next = len(self.order)

"""The seam between the filesystem core and where bytes come from.

The core asks a ``RangeReader`` for byte ranges of a shard. ``DirectReader`` goes straight
to the store; the block cache and readahead implement the same protocol.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol

from .store import ShardInfo, Store


class RangeReader(Protocol):
    def read(self, shard: ShardInfo, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``shard``; raises ShardfsError on failure."""
        ...


@dataclass
class ReadCounters:
    """Bytes and requests that went to the store, counted by the reader."""

    requests: int = 0
    bytes_fetched: int = 0


class DirectReader:
    """Every read is one ranged GET on the store."""

    def __init__(self, store: Store, *, retries: int = 4) -> None:
        self.store = store
        self.retries = retries
        self.counters = ReadCounters()
        self._lock = threading.Lock()

    def read(self, shard: ShardInfo, start: int, end: int) -> bytes:
        data = self.store.read_range(shard, start, end, retries=self.retries)
        with self._lock:
            self.counters.requests += 1
            self.counters.bytes_fetched += len(data)
        return data

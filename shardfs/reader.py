"""The seam between the filesystem core and where bytes come from.

The core asks a ``RangeReader`` for byte ranges of a shard. ``DirectReader`` goes straight
to the store; the block cache and readahead implement the same protocol.
"""

from __future__ import annotations

from typing import Protocol

from .cache import BlockCache, BlockKey, shard_key
from .stats import Stats
from .store import ShardInfo, Store


class RangeReader(Protocol):
    def read(self, shard: ShardInfo, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``shard``; raises ShardfsError on failure."""
        ...


class DirectReader:
    """Every read is one ranged GET on the store (``--no-cache``)."""

    def __init__(self, store: Store, stats: Stats | None = None, *, retries: int = 4) -> None:
        self.store = store
        self.stats = stats if stats is not None else Stats()
        self.retries = retries

    def read(self, shard: ShardInfo, start: int, end: int) -> bytes:
        if start >= end:
            return b""
        data = self.store.read_range(shard, start, end, retries=self.retries)
        self.stats.add(store_requests=1, bytes_fetched=len(data))
        return data


class CachedReader:
    """Reads through the persistent block cache: each block of a shard is fetched once."""

    def __init__(self, store: Store, cache: BlockCache, stats: Stats, *, retries: int = 4) -> None:
        self.store = store
        self.cache = cache
        self.stats = stats
        self.retries = retries
        self.block_size = cache.config.block_size
        self._keys: dict[ShardInfo, str] = {}

    def _shard_key(self, shard: ShardInfo) -> str:
        key = self._keys.get(shard)
        if key is None:
            key = shard_key(self.store.location(shard), shard.size, shard.etag)
            self._keys[shard] = key
        return key

    def read(self, shard: ShardInfo, start: int, end: int) -> bytes:
        if start >= end:
            return b""  # else a whole block would be fetched for nothing
        size = self.block_size
        skey = self._shard_key(shard)
        pieces = []
        for index in range(start // size, (end - 1) // size + 1):
            block_start = index * size
            block_end = min(block_start + size, shard.size)

            def fetch(block_start: int = block_start, block_end: int = block_end) -> bytes:
                data = self.store.read_range(shard, block_start, block_end, retries=self.retries)
                self.stats.add(store_requests=1, bytes_fetched=len(data))
                return data

            pieces.append(
                self.cache.get(
                    BlockKey(skey, index),
                    max(start, block_start) - block_start,
                    min(end, block_end) - block_start,
                    block_end - block_start,
                    fetch,
                )
            )
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

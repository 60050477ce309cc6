"""The seam between the filesystem core and where bytes come from.

The core asks a ``RangeReader`` for byte ranges of a shard. ``DirectReader`` goes straight
to the store; the block cache and readahead (``CachedReader``) implement the same protocol.
The store counts the bytes and GETs it fetches (``Store.stats``, the same ``Stats`` in a
mount).
"""

from __future__ import annotations

from typing import Protocol

from ..cache import shard_key
from ..store.remote import Store
from ..store.shards import ShardInfo


def shard_key_of(store: Store, shard: ShardInfo, block_size: int) -> str:
    """The cache key of ``shard`` as ``store`` reaches it: the one place for the recipe
    (its location, size, ETag and the block size)."""
    return shard_key(store.location(shard), shard.size, shard.etag, block_size)


class RangeReader(Protocol):
    def read(self, shard: ShardInfo, start: int, end: int, extent_end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of ``shard``; raises ShardfsError on failure.
        ``extent_end``: where the file being read ends (reads ahead stop there)."""

    def read_local(self, shard: ShardInfo, start: int, end: int) -> bytes | None:
        """The same bytes if they can be had at once (no network, no disk wait), else None."""

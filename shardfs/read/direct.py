"""``--no-cache``: every read a ranged GET on the store, nothing kept on disk."""

from __future__ import annotations

from ..stats import Stats
from ..store.remote import Store
from ..store.shards import ShardInfo


class DirectReader:
    """Every read is one ranged GET on the store (``--no-cache``); from a server that
    ignores Range, reads of a shard it sent whole are cut from the store's copy."""

    def __init__(self, store: Store, stats: Stats, *, retries: int = 4) -> None:
        self.store = store
        self.stats = stats
        self.retries = retries

    def read(self, shard: ShardInfo, start: int, end: int, extent_end: int | None = None) -> bytes:
        if start >= end:
            return b""
        return self.store.read_range(shard, start, end, retries=self.retries)

    def read_local(self, shard: ShardInfo, start: int, end: int) -> bytes | None:
        return b"" if start >= end else None

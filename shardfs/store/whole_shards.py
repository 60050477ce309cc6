"""Whole shards that a server sent for ranged GETs (it ignores ``Range``), kept in memory
within a bound, so that the next reads of such a shard are cut from the copy instead of
downloading the whole shard again.

Only ``store.Store`` uses this module, and only once its server has answered a ranged GET
with the whole object.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from .shards import ShardInfo

WHOLE_SHARDS_MEMORY = 512 << 20
"""Bytes of whole shards kept: two shards of ``pack``'s default size. A shard larger than
this is not kept (each read of it downloads it again: the warning says so)."""


class WholeShards:
    """Least recently used whole shards, at most ``budget`` bytes in all; one lock per shard
    lets a single GET bring a shard while other readers of it wait for the copy."""

    def __init__(self, budget: int = WHOLE_SHARDS_MEMORY) -> None:
        self.budget = budget
        self._bodies: OrderedDict[ShardInfo, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._shard_locks: dict[ShardInfo, threading.Lock] = {}

    def get(self, shard: ShardInfo) -> bytes | None:
        with self._lock:
            body = self._bodies.get(shard)
            if body is not None:
                self._bodies.move_to_end(shard)
            return body

    def keep(self, shard: ShardInfo, body: bytes) -> None:
        """Keep ``body`` (all of ``shard``) if it fits the budget, evicting older ones."""
        if len(body) > self.budget:
            return
        with self._lock:
            old = self._bodies.pop(shard, None)
            self._bytes -= len(old) if old is not None else 0
            while self._bodies and self._bytes + len(body) > self.budget:
                _, evicted = self._bodies.popitem(last=False)
                self._bytes -= len(evicted)
            self._bodies[shard] = body
            self._bytes += len(body)

    def held_bytes(self) -> int:
        with self._lock:
            return self._bytes

    def lock(self, shard: ShardInfo) -> threading.Lock:
        """The lock one reader holds while it GETs ``shard`` whole."""
        with self._lock:
            return self._shard_locks.setdefault(shard, threading.Lock())

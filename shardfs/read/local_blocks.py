"""News that a block of a shard is on local disk, from the reader to whoever listens.

The reader publishes once per block (stored by this process, or first found cached), and
once per file an order hint had fetched ahead as a range (its bytes held in memory); the
kernel pusher listens and puts the files lying wholly in those bytes into the kernel's
page cache. The reader
owns this event source, so a miss never calls up into the layer that asked for the bytes:
it returns its bytes, and the news goes out here.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ..store.shards import ShardInfo

log = logging.getLogger(__name__)

BlockListener = Callable[[ShardInfo, int, int, bytes | memoryview | None], None]
"""Told ``(shard, start, end, block)``: bytes ``[start, end)`` of ``shard`` are local;
``block`` holds them when they were just fetched, else None. Runs on the reading thread,
so it must only queue work."""


class LocalBlocks:
    """The listeners told when a block becomes local."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._listeners: tuple[BlockListener, ...] = ()

    @property
    def listening(self) -> bool:
        """Whether anyone listens (else the reader does not even look)."""
        return bool(self._listeners)

    def subscribe(self, listener: BlockListener) -> None:
        with self._lock:
            self._listeners = (*self._listeners, listener)

    def unsubscribe(self, listener: BlockListener) -> None:
        with self._lock:
            self._listeners = tuple(each for each in self._listeners if each != listener)

    def clear(self) -> None:
        with self._lock:
            self._listeners = ()

    def publish(
        self, shard: ShardInfo, start: int, end: int, block: bytes | memoryview | None
    ) -> None:
        """Tell every listener. A listener's failure is logged and costs neither the read
        that published nor the other listeners."""
        for listener in self._listeners:
            try:
                listener(shard, start, end, block)
            except Exception:
                log.exception("a listener for local blocks failed")

"""Background block fetches: the rest of a block a reader is waiting on, then whole shards.

Two kinds of work share a small pool of threads (``--prefetch-streams``):

- *fills* complete a block after a demand read fetched only the bytes the reader needed;
- *readahead* fetches every block of a shard once a reader has touched it (or of every
  shard, for ``--prefetch all`` and ``shardfs warm``).

Fills always go first. Demand reads never enter this queue: they are fetched by the reader's
own thread, so a cold random read never waits behind prefetches. Readahead never evicts:
``BlockCache.prefetch`` declines a block that would not fit in the cache's free budget.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections.abc import Callable, Iterable

log = logging.getLogger(__name__)

Task = Callable[[], object]
_FILL, _READAHEAD, _STOP = 0, 1, 2


class Prefetcher:
    """A priority queue of block fetches served by ``streams`` threads."""

    def __init__(self, streams: int) -> None:
        if streams < 1:
            raise ValueError("streams must be at least 1")
        self._queue: queue.PriorityQueue[tuple[int, int, Task | None]] = queue.PriorityQueue()
        self._order = itertools.count()
        self._idle = threading.Condition()
        self._pending = 0
        self._closed = False
        self._threads = [
            threading.Thread(target=self._work, name=f"prefetch-{i}", daemon=True)
            for i in range(streams)
        ]
        for thread in self._threads:
            thread.start()

    def run_soon(self, task: Task) -> None:
        """Queue a fill ahead of every readahead task."""
        self._put(_FILL, task)

    def schedule(self, tasks: Iterable[Task]) -> int:
        """Queue readahead tasks behind every fill; returns how many were queued."""
        count = 0
        for task in tasks:
            self._put(_READAHEAD, task)
            count += 1
        return count

    def _put(self, priority: int, task: Task) -> None:
        with self._idle:
            if self._closed and priority == _READAHEAD:
                return
            self._pending += 1
        self._queue.put((priority, next(self._order), task))

    def _work(self) -> None:
        while True:
            priority, _, task = self._queue.get()
            if task is None:
                return
            try:
                if not (self._closed and priority == _READAHEAD):
                    task()
            except Exception:
                log.warning("background fetch failed", exc_info=True)
            finally:
                with self._idle:
                    self._pending -= 1
                    if self._pending == 0:
                        self._idle.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until every queued task ran; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    @property
    def pending(self) -> int:
        with self._idle:
            return self._pending

    def close(self, timeout: float = 30.0) -> None:
        """Drop queued readahead, finish fills (they hold block claims), stop the threads."""
        with self._idle:
            self._closed = True
        for _ in self._threads:
            self._queue.put((_STOP, next(self._order), None))
        for thread in self._threads:
            thread.join(timeout)

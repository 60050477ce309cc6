"""Background block fetches: the rest of a block a reader is waiting on, then whole shards.

Two kinds of work share a small pool of threads (``--prefetch-streams``):

- *fills* complete a block after a demand read fetched only the bytes the reader needed;
- *hinted* readahead fetches the blocks an order hint says readers will need next, in
  first-use order, a bounded window ahead of the readers (``HintedOrder``);
- *readahead* fetches every block of a shard once a reader has touched it (or of every
  shard, for ``--prefetch all`` and ``shardfs warm``).

Fills always go first, then hinted blocks. Demand reads never enter this queue: they are
fetched by the reader's own thread, so a cold random read never waits behind prefetches.
Hinted blocks start slowly: at first two run at a time, one more for each that finishes, up
to every stream. Eight at once split the server between eight blocks, so the block the
readers need first came no sooner than the eighth (a cold shard-mode epoch's first batch on
moto: median 0.69 s against 0.85 s, 5 interleaved runs each; whole epochs within noise).
"""

from __future__ import annotations

import bisect
import itertools
import logging
import queue
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable

log = logging.getLogger(__name__)

Task = Callable[[], object]
_FILL, _HINTED, _READAHEAD, _STOP = 0, 1, 2, 3


HINTED_FIRST_STREAMS = 2
"""Hinted fetches allowed to run at once at first; each one that finishes allows one more."""


class Prefetcher:
    """A priority queue of block fetches served by ``streams`` threads."""

    def __init__(self, streams: int, *, hinted_first: int = HINTED_FIRST_STREAMS) -> None:
        if streams < 1:
            raise ValueError("streams must be at least 1")
        self._queue: queue.PriorityQueue[tuple[int, int, Task | None]] = queue.PriorityQueue()
        self._order = itertools.count()
        self._idle = threading.Condition()
        self._pending = 0
        self._closed = False
        # Hinted tasks wait here until a slot is free: the slow start described above.
        self._hinted: deque[Task] = deque()
        self._hinted_running = 0
        self._hinted_limit = max(1, min(hinted_first, streams))
        self._streams = streams
        self._threads = [
            threading.Thread(target=self._work, name=f"prefetch-{i}", daemon=True)
            for i in range(streams)
        ]
        for thread in self._threads:
            thread.start()

    @property
    def streams(self) -> int:
        """Threads serving the queue: how many fetches may run at once."""
        return self._streams

    def run_soon(self, task: Task) -> None:
        """Queue a fill ahead of every readahead task."""
        self._put(_FILL, task)

    def schedule(self, tasks: Iterable[Task], *, hinted: bool = False) -> int:
        """Queue readahead tasks behind every fill; returns how many were queued. Tasks
        that follow an order hint go ahead of whole-shard readahead."""
        if hinted:
            return self._schedule_hinted(tasks)
        count = 0
        for task in tasks:
            self._put(_READAHEAD, task)
            count += 1
        return count

    def _schedule_hinted(self, tasks: Iterable[Task]) -> int:
        with self._idle:
            if self._closed:
                return 0
            before = len(self._hinted)
            self._hinted.extend(tasks)
            count = len(self._hinted) - before
            self._pending += count
            ready = self._release_hinted()
        for task in ready:
            self._queue.put((_HINTED, next(self._order), task))
        return count

    def _release_hinted(self) -> list[Task]:
        """Hinted tasks that may start now (call with ``_idle`` held)."""
        ready = []
        while self._hinted and self._hinted_running < self._hinted_limit:
            ready.append(self._hinted.popleft())
            self._hinted_running += 1
        return ready

    def _put(self, priority: int, task: Task) -> None:
        with self._idle:
            if self._closed and priority in (_HINTED, _READAHEAD):
                return
            self._pending += 1
        self._queue.put((priority, next(self._order), task))

    def _work(self) -> None:
        while True:
            priority, _, task = self._queue.get()
            if task is None:
                return
            ready: list[Task] = []
            try:
                if not (self._closed and priority in (_HINTED, _READAHEAD)):
                    task()
            except Exception:
                log.warning("background fetch failed", exc_info=True)
            finally:
                with self._idle:
                    self._pending -= 1
                    if priority == _HINTED:
                        self._hinted_running -= 1
                        self._hinted_limit = min(self._hinted_limit + 1, self._streams)
                        if not self._closed:
                            ready = self._release_hinted()
                    if self._pending == 0:
                        self._idle.notify_all()
            for waiting in ready:
                self._queue.put((_HINTED, next(self._order), waiting))

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
            self._pending -= len(self._hinted)
            self._hinted.clear()
            if self._pending == 0:
                self._idle.notify_all()
        for _ in self._threads:
            self._queue.put((_STOP, next(self._order), None))
        for thread in self._threads:
            thread.join(timeout)


_FIRST_WINDOW = 64 << 10
_MAX_WINDOW = 512 << 10
_MEMORY = 16 << 20
_GAP = 4096  # tar headers between two files read one after the other (pax ones included)
_STREAMS = 4096


class MemoryReadahead:
    """Reads without the block cache: what is asked for, plus a read-ahead window that
    doubles (64 KiB up to 512 KiB) while reads of a shard move forward and drops to nothing
    on a seek. The bytes read ahead are kept in a bounded LRU of ranges.

    A whole block per read would multiply egress by the block size over the file size
    (about 14x for 70 KB files in 1 MiB blocks); this stays near 1x for sequential and for
    random reads alike."""

    def __init__(
        self,
        *,
        first_window: int = _FIRST_WINDOW,
        max_window: int = _MAX_WINDOW,
        memory: int = _MEMORY,
    ) -> None:
        self.first_window = first_window
        self.max_window = max_window
        self.memory = memory
        self._ranges: OrderedDict[tuple[str, int], bytes] = OrderedDict()
        self._bytes = 0
        # next expected offset, window, reads in a row that continued the one before
        self._streams: OrderedDict[str, tuple[int, int, int]] = OrderedDict()
        self._lock = threading.Lock()

    def read(
        self, shard: str, start: int, end: int, size: int, fetch: Callable[[int, int], bytes]
    ) -> bytes:
        """Bytes ``[start, end)`` of the shard ``shard`` (of ``size`` bytes); ``fetch(a, b)``
        gets bytes ``[a, b)`` from the store."""
        if start >= end:
            return b""
        with self._lock:
            window = self._advance(shard, start, end)
            head = self._find(shard, start, end)
        have = start + len(head)
        if have >= end:
            return head
        stop = max(end, min(size, end + window))
        data = fetch(have, stop)
        wanted = end - have
        if len(data) > wanted:
            with self._lock:
                self._keep(shard, end, data[wanted:])
        return head + data[:wanted] if head else data[:wanted]

    def _advance(self, shard: str, start: int, end: int) -> int:
        """The window for this read: none until it is the second read in a row to continue
        the shard's last one (a few tar headers of gap allowed), then doubling. One random
        read may land just after the last by chance; a window for it would be wasted."""
        last = self._streams.pop(shard, None)
        window, run = 0, 0
        if last is not None:
            expected, previous, previous_run = last
            if expected <= start <= expected + _GAP:
                run = previous_run + 1
                if run >= 2:
                    window = min(max(previous * 2, self.first_window), self.max_window)
        self._streams[shard] = (end, window, run)
        while len(self._streams) > _STREAMS:
            self._streams.popitem(last=False)
        return window

    def _find(self, shard: str, start: int, end: int) -> bytes:
        """The longest run of bytes from ``start`` (up to ``end``) held in memory."""
        for (key, offset), data in reversed(self._ranges.items()):
            if key == shard and offset <= start < offset + len(data):
                self._ranges.move_to_end((key, offset))
                return data[start - offset : end - offset]
        return b""

    def _keep(self, shard: str, offset: int, data: bytes) -> None:
        old = self._ranges.pop((shard, offset), None)
        if old is not None:
            self._bytes -= len(old)
        self._ranges[(shard, offset)] = data
        self._bytes += len(data)
        while self._bytes > self.memory and self._ranges:
            _, dropped = self._ranges.popitem(last=False)
            self._bytes -= len(dropped)


HINT_WINDOW = 64
"""Blocks queued ahead of the furthest hinted read: with 1 MiB blocks, 64 MiB in flight or
cached ahead of the readers, enough to cover a few seconds of download per reader."""


class HintedOrder:
    """The read-ahead plan of one order hint: blocks in first-use order, queued a window
    ahead of how far the readers have got.

    ``blocks[j]`` is first needed by the read at hint position ``first_use[j]`` (rising).
    Readers report the hint positions they reach (``reached``); the plan hands back the
    blocks that now fall inside the window, each exactly once.

    With ``run`` above 1 (for a cache that holds every block of the plan), a block entering
    the window brings along the blocks that follow it in its shard, up to ``run`` in all,
    when the plan holds them and has not handed them yet: they are fetched with one GET
    rather than one each as the window reaches them, and nothing is fetched that the plan
    does not need. A uniform-mode order, whose window gains one block of a random shard at
    a time, otherwise pays a GET per block (``bench/per_file.py --order uniform``: 1,130
    GETs for 1,180 blocks of 1 MiB, 446-471 with runs of 4). ``CachedReader.hinted_run``
    says how long a run may be."""

    def __init__(
        self,
        blocks: list[tuple[int, int]],
        first_use: list[int],
        window: int = HINT_WINDOW,
        *,
        run: int = 1,
    ) -> None:
        if len(blocks) != len(first_use):
            raise ValueError("one first use per block")
        self.blocks = blocks
        self.first_use = first_use
        self.window = window
        self.furthest = -1
        self._queued = 0
        self._lock = threading.Lock()
        self._run = run
        # With runs: which blocks were handed (some past the window), and each one's place.
        self._handed = bytearray(len(blocks)) if run > 1 else None
        self._place = {block: j for j, block in enumerate(blocks)} if run > 1 else {}

    def start(self) -> list[tuple[int, int]]:
        """The first window of blocks, before anything is read."""
        with self._lock:
            return self._take(min(len(self.blocks), self.window))

    def reached(self, position: int) -> list[tuple[int, int]]:
        """A read at hint ``position``: the blocks to queue now (often none)."""
        if position <= self.furthest:
            return []
        with self._lock:
            if position <= self.furthest:
                return []
            self.furthest = position
            needed = bisect.bisect_right(self.first_use, position)
            return self._take(min(len(self.blocks), needed + self.window))

    def _take(self, upto: int) -> list[tuple[int, int]]:
        if upto <= self._queued:
            return []
        first, self._queued = self._queued, upto
        handed = self._handed
        if handed is None:
            return self.blocks[first:upto]
        taken = []
        for j in range(first, upto):
            if handed[j]:
                continue  # brought along by an earlier block of its shard
            handed[j] = 1
            shard, index = self.blocks[j]
            taken.append((shard, index))
            for after in range(index + 1, index + self._run):
                k = self._place.get((shard, after))
                if k is None or handed[k]:
                    break
                handed[k] = 1
                taken.append((shard, after))
        return taken

    @property
    def queued(self) -> int:
        """Plan blocks up to which every block was handed."""
        return self._queued

"""Filling the block cache from the store: what a reader does when a block is missing.

The cache only stores blocks (``shardfs.cache``); these fills claim a block, fetch it with
the reader's fetcher, put it, and return the block they stored so that the reader can say
it is local. Nothing here calls back up: every result travels back as a return value.

Three kinds, one per way a block is brought:

- ``read``: a read misses and fetches its whole block (one GET), then is served from it;
- ``read_split``: a read misses and fetches only its own bytes; the rest of the block is a
  task that holds the claim until it has completed and stored the block;
- ``prefetch``: a whole block ahead of need, only when it can be kept.

Beside them, two small pieces of the reader's miss policy: ``ColdClock`` (which blocks a
store may evict when the cache is smaller than the data) and ``Arrivals`` (blocks that a
readahead GET for several blocks is bringing, which a read waits for instead of fetching).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from ..cache import EVICT_ANY, EVICT_NONE, RETIRED_BEFORE, BlockCache, BlockKey, Claim, NoRoom
from ..stats import Stats

log = logging.getLogger(__name__)

Fetch = Callable[[int, int], bytes | memoryview]
# A whole block fetched ahead: in landing memory (``BlockCache.landing``) or bytes.
Block = bytes | memoryview
BlockFetch = Callable[[int, int], Block]
"""Bytes ``[lo, hi)`` of one block, from the store (offsets within the block)."""

Stored = Callable[[Block], None]
"""Told of a block just stored, while its claim still holds back the threads waiting."""

Completion = Callable[[], bytes | None]
"""The rest of a split miss: completes and stores the block; returns it if stored."""


class BlockFills:
    """Claim, fetch and put blocks of ``cache``, counting misses in ``stats``."""

    def __init__(self, cache: BlockCache, stats: Stats) -> None:
        self.cache = cache
        self.stats = stats

    def read(
        self,
        key: BlockKey,
        start: int,
        end: int,
        block_len: int,
        fetch: Fetch,
        *,
        evict_before: float = EVICT_ANY,
        stored: Stored | None = None,
        unstored: Stored | None = None,
    ) -> tuple[bytes, Block | None]:
        """Bytes ``[start, end)`` of a block of ``block_len`` bytes, fetched whole and once
        on a miss; and the block if this call stored it (else None). ``stored`` is told of
        the block once stored, before the threads waiting for it go on; ``unstored`` of a
        block fetched that could not be stored after all (its bytes are paid for: the
        caller may hold them for its other reads).

        Storing may evict only blocks last used before ``evict_before``; when those would not
        make room nothing is fetched and ``NoRoom`` is raised (to the waiters too). Any other
        failure is shared with the waiters and held for a moment (``Claim.fail``)."""
        while True:
            data = self.cache.peek(key, start, end, block_len)
            if data is not None:
                return data, None
            claim = self.cache.claim(key)
            if not claim.owner:
                if claim.shared is not None:  # fetched but not stored (degraded)
                    self.stats.add(cache_hits=1)
                    return claim.shared[start:end], None
                continue  # stored (by that thread or another mount): read it from disk
            with claim:
                try:
                    return self._fetch_whole(claim, start, end, block_len, fetch,
                        evict_before, on_stored=stored, on_unstored=unstored)  # fmt: skip
                except NoRoom as exc:
                    claim.fail(exc)  # waiters fetch their bytes as ranges too
                    raise
                except Exception as exc:
                    claim.fail(exc, hold=True)  # waiters fail too, not refetch in turn
                    raise

    def _fetch_whole(
        self,
        claim: Claim,
        start: int,
        end: int,
        block_len: int,
        fetch: Fetch,
        evict_before: float,
        *,
        on_stored: Stored | None,
        on_unstored: Stored | None,
    ) -> tuple[bytes, Block | None]:
        data = self.cache.peek(claim.key, start, end, block_len)  # another mount stored it
        if data is not None:
            return data, None
        with self.cache.reserving(block_len, evict_before) as reserved:
            if not reserved:
                raise NoRoom(claim.key)
            block = fetch(0, block_len)
            self.stats.add(cache_misses=1)
            if len(block) != block_len:
                raise ValueError(f"fetched {len(block)} bytes for a block of {block_len}")
            stored = self.cache.put(claim, block, evict_before=evict_before)
        if stored and on_stored is not None:
            on_stored(block)
        if not stored:
            claim.share(bytes(block))
            if on_unstored is not None:
                on_unstored(block)
        return bytes(block[start:end]), block if stored else None

    def read_split(
        self,
        key: BlockKey,
        start: int,
        end: int,
        block_len: int,
        fetch: Fetch,
        *,
        evict_before: float = EVICT_ANY,
    ) -> tuple[bytes, Completion | None]:
        """Like ``read``, but a miss fetches only ``[start, end)`` and returns, with those
        bytes, the task that completes the block. The task owns the claim: whoever runs it
        (a background thread) lets the block's waiters in when it ends, so it must run."""
        while True:
            data = self.cache.peek(key, start, end, block_len)
            if data is not None:
                return data, None
            claim = self.cache.claim(key)
            if claim.owner:
                break
        try:
            data = self.cache.peek(key, start, end, block_len)  # another mount stored it
            if data is not None:
                claim.release()
                return data, None
            needed = bytes(fetch(start, end))
            self.stats.add(cache_misses=1)
        except Exception as exc:
            claim.fail(exc)
            claim.release()
            raise
        except BaseException:
            claim.release()
            raise
        complete = functools.partial(
            self._complete, claim, start, end, block_len, needed, fetch, evict_before
        )
        return needed, complete

    def _complete(
        self,
        claim: Claim,
        start: int,
        end: int,
        block_len: int,
        needed: bytes,
        fetch: Fetch,
        evict_before: float,
    ) -> bytes | None:
        """Fetch the rest of a block around ``needed`` and store it; then let others in.
        A failure costs only the cached copy: waiters fetch the block themselves."""
        with claim:
            try:
                before = bytes(fetch(0, start)) if start else b""
                after = bytes(fetch(end, block_len)) if end < block_len else b""
                block = before + needed + after
                if len(block) != block_len:
                    raise ValueError(f"assembled {len(block)} bytes for a block of {block_len}")
                return block if self.cache.put(claim, block, evict_before=evict_before) else None
            except Exception as exc:
                key = claim.key
                log.warning("could not complete block %s/%d: %s", key.shard, key.index, exc)
                return None

    def prefetch(
        self,
        key: BlockKey,
        block_len: int,
        fetch: BlockFetch,
        *,
        evict_before: float = EVICT_NONE,
        held: int = 0,
        stored: Stored | None = None,
        unstored: Stored | None = None,
    ) -> bytes | memoryview | None:
        """Fetch a whole block ahead of need; returns it if stored. Fetches nothing when the
        block is cached or in flight, when it would not fit without evicting a block used
        since ``evict_before`` (by default: without evicting anything), or while caching is
        paused. A failure is the task's own: waiters fetch the block themselves. ``held``:
        room already held for this block (``BlockCache.hold``), used or given back.
        ``stored``, ``unstored``: as for ``read``."""
        if not self.cache.accepts(key):
            self.cache.release(held)
            return None
        with self.cache.reserving(block_len, evict_before, held) as reserved:
            if not reserved:
                return None
            claim = self.cache.claim(key, wait=False)
            if claim is None:
                return None
            with claim:
                if self.cache.contains(key):
                    return None
                block = fetch(0, block_len)
                self.stats.add(prefetched_blocks=1)
                if len(block) != block_len:
                    raise ValueError(f"assembled {len(block)} bytes for a block of {block_len}")
                if not self.cache.put(claim, block, evict_before=evict_before, unread=True):
                    if unstored is not None:
                        unstored(block)
                    return None
                if stored is not None:
                    stored(block)
                return block


class ColdClock:
    """When a block counts as cold, for a cache smaller than the data: no read has used it
    while the reader served ``horizon`` bytes (an epoch's worth). None: plain LRU."""

    def __init__(self, horizon: int | None) -> None:
        self.horizon = horizon
        self._served = 0
        self._clock: deque[tuple[float, int]] = deque([(time.time(), 0)])
        self._lock = threading.Lock()

    def tick(self, length: int) -> float:
        """Count ``length`` bytes read; the wall time before which a block unused is cold
        (``EVICT_ANY`` without a horizon; before a horizon was served, ``RETIRED_BEFORE``:
        only blocks an order hint's readers are done with may go)."""
        horizon = self.horizon
        if horizon is None:
            return EVICT_ANY
        now = time.time()
        with self._lock:
            self._served += length
            served = self._served
            if length == 0:
                return self._cutoff(served, horizon)
            clock = self._clock
            if served - clock[-1][1] >= max(1, horizon // 64):
                clock.append((now, served))
            # Keep one reading at or before ``served - horizon``: the cold cutoff.
            while len(clock) > 1 and clock[1][1] <= served - horizon:
                clock.popleft()
            return self._cutoff(served, horizon)

    def _cutoff(self, served: int, horizon: int) -> float:
        when, at = self._clock[0]
        return when if at <= served - horizon else RETIRED_BEFORE


class Arrivals:
    """Blocks a running readahead GET is bringing: a read of one waits (up to ``timeout``)
    for it to be stored rather than fetch the same bytes again."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._lock = threading.Lock()
        self._coming: dict[tuple[str, int], threading.Event] = {}

    def mark(self, skey: str, index: int) -> bool:
        """Mark block ``index`` coming; False if another GET's mark is on it already."""
        with self._lock:
            if (skey, index) in self._coming:
                return False
            self._coming[(skey, index)] = threading.Event()
            return True

    def arrived(self, skey: str, *indices: int) -> None:
        with self._lock:
            events = [self._coming.pop((skey, index), None) for index in indices]
        for event in events:
            if event is not None:
                event.set()

    def expected(self, skey: str, index: int) -> bool:
        """Whether a running GET is bringing block ``index`` of ``skey``."""
        return bool(self._coming) and (skey, index) in self._coming

    def wait(self, skey: str, index: int) -> None:
        if not self._coming:
            return
        with self._lock:
            event = self._coming.get((skey, index))
        if event is not None:
            event.wait(self.timeout)

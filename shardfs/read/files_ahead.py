"""Files fetched ahead of an order hint while the block cache is full.

With an order hint the mount knows which files the readers ask for next. When the blocks
holding them could be cached only by evicting blocks that will be read again, fetching
whole blocks would multiply egress; instead each upcoming file is fetched as one ranged
GET, a bounded distance ahead, and held in memory until its read takes it. Every byte is
fetched once, and the readers find their files already local.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

DEFAULT_BUDGET = 64 << 20
"""Bytes held at most: enough for a few hundred typical images ahead of the readers."""

OPENED_GRACE_S = 0.2
"""How long bytes fetched ahead of a file stay held once its open from the page cache was
heard of: a READ that follows the open (the page cache let go of the file after its push)
comes at once, well inside this."""


def missing_span(
    start: int, end: int, block_size: int, held: Callable[[int], bool]
) -> tuple[int, int] | None:
    """The part of ``[start, end)`` from its first to its last block that ``held`` (by
    block index: cached, or coming) says is not held, which is all a fetch ahead needs (a
    read takes the rest from the cache); None if every block is held."""
    missing = [
        index
        for index in range(start // block_size, (end - 1) // block_size + 1)
        if not held(index)
    ]
    if not missing:
        return None
    return max(start, missing[0] * block_size), min(end, (missing[-1] + 1) * block_size)


@dataclass
class _Entry:
    end: int
    started: bool = False  # its fetch began: a read waits for it rather than fetch again
    data: bytes | None = None
    failed: bool = False
    waited: bool = False  # a read came while its fetch ran: that read hands it over
    done: threading.Event = field(default_factory=threading.Event)


class FilesAhead:
    """Extents of shards fetched ahead, each taken by the reads that cover it.

    An extent is claimed before its fetch (so a read arriving meanwhile waits for that
    fetch rather than fetching again), filled or failed, and dropped once reads have
    taken its last byte, or a while after its file was opened from the kernel's page
    cache, where the pusher put it (``opened``). A kept block (``keep``) is read in any
    order, so it stays until ``clear``: a read ending at its end says nothing of the
    files before it."""

    def __init__(self, budget: int = DEFAULT_BUDGET) -> None:
        self.budget = budget
        self._held = 0
        self._extents: dict[str, dict[int, _Entry]] = {}
        # The extents ``keep`` made, per shard (start: end): a claim inside one is refused.
        self._kept: dict[str, dict[int, int]] = {}
        # Extents of files opened from the page cache, to let go of: (when, shard, at, extent)
        self._opened: deque[tuple[float, str, int, _Entry]] = deque()
        self._lock = threading.Lock()

    @property
    def held(self) -> int:
        return self._held

    def claim(self, shard: str, start: int, end: int) -> bool:
        """Reserve ``[start, end)`` of ``shard`` for a fetch; False if it is held already
        (claimed, or overlapping a block held: ``keep``; its read takes that part and
        fetches only the rest) or would pass the budget."""
        with self._lock:
            extents = self._extents.setdefault(shard, {})
            if start in extents or self._held + (end - start) > self.budget:
                return False
            kept = self._kept.get(shard)
            if kept and any(at < end and start < kept_end for at, kept_end in kept.items()):
                return False
            extents[start] = _Entry(end)
            self._held += end - start
            return True

    def claim_missing(
        self, shard: str, start: int, end: int, held: Callable[[int], bool], block_size: int
    ) -> tuple[int, int] | None:
        """Claim the part of ``[start, end)`` whose blocks ``held`` (by index) does not
        cover (``missing_span``); the span claimed, or None."""
        span = missing_span(start, end, block_size, held) if start < end else None
        return span if span is not None and self.claim(shard, *span) else None

    def fetch_claimed(
        self,
        shard: str,
        start: int,
        end: int,
        held: Callable[[int], bool],
        block_size: int,
        needed: Callable[[], bool],
        fetch: Callable[[int, int], bytes],
    ) -> tuple[int, bytes] | None:
        """Run a claim's fetch, narrowed to its blocks still not held; or drop the claim
        (its read fetches nothing ahead) when none is missing any more or ``needed`` says
        the cache can take them whole. Returns where the bytes fetched start, and them,
        while no read has come for them yet (one that came hands them over itself)."""
        span = missing_span(start, end, block_size, held)
        if span is None or not needed():
            self.take(shard, start, end)  # not started: dropped, the cache serves it
            return None
        if span != (start, end):  # a block of it was cached since the claim
            if not self.narrow(shard, start, *span):
                return None  # a read took the claim over
            start, end = span
        data = self.fill(shard, start, functools.partial(fetch, start, end))
        with self._lock:
            entry = self._extents.get(shard, {}).get(start)
            unread = entry is not None and entry.data is data and not entry.waited
        return (start, data) if data is not None and unread else None

    def narrow(self, shard: str, start: int, new_start: int, new_end: int) -> bool:
        """Shrink a claimed extent whose fetch has not started to ``[new_start, new_end)``
        inside it (part of it got cached meanwhile); False if it is no longer held."""
        with self._lock:
            extents = self._extents.get(shard, {})
            entry = extents.get(start)
            if entry is None or entry.started or not start <= new_start < new_end <= entry.end:
                return False
            if new_start != start and new_start in extents:
                return False
            del extents[start]
            self._held -= (entry.end - start) - (new_end - new_start)
            entry.end = new_end
            extents[new_start] = entry
            return True

    def keep(self, shard: str, start: int, data: bytes) -> bool:
        """Hold bytes fetched already (a block that could not be cached after all) as an
        extent at ``start``: the reads inside it take them, in any order, and no file
        overlapping it is claimed. Held until ``clear`` (within the budget). Files fetched
        ahead inside it give way to it (a read waiting for one still gets it); one running
        past its edge stays beside it. False where it would pass the budget or overlap
        another kept block."""
        end = start + len(data)
        with self._lock:
            extents = self._extents.setdefault(shard, {})
            kept = self._kept.get(shard, {})
            overlapping = [(at, entry) for at, entry in extents.items()
                           if at < end and start < entry.end]  # fmt: skip
            inside = [(at, entry) for at, entry in overlapping
                      if at not in kept and start <= at and entry.end <= end]  # fmt: skip
            freed = sum(entry.end - at for at, entry in inside)
            if (
                not data
                or self._held - freed + len(data) > self.budget
                or any(at in kept for at, _ in overlapping)
            ):
                if not extents:
                    del self._extents[shard]
                return False
            for at, entry in inside:
                self._forget(shard, at, entry)
            extents = self._extents.setdefault(shard, {})
            entry = _Entry(end, started=True, data=data)
            entry.done.set()
            extents[start] = entry
            self._kept.setdefault(shard, {})[start] = end
            self._held += len(data)
            return True

    def fill(self, shard: str, start: int, fetch: Callable[[], bytes]) -> bytes | None:
        """Run the fetch for a claimed extent, unless a read took the claim over first (or
        its file was opened from the kernel's cache: ``opened``); a failure drops it
        (the read fetches it). Returns the bytes fetched, None if it fetched nothing."""
        with self._lock:
            entry = self._extents.get(shard, {}).get(start)
            if entry is None:
                return None
            entry.started = True
        try:
            data = entry.data = fetch()
        except BaseException:
            entry.failed = True
            self._drop(shard, start, entry)
            raise
        finally:
            entry.done.set()
        return data

    def opened(self, files: Iterable[tuple[str, int, int]], now: float | None = None) -> int:
        """Readers opened these files (shard, start, end) from the kernel's page cache (the
        pusher put them there): no read of them needs to come. Their extents fetched ahead
        go ``OPENED_GRACE_S`` later (at a later call), unless a read took them first: the
        page cache may have let go of a file since its push, and then its READ follows the
        open and takes them. Kept blocks stay. Returns how many extents went now, those of
        earlier opens that are still held (the same ones: not an extent fetched since at
        the same place)."""
        now = time.monotonic() if now is None else now
        released = 0
        with self._lock:
            for shard, start, end in files:
                kept = self._kept.get(shard, {})
                self._opened.extend(
                    (now + OPENED_GRACE_S, shard, at, entry)
                    for at, entry in self._extents.get(shard, {}).items()
                    if start <= at and entry.end <= end and at not in kept
                )
            while self._opened and self._opened[0][0] <= now:
                _, shard, at, entry = self._opened.popleft()
                if self._extents.get(shard, {}).get(at) is entry:
                    self._forget(shard, at, entry)
                    released += 1
        return released

    def assemble(
        self, shard: str, start: int, end: int, fetch: Callable[[int, int], bytes]
    ) -> tuple[bytes, bool, bool]:
        """Bytes ``[start, end)``: the parts extents hold taken from them, the rest from
        ``fetch(at, upto)`` (``upto``: an extent's start, or ``end`` when none follows).
        Returns them, whether any part was taken and whether any was fetched. A file that
        runs out of a kept block, or into one, fetches only its part outside it."""
        pieces: list[bytes] = []
        at, taken, fetched = start, False, False
        while at < end:
            held = self.take(shard, at, end)
            if held:
                pieces.append(held)
                at, taken = at + len(held), True
                continue
            upto = self.next_start(shard, at, end)
            pieces.append(fetch(at, upto))
            at, fetched = upto, True
        return (pieces[0] if len(pieces) == 1 else b"".join(pieces)), taken, fetched

    def take(self, shard: str, start: int, end: int, *, wait: float = 60.0) -> bytes | None:
        """The bytes from ``start`` that a held extent holds (waiting for its fetch if it
        is running): all of ``[start, end)``, or those before the extent ends; None if no
        extent holds ``start``. An extent fetched ahead goes once its last byte was taken;
        one whose fetch has not started goes at once (the read fetches it itself, not
        twice); a kept block stays (see the class)."""
        with self._lock:
            found = self._holding(shard, start)
            if found is None:
                return None
            offset, entry = found
            if not entry.started:
                self._forget(shard, offset, entry)
                return None
            entry.waited |= not entry.done.is_set()
        if not entry.done.wait(wait) or entry.failed or entry.data is None:
            return None
        stop = min(end, entry.end)
        if stop == entry.end and not self._is_kept(shard, offset):
            self._drop(shard, offset, entry)
        return entry.data[start - offset : stop - offset]

    def take_kept(self, shard: str, start: int, end: int) -> bytes | None:
        """The kept block ``[start, end)``, let go (its taker stores it); else None."""
        if not self._held:
            return None
        with self._lock:
            entry = self._extents.get(shard, {}).get(start)
            if entry is None or self._kept.get(shard, {}).get(start) != end:
                return None
        self._drop(shard, start, entry)
        return entry.data

    def kept_part(self, shard: str, start: int, end: int) -> bytes | None:
        """Bytes ``[start, end)`` where one kept block holds them all, the block left kept
        (unlike ``take_kept``); else None. Never waits: a kept block is there or not."""
        if not self._held:
            return None
        with self._lock:
            for offset, stop in self._kept.get(shard, {}).items():
                if offset <= start and end <= stop:
                    entry = self._extents.get(shard, {}).get(offset)
                    if entry is None or entry.data is None:
                        return None
                    return entry.data[start - offset : end - offset]
        return None

    def fetching(self, shard: str, start: int) -> bool:
        """Whether an extent whose fetch began (or a kept block) holds byte ``start``."""
        if not self._held:
            return False
        with self._lock:
            found = self._holding(shard, start)
            return found is not None and found[1].started

    def next_start(self, shard: str, start: int, end: int) -> int:
        """Where the first extent held inside ``(start, end)`` begins; ``end`` if none: a
        read fetches up to there, and takes the rest from the extent."""
        with self._lock:
            extents = self._extents.get(shard, {})
            return min((at for at in extents if start < at < end), default=end)

    def _holding(self, shard: str, start: int) -> tuple[int, _Entry] | None:
        """(offset, extent) of the extent that holds byte ``start`` (call with the lock)."""
        for offset, entry in self._extents.get(shard, {}).items():
            if offset <= start < entry.end:
                return offset, entry
        return None

    def _is_kept(self, shard: str, offset: int) -> bool:
        with self._lock:
            return offset in self._kept.get(shard, {})

    def _forget(self, shard: str, offset: int, entry: _Entry) -> None:
        """Let go of an extent (call with the lock)."""
        extents = self._extents[shard]
        del extents[offset]
        self._held -= entry.end - offset
        if not extents:
            del self._extents[shard]

    def _drop(self, shard: str, start: int, entry: _Entry) -> None:
        with self._lock:
            extents = self._extents.get(shard)
            if extents is not None and extents.get(start) is entry:
                self._forget(shard, start, entry)
                kept = self._kept.get(shard)
                if kept is not None and kept.pop(start, None) is not None and not kept:
                    del self._kept[shard]

    def clear(self) -> None:
        """Forget every extent (a new hint replaced the order they were fetched for)."""
        with self._lock:
            self._extents.clear()
            self._kept.clear()
            self._opened.clear()
            self._held = 0

"""Reads fetched as ranges, beside the block cache's fills, and each byte of a hinted
epoch paid for once.

A read comes here when its block cannot be cached (a paused cache, or one full of blocks as
likely to be read as the missing one) or when bytes fetched ahead hold it. Blocks the cache
holds still serve; bytes fetched ahead (``FilesAhead``) are taken; the rest is fetched
range by range with a read-ahead window in memory (``MemoryReadahead``). While an order
hint is followed, every range GET marks its blocks paid in part (``PaidInPart``), so that no
whole-block GET brings those bytes again in the same epoch.
"""

from __future__ import annotations

from collections.abc import Callable

from ..cache import BlockCache, BlockKey
from ..stats import Stats
from ..store.shards import ShardInfo
from .files_ahead import FilesAhead
from .fills import Arrivals
from .readahead import MemoryReadahead


def _block_len(shard: ShardInfo, index: int, block_size: int) -> int:
    return min(block_size, shard.size - index * block_size)


class PaidInPart:
    """Blocks some of whose bytes were fetched as ranges while an order hint is followed.

    Each byte of an epoch is paid for once: a block that lost part of its bytes to a range
    (a file fetched ahead, or read, while the cache had no room) is not fetched whole later
    in the epoch, when room comes back, since that GET would bring those bytes again. Its
    other files come as ranges too. A new hint starts afresh (``clear``)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.active = False  # only while a hint is followed: without one there is no epoch
        self._blocks: set[tuple[str, int]] = set()

    def add(self, shard: str, start: int, end: int) -> None:
        """Bytes ``[start, end)`` of ``shard`` are being fetched as a range (call before
        the GET: a block GET that looks after this sees it)."""
        if self.active and start < end:
            size = self.block_size
            first, last = start // size, (end - 1) // size
            self._blocks.update((shard, index) for index in range(first, last + 1))

    def __bool__(self) -> bool:
        return bool(self._blocks)

    def holds(self, shard: str, index: int) -> bool:
        """Whether block ``index`` of ``shard`` had bytes fetched as a range this epoch."""
        return bool(self._blocks) and (shard, index) in self._blocks

    def clear(self) -> None:
        """Forget the marks (a new hint). In place: a mark a range GET makes meanwhile is
        kept, as a mark too many only sends a block's reads to ranges, while one lost could
        let the block be fetched whole and pay again."""
        self._blocks.clear()


class RangeReads:
    """The range path of a ``CachedReader``: ``read`` for reads that bypass the cache's
    fills, ``get_paid_once`` for every range GET (a read's, or a file fetched ahead)."""

    def __init__(
        self,
        cache: BlockCache,
        coming: Arrivals,
        stats: Stats,
        ahead: FilesAhead,
        get: Callable[[ShardInfo, int, int], bytes],
        timeout: float,
    ) -> None:
        self.cache, self.coming, self.stats, self.timeout = cache, coming, stats, timeout
        self.block_size = cache.config.block_size
        self.paid = PaidInPart(self.block_size)
        self._ahead, self._get = ahead, get
        self._memory = MemoryReadahead()

    def read(
        self,
        shard: ShardInfo,
        skey: str,
        start: int,
        end: int,
        extent_end: int | None,
        *,
        count_waits: bool = False,
    ) -> bytes:
        """Blocks the cache holds still serve; anything else comes from the store, range
        by range, never a whole block per read (a paused cache, or one that is full of
        blocks as likely to be read as the missing one). ``count_waits``: a read that finds
        its bytes neither cached nor fetched ahead counts as waiting on the network."""

        def fetch(lo: int, hi: int) -> bytes:
            return self.get_paid_once(shard, skey, lo, hi)

        limit = shard.size if extent_end is None else min(shard.size, max(end, extent_end))
        waited = False

        def missing(lo: int, hi: int) -> bytes:
            nonlocal waited
            data, fetched = self._fetch_missing(skey, lo, hi, limit, fetch)
            waited |= fetched
            return data

        data = self._assemble(shard, skey, start, end, missing)
        if count_waits and waited:
            self.stats.add(reads_waited_on_network=1)
        return data

    def _fetch_missing(
        self, skey: str, start: int, end: int, limit: int, fetch: Callable[[int, int], bytes]
    ) -> tuple[bytes, bool]:
        """The bytes, and whether any had to be fetched now: what extents fetched ahead
        (or kept) hold is taken from them, and only the rest fetched."""

        def rest(at: int, upto: int) -> bytes:  # a read-ahead window stops at a held extent
            return self._memory.read(skey, at, upto, upto if upto < end else limit, fetch)

        data, taken, fetched = self._ahead.assemble(skey, start, end, rest)
        if taken:
            self.stats.add(files_ahead_read=1)
        return data, fetched

    def get_paid_once(self, shard: ShardInfo, skey: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` as ranges, for a read or a file fetched ahead, never twice
        in a hinted epoch: their blocks are marked paid in part (``PaidInPart``) before a
        look at the cache, and a block found cached or being fetched whole then (by a GET
        that looked at the marks just before they were made) is taken from the cache. A
        whole-block GET looks at the marks after it claimed its block or marked it coming,
        so one of the two sees the other."""
        paid = self.paid
        if not paid.active:
            return self._get(shard, start, end)
        paid.add(skey, start, end)
        return self._assemble(
            shard, skey, start, end, lambda lo, hi: self._get(shard, lo, hi), settle=True
        )

    def _assemble(
        self,
        shard: ShardInfo,
        skey: str,
        start: int,
        end: int,
        fill: Callable[[int, int], bytes],
        *,
        settle: bool = False,
    ) -> bytes:
        """Bytes ``[start, end)``: each block's part from the cache where it holds it, once
        a readahead GET bringing the block has stored it (``settle``: once any fetch of it
        in flight has ended too, and from the block held as kept where that fetch could not
        store it); each run of bytes between from ``fill(lo, hi)`` (a read's fill takes
        held bytes itself: ``_fetch_missing``)."""
        size, pieces, gap = self.block_size, [], start  # gap: start of bytes not found cached
        for index in range(start // size, (end - 1) // size + 1):
            key = BlockKey(skey, index)
            self.coming.wait(skey, index)  # a readahead GET brings it: no second fetch
            if settle:
                self.cache.wait_flight(key, self.timeout)
            block_start = index * size
            lo, hi = max(start, block_start), min(end, block_start + size)
            block_len = _block_len(shard, index, size)
            data = self.cache.peek(key, lo - block_start, hi - block_start, block_len)
            if data is None and settle:
                data = self._ahead.kept_part(skey, lo, hi)  # fetched whole, then no room
            if data is None:
                continue
            if gap < lo:
                pieces.append(fill(gap, lo))
            pieces.append(data)
            gap = hi
        if gap < end:
            pieces.append(fill(gap, end))
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

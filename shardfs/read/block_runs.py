"""Readahead of consecutive blocks of one shard with as few GETs as the cache allows."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Generator
from typing import Protocol

from ..cache import BlockCache, BlockKey, NoRoom
from ..stats import Stats
from ..store.remote import Store
from ..store.responses import Landing
from ..store.shards import ShardInfo
from .fills import Arrivals, Block, BlockFetch
from .range_reads import PaidInPart

RUN_BLOCKS = 4
"""Consecutive blocks of a shard that readahead fetches with one GET: a server that reads
the whole object for every ranged GET (moto does) pays a quarter as often, and one larger
GET moves more bytes per round trip (see docs/design.md, "Block size")."""


def runs_of(blocks: list[tuple[ShardInfo, int]]) -> list[tuple[ShardInfo, list[int]]]:
    """The blocks, in their order, as runs of consecutive blocks of a shard (at most
    ``RUN_BLOCKS`` each), one GET per run. An order hint interleaves shards: a block joins
    its shard's open run when it continues it, wherever the run started in the order."""
    runs: list[tuple[ShardInfo, list[int]]] = []
    open_runs: dict[ShardInfo, list[int]] = {}  # per shard, the run still growing
    for shard, index in blocks:
        run = open_runs.get(shard)
        if run is not None and run[-1] + 1 == index and len(run) < RUN_BLOCKS:
            run.append(index)
        else:
            run = open_runs[shard] = [index]
            runs.append((shard, run))
    return runs


class UnreadPrefetched:
    """Blocks prefetched that no read has touched yet: ``prefetched_bytes_read`` counts
    each once, at its first read."""

    def __init__(self, stats: Stats) -> None:
        self.stats = stats
        self._lock = threading.Lock()
        self._blocks: set[tuple[str, int]] = set()

    def add(self, skey: str, index: int) -> None:
        with self._lock:  # before the store: a read may come as soon as it lands
            self._blocks.add((skey, index))

    def first_read(self, skey: str, index: int, block_len: int) -> None:
        """A read touched the block: counted if it was prefetched and is read first now."""
        if self._blocks and (skey, index) in self._blocks:
            with self._lock:
                if (skey, index) not in self._blocks:
                    return
                self._blocks.discard((skey, index))
            self.stats.add(prefetched_bytes_read=block_len)

    def not_stored(self, skey: str, index: int, block_len: int) -> None:
        """The prefetch stored nothing after all: a read that counted it meanwhile did
        not read a prefetched block."""
        with self._lock:
            read_meanwhile = (skey, index) not in self._blocks
            self._blocks.discard((skey, index))
        if read_meanwhile:
            self.stats.add(prefetched_bytes_read=-block_len)


class RunOwner(Protocol):
    """What a run needs of its reader (``CachedReader``)."""

    cache: BlockCache
    store: Store
    block_size: int
    coming: Arrivals
    paid_in_part: PaidInPart
    stats: Stats

    def stream_pieces(
        self, shard: ShardInfo, start: int, end: int, piece: int, land: Landing | None = ...
    ) -> Generator[Block, None, None]: ...

    def prefetch_one(
        self,
        shard: ShardInfo,
        skey: str,
        index: int,
        fetch: BlockFetch,
        evict_before: float,
        held: int = ...,
    ) -> bool: ...

    def keep_unstored(self, shard: ShardInfo, skey: str, index: int, block: Block) -> None: ...


class BlockRun:
    """One readahead task over consecutive blocks ``indices`` of a shard: one GET covers
    every block from the first one still needed to the end of the run, as far as the
    blocks are missing and fit (evicting only blocks used before ``evict_before``); each
    block is stored on its own as soon as it has landed, while the GET's later blocks are
    still on the wire where the store streams them (``Store.stream``), so that a run holds
    one block of landing memory at a time. A block part of which came as a range this epoch
    (``PaidInPart``) is left out: its files come as ranges."""

    def __init__(
        self,
        reader: RunOwner,
        shard: ShardInfo,
        skey: str,
        indices: list[int],
        evict_before: float,
    ) -> None:
        self.reader = reader
        self.shard = shard
        self.skey = skey
        self.indices = indices
        self.evict_before = evict_before
        self._pieces: Generator[Block, None, None] | None = None  # the last GET's, not taken
        self._first = self._next = -1  # the GET's first block, and the one it brings next
        self._rooms: list[int] = []  # landing room to hold while each of them lands
        self._held: dict[int, int] = {}  # room held for those blocks (bytes, per block)
        self._marked: set[int] = set()  # blocks marked coming by this run's GETs

    def _stretch_end(self, index: int) -> int:
        """The end of the bytes worth one GET from block ``index`` (which holds its own
        room): the following blocks of the run that are missing, as far as room for them is
        held now, with a run's worth still free after them, until each is stored. A block
        fetched without held room could find it taken by another fetch meanwhile, and its
        bytes would be fetched for nothing."""
        cache, size, coming = self.reader.cache, self.reader.block_size, self.reader.coming
        end = index + 1
        while end <= self.indices[-1]:
            # Marked coming before the look: a read that claims the block after the look
            # sees the mark, and waits for this GET's bytes rather than fetch them too.
            if not coming.mark(self.skey, end):
                break  # another GET is bringing it
            key = BlockKey(self.skey, end)
            paid = self.reader.paid_in_part.holds(self.skey, end)  # not to be fetched whole
            if paid or cache.contains(key) or cache.in_flight(key):
                coming.arrived(self.skey, end)
                break
            end += 1
        lens = [min(size, self.shard.size - i * size) for i in range(index + 1, end)]
        shares = cache.hold(lens, self.evict_before, spare=(1 + RUN_BLOCKS) * size)
        self._held.update(zip(range(index + 1, end), shares, strict=False))
        last = index + 1 + len(shares)  # the first block this GET leaves out
        coming.arrived(self.skey, *range(last, end))
        self._marked.update(range(index + 1, last))
        return min(self.shard.size, last * size)

    def _brings(self, index: int) -> bool:
        """Whether the run's GET brings block ``index`` next."""
        brought = self._next - self._first < len(self._rooms)  # within the GET's range
        return self._pieces is not None and self._next == index and brought

    def _take(self, index: int) -> Block | None:
        """Block ``index`` from the run's GET if it brings it next, received now (within
        the readahead's landing memory: ``landing_room``, the pusher catches up first)."""
        pieces = self._pieces
        if pieces is None or not self._brings(index):
            return None
        room = self._rooms[index - self._first]
        with self.reader.cache.landing_room(room) if room else contextlib.nullcontext():
            block = next(pieces, None)
        self._next += 1
        return block

    def _close(self) -> None:
        """Leave the GET's pieces not taken (the connection is closed if bytes are left)."""
        if self._pieces is not None:
            self._pieces.close()
            self._pieces = None

    def _fetcher(self, index: int) -> BlockFetch:
        reader, size = self.reader, self.reader.block_size

        def fetch_range(lo: int, hi: int) -> Block:
            block = self._take(index)
            if block is None:
                if reader.paid_in_part.holds(self.skey, index):  # looked at again, claimed
                    raise NoRoom(BlockKey(self.skey, index))
                # Reads of the later blocks wait for this GET and their store, rather
                # than fetch the same bytes again (``_stretch_end`` marks them coming).
                start, end = index * size, self._stretch_end(index)
                self._close()
                self._pieces = reader.stream_pieces(self.shard, start, end, size,
                    reader.cache.landing)  # fmt: skip
                self._first = self._next = index
                lens = [min(size, end - at) for at in range(start, end, size)]
                # A store that does not stream lands the whole GET with its first piece.
                streamed = reader.store.streams_pieces(self.shard)
                self._rooms = lens if streamed else [end - start] + [0] * (len(lens) - 1)
                block = self._take(index)
                if block is None:
                    raise ValueError(f"a GET of [{start}:{end}] brought nothing")
            return block if lo == 0 and hi == len(block) else block[lo:hi]

        return fetch_range

    def task(self) -> bool:
        """Fetch and store the run; whether any block was stored."""
        reader, skey = self.reader, self.skey
        stored = False
        try:
            for index in self.indices:
                try:
                    if not self._brings(index) and reader.paid_in_part.holds(skey, index):
                        reader.stats.add(blocks_paid_in_part=1)
                        continue  # part of it came as a range this epoch: not paid twice
                    fetch = self._fetcher(index)
                    held = self._held.pop(index, 0)
                    stored_now = reader.prefetch_one(
                        self.shard, skey, index, fetch, self.evict_before, held
                    )
                    stored |= stored_now
                    unstored = None if stored_now else self._take(index)
                    if unstored is not None:  # brought by the GET, then not stored
                        reader.keep_unstored(self.shard, skey, index, unstored)
                finally:
                    if index in self._marked:
                        self._marked.discard(index)
                        reader.coming.arrived(skey, index)
        finally:
            reader.coming.arrived(skey, *self._marked)  # a failed GET: nobody waits any more
            self._marked.clear()
            self._close()
            reader.cache.release(sum(self._held.values()))
            self._held.clear()
        return stored

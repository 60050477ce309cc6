"""Readahead of consecutive blocks of one shard with as few GETs as the cache allows."""

from __future__ import annotations

from typing import Protocol

from ..cache import BlockCache, BlockKey
from ..store.responses import Landing
from ..store.shards import ShardInfo
from .fills import Arrivals, Block, BlockFetch

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


class RunOwner(Protocol):
    """What a run needs of its reader (``CachedReader``)."""

    cache: BlockCache
    block_size: int
    coming: Arrivals

    def get_pieces(
        self, shard: ShardInfo, start: int, end: int, piece: int, land: Landing | None = ...
    ) -> list[Block]: ...

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
    block is then stored on its own."""

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
        self._got: dict[int, Block] = {}  # blocks the last GET brought, not yet stored
        self._held: dict[int, int] = {}  # room held for those blocks (bytes, per block)

    def _stretch_end(self, index: int) -> int:
        """The end of the bytes worth one GET from block ``index`` (which holds its own
        room): the following blocks of the run that are missing, as far as room for them is
        held now, with a run's worth still free after them, until each is stored. A block
        fetched without held room could find it taken by another fetch meanwhile, and its
        bytes would be fetched for nothing."""
        cache, size = self.reader.cache, self.reader.block_size
        end = index + 1
        while end <= self.indices[-1]:
            key = BlockKey(self.skey, end)
            if cache.contains(key) or cache.in_flight(key):
                break
            end += 1
        lens = [min(size, self.shard.size - i * size) for i in range(index + 1, end)]
        shares = cache.hold(lens, self.evict_before, spare=(1 + RUN_BLOCKS) * size)
        self._held.update(zip(range(index + 1, end), shares, strict=False))
        return min(self.shard.size, (index + 1 + len(shares)) * size)

    def _fetcher(self, index: int) -> BlockFetch:
        reader, size = self.reader, self.reader.block_size

        def fetch_range(lo: int, hi: int) -> Block:
            block = self._got.pop(index, None)
            if block is None:
                start, end = index * size, self._stretch_end(index)
                # Reads of the later blocks wait for this GET and their store, rather
                # than fetch the same bytes again.
                reader.coming.expect(self.skey, range(index + 1, -(-end // size)))
                with reader.cache.landing_room(end - start):  # the pusher catches up first
                    pieces = reader.get_pieces(self.shard, start, end, size, reader.cache.landing)
                self._got.clear()
                self._got.update(enumerate(pieces, start=index))
                block = self._got.pop(index)
            return block if lo == 0 and hi == len(block) else block[lo:hi]

        return fetch_range

    def task(self) -> bool:
        """Fetch and store the run; whether any block was stored."""
        reader, skey = self.reader, self.skey
        stored = False
        try:
            for index in self.indices:
                try:
                    fetch = self._fetcher(index)
                    held = self._held.pop(index, 0)
                    stored_now = reader.prefetch_one(
                        self.shard, skey, index, fetch, self.evict_before, held
                    )
                    stored |= stored_now
                    unstored = None if stored_now else self._got.pop(index, None)
                    if unstored is not None:  # brought by the GET, then no room to store it
                        reader.keep_unstored(self.shard, skey, index, unstored)
                finally:
                    reader.coming.arrived(skey, index)
        finally:
            reader.coming.arrived(skey, *self.indices)  # a failed GET: nobody waits any more
            self._got.clear()
            reader.cache.release(sum(self._held.values()))
            self._held.clear()
        return stored

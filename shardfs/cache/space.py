"""The bound: room held for blocks being fetched, and eviction of the least recently used.

A store may evict only blocks last used before a given wall time (``evict_before``), so a
cache smaller than the data keeps its warm blocks; blocks that reads hold are never evicted.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import sqlite3
import threading

from ..stats import Stats
from .block_format import encoded_size
from .ledger import RETIRED_BEFORE, Ledger
from .open_blocks import OpenBlocks

_EVICT_LOW_WATER = 0.9

EVICT_ANY = math.inf
"""``evict_before`` that lets a store evict any block (least recently used first)."""
EVICT_NONE = -math.inf
"""``evict_before`` that lets nothing be evicted: a block is kept only if it fits."""
__all__ = ["EVICT_ANY", "EVICT_NONE", "RETIRED_BEFORE", "Space"]


class Space:
    """Room under the bound: what fetches in flight hold, and eviction to make more."""

    def __init__(
        self, ledger: Ledger, open_blocks: OpenBlocks, stats: Stats, chunk_size: int
    ) -> None:
        self.ledger = ledger
        self.open_blocks = open_blocks
        self.stats = stats
        self.chunk_size = chunk_size
        self._reserved = 0  # bytes of blocks being fetched to be stored (``reserving``)
        self._room_lock = threading.Lock()
        self._evicting = threading.Lock()

    def room_for(self, block_len: int, evict_before: float = EVICT_NONE) -> bool:
        """Whether a block of ``block_len`` bytes fits under the bound now, counting as free
        the blocks last used before ``evict_before`` (a wall time) that no read holds."""
        return self.look(block_len, evict_before)[0]

    def look(self, block_len: int, evict_before: float = EVICT_NONE) -> tuple[bool, int]:
        """(``room_for``'s answer, the bytes that fit now without evicting anything past
        what the fetches in flight hold), from one look at the ledger and the disk; a
        ledger that cannot be read has no room."""
        reserved = self._reserved
        try:
            used = self.ledger.usage()
        except sqlite3.Error:
            return False, 0
        limit = self.ledger.limit(used)
        incoming = encoded_size(block_len, self.chunk_size) + reserved
        fits = self._fits(used, limit, incoming, evict_before)
        return fits, max(0, limit - used - reserved)

    def hold(self, block_lens: list[int], evict_before: float, spare: int = 0) -> list[int]:
        """Hold room for the next blocks one GET brings besides the block reserving now, as
        many leading ones as fit with ``spare`` bytes still free after them; returns the
        bytes held per block held. Each share goes to the ``reserving`` that stores its
        block (``held``), or back through ``release``."""
        if evict_before == EVICT_ANY:
            return [0] * len(block_lens)
        shares: list[int] = []
        with self._room_lock:
            for block_len in block_lens:
                incoming = encoded_size(block_len, self.chunk_size)
                if not self._room(incoming + spare + self._reserved, evict_before):
                    break
                self._reserved += incoming
                shares.append(incoming)
        return shares

    def release(self, held: int) -> None:
        """Give back room held (``hold``) for blocks that will not be stored."""
        if held:
            with self._room_lock:
                self._reserved -= held

    def reserving(self, block_len: int, evict_before: float, held: int = 0) -> _Reservation:
        """Hold room for a block while it is fetched and stored, so that concurrent fetches
        in this process never count the same free bytes (one of them would be fetched and
        then not kept). Yields whether room was found; ``EVICT_ANY`` always finds it.
        ``held``: room ``hold`` kept for this block, handed over here (given back if the
        block finds no room after all)."""
        return _Reservation(self, block_len, evict_before, held)

    def _reserve(self, block_len: int, evict_before: float, held: int) -> int:
        """``reserving``'s entry: the bytes now reserved (0: no room), or -1 for
        ``EVICT_ANY``, which needs none."""
        if evict_before == EVICT_ANY:
            self.release(held)
            return -1
        incoming = encoded_size(block_len, self.chunk_size)
        with self._room_lock:
            self._reserved -= held
            if not self._room(incoming + self._reserved, evict_before):
                return 0
            self._reserved += incoming
        return incoming

    def _room(self, incoming: int, evict_before: float) -> bool:
        """Whether ``incoming`` bytes fit; a ledger that cannot be read has no room."""
        try:
            used = self.ledger.usage()
        except sqlite3.Error:
            return False
        return self._fits(used, self.ledger.limit(used), incoming, evict_before)

    def _fits(self, used: int, limit: int, incoming: int, evict_before: float) -> bool:
        if used + incoming <= limit:
            return True
        if incoming > limit or evict_before == EVICT_NONE:
            return False
        need = used + incoming - limit
        if self._evictable(need, evict_before) < need:
            return False
        self.ledger.flush_uses(force=True)  # uses not yet written may warm a victim
        return self._evictable(need, evict_before) >= need

    def _evictable(self, need: int, evict_before: float) -> int:
        return self.ledger.evictable(need, evict_before, self.open_blocks.pinned_paths())

    def make_room(self, incoming: int, evict_before: float = EVICT_ANY) -> bool:
        """Evict least recently used blocks, among those last used before ``evict_before``,
        so that ``incoming`` bytes fit under the bound; False when they cannot. A ledger
        that cannot be read raises sqlite3.Error: the write is not admitted."""
        used = self.ledger.usage()
        limit = self.ledger.limit(used)
        if incoming > limit:
            raise OSError(errno.ENOSPC, "cache bound smaller than one block")
        if used + incoming <= limit:
            return True
        if evict_before == EVICT_NONE:
            return False
        with self._evicting:
            self.ledger.flush_uses(force=True)
            target = int(limit * _EVICT_LOW_WATER) - incoming
            self.evict_to(max(0, target), evict_before)
            return self.ledger.usage() + incoming <= limit

    def evict_to(self, target: int, evict_before: float = EVICT_ANY) -> int:
        """Remove least recently used blocks (of those last used before ``evict_before``)
        until usage is at most ``target``; returns how many."""
        removed = 0
        while chosen := self.ledger.take_victims(
            target, evict_before, self.open_blocks.pinned_paths
        ):
            for path in chosen:
                self.open_blocks.close_path(path)
                with contextlib.suppress(OSError):
                    os.unlink(path)
            removed += len(chosen)
            unread = self.ledger.take_unread(chosen)
            self.stats.add(blocks_evicted=len(chosen), evicted_unread_bytes=unread)
        return removed


class _Reservation:
    """``Space.reserving``: a small object rather than a generator (one per block stored)."""

    __slots__ = ("_block_len", "_evict_before", "_held", "_reserved", "_space")

    def __init__(self, space: Space, block_len: int, evict_before: float, held: int) -> None:
        self._space = space
        self._block_len = block_len
        self._evict_before = evict_before
        self._held = held
        self._reserved = 0

    def __enter__(self) -> bool:
        self._reserved = self._space._reserve(self._block_len, self._evict_before, self._held)
        return self._reserved != 0

    def __exit__(self, *_: object) -> None:
        if self._reserved > 0:
            self._space.release(self._reserved)

"""``BlockCache``: shard-aligned blocks on local disk, bounded, crash-safe, verified.

It ties the parts of the package together: the block format (``block_format``), the ledger
and the bound (``ledger``), one fetch per block (``claims``), open block files and the reads
that pin them (``open_blocks``), and the temp-file-and-rename write (``writer``). Each part
owns its own lock; the bound's room and eviction live in ``space``.

Errors that concern one block path cost that block alone; only errors of the whole disk
turn caching off for a while (``health``).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import shutil
import sqlite3
import struct
import threading
from collections.abc import Callable
from pathlib import Path

from ..config import CacheConfig, resolve_cache_size
from ..stats import Stats
from .block_format import (
    BlockKey,
    CorruptBlockError,
    NotInMemory,
    block_header,
    read_data,
)
from .claims import Claims, LockFile, slot_of
from .health import DiskHealth, disk_wide
from .ledger import Ledger
from .open_blocks import OpenBlocks
from .space import EVICT_ANY, EVICT_NONE, Space
from .writer import AtomicWriter

log = logging.getLogger(__name__)


class NoRoom(Exception):
    """The block would fit only by evicting blocks that are not cold: it is not fetched
    (``BlockCache.get``); the caller fetches the bytes it needs without caching them."""


class BlockCache:
    """Shard-aligned blocks on disk, shared safely by every mount that uses the same folder."""

    def __init__(self, config: CacheConfig, stats: Stats | None = None) -> None:
        self.config = config
        self.stats = stats if stats is not None else Stats()
        self.root = config.cache_dir
        self.blocks_dir = self.root / "blocks"
        self._blocks_prefix = f"{self.blocks_dir}/"
        self.tmp_dir = self.root / "tmp"
        for folder in (self.blocks_dir, self.tmp_dir):
            folder.mkdir(parents=True, exist_ok=True)
        disk = shutil.disk_usage(self.root)
        self.max_bytes = resolve_cache_size(config.size, disk.total)
        self._health = DiskHealth(self.stats)
        self._locks = LockFile(self.root)
        self._ledger = Ledger(self.root, self._locks, self.max_bytes, config.min_free)
        self._prepare()
        self._claims = Claims()
        self._open = OpenBlocks()
        self._writer = AtomicWriter(self.tmp_dir)
        self._space = Space(self._ledger, self._open, self.stats, config.chunk_size)
        # Told every block this process stores (key and bytes), once it is in place on disk.
        self.on_stored: Callable[[BlockKey, bytes], None] | None = None
        self._closed = False
        self._writer.remove_stale()

    # Tests of a failing ledger swap this thread's connection for a failing one.
    @property
    def _local(self) -> threading.local:
        return self._ledger.local

    # -- public -------------------------------------------------------------------------

    def get(
        self,
        key: BlockKey,
        start: int,
        end: int,
        block_len: int,
        fetch: Callable[[], bytes],
        *,
        evict_before: float = EVICT_ANY,
    ) -> bytes:
        """Bytes ``[start, end)`` of a block of ``block_len`` bytes; fetched once on a miss.

        Storing it may evict only blocks last used before ``evict_before`` (a wall time);
        when those would not make room, nothing is fetched and ``NoRoom`` is raised."""
        while True:
            data = self._load(key, start, end, block_len)
            if data is not None:
                self.stats.add(cache_hits=1)
                return data
            flight, owner = self._claims.open_flight(key)
            if not owner:
                shared = flight.outcome()
                if shared is not None:  # fetched but not stored (degraded): share the bytes
                    self.stats.add(cache_hits=1)
                    return shared[start:end]
                continue  # stored (by that thread or another mount): read it from disk
            try:
                self._claims.raise_recent_failure(key)
                data, flight.block = self._fetch_and_store(
                    key, start, end, block_len, fetch, evict_before
                )
                return data
            except NoRoom as exc:
                flight.error = exc  # waiters fetch their bytes as ranges too
                raise
            except Exception as exc:
                flight.error = exc  # waiters fail with it too, instead of refetching in turn
                self._claims.remember_failure(key, exc)
                raise
            finally:
                self._claims.release(key)

    @property
    def degraded(self) -> bool:
        """Whether caching is paused because the cache disk failed (full, read-only)."""
        return self._health.degraded

    def peek(
        self,
        key: BlockKey,
        start: int,
        end: int,
        block_len: int,
        *,
        count: bool = True,
        nowait: bool = False,
    ) -> bytes | None:
        """Bytes ``[start, end)`` of a cached block, or None without fetching or waiting.

        ``count=False`` leaves the hit out of the statistics (reads nobody asked for).
        ``nowait``: None also when the bytes are on disk but not in the page cache."""
        data = self._load(key, start, end, block_len, nowait=nowait, used=count)
        if data is not None and count:
            self.stats.add(cache_hits=1)
        return data

    def get_split(
        self,
        key: BlockKey,
        start: int,
        end: int,
        block_len: int,
        fetch_range: Callable[[int, int], bytes],
        run_later: Callable[[Callable[[], None]], None],
        *,
        evict_before: float = EVICT_ANY,
    ) -> bytes:
        """Like ``get``, but a miss fetches only ``[start, end)`` for the reader and hands the
        rest of the block to ``run_later``, so a cold read never waits for a whole block."""
        while True:
            data = self._load(key, start, end, block_len)
            if data is not None:
                self.stats.add(cache_hits=1)
                return data
            if not self._claims.claim(key):
                continue
            slot = slot_of(key)
            try:
                self._locks.lock(slot)
            except BaseException:
                self._claims.release(key)
                raise
            try:
                data = self._load(key, start, end, block_len)  # another mount fetched it
                if data is not None:
                    self.stats.add(cache_hits=1)
                    self._unlock_and_release(key, slot)
                    return data
                needed = fetch_range(start, end)
                self.stats.add(cache_misses=1)
            except Exception as exc:
                self._unlock_and_release(key, slot, exc)
                raise
            except BaseException:
                self._unlock_and_release(key, slot)
                raise
            fill = functools.partial(
                self._complete, key, slot, start, end, block_len, needed, fetch_range, evict_before
            )
            try:
                run_later(fill)
            except Exception:
                fill()
            return needed

    def _complete(
        self,
        key: BlockKey,
        slot: int,
        start: int,
        end: int,
        block_len: int,
        needed: bytes,
        fetch_range: Callable[[int, int], bytes],
        evict_before: float,
    ) -> None:
        """Fetch the rest of a block around ``needed`` and store it; then let others in."""
        try:
            before = fetch_range(0, start) if start else b""
            after = fetch_range(end, block_len) if end < block_len else b""
            self._store(key, before + needed + after, expected=block_len, evict_before=evict_before)
        except Exception as exc:
            log.warning("could not complete block %s/%d: %s", key.shard, key.index, exc)
        finally:
            self._unlock_and_release(key, slot)

    def prefetch(
        self,
        key: BlockKey,
        block_len: int,
        fetch_range: Callable[[int, int], bytes],
        *,
        evict_before: float = EVICT_NONE,
    ) -> bool:
        """Fetch a whole block ahead of need. Returns False, fetching nothing, when the block
        is cached or in flight, when it would not fit without evicting a block used since
        ``evict_before`` (by default: without evicting anything), or while caching is paused
        (a block that cannot be kept is not worth fetching ahead)."""
        if self.degraded or self._unusable(key):
            return False
        with self._space.reserving(block_len, evict_before) as reserved:
            return reserved and self._prefetch_claimed(key, block_len, fetch_range, evict_before)

    def _prefetch_claimed(
        self,
        key: BlockKey,
        block_len: int,
        fetch_range: Callable[[int, int], bytes],
        evict_before: float,
    ) -> bool:
        if not self._claims.claim(key, wait=False):
            return False
        try:
            with self._locks.holding(slot_of(key)):
                if os.path.exists(self._block_path(key)):
                    return False
                block = fetch_range(0, block_len)
                self.stats.add(prefetched_blocks=1)
                return self._store(
                    key, block, expected=block_len, evict_before=evict_before, unread=True
                )
        finally:
            self._claims.release(key)

    def _unusable(self, key: BlockKey) -> bool:
        """Cached already, or a path that cannot hold a block."""
        path = self._block_path(key)
        return self._health.is_bad(path) or os.path.lexists(path)

    def in_flight(self, key: BlockKey) -> bool:
        """Whether a thread of this process is fetching the block now."""
        return self._claims.in_flight(key)

    def contains(self, key: BlockKey) -> bool:
        """Whether the block's file is on disk (not verified)."""
        return os.path.exists(self._block_path(key))

    def put(self, key: BlockKey, block: bytes) -> bool:
        """Store a block that was downloaded anyway (an index scan), unless it is cached,
        in flight, or would need evicting; returns True if stored."""
        if self.degraded or self._unusable(key):
            return False
        with self._space.reserving(len(block), EVICT_NONE) as reserved:
            if not reserved or not self._claims.claim(key, wait=False):
                return False
            try:
                with self._locks.holding(slot_of(key)):
                    if os.path.exists(self._block_path(key)):
                        return False
                    return self._store(key, block, evict_before=EVICT_NONE)
            finally:
                self._claims.release(key)

    def _unlock_and_release(self, key: BlockKey, slot: int, error: Exception | None = None) -> None:
        try:
            self._locks.unlock(slot)
        finally:
            self._claims.release(key, error)

    def room_for(self, block_len: int, evict_before: float = EVICT_NONE) -> bool:
        """Whether a block of ``block_len`` bytes fits under the bound now, counting as free
        the blocks last used before ``evict_before`` (a wall time) that no read holds."""
        return self._space.room_for(block_len, evict_before)

    def evict_to(self, target: int, evict_before: float = EVICT_ANY) -> int:
        """Remove least recently used blocks (of those last used before ``evict_before``)
        until usage is at most ``target``; returns how many."""
        return self._space.evict_to(target, evict_before)

    def usage(self) -> int:
        """Bytes of cached blocks, for statistics: when the ledger cannot be read, the last
        figure it gave (the bound's own arithmetic never uses this figure)."""
        return self._ledger.reported_usage()

    def limit(self) -> int:
        """The bound in force now: ``--cache-size``, lowered to keep ``min_free`` free."""
        return self._ledger.limit(self.usage())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._open.close_all()
        self._locks.close()
        self._ledger.close()

    # -- paths and bookkeeping ---------------------------------------------------------

    def path_of(self, key: BlockKey) -> Path:
        return Path(self._block_path(key))

    def _block_path(self, key: BlockKey) -> str:
        return f"{self._blocks_prefix}{key.shard[:2]}/{key.shard}/{key.index}"

    # -- reading -----------------------------------------------------------------------

    def _load(
        self,
        key: BlockKey,
        start: int,
        end: int,
        block_len: int,
        *,
        nowait: bool = False,
        used: bool = True,
    ) -> bytes | None:
        path = self._block_path(key)
        if self._health.is_bad(path):
            return None
        with self._open.pinned(path):
            try:
                block = self._open.acquire(path, key, block_len)
            except (CorruptBlockError, struct.error) as exc:
                self._discard(path, exc)
                return None
            except OSError as exc:
                if not disk_wide(exc):
                    self._health.skip_path(path, exc)
                else:
                    log.warning("cannot open cached block %s: %s", path, exc)
                return None
            if block is None:
                return None
            try:
                data = read_data(block.fd, block.header, start, end, nowait=nowait)
            except NotInMemory:
                return None
            except CorruptBlockError as exc:
                self._discard(path, exc)
                return None
            except OSError as exc:
                log.warning("cannot read cached block %s: %s", path, exc)
                return None
        self._ledger.touch(path, used=used)
        return data

    def _discard(self, path: str, exc: BaseException) -> None:
        self.stats.add(checksum_failures=1)
        log.warning("discarding corrupt cached block %s (%s)", path, exc)
        self._forget(path)

    def _forget(self, path: str) -> None:
        self._open.close_path(path)
        with contextlib.suppress(OSError):
            os.unlink(path)
        self._ledger.forget(path)

    # -- fetching and writing ----------------------------------------------------------

    def _fetch_and_store(
        self,
        key: BlockKey,
        start: int,
        end: int,
        block_len: int,
        fetch: Callable[[], bytes],
        evict_before: float,
    ) -> tuple[bytes, bytes | None]:
        """Bytes ``[start, end)``, and the fetched block when it could not be stored (for the
        threads waiting on it); else None."""
        with self._locks.holding(slot_of(key)):
            data = self._load(key, start, end, block_len)  # another mount may have fetched it
            if data is not None:
                self.stats.add(cache_hits=1)
                return data, None
            with self._space.reserving(block_len, evict_before) as reserved:
                if not reserved:
                    raise NoRoom(key)
                block = fetch()
                self.stats.add(cache_misses=1)
                if len(block) != block_len:
                    raise ValueError(f"fetched {len(block)} bytes for a block of {block_len}")
                stored = self._store(key, block, evict_before=evict_before)
        return block[start:end], None if stored else block

    def _store(
        self,
        key: BlockKey,
        block: bytes,
        *,
        expected: int | None = None,
        evict_before: float = EVICT_ANY,
        unread: bool = False,
    ) -> bool:
        """Write a block into the cache, evicting only blocks last used before
        ``evict_before``; returns whether it is there now. ``unread``: fetched ahead of any
        read (counted if it is evicted before a read uses it).

        ``on_stored`` is told once the block is in place, outside the write's error
        handling: an error of the observer reaches the caller and never costs the block."""
        if expected is not None and len(block) != expected:
            raise ValueError(f"assembled {len(block)} bytes for a block of {expected}")
        if self._health.degraded:
            return False
        final = self.path_of(key)
        if self._health.is_bad(str(final)):
            return False
        if not self._ledger.ready and not self._prepare():
            return False
        if not self._write_block(key, block, final, evict_before, unread):
            return False
        announce = self.on_stored
        if announce is not None:
            announce(key, block)
        return True

    def _write_block(
        self, key: BlockKey, block: bytes, final: Path, evict_before: float, unread: bool
    ) -> bool:
        """Make room, write the block to a temp file, record it, rename it into place."""
        header = block_header(key, block, self.config.chunk_size)
        size = len(header) + len(block)
        tmp = self._writer.temp_path()
        inserted = False
        try:
            if not self._space.make_room(size, evict_before):
                self.stats.add(blocks_not_admitted=1)
                return False
            self._writer.write(tmp, header, block)
            inserted = self._ledger.add(str(final), size)
            self._writer.publish(tmp, final)
        except (OSError, sqlite3.Error) as exc:
            self._writer.discard(tmp)
            if inserted:
                self._forget(str(final))  # counted, but never renamed into place
            self._write_failed(str(final), exc)
            return False
        self._open.close_path(str(final))
        self.stats.add(blocks_written=1)
        if unread:
            self._ledger.mark_unread(str(final), size)
        return True

    def _write_failed(self, path: str, exc: OSError | sqlite3.Error) -> None:
        """Sort a failed block write: this block, the ledger, or the whole disk."""
        if isinstance(exc, OSError) and exc.errno == errno.ENOENT:
            self.stats.add(cache_write_errors=1)  # a folder cleared under us: next time
        elif isinstance(exc, OSError) and not disk_wide(exc):
            self._health.skip_path(path, exc)
        elif isinstance(exc, sqlite3.Error) and self._ledger.damaged(exc):
            self.stats.add(cache_write_errors=1)
            self._rebuild_ledger(str(exc))
        else:
            self._health.degrade(exc)

    def _prepare(self) -> bool:
        """Open (or rebuild) the ledger; on a full or read-only disk start degraded and try
        again later. Returns whether the ledger is usable."""
        try:
            self._ledger.prepare()
        except (OSError, sqlite3.Error) as exc:
            self._health.degrade(exc)
            return False
        return True

    def _rebuild_ledger(self, reason: str) -> None:
        """The ledger went bad while in use: rebuild it from the block files."""
        try:
            self._ledger.rebuild(reason)
        except (OSError, sqlite3.Error) as exc:
            self._health.degrade(exc)

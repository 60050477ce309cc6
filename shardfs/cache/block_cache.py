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
import logging
import os
import shutil
import sqlite3
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, overload

from ..config import CacheConfig, resolve_cache_size
from ..stats import Stats
from .block_format import (
    BlockKey,
    CorruptBlockError,
    NotInMemory,
    block_header,
    read_all_into,
    read_data,
    written_header,
)
from .claims import Claim, Claims, LockFile, claim_block
from .health import DiskHealth, disk_wide
from .landing import READAHEAD_BYTES
from .ledger import Ledger, open_connection
from .open_blocks import OpenBlock, OpenBlocks
from .space import EVICT_ANY, EVICT_NONE, Space
from .writer import AtomicWriter

log = logging.getLogger(__name__)


class NoRoom(Exception):
    """The block would fit only by evicting blocks that are not cold: whoever claimed it
    fetches nothing, and readers fetch the bytes they need without caching them."""


@dataclass(frozen=True)
class BlockFile:
    """A block file opened for a reader of its own, its header verified: what that reader
    needs to check every chunk it reads (``block_format.read_data``'s rule)."""

    fd: int
    data_at: int  # where the data starts in the file
    data_len: int
    chunk: int  # bytes per checksummed chunk
    sums: bytes  # each chunk's xxh3-64, little-endian 64-bit words


def _names(path: str, fd: int) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        return os.path.samestat(os.stat(path), os.fstat(fd))
    except FileNotFoundError:
        return False


class BlockCache:
    """Shard-aligned blocks on disk, shared safely by every mount that uses the same folder.

    A store of blocks and nothing more: it looks blocks up (``peek``), hands out claims
    (``claim``), stores what a claim's owner brings (``put``), and keeps the bound (room,
    eviction). It never fetches: the reader decides what to fetch on a miss, brings it and
    puts it (``shardfs.read.fills``), as mountpoint-s3's caching part stream does around
    its ``DataCache``."""

    def __init__(
        self,
        config: CacheConfig,
        stats: Stats,
        *,
        ledger_connect: Callable[[Path], sqlite3.Connection] = open_connection,
    ) -> None:
        """``ledger_connect`` opens each thread's ledger connection (tests pass one whose
        statements fail, to play a failing disk under the ledger)."""
        self.config = config
        self.stats = stats
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
        self._ledger = Ledger(
            self.root, self._locks, self.max_bytes, config.min_free, connect=ledger_connect
        )
        self._prepare()
        self._claims = Claims()
        self._open = OpenBlocks()
        self._writer = AtomicWriter(self.tmp_dir, config.chunk_size)
        self._space = Space(self._ledger, self._open, self.stats, config.chunk_size)
        self._closed = False
        self._writer.remove_stale()
        self.stats.add_source(lambda: {"landing_mapped_bytes": self._writer.landing.mapped_bytes})

    # -- public -------------------------------------------------------------------------

    @overload
    def claim(self, key: BlockKey, *, wait: Literal[True] = ...) -> Claim: ...

    @overload
    def claim(self, key: BlockKey, *, wait: bool) -> Claim | None: ...

    def claim(self, key: BlockKey, *, wait: bool = True) -> Claim | None:
        """The one right in this process, and across mounts, to fetch and store ``key``.

        The owner looks at the disk again (``peek``) before fetching: another mount may have
        stored the block while it waited for the slot. When another thread of this process
        holds it: None at once unless ``wait``; else, once that thread is done, a waiter's
        claim (``owner`` False, ``shared`` the block if it was not stored) or its failure
        raised. A demand read (``wait``) of a block whose fetch failed a moment ago fails
        at once with the same error."""
        return claim_block(self._claims, self._locks, key, wait=wait)

    def put(
        self,
        claim: Claim,
        block: bytes | memoryview,
        *,
        evict_before: float = EVICT_ANY,
        unread: bool = False,
    ) -> bool:
        """Store the block of a claim its caller owns; returns whether it is there now.

        Storing may evict only blocks last used before ``evict_before`` (a wall time).
        ``unread``: fetched ahead of any read (counted if evicted before a read uses it).
        A block downloaded anyway (an index scan) goes through ``offer`` instead."""
        if not claim.owner or not claim.held:
            raise ValueError(f"put of block {claim.key.index} without owning its claim")
        return self._store(claim.key, block, evict_before=evict_before, unread=unread)

    def landing(self, length: int) -> memoryview:
        """Memory to receive a block of ``length`` bytes into: ``put`` writes it from there,
        without a copy (``landing.LandingBuffers``)."""
        return self._writer.landing.take(length)

    def prefill_landing(self, block_size: int, streams: int) -> int:
        """Landing memory for ``streams`` concurrent GETs of whole blocks (at most what
        readahead may hold, ``landing.READAHEAD_BYTES``), mapped and faulted in now, at
        mount, rather than by the first epoch's fetches; returns the bytes mapped."""
        count = max(1, min(streams, READAHEAD_BYTES // block_size))
        return self._writer.landing.prefill(block_size, count)

    @contextlib.contextmanager
    def landing_room(self, length: int) -> Iterator[None]:
        """Around a readahead GET of ``length`` bytes into landing memory: first wait a
        little while the blocks fetched ahead and not yet written or pushed, and the other
        readahead GETs, hold more than ``landing.READAHEAD_BYTES`` (``LandingBuffers.room``)."""
        with self._writer.landing.room(length) as fits:
            if not fits:
                self.stats.add(landing_room_timeouts=1)
            yield

    def landing_released(self) -> None:
        """A holder of fetched blocks' memory let some go (``LandingBuffers.released``)."""
        self._writer.landing.released()

    def offer(self, key: BlockKey, block: bytes) -> bool:
        """Store a block that was downloaded anyway (an index scan), unless it is cached,
        in flight, or would need evicting; returns True if stored."""
        if not self.accepts(key):
            return False
        with self.reserving(len(block), EVICT_NONE) as reserved:
            if not reserved:
                return False
            claim = self.claim(key, wait=False)
            if claim is None:
                return False
            with claim:
                return not self.contains(key) and self.put(claim, block, evict_before=EVICT_NONE)

    def accepts(self, key: BlockKey) -> bool:
        """Whether a block fetched now could be kept: caching is on, the block is not cached,
        and its path can hold one (a block that cannot be kept is not worth fetching ahead)."""
        if self.degraded:
            return False
        path = self._block_path(key)
        return not self._health.is_bad(path) and not os.path.lexists(path)

    def reserving(
        self, block_len: int, evict_before: float, held: int = 0
    ) -> contextlib.AbstractContextManager[bool]:
        """Hold room for a block while it is fetched and stored (``Space.reserving``):
        yields whether room was found; ``EVICT_ANY`` always finds it. ``held``: room that
        ``hold`` kept for this block, handed over."""
        return self._space.reserving(block_len, evict_before, held)

    def hold(self, block_lens: list[int], evict_before: float, spare: int = 0) -> list[int]:
        """Room for the further blocks of one GET, held until each is stored
        (``Space.hold``): the bytes held per leading block that fits."""
        return self._space.hold(block_lens, evict_before, spare)

    def release(self, held: int) -> None:
        """Give back room ``hold`` kept for blocks that will not be stored."""
        self._space.release(held)

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

    def read_into(
        self, key: BlockKey, block_len: int, buffer: bytearray | memoryview
    ) -> memoryview | None:
        """A cached block's data, read into ``buffer`` with every chunk verified just now,
        or None (missing, or damaged: then discarded)."""
        with self._pinned_block(key, block_len) as (path, block):
            if block is None:
                return None
            try:
                return read_all_into(block.fd, block.header, buffer)
            except CorruptBlockError as exc:
                self._discard(path, exc, block.fd)
            except OSError as exc:
                log.warning("cannot read cached block %s: %s", path, exc)
        return None

    def opened(self, key: BlockKey, block_len: int) -> BlockFile | None:
        """A cached block's file, its header verified and its data not read, on a duplicate
        descriptor the caller owns (and must close); or None."""
        with self._pinned_block(key, block_len) as (_, block):
            if block is None:
                return None
            header = block.header
            return BlockFile(
                os.dup(block.fd), header.header_len, header.data_len, header.chunk, header.sums
            )

    @contextlib.contextmanager
    def _pinned_block(
        self, key: BlockKey, block_len: int
    ) -> Iterator[tuple[str, OpenBlock | None]]:
        """The block's path and its open, header-verified file, pinned while the block is
        used (None: missing, damaged, or on a path the disk's health skips)."""
        path = self._block_path(key)
        if self._health.is_bad(path):
            yield path, None
            return
        with self._open.pinned(path):
            yield path, self._acquire(path, key, block_len)

    def touch(self, key: BlockKey) -> None:
        """Reads were answered from the block without this cache (the compiled FUSE path):
        it counts as used now for eviction."""
        self._ledger.touch(self._block_path(key), used=True)

    def in_flight(self, key: BlockKey) -> bool:
        """Whether a thread of this process is fetching the block now."""
        return self._claims.in_flight(key)

    def wait_flight(self, key: BlockKey, timeout: float) -> bool:
        """Wait (up to ``timeout``) while a thread of this process fetches the block, without
        claiming it; whether one was."""
        return self._claims.wait(key, timeout)

    def contains(self, key: BlockKey) -> bool:
        """Whether the block's file is on disk (not verified)."""
        return os.path.exists(self._block_path(key))

    def room_for(self, block_len: int, evict_before: float = EVICT_NONE) -> bool:
        """Whether a block of ``block_len`` bytes fits under the bound now, counting as free
        the blocks last used before ``evict_before`` (a wall time) that no read holds."""
        return self._space.room_for(block_len, evict_before)

    def look(self, block_len: int, evict_before: float = EVICT_NONE) -> tuple[bool, int]:
        """(``room_for``'s answer, the bytes that fit now without evicting anything): one
        look at the ledger and the disk (``Space.look``)."""
        return self._space.look(block_len, evict_before)

    def evict_to(self, target: int, evict_before: float = EVICT_ANY) -> int:
        """Remove least recently used blocks (of those last used before ``evict_before``)
        until usage is at most ``target``; returns how many."""
        return self._space.evict_to(target, evict_before)

    def retire(self, keys: list[BlockKey]) -> None:
        """Blocks no read will need again soon (an order hint's files in them were all
        opened): the first to go when room is needed, by ``evict_before=RETIRED_BEFORE``
        and any later cutoff (``Ledger.retire``)."""
        if keys and (self._ledger.ready or self._prepare()):
            self._ledger.retire([self._block_path(key) for key in keys])

    def unretire_all(self) -> None:
        """A new reading order begins: reads warm the blocks they use again."""
        self._ledger.unretire_all()

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
            block = self._acquire(path, key, block_len)
            if block is None:
                return None
            try:
                data = read_data(block.fd, block.header, start, end, nowait=nowait)
            except NotInMemory:
                return None
            except CorruptBlockError as exc:
                self._discard(path, exc, block.fd)
                return None
            except OSError as exc:
                log.warning("cannot read cached block %s: %s", path, exc)
                return None
        self._ledger.touch(path, used=used)
        return data

    def _acquire(self, path: str, key: BlockKey, block_len: int) -> OpenBlock | None:
        """The open, header-verified block file at ``path`` (the caller pins it), or None:
        missing, or its header damaged (discarded) or unreadable (the path skipped, unless
        the whole disk fails)."""
        try:
            return self._open.acquire(path, key, block_len)
        except (CorruptBlockError, struct.error) as exc:
            self._discard(path, exc)
        except OSError as exc:
            if not disk_wide(exc):
                self._health.skip_path(path, exc)
            else:
                log.warning("cannot open cached block %s: %s", path, exc)
        return None

    def _discard(self, path: str, exc: BaseException, fd: int | None = None) -> None:
        """Delete a damaged block file, counted once. ``fd``: the damaged file, open. Two
        threads may meet the same damage at once (a read and a publish of the block): the
        second finds the file gone, or the block cached again at ``path``, and leaves it."""
        if fd is not None and not _names(path, fd):
            return
        if self._forget(path):
            self.stats.add(checksum_failures=1)
            log.warning("discarding corrupt cached block %s (%s)", path, exc)

    def _forget(self, path: str) -> bool:
        """Drop the block file at ``path``; False when another thread removed it first."""
        self._open.close_path(path)
        removed = True
        try:
            os.unlink(path)
        except FileNotFoundError:
            removed = False
        except OSError:
            pass  # the ledger forgets it all the same
        self._ledger.forget(path)
        return removed

    # -- writing ----------------------------------------------------------------------

    def _store(
        self, key: BlockKey, block: bytes | memoryview, *, evict_before: float, unread: bool = False
    ) -> bool:
        """Write a block into the cache, evicting only blocks last used before
        ``evict_before``; returns whether it is there now."""
        if self._health.degraded:
            return False
        final = self._block_path(key)
        if self._health.is_bad(final):
            return False
        if not self._ledger.ready and not self._prepare():
            return False
        return self._write_block(key, block, final, evict_before, unread)

    def _write_block(
        self,
        key: BlockKey,
        block: bytes | memoryview,
        final: str,
        evict_before: float,
        unread: bool,
    ) -> bool:
        """Make room, write the block to a temp file, record it, rename it into place."""
        header = block_header(key, block, self.config.chunk_size)
        size = len(header) + len(block)
        tmp = self._writer.temp_path()
        inserted = False
        fd = -1
        try:
            if not self._space.make_room(size, evict_before):
                self.stats.add(blocks_not_admitted=1)
                return False
            self._writer.write(tmp, header, block)
            # Kept open from here: the block's first read (the pusher publishing it) would
            # otherwise read its header back from the disk, queued behind block writes.
            fd = os.open(tmp, os.O_RDONLY)
            inserted = self._ledger.add(final, size)
            self._writer.publish(tmp, final)
        except (OSError, sqlite3.Error) as exc:
            if fd >= 0:
                os.close(fd)
            self._writer.discard(tmp)
            if inserted:
                self._forget(final)  # counted, but never renamed into place
            self._write_failed(final, exc)
            return False
        self._open.adopt(final, OpenBlock(fd, written_header(header)))
        self.stats.add(blocks_written=1)
        if unread:
            self._ledger.mark_unread(final, size)
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

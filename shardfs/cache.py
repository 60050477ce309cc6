"""The persistent block cache: shard-aligned blocks on local disk, bounded, crash-safe, verified.

Layout under ``CACHE_DIR``::

    blocks/ab/<shard key>/<block index>   one file per block: header + data
    tmp/<pid>-<n>.tmp                    blocks being written (renamed into blocks/)
    cache.sqlite                         size and last use of each block (for the bound)
    locks                                byte-range locks: one fetch per block across mounts

A block file starts with a header that carries the shard key, the block index, the data
length and an xxh3-64 checksum of every 64 KiB chunk (plus one of the header itself). A read
verifies only the chunks it returns, so a warm small read stays cheap while no byte is ever
served unchecked. A file that fails a check is deleted, counted and fetched again.

A block is written to ``tmp/`` and renamed into place, so a daemon killed at any moment
leaves either a whole block or none; leftover temp files of dead processes are removed at
start by listing ``tmp/`` alone. The cache never sees the store: ``get`` takes a fetch
function, which makes every part testable with a fake fetcher.

The block files are the truth; ``cache.sqlite`` is only a ledger over them. An unreadable
ledger is rebuilt from the block headers (one warning), and an unusable ``locks`` file is
recreated, so no single damaged file stops a mount or loses a valid block. Errors that
concern one block path (a folder squatting it, say) cost that block alone; only errors of
the whole disk (full, read-only, failing) turn caching off for a while.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import itertools
import logging
import math
import mmap
import os
import shutil
import sqlite3
import stat
import struct
import threading
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import xxhash

from .config import CacheConfig, resolve_cache_size
from .control import process_running
from .stats import Stats

log = logging.getLogger(__name__)

MAGIC = b"SHFSBLK1"
_FIXED = struct.Struct("<8sIIQQ16sII")  # magic, header len, chunk, data len, index, key, n, 0
_LOCK_SLOTS = 1 << 16
_OPEN_BLOCKS = 64  # block files kept open with their verified headers
_DIRECT_ALIGN = 4096  # O_DIRECT writes: offset, length and memory aligned to this
_DIRECT_BUFFERS = 8  # aligned write buffers kept for reuse
_DEGRADED_RETRY_S = 30.0
# A block whose fetch just failed fails at once for this long: the kernel answers a failed
# readahead with an immediate single-page READ, which would otherwise wait out a second
# read deadline on a store that does not answer.
_FAILURE_HOLD_S = 1.0
_ATIME_FLUSH_S = 5.0
_EVICT_LOW_WATER = 0.9

EVICT_ANY = math.inf
"""``evict_before`` that lets a store evict any block (least recently used first)."""
EVICT_NONE = -math.inf
"""``evict_before`` that lets nothing be evicted: a block is kept only if it fits."""

# Errors that say the cache disk as a whole is unusable: caching pauses for a while. Any
# other OSError concerns one path (EISDIR, ENOTDIR, EEXIST, ENAMETOOLONG, ELOOP, ...) and
# costs only its block.
_DISK_WIDE = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EACCES, errno.EPERM}
)
# SQLite primary result codes (``sqlite_errorcode & 0xff``).
_SQLITE_CORRUPT, _SQLITE_NOTADB = 11, 26
_LEDGER = "cache.sqlite"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS blocks (path TEXT PRIMARY KEY, size INTEGER NOT NULL,
                                   atime REAL NOT NULL);
CREATE INDEX IF NOT EXISTS blocks_by_atime ON blocks (atime);
CREATE TABLE IF NOT EXISTS total (id INTEGER PRIMARY KEY CHECK (id = 1), bytes INTEGER NOT NULL);
INSERT OR IGNORE INTO total VALUES (1, 0);
"""


def shard_key(location: str, size: int, etag: str, block_size: int = 0) -> str:
    """A shard's cache identity: where it lives, which version it is, and how it is cut into
    blocks (block ``i`` under another block size is other bytes, possibly of equal length)."""
    text = f"{location}\0{size}\0{etag}"
    if block_size:
        text += f"\0{block_size}"
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class BlockKey:
    shard: str  # shard_key(), 32 hex digits
    index: int


class NoRoom(Exception):
    """The block would fit only by evicting blocks that are not cold: it is not fetched
    (``BlockCache.get``); the caller fetches the bytes it needs without caching them."""


class CorruptBlockError(Exception):
    """A block file failed a check; internal to the cache, never reaches a reader."""


def block_header(key: BlockKey, data: bytes, chunk_size: int) -> bytes:
    """The header written before a block's data: sizes, key, and per-chunk checksums."""
    count = (len(data) + chunk_size - 1) // chunk_size
    view = memoryview(data)
    sums = [
        xxhash.xxh3_64_intdigest(view[i * chunk_size : (i + 1) * chunk_size]) for i in range(count)
    ]
    header_len = _FIXED.size + 8 * count + 8
    head = _FIXED.pack(
        MAGIC, header_len, chunk_size, len(data), key.index, bytes.fromhex(key.shard), count, 0
    ) + struct.pack(f"<{count}Q", *sums)
    return head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head))


def encoded_size(block_len: int, chunk_size: int) -> int:
    """Bytes a block of ``block_len`` takes in the cache: its header, then its data."""
    count = (block_len + chunk_size - 1) // chunk_size
    return _FIXED.size + 8 * count + 8 + block_len


def encode_block(key: BlockKey, data: bytes, chunk_size: int) -> bytes:
    """Header + data, as written to disk."""
    return block_header(key, data, chunk_size) + data


@dataclass(slots=True)
class _Header:
    """A block file's verified header: what a read needs to check the chunks it returns."""

    header_len: int
    chunk: int
    data_len: int
    sums: bytes


def read_header(fd: int, key: BlockKey, expected_len: int) -> _Header:
    """Parse and verify the header of the block in ``fd``."""
    fixed = os.pread(fd, _FIXED.size, 0)
    if len(fixed) != _FIXED.size:
        raise CorruptBlockError("truncated header")
    magic, header_len, chunk, data_len, index, raw_key, count, _ = _FIXED.unpack(fixed)
    if magic != MAGIC or raw_key.hex() != key.shard or index != key.index:
        raise CorruptBlockError("wrong magic or key")
    if data_len != expected_len or chunk <= 0 or count != (data_len + chunk - 1) // chunk:
        raise CorruptBlockError("wrong length")
    if header_len != _FIXED.size + 8 * count + 8:
        raise CorruptBlockError("wrong header length")
    rest = os.pread(fd, header_len - _FIXED.size, _FIXED.size)
    if len(rest) != header_len - _FIXED.size:
        raise CorruptBlockError("truncated header")
    (header_sum,) = struct.unpack_from("<Q", rest, 8 * count)
    if xxhash.xxh3_64_intdigest(fixed + rest[: 8 * count]) != header_sum:
        raise CorruptBlockError("header checksum mismatch")
    return _Header(header_len, chunk, data_len, rest[: 8 * count])


class NotInMemory(Exception):
    """A read that must not wait on the disk found bytes the page cache does not hold."""


def read_data(fd: int, header: _Header, start: int, end: int, *, nowait: bool = False) -> bytes:
    """Bytes ``[start, end)`` of the block's data, each chunk they touch verified.

    ``nowait``: raise NotInMemory instead of waiting for the disk (RWF_NOWAIT): blocks are
    written around the page cache, so the first read of one is a disk read."""
    chunk = header.chunk
    first, last = start // chunk, (end - 1) // chunk
    span_start = first * chunk
    span_end = min((last + 1) * chunk, header.data_len)
    length = span_end - span_start
    data: bytes | bytearray | None = None
    if nowait:
        data = _read_nowait(fd, length, header.header_len + span_start)
    if data is None:
        data = os.pread(fd, length, header.header_len + span_start)
    if len(data) != length:
        raise CorruptBlockError("truncated data")
    sums = struct.unpack_from(f"<{last - first + 1}Q", header.sums, 8 * first)
    view = memoryview(data)
    for i, expected in enumerate(sums):
        if xxhash.xxh3_64_intdigest(view[i * chunk : (i + 1) * chunk]) != expected:
            raise CorruptBlockError(f"checksum mismatch in chunk {first + i}")
    return bytes(view[start - span_start : end - span_start])


def _read_nowait(fd: int, length: int, offset: int) -> bytearray | None:
    """``length`` bytes at ``offset`` if the page cache holds them all; NotInMemory if not;
    None where the filesystem cannot tell (no RWF_NOWAIT): then read as usual."""
    buffer = bytearray(length)
    try:
        got = os.preadv(fd, [buffer], offset, os.RWF_NOWAIT)
    except BlockingIOError:
        raise NotInMemory from None
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
            return None
        raise
    if got != length:  # partly cached, or short: the waiting read sorts it out
        raise NotInMemory
    return buffer


def read_verified(fd: int, key: BlockKey, start: int, end: int, expected_len: int) -> bytes:
    """Bytes ``[start, end)`` of the block in ``fd``, header and chunks verified."""
    return read_data(fd, read_header(fd, key, expected_len), start, end)


def _write_all(fd: int, *pieces: bytes) -> None:
    """Write every piece, in order, with as few system calls as the kernel allows."""
    views = [memoryview(piece) for piece in pieces if piece]
    while views:
        written = os.writev(fd, views)
        while views and written >= len(views[0]):
            written -= len(views[0])
            views.pop(0)
        if views and written:
            views[0] = views[0][written:]


def remove_any(path: Path) -> None:
    """Remove whatever sits at ``path``: a file, a link or a whole folder."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _lock_range(fd: int, offset: int) -> None:
    """Hold byte ``offset`` of the lock file; one holder across processes."""
    while True:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX, 1, offset)
            return
        except OSError as exc:
            # Record locks belong to the process, so two multithreaded mounts waiting
            # crosswise look like a deadlock to the kernel. It is none (a holder never
            # waits for another slot), so wait and try again.
            if exc.errno != errno.EDEADLK:
                raise
            time.sleep(0.01)


@contextlib.contextmanager
def _holding(fd: int, offset: int) -> Iterator[None]:
    _lock_range(fd, offset)
    try:
        yield
    finally:
        fcntl.lockf(fd, fcntl.LOCK_UN, 1, offset)


def open_lock_file(root: Path) -> int:
    """The ``locks`` file, opened read-write; recreated (one warning) when something else
    sits at its name: a folder, a link, a pipe, or a file that will not open."""
    path = root / "locks"
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EIO):
            raise
        problem = exc.strerror or str(exc)
    else:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return fd
        os.close(fd)
        problem = "not a regular file"
    log.warning("cache lock file %s was unusable (%s); recreated it", path, problem)
    remove_any(path)
    return os.open(path, flags, 0o644)


def _sqlite_code(exc: sqlite3.Error) -> int:
    return (getattr(exc, "sqlite_errorcode", 0) or 0) & 0xFF


def ledger_damaged(exc: sqlite3.Error, db_path: Path) -> bool:
    """Whether ``exc`` says the ledger file itself is bad (rebuild it), rather than the disk
    (full, read-only) or another process (busy)."""
    if _sqlite_code(exc) in (_SQLITE_CORRUPT, _SQLITE_NOTADB) or "integrity check" in str(exc):
        return True
    paths = [Path(f"{db_path}{suffix}") for suffix in ("", "-wal", "-shm")]
    return any(p.is_symlink() or (p.exists() and not p.is_file()) for p in paths)


def _connect_ledger(db_path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(db_path, timeout=30, isolation_level=None, check_same_thread=False)
    try:
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = NORMAL")
    except BaseException:
        conn.close()
        raise
    return conn


def _check_ledger(db_path: Path) -> None:
    """Create the schema if missing and run SQLite's quick check (fast: one pass, no index
    cross-checks); raises sqlite3.DatabaseError when the file is damaged."""
    conn = _connect_ledger(db_path)
    try:
        conn.executescript(_SCHEMA)
        verdict = conn.execute("PRAGMA quick_check").fetchone()[0]
        if verdict != "ok":
            raise sqlite3.DatabaseError(f"integrity check failed: {verdict}")
    finally:
        conn.close()


def block_file_size(path: str, shard: str, index: int) -> int | None:
    """The size of a well-formed block file for ``(shard, index)``, or None: a whole header
    that names this key and checks, and exactly as many data bytes as it announces. The data
    checksums are left to the reads, which verify every chunk they return."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        fixed = os.pread(fd, _FIXED.size, 0)
        if len(fixed) != _FIXED.size:
            return None
        data_len = _FIXED.unpack(fixed)[3]
        header = read_header(fd, BlockKey(shard, index), data_len)
    except (CorruptBlockError, struct.error, OSError, ValueError):
        return None
    finally:
        os.close(fd)
    return size if size == header.header_len + header.data_len else None


def _scan_block_files(blocks_dir: Path) -> Iterator[tuple[str, int, float]]:
    """(path, size, last use) of every valid block file; invalid files are deleted."""
    for top in _scandir(blocks_dir):
        if not top.is_dir(follow_symlinks=False):
            continue
        for shard in _scandir(Path(top.path)):
            if not shard.is_dir(follow_symlinks=False):
                continue
            valid_shard = len(shard.name) == 32 and shard.name[:2] == top.name
            for entry in _scandir(Path(shard.path)):
                if not entry.is_file(follow_symlinks=False):
                    continue  # a folder squatting a block path costs that block alone
                size = None
                if valid_shard and entry.name.isdigit():
                    with contextlib.suppress(ValueError):
                        size = block_file_size(entry.path, shard.name, int(entry.name))
                if size is None:
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)
                    continue
                with contextlib.suppress(OSError):
                    info = entry.stat(follow_symlinks=False)
                    yield entry.path, size, max(info.st_atime, info.st_mtime)


def _scandir(folder: Path) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(folder) as entries:
            return list(entries)
    except OSError:
        return []


def rebuild_ledger(root: Path, reason: str) -> int:
    """Replace ``cache.sqlite`` by one made from the block files; returns the blocks kept.
    Call with the setup lock held."""
    db_path = root / _LEDGER
    for suffix in ("", "-wal", "-shm", "-journal"):
        remove_any(Path(f"{db_path}{suffix}"))
    rows = list(_scan_block_files(root / "blocks"))
    conn = _connect_ledger(db_path)
    try:
        conn.executescript(_SCHEMA)
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany("INSERT OR IGNORE INTO blocks VALUES (?, ?, ?)", rows)
        total = conn.execute("SELECT COALESCE(SUM(size), 0) FROM blocks").fetchone()[0]
        conn.execute("UPDATE total SET bytes = ? WHERE id = 1", (total,))
        conn.execute("COMMIT")
    finally:
        conn.close()
    log.warning(
        "cache ledger %s was unreadable (%s); rebuilt it from %d cached block(s)",
        db_path,
        reason,
        len(rows),
    )
    return len(rows)


def prepare_ledger(root: Path, lock_fd: int) -> None:
    """Make sure ``cache.sqlite`` is usable, rebuilding it when it is damaged. Errors of the
    disk (full, read-only) are raised: the caller decides how to degrade."""
    db_path = root / _LEDGER
    # Switching a new database to WAL fails at once ("database is locked") when another
    # mount does the same, so mounts set it up one at a time (the byte after the slots).
    with _holding(lock_fd, _LOCK_SLOTS):
        try:
            _check_ledger(db_path)
        except sqlite3.DatabaseError as exc:
            if not ledger_damaged(exc, db_path):
                raise
            rebuild_ledger(root, str(exc))


@dataclass(slots=True)
class _OpenBlock:
    """A block file kept open with its verified header; closed when retired and unused."""

    fd: int
    header: _Header
    users: int = 0
    retired: bool = False


class _Flight:
    """One fetch of a block in progress. Threads that wait on it share its result: its
    failure (a black-holed store then fails every waiter once, not each in turn), or its
    bytes when they could not be stored; a stored block is read from disk as usual."""

    __slots__ = ("block", "done", "error")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: Exception | None = None
        self.block: bytes | None = None

    def outcome(self) -> bytes | None:
        """Wait for the fetch; raise its failure, or return its unstored block (else None)."""
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.block


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
        self._db_path = self.root / _LEDGER
        self._local = threading.local()
        self._generation = 0  # bumped when the ledger is rebuilt: threads reconnect
        self._degraded_until = 0.0
        self._warned = False
        self._lock_fd = open_lock_file(self.root)
        self._ledger_ready = False
        self._prepare()
        self._inflight: dict[BlockKey, _Flight] = {}
        self._reserved = 0  # bytes of blocks being fetched to be stored (``_reserving``)
        self._room_lock = threading.Lock()
        self._failed: dict[BlockKey, tuple[Exception, float]] = {}
        # Block paths that failed on their own (a folder squatting one, say): served from
        # the store without touching the disk again; every other block is cached as usual.
        self._bad_paths: set[str] = set()
        self._open: OrderedDict[str, _OpenBlock] = OrderedDict()
        # Told every block this process stores (key and bytes), once it is in place on disk.
        self.on_stored: Callable[[BlockKey, bytes], None] | None = None
        # Blocks are written with O_DIRECT where the filesystem takes it: no copy into the
        # page cache (a block is read back rarely, and its files go to the kernel anyway).
        self._direct = hasattr(os, "O_DIRECT")
        self._direct_buffers: list[mmap.mmap] = []
        self._direct_lock = threading.Lock()
        self._open_lock = threading.Lock()
        self._inflight_lock = threading.Lock()
        self._pins: Counter[str] = Counter()
        self._pins_lock = threading.Lock()
        self._touched: dict[str, float] = {}
        # Blocks this process fetched ahead of need that no read has used yet (path: size).
        self._unread: dict[str, int] = {}
        self._touched_lock = threading.Lock()
        self._last_flush = time.monotonic()
        self._tmp_names = itertools.count()
        self._evicting = threading.Lock()
        self._closed = False
        self._remove_stale_temp_files()

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
            with self._inflight_lock:
                flight = self._inflight.get(key)
                owner = flight is None
                if flight is None:
                    flight = self._inflight[key] = _Flight()
            if not owner:
                shared = flight.outcome()
                if shared is not None:  # fetched but not stored (degraded): share the bytes
                    self.stats.add(cache_hits=1)
                    return shared[start:end]
                continue  # stored (by that thread or another mount): read it from disk
            try:
                self._raise_recent_failure(key)
                data, flight.block = self._fetch_and_store(
                    key, start, end, block_len, fetch, evict_before
                )
                return data
            except NoRoom as exc:
                flight.error = exc  # waiters fetch their bytes as ranges too
                raise
            except Exception as exc:
                flight.error = exc  # waiters fail with it too, instead of refetching in turn
                self._remember_failure(key, exc)
                raise
            finally:
                self._release(key)

    def _raise_recent_failure(self, key: BlockKey) -> None:
        with self._inflight_lock:
            failed = self._failed.get(key)
        if failed is not None and time.monotonic() < failed[1]:
            raise failed[0]

    def _remember_failure(self, key: BlockKey, exc: Exception) -> None:
        now = time.monotonic()
        with self._inflight_lock:
            if key in self._failed and self._failed[key][0] is exc:
                return  # raised from the memory itself: the hold does not grow
            for old in [k for k, (_, until) in self._failed.items() if until <= now]:
                del self._failed[old]
            self._failed[key] = (exc, now + _FAILURE_HOLD_S)

    @property
    def degraded(self) -> bool:
        """Whether caching is paused because the cache disk failed (full, read-only)."""
        return time.monotonic() < self._degraded_until

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
            if not self._claim(key):
                continue
            slot = self._slot(key)
            try:
                self._lock_slot(slot)
            except BaseException:
                self._release(key)
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
        with self._reserving(block_len, evict_before) as reserved:
            return reserved and self._prefetch_claimed(key, block_len, fetch_range, evict_before)

    def _prefetch_claimed(
        self,
        key: BlockKey,
        block_len: int,
        fetch_range: Callable[[int, int], bytes],
        evict_before: float,
    ) -> bool:
        if not self._claim(key, wait=False):
            return False
        slot = self._slot(key)
        try:
            self._lock_slot(slot)
            try:
                if os.path.exists(self._block_path(key)):
                    return False
                block = fetch_range(0, block_len)
                self.stats.add(prefetched_blocks=1)
                stored = self._store(
                    key, block, expected=block_len, evict_before=evict_before, unread=True
                )
                return stored
            finally:
                self._unlock_slot(slot)
        finally:
            self._release(key)

    def _unusable(self, key: BlockKey) -> bool:
        """Cached already, or a path that cannot hold a block."""
        path = self._block_path(key)
        return path in self._bad_paths or os.path.lexists(path)

    def in_flight(self, key: BlockKey) -> bool:
        """Whether a thread of this process is fetching the block now."""
        return key in self._inflight

    def contains(self, key: BlockKey) -> bool:
        """Whether the block's file is on disk (not verified)."""
        return os.path.exists(self._block_path(key))

    def put(self, key: BlockKey, block: bytes) -> bool:
        """Store a block that was downloaded anyway (an index scan), unless it is cached,
        in flight, or would need evicting; returns True if stored."""
        if self.degraded or self._unusable(key):
            return False
        with self._reserving(len(block), EVICT_NONE) as reserved:
            if not reserved or not self._claim(key, wait=False):
                return False
            try:
                with self._cross_process_lock(key):
                    if os.path.exists(self._block_path(key)):
                        return False
                    return self._store(key, block, evict_before=EVICT_NONE)
            finally:
                self._release(key)

    def _claim(self, key: BlockKey, *, wait: bool = True) -> bool:
        """Become the one thread fetching ``key``; else (if ``wait``) wait for the owner,
        raising its failure."""
        with self._inflight_lock:
            flight = self._inflight.get(key)
            if flight is None:
                self._inflight[key] = _Flight()
                return True
        if wait:
            flight.outcome()
        return False

    def _release(self, key: BlockKey, error: Exception | None = None) -> None:
        with self._inflight_lock:
            flight = self._inflight.pop(key)
        if error is not None and flight.error is None:
            flight.error = error
        flight.done.set()

    def _unlock_and_release(self, key: BlockKey, slot: int, error: Exception | None = None) -> None:
        try:
            self._unlock_slot(slot)
        finally:
            self._release(key, error)

    def usage(self) -> int:
        try:
            with self._db() as db:
                return int(db.execute("SELECT bytes FROM total WHERE id = 1").fetchone()[0])
        except sqlite3.Error:
            return -1

    def limit(self) -> int:
        """The bound in force now: ``--cache-size``, lowered to keep ``min_free`` free."""
        try:
            free = shutil.disk_usage(self.root).free
        except OSError:
            return self.max_bytes
        return max(0, min(self.max_bytes, self.usage() + free - self.config.min_free))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._flush_access_times(force=True)
        with self._open_lock:
            for block in self._open.values():
                self._retire_locked(block)
            self._open.clear()
        os.close(self._lock_fd)
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()

    # -- paths and bookkeeping ---------------------------------------------------------

    def path_of(self, key: BlockKey) -> Path:
        return Path(self._block_path(key))

    def _block_path(self, key: BlockKey) -> str:
        return f"{self._blocks_prefix}{key.shard[:2]}/{key.shard}/{key.index}"

    @contextlib.contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is not None and getattr(self._local, "generation", -1) != self._generation:
            with contextlib.suppress(sqlite3.Error):
                conn.close()  # the ledger was rebuilt: this connection sees the old file
            conn = None
        if conn is None:
            conn = _connect_ledger(self._db_path)
            self._local.conn = conn
            self._local.generation = self._generation
        try:
            yield conn
        except BaseException:
            # A statement failed inside BEGIN ... COMMIT: without a rollback this thread's
            # connection would stay in the transaction and every later write would fail.
            if conn.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
            raise

    def _remove_stale_temp_files(self) -> None:
        """Delete temp files whose writer process is gone; only ``tmp/`` is listed."""
        for entry in os.scandir(self.tmp_dir):
            pid_text = entry.name.split("-", 1)[0]
            if not (pid_text.isdigit() and process_running(int(pid_text))):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)

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
        if path in self._bad_paths:
            return None
        with self._pins_lock:
            self._pins[path] += 1
        try:
            try:
                block = self._acquire(path, key, block_len)
            except (CorruptBlockError, struct.error) as exc:
                self._discard(path, exc)
                return None
            except OSError as exc:
                if exc.errno not in _DISK_WIDE:
                    self._skip_path(path, exc)
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
            finally:
                self._unuse(block)
        finally:
            with self._pins_lock:
                self._pins[path] -= 1
                if not self._pins[path]:
                    del self._pins[path]
        with self._touched_lock:
            self._touched[path] = time.time()
            if used and self._unread:
                self._unread.pop(path, None)
        self._flush_access_times()
        return data

    def _acquire(self, path: str, key: BlockKey, block_len: int) -> _OpenBlock | None:
        """The open block file at ``path`` (opened and header-verified once), or None."""
        with self._open_lock:
            block = self._open.get(path)
            if block is not None and os.fstat(block.fd).st_nlink == 0:
                # Removed by `cache clear` or another mount's eviction: holding it open
                # would keep its disk space and serve a block the cache no longer has.
                del self._open[path]
                self._retire_locked(block)
                block = None
            if block is not None:
                self._open.move_to_end(path)
                block.users += 1
                return block
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            header = read_header(fd, key, block_len)
        except BaseException:
            os.close(fd)
            raise
        block = _OpenBlock(fd, header, users=1)
        with self._open_lock:
            if path in self._open:  # another thread opened it meanwhile: use one
                os.close(fd)
                block = self._open[path]
                block.users += 1
                return block
            self._open[path] = block
            while len(self._open) > _OPEN_BLOCKS:
                _, oldest = self._open.popitem(last=False)
                self._retire_locked(oldest)
        return block

    def _unuse(self, block: _OpenBlock) -> None:
        with self._open_lock:
            block.users -= 1
            if block.retired and block.users == 0:
                os.close(block.fd)

    def _retire_locked(self, block: _OpenBlock) -> None:
        block.retired = True
        if block.users == 0:
            os.close(block.fd)

    def _close_open(self, path: str) -> None:
        """Stop using an open block (evicted, discarded or replaced)."""
        with self._open_lock:
            block = self._open.pop(path, None)
            if block is not None:
                self._retire_locked(block)

    def _discard(self, path: str, exc: BaseException) -> None:
        self.stats.add(checksum_failures=1)
        log.warning("discarding corrupt cached block %s (%s)", path, exc)
        self._forget(path)

    def _forget(self, path: str) -> None:
        self._close_open(path)
        with contextlib.suppress(OSError):
            os.unlink(path)
        with contextlib.suppress(sqlite3.Error), self._db() as db:
            db.execute("BEGIN IMMEDIATE")
            row = db.execute("SELECT size FROM blocks WHERE path = ?", (path,)).fetchone()
            if row is not None:
                db.execute("DELETE FROM blocks WHERE path = ?", (path,))
                db.execute("UPDATE total SET bytes = bytes - ? WHERE id = 1", (row[0],))
            db.execute("COMMIT")

    def _flush_access_times(self, *, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_flush < _ATIME_FLUSH_S:
            return
        with self._touched_lock:
            self._last_flush = now
            touched, self._touched = self._touched, {}
        if not touched:
            return
        try:
            with self._db() as db:
                db.executemany(
                    "UPDATE blocks SET atime = ? WHERE path = ?",
                    [(atime, path) for path, atime in touched.items()],
                )
        except sqlite3.Error as exc:
            log.debug("could not record block use: %s", exc)

    # -- fetching and writing ----------------------------------------------------------

    def _cross_process_lock(self, key: BlockKey) -> contextlib.AbstractContextManager[None]:
        return self._locked(self._slot(key))

    @staticmethod
    def _slot(key: BlockKey) -> int:
        return (int(key.shard[:8], 16) ^ key.index) % _LOCK_SLOTS

    def _lock_slot(self, offset: int) -> None:
        _lock_range(self._lock_fd, offset)

    def _unlock_slot(self, offset: int) -> None:
        fcntl.lockf(self._lock_fd, fcntl.LOCK_UN, 1, offset)

    def _locked(self, offset: int) -> contextlib.AbstractContextManager[None]:
        return _holding(self._lock_fd, offset)

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
        with self._cross_process_lock(key):
            data = self._load(key, start, end, block_len)  # another mount may have fetched it
            if data is not None:
                self.stats.add(cache_hits=1)
                return data, None
            with self._reserving(block_len, evict_before) as reserved:
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
        read (counted if it is evicted before a read uses it)."""
        if expected is not None and len(block) != expected:
            raise ValueError(f"assembled {len(block)} bytes for a block of {expected}")
        if time.monotonic() < self._degraded_until:
            return False
        final = self.path_of(key)
        if str(final) in self._bad_paths:
            return False
        if not self._ledger_ready and not self._prepare():
            return False
        header = block_header(key, block, self.config.chunk_size)
        size = len(header) + len(block)
        tmp = self.tmp_dir / f"{os.getpid()}-{next(self._tmp_names)}-{uuid.uuid4().hex[:8]}.tmp"
        inserted = 0
        try:
            if not self._make_room(size, evict_before):
                self.stats.add(blocks_not_admitted=1)
                return False
            self._write_new_file(tmp, header, block)
            with self._db() as db:
                db.execute("BEGIN IMMEDIATE")
                inserted = db.execute(
                    "INSERT OR IGNORE INTO blocks VALUES (?, ?, ?)",
                    (str(final), size, time.time()),
                ).rowcount
                if inserted:
                    db.execute("UPDATE total SET bytes = bytes + ? WHERE id = 1", (size,))
                db.execute("COMMIT")
            final.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, final)
            self._close_open(str(final))
            self.stats.add(blocks_written=1)
            if unread:
                with self._touched_lock:
                    self._unread[str(final)] = size
            announce = self.on_stored
            if announce is not None:
                announce(key, block)
            return True
        except (OSError, sqlite3.Error) as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            if inserted:
                self._forget(str(final))  # counted, but never renamed into place
            if isinstance(exc, OSError) and exc.errno == errno.ENOENT:
                self.stats.add(cache_write_errors=1)  # a folder cleared under us: next time
            elif isinstance(exc, OSError) and exc.errno not in _DISK_WIDE:
                self._skip_path(str(final), exc)
            elif isinstance(exc, sqlite3.Error) and ledger_damaged(exc, self._db_path):
                self.stats.add(cache_write_errors=1)
                self._rebuild_ledger(str(exc))
            else:
                self._degrade(exc)
            return False

    def _skip_path(self, path: str, exc: OSError) -> None:
        """A block path that fails on its own: count it, warn once for it, and serve that
        block from the store from now on; the rest of the cache carries on."""
        self.stats.add(cache_write_errors=1)
        if path in self._bad_paths:
            return
        if len(self._bad_paths) < 4096:
            self._bad_paths.add(path)
        log.warning("cannot cache block %s (%s); serving it from the store", path, exc.strerror)

    def _prepare(self) -> bool:
        """Open (or rebuild) the ledger; on a full or read-only disk start degraded and try
        again later. Returns whether the ledger is usable."""
        try:
            prepare_ledger(self.root, self._lock_fd)
        except (OSError, sqlite3.Error) as exc:
            self._degrade(exc)
            return False
        self._generation += 1
        self._ledger_ready = True
        return True

    def _rebuild_ledger(self, reason: str) -> None:
        """The ledger went bad while in use: rebuild it from the block files."""
        try:
            with self._locked(_LOCK_SLOTS):
                rebuild_ledger(self.root, reason)
        except (OSError, sqlite3.Error) as exc:
            self._ledger_ready = False
            self._degrade(exc)
            return
        self._generation += 1

    def _write_new_file(self, path: Path, header: bytes, block: bytes) -> None:
        if self._direct:
            try:
                self._write_direct(path, header, block)
                return
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._direct = False  # the filesystem refuses O_DIRECT: write through it
                log.info("cache folder does not take O_DIRECT; writing blocks buffered")
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _write_all(fd, header, block)
        finally:
            os.close(fd)

    def _write_direct(self, path: Path, header: bytes, block: bytes) -> None:
        """Write header + block bypassing the page cache: an aligned, padded write, then the
        file is cut to its exact length."""
        size = len(header) + len(block)
        padded = -(-size // _DIRECT_ALIGN) * _DIRECT_ALIGN
        with self._direct_lock:
            usable = [b for b in self._direct_buffers if len(b) >= padded]
            buffer = usable[0] if usable else mmap.mmap(-1, padded)
            if usable:
                self._direct_buffers.remove(buffer)
        try:
            buffer[: len(header)] = header
            buffer[len(header) : size] = block
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o644)
            try:
                if os.write(fd, memoryview(buffer)[:padded]) != padded:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
                os.ftruncate(fd, size)
            finally:
                os.close(fd)
        finally:
            with self._direct_lock:
                if len(self._direct_buffers) < _DIRECT_BUFFERS:
                    self._direct_buffers.append(buffer)
                else:
                    buffer.close()

    def _degrade(self, exc: BaseException) -> None:
        """A full or read-only cache disk: keep serving from the store, warn once."""
        self.stats.add(cache_write_errors=1)
        self._degraded_until = time.monotonic() + _DEGRADED_RETRY_S
        if not self._warned:
            self._warned = True
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            log.warning("cache disk unusable (%s); reading from the store without caching", reason)
        log.debug("cache write failed", exc_info=exc)

    def room_for(self, block_len: int, evict_before: float = EVICT_NONE) -> bool:
        """Whether a block of ``block_len`` bytes fits under the bound now, counting as free
        the blocks last used before ``evict_before`` (a wall time) that no read holds."""
        incoming = encoded_size(block_len, self.config.chunk_size)
        return self._room(incoming + self._reserved, evict_before)

    @contextlib.contextmanager
    def _reserving(self, block_len: int, evict_before: float) -> Iterator[bool]:
        """Hold room for a block while it is fetched and stored, so that concurrent fetches
        in this process never count the same free bytes (one of them would be fetched and
        then not kept). Yields whether room was found; ``EVICT_ANY`` always finds it."""
        if evict_before == EVICT_ANY:
            yield True
            return
        incoming = encoded_size(block_len, self.config.chunk_size)
        with self._room_lock:
            if not self._room(incoming + self._reserved, evict_before):
                reserved = 0
            else:
                reserved = incoming
                self._reserved += incoming
        try:
            yield reserved > 0
        finally:
            if reserved:
                with self._room_lock:
                    self._reserved -= reserved

    def _room(self, incoming: int, evict_before: float) -> bool:
        limit = self.limit()
        used = self.usage()
        if used + incoming <= limit:
            return True
        if incoming > limit or evict_before == EVICT_NONE:
            return False
        need = used + incoming - limit
        if self._evictable(need, evict_before) < need:
            return False
        self._flush_access_times(force=True)  # uses not yet written may warm a victim
        return self._evictable(need, evict_before) >= need

    def _evictable(self, need: int, evict_before: float) -> int:
        """Bytes of the oldest blocks used before ``evict_before``, counted up to ``need``."""
        with self._pins_lock:
            pinned = set(self._pins)
        found = 0
        try:
            with self._db() as db:
                rows = db.execute(
                    "SELECT path, size FROM blocks WHERE atime < ? ORDER BY atime",
                    (evict_before,),
                )
                for path, size in rows:
                    if path not in pinned:
                        found += size
                        if found >= need:
                            break
        except sqlite3.Error:
            return 0
        return found

    def _make_room(self, incoming: int, evict_before: float = EVICT_ANY) -> bool:
        """Evict least recently used blocks, among those last used before ``evict_before``,
        so that ``incoming`` bytes fit under the bound; False when they cannot."""
        limit = self.limit()
        if incoming > limit:
            raise OSError(errno.ENOSPC, "cache bound smaller than one block")
        if self.usage() + incoming <= limit:
            return True
        if evict_before == EVICT_NONE:
            return False
        with self._evicting:
            self._flush_access_times(force=True)
            target = int(limit * _EVICT_LOW_WATER) - incoming
            self.evict_to(max(0, target), evict_before)
            return self.usage() + incoming <= limit

    def evict_to(self, target: int, evict_before: float = EVICT_ANY) -> int:
        """Remove least recently used blocks (of those last used before ``evict_before``)
        until usage is at most ``target``; returns how many."""
        removed = 0
        with self._db() as db:
            while True:
                db.execute("BEGIN IMMEDIATE")
                used = int(db.execute("SELECT bytes FROM total WHERE id = 1").fetchone()[0])
                if used <= target:
                    db.execute("COMMIT")
                    return removed
                with self._pins_lock:
                    pinned = set(self._pins)
                # Blocks being read here are never evicted; look past them, however many.
                rows = db.execute(
                    "SELECT path, size FROM blocks WHERE atime < ? ORDER BY atime LIMIT ?",
                    (evict_before, 64 + len(pinned)),
                ).fetchall()
                victims = [(p, s) for p, s in rows if p not in pinned]
                freed, chosen = 0, []
                for path, size in victims:
                    if used - freed <= target:
                        break
                    chosen.append(path)
                    freed += size
                if not chosen:
                    db.execute("COMMIT")
                    return removed
                db.executemany("DELETE FROM blocks WHERE path = ?", [(p,) for p in chosen])
                db.execute("UPDATE total SET bytes = bytes - ? WHERE id = 1", (freed,))
                db.execute("COMMIT")
                for path in chosen:
                    self._close_open(path)
                    with contextlib.suppress(OSError):
                        os.unlink(path)
                removed += len(chosen)
                with self._touched_lock:
                    unread = sum(self._unread.pop(path, 0) for path in chosen)
                self.stats.add(blocks_evicted=len(chosen), evicted_unread_bytes=unread)


def heal_cache_folder(cache_dir: Path) -> None:
    """Recreate an unusable lock file and rebuild a damaged ledger (each with one warning);
    errors of the disk itself are left to the caller."""
    fd = open_lock_file(cache_dir)
    try:
        prepare_ledger(cache_dir, fd)
    finally:
        os.close(fd)


def _ledger_totals(db_path: Path) -> tuple[int, int]:
    """(blocks, bytes) the ledger records; sqlite3.Error if it cannot be read."""
    conn = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=30)
    try:
        blocks = int(conn.execute("SELECT COUNT(*) FROM blocks").fetchone()[0])
        used = int(conn.execute("SELECT bytes FROM total WHERE id = 1").fetchone()[0])
    finally:
        conn.close()
    return blocks, used


def cache_info(cache_dir: Path) -> dict[str, int | str]:
    """What is in a cache folder; a damaged ledger is rebuilt first (one warning)."""
    info: dict[str, int | str] = {"cache_dir": str(cache_dir)}
    db_path = cache_dir / _LEDGER
    blocks = used = 0
    if os.path.lexists(db_path):
        try:
            blocks, used = _ledger_totals(db_path)
        except sqlite3.Error as exc:
            if ledger_damaged(exc, db_path) or "no such table" in str(exc):
                with contextlib.suppress(OSError, sqlite3.Error):
                    heal_cache_folder(cache_dir)
            with contextlib.suppress(sqlite3.Error):
                blocks, used = _ledger_totals(db_path)
    info["blocks"] = blocks
    info["block_bytes"] = used
    for name in ("index", "views"):
        folder = cache_dir / name
        files = list(folder.glob("*.sqlite")) if folder.is_dir() else []
        sizes = []
        for path in files:
            with contextlib.suppress(OSError):
                sizes.append(path.stat().st_size)
        info[f"{name}_files"] = len(sizes)
        info[f"{name}_bytes"] = sum(sizes)
    return info


def _move_blocks(blocks_dir: Path, trash: Path) -> None:
    """Move every block away in one step, leaving an empty blocks folder."""
    if blocks_dir.exists():
        os.rename(blocks_dir, trash)
    blocks_dir.mkdir(exist_ok=True)


def _empty_ledger(conn: sqlite3.Connection) -> None:
    conn.execute("DELETE FROM blocks")
    conn.execute("UPDATE total SET bytes = 0 WHERE id = 1")
    conn.execute("COMMIT")


def clear_cache(cache_dir: Path, *, everything: bool = False) -> int:
    """Drop every cached block (and with ``everything`` the indexes and views).

    Safe while mounts use the folder: the blocks folder is renamed away in one step, so a
    reader either still holds an open block (valid until closed) or misses and refetches.
    Returns the number of bytes the bookkeeping said were used. A damaged ledger or lock
    file is repaired first (one warning), so clearing always works.
    """
    blocks_dir = cache_dir / "blocks"
    used = 0
    db_path = cache_dir / _LEDGER
    if os.path.lexists(db_path):
        with contextlib.suppress(OSError, sqlite3.OperationalError):  # full disk: see below
            heal_cache_folder(cache_dir)
        trash = cache_dir / f"trash-{uuid.uuid4().hex[:8]}"
        try:
            conn = sqlite3.connect(db_path, timeout=30, isolation_level=None)
            try:
                conn.execute("BEGIN IMMEDIATE")
                used = int(conn.execute("SELECT bytes FROM total WHERE id = 1").fetchone()[0])
                _move_blocks(blocks_dir, trash)
                try:
                    _empty_ledger(conn)
                except sqlite3.OperationalError:
                    # A full disk cannot take the ledger's write: free the blocks, retry.
                    conn.execute("ROLLBACK")
                    shutil.rmtree(trash, ignore_errors=True)
                    conn.execute("BEGIN IMMEDIATE")
                    _empty_ledger(conn)
            finally:
                conn.close()
        except sqlite3.OperationalError as exc:
            # Still no room (the disk is full of other files): no block is left, so an
            # absent ledger is the right one; the next mount starts a new one.
            log.warning("cache ledger not writable (%s); removed it", exc)
            _move_blocks(blocks_dir, trash)
            for suffix in ("", "-wal", "-shm"):
                remove_any(Path(f"{db_path}{suffix}"))
        shutil.rmtree(trash, ignore_errors=True)
    elif blocks_dir.exists():
        shutil.rmtree(blocks_dir, ignore_errors=True)
    if everything:
        for name in ("index", "views"):
            remove_any(cache_dir / name)
    return used

"""The ledger: ``cache.sqlite`` records the size and last use of every block, for the bound.

The block files are the truth; the ledger is only bookkeeping over them. An unreadable
ledger is rebuilt from the block headers (one warning). Every statement on the ledger's
tables lives in this module, for mounts (``Ledger``) and for ``cache info`` / ``cache clear``
alike.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from .block_format import block_file_size
from .claims import SETUP_SLOT, LockFile
from .writer import remove_any

log = logging.getLogger(__name__)

LEDGER = "cache.sqlite"
_ATIME_FLUSH_S = 5.0
# SQLite primary result codes (``sqlite_errorcode & 0xff``).
_SQLITE_CORRUPT, _SQLITE_NOTADB = 11, 26

_SCHEMA = """
CREATE TABLE IF NOT EXISTS blocks (path TEXT PRIMARY KEY, size INTEGER NOT NULL,
                                   atime REAL NOT NULL);
CREATE INDEX IF NOT EXISTS blocks_by_atime ON blocks (atime);
CREATE TABLE IF NOT EXISTS total (id INTEGER PRIMARY KEY CHECK (id = 1), bytes INTEGER NOT NULL);
INSERT OR IGNORE INTO total VALUES (1, 0);
"""


def disk_free(path: Path) -> int:
    """Bytes free on the disk holding ``path`` for this user (``shutil.disk_usage``'s
    ``free``, from one ``statvfs``: looked at about three times per block stored)."""
    disk = os.statvfs(path)
    return disk.f_bavail * disk.f_frsize


def read_total(conn: sqlite3.Connection) -> int:
    return int(conn.execute("SELECT bytes FROM total WHERE id = 1").fetchone()[0])


def _add_to_total(conn: sqlite3.Connection, delta: int) -> None:
    conn.execute("UPDATE total SET bytes = bytes + ? WHERE id = 1", (delta,))


def empty_ledger(conn: sqlite3.Connection) -> None:
    conn.execute("DELETE FROM blocks")
    conn.execute("UPDATE total SET bytes = 0 WHERE id = 1")
    conn.execute("COMMIT")


def _sqlite_code(exc: sqlite3.Error) -> int:
    return (getattr(exc, "sqlite_errorcode", 0) or 0) & 0xFF


def ledger_damaged(exc: sqlite3.Error, db_path: Path) -> bool:
    """Whether ``exc`` says the ledger file itself is bad (rebuild it), rather than the disk
    (full, read-only) or another process (busy)."""
    if _sqlite_code(exc) in (_SQLITE_CORRUPT, _SQLITE_NOTADB) or "integrity check" in str(exc):
        return True
    paths = [Path(f"{db_path}{suffix}") for suffix in ("", "-wal", "-shm")]
    return any(p.is_symlink() or (p.exists() and not p.is_file()) for p in paths)


def open_connection(db_path: Path) -> sqlite3.Connection:
    """A connection to the ledger in autocommit and WAL mode, usable from any thread."""
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
    conn = open_connection(db_path)
    try:
        conn.executescript(_SCHEMA)
        verdict = conn.execute("PRAGMA quick_check").fetchone()[0]
        if verdict != "ok":
            raise sqlite3.DatabaseError(f"integrity check failed: {verdict}")
    finally:
        conn.close()


def _scandir(folder: Path) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(folder) as entries:
            return list(entries)
    except OSError:
        return []


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


def rebuild_ledger(root: Path, reason: str) -> int:
    """Replace ``cache.sqlite`` by one made from the block files; returns the blocks kept.
    Call with the setup lock held."""
    db_path = root / LEDGER
    for suffix in ("", "-wal", "-shm", "-journal"):
        remove_any(Path(f"{db_path}{suffix}"))
    rows = list(_scan_block_files(root / "blocks"))
    conn = open_connection(db_path)
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


def prepare_ledger(root: Path, locks: LockFile) -> None:
    """Make sure ``cache.sqlite`` is usable, rebuilding it when it is damaged. Errors of the
    disk (full, read-only) are raised: the caller decides how to degrade."""
    db_path = root / LEDGER
    # Switching a new database to WAL fails at once ("database is locked") when another
    # mount does the same, so mounts set it up one at a time.
    with locks.holding(SETUP_SLOT):
        try:
            _check_ledger(db_path)
        except sqlite3.DatabaseError as exc:
            if not ledger_damaged(exc, db_path):
                raise
            rebuild_ledger(root, str(exc))


def heal_cache_folder(cache_dir: Path) -> None:
    """Recreate an unusable lock file and rebuild a damaged ledger (each with one warning);
    errors of the disk itself are left to the caller."""
    locks = LockFile(cache_dir)
    try:
        prepare_ledger(cache_dir, locks)
    finally:
        locks.close()


def ledger_totals(db_path: Path) -> tuple[int, int]:
    """(blocks, bytes) the ledger records; sqlite3.Error if it cannot be read."""
    conn = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=30)
    try:
        blocks = int(conn.execute("SELECT COUNT(*) FROM blocks").fetchone()[0])
        used = read_total(conn)
    finally:
        conn.close()
    return blocks, used


RETIRED_BEFORE = 1e6
"""Use times below this (1970-01-12) mark retired blocks (``Ledger.retire``)."""


class _Held:
    """A thread's connection to the ledger as a context manager: ``with`` gives it, and an
    exception inside rolls back a transaction left open (without the rollback, the
    thread's connection would stay in it and every later write would fail). A class, not
    a generator: the ledger is used several times per block stored."""

    __slots__ = ("conn", "generation")

    def __init__(self, conn: sqlite3.Connection, generation: int) -> None:
        self.conn = conn
        self.generation = generation

    def __enter__(self) -> sqlite3.Connection:
        return self.conn

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is not None and self.conn.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                self.conn.execute("ROLLBACK")


class Ledger:
    """A mount's view of the ledger: one connection per thread, the bound's arithmetic,
    eviction victims, and the block uses not yet written (flushed every few seconds)."""

    def __init__(
        self,
        root: Path,
        locks: LockFile,
        max_bytes: int,
        min_free: int,
        *,
        connect: Callable[[Path], sqlite3.Connection] = open_connection,
    ) -> None:
        self.root = root
        self._connect = connect
        self.path = root / LEDGER
        self.max_bytes = max_bytes
        self._min_free = min_free
        self._locks = locks
        self.local = threading.local()
        self._generation = 0  # bumped when the ledger is rebuilt: threads reconnect
        # Every thread's connection, so that close() closes them all (not only its own).
        self._connections: set[sqlite3.Connection] = set()
        self._connections_lock = threading.Lock()
        self.ready = False
        self._last_usage = 0
        self._uses_lock = threading.Lock()
        self._touched: dict[str, float] = {}
        # Blocks this process fetched ahead of need that no read has used yet (path: size).
        self._unread: dict[str, int] = {}
        # Blocks retired (``retire``) since the order they were read in began: later uses
        # do not warm them again.
        self._retired: set[str] = set()
        self._retired_count = 0
        self._last_flush = time.monotonic()

    # -- the file ------------------------------------------------------------------------

    def prepare(self) -> None:
        """Open (or rebuild) the ledger; disk errors are raised to the caller."""
        prepare_ledger(self.root, self._locks)
        self._generation += 1
        self.ready = True

    def rebuild(self, reason: str) -> None:
        """The ledger went bad while in use: rebuild it from the block files."""
        try:
            with self._locks.holding(SETUP_SLOT):
                rebuild_ledger(self.root, reason)
        except (OSError, sqlite3.Error):
            self.ready = False
            raise
        self._generation += 1

    def damaged(self, exc: sqlite3.Error) -> bool:
        return ledger_damaged(exc, self.path)

    def connection(self) -> _Held:
        """This thread's connection, for a ``with`` block (which gives the connection); a
        failed statement never leaves it in a transaction."""
        held: _Held | None = getattr(self.local, "held", None)
        if held is not None and held.generation == self._generation:
            return held
        if held is not None:
            self._forget(held.conn)  # rebuilt (this connection sees the old file) or closed
        conn = self._connect(self.path)
        with self._connections_lock:
            self._connections.add(conn)
        held = _Held(conn, self._generation)
        self.local.held = held
        return held

    def _forget(self, conn: sqlite3.Connection) -> None:
        with self._connections_lock:
            self._connections.discard(conn)
        with contextlib.suppress(sqlite3.Error):
            conn.close()

    def close(self) -> None:
        """Write pending uses and close every thread's connection; a thread that uses the
        ledger afterwards opens a new one rather than touch a closed one."""
        self.flush_uses(force=True)
        self._generation += 1
        with self._connections_lock:
            connections, self._connections = self._connections, set()
        for conn in connections:
            with contextlib.suppress(sqlite3.Error):
                conn.close()

    @property
    def open_connections(self) -> int:
        with self._connections_lock:
            return len(self._connections)

    # -- usage and the bound -------------------------------------------------------------

    def usage(self) -> int:
        """Bytes of the blocks on record; sqlite3.Error when the ledger cannot be read (a
        guess would let blocks past the bound)."""
        with self.connection() as db:
            used = read_total(db)
        self._last_usage = used
        return used

    def reported_usage(self) -> int:
        """For statistics only: the usage, or the last one read when the ledger fails."""
        try:
            return self.usage()
        except sqlite3.Error:
            return self._last_usage

    def limit(self, used: int) -> int:
        """The bound in force with ``used`` bytes cached: the configured size, lowered to
        keep ``min_free`` bytes of the disk free."""
        try:
            free = disk_free(self.root)
        except OSError:
            return self.max_bytes
        return max(0, min(self.max_bytes, used + free - self._min_free))

    def add(self, path: str, size: int) -> bool:
        """Record a new block; False when it was on record already (nothing counted)."""
        with self.connection() as db:
            db.execute("BEGIN IMMEDIATE")
            inserted = db.execute(
                "INSERT OR IGNORE INTO blocks VALUES (?, ?, ?)", (path, size, time.time())
            ).rowcount
            if inserted:
                _add_to_total(db, size)
            db.execute("COMMIT")
        if inserted and self._retired:
            with self._uses_lock:
                self._retired.discard(path)  # fetched again: its new reads count
        return bool(inserted)

    def forget(self, path: str) -> None:
        """Drop a block from the record, if it is there; a failing ledger is left be."""
        with contextlib.suppress(sqlite3.Error), self.connection() as db:
            db.execute("BEGIN IMMEDIATE")
            row = db.execute("SELECT size FROM blocks WHERE path = ?", (path,)).fetchone()
            if row is not None:
                db.execute("DELETE FROM blocks WHERE path = ?", (path,))
                _add_to_total(db, -row[0])
            db.execute("COMMIT")

    def evictable(self, need: int, evict_before: float, pinned: set[str]) -> int:
        """Bytes of the oldest blocks used before ``evict_before`` and not ``pinned``,
        counted up to ``need``; 0 when the ledger cannot be read."""
        found = 0
        try:
            with self.connection() as db:
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

    def take_victims(
        self, target: int, evict_before: float, pinned: Callable[[], set[str]]
    ) -> list[str]:
        """Strike one batch of the least recently used blocks (used before ``evict_before``,
        not ``pinned``) off the record, towards usage ``target``; the caller removes their
        files. Empty when usage is at the target or nothing more may go."""
        with self.connection() as db:
            db.execute("BEGIN IMMEDIATE")
            used = read_total(db)
            if used <= target:
                db.execute("COMMIT")
                return []
            held = pinned()
            # Blocks being read here are never evicted; look past them, however many.
            rows = db.execute(
                "SELECT path, size FROM blocks WHERE atime < ? ORDER BY atime LIMIT ?",
                (evict_before, 64 + len(held)),
            ).fetchall()
            freed, chosen = 0, []
            for path, size in rows:
                if path in held:
                    continue
                if used - freed <= target:
                    break
                chosen.append(path)
                freed += size
            if chosen:
                db.executemany("DELETE FROM blocks WHERE path = ?", [(p,) for p in chosen])
                _add_to_total(db, -freed)
            db.execute("COMMIT")
        return chosen

    # -- uses ------------------------------------------------------------------------------

    def touch(self, path: str, *, used: bool) -> None:
        """A read found the block; ``used``: a read somebody asked for (not unread now)."""
        with self._uses_lock:
            if path not in self._retired:
                self._touched[path] = time.time()
            if used and self._unread:
                self._unread.pop(path, None)
        self.flush_uses()

    def retire(self, paths: list[str]) -> None:
        """Blocks whose reads are all done for now (an order hint's files, all opened): they
        go first when room is needed, oldest retirement first. Their use times become
        ``RETIRED_BEFORE`` or less, so any ``evict_before`` from it on may take them, and
        reads of them no longer warm them until ``unretire_all``."""
        with self._uses_lock:
            stamps = []
            for path in paths:
                self._touched.pop(path, None)
                self._retired.add(path)
                self._retired_count += 1
                stamps.append((1.0 + self._retired_count * 1e-3, path))
        try:
            with self.connection() as db:
                db.executemany("UPDATE blocks SET atime = ? WHERE path = ?", stamps)
        except sqlite3.Error as exc:
            log.debug("could not retire blocks: %s", exc)

    def unretire_all(self) -> None:
        """A new reading order begins: reads warm every block again (retired ones stay
        first to go until a read uses them)."""
        with self._uses_lock:
            self._retired.clear()

    def mark_unread(self, path: str, size: int) -> None:
        with self._uses_lock:
            self._unread[path] = size

    def take_unread(self, paths: list[str]) -> int:
        """Bytes of ``paths`` (evicted now) that no read used."""
        with self._uses_lock:
            return sum(self._unread.pop(path, 0) for path in paths)

    def flush_uses(self, *, force: bool = False) -> None:
        """Write the last uses to the ledger, at most every few seconds unless ``force``."""
        now = time.monotonic()
        if not force and now - self._last_flush < _ATIME_FLUSH_S:
            return
        with self._uses_lock:
            self._last_flush = now
            touched, self._touched = self._touched, {}
        if not touched:
            return
        try:
            with self.connection() as db:
                db.executemany(
                    "UPDATE blocks SET atime = ? WHERE path = ?",
                    [(atime, path) for path, atime in touched.items()],
                )
        except sqlite3.Error as exc:
            log.debug("could not record block use: %s", exc)

"""The global index: every member of every shard, built once by streaming, kept in SQLite.

One SQLite file per source under ``CACHE_DIR/index/``. Rows are keyed by each shard's
identity (name, size, ETag), so a remount with unchanged shards scans nothing and a changed
shard is rescanned alone. The same file, uploaded next to the shards as a sidecar, lets
another machine mount without scanning.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import posixpath
import sqlite3
import tempfile
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from ..atomic import replacing
from ..config import IndexConfig
from ..errors import CorruptShardError, IndexFileError
from ..formats.members import (
    LABEL_EXTENSIONS,
    MAX_LABEL_BYTES,
    MemberRow,
    label_extension,
    parse_label,
    split_key,
)
from ..formats.tar import MemberKind
from ..formats.units import DecodedScan, DecodedSpace
from ..store.remote import Store
from ..store.shards import ShardInfo
from .scan import BlockSink, ShardScan, scan_shard

log = logging.getLogger(__name__)

SCHEMA_VERSION = 4
# Schema 1 read labels only from KEY.cls / KEY.json, not from KEY.v2.cls; schemas 1 and 2
# kept a tar inside a tar as one file, where schema 3 presents it as a folder; schema 4
# decodes members that schema 3 refused (deflated zip members, compressed parquet pages,
# zstd MDS shards). An older index's rows are reused for every shard they still describe,
# the others scanned again.
_OLD_LABEL_SCHEMA = 1
_OLD_NESTING_SCHEMA = 2
_OLD_UNDECODED_SCHEMA = 3
SIDECAR_NAME = ".shardfs-index.sqlite"

UNITS_TABLE = """
CREATE TABLE IF NOT EXISTS units (
    shard INTEGER NOT NULL,
    start INTEGER NOT NULL,
    codec TEXT NOT NULL,
    offset INTEGER NOT NULL,
    length INTEGER NOT NULL,
    size INTEGER NOT NULL,
    state BLOB NOT NULL,
    PRIMARY KEY (shard, start)
);
"""
"""The decode units of each shard (``formats.units``); the view keeps a copy."""

_SCHEMA = (
    """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS shards (
    id INTEGER PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    size INTEGER NOT NULL,
    etag TEXT NOT NULL,
    error_offset INTEGER,
    error TEXT
);
CREATE TABLE IF NOT EXISTS members (
    shard INTEGER NOT NULL,
    path TEXT NOT NULL,
    offset INTEGER NOT NULL,
    size INTEGER NOT NULL,
    mode INTEGER NOT NULL,
    mtime INTEGER NOT NULL,
    kind INTEGER NOT NULL,
    link TEXT NOT NULL,
    label INTEGER
);
CREATE INDEX IF NOT EXISTS members_by_shard ON members (shard);
"""
    + UNITS_TABLE
)
UNIT_COLUMNS = "start, codec, offset, length, size, state"
"""The columns of a ``units`` row after its shard: a decode unit placed in decoded space."""

Progress = Callable[[int, int, int, int], None]
"""Called with (shards done, shards total, bytes done, bytes total)."""


def fingerprint(shards: list[ShardInfo]) -> str:
    """A digest of the shard identities: equal fingerprints mean an equal index."""
    digest = hashlib.sha256()
    for shard in shards:
        digest.update(json.dumps(shard.identity).encode())
    return digest.hexdigest()[:24]


def connect(path: Path, *, readonly: bool = False) -> sqlite3.Connection:
    if readonly:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)
    else:
        conn = sqlite3.connect(path, check_same_thread=False)
    conn.execute("PRAGMA busy_timeout = 30000")
    return conn


def create_index(path: Path, source: str, shards: list[ShardInfo]) -> sqlite3.Connection:
    """A new index file holding the shard table; shard ids are 1-based list positions."""
    conn = connect(path)
    conn.execute("PRAGMA journal_mode = OFF")
    conn.execute("PRAGMA synchronous = OFF")
    conn.executescript(_SCHEMA)
    conn.execute("INSERT INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
    conn.execute("INSERT INTO meta VALUES ('source', ?)", (source,))
    conn.execute("INSERT INTO meta VALUES ('fingerprint', ?)", (fingerprint(shards),))
    conn.executemany(
        "INSERT INTO shards (id, name, size, etag) VALUES (?, ?, ?, ?)",
        [(sid, s.name, s.size, s.etag) for sid, s in enumerate(shards, start=1)],
    )
    return conn


def insert_members(conn: sqlite3.Connection, shard_id: int, rows: list[MemberRow]) -> None:
    conn.executemany(
        "INSERT INTO members VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
        ((shard_id, *row) for row in rows),
    )


def insert_units(conn: sqlite3.Connection, shard_id: int, space: DecodedSpace) -> None:
    conn.executemany(
        "INSERT INTO units VALUES (?, ?, ?, ?, ?, ?, ?)",
        (
            (shard_id, start, u.codec, u.offset, u.length, u.size, u.state)
            for start, u in zip(space.starts, space.units, strict=True)
        ),
    )


ShardTable = dict[tuple[str, int, str], int]
"""Identity (name, size, ETag) -> shard id in an index file."""


def _read_shard_table(path: Path) -> tuple[ShardTable, bool] | None:
    """The reusable shards of an existing index file and whether its schema is this one's
    (else it is copied into a new file); None if it is absent or unusable."""
    if not path.exists():
        return None
    try:
        conn = connect(path, readonly=True)
        try:
            version = conn.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()
            schema = int(version[0]) if version is not None else None
            known = (SCHEMA_VERSION, _OLD_UNDECODED_SCHEMA, _OLD_NESTING_SCHEMA, _OLD_LABEL_SCHEMA)
            if schema not in known:
                return None
            rows = conn.execute("SELECT id, name, size, etag FROM shards").fetchall()
            stale = _unread_label_shards(conn) if schema == _OLD_LABEL_SCHEMA else set()
            if schema is not None and schema < _OLD_UNDECODED_SCHEMA:
                stale |= _inner_tar_shards(conn)
            if schema != SCHEMA_VERSION:  # a shard refused then may decode now
                stale |= {sid for (sid,) in conn.execute("SELECT id FROM shards WHERE error")}
        finally:
            conn.close()
    except (sqlite3.Error, ValueError):
        log.warning("ignoring unreadable index %s", path)
        return None
    table = {(name, size, etag): sid for sid, name, size, etag in rows if sid not in stale}
    return table, schema == SCHEMA_VERSION


def _unread_label_shards(conn: sqlite3.Connection) -> set[int]:
    """Shards of a schema-1 index holding a label member (``KEY.v2.cls``) it did not read."""
    rows = conn.execute(
        "SELECT shard, path FROM members WHERE kind = ? AND label IS NULL AND size <= ? "
        "AND (path LIKE '%.cls' OR path LIKE '%.json')",
        (int(MemberKind.FILE), MAX_LABEL_BYTES),
    )
    stale = set()
    for shard, path in rows:
        split = split_key(path)
        if split is not None and "." in split[1] and label_extension(path) is not None:
            stale.add(shard)
    return stale


def _inner_tar_shards(conn: sqlite3.Connection) -> set[int]:
    """Shards of an index before schema 3 holding a ``.tar`` member, which may be a tar that
    schema 3 presents as a folder."""
    rows = conn.execute(
        "SELECT DISTINCT shard FROM members WHERE kind = ? AND path LIKE '%.tar'",
        (int(MemberKind.FILE),),
    )
    return {shard for (shard,) in rows}


@dataclass(frozen=True)
class _Source:
    """Where to copy a shard's rows from: an index file, its shard id, and the folder its
    paths are relative to."""

    path: Path
    shard_id: int
    folder: str


@dataclass(frozen=True)
class BadShard:
    name: str
    offset: int
    reason: str


class IndexBuilder:
    """Brings the persisted index of one source up to date with the store's shard list."""

    def __init__(
        self,
        store: Store,
        config: IndexConfig,
        *,
        progress: Progress | None = None,
        block_sink: BlockSink | None = None,
        block_size: int = 0,
    ) -> None:
        self.block_sink = block_sink
        self.block_size = block_size
        self.store = store
        self.config = config
        self.progress = progress
        self.index_dir = config.cache_dir / "index"
        self.path = self.index_dir / f"{store.identity}.sqlite"
        self.scanned_shards = 0
        self._temp_files: list[Path] = []

    def build(self, shards: list[ShardInfo]) -> Path:
        """Return the path of an index that covers exactly ``shards``.

        Raises CorruptShardError for a bad shard unless ``skip_bad_shards`` is set.
        """
        try:
            self.index_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise IndexFileError(f"cannot create index folder {self.index_dir}: {exc}") from exc
        wanted = {s.identity for s in shards}
        local, current = _read_shard_table(self.path) or ({}, True)
        if set(local) != wanted or not current:
            self._rebuild(shards, local)
        self._check_bad_shards()
        return self.path

    def _sidecars(self, missing: list[ShardInfo]) -> dict[tuple[str, int, str], _Source]:
        """Sidecars next to the missing shards: in the source root and in each shard folder
        (of each source, for several).

        A sidecar names its shards and members relative to its own folder."""
        found: dict[tuple[str, int, str], _Source] = {}
        # A sidecar's rows came from each shard's own format; --format may read them as
        # another.
        if not self.config.use_sidecar or self.store.config.shard_format != "auto":
            return found
        for part, suffix in self.store.parts():
            names = [s.name.removesuffix(suffix) for s in missing if s.name.endswith(suffix)]
            if names:
                self._sidecars_of(part, suffix, names, found)
        return found

    def _sidecars_of(
        self,
        part: Store,
        suffix: str,
        names: list[str],
        found: dict[tuple[str, int, str], _Source],
    ) -> None:
        """Add to ``found`` the shards of one source's sidecars; ``names`` are its missing
        shards as it names them, ``suffix`` what its shard names carry here."""
        for folder in sorted({posixpath.dirname(n) for n in names} | {""}):
            data = part.read_object(posixpath.join(folder, SIDECAR_NAME))
            if data is None:
                continue
            fd, name = tempfile.mkstemp(prefix=".sidecar-", suffix=".sqlite", dir=self.index_dir)
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
            self._temp_files.append(Path(name))
            found_table = _read_shard_table(Path(name))
            if found_table is None:
                log.warning(
                    "ignoring invalid index sidecar %s", posixpath.join(folder, SIDECAR_NAME)
                )
                continue
            table = found_table[0]
            where = f"folder {folder}/" if folder else "the source root"
            log.info("using the index sidecar in %s for %d shard(s)", where, len(table))
            for (shard_name, size, etag), sid in table.items():
                identity = (posixpath.join(folder, shard_name) + suffix, size, etag)
                found.setdefault(identity, _Source(Path(name), sid, folder))

    def _rebuild(self, shards: list[ShardInfo], local: ShardTable) -> None:
        missing = [s for s in shards if s.identity not in local]
        self._temp_files.clear()
        try:
            with replacing(self.path, prefix=".build-", suffix=".sqlite") as tmp:
                sidecars = self._sidecars(missing) if missing else {}
                conn = create_index(tmp, self.store.describe(), shards)
                try:
                    to_scan: list[tuple[int, ShardInfo]] = []
                    for sid, shard in enumerate(shards, start=1):
                        if shard.identity in local:
                            source = _Source(self.path, local[shard.identity], "")
                            self._copy_shard(conn, source, sid)
                        elif shard.identity in sidecars:
                            self._copy_shard(conn, sidecars[shard.identity], sid)
                        else:
                            to_scan.append((sid, shard))
                    conn.commit()
                    self._scan_all(conn, to_scan)
                    conn.commit()
                finally:
                    conn.close()
        finally:
            for path in self._temp_files:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()

    @staticmethod
    def _copy_shard(conn: sqlite3.Connection, source: _Source, new_id: int) -> None:
        """Copy one shard's rows from another index file, under ``source.folder``."""
        conn.execute("ATTACH DATABASE ? AS old", (f"file:{source.path}?mode=ro",))
        prefix = source.folder + "/" if source.folder else ""
        try:
            conn.execute(
                "INSERT INTO members SELECT ?, ? || path, offset, size, mode, mtime, kind, "
                "CASE WHEN kind = ? AND link != '' THEN ? || link ELSE link END, label "
                "FROM old.members WHERE shard = ? ORDER BY rowid",
                (new_id, prefix, int(MemberKind.HARDLINK), prefix, source.shard_id),
            )
            has_units = conn.execute(
                "SELECT 1 FROM old.sqlite_master WHERE type = 'table' AND name = 'units'"
            ).fetchone()
            if has_units:
                conn.execute(
                    f"INSERT INTO units SELECT ?, {UNIT_COLUMNS} FROM old.units WHERE shard = ?",
                    (new_id, source.shard_id),
                )
            conn.execute(
                "UPDATE shards SET (error_offset, error) = "
                "(SELECT error_offset, error FROM old.shards WHERE id = ?) WHERE id = ?",
                (source.shard_id, new_id),
            )
            conn.commit()
        finally:
            conn.execute("DETACH DATABASE old")

    def _scan_all(self, conn: sqlite3.Connection, to_scan: list[tuple[int, ShardInfo]]) -> None:
        if not to_scan:
            return
        total_bytes = sum(s.size for _, s in to_scan)
        done = done_bytes = 0
        stop = threading.Event()

        def job(shard: ShardInfo) -> ShardScan | CorruptShardError:
            if stop.is_set():
                return []
            try:
                return scan_shard(self.store, shard, self.block_sink, self.block_size)
            except CorruptShardError as exc:
                return exc

        workers = max(1, min(self.config.scan_workers, len(to_scan)))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="scan") as pool:
            pending: dict[Future[ShardScan | CorruptShardError], tuple[int, ShardInfo]]
            pending = {pool.submit(job, shard): (sid, shard) for sid, shard in to_scan}
            if self.progress:
                self.progress(0, len(to_scan), 0, total_bytes)
            try:
                while pending:
                    finished, _ = wait(pending, return_when=FIRST_COMPLETED)
                    for future in finished:
                        sid, shard = pending.pop(future)
                        result = future.result()
                        self._store_scan(conn, sid, shard, result)
                        done += 1
                        done_bytes += shard.size
                        if self.progress:
                            self.progress(done, len(to_scan), done_bytes, total_bytes)
            except BaseException:
                stop.set()
                for future in pending:
                    future.cancel()
                raise

    def _store_scan(
        self,
        conn: sqlite3.Connection,
        sid: int,
        shard: ShardInfo,
        result: ShardScan | CorruptShardError,
    ) -> None:
        self.scanned_shards += 1
        if isinstance(result, CorruptShardError):
            conn.execute(
                "UPDATE shards SET error_offset = ?, error = ? WHERE id = ?",
                (result.offset, result.reason, sid),
            )
        elif isinstance(result, DecodedScan):
            insert_members(conn, sid, result.rows)
            insert_units(conn, sid, result.space)
        else:
            insert_members(conn, sid, result)
        conn.commit()

    def bad_shards(self) -> list[BadShard]:
        conn = connect(self.path, readonly=True)
        try:
            rows = conn.execute(
                "SELECT name, error_offset, error FROM shards WHERE error IS NOT NULL ORDER BY id"
            ).fetchall()
        finally:
            conn.close()
        return [BadShard(name, offset, reason) for name, offset, reason in rows]

    def _check_bad_shards(self) -> None:
        bad = self.bad_shards()
        if not bad:
            return
        if not self.config.skip_bad_shards:
            first = bad[0]
            more = f" (and {len(bad) - 1} more bad shard(s))" if len(bad) > 1 else ""
            error = CorruptShardError(first.name, first.offset, first.reason)
            error.args = (f"{error}{more}; use --skip-bad-shards to mount the rest",)
            raise error
        for shard in bad:
            # Callers warn the user through their own channel (CLI line, mount pipe).
            log.info(
                "skipping bad shard %s: %s at offset %d", shard.name, shard.reason, shard.offset
            )


def write_sidecar(store: Store, index_path: Path) -> None:
    """Upload the index next to the shards so other machines mount without scanning."""
    store.write_object(SIDECAR_NAME, index_path.read_bytes())


def iter_member_rows(conn: sqlite3.Connection) -> Iterator[tuple[int, MemberRow]]:
    """Every member of every good shard, in shard order and archive order."""
    cursor = conn.execute(
        "SELECT m.shard, m.path, m.offset, m.size, m.mode, m.mtime, m.kind, m.link, m.label "
        "FROM members m JOIN shards s ON s.id = m.shard WHERE s.error IS NULL "
        "ORDER BY m.shard, m.rowid"
    )
    for shard, *row in cursor:
        yield shard, tuple(row)


# The member rules (``members``) and ``BlockSink`` are imported from here by pack and dataset.
__all__ = [
    "LABEL_EXTENSIONS",
    "MAX_LABEL_BYTES",
    "SIDECAR_NAME",
    "UNITS_TABLE",
    "UNIT_COLUMNS",
    "BadShard",
    "BlockSink",
    "IndexBuilder",
    "MemberRow",
    "Progress",
    "connect",
    "create_index",
    "fingerprint",
    "insert_members",
    "insert_units",
    "iter_member_rows",
    "label_extension",
    "parse_label",
    "split_key",
    "write_sidecar",
]

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

from .atomic import replacing
from .config import IndexConfig
from .errors import CorruptShardError, IndexFileError, UnsafeMemberError
from .store import ShardInfo, Store
from .tar import MemberKind, Readable, TarMember, iter_members

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
SIDECAR_NAME = ".shardfs-index.sqlite"
LABEL_EXTENSIONS = frozenset({"cls", "json"})
MAX_LABEL_BYTES = 64 << 10

_SCHEMA = """
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

MemberRow = tuple[str, int, int, int, int, int, str, "int | None"]
"""(path, data offset, size, mode, mtime, kind, link target, label)."""

Progress = Callable[[int, int, int, int], None]
"""Called with (shards done, shards total, bytes done, bytes total)."""


def split_key(path: str) -> tuple[str, str]:
    """webdataset's sample key and extension: the basename splits at its first dot."""
    directory, base = posixpath.split(path)
    stem, dot, ext = base.partition(".")
    key = posixpath.join(directory, stem) if directory else stem
    return key, ext if dot else ""


# What a member path may be. Linux limits, which FUSE could not serve beyond anyway: a
# component of at most NAME_MAX bytes, a path of at most PATH_MAX - 1 bytes. The depth bound
# is ours: no real dataset nests 256 folders, and a bound keeps every walk over a path short.
MAX_NAME_BYTES = 255
MAX_PATH_BYTES = 4095
MAX_PATH_DEPTH = 256
# Labels are class indices: non-negative and small enough for a C int everywhere downstream.
MAX_LABEL = 2**31 - 1
_LABEL_FIELDS = ("label", "cls", "class", "target")


def _shown(text: str) -> str:
    """A member path for an error message: repr'd, and cut short if it is huge."""
    return repr(text) if len(text) <= 200 else repr(text[:200]) + "..."


def _check_name(raw: str, what: str, shard: str, offset: int) -> bytes:
    """The UTF-8 bytes of a name the filesystem can present, or UnsafeMemberError.

    The tar parser decodes names with ``surrogateescape``, so a name that was not valid
    UTF-8 arrives holding lone surrogates and fails to encode here. A NUL would cut the
    name short in every C interface (the kernel would list a name that cannot be opened).
    """
    try:
        encoded = raw.encode("utf-8")
    except UnicodeEncodeError:
        raise UnsafeMemberError(shard, offset, f"{what} {_shown(raw)} is not valid UTF-8") from None
    if b"\0" in encoded:
        raise UnsafeMemberError(shard, offset, f"{what} {_shown(raw)} contains a NUL byte")
    if len(encoded) > MAX_PATH_BYTES:
        raise UnsafeMemberError(
            shard, offset, f"{what} {_shown(raw)} is longer than {MAX_PATH_BYTES} bytes"
        )
    return encoded


def normalize_member_path(raw: str, shard: str, offset: int) -> str:
    """A member path made relative and clean; anything the mount cannot present is refused.

    Refused with UnsafeMemberError (the shard is bad): absolute paths, '..' components,
    names that are not valid UTF-8 or hold a NUL, a path over ``MAX_PATH_BYTES`` bytes, a
    component over ``MAX_NAME_BYTES`` bytes, and more than ``MAX_PATH_DEPTH`` components.
    """
    _check_name(raw, "member path", shard, offset)
    if raw.startswith("/"):
        raise UnsafeMemberError(shard, offset, f"member path {_shown(raw)} is absolute")
    parts = []
    for part in raw.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            raise UnsafeMemberError(shard, offset, f"member path {_shown(raw)} escapes the mount")
        if len(part.encode()) > MAX_NAME_BYTES:
            raise UnsafeMemberError(
                shard,
                offset,
                f"member path {_shown(raw)} has a name longer than {MAX_NAME_BYTES} bytes",
            )
        parts.append(part)
    if len(parts) > MAX_PATH_DEPTH:
        raise UnsafeMemberError(
            shard, offset, f"member path {_shown(raw)} is deeper than {MAX_PATH_DEPTH} folders"
        )
    return "/".join(parts)


def check_symlink_target(target: str, shard: str, offset: int) -> str:
    """A symlink target as stored: it may point anywhere (the view drops those that leave
    the mount), but it must be valid UTF-8 without NUL and at most ``MAX_PATH_BYTES``."""
    _check_name(target, "symlink target", shard, offset)
    return target


def _label_value(value: object) -> int | None:
    """A label is an int (not a bool) with ``0 <= label <= MAX_LABEL``; else there is none."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_LABEL:
        return value
    return None


def parse_label(ext: str, content: bytes) -> int | None:
    """The integer label of a ``.cls`` or ``.json`` member, or None if it has none.

    A ``.cls`` holds ASCII digits; a ``.json`` holds an int or an object with one of the
    ``_LABEL_FIELDS``. Anything else, including a negative or huge number, is no label:
    the view reports the sample as unlabelled instead of the shard being refused. JSON
    nested deeper than the interpreter's recursion limit is no label either.
    """
    try:
        text = content.decode("utf-8").strip()
    except UnicodeDecodeError:
        return None
    if ext == "cls":
        digits = text.lstrip("0")
        if not (text.isascii() and text.isdigit()) or len(digits) > len(str(MAX_LABEL)):
            return None
        return _label_value(int(digits or "0"))
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):  # ValueError covers ints of over 4,300 digits too
        return None
    if isinstance(value, dict):
        for field in _LABEL_FIELDS:
            label = _label_value(value.get(field))
            if label is not None:
                return label
        return None
    return _label_value(value)


def _wants_content(member: TarMember) -> bool:
    return (
        member.kind == MemberKind.FILE
        and member.size <= MAX_LABEL_BYTES
        and split_key(member.path)[1].lower() in LABEL_EXTENSIONS
    )


BlockSink = Callable[[ShardInfo, int, bytes], None]
"""Receives (shard, block index, block bytes) for every whole block a scan streamed."""


class _BlockTee:
    """Passes a shard stream through while cutting it into cache blocks for a sink, so the
    bytes a scan downloads are not downloaded again when files are read."""

    def __init__(
        self, stream: Readable, shard: ShardInfo, block_size: int, sink: BlockSink
    ) -> None:
        self._stream = stream
        self._shard = shard
        self._block_size = block_size
        self._sink = sink
        self._buffer = bytearray()
        self._index = 0
        self._sink_failed = False

    def read(self, n: int = -1, /) -> bytes:
        data = self._stream.read(n)
        self._buffer += data
        while len(self._buffer) >= self._block_size:
            self._emit(bytes(self._buffer[: self._block_size]))
            del self._buffer[: self._block_size]
        return data

    def finish(self) -> None:
        """Read the archive's tail padding too, so that the last block is whole."""
        while self.read(1 << 20):
            pass
        if self._buffer and self._index * self._block_size + len(self._buffer) == self._shard.size:
            self._emit(bytes(self._buffer))
        self._buffer.clear()

    def _emit(self, block: bytes) -> None:
        if self._sink_failed:
            return
        try:
            self._sink(self._shard, self._index, block)
        except (OSError, sqlite3.Error) as exc:
            # The cache disk failed: the scan goes on (the blocks are an optimisation
            # here), says so once, and stops handing this shard's blocks over. Any other
            # error is a bug and is raised.
            log.warning("not caching the blocks of %s while indexing: %s", self._shard.name, exc)
            self._sink_failed = True
        self._index += 1


def scan_shard(
    store: Store,
    shard: ShardInfo,
    block_sink: BlockSink | None = None,
    block_size: int = 0,
) -> list[MemberRow]:
    """Stream one shard and return a row per member worth serving; with ``block_sink``, also
    hand every block of the shard to it."""
    rows: list[MemberRow] = []
    shard_dir = posixpath.dirname(shard.name)
    with store.open_stream(shard) as raw:
        tee = _BlockTee(raw, shard, block_size, block_sink) if block_sink and block_size else None
        stream: Readable = tee if tee is not None else raw
        for member, content in iter_members(stream, shard.name, capture=_wants_content):
            if member.kind == MemberKind.OTHER:
                continue
            path = normalize_member_path(member.path, shard.name, member.header_offset)
            link = member.linkname
            if member.kind == MemberKind.HARDLINK:
                link = normalize_member_path(link, shard.name, member.header_offset)
            elif member.kind == MemberKind.SYMLINK:
                link = check_symlink_target(link, shard.name, member.header_offset)
            if shard_dir:
                path = posixpath.join(shard_dir, path) if path else shard_dir
                if member.kind == MemberKind.HARDLINK:
                    link = posixpath.join(shard_dir, link)
            if not path:
                continue  # the archive's own "./" entry
            label = None
            if content is not None:
                label = parse_label(split_key(path)[1].lower(), content)
            rows.append(
                (
                    path,
                    member.data_offset,
                    member.size,
                    member.mode,
                    member.mtime,
                    int(member.kind),
                    link,
                    label,
                )
            )
        if tee is not None:
            tee.finish()
    return rows


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


def _read_shard_table(path: Path) -> dict[tuple[str, int, str], int] | None:
    """Identity -> shard id of an existing index file, or None if unusable."""
    if not path.exists():
        return None
    try:
        conn = connect(path, readonly=True)
        try:
            version = conn.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()
            if version is None or int(version[0]) != SCHEMA_VERSION:
                return None
            rows = conn.execute("SELECT id, name, size, etag FROM shards").fetchall()
        finally:
            conn.close()
    except (sqlite3.Error, ValueError):
        log.warning("ignoring unreadable index %s", path)
        return None
    return {(name, size, etag): sid for sid, name, size, etag in rows}


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
        local = _read_shard_table(self.path) or {}
        if set(local) != wanted:
            self._rebuild(shards, local)
        self._check_bad_shards()
        return self.path

    def _sidecars(self, missing: list[ShardInfo]) -> dict[tuple[str, int, str], _Source]:
        """Sidecars next to the missing shards: in the source root and in each shard folder.

        A sidecar names its shards and members relative to its own folder."""
        found: dict[tuple[str, int, str], _Source] = {}
        if not self.config.use_sidecar:
            return found
        for folder in sorted({posixpath.dirname(s.name) for s in missing} | {""}):
            data = self.store.read_object(posixpath.join(folder, SIDECAR_NAME))
            if data is None:
                continue
            fd, name = tempfile.mkstemp(prefix=".sidecar-", suffix=".sqlite", dir=self.index_dir)
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
            self._temp_files.append(Path(name))
            table = _read_shard_table(Path(name))
            if table is None:
                log.warning(
                    "ignoring invalid index sidecar %s", posixpath.join(folder, SIDECAR_NAME)
                )
                continue
            where = f"folder {folder}/" if folder else "the source root"
            log.info("using the index sidecar in %s for %d shard(s)", where, len(table))
            for (shard_name, size, etag), sid in table.items():
                identity = (posixpath.join(folder, shard_name), size, etag)
                found.setdefault(identity, _Source(Path(name), sid, folder))
        return found

    def _rebuild(self, shards: list[ShardInfo], local: dict[tuple[str, int, str], int]) -> None:
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

        def job(shard: ShardInfo) -> list[MemberRow] | CorruptShardError:
            if stop.is_set():
                return []
            try:
                return scan_shard(self.store, shard, self.block_sink, self.block_size)
            except CorruptShardError as exc:
                return exc

        workers = max(1, min(self.config.scan_workers, len(to_scan)))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="scan") as pool:
            pending: dict[Future[list[MemberRow] | CorruptShardError], tuple[int, ShardInfo]]
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
        result: list[MemberRow] | CorruptShardError,
    ) -> None:
        self.scanned_shards += 1
        if isinstance(result, CorruptShardError):
            conn.execute(
                "UPDATE shards SET error_offset = ?, error = ? WHERE id = ?",
                (result.offset, result.reason, sid),
            )
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


__all__ = [
    "SIDECAR_NAME",
    "BadShard",
    "IndexBuilder",
    "fingerprint",
    "iter_member_rows",
    "normalize_member_path",
    "parse_label",
    "scan_shard",
    "split_key",
    "write_sidecar",
]

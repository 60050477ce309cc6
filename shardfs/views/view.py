"""Views: how index members become a directory tree, materialised once into SQLite.

``raw`` shows member paths as they are, merged across shards. ``imagefolder`` turns
webdataset samples (``KEY.jpg`` + ``KEY.cls``) into ``CLASS/KEY.jpg``, the member's folders
kept (``imagefolder_view``).

Duplicate rule: when two members present the same path, the one from the later shard
(in sorted shard-name order) wins, and within a shard the later member wins, as if the
shards were extracted one after another. Every duplicate is counted and reported.

Symlinks are judged on the finished tree by walking each target as the Linux kernel would
(``symlink_walk``); one whose walk could leave the mount, or loops, is left out and reported.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import posixpath
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

from ..atomic import replacing
from ..config import ViewConfig
from ..errors import NotADirError, NotFoundError, UsageError
from ..formats.tar import MemberKind
from ..formats.units import DecodedSpace, Unit
from ..index.db import SCHEMA_VERSION, UNIT_COLUMNS, UNITS_TABLE, connect, iter_member_rows
from ..store.shards import ShardInfo
from .block_files import FileTable, ShardWindows
from .imagefolder import IMAGE_EXTENSIONS, build_imagefolder, is_image_name
from .nodes import NODE_COLUMNS, ROOT_INO, Node, node_of
from .tree import TreeWriter, ViewReport

log = logging.getLogger(__name__)

# IMAGE_EXTENSIONS is imported from here by pack.
__all__ = [
    "CLASSES_FILE",
    "IMAGE_EXTENSIONS",
    "ROOT_INO",
    "Node",
    "View",
    "ViewReport",
    "build_view",
    "parse_classes",
    "view_key",
]

VIEW_VERSION = 6  # 5: rows that carry their own label (parquet, MDS); 6: decode units
CLASSES_FILE = "classes.txt"

_NODE_BATCH = 256  # nodes loaded by a miss that follows the last one's batch
_NODE_FEW = 8  # by any other miss
_NODE_CACHE = 1 << 17
_VIEW_SCHEMA = (
    """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE shards (id INTEGER PRIMARY KEY, name TEXT NOT NULL, size INTEGER NOT NULL,
                     etag TEXT NOT NULL);
CREATE TABLE nodes (
    ino INTEGER PRIMARY KEY,
    parent INTEGER NOT NULL,
    name TEXT NOT NULL,
    kind INTEGER NOT NULL,
    shard INTEGER NOT NULL,
    offset INTEGER NOT NULL,
    size INTEGER NOT NULL,
    mode INTEGER NOT NULL,
    mtime INTEGER NOT NULL,
    link TEXT NOT NULL
);
"""
    + UNITS_TABLE
)

ClassesLookup = Callable[[str], "list[str] | None"]
"""Class names for a shard folder (from a classes.txt next to its shards), or None."""


def view_key(index_fingerprint: str, config: ViewConfig, classes: dict[str, list[str]]) -> str:
    """The name of a materialised view: a new view rule or index schema builds it anew."""
    text = json.dumps(
        [VIEW_VERSION, SCHEMA_VERSION, index_fingerprint, config.layout, config.classes, classes]
    )
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def parse_classes(text: str, source: str = "classes file") -> list[str]:
    """One class name per line, index = label; blank trailing lines are ignored.

    A name given twice is refused: its labels would silently share one folder."""
    names = [line.strip() for line in text.splitlines()]
    while names and not names[-1]:
        names.pop()
    first_line: dict[str, int] = {}
    for number, name in enumerate(names, start=1):
        if not name or "/" in name or name in (".", ".."):
            raise UsageError(f"{source}: invalid class name {name!r} on line {number}")
        earlier = first_line.setdefault(name, number)
        if earlier != number:
            again = [n for n, other in enumerate(names, start=1) if other == name]
            lines = ", ".join(str(n) for n in again[:-1]) + f" and {again[-1]}"
            raise UsageError(
                f"{source}: duplicate class name {name!r} on lines {lines} "
                "(each label needs a name of its own)"
            )
    return names


def _build_raw(conn: sqlite3.Connection, tree: TreeWriter, report: ViewReport) -> None:
    by_path: dict[str, tuple[int, int, int, int]] = {}
    current_shard = -1
    for shard, (path, offset, size, mode, mtime, kind, link, _label) in iter_member_rows(conn):
        if shard != current_shard:
            by_path.clear()  # hard links refer to earlier members of the same shard
            current_shard = shard
        if kind == MemberKind.DIRECTORY:
            if _label is None:  # a labelled folder is a class the imagefolder view makes
                tree.directory(path, mode, mtime)
        elif kind == MemberKind.FILE:
            by_path[path] = (offset, size, mode, mtime)
            tree.entry(path, MemberKind.FILE, shard, offset, size, mode, mtime)
            report.images += is_image_name(path)
        elif kind == MemberKind.HARDLINK:
            target = by_path.get(link)
            if target is None:
                report.dropped_links += 1
                report.note("link", f"hard link {path!r} -> {link!r}: target not in the same shard")
                continue
            t_offset, t_size, t_mode, t_mtime = target
            tree.entry(path, MemberKind.FILE, shard, t_offset, t_size, t_mode, t_mtime)
            report.images += is_image_name(path)
        elif kind == MemberKind.SYMLINK:
            tree.entry(path, MemberKind.SYMLINK, shard, 0, len(link.encode()), 0o777, mtime, link)


def build_view(
    index_path: Path, out_path: Path, config: ViewConfig, classes_for: ClassesLookup
) -> ViewReport:
    """Materialise the view of an index into ``out_path`` (written to a temp file, then renamed)."""
    out_path.parent.mkdir(parents=True, exist_ok=True)
    report = ViewReport()
    index = connect(index_path, readonly=True)
    try:
        with replacing(out_path, prefix=".view-", suffix=".sqlite") as tmp:
            out = sqlite3.connect(tmp)
            try:
                _write_view(index, out, config, classes_for, report)
            finally:
                out.close()
    finally:
        index.close()
    return report


def _write_view(
    index: sqlite3.Connection,
    out: sqlite3.Connection,
    config: ViewConfig,
    classes_for: ClassesLookup,
    report: ViewReport,
) -> None:
    """Fill the empty view database ``out`` from ``index``, per ``config``."""
    out.execute("PRAGMA journal_mode = OFF")
    out.execute("PRAGMA synchronous = OFF")
    out.execute("PRAGMA temp_store = FILE")
    out.executescript(_VIEW_SCHEMA)
    shards = index.execute("SELECT id, name, size, etag FROM shards ORDER BY id").fetchall()
    out.executemany("INSERT INTO shards VALUES (?, ?, ?, ?)", shards)
    out.executemany(
        f"INSERT INTO units VALUES (?, {', '.join('?' * 6)})",
        index.execute(f"SELECT shard, {UNIT_COLUMNS} FROM units ORDER BY shard, start"),
    )
    tree = TreeWriter(out, report, int(time.time()))
    layout = config.layout
    if layout in ("auto", "imagefolder"):
        lookup = classes_for
        if config.classes is not None:
            fixed = list(config.classes)

            def lookup(_folder: str) -> list[str] | None:
                return fixed

        if build_imagefolder(index, tree, report, lookup, strict=layout == "auto"):
            layout = "imagefolder"
        elif layout == "auto":
            # Raw shows every image, so none is "left out": keep the count as the reason.
            report.auto_unlabeled = report.unlabeled + report.unsplit
            report.unlabeled = report.unsplit = report.ignored = report.images = 0
            report.dropped_links = 0  # raw counts its own
            report.examples.clear()
            layout = "raw"
        else:
            raise UsageError("--layout imagefolder: no labelled samples (KEY.cls / KEY.json)")
    if layout == "raw":
        _build_raw(index, tree, report)
    report.layout = layout
    report.requested = config.layout
    tree.finish({sid: name for sid, name, _, _ in shards})
    report.images_presented = report.files if layout == "imagefolder" else _image_files(out)
    out.execute("INSERT INTO meta VALUES ('layout', ?)", (layout,))
    out.execute("INSERT INTO meta VALUES ('report', ?)", (json.dumps(report.__dict__),))
    out.commit()


def _image_files(conn: sqlite3.Connection) -> int:
    """How many files of a finished tree are images by their name (``is_image_name``)."""
    names = " OR ".join("name LIKE ?" for _ in IMAGE_EXTENSIONS)  # LIKE ignores ASCII case
    return int(
        conn.execute(
            f"SELECT COUNT(*) FROM nodes WHERE kind = ? AND ({names})",
            (int(MemberKind.FILE), *(f"%.{ext}" for ext in sorted(IMAGE_EXTENSIONS))),
        ).fetchone()[0]
    )


class View:
    """Read side of a materialised view. Lookups hit SQLite; nothing per file is kept in memory
    beyond a bounded cache."""

    def __init__(self, path: Path) -> None:
        self.path = path
        # One connection for every FUSE thread: libfuse starts and stops threads at will,
        # and a new connection per thread starts with a cold page cache. The GIL serialises
        # the queries anyway.
        self._db = sqlite3.connect(
            f"file:{path}?mode=ro&immutable=1", uri=True, check_same_thread=False
        )
        self._db.execute("PRAGMA mmap_size = 1073741824")
        self._db.execute("PRAGMA cache_size = -65536")
        self._lock = threading.Lock()
        conn = self._db
        self.shards: dict[int, ShardInfo] = {
            sid: ShardInfo(name, size, etag)
            for sid, name, size, etag in conn.execute("SELECT id, name, size, etag FROM shards")
        }
        meta = dict(conn.execute("SELECT key, value FROM meta"))
        self.layout: str = meta.get("layout", "raw")
        self.report = ViewReport(**json.loads(meta.get("report", "{}")))
        self.root = self._by_ino(ROOT_INO)
        self.shard_ids = {info: sid for sid, info in self.shards.items()}
        self.max_ino: int = conn.execute("SELECT MAX(ino) FROM nodes").fetchone()[0]
        self._child = lru_cache(maxsize=1 << 16)(self._child_uncached)
        # Nodes by inode, loaded with their neighbours (``_load_nodes``): an epoch asks for
        # each file about once, and one query per file was a tenth of the daemon's Python
        # time.
        self._nodes: dict[int, Node] = {}
        self._nodes_lock = threading.Lock()
        self._batch_end = -1  # the inode after the last batch loaded
        self._windows = ShardWindows(self._files_from, self._files_before)

    def block_files(self, shard: int, start: int, end: int) -> tuple[FileTable, list[Node]]:
        """The non-empty regular files with bytes in ``[start, end)`` of a shard: (those
        lying wholly inside it, positions counted from ``start``; those crossing its
        edges)."""
        inside, across = self._windows.touching(shard, start, end)
        return inside, [self._nodes.get(ino) or self._by_ino(ino) for ino in across]

    def _files_from(self, shard: int, start: int, end: int) -> list[tuple[int, int, int]]:
        return self._query(
            "SELECT offset, size, ino FROM nodes WHERE shard = ? AND offset >= ? AND offset < ? "
            "AND kind = ? AND size > 0 ORDER BY offset",
            (shard, start, end, int(MemberKind.FILE)),
        )

    def _files_before(self, shard: int, offset: int, count: int) -> list[tuple[int, int, int]]:
        rows = self._query(
            "SELECT offset, size, ino FROM nodes WHERE shard = ? AND offset < ? AND kind = ? "
            "AND size > 0 ORDER BY offset DESC LIMIT ?",
            (shard, offset, int(MemberKind.FILE), count),
        )
        return rows[::-1]

    def unit_at(self, shard: int, offset: int, *, state: bool = False) -> tuple[int, Unit]:
        """(decoded start, unit) of the decode unit holding a decoded ``offset`` of a shard
        (``formats.units``); its ``state`` is loaded only when asked for (it can be large).
        NotFoundError when no unit holds it."""
        rows = self._query(
            f"SELECT start, codec, offset, length, size, {'state' if state else 'NULL'} "
            "FROM units WHERE shard = ? AND start <= ? ORDER BY start DESC LIMIT 1",
            (shard, offset),
        )
        if not rows or offset >= rows[0][0] + max(rows[0][4], 1):
            raise NotFoundError(f"decoded offset {offset} of shard {shard}")
        start, codec, raw, length, size, blob = rows[0]
        return start, Unit(codec, raw, length, size, blob or b"")

    def units_of(self, shard: int) -> DecodedSpace:
        """Every decode unit of a shard with its state, in decoded order (empty for most)."""
        space = DecodedSpace()
        rows = self._query(
            "SELECT start, codec, offset, length, size, state FROM units WHERE shard = ? "
            "ORDER BY start",
            (shard,),
        )
        for start, codec, raw, length, size, state in rows:
            space.units.append(Unit(codec, raw, length, size, state))
            space.starts.append(start)
        return space

    def child(self, parent: int, name: str) -> Node | None:
        """The entry ``name`` of the folder with inode ``parent``, or None."""
        return self._child(parent, name)

    def _query(self, sql: str, args: tuple[object, ...] = ()) -> list[Any]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def node(self, ino: int) -> Node:
        """The node of inode ``ino``; NotFoundError when there is none."""
        found = self._nodes.get(ino)
        if found is None:
            found = self._load_nodes(ino)
        return found

    def _load_nodes(self, ino: int) -> Node:
        """Load ``ino`` and the inodes after it, keeping at most _NODE_CACHE nodes, the
        oldest dropped first. Files of one folder or shard are numbered together, and a
        walk through them misses where the last batch ended: it gets _NODE_BATCH at a
        time. Any other miss (a READ in a shuffled epoch, whose neighbours come at random
        much later) gets _NODE_FEW: 256 rows per such miss were 60 % of the Python time
        of the READs that waited for their blocks in a cold epoch."""
        walking = self._batch_end <= ino < self._batch_end + _NODE_FEW
        batch = _NODE_BATCH if walking else _NODE_FEW
        self._batch_end = ino + batch
        rows = self._query(
            f"SELECT {NODE_COLUMNS} FROM nodes WHERE ino >= ? AND ino < ?", (ino, ino + batch)
        )
        self._keep([node_of(row) for row in rows])
        found = self._nodes.get(ino)
        if found is None:
            raise NotFoundError(f"inode {ino}")
        return found

    def _keep(self, loaded: list[Node]) -> None:
        nodes = self._nodes
        with self._nodes_lock:  # readers only ``get``: safe without it
            excess = len(nodes) + len(loaded) - _NODE_CACHE
            if excess > 0:
                for old in list(itertools.islice(nodes, excess)):
                    del nodes[old]
            for node in loaded:
                nodes[node.ino] = node

    def _by_ino(self, ino: int) -> Node:
        rows = self._query(f"SELECT {NODE_COLUMNS} FROM nodes WHERE ino = ?", (ino,))
        found = rows[0] if rows else None
        if found is None:
            raise NotFoundError(f"inode {ino}")
        return node_of(found)

    def _child_uncached(self, parent: int, name: str) -> Node | None:
        rows = self._query(
            f"SELECT {NODE_COLUMNS} FROM nodes WHERE parent = ? AND name = ?", (parent, name)
        )
        return node_of(rows[0]) if rows else None

    def lookup(self, path: str) -> Node:
        node = self.root
        for part in path.split("/"):
            if not part:
                continue
            if not node.is_dir:
                raise NotADirError(path)
            child = self._child(node.ino, part)
            if child is None:
                raise NotFoundError(path)
            node = child
        return node

    def children(self, directory: Node) -> Iterator[tuple[str, Node]]:
        rows = self._query(
            f"SELECT name, {NODE_COLUMNS} FROM nodes WHERE parent = ? AND ino != ? ORDER BY name",
            (directory.ino, ROOT_INO),
        )
        for name, *row in rows:
            yield name, node_of(tuple(row))

    def listing_rows(self, directory: int) -> list[tuple[bytes, int, int, int, int, int]]:
        """(name as UTF-8 bytes, ino, kind, size, mode, mtime) of every entry of a folder, by
        name: the raw rows, for listings of a million names."""
        return self._query(
            "SELECT CAST(name AS BLOB), ino, kind, size, mode, mtime FROM nodes "
            "WHERE parent = ? AND ino != ? ORDER BY name",
            (directory, ROOT_INO),
        )

    def parent_of(self, directory: int) -> int:
        """The inode of the folder holding ``directory`` (the root holds itself)."""
        rows = self._query("SELECT parent FROM nodes WHERE ino = ?", (directory,))
        if not rows:
            raise NotFoundError(f"inode {directory}")
        return int(rows[0][0]) or ROOT_INO

    def files(self) -> Iterator[tuple[str, Node]]:
        """Every regular file with its path, in (shard, offset) order."""
        folders = {ROOT_INO: ""}
        rows = self._query(
            "SELECT ino, parent, name FROM nodes WHERE kind = ? AND ino != ? ORDER BY ino",
            (int(MemberKind.DIRECTORY), ROOT_INO),
        )
        for ino, parent, name in rows:  # a folder's parent always has a smaller inode
            folders[ino] = posixpath.join(folders[parent], name)
        files = self._query(
            f"SELECT parent, name, {NODE_COLUMNS} FROM nodes WHERE kind = ? ORDER BY shard, offset",
            (int(MemberKind.FILE),),
        )
        for parent, name, *row in files:
            yield posixpath.join(folders[parent], name), node_of(tuple(row))

    def close(self) -> None:
        with self._lock:
            self._db.close()

"""Views: how index members become a directory tree, materialised once into SQLite.

``raw`` shows member paths as they are, merged across shards. ``imagefolder`` turns
webdataset samples (``KEY.jpg`` + ``KEY.cls``) into ``CLASS/KEY.jpg``.

Duplicate rule: when two members present the same path, the one from the later shard
(in sorted shard-name order) wins, and within a shard the later member wins, as if the
shards were extracted one after another. Every duplicate is counted and reported.

Symlinks are judged on the finished tree by walking each target as the Linux kernel would
(``_LinkJudge``); one whose walk could leave the mount, or loops, is left out and reported.
"""

from __future__ import annotations

import collections
import enum
import hashlib
import json
import logging
import posixpath
import sqlite3
import stat
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, NamedTuple

from .atomic import replacing
from .config import ViewConfig
from .errors import NotADirError, NotFoundError, UsageError
from .index import LABEL_EXTENSIONS, connect, iter_member_rows, split_key
from .store import ShardInfo
from .tar import MemberKind

log = logging.getLogger(__name__)

VIEW_VERSION = 3
ROOT_INO = 1
IMAGE_EXTENSIONS = frozenset({"jpg", "jpeg", "png", "ppm", "bmp", "pgm", "tif", "tiff", "webp"})
CLASSES_FILE = "classes.txt"

_VIEW_SCHEMA = """
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

ClassesLookup = Callable[[str], "list[str] | None"]
"""Class names for a shard folder (from a classes.txt next to its shards), or None."""


@dataclass
class ViewReport:
    """What building a view found; warnings name a few examples of each problem.

    The ``auto_*`` fields keep why ``auto`` chose raw, so that every mount can say so."""

    layout: str = "raw"  # the layout built
    requested: str = "raw"  # the layout asked for: auto, raw or imagefolder
    files: int = 0
    directories: int = 0
    bytes: int = 0
    duplicates: int = 0
    labeled: int = 0  # images with a label (the imagefolder tree's files)
    labeled_shards: int = 0  # shards holding them
    unlabeled: int = 0  # images without a label, left out of an imagefolder tree
    auto_unlabeled: int = 0  # images without a label that made auto choose raw
    auto_example: str = ""  # one of them: "KEY.EXT in SHARD"
    ignored: int = 0
    dropped_links: int = 0
    examples: list[str] = field(default_factory=list)

    def note(self, text: str) -> None:
        if len(self.examples) < 5:
            self.examples.append(text)


def view_key(index_fingerprint: str, config: ViewConfig, classes: dict[str, list[str]]) -> str:
    text = json.dumps([VIEW_VERSION, index_fingerprint, config.layout, config.classes, classes])
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


class _TreeWriter:
    """Stages presented entries, then writes the de-duplicated tree with stable inodes."""

    def __init__(self, conn: sqlite3.Connection, report: ViewReport, now: int) -> None:
        self.conn = conn
        self.report = report
        self.now = now
        self.dirs: dict[str, int] = {"": ROOT_INO}
        self.dir_rows: list[tuple[int, str, int, int]] = [(0, "", 0o755, now)]
        self.batch: list[tuple[int, str, int, int, int, int, int, int, str]] = []
        self._folder_paths: dict[int, str] = {}
        conn.execute(
            "CREATE TEMP TABLE staged (seq INTEGER PRIMARY KEY, parent INTEGER, name TEXT, "
            "kind INTEGER, shard INTEGER, offset INTEGER, size INTEGER, mode INTEGER, "
            "mtime INTEGER, link TEXT)"
        )

    def directory(self, path: str, mode: int = 0o755, mtime: int | None = None) -> int:
        ino = self.dirs.get(path)
        if ino is not None:
            if mtime is not None:
                above, name, _, _ = self.dir_rows[ino - 1]
                self.dir_rows[ino - 1] = (above, name, mode | 0o500, mtime)
            return ino
        # Climb to the nearest folder that exists, then create downwards: a loop, not a
        # recursion, so a member path of thousands of components cannot exhaust the stack.
        missing = [path]
        parent_path = posixpath.dirname(path)
        found = self.dirs.get(parent_path)
        while found is None:
            if parent_path == missing[-1]:  # "/" is its own dirname
                raise ValueError(f"folder path {path!r} is not relative")
            missing.append(parent_path)
            parent_path = posixpath.dirname(parent_path)
            found = self.dirs.get(parent_path)
        parent = found
        for depth, folder in enumerate(reversed(missing), start=1):
            ino = len(self.dir_rows) + 1
            self.dirs[folder] = ino
            if depth == len(missing):  # the folder asked for; those above are implied
                row = (parent, posixpath.basename(folder), mode | 0o500, mtime or self.now)
            else:
                row = (parent, posixpath.basename(folder), 0o755 | 0o500, self.now)
            self.dir_rows.append(row)
            parent = ino
        return parent

    def entry(
        self,
        path: str,
        kind: MemberKind,
        shard: int,
        offset: int,
        size: int,
        mode: int,
        mtime: int,
        link: str = "",
    ) -> None:
        parent_path, name = posixpath.split(path)
        parent = self.directory(parent_path)
        self.batch.append((parent, name, int(kind), shard, offset, size, mode, mtime, link))
        if len(self.batch) >= 50_000:
            self.flush()

    def flush(self) -> None:
        self.conn.executemany(
            "INSERT INTO staged (parent, name, kind, shard, offset, size, mode, mtime, link) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            self.batch,
        )
        self.batch.clear()

    def finish(self, shard_names: dict[int, str]) -> None:
        self.flush()
        conn = self.conn
        conn.executemany(
            "INSERT INTO nodes VALUES (?, ?, ?, ?, 0, 0, 0, ?, ?, '')",
            (
                (ino, parent, name, int(MemberKind.DIRECTORY), mode, mtime)
                for ino, (parent, name, mode, mtime) in enumerate(self.dir_rows, start=1)
            ),
        )
        conn.execute("CREATE INDEX temp.staged_by_name ON staged (parent, name, seq)")
        for parent, name, count, shard in conn.execute(
            "SELECT parent, name, COUNT(*), MAX(shard) FROM staged "
            "GROUP BY parent, name HAVING COUNT(*) > 1 LIMIT 5"
        ):
            self.report.note(
                f"duplicate path {self._path_of(parent, name)!r} ({count} copies; "
                f"the one in {shard_names.get(shard, '?')} wins)"
            )
        # The newest copy of each path wins; paths that are also directories lose to them.
        conn.execute(
            "INSERT INTO nodes (parent, name, kind, shard, offset, size, mode, mtime, link) "
            "SELECT s.parent, s.name, s.kind, s.shard, s.offset, s.size, s.mode, s.mtime, s.link "
            "FROM staged s WHERE s.seq = (SELECT MAX(t.seq) FROM staged t "
            "WHERE t.parent = s.parent AND t.name = s.name) "
            "AND NOT EXISTS (SELECT 1 FROM nodes d WHERE d.parent = s.parent AND d.name = s.name) "
            "ORDER BY s.parent, s.name"
        )
        staged = conn.execute("SELECT COUNT(*) FROM staged").fetchone()[0]
        conn.execute("DROP TABLE staged")
        conn.execute("CREATE UNIQUE INDEX nodes_by_name ON nodes (parent, name)")
        winners = conn.execute(
            "SELECT COUNT(*) FROM nodes WHERE kind != ?", (int(MemberKind.DIRECTORY),)
        ).fetchone()[0]
        self._drop_unsafe_links()
        files, total = conn.execute(
            "SELECT COUNT(*), COALESCE(SUM(size), 0) FROM nodes WHERE kind != ?",
            (int(MemberKind.DIRECTORY),),
        ).fetchone()
        self.report.duplicates = staged - winners
        self.report.files = files
        self.report.bytes = total
        self.report.directories = len(self.dir_rows)
        conn.execute("CREATE INDEX nodes_by_place ON nodes (shard, offset)")

    def _drop_unsafe_links(self) -> None:
        """Leave out every symlink of the finished tree that the kernel, following it, would
        walk out of the mount (or that loops): see :class:`_LinkJudge`."""
        parents = [0] + [parent for parent, _, _, _ in self.dir_rows]
        judge = _LinkJudge(self.conn, parents)
        dropped = judge.unsafe_links()
        if not dropped:
            return
        self.report.dropped_links += len(dropped)
        for link in dropped[:5]:
            why = (
                "leads outside the mount"
                if link.end == _End.ESCAPES
                else f"loops or follows more than {MAX_LINK_HOPS} links"
            )
            path = self._path_of(link.parent, link.name)
            self.report.note(f"symlink {path!r} -> {link.target!r} {why}")
        self.conn.executemany("DELETE FROM nodes WHERE ino = ?", ((link.ino,) for link in dropped))

    def _path_of(self, parent: int, name: str) -> str:
        if len(self._folder_paths) != len(self.dirs):
            self._folder_paths = {ino: path for path, ino in self.dirs.items()}
        return posixpath.join(self._folder_paths.get(parent, "?"), name)


MAX_LINK_HOPS = 40
"""Linux's MAXSYMLINKS: a path walk that would follow a 41st symlink fails with ELOOP."""


class _End(enum.Enum):
    """How the kernel's walk of a symlink's target ends."""

    DIRECTORY = "directory"  # at a folder (``_Resolved.folder``)
    OTHER = "other"  # at a file
    FAILS = "fails"  # ENOENT or ENOTDIR inside the mount: harmless
    ESCAPES = "escapes"  # '..' above the mount root, or an absolute target
    LOOPS = "loops"  # a cycle, or more than MAX_LINK_HOPS links: ELOOP


_HARMLESS = frozenset({_End.DIRECTORY, _End.OTHER, _End.FAILS})


class _Resolved(NamedTuple):
    end: _End
    folder: int  # the folder reached, for DIRECTORY
    hops: int  # symlinks followed, the link itself included; 0 only marks a cycle found


class _UnsafeLink(NamedTuple):
    ino: int
    parent: int
    name: str
    target: str
    end: _End


@dataclass
class _Walk:
    """Where the walk of one symlink's target stands."""

    link: int
    parts: list[str]
    folder: int
    step: int = 0
    hops: int = 1


class _LinkJudge:
    """Resolves the symlinks of a finished tree the way the Linux path walk would.

    A walk starts in the link's folder and takes the target one component at a time; every
    symlink met (in the middle or at the end) is followed, '..' moves to the folder's real
    parent and, at the mount root, out of the mount. Each link is resolved once, from a
    fresh start; its result and the number of links it followed are reused by every walk
    that meets it, so the work is one lookup per target component. Walks nest on an explicit
    stack of at most MAX_LINK_HOPS frames, never on Python's.

    A link is unsafe if its walk, in the tree before anything is dropped, leaves the mount at
    any moment or loops. Dropping a link only turns walks that meet it into ENOENT there; a
    walk that meets an unsafe link is itself unsafe, so every kept link walks exactly as
    judged and no second pass is needed.
    """

    def __init__(self, conn: sqlite3.Connection, parents: list[int]) -> None:
        self.conn = conn
        self.parents = parents  # folder inode -> its parent's inode
        self.results: dict[int, _Resolved] = {}

    def unsafe_links(self) -> list[_UnsafeLink]:
        unsafe = []
        rows = self.conn.execute(
            "SELECT ino, parent, name, link FROM nodes WHERE kind = ? ORDER BY ino",
            (int(MemberKind.SYMLINK),),
        ).fetchall()
        for ino, parent, name, target in rows:
            end = self.resolve(ino, parent, target).end
            if end not in _HARMLESS:
                unsafe.append(_UnsafeLink(ino, parent, name, target, end))
        return unsafe

    def resolve(self, link: int, folder: int, target: str) -> _Resolved:
        """What following symlink ``link`` (in ``folder``) from a fresh start comes to."""
        done = self.results.get(link)
        if done is not None:
            return done
        stack = collections.deque([_start(link, folder, target)])
        walking = {link}
        while stack:
            walk = stack[-1]
            outcome = self._advance(walk, walking)
            if isinstance(outcome, _Walk):  # a symlink met whose result is unknown: resolve it
                stack.append(outcome)
                walking.add(outcome.link)
                if len(stack) > MAX_LINK_HOPS:
                    # The bottom walk follows at least one link per walk above it: ELOOP.
                    # Those above are still resolved, each from its own fresh start.
                    bottom = stack.popleft()
                    walking.discard(bottom.link)
                    self.results[bottom.link] = _Resolved(_End.LOOPS, 0, MAX_LINK_HOPS + 1)
                continue
            if outcome.hops == 0:
                # A cycle: each walk on the stack waits for one that waits for itself.
                for waiting in stack:
                    self.results[waiting.link] = _Resolved(_End.LOOPS, 0, MAX_LINK_HOPS + 1)
                break
            stack.pop()
            walking.discard(walk.link)
            self.results[walk.link] = outcome
        return self.results[link]

    def _advance(self, walk: _Walk, walking: set[int]) -> _Resolved | _Walk:
        """Walk on to the end, or to a symlink that has to be resolved first."""
        parts = walk.parts
        if not parts:
            return _Resolved(_End.FAILS, 0, walk.hops)  # an empty target: ENOENT
        while True:
            part = parts[walk.step]
            if part == "/":
                return _Resolved(_End.ESCAPES, 0, walk.hops)
            if part == ".":
                end, folder = _End.DIRECTORY, walk.folder
            elif part == "..":
                if walk.folder == ROOT_INO:
                    return _Resolved(_End.ESCAPES, 0, walk.hops)
                end, folder = _End.DIRECTORY, self.parents[walk.folder]
            else:
                row = self.conn.execute(
                    "SELECT ino, kind, link FROM nodes WHERE parent = ? AND name = ?",
                    (walk.folder, part),
                ).fetchone()
                if row is None:
                    return _Resolved(_End.FAILS, 0, walk.hops)
                ino, kind, target = row
                if kind == MemberKind.DIRECTORY:
                    end, folder = _End.DIRECTORY, ino
                elif kind != MemberKind.SYMLINK:
                    end, folder = _End.OTHER, 0
                elif ino in walking:
                    return _Resolved(_End.LOOPS, 0, 0)
                else:
                    known = self.results.get(ino)
                    if known is None:
                        return _start(ino, walk.folder, target)
                    walk.hops += known.hops
                    if known.end not in _HARMLESS:
                        return _Resolved(known.end, 0, walk.hops)
                    if walk.hops > MAX_LINK_HOPS:
                        return _Resolved(_End.LOOPS, 0, walk.hops)
                    end, folder = known.end, known.folder
            if walk.step == len(parts) - 1:
                return _Resolved(end, folder, walk.hops)
            if end != _End.DIRECTORY:
                return _Resolved(_End.FAILS, 0, walk.hops)  # ENOTDIR, or ENOENT below
            walk.folder = folder
            walk.step += 1


def _start(link: int, folder: int, target: str) -> _Walk:
    """The walk of ``target`` from ``folder``; an absolute target is the single part '/'."""
    if target.startswith("/"):
        return _Walk(link, ["/"], folder)
    parts = [part for part in target.split("/") if part]
    if parts and target.endswith("/"):
        parts.append(".")  # 'name/' has to be a folder
    return _Walk(link, parts, folder)


def _build_raw(conn: sqlite3.Connection, tree: _TreeWriter, report: ViewReport) -> None:
    by_path: dict[str, tuple[int, int, int, int]] = {}
    current_shard = -1
    for shard, (path, offset, size, mode, mtime, kind, link, _label) in iter_member_rows(conn):
        if shard != current_shard:
            by_path.clear()  # hard links refer to earlier members of the same shard
            current_shard = shard
        if kind == MemberKind.DIRECTORY:
            tree.directory(path, mode, mtime)
        elif kind == MemberKind.FILE:
            by_path[path] = (offset, size, mode, mtime)
            tree.entry(path, MemberKind.FILE, shard, offset, size, mode, mtime)
        elif kind == MemberKind.HARDLINK:
            target = by_path.get(link)
            if target is None:
                report.dropped_links += 1
                report.note(f"hard link {path!r} -> {link!r}: target not in the same shard")
                continue
            t_offset, t_size, t_mode, t_mtime = target
            tree.entry(path, MemberKind.FILE, shard, t_offset, t_size, t_mode, t_mtime)
        elif kind == MemberKind.SYMLINK:
            tree.entry(path, MemberKind.SYMLINK, shard, 0, len(link.encode()), 0o777, mtime, link)


def _build_imagefolder(
    conn: sqlite3.Connection,
    tree: _TreeWriter,
    report: ViewReport,
    classes_for: Callable[[str], list[str] | None],
    *,
    strict: bool,
) -> bool:
    """Fill the tree and return True; or return False, having written nothing, when no
    member has a label, or when ``strict`` and an image has none (``auto`` then falls back
    to raw). Either way the report counts the labelled and unlabelled images, so that the
    choice can be explained."""
    max_label = conn.execute(
        "SELECT MAX(label) FROM members m JOIN shards s ON s.id = m.shard "
        "WHERE s.error IS NULL AND label IS NOT NULL"
    ).fetchone()[0]
    if max_label is None:
        return False
    width = len(str(max_label))
    shard_dirs = dict(conn.execute("SELECT id, name FROM shards"))

    def class_name(shard: int, label: int) -> str:
        folder = posixpath.dirname(shard_dirs[shard])
        names = classes_for(folder)
        if names is None:
            return f"{label:0{width}d}"
        if not 0 <= label < len(names):
            raise UsageError(
                f"{shard_dirs[shard]}: label {label} has no name in the classes list "
                f"({len(names)} names)"
            )
        return names[label]

    staged: list[tuple[int, str, int, int, int, int]] = []
    samples: dict[str, tuple[int | None, list[tuple[str, int, int, int, int]]]] = {}
    current_shard = -1

    def flush_shard() -> None:
        shard_name = shard_dirs[current_shard]
        folder = posixpath.dirname(shard_name)
        labeled_here = 0
        for key, (label, images) in samples.items():
            if label is None:
                member = key.removeprefix(f"{folder}/") if folder else key  # as in the tar
                example = f"{member}.{images[0][0]} in {shard_name}"
                report.unlabeled += len(images)
                report.note(f"image {example} has no label")
                if strict and not report.auto_example:
                    report.auto_example = example
                    staged.clear()  # nothing will be written: only count from here on
                continue
            labeled_here += len(images)
            name = class_name(current_shard, label)
            if strict and report.unlabeled:
                continue
            base = posixpath.basename(key)
            for ext, offset, size, mode, mtime in images:
                path = posixpath.join(folder, name, f"{base}.{ext}")
                staged.append((current_shard, path, offset, size, mode, mtime))
        report.labeled += labeled_here
        report.labeled_shards += labeled_here > 0
        samples.clear()

    for shard, (path, offset, size, mode, mtime, kind, _link, label) in iter_member_rows(conn):
        if shard != current_shard:
            if current_shard != -1:
                flush_shard()
            current_shard = shard
        if kind != MemberKind.FILE:
            continue
        key, ext = split_key(path)
        lower = ext.lower()
        if lower in IMAGE_EXTENSIONS:
            entry = samples.setdefault(key, (None, []))
            entry[1].append((ext, offset, size, mode, mtime))
        elif lower in LABEL_EXTENSIONS and label is not None:
            images = samples.get(key, (None, []))[1]
            samples[key] = (label, images)
        elif lower not in LABEL_EXTENSIONS:
            report.ignored += 1
    if current_shard != -1:
        flush_shard()
    if strict and (report.unlabeled or not report.labeled):
        return False
    for shard, path, offset, size, mode, mtime in staged:
        tree.entry(path, MemberKind.FILE, shard, offset, size, mode, mtime)
    return True


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
    tree = _TreeWriter(out, report, int(time.time()))
    layout = config.layout
    if layout in ("auto", "imagefolder"):
        lookup = classes_for
        if config.classes is not None:
            fixed = list(config.classes)

            def lookup(_folder: str) -> list[str] | None:
                return fixed

        if _build_imagefolder(index, tree, report, lookup, strict=layout == "auto"):
            layout = "imagefolder"
        elif layout == "auto":
            # Raw shows every image, so none is "left out": keep the count as the reason.
            report.auto_unlabeled, report.unlabeled = report.unlabeled, 0
            report.ignored = 0
            report.examples.clear()
            layout = "raw"
        else:
            raise UsageError("--layout imagefolder: no labelled samples (KEY.cls / KEY.json)")
    if layout == "raw":
        _build_raw(index, tree, report)
    report.layout = layout
    report.requested = config.layout
    tree.finish({sid: name for sid, name, _, _ in shards})
    out.execute("INSERT INTO meta VALUES ('layout', ?)", (layout,))
    out.execute("INSERT INTO meta VALUES ('report', ?)", (json.dumps(report.__dict__),))
    out.commit()


class Node(NamedTuple):
    """One entry of the presented tree (a tuple: listings build many of these)."""

    ino: int
    kind: MemberKind
    shard: int
    offset: int
    size: int
    mode: int
    mtime: int
    link: str

    @property
    def is_dir(self) -> bool:
        return self.kind == MemberKind.DIRECTORY

    @property
    def st_mode(self) -> int:
        return st_mode(self.kind, self.mode)


@lru_cache(maxsize=256)
def st_mode(kind: int, mode: int) -> int:
    """The mode ``stat`` shows for a member of ``kind`` stored with permission bits ``mode``:
    read-only for everyone (plus the member's own execute bits)."""
    if kind == MemberKind.DIRECTORY:
        return stat.S_IFDIR | 0o555
    if kind == MemberKind.SYMLINK:
        return stat.S_IFLNK | 0o777
    return stat.S_IFREG | (mode & 0o555 | 0o444)


_KINDS = {int(kind): kind for kind in MemberKind}
_NODE_COLUMNS = "ino, kind, shard, offset, size, mode, mtime, link"


def _node(row: tuple[int, int, int, int, int, int, int, str]) -> Node:
    ino, kind, shard, offset, size, mode, mtime, link = row
    return Node(ino, _KINDS[kind], shard, offset, size, mode, mtime, link)


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
        self.node = lru_cache(maxsize=1 << 16)(self._by_ino)

    def files_within(self, shard: int, start: int, end: int) -> list[Node]:
        """Non-empty regular files whose bytes lie wholly inside ``[start, end)`` of a shard."""
        rows = self._query(
            f"SELECT {_NODE_COLUMNS} FROM nodes WHERE shard = ? AND offset >= ? AND offset < ? "
            "AND kind = ? AND size > 0 AND offset + size <= ?",
            (shard, start, end, int(MemberKind.FILE), end),
        )
        return [_node(row) for row in rows]

    def child(self, parent: int, name: str) -> Node | None:
        """The entry ``name`` of the folder with inode ``parent``, or None."""
        return self._child(parent, name)

    def _query(self, sql: str, args: tuple[object, ...] = ()) -> list[Any]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def _by_ino(self, ino: int) -> Node:
        rows = self._query(f"SELECT {_NODE_COLUMNS} FROM nodes WHERE ino = ?", (ino,))
        found = rows[0] if rows else None
        if found is None:
            raise NotFoundError(f"inode {ino}")
        return _node(found)

    def _child_uncached(self, parent: int, name: str) -> Node | None:
        rows = self._query(
            f"SELECT {_NODE_COLUMNS} FROM nodes WHERE parent = ? AND name = ?", (parent, name)
        )
        return _node(rows[0]) if rows else None

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
            f"SELECT name, {_NODE_COLUMNS} FROM nodes WHERE parent = ? AND ino != ? ORDER BY name",
            (directory.ino, ROOT_INO),
        )
        for name, *row in rows:
            yield name, _node(tuple(row))

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
            f"SELECT parent, name, {_NODE_COLUMNS} FROM nodes WHERE kind = ? "
            "ORDER BY shard, offset",
            (int(MemberKind.FILE),),
        )
        for parent, name, *row in files:
            yield posixpath.join(folders[parent], name), _node(tuple(row))

    def close(self) -> None:
        with self._lock:
            self._db.close()

"""The tree a view build writes: presented entries are staged, de-duplicated (the later
shard and the later member win) and written with stable inodes, then unsafe symlinks are
dropped; ``ViewReport`` counts what the build found."""

from __future__ import annotations

import posixpath
import sqlite3
from dataclasses import dataclass, field

from ..formats.tar import MemberKind
from .nodes import ROOT_INO
from .symlinks import MAX_LINK_HOPS, End, LinkJudge

EXAMPLES_PER_KIND = 3


@dataclass
class ViewReport:
    """What building a view found: what the shards hold, what the tree presents, and what
    it leaves out, each kind counted with a few examples (``examples[kind]``, the kinds
    named in ``note``).

    The ``auto_*`` fields keep why ``auto`` chose raw, so that every mount can say so."""

    layout: str = "raw"  # the layout built
    requested: str = "raw"  # the layout asked for: auto, raw or imagefolder
    files: int = 0
    directories: int = 0
    bytes: int = 0
    images: int = 0  # image members the shards hold (KEY.jpg, KEY.v2.png, ...)
    images_presented: int = 0  # image files in the tree
    duplicates: int = 0  # entries not served because another has their path, all told:
    same_shard_duplicates: int = 0  # ... a later member of the same shard
    later_shard_duplicates: int = 0  # ... a copy in a later shard (the rest lost to a folder)
    labeled: int = 0  # images with a label (the imagefolder tree's files)
    labeled_shards: int = 0  # shards holding them
    unlabeled: int = 0  # images without a label, left out of an imagefolder tree
    unsplit: int = 0  # images whose name has no key (``.x.png``), left out of it too
    auto_unlabeled: int = 0  # images without a label that made auto choose raw
    auto_example: str = ""  # one of them: "PATH in SHARD"
    ignored: int = 0  # members neither image nor label, left out of an imagefolder tree
    dropped_links: int = 0
    examples: dict[str, list[str]] = field(default_factory=dict)

    def wants(self, kind: str) -> bool:
        """Whether ``note`` would keep another example of ``kind``."""
        return len(self.examples.get(kind, ())) < EXAMPLES_PER_KIND

    def note(self, kind: str, text: str) -> None:
        """Keep ``text`` as an example of ``kind``: same_shard, later_shard, folder,
        link, unlabelled, unsplit or other."""
        found = self.examples.setdefault(kind, [])
        if len(found) < EXAMPLES_PER_KIND:
            found.append(text)


class TreeWriter:
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
        # The folders by name, for the checks below: nodes has no name index yet (it is
        # built once, after the bulk insert), and a scan of it per entry is quadratic.
        conn.execute(
            "CREATE TEMP TABLE folders (parent INTEGER, name TEXT, PRIMARY KEY (parent, name)) "
            "WITHOUT ROWID"
        )
        conn.executemany(
            "INSERT INTO folders VALUES (?, ?)", ((p, n) for p, n, _, _ in self.dir_rows)
        )
        self._count_duplicates(shard_names)
        # The newest copy of each path wins; paths that are also directories lose to them.
        conn.execute(
            "INSERT INTO nodes (parent, name, kind, shard, offset, size, mode, mtime, link) "
            "SELECT s.parent, s.name, s.kind, s.shard, s.offset, s.size, s.mode, s.mtime, s.link "
            "FROM staged s WHERE s.seq = (SELECT MAX(t.seq) FROM staged t "
            "WHERE t.parent = s.parent AND t.name = s.name) "
            "AND NOT EXISTS (SELECT 1 FROM folders f WHERE f.parent = s.parent "
            "AND f.name = s.name) ORDER BY s.parent, s.name"
        )
        staged = conn.execute("SELECT COUNT(*) FROM staged").fetchone()[0]
        conn.execute("DROP TABLE staged")
        conn.execute("DROP TABLE folders")
        conn.execute("CREATE UNIQUE INDEX nodes_by_name ON nodes (parent, name)")
        winners = conn.execute(
            "SELECT COUNT(*) FROM nodes WHERE kind != ?", (int(MemberKind.DIRECTORY),)
        ).fetchone()[0]
        self._drop_unsafe_links()
        files, total = conn.execute(
            "SELECT COUNT(*), COALESCE(SUM(size), 0) FROM nodes WHERE kind != ?",
            (int(MemberKind.DIRECTORY),),
        ).fetchone()
        self.report.duplicates = staged - winners  # same shard + later shard + lost to a folder
        self.report.files = files
        self.report.bytes = total
        self.report.directories = len(self.dir_rows)
        conn.execute("CREATE INDEX nodes_by_place ON nodes (shard, offset)")

    def _count_duplicates(self, shard_names: dict[int, str]) -> None:
        """Count and name the staged entries that will lose to another of their path: to a
        later member of the same shard, or to a copy in a later shard (an entry that is
        also a folder loses to it: the rest of ``duplicates``)."""
        conn, report = self.conn, self.report
        is_folder = "EXISTS (SELECT 1 FROM folders f WHERE f.parent = d.parent AND f.name = d.name)"
        # One pass over the staged entries in name order; only paths staged twice are kept.
        conn.execute(
            "CREATE TEMP TABLE dups AS SELECT parent, name, COUNT(*) AS copies, "
            "MIN(shard) AS first, MAX(shard) AS last, COUNT(DISTINCT shard) AS shards "
            "FROM staged GROUP BY parent, name HAVING COUNT(*) > 1"
        )
        conn.execute(f"DELETE FROM dups AS d WHERE {is_folder}")
        rows = conn.execute(
            "SELECT parent, name, copies, first, last, shards, (SELECT COUNT(*) FROM staged t "
            "WHERE t.parent = d.parent AND t.name = d.name AND t.shard = d.last) FROM dups d"
        )
        name_of = shard_names.get
        for parent, name, copies, first, last, shards, in_last in rows:
            report.same_shard_duplicates += in_last - 1
            report.later_shard_duplicates += copies - in_last
            if in_last > 1 and report.wants("same_shard"):
                path = self._path_of(parent, name)
                report.note("same_shard", f"{path!r}: {in_last} copies in {name_of(last, '?')}")
            if shards > 1 and report.wants("later_shard"):
                if shards == 2:
                    where = f"{name_of(first, '?')} and {name_of(last, '?')}"
                else:
                    where = f"{shards} shards, {name_of(first, '?')} to {name_of(last, '?')}"
                report.note(
                    "later_shard",
                    f"{self._path_of(parent, name)!r}: {copies} copies in {where}; "
                    f"the one in {name_of(last, '?')} is served",
                )
        conn.execute("DROP TABLE dups")
        for parent, name, shard in conn.execute(
            "SELECT s.parent, s.name, s.shard FROM folders f JOIN staged s "
            "ON s.parent = f.parent AND s.name = f.name LIMIT ?",
            (EXAMPLES_PER_KIND,),
        ):
            path = self._path_of(parent, name)
            report.note("folder", f"file {path!r} in {name_of(shard, '?')} is also a folder")

    def _drop_unsafe_links(self) -> None:
        """Leave out every symlink of the finished tree that the kernel, following it, would
        walk out of the mount (or that loops): see :class:`LinkJudge`."""
        parents = [0] + [parent for parent, _, _, _ in self.dir_rows]
        judge = LinkJudge(self.conn, parents)
        dropped = judge.unsafe_links()
        if not dropped:
            return
        self.report.dropped_links += len(dropped)
        for link in dropped[:5]:
            why = (
                "leads outside the mount"
                if link.end == End.ESCAPES
                else f"loops or follows more than {MAX_LINK_HOPS} links"
            )
            path = self._path_of(link.parent, link.name)
            self.report.note("link", f"symlink {path!r} -> {link.target!r} {why}")
        self.conn.executemany("DELETE FROM nodes WHERE ino = ?", ((link.ino,) for link in dropped))

    def _path_of(self, parent: int, name: str) -> str:
        if len(self._folder_paths) != len(self.dirs):
            self._folder_paths = {ino: path for path, ino in self.dirs.items()}
        return posixpath.join(self._folder_paths.get(parent, "?"), name)

"""Opening a dataset: list the shards, bring the index up to date, open the view (used by
``mount``, ``warm`` and ``verify``).

The index and view files under the cache folder are derived data: a damaged one is deleted
and rebuilt, and when the cache disk is full (or read-only) they are built in a private
scratch folder in memory (``/dev/shm``, else ``$TMPDIR``) that goes away at unmount.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import errno
import logging
import os
import posixpath
import shutil
import sqlite3
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from .cache import BlockCache, BlockKey, remove_any
from .config import (
    IndexConfig,
    SourceConfig,
    ViewConfig,
)
from .errors import IndexFileError, UsageError
from .index.db import BlockSink, IndexBuilder, Progress, connect, fingerprint
from .read.seam import shard_key_of
from .stats import Stats
from .store.remote import Store
from .store.sets import open_store
from .store.shards import ShardInfo
from .views.view import CLASSES_FILE, View, ViewReport, build_view, parse_classes, view_key

log = logging.getLogger(__name__)


@dataclass
class OpenedSource:
    store: Store
    view: View
    index_path: Path
    scanned_shards: int
    scratch: Path | None = None  # where index and view went when the cache disk was full

    def close(self) -> None:
        self.view.close()
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)


# Disk-wide failures while writing the index or view: build them in scratch instead.
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO})
_SQLITE_FULL_CODES = frozenset({8, 10, 13})  # SQLITE_READONLY, SQLITE_IOERR, SQLITE_FULL
_SQLITE_DAMAGE_CODES = frozenset({11, 26})  # SQLITE_CORRUPT, SQLITE_NOTADB


def _disk_unwritable(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) says the cache disk takes no more writes."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in _FULL_ERRNOS:
            return True
        if isinstance(exc, sqlite3.Error):
            code = (getattr(exc, "sqlite_errorcode", 0) or 0) & 0xFF
            return code in _SQLITE_FULL_CODES
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return False


def _damaged(exc: sqlite3.Error) -> bool:
    return ((getattr(exc, "sqlite_errorcode", 0) or 0) & 0xFF) in _SQLITE_DAMAGE_CODES


def sqlite_file_damage(path: Path) -> str | None:
    """Why an index or view file cannot be used as it is (not a file, not SQLite, cut
    short), or None when it looks whole or is absent. Cheap: header and size only."""
    if not os.path.lexists(path):
        return None
    if path.is_symlink() or not path.is_file():
        return "not a regular file"
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()
            page_size = int(conn.execute("PRAGMA page_size").fetchone()[0])
            pages = int(conn.execute("PRAGMA page_count").fetchone()[0])
        finally:
            conn.close()
    except sqlite3.Error as exc:
        return str(exc) if _damaged(exc) else None
    size = path.stat().st_size
    if pages == 0 or page_size * pages > size:
        return f"cut short ({size} bytes, {page_size * pages} expected)"
    return None


def _discard_damaged(path: Path, what: str, warn: Callable[[str], None]) -> None:
    reason = sqlite_file_damage(path)
    if reason is not None:
        warn(f"{what} {path} was damaged ({reason}); rebuilding it")
        remove_any(path)


class _Scratch:
    """The private fallback folder for index and view, made on first need (one warning)."""

    def __init__(self, cache_dir: Path, warn: Callable[[str], None]) -> None:
        self.cache_dir = cache_dir
        self.warn = warn
        self.path: Path | None = None

    def get(self, exc: BaseException) -> Path:
        if self.path is None:
            shm = Path("/dev/shm")
            parent = shm if shm.is_dir() and os.access(shm, os.W_OK) else None
            self.path = Path(tempfile.mkdtemp(prefix="shardfs-", dir=parent))
            atexit.register(shutil.rmtree, self.path, True)
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            self.warn(
                f"cache folder {self.cache_dir} is full or read-only ({reason}); "
                f"index and view are kept in {self.path} until unmount"
            )
        return self.path


def _build_index(
    store: Store,
    shards: list[ShardInfo],
    config: IndexConfig,
    scratch: _Scratch,
    *,
    progress: Progress | None,
    sink: BlockSink | None,
    block_size: int,
    warn: Callable[[str], None],
) -> IndexBuilder:
    """An up-to-date index: in the cache folder, rebuilt if damaged, or in scratch when the
    cache disk cannot take it."""

    def build(settings: IndexConfig) -> IndexBuilder:
        builder = IndexBuilder(
            store, settings, progress=progress, block_sink=sink, block_size=block_size
        )
        _discard_damaged(builder.path, "index", warn)
        builder.build(shards)
        return builder

    try:
        return build(config)
    except (OSError, sqlite3.Error, IndexFileError) as exc:
        if not _disk_unwritable(exc):
            raise
        folder = scratch.get(exc)
    old = IndexBuilder(store, config).path
    settings = dataclasses.replace(config, cache_dir=folder)
    if os.path.isfile(old) and sqlite_file_damage(old) is None:
        (folder / "index").mkdir(exist_ok=True)
        with contextlib.suppress(OSError):  # unchanged shards are then copied, not rescanned
            shutil.copyfile(old, IndexBuilder(store, settings).path)
    return build(settings)


VIEW_NOTICE_AFTER = 1.0
"""Seconds a view build may run silently; after that a line says what is going on."""


@contextlib.contextmanager
def _say_if_slow(notice: Callable[[str], None], text: Callable[[], str]) -> Iterator[None]:
    """Say ``text()`` once the block has run for VIEW_NOTICE_AFTER seconds: a silent wait of
    seconds after the scan's progress bar looks like a hang. Nothing is said after the block."""
    done = threading.Event()

    def wait() -> None:
        if not done.wait(VIEW_NOTICE_AFTER):
            notice(text())

    thread = threading.Thread(target=wait, name="shardfs-view-notice", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _building_view_text(index_path: Path) -> str:
    try:
        conn = connect(index_path, readonly=True)
        try:
            members = conn.execute(
                "SELECT COUNT(*) FROM members m JOIN shards s ON s.id = m.shard "
                "WHERE s.error IS NULL"
            ).fetchone()[0]
        finally:
            conn.close()
    except sqlite3.Error:
        return "building the view (once; later mounts reuse it) ..."
    return f"building the view of {members:,} members (once; later mounts reuse it) ..."


def _open_view(
    index_path: Path,
    view_path: Path,
    config: ViewConfig,
    classes_for: Callable[[str], list[str] | None],
    scratch: _Scratch,
    warn: Callable[[str], None],
    notice: Callable[[str], None],
) -> View:
    """The materialised view: reused when whole, rebuilt when damaged, built in scratch when
    the cache disk cannot take it."""

    def build(out: Path) -> ViewReport:
        with _say_if_slow(notice, lambda: _building_view_text(index_path)):
            return build_view(index_path, out, config, classes_for)

    _discard_damaged(view_path, "view", warn)
    if not view_path.exists():
        try:
            report = build(view_path)
        except (OSError, sqlite3.Error) as exc:
            if not _disk_unwritable(exc):
                raise
            view_path = scratch.get(exc) / "views" / view_path.name
            report = build(view_path)
        for line in report_warnings(report):
            warn(line)
    try:
        return View(view_path)
    except sqlite3.DatabaseError as exc:
        if not _damaged(exc):
            raise
        warn(f"view {view_path} was damaged ({exc}); rebuilding it")
        remove_any(view_path)
        build(view_path)
        return View(view_path)


def report_warnings(report: ViewReport) -> list[str]:
    """Each kind of entry the view does not serve: a line with its count, then examples."""
    folder_losers = report.duplicates - report.same_shard_duplicates
    folder_losers -= report.later_shard_duplicates
    kinds = (
        (
            "same_shard",
            report.same_shard_duplicates,
            "duplicate path(s) within one shard; the later member is served",
        ),
        (
            "later_shard",
            report.later_shard_duplicates,
            "duplicate path(s) across shards; the copy in the later shard is served",
        ),
        ("folder", folder_losers, "file(s) with the path of a folder; the folder is served"),
        ("link", report.dropped_links, "link(s) left out (outside the mount, or a loop)"),
        ("unlabelled", report.unlabeled, "image(s) without a label left out"),
        (
            "unsplit",
            report.unsplit,
            "image(s) left out: no sample key in the name (it starts with a dot)",
        ),
        ("other", report.ignored, "member(s) neither image nor label left out"),
    )
    lines = []
    for kind, count, text in kinds:
        if count:
            lines.append(f"{count:,} {text}")
            lines += [f"  e.g. {example}" for example in report.examples.get(kind, [])]
    return lines


def images_line(report: ViewReport) -> str:
    """How many images the shards hold and how many the tree presents, with why the rest
    are not (for the mount's summary line); empty when the shards hold no image."""
    if not report.images:
        return ""
    presented = report.images_presented
    line = f"the shards hold {_count(report.images, 'image')}, {presented:,} presented"
    why = []
    if report.unlabeled:
        why.append(f"{report.unlabeled:,} without a label")
    if report.unsplit:
        why.append(f"{report.unsplit:,} without a sample key")
    lost = report.images - presented - report.unlabeled - report.unsplit
    if lost:  # lost to another entry of the same path
        why.append(f"{lost:,} under a duplicate path")
    return f"{line} ({', '.join(why)})" if why else line


def _count(number: int, noun: str) -> str:
    return f"{number:,} {noun}" + ("" if number == 1 else "s")


def layout_line(report: ViewReport) -> str | None:
    """Which layout ``auto`` chose and why, as one line; None for a layout asked for by name.

    Said at every mount (the reason is kept in the view), since a fallback to raw because
    of one unlabelled image among thousands is otherwise invisible."""
    if report.requested != "auto":
        return None
    if report.layout == "imagefolder":
        images = _count(report.labeled, "labelled image")
        return f"layout: imagefolder (auto: {images} in {_count(report.labeled_shards, 'shard')})"
    if report.auto_unlabeled:
        total = report.labeled + report.auto_unlabeled
        verb = "has" if report.auto_unlabeled == 1 else "have"
        ones = "one" if report.labeled == 1 else "ones"
        return (
            f"layout: raw (auto: {report.auto_unlabeled:,} of {_count(total, 'image')} "
            f"{verb} no label, e.g. {report.auto_example}; use --layout imagefolder to mount "
            f"the {report.labeled:,} labelled {ones})"
        )
    return "layout: raw (auto: no image has a label, a KEY.cls or KEY.json next to KEY.jpg)"


def open_source(
    source: SourceConfig,
    index_config: IndexConfig,
    view_config: ViewConfig,
    *,
    progress: Progress | None = None,
    warn: Callable[[str], None] = log.warning,
    notice: Callable[[str], None] = log.info,
    cache: BlockCache | None = None,
    stats: Stats | None = None,
) -> OpenedSource:
    """Everything up to a ready View: listing, index (scanning only what changed), view.

    ``warn`` gets problems, ``notice`` what the user should know even so: the layout
    ``auto`` chose and why, a view build that takes a while, and a server found during the
    scan to ignore Range (the store logs that warning itself, once).

    With a ``cache``, the bytes an index scan streams are kept as cache blocks, so reading
    the files afterwards downloads nothing again. ``stats`` counts what the store fetches,
    the scan included (``Store.stats``)."""
    store = open_store(source, stats)
    shards = store.list_shards()
    for warning in store.listing_warnings:
        warn(warning)
    sink = None
    if cache is not None:
        block_cache = cache

        def sink(shard: ShardInfo, index: int, block: bytes) -> None:
            key = shard_key_of(store, shard, block_cache.config.block_size)
            block_cache.offer(BlockKey(key, index), block)

    scratch = _Scratch(index_config.cache_dir, warn)
    try:
        view, index_path, scanned = _open_index_and_view(
            store, shards, index_config, view_config, scratch, progress, sink, cache, warn, notice
        )
    except BaseException:
        if scratch.path is not None:
            shutil.rmtree(scratch.path, ignore_errors=True)
        raise
    if store.range_warning is not None:
        notice(store.range_warning)  # on the terminal of a mount, not only in its log
    line = layout_line(view.report)
    if line is not None:
        notice(line)
    log.info(
        "view %s: %d files, %d folders, %d bytes in %d shards",
        view.layout,
        view.report.files,
        view.report.directories,
        view.report.bytes,
        len(view.shards),
    )
    return OpenedSource(store, view, index_path, scanned, scratch.path)


def _classes_files(store: Store, shards: list[ShardInfo]) -> dict[str, list[str]]:
    """The ``classes.txt`` next to the shards, by folder: in the root and in each shard
    folder, of each source. Sources whose files for one folder differ are refused: a label
    would then name two classes."""
    classes: dict[str, tuple[list[str], Store]] = {}
    for part, suffix in store.parts():
        mine = [s.name.removesuffix(suffix) for s in shards if s.name.endswith(suffix)]
        for folder in sorted({""} | {posixpath.dirname(n) for n in mine}):
            name = posixpath.join(folder, CLASSES_FILE)
            data = part.read_object(name)
            if data is None:
                continue
            try:
                names = parse_classes(data.decode("utf-8"), name)
            except UnicodeDecodeError as exc:
                raise UsageError(f"{name}: not UTF-8 text ({exc.reason})") from exc
            first, source = classes.setdefault(folder, (names, part))
            if first != names:
                raise UsageError(
                    f"{part.describe()}: its {name} differs from the one of "
                    f"{source.describe()}, so a label would name two classes; mount them "
                    "apart, or give --classes FILE"
                )
    return {folder: names for folder, (names, _) in classes.items()}


def _open_index_and_view(
    store: Store,
    shards: list[ShardInfo],
    index_config: IndexConfig,
    view_config: ViewConfig,
    scratch: _Scratch,
    progress: Progress | None,
    sink: BlockSink | None,
    cache: BlockCache | None,
    warn: Callable[[str], None],
    notice: Callable[[str], None],
) -> tuple[View, Path, int]:
    def index() -> IndexBuilder:
        return _build_index(
            store,
            shards,
            index_config,
            scratch,
            progress=progress,
            sink=sink,
            block_size=cache.config.block_size if cache is not None else 0,
            warn=warn,
        )

    builder = index()
    for bad in builder.bad_shards():
        warn(f"skipped bad shard {bad.name}: {bad.reason} at offset {bad.offset}")
    classes: dict[str, list[str]] = {}
    if view_config.layout != "raw" and view_config.classes is None:
        classes = _classes_files(store, shards)

    def classes_for(folder: str) -> list[str] | None:
        return classes.get(folder, classes.get(""))

    key = view_key(fingerprint(shards), view_config, classes)
    view_path = index_config.cache_dir / "views" / f"{store.identity}-{key}.sqlite"
    try:
        view = _open_view(builder.path, view_path, view_config, classes_for, scratch, warn, notice)
    except sqlite3.DatabaseError as exc:
        if not _damaged(exc):
            raise
        # The index passed its cheap check but is damaged inside: rebuild it, then the view.
        warn(f"index {builder.path} was damaged ({exc}); rebuilding it")
        remove_any(builder.path)
        builder = index()
        view = _open_view(builder.path, view_path, view_config, classes_for, scratch, warn, notice)
    return view, builder.path, builder.scanned_shards

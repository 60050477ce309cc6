"""Putting a mount together: list shards, bring the index up to date, open the view, serve.

``shardfs mount`` re-runs itself in the foreground as a detached child and waits on a pipe
until the child reports that the mount is ready (or why it failed), so the command exits 0
only once the tree is usable.

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
import signal
import sqlite3
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from .cache import BlockCache, BlockKey, remove_any
from .config import (
    CacheConfig,
    IndexConfig,
    MountConfig,
    ReadaheadConfig,
    ReadConfig,
    SourceConfig,
    ViewConfig,
)
from .control import ControlServer, lock_mountpoint, pid_file, process_running, socket_path
from .errors import FuseUnavailableError, IndexFileError, MountError, UsageError
from .index import BlockSink, IndexBuilder, Progress, connect, fingerprint
from .mounttable import find_mount, is_disconnected
from .readahead import Prefetcher
from .reader import CachedReader, DirectReader, RangeReader, shard_key_of
from .stats import Stats
from .store import ShardInfo, Store
from .views import CLASSES_FILE, View, ViewReport, build_view, parse_classes, view_key

log = logging.getLogger(__name__)

TABLE_AHEAD_FILES = 100_000
"""From this many files on, a mount builds its placement table once it is ready (about
2 s of one core for 1.28M files) instead of at the first sampler's read."""


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
    """One line per kind of problem the view found, for the user."""
    lines = []
    if report.duplicates:
        lines.append(
            f"{report.duplicates} duplicate path(s); the copy in the later shard is served"
        )
    if report.dropped_links:
        lines.append(f"{report.dropped_links} link(s) left out (outside the mount, or a loop)")
    if report.unlabeled:
        lines.append(f"{report.unlabeled} image(s) without a label left out")
    return lines + [f"  e.g. {example}" for example in report.examples] if lines else []


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
) -> OpenedSource:
    """Everything up to a ready View: listing, index (scanning only what changed), view.

    ``warn`` gets problems, ``notice`` what the user should know even so: the layout
    ``auto`` chose and why, and a view build that takes a while.

    With a ``cache``, the bytes an index scan streams are kept as cache blocks, so reading
    the files afterwards downloads nothing again."""
    store = Store(source)
    shards = store.list_shards()
    if store.version_warning:
        warn(store.version_warning)
    sink = None
    if cache is not None:
        block_cache = cache

        def sink(shard: ShardInfo, index: int, block: bytes) -> None:
            key = shard_key_of(store, shard, block_cache.config.block_size)
            block_cache.put(BlockKey(key, index), block)

    scratch = _Scratch(index_config.cache_dir, warn)
    try:
        view, index_path, scanned = _open_index_and_view(
            store, shards, index_config, view_config, scratch, progress, sink, cache, warn, notice
        )
    except BaseException:
        if scratch.path is not None:
            shutil.rmtree(scratch.path, ignore_errors=True)
        raise
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
        folders = sorted({""} | {posixpath.dirname(s.name) for s in shards})
        for folder in folders:
            name = posixpath.join(folder, CLASSES_FILE)
            data = store.read_object(name)
            if data is not None:
                try:
                    classes[folder] = parse_classes(data.decode("utf-8"), name)
                except UnicodeDecodeError as exc:
                    raise UsageError(f"{name}: not UTF-8 text ({exc.reason})") from exc

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


def check_mountpoint(
    mountpoint: Path, *, notice: Callable[[str], None] = log.warning, nonempty: bool = False
) -> None:
    """Refuse a mountpoint that is missing, not a folder, already mounted, or not empty
    (unless ``nonempty``).

    A dead shardfs mount left there (its daemon was killed) is removed first, and
    ``notice`` says so; a dead mount of another filesystem is not ours to remove."""
    entry = find_mount(mountpoint)
    if entry is not None:
        if not is_disconnected(entry.mountpoint):
            if entry.is_shardfs:
                raise MountError(f"{mountpoint}: already mounted (shardfs umount {mountpoint})")
            raise MountError(f"{mountpoint}: already mounted ({entry.fstype})")
        if not entry.is_shardfs:
            raise MountError(
                f"{mountpoint}: a dead {entry.fstype} mount is left here, not a shardfs one; "
                f"remove it with: fusermount3 -u {mountpoint}"
            )
        _unmount_command(entry.mountpoint, mountpoint, lazy=False)
        _forget_dead_daemon(mountpoint)
        notice(f"removed a dead shardfs mount at {mountpoint}")
    try:
        if not mountpoint.exists():
            raise MountError(f"{mountpoint}: mountpoint does not exist")
        if not mountpoint.is_dir():
            raise MountError(f"{mountpoint}: mountpoint is not a folder")
        if not nonempty and any(mountpoint.iterdir()):
            raise MountError(
                f"{mountpoint}: mountpoint is not empty (-o nonempty mounts over it, "
                "hiding what it holds)"
            )
    except OSError as exc:
        raise MountError(f"{mountpoint}: {exc.strerror}") from exc


def check_cache_dir(cache_dir: Path) -> None:
    """The cache folder must exist (or be creatable) and be writable."""
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=cache_dir, prefix=".probe-"):
            pass
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise UsageError(f"--cache-dir {cache_dir}: not writable ({reason})") from exc


_CAP_SYS_ADMIN = 21


def diagnose_fuse_failure(
    mountpoint: Path,
    *,
    allow_other: bool,
    device: Path = Path("/dev/fuse"),
    fuse_conf: Path = Path("/etc/fuse.conf"),
    fusermount: str | None = None,
    euid: int | None = None,
    status: Path = Path("/proc/self/status"),
) -> str | None:
    """Why this process cannot mount FUSE at ``mountpoint``, with the fix; None if no cause
    is seen. libfuse prints its reason only on stderr (the daemon's log), so its checks are
    repeated here, after a failed mount, to put the cause in the user's one line.

    ``fusermount`` is the helper an unprivileged mount runs (default: found as libfuse
    finds it); the other arguments let tests point the checks at files of their own."""
    user_id = os.geteuid() if euid is None else euid
    if not os.path.exists(device):
        return (
            f"{device} does not exist: load the fuse kernel module (sudo modprobe fuse), "
            "or in a container pass the device (--device /dev/fuse)"
        )
    try:
        os.close(os.open(device, os.O_RDWR | os.O_CLOEXEC))
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM):
            return _device_permission_cause(device, exc)
        return (
            f"{device} cannot be opened ({exc.strerror}): is the fuse kernel module loaded? "
            "(sudo modprobe fuse)"
        )
    if not _may_mount(status):
        return (
            "this process may not mount (CAP_SYS_ADMIN is not in its capability bounding "
            "set); in a container, add --cap-add SYS_ADMIN --device /dev/fuse"
        )
    if user_id == 0:
        return None
    helper = fusermount if fusermount is not None else _find_fusermount()
    if helper is None or not os.access(helper, os.X_OK):
        return (
            "fusermount3 is not installed or cannot be run (an unprivileged user mounts "
            "through it): "
            "install fuse3 (apt install fuse3, or dnf install fuse3)"
        )
    info = os.stat(helper)
    if info.st_uid != 0 or not info.st_mode & stat.S_ISUID:
        return (
            f"{helper} is not setuid root, so an unprivileged user cannot mount with it: "
            f"reinstall fuse3, or sudo chmod u+s {helper}"
        )
    if allow_other and not _user_allow_other(fuse_conf):
        return (
            f"allow_other needs the line user_allow_other in {fuse_conf} for users other "
            "than root: add it (as root), or mount without allow_other"
        )
    if not os.access(mountpoint, os.W_OK):
        return (
            f"this user has no write access to the mountpoint {mountpoint}, which "
            "fusermount3 requires: mount on a folder you own"
        )
    return None


def _device_permission_cause(device: Path, exc: OSError) -> str:
    import grp
    import pwd

    info = os.stat(device)
    owner = _name_of(pwd.getpwuid, info.st_uid)
    group = _name_of(grp.getgrgid, info.st_gid)
    mode = stat.filemode(info.st_mode)
    fixes = f"make it usable by all as most systems do (sudo chmod 0666 {device})"
    if info.st_gid != 0 and info.st_mode & 0o060 == 0o060:
        fixes = (
            f"add this user to the {group} group (sudo usermod -aG {group} $USER, then log in "
            f"again), or {fixes}"
        )
    found = f"{exc.strerror}; it is {mode} {owner}:{group}"
    return f"{device} cannot be opened by this user ({found}): {fixes}"


def _name_of(lookup: Callable[[int], Any], number: int) -> str:
    try:
        return str(lookup(number)[0])
    except KeyError:
        return str(number)


def _find_fusermount() -> str | None:
    """fusermount3 as libfuse runs it: its install folder first, then PATH."""
    for name in ("fusermount3", "fusermount"):
        for path in (f"/usr/bin/{name}", f"/bin/{name}", shutil.which(name)):
            if path and os.path.isfile(path):
                return path
    return None


def _may_mount(status: Path) -> bool:
    """False when CAP_SYS_ADMIN is outside the bounding set: neither this process nor a
    setuid fusermount3 it runs can mount then. True when it cannot be told."""
    try:
        for line in status.read_text().splitlines():
            if line.startswith("CapBnd:"):
                return bool(int(line.split()[1], 16) >> _CAP_SYS_ADMIN & 1)
    except (OSError, ValueError, IndexError):
        pass
    return True


def _user_allow_other(fuse_conf: Path) -> bool:
    try:
        lines = fuse_conf.read_text().splitlines()
    except OSError:
        return False
    return any(line.split("#", 1)[0].strip() == "user_allow_other" for line in lines)


class ReadyChannel:
    """The child's side of the pipe: progress, warnings, then ``ready`` or ``error``."""

    def __init__(self, fd: int | None) -> None:
        self._file = os.fdopen(fd, "w", buffering=1) if fd is not None else None

    @property
    def attached(self) -> bool:
        return self._file is not None

    def send(self, kind: str, text: str = "") -> None:
        if self._file is None:
            return
        try:
            self._file.write(f"{kind} {text}".rstrip().replace("\n", " ") + "\n")
            if kind in ("ready", "error"):
                self._file.close()
                self._file = None
        except OSError:
            self._file = None  # the parent went away; carry on


def _warn_both(channel: ReadyChannel, text: str) -> None:
    log.warning("%s", text)
    channel.send("warn", text)


def _note_both(channel: ReadyChannel, text: str) -> None:
    log.info("%s", text)
    channel.send("note", text)


def run_foreground(
    source: SourceConfig,
    index_config: IndexConfig,
    view_config: ViewConfig,
    mount_config: MountConfig,
    read_config: ReadConfig,
    cache_config: CacheConfig,
    readahead_config: ReadaheadConfig,
    channel: ReadyChannel,
    progress: Progress | None,
) -> None:
    """Build everything, mount, and serve until unmounted."""
    from .fuse import session  # imported late: loading libfuse is only needed to serve

    # Held until this process exits (the descriptor is never closed): a second mount of
    # this mountpoint fails at once while this one scans or serves.
    lock_mountpoint(mount_config.mountpoint)
    check_mountpoint(mount_config.mountpoint, nonempty=mount_config.nonempty)
    check_cache_dir(index_config.cache_dir)
    stats = Stats()
    cache = BlockCache(cache_config, stats) if cache_config.enabled else None
    try:
        opened = open_source(
            source,
            index_config,
            view_config,
            progress=progress,
            warn=lambda text: _warn_both(channel, text),
            notice=lambda text: _note_both(channel, text),
            cache=cache,
        )
    except BaseException:
        if cache is not None:
            cache.close()
        raise
    from .filesystem import Owner, ShardFileSystem

    reader: RangeReader
    prefetcher = None
    if cache is not None:
        if readahead_config.prefetch != "none":
            prefetcher = Prefetcher(readahead_config.streams)
        reader = cached = CachedReader(
            opened.store,
            cache,
            stats,
            retries=read_config.retries,
            prefetcher=prefetcher,
            split_misses=readahead_config.miss_fetch == "range",
            dataset_bytes=sum(shard.size for shard in opened.view.shards.values()),
        )
    else:
        reader = DirectReader(opened.store, stats, retries=read_config.retries)
    core = ShardFileSystem(
        opened.view,
        reader,
        read_config,
        stats,
        owner=Owner.of(mount_config),
    )
    pid_path = pid_file(mount_config.mountpoint)

    def snapshot() -> dict[str, Any]:
        values = stats.snapshot()
        values.update(
            source=source.url,
            mountpoint=str(mount_config.mountpoint),
            layout=opened.view.layout,
            files=opened.view.report.files,
            dataset_bytes=opened.view.report.bytes,
            cache_enabled=cache is not None,
            cache_dir=str(cache_config.cache_dir),
            block_size=cache_config.block_size,
            cache_bytes_used=cache.usage() if cache else 0,
            cache_bytes_limit=cache.limit() if cache else 0,
        )
        return values

    control = ControlServer(mount_config.mountpoint, snapshot)

    served = threading.Event()

    background: list[threading.Thread] = []  # joined before anything they use is closed

    def in_background(name: str, work: Callable[[], object]) -> None:
        def run() -> None:
            try:
                work()
            except Exception:
                log.exception("%s failed", name)

        thread = threading.Thread(target=run, name=name, daemon=True)
        background.append(thread)
        thread.start()

    def on_ready() -> None:
        pid_path.write_text(str(os.getpid()))
        log.info("mounted %s at %s", source.url, mount_config.mountpoint)
        channel.send("ready", f"{opened.view.report.files} {opened.view.layout}")
        if prefetcher is not None and readahead_config.prefetch == "all":
            shards = list(opened.view.shards.values())
            in_background("shardfs-prefetch-all", lambda: [cached.read_ahead(s) for s in shards])
        if opened.view.report.files >= TABLE_AHEAD_FILES:
            # A sampler's first read of the placement table finds it built (1.28M files
            # take seconds), while ImageFolder still scans the tree.
            in_background("shardfs-table", core.table)
        served.set()

    try:
        # With the block cache, reads are cheap enough to serve without open handles.
        session.serve(core, mount_config, on_ready, keep_handles=cache is None)
    except RuntimeError as exc:  # the mount itself failed (a stopped loop returns normally)
        if not served.is_set():
            mountpoint = mount_config.mountpoint
            cause = diagnose_fuse_failure(mountpoint, allow_other=mount_config.allow_other)
            if cause is not None:
                raise FuseUnavailableError(f"{mountpoint}: cannot mount: {cause}") from exc
            raise MountError(f"{mountpoint}: FUSE mount failed ({exc})") from exc
        raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            pid_path.unlink()
        control.close()
        for thread in background:
            thread.join()
        if prefetcher is not None:
            prefetcher.close()
        if cache is not None:
            cache.close()
        opened.close()
    log.info("unmounted %s", mount_config.mountpoint)


def log_file_for(cache_dir: Path, chosen: Path | None) -> Path:
    """Where a backgrounded mount's daemon logs: ``chosen`` (``--log-file``), else a new
    file in ``CACHE_DIR/logs``, named by the daemon's pid once it runs (see spawn_daemon)."""
    if chosen is not None:
        return chosen.absolute()
    return cache_dir / "logs" / f"mount-starting-{os.getpid()}.log"


def _prune_logs(folder: Path, keep: int) -> None:
    """Keep the newest ``keep`` mount logs, and every log of a daemon still running."""
    logs = []
    for path in folder.glob("mount-*.log"):
        pid = path.stem.removeprefix("mount-")
        if pid.isdigit() and process_running(int(pid)):
            continue
        with contextlib.suppress(OSError):
            logs.append((path.stat().st_mtime, path))
    logs.sort(reverse=True)
    for _, path in logs[keep:]:
        with contextlib.suppress(OSError):
            path.unlink()


class _Stopped(Exception):
    """The waiting parent got SIGINT or SIGTERM."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


_PARENT_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_DAEMON_STOP_GRACE = 10.0  # seconds a stopped daemon gets to unmount before SIGKILL


def spawn_daemon(
    argv: Sequence[str],
    mountpoint: Path,
    log_path: Path,
    show_progress: bool,
    *,
    verbose: bool = False,
) -> tuple[int, str]:
    """Start ``shardfs mount --foreground`` detached and wait until it is ready or fails.

    Returns (exit code, summary line). SIGINT or SIGTERM while waiting stops the daemon
    and removes whatever it mounted, so nothing is left behind. With ``verbose``, a daemon
    that fails shows its traceback here (from its log)."""
    from .config import LOGS_KEPT

    read_fd, write_fd = os.pipe()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    named_by_pid = log_path.name.startswith("mount-starting-")
    if named_by_pid:
        _prune_logs(log_path.parent, LOGS_KEPT - 1)
    previous = {number: signal.getsignal(number) for number in _PARENT_STOP_SIGNALS}

    pending: list[int] = []
    child: subprocess.Popen[bytes] | None = None

    def on_signal(signum: int, _frame: object) -> None:
        if child is None:  # inside Popen: stop once the child can be named
            pending.append(signum)
            return
        raise _Stopped(signum)

    bar: Any = None
    try:
        for number in _PARENT_STOP_SIGNALS:
            signal.signal(number, on_signal)
        with open(log_path, "ab") as log_file:
            log_start = log_file.tell()
            child = subprocess.Popen(
                [sys.executable, "-m", "shardfs", *argv, "--foreground", "--ready-fd",
                 str(write_fd)],
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=log_file,
                pass_fds=(write_fd,),
                start_new_session=True,
            )  # fmt: skip
        if pending:
            raise _Stopped(pending[0])
        if named_by_pid:
            named = log_path.with_name(f"mount-{child.pid}.log")
            os.replace(log_path, named)  # the daemon keeps writing to the same file
            log_path = named
        os.close(write_fd)
        write_fd = -1
        with os.fdopen(read_fd, "r") as pipe:
            read_fd = -1
            for line in pipe:
                kind, _, text = line.rstrip("\n").partition(" ")
                if kind == "progress" and show_progress:
                    bar = update_progress_bar(bar, text)
                elif kind == "warn":
                    _print_line(bar, f"shardfs: warning: {text}")
                elif kind == "note":
                    _print_line(bar, f"shardfs: {text}")
                elif kind == "ready":
                    return 0, text
                elif kind == "error":
                    code, _, message = text.partition(" ")
                    if verbose:
                        _show_daemon_traceback(child, log_path, log_start)
                    return int(code), message
        status = child.wait()
        if verbose:
            _show_daemon_traceback(child, log_path, log_start)
        return 1, (
            f"the mount daemon exited with status {status} before it was ready; see {log_path}"
        )
    except _Stopped as stopped:
        if bar is not None:
            bar.close()
            bar = None
        if child is not None:
            _stop_daemon(child, mountpoint)
        name = signal.Signals(stopped.signum).name
        return 128 + stopped.signum, (
            f"interrupted ({name}) before the mount was ready; stopped the mount daemon, "
            "nothing is mounted"
        )
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        for fd in (read_fd, write_fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        if bar is not None:
            bar.close()


def _stop_daemon(child: subprocess.Popen[bytes], mountpoint: Path) -> None:
    """End a daemon that is not ready yet, and any mount it made meanwhile.

    SIGTERM first: before it mounts, that ends it at once; once mounting, its handler
    unmounts and exits. SIGKILL if it does not end in time, then the mount is removed."""
    with contextlib.suppress(ProcessLookupError):
        child.send_signal(signal.SIGTERM)
    try:
        child.wait(_DAEMON_STOP_GRACE)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
    if find_mount(mountpoint) is not None:
        with contextlib.suppress(MountError):
            _unmount_command(str(mountpoint), mountpoint, lazy=True)
        _forget_dead_daemon(mountpoint)


def _show_daemon_traceback(child: subprocess.Popen[bytes], log_path: Path, start: int) -> None:
    """Print the failed daemon's traceback from its log (what it wrote from byte ``start``
    on), and where the log is."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.wait(10)  # the daemon prints its traceback after it reported the error
    try:
        with open(log_path, "rb") as log_file:
            log_file.seek(start)
            text = log_file.read().decode("utf-8", "replace")
    except OSError:
        text = ""
    start = text.find("Traceback (most recent call last)")
    if start >= 0:
        end = text.find("\nshardfs: error:", start)
        sys.stderr.write(text[start : end + 1 if end >= 0 else len(text)])
    print(f"shardfs: the daemon's log is {log_path}", file=sys.stderr)


def _print_line(bar: Any, text: str) -> None:
    """A line on stderr, above the progress bar if one is shown."""
    if bar is not None:
        bar.write(text, file=sys.stderr)
    else:
        print(text, file=sys.stderr)


def update_progress_bar(bar: object | None, text: str) -> object:
    from tqdm import tqdm

    done, total, done_bytes, total_bytes = (int(x) for x in text.split())
    if bar is None:
        bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="indexing shards")
    assert isinstance(bar, tqdm)
    bar.update(done_bytes - bar.n)
    bar.set_postfix_str(f"{done}/{total} shards")
    return bar


Unmounted = Literal["live", "dead", "detached"]


def unmount(mountpoint: Path, *, lazy: bool = False, timeout: float = 30.0) -> Unmounted:
    """Unmount a shardfs mount, live or left dead by a killed daemon.

    A live mount is unmounted and its daemon waited for ("live"). A dead one is only
    removed from the mount table ("dead"). ``lazy`` detaches the mount even while a
    process still uses it; its daemon then exits once the last user lets go ("detached")."""
    entry = find_mount(mountpoint)
    if entry is None:
        raise MountError(f"{mountpoint}: not mounted")
    if not entry.is_shardfs:
        raise MountError(
            f"{mountpoint}: a {entry.fstype} mount, not a shardfs one; "
            f"unmount it with fusermount3 -u or umount"
        )
    dead = is_disconnected(entry.mountpoint)
    pid = None if dead else _daemon_pid(mountpoint)
    _unmount_command(entry.mountpoint, mountpoint, lazy=lazy)
    if dead:
        _forget_dead_daemon(mountpoint)
        return "dead"
    if lazy:
        return "detached"
    deadline = time.monotonic() + timeout
    while pid is not None and time.monotonic() < deadline:
        if not process_running(pid):
            break
        time.sleep(0.05)
    else:
        if pid is not None:
            raise MountError(f"{mountpoint}: unmounted, but daemon pid {pid} is still running")
    return "live"


def _daemon_pid(mountpoint: Path) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return int(pid_file(mountpoint).read_text())
    return None


def _forget_dead_daemon(mountpoint: Path) -> None:
    """Drop the pid file and socket a killed daemon left, so nothing later waits on that
    pid or asks that socket."""
    pid = _daemon_pid(mountpoint)
    if pid is not None and not process_running(pid):
        for path in (pid_file(mountpoint), socket_path(mountpoint)):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def _unmount_command(table_path: str, mountpoint: Path, *, lazy: bool) -> None:
    """fusermount3 -u (what an unprivileged user may run), or umount without it."""
    tool = shutil.which("fusermount3") or shutil.which("fusermount")
    if tool:
        command = [tool, "-u", *(["-z"] if lazy else []), table_path]
    else:
        command = ["umount", *(["-l"] if lazy else []), table_path]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode == 0:
        return
    message = (result.stderr or result.stdout).strip().splitlines()
    detail = message[-1] if message else f"exit status {result.returncode}"
    if "busy" in detail.lower():
        raise MountError(
            f"{mountpoint}: busy (a process has a file open or its working folder inside); "
            f"stop it and retry, or detach now with: shardfs umount --lazy {mountpoint}"
        )
    raise MountError(f"{mountpoint}: unmount failed ({detail})")

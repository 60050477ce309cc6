"""Putting a mount together: ``Mount`` builds every part of one mount, each given its
collaborators in its constructor, and starts and stops them in one documented order.
``run_foreground`` is the daemon's body: lock and check the mountpoint, then serve a Mount.
Opening the dataset is ``shardfs.dataset``; being a daemon is ``shardfs.mount.daemon``."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..cache import BlockCache
from ..config import (
    CacheConfig,
    IndexConfig,
    MountConfig,
    ReadaheadConfig,
    ReadConfig,
    SourceConfig,
    ViewConfig,
)
from ..core.filesystem import Owner, ShardFileSystem
from ..dataset import OpenedSource, images_line, open_source
from ..errors import FuseUnavailableError, MountError
from ..fuse.session import FuseSession
from ..index.db import Progress
from ..read.direct import DirectReader
from ..read.readahead import Prefetcher
from ..read.reader import CachedReader
from ..read.seam import RangeReader
from ..stats import Stats
from . import allocator, process_limits, thread_names
from .control import ControlServer, lock_mountpoint, pid_file, remove_created_mountpoint
from .daemon import ReadyChannel, note_both, warn_both
from .mountpoints import (
    check_cache_dir,
    check_mountpoint,
    diagnose_fuse_failure,
    make_mountpoint,
)
from .watchdog import start_watchdog

log = logging.getLogger(__name__)

FILLS_GRACE = 30.0
"""Seconds ``stop`` waits for background fetches after the prefetcher is closed."""

STOP_ORDER = ("session", "control", "background", "prefetcher", "cache", "dataset")
"""The parts ``Mount.stop`` takes down, in this order (see ``Mount``)."""


@dataclass(frozen=True)
class MountSettings:
    """Every configuration one mount is built from (the CLI makes them)."""

    source: SourceConfig
    index: IndexConfig
    view: ViewConfig
    mount: MountConfig
    read: ReadConfig
    cache: CacheConfig
    readahead: ReadaheadConfig


class Mount:
    """The parts of one mount, and the one order in which they start and stop.

    Start (``start``), each part built from the ones before it:

    1. block cache (the index scan streams the blocks it reads into it);
    2. dataset: store, index and view (``dataset.open_source``);
    3. prefetcher and reader (over the cache and the store);
    4. filesystem core (over the view and the reader);
    5. control socket (answers ``shardfs stats``);
    6. FUSE session: mount, kernel pusher, request loop. When the kernel's init arrives:
       pid file, ``ready`` to the waiting parent, the ``--prefetch all`` thread.

    Stop (``stop``), the same parts in the reverse order, with the cache before the store
    (once open, the dataset no longer uses the cache):

    1. FUSE session: kernel pusher (a push can wait on a read, so reads are still
       answered), request loop, read workers, then unmount;
    2. pid file and control socket;
    3. background threads: the ``--prefetch all`` thread stops between shards and is joined;
    4. prefetcher: queued readahead is dropped and the fills are waited for, as they hold
       block claims and open block files;
    5. block cache: its open files and every thread's ledger connection;
    6. dataset: the view's database and the scratch folder; the store holds nothing open.

    ``stop`` is idempotent, and after a failed ``start`` it closes exactly the parts built.
    """

    def __init__(
        self,
        settings: MountSettings,
        stats: Stats,
        channel: ReadyChannel,
        progress: Progress | None,
    ) -> None:
        self.settings = settings
        self.stats = stats
        self.channel = channel
        self.progress = progress
        self.cache: BlockCache | None = None
        self.dataset: OpenedSource | None = None
        self.prefetcher: Prefetcher | None = None
        self.reader: RangeReader | None = None
        self.core: ShardFileSystem | None = None
        self.control: ControlServer | None = None
        self.session: FuseSession | None = None
        self._background: list[threading.Thread] = []
        self._stopping = threading.Event()  # background threads end at their next step
        self._stopped = False
        self._fills_running = False  # a fill outlived the prefetcher's close

    # -- start ------------------------------------------------------------------------

    def start(self) -> None:
        """Build and start every part in order; on any failure, stop what was built."""
        try:
            self.cache = self._open_cache()
            self.dataset = self._open_dataset()
            self.reader = self._build_reader(self.dataset)
            self.core = ShardFileSystem(
                self.dataset.view,
                self.reader,
                self.settings.read,
                self.stats,
                owner=Owner.of(self.settings.mount),
            )
            self.control = ControlServer(self.settings.mount.mountpoint, self.snapshot)
            # With the block cache, reads are cheap enough to serve without open handles.
            self.session = FuseSession(
                self.core, self.settings.mount, self._on_ready, keep_handles=self.cache is None
            )
            self._mount(self.session)
        except BaseException:
            self.stop()
            raise

    def serve(self) -> None:
        """Start, serve until unmounted or signalled, then stop."""
        allocator.tune()  # before the mount's threads start
        try:
            self.start()
            assert self.session is not None
            self.session.wait()
        finally:
            self.stop()

    def _open_cache(self) -> BlockCache | None:
        config = self.settings.cache
        return BlockCache(config, self.stats) if config.enabled else None

    def _open_dataset(self) -> OpenedSource:
        return open_source(
            self.settings.source,
            self.settings.index,
            self.settings.view,
            progress=self.progress,
            warn=lambda text: warn_both(self.channel, text),
            notice=lambda text: note_both(self.channel, text),
            cache=self.cache,
            stats=self.stats,
        )

    def _build_reader(self, dataset: OpenedSource) -> RangeReader:
        """The reader over the store: through the block cache (with the prefetcher, kept
        in ``self.prefetcher``) when there is one, else straight from the store."""
        read = self.settings.read
        if self.cache is None:
            return DirectReader(dataset.store, self.stats, retries=read.retries)
        readahead = self.settings.readahead
        if readahead.prefetch != "none":
            self.prefetcher = Prefetcher(readahead.streams)
            self.cache.prefill_landing(self.settings.cache.block_size, readahead.streams)
        return CachedReader(
            dataset.store,
            self.cache,
            self.stats,
            retries=read.retries,
            prefetcher=self.prefetcher,
            split_misses=readahead.miss_fetch == "range",
            dataset_bytes=sum(shard.size for shard in dataset.view.shards.values()),
        )

    def _mount(self, session: FuseSession) -> None:
        """Start the session; a mount that fails says why, as one line."""
        try:
            session.start()
        except RuntimeError as exc:
            mountpoint = self.settings.mount.mountpoint
            allow_other = self.settings.mount.allow_other
            cause = diagnose_fuse_failure(mountpoint, allow_other=allow_other)
            if cause is not None:
                raise FuseUnavailableError(f"{mountpoint}: cannot mount: {cause}") from exc
            raise MountError(f"{mountpoint}: FUSE mount failed ({exc})") from exc

    def _on_ready(self) -> None:
        """The kernel's init arrived (on the FUSE loop's thread): the mount is usable."""
        assert self.dataset is not None
        mountpoint = self.settings.mount.mountpoint
        pid_file(mountpoint).write_text(str(os.getpid()))
        start_watchdog(os.getpid(), os.path.abspath(mountpoint))
        log.info("mounted %s at %s", self.settings.source.describe(), mountpoint)
        view = self.dataset.view
        self.channel.send("ready", f"{view.report.files} {view.layout} {images_line(view.report)}")
        if isinstance(self.reader, CachedReader) and self.settings.readahead.prefetch == "all":
            reader, shards = self.reader, list(view.shards.values())

            def prefetch_all() -> None:
                for shard in shards:
                    if self._stopping.is_set():
                        return
                    reader.read_ahead(shard)

            self._in_background("shardfs-prefetch-all", prefetch_all)

    def _in_background(self, name: str, work: Callable[[], object]) -> None:
        """Run ``work`` on a thread that ``stop`` joins (it should watch ``_stopping``)."""

        def run() -> None:
            try:
                work()
            except Exception:
                log.exception("%s failed", name)

        thread = threading.Thread(target=run, name=name, daemon=True)
        self._background.append(thread)
        thread.start()

    def snapshot(self) -> dict[str, Any]:
        """What ``shardfs stats`` shows: the counters plus what this mount is."""
        assert self.dataset is not None
        cache, config, view = self.cache, self.settings.cache, self.dataset.view
        values = self.stats.snapshot()
        values.update(
            source=self.settings.source.describe(),
            mountpoint=str(self.settings.mount.mountpoint),
            layout=view.layout,
            files=view.report.files,
            dataset_bytes=view.report.bytes,
            cache_enabled=cache is not None,
            cache_dir=str(config.cache_dir),
            block_size=config.block_size,
            cache_bytes_used=cache.usage() if cache else 0,
            cache_bytes_limit=cache.limit() if cache else 0,
        )
        return values

    # -- stop -------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop every part that was built, in ``STOP_ORDER``, each once (see the class).

        A part that fails to stop is logged and the others still stop; the first such
        error is raised at the end."""
        self._stopping.set()
        if self._stopped:
            return
        self._stopped = True
        steps = {
            "session": self._stop_session,
            "control": self._stop_control,
            "background": self._stop_background,
            "prefetcher": self._stop_prefetcher,
            "cache": self._stop_cache,
            "dataset": self._stop_dataset,
        }
        failures: list[Exception] = []
        for name in STOP_ORDER:
            try:
                steps[name]()
            except Exception as exc:
                log.exception("stopping the %s failed", name)
                failures.append(exc)
        if failures:
            raise failures[0]

    def _stop_session(self) -> None:
        if self.session is not None:
            self.session.stop()

    def _stop_control(self) -> None:
        if self.session is not None:  # only a session writes the pid file
            with contextlib.suppress(FileNotFoundError):
                pid_file(self.settings.mount.mountpoint).unlink()
        if self.control is not None:
            self.control.close()

    def _stop_background(self) -> None:
        for thread in self._background:
            thread.join()

    def _stop_prefetcher(self) -> None:
        if self.prefetcher is None:
            return
        self.prefetcher.close(FILLS_GRACE)
        if not self.prefetcher.wait_idle(FILLS_GRACE):
            # A fill still runs and uses the cache's files: leave them to the process's exit
            # rather than close them under it.
            log.warning("background fetches still running after %.0f s", FILLS_GRACE)
            self._fills_running = True

    def _stop_cache(self) -> None:
        if self.cache is not None and not self._fills_running:
            self.cache.close()

    def _stop_dataset(self) -> None:
        if self.dataset is not None:
            self.dataset.close()


def run_foreground(
    settings: MountSettings, channel: ReadyChannel, progress: Progress | None
) -> None:
    """Be the daemon: take the mountpoint, check it (making it when missing), and serve a
    Mount until unmounted; a mountpoint that shardfs made is removed as the daemon ends."""
    mountpoint = settings.mount.mountpoint
    thread_names.install()
    process_limits.raise_open_files()
    # Held until this process exits (the descriptor is never closed): a second mount of
    # this mountpoint fails at once while this one scans or serves.
    lock_mountpoint(mountpoint)
    check_mountpoint(mountpoint, nonempty=settings.mount.nonempty)
    if make_mountpoint(mountpoint):  # the waiting parent says so once the mount is ready
        log.info("created mountpoint %s (removed at unmount)", mountpoint)
    try:
        check_cache_dir(settings.index.cache_dir)
        Mount(settings, Stats(), channel, progress).serve()
    finally:
        # Made by this mount or by one killed before it could remove it: this mount's
        # end, failed or not, is where it goes.
        remove_created_mountpoint(mountpoint, by_its_daemon=True)
    log.info("unmounted %s", mountpoint)

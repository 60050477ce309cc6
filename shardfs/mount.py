"""Putting a mount together: open the dataset, build the reader and the filesystem core,
serve until unmounted, then stop everything in order (the session first, then background
threads, the prefetcher, the cache and the store)."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from .cache import BlockCache
from .config import (
    CacheConfig,
    IndexConfig,
    MountConfig,
    ReadaheadConfig,
    ReadConfig,
    SourceConfig,
    ViewConfig,
)
from .control import ControlServer, lock_mountpoint, pid_file
from .daemon import ReadyChannel, note_both, warn_both
from .dataset import open_source
from .errors import FuseUnavailableError, MountError
from .index import Progress
from .mountpoints import check_cache_dir, check_mountpoint, diagnose_fuse_failure
from .readahead import Prefetcher
from .reader import CachedReader, DirectReader, RangeReader
from .stats import Stats

log = logging.getLogger(__name__)


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
            warn=lambda text: warn_both(channel, text),
            notice=lambda text: note_both(channel, text),
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

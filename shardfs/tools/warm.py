"""``shardfs warm``: stream a whole dataset into the block cache with concurrent GETs."""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..cache import BlockCache, BlockKey
from ..config import (
    CacheConfig,
    IndexConfig,
    ReadaheadConfig,
    SourceConfig,
    ViewConfig,
    format_bytes,
    plural,
)
from ..dataset import open_source
from ..read.readahead import Prefetcher
from ..read.reader import CachedReader
from ..stats import Stats
from .progress import new_bar, scan_progress


@dataclass
class WarmReport:
    shards: int
    blocks: int
    cached_before: int
    cached_after: int
    bytes_fetched: int  # everything fetched from the store, the index scan's part included
    seconds: float  # the index scan included
    scan_bytes: int = 0  # what the index scan fetched (its blocks are kept too)

    def summary(self) -> str:
        rate = self.bytes_fetched / max(self.seconds, 1e-9) / 1e6
        missing = self.blocks - self.cached_after
        tail = f"; {missing} did not fit in the cache bound" if missing else ""
        scan = f"; {format_bytes(self.scan_bytes)} by the index scan" if self.scan_bytes else ""
        return (
            f"warmed {plural(self.shards, 'shard')}: {self.cached_after}/{self.blocks} blocks "
            f"cached ({self.cached_before} were already), fetched "
            f"{format_bytes(self.bytes_fetched)} in {self.seconds:.1f} s "
            f"({rate:.0f} MB/s{scan}){tail}"
        )


def warm(
    source: SourceConfig,
    index_config: IndexConfig,
    cache_config: CacheConfig,
    readahead_config: ReadaheadConfig,
    *,
    show_progress: bool = False,
) -> WarmReport:
    """Bring the index up to date and fetch every block not cached yet (never evicting).

    Shards the index has to scan fill the cache as they stream, so each byte is fetched
    once; the rest is fetched with concurrent ranged GETs. The report counts both."""
    stats = Stats()
    cache = BlockCache(cache_config, stats)
    started = time.perf_counter()
    try:
        opened = open_source(
            source,
            index_config,
            ViewConfig(layout="raw"),
            cache=cache,
            stats=stats,
            progress=scan_progress() if show_progress else None,
        )
    except BaseException:
        cache.close()
        raise
    opened.view.close()
    store = opened.store
    shards = store.list_shards()
    prefetcher = Prefetcher(readahead_config.streams)
    reader = CachedReader(store, cache, stats, prefetcher=prefetcher)

    def cached_blocks() -> int:
        return sum(
            cache.path_of(BlockKey(reader.shard_key(s), i)).exists()
            for s in shards
            for i in range(reader.block_count(s))
        )

    blocks = sum(reader.block_count(s) for s in shards)
    # Blocks the index scan stored just now were not cached before this run.
    before = cached_blocks() - stats.blocks_written
    scanned = stats.bytes_fetched
    bar = None
    if show_progress:
        bar = new_bar("warming", sum(s.size for s in shards))
        bar.update(min(scanned, bar.total))
    try:
        for shard in shards:
            reader.read_ahead(shard)
        while not prefetcher.wait_idle(timeout=0.25):
            if bar is not None:
                bar.update(min(stats.bytes_fetched, bar.total) - bar.n)
        if bar is not None:
            bar.update(min(stats.bytes_fetched, bar.total) - bar.n)
    finally:
        if bar is not None:
            bar.close()
        prefetcher.close()
        cache.close()
    seconds = time.perf_counter() - started
    return WarmReport(
        len(shards),
        blocks,
        before,
        cached_blocks(),
        stats.bytes_fetched,
        seconds,
        scan_bytes=stats.scan_bytes,
    )

"""Range readers over real fsspec stores (memory and a local folder): the direct reader and
the reader through the block cache return the same bytes; the cached one fetches each
block once and never mixes versions or locations of a shard."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.tarbuild import memory_url, put, remove

import shardfs.cache.claims
from shardfs.cache import BlockCache, BlockKey
from shardfs.config import CacheConfig, SourceConfig
from shardfs.errors import ShardChangedError
from shardfs.read.block_runs import RUN_BLOCKS
from shardfs.read.direct import DirectReader
from shardfs.read.local_blocks import LocalBlocks
from shardfs.read.readahead import Prefetcher
from shardfs.read.reader import CachedReader
from shardfs.read.seam import RangeReader
from shardfs.stats import Stats
from shardfs.store.remote import Store
from shardfs.store.shards import ShardInfo

BLOCK = 4096
SIZE = 5 * BLOCK + 123  # the last block is short


def payload(size: int = SIZE, seed: int = 1) -> bytes:
    return random.Random(seed).randbytes(size)


@pytest.fixture
def block_cache(tmp_path: Path) -> Iterator[BlockCache]:
    config = CacheConfig(
        cache_dir=tmp_path / "cache", size="64M", min_free=0, block_size=BLOCK, chunk_size=512
    )
    cache = BlockCache(config, Stats())
    yield cache
    cache.close()


def block_files(cache: BlockCache) -> list[Path]:
    return [p for p in cache.blocks_dir.rglob("*") if p.is_file()]


def memory_store(shards: dict[str, bytes], stats: Stats | None = None) -> Store:
    """A store of ``shards``; it counts what it fetches in ``stats`` (a mount's one Stats)."""
    url = memory_url()
    for name, data in shards.items():
        put(url, name, data)
    return Store(SourceConfig(url), stats)


def local_store(folder: Path, shards: dict[str, bytes], stats: Stats | None = None) -> Store:
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in shards.items():
        (folder / name).write_bytes(data)
    return Store(SourceConfig(str(folder)), stats)


def only_shard(store: Store) -> ShardInfo:
    (shard,) = store.list_shards()
    return shard


READERS: dict[str, Callable[[Store, BlockCache], RangeReader]] = {
    "direct": lambda store, cache: DirectReader(store, store.stats, retries=1),
    "cached": lambda store, cache: CachedReader(store, cache, cache.stats, retries=1),
}

RANGES = [
    (0, 1),
    (0, SIZE),
    (0, BLOCK),
    (BLOCK - 1, BLOCK + 1),
    (BLOCK, 2 * BLOCK),
    (100, 3 * BLOCK + 7),
    (2 * BLOCK - 511, 2 * BLOCK + 513),
    (5 * BLOCK - 1, SIZE),
    (5 * BLOCK, SIZE),
    (SIZE - 1, SIZE),
]


@pytest.mark.parametrize("where", ["memory", "local"])
@pytest.mark.parametrize("kind", sorted(READERS))
def test_reads_return_exact_bytes(
    block_cache: BlockCache, tmp_path: Path, kind: str, where: str
) -> None:
    data = payload()
    shards = {"a.tar": data}
    store = memory_store(shards) if where == "memory" else local_store(tmp_path / "src", shards)
    reader = READERS[kind](store, block_cache)
    shard = only_shard(store)
    for _ in range(2):  # cold, then warm for the cached reader
        for start, end in RANGES:
            assert reader.read(shard, start, end) == data[start:end], (start, end)
    rng = random.Random(7)
    for _ in range(50):
        start = rng.randrange(SIZE)
        end = rng.randrange(start + 1, SIZE + 1)
        assert reader.read(shard, start, end) == data[start:end], (start, end)


@pytest.mark.parametrize("kind", sorted(READERS))
@pytest.mark.parametrize("at", [0, 100, BLOCK, SIZE])
def test_empty_read_returns_nothing_and_fetches_nothing(
    block_cache: BlockCache, kind: str, at: int
) -> None:
    store = memory_store({"a.tar": payload()}, block_cache.stats)
    reader = READERS[kind](store, block_cache)
    stats: Stats = reader.stats  # type: ignore[attr-defined]
    assert reader.read(only_shard(store), at, at) == b""
    assert stats.store_requests == 0


def test_cached_reader_fetches_each_block_once(block_cache: BlockCache) -> None:
    data = payload()
    store = memory_store({"a.tar": data}, block_cache.stats)
    shard = only_shard(store)
    reader = CachedReader(store, block_cache, block_cache.stats, retries=1)
    stats = block_cache.stats

    assert reader.read(shard, BLOCK + 5, 4 * BLOCK - 5) == data[BLOCK + 5 : 4 * BLOCK - 5]
    assert (stats.store_requests, stats.bytes_fetched) == (3, 3 * BLOCK)  # blocks 1, 2, 3
    assert (stats.cache_misses, stats.cache_hits) == (3, 0)

    assert reader.read(shard, 0, SIZE) == data
    assert stats.store_requests == 6  # only blocks 0, 4 and the short block 5 were new
    assert stats.bytes_fetched == 5 * BLOCK + 123 == SIZE
    assert (stats.cache_misses, stats.cache_hits) == (6, 3)

    assert reader.read(shard, 0, SIZE) == data
    assert stats.store_requests == 6
    assert len(block_files(block_cache)) == 6


def test_direct_reader_counts_every_request() -> None:
    data = payload()
    stats = Stats()
    store = memory_store({"a.tar": data}, stats)
    reader = DirectReader(store, stats, retries=1)
    shard = only_shard(store)
    for _ in range(3):
        assert reader.read(shard, 10, 5000) == data[10:5000]
    assert (reader.stats.store_requests, reader.stats.bytes_fetched) == (3, 3 * 4990)


@pytest.mark.parametrize("changed", [{"etag": "v2"}, {"size": SIZE - 1000}], ids=["etag", "size"])
def test_changed_shard_never_serves_old_blocks(
    block_cache: BlockCache, changed: dict[str, Any]
) -> None:
    old = payload(seed=1)
    store = memory_store({"a.tar": old}, block_cache.stats)
    reader = CachedReader(store, block_cache, block_cache.stats, retries=1)
    v1 = ShardInfo("a.tar", SIZE, "v1")
    assert reader.read(v1, 0, 3 * BLOCK) == old[: 3 * BLOCK]

    v2 = ShardInfo("a.tar", int(changed.get("size", SIZE)), str(changed.get("etag", "v1")))
    new = payload(v2.size, seed=2)
    put(store.config.url, "a.tar", new)  # same name, new contents
    assert reader.shard_key(v1) != reader.shard_key(v2)
    assert reader.read(v2, 0, 3 * BLOCK) == new[: 3 * BLOCK]
    assert block_cache.stats.store_requests == 6
    assert len(block_files(block_cache)) == 6


def test_same_name_in_two_locations_gets_two_keys(block_cache: BlockCache) -> None:
    """Same name, size and etag, in two places: the location keeps them apart."""
    first, second = payload(seed=1), payload(seed=2)
    store_a = memory_store({"a.tar": first}, block_cache.stats)
    store_b = memory_store({"a.tar": second}, block_cache.stats)
    shard = ShardInfo("a.tar", SIZE, "same-etag")
    reader_a = CachedReader(store_a, block_cache, block_cache.stats, retries=1)
    reader_b = CachedReader(store_b, block_cache, block_cache.stats, retries=1)

    assert store_a.location(shard) != store_b.location(shard)
    assert reader_a.shard_key(shard) != reader_b.shard_key(shard)
    assert reader_a.read(shard, 0, SIZE) == first
    assert reader_b.read(shard, 0, SIZE) == second
    assert reader_a.read(shard, 0, SIZE) == first
    assert block_cache.stats.store_requests == 12


def test_location_ignores_how_the_source_was_named(tmp_path: Path) -> None:
    """A brace pattern and a folder URL for the same shard share cached blocks."""
    url = memory_url()
    put(url, "a-0.tar", b"x")
    put(url, "a-1.tar", b"y")
    plain, pattern = Store(SourceConfig(url)), Store(SourceConfig(url + "/a-{0..1}.tar"))
    shard = ShardInfo("a-1.tar", 1, "e")
    assert plain.location(shard) == pattern.location(shard)
    assert plain.identity != pattern.identity


def test_store_failure_caches_nothing_and_is_retried(
    block_cache: BlockCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shardfs.cache.claims, "_FAILURE_HOLD_S", 0.0)  # retried at once below
    data = payload()
    store = memory_store({"a.tar": data}, block_cache.stats)
    shard = only_shard(store)
    reader = CachedReader(store, block_cache, block_cache.stats, retries=1)
    remove(store.config.url, "a.tar")
    with pytest.raises(ShardChangedError):
        reader.read(shard, 0, 10)
    assert block_files(block_cache) == []
    assert list(block_cache.tmp_dir.iterdir()) == []

    put(store.config.url, "a.tar", data)
    assert reader.read(shard, 0, 10) == data[:10]
    assert block_files(block_cache) == [block_cache.path_of(BlockKey(reader.shard_key(shard), 0))]


def test_shorter_shard_in_the_store_is_never_cached(block_cache: BlockCache) -> None:
    """The store now holds fewer bytes than indexed: the read fails, nothing is stored."""
    store = memory_store({"a.tar": payload(SIZE - 200)}, block_cache.stats)
    reader = CachedReader(store, block_cache, block_cache.stats, retries=1)
    shard = ShardInfo("a.tar", SIZE, "indexed")
    assert reader.read(shard, 0, 10) == payload(SIZE - 200)[:10]  # block 0 is intact
    with pytest.raises(ShardChangedError):
        reader.read(shard, SIZE - 10, SIZE)
    assert len(block_files(block_cache)) == 1


def test_block_sizes_sharing_a_cache_never_mix_blocks(tmp_path: Path) -> None:
    """Block 1 of a 2-block shard under 2*BLOCK is bytes [2B, 3B); under BLOCK it is
    [B, 2B): same index, same length. Mounts (or a remount) with another --block-size on the
    same cache folder must not serve each other's blocks."""
    data = payload(3 * BLOCK)
    store = memory_store({"a.tar": data})
    shard = only_shard(store)

    def reader_with(block_size: int) -> CachedReader:
        config = CacheConfig(
            cache_dir=tmp_path / "cache",
            size="64M",
            min_free=0,
            block_size=block_size,
            chunk_size=512,
        )
        cache = BlockCache(config, Stats())
        return CachedReader(store, cache, cache.stats, retries=1)

    small, large = reader_with(BLOCK), reader_with(2 * BLOCK)
    try:
        assert small.read(shard, 0, 3 * BLOCK) == data
        assert large.read(shard, 2 * BLOCK, 3 * BLOCK) == data[2 * BLOCK :]
        assert small.read(shard, BLOCK, 2 * BLOCK) == data[BLOCK : 2 * BLOCK]
    finally:
        small.cache.close()
        large.cache.close()


def test_degraded_cache_serves_cached_blocks_and_fetches_only_ranges(
    block_cache: BlockCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = payload(512 * BLOCK)
    store = memory_store({"a.tar": data}, block_cache.stats)
    shard = only_shard(store)
    reader = CachedReader(store, block_cache, block_cache.stats, retries=1)
    stats = block_cache.stats
    assert reader.read(shard, 0, 100) == data[:100]  # block 0 is cached
    before = stats.bytes_fetched
    monkeypatch.setattr(type(block_cache), "degraded", property(lambda self: True))
    assert reader.read(shard, 10, BLOCK) == data[10:BLOCK]
    assert stats.bytes_fetched == before  # still served by the cached block
    rng = random.Random(4)
    spans = rng.sample(range(BLOCK, 511 * BLOCK, 20 * BLOCK), 15)  # 80K apart: seeks
    for start in spans:
        assert reader.read(shard, start, start + 300) == data[start : start + 300]
    assert stats.bytes_fetched - before == 15 * 300  # what was read, not 15 blocks
    assert block_files(block_cache) == [block_cache.path_of(BlockKey(reader.shard_key(shard), 0))]


def test_readahead_fetches_consecutive_blocks_in_runs(block_cache: BlockCache) -> None:
    """A shard's readahead takes up to RUN_BLOCKS consecutive blocks per GET, each byte
    once, and stores every block on its own."""
    data = payload(10 * BLOCK + 5, seed=7)  # 11 blocks, the last one short
    store = memory_store({"r.tar": data}, block_cache.stats)
    shard = only_shard(store)
    prefetcher = Prefetcher(1)
    reader = CachedReader(store, block_cache, block_cache.stats, retries=1, prefetcher=prefetcher)
    try:
        assert reader.read(shard, 0, 10) == data[:10]  # block 0 by the read, then the rest
        assert prefetcher.wait_idle(30)
    finally:
        prefetcher.close()
    stats = block_cache.stats.snapshot()
    assert stats["bytes_fetched"] == len(data)
    assert stats["store_requests"] == 1 + -(-10 // RUN_BLOCKS)  # the read, then 3 runs
    assert len(block_files(block_cache)) == 11
    for index in range(11):
        start = index * BLOCK
        assert reader.read(shard, start, min(start + BLOCK, len(data))) == data[start:][:BLOCK]
    assert block_cache.stats.snapshot()["store_requests"] == stats["store_requests"]


def test_hinted_blocks_of_interleaved_shards_are_fetched_in_runs(block_cache: BlockCache) -> None:
    """An order hint interleaves shards; each shard's consecutive blocks still share a GET."""
    shards = {"a.tar": payload(4 * BLOCK, seed=8), "b.tar": payload(4 * BLOCK, seed=9)}
    store = memory_store(shards, block_cache.stats)
    a, b = sorted(store.list_shards(), key=lambda s: s.name)
    prefetcher = Prefetcher(1)
    reader = CachedReader(store, block_cache, block_cache.stats, retries=1, prefetcher=prefetcher)
    try:
        order = [(a, 1), (b, 1), (a, 2), (b, 2), (a, 3), (b, 3)]
        assert reader.prefetch_blocks(order) == 6
        assert prefetcher.wait_idle(30)
    finally:
        prefetcher.close()
    stats = block_cache.stats.snapshot()
    assert stats["store_requests"] == 2  # blocks 1-3 of each shard, one GET each
    assert stats["bytes_fetched"] == 6 * BLOCK
    for shard in (a, b):
        for index in (1, 2, 3):
            start = index * BLOCK
            assert reader.read(shard, start, start + BLOCK) == shards[shard.name][start:][:BLOCK]
    assert block_cache.stats.snapshot()["store_requests"] == 2


# -- blocks that become local, published once each -------------------------------------------

Told = tuple[str, int, int, bytes | None]


def listen(events: LocalBlocks) -> list[Told]:
    told: list[Told] = []
    lock = threading.Lock()

    def listener(shard: ShardInfo, start: int, end: int, block: bytes | None) -> None:
        with lock:
            told.append((shard.name, start, end, block))

    events.subscribe(listener)
    return told


@pytest.mark.parametrize("how", ["block", "split", "readahead"])
def test_each_block_stored_is_published_once_with_its_bytes(
    block_cache: BlockCache, how: str
) -> None:
    """Whichever fill stores a block (a whole-block miss, the rest of a split miss, a
    readahead run), its listeners hear of it once, with the bytes, from the reader."""
    data = payload()
    store = memory_store({"a.tar": data}, block_cache.stats)
    shard = only_shard(store)
    events = LocalBlocks()
    told = listen(events)
    prefetcher = Prefetcher(1) if how != "block" else None
    reader = CachedReader(
        store,
        block_cache,
        block_cache.stats,
        retries=1,
        prefetcher=prefetcher,
        split_misses=how == "split",
        local_blocks=events,
    )
    try:
        assert reader.read(shard, BLOCK + 10, BLOCK + 20) == data[BLOCK + 10 : BLOCK + 20]
        if prefetcher is not None:
            assert prefetcher.wait_idle(30)
        assert reader.read(shard, 0, SIZE) == data
        if prefetcher is not None:
            assert prefetcher.wait_idle(30)
    finally:
        if prefetcher is not None:
            prefetcher.close()
    blocks = [(i * BLOCK, min(SIZE, (i + 1) * BLOCK)) for i in range(6)]
    assert sorted((start, end) for _, start, end, _ in told) == blocks  # once each
    for name, start, end, block in told:
        assert name == "a.tar"
        assert block == data[start:end]  # stored by this process: the bytes come along
    assert block_cache.stats.bytes_fetched == SIZE


def test_a_block_found_cached_is_published_without_bytes(block_cache: BlockCache) -> None:
    data = payload()
    store = memory_store({"a.tar": data}, block_cache.stats)
    shard = only_shard(store)
    CachedReader(store, block_cache, block_cache.stats, retries=1).read(shard, 0, 10)
    events = LocalBlocks()
    told = listen(events)
    reader = CachedReader(store, block_cache, block_cache.stats, retries=1, local_blocks=events)
    assert reader.read(shard, 5, 50) == data[5:50]
    assert reader.read(shard, 50, 90) == data[50:90]
    assert told == [("a.tar", 0, BLOCK, None)]


def test_a_failing_listener_costs_neither_the_read_nor_the_block(
    block_cache: BlockCache, caplog: pytest.LogCaptureFixture
) -> None:
    """A listener's error is its own: logged, while the read gets its bytes, the block stays
    cached, and the other listeners are told."""
    data = payload()
    store = memory_store({"a.tar": data}, block_cache.stats)
    shard = only_shard(store)
    events = LocalBlocks()

    def failing(shard: ShardInfo, start: int, end: int, block: bytes | None) -> None:
        raise OSError("the pusher is gone")

    events.subscribe(failing)
    told = listen(events)
    reader = CachedReader(store, block_cache, block_cache.stats, retries=1, local_blocks=events)
    with caplog.at_level(logging.ERROR, logger="shardfs.read.local_blocks"):
        assert reader.read(shard, 0, 100) == data[:100]
    assert [r.getMessage() for r in caplog.records] == ["a listener for local blocks failed"]
    assert told == [("a.tar", 0, BLOCK, data[:BLOCK])]
    assert len(block_files(block_cache)) == 1
    assert block_cache.stats.cache_write_errors == 0 and not block_cache.degraded
    assert reader.read(shard, 0, BLOCK) == data[:BLOCK]
    assert block_cache.stats.store_requests == 1  # read back from disk, not fetched again


def test_a_read_spanning_two_blocks_one_get_brings_waits_for_both(
    block_cache: BlockCache,
) -> None:
    """A readahead GET brings blocks 0 and 1 and stores them one after the other. A read
    spanning both waits for each to be stored, not only the first: fetching the second
    itself meanwhile would pay its bytes twice."""
    data = payload()
    store = memory_store({"s.tar": data}, block_cache.stats)
    shard = only_shard(store)
    reader = CachedReader(store, block_cache, block_cache.stats, retries=1)
    skey = reader.shard_key(shard)
    assert reader.coming.mark(skey, 0) and reader.coming.mark(skey, 1)
    assert not reader.coming.mark(skey, 1)  # one GET brings a block

    def bring() -> None:  # what a BlockRun does with the blocks its GET brought
        for index, delay in ((0, 0.1), (1, 0.3)):
            time.sleep(delay)
            block = data[index * BLOCK : (index + 1) * BLOCK]
            reader.prefetch_one(shard, skey, index, lambda lo, hi, b=block: b[lo:hi], 0.0)
            reader.coming.arrived(skey, index)

    thread = threading.Thread(target=bring)
    thread.start()
    try:
        assert reader.read(shard, BLOCK - 10, BLOCK + 10) == data[BLOCK - 10 : BLOCK + 10]
    finally:
        thread.join()
    assert block_cache.stats.snapshot()["store_requests"] == 0

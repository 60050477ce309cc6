"""Readahead: the prefetch queue's priorities, split demand reads, shard readahead that
never evicts, and the cached reader driving them over a real fsspec store."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.mounts import wait_for
from support.tarbuild import memory_url, put

from shardfs.cache import BlockCache, BlockKey
from shardfs.config import CacheConfig, SourceConfig
from shardfs.read.block_runs import runs_of
from shardfs.read.fills import BlockFills, Fetch
from shardfs.read.readahead import HintedOrder, Prefetcher
from shardfs.read.reader import CachedReader
from shardfs.stats import Stats
from shardfs.store.remote import Store
from shardfs.store.responses import Fetched

BLOCK = 4096
KEY = "ab" * 16


@pytest.fixture
def cache(tmp_path: Path) -> Iterator[BlockCache]:
    config = CacheConfig(
        cache_dir=tmp_path / "cache", size="64M", min_free=0, block_size=BLOCK, chunk_size=512
    )
    block_cache = BlockCache(config, Stats())
    yield block_cache
    block_cache.close()


def never(start: int, end: int) -> bytes:
    raise AssertionError(f"fetched [{start}, {end}) of a block the cache holds")


def split_read(
    cache: BlockCache, key: BlockKey, start: int, end: int, fetch: Fetch, run_later: Any
) -> bytes:
    """A split miss as the reader makes it: its bytes now, the rest handed to ``run_later``."""
    data, rest = BlockFills(cache, cache.stats).read_split(key, start, end, BLOCK, fetch)
    if rest is not None:
        run_later(rest)
    return data


def whole_read(cache: BlockCache, key: BlockKey, fetch: Fetch = never) -> bytes:
    return BlockFills(cache, cache.stats).read(key, 0, BLOCK, BLOCK, fetch)[0]


class RangeSource:
    """A block's bytes behind a fetch_range that records every call; optionally slow."""

    def __init__(self, data: bytes, delay: float = 0.0) -> None:
        self.data = data
        self.delay = delay
        self.calls: list[tuple[int, int]] = []
        self.lock = threading.Lock()

    def __call__(self, start: int, end: int) -> bytes:
        with self.lock:
            self.calls.append((start, end))
        time.sleep(self.delay)
        return self.data[start:end]


# -- the queue ---------------------------------------------------------------------------


def test_fills_run_before_queued_readahead() -> None:
    order: list[str] = []
    gate = threading.Event()
    prefetcher = Prefetcher(1)
    try:
        prefetcher.run_soon(gate.wait)  # occupy the only thread
        prefetcher.schedule([lambda i=i: order.append(f"ahead{i}") for i in range(3)])
        prefetcher.run_soon(lambda: order.append("fill"))
        gate.set()
        assert prefetcher.wait_idle(30)
    finally:
        prefetcher.close()
    assert order == ["fill", "ahead0", "ahead1", "ahead2"]


def test_close_drops_queued_readahead_but_runs_fills() -> None:
    ran: list[str] = []
    gate = threading.Event()
    prefetcher = Prefetcher(1)  # one stream, so one hinted fetch runs and one waits a slot
    prefetcher.run_soon(gate.wait)
    prefetcher.schedule([lambda: ran.append("ahead")] * 5)
    prefetcher.schedule([lambda: ran.append("hinted")] * 2, hinted=True)
    prefetcher.run_soon(lambda: ran.append("fill"))
    assert prefetcher.pending == 9
    closer = threading.Thread(target=prefetcher.close)
    closer.start()
    # close() has begun once the hinted fetch waiting for a slot is dropped from the count.
    wait_for(lambda: prefetcher.pending == 8, "close() to drop the waiting hinted fetch")
    gate.set()
    closer.join(30)
    assert not closer.is_alive()
    assert ran == ["fill"]
    assert prefetcher.pending == 0


def test_a_failing_task_does_not_stop_the_workers() -> None:
    ran: list[int] = []
    prefetcher = Prefetcher(2)
    try:

        def boom() -> None:
            raise RuntimeError("boom")

        prefetcher.schedule([boom, lambda: ran.append(1), boom, lambda: ran.append(2)])
        assert prefetcher.wait_idle(30)
    finally:
        prefetcher.close()
    assert sorted(ran) == [1, 2]


def test_hinted_fetches_start_two_at_a_time_then_one_more_per_finished_one() -> None:
    """The slow start: the block readers need first is not split eight ways."""
    gates = [threading.Event() for _ in range(7)]
    started: list[int] = []
    lock = threading.Lock()

    def task(number: int) -> None:
        with lock:
            started.append(number)
        assert gates[number].wait(30)

    def started_count(expected: int) -> bool:
        with lock:
            return len(started) >= expected

    fences = 0

    def fence() -> None:
        nonlocal fences
        with lock:
            fences += 1

    def after_a_fence() -> list[int]:
        """What had started once a readahead task queued now ran: hinted fetches in the
        queue go first, so any the slow start let out too early had been taken by then."""
        seen = fences
        prefetcher.schedule([fence])
        wait_for(lambda: fences > seen, "the fence")
        with lock:
            return sorted(started)

    prefetcher = Prefetcher(8)
    try:
        assert prefetcher.schedule([lambda n=n: task(n) for n in range(7)], hinted=True) == 7
        wait_for(lambda: started_count(2), "two hinted fetches")
        assert after_a_fence() == [0, 1]  # six idle threads, yet no third fetch
        gates[0].set()  # finished: the limit grows to 3, with 1 still running
        wait_for(lambda: started_count(4), "four hinted fetches")
        assert after_a_fence() == [0, 1, 2, 3]
        gates[1].set()  # limit 4, 2 running: two more start
        wait_for(lambda: started_count(6), "six hinted fetches")
        for gate in gates:
            gate.set()
        assert prefetcher.wait_idle(30)
        assert sorted(started) == list(range(7))
    finally:
        for gate in gates:
            gate.set()
        prefetcher.close()


def test_close_drops_hinted_fetches_still_waiting_for_a_slot() -> None:
    running, gate = threading.Event(), threading.Event()
    ran: list[int] = []

    def first() -> None:
        running.set()
        gate.wait()

    prefetcher = Prefetcher(4, hinted_first=1)
    prefetcher.schedule([first] + [lambda n=n: ran.append(n) for n in range(5)], hinted=True)
    assert prefetcher.pending == 6
    # Running, the first fetch counts until it ends (queued, close() would drop it too).
    assert running.wait(30)
    closer = threading.Thread(target=prefetcher.close)
    closer.start()
    wait_for(lambda: prefetcher.pending == 1, "the waiting fetches dropped")
    gate.set()
    closer.join(30)
    assert not closer.is_alive()
    assert ran == []
    assert prefetcher.pending == 0


def test_streams_must_be_positive() -> None:
    with pytest.raises(ValueError):
        Prefetcher(0)


# -- split demand reads and prefetch: the reader's fills of the cache ----------------------


def test_split_read_fetches_only_the_asked_bytes_first_then_completes_the_block(
    cache: BlockCache,
) -> None:
    data = random.Random(1).randbytes(BLOCK)
    source = RangeSource(data)
    later: list[object] = []
    key = BlockKey(KEY, 0)
    got = split_read(cache, key, 1000, 1200, source, later.append)
    assert got == data[1000:1200]
    assert source.calls == [(1000, 1200)]  # the reader waited for its own bytes only
    assert not cache.path_of(key).exists()
    (fill,) = later
    fill()  # type: ignore[operator]
    assert source.calls == [(1000, 1200), (0, 1000), (1200, BLOCK)]
    assert whole_read(cache, key) == data
    assert cache.stats.cache_misses == 1 and cache.stats.cache_hits == 1


@pytest.mark.parametrize(("start", "end"), [(0, 10), (BLOCK - 10, BLOCK), (0, BLOCK)])
def test_split_read_at_block_edges_fetches_no_empty_ranges(
    cache: BlockCache, start: int, end: int
) -> None:
    data = random.Random(2).randbytes(BLOCK)
    source = RangeSource(data)
    assert (
        split_read(cache, BlockKey(KEY, 1), start, end, source, lambda f: f()) == (data[start:end])
    )
    assert all(a < b for a, b in source.calls)
    assert sum(b - a for a, b in source.calls) == BLOCK  # each byte once
    assert whole_read(cache, BlockKey(KEY, 1)) == data


def test_a_second_reader_waits_for_the_fill_instead_of_fetching_again(
    cache: BlockCache,
) -> None:
    data = random.Random(3).randbytes(BLOCK)
    source = RangeSource(data, delay=0.05)
    key = BlockKey(KEY, 2)
    fills: list[threading.Thread] = []

    def run_later(task: object) -> None:
        thread = threading.Thread(target=task)  # type: ignore[arg-type]
        fills.append(thread)
        thread.start()

    first = split_read(cache, key, 0, 100, source, run_later)
    second = split_read(cache, key, 2000, 2100, source, run_later)
    for thread in fills:
        thread.join()
    assert (first, second) == (data[0:100], data[2000:2100])
    assert sum(b - a for a, b in source.calls) == BLOCK  # the block was fetched once


def test_a_failed_fill_stores_nothing_and_lets_the_next_read_refetch(
    cache: BlockCache,
) -> None:
    data = random.Random(4).randbytes(BLOCK)
    calls = {"n": 0}

    def flaky(start: int, end: int) -> bytes:
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("connection reset")
        return data[start:end]

    key = BlockKey(KEY, 3)
    assert split_read(cache, key, 100, 200, flaky, lambda f: f()) == data[100:200]
    assert not cache.path_of(key).exists()
    assert split_read(cache, key, 100, 200, flaky, lambda f: f()) == data[100:200]
    assert cache.path_of(key).exists()
    assert whole_read(cache, key) == data


def test_prefetch_skips_cached_blocks_and_never_evicts(tmp_path: Path) -> None:
    config = CacheConfig(
        cache_dir=tmp_path / "small", size=str(3 * BLOCK + 600), min_free=0, block_size=BLOCK
    )
    cache = BlockCache(config, Stats())
    try:
        data = random.Random(5).randbytes(BLOCK)
        fills = BlockFills(cache, cache.stats)
        fetched = [fills.prefetch(BlockKey(KEY, i), BLOCK, RangeSource(data)) for i in range(5)]
        assert fetched[0] == fetched[1] == data  # stored, and handed back to announce
        assert fetched[-1] is None  # the bound was reached: readahead stops
        assert cache.stats.blocks_evicted == 0
        assert cache.usage() <= cache.limit()
        source = RangeSource(data)
        assert fills.prefetch(BlockKey(KEY, 0), BLOCK, source) is None
        assert source.calls == []
    finally:
        cache.close()


# -- the cached reader with a prefetcher, over a real fsspec store ------------------------


def test_first_read_in_a_shard_prefetches_the_rest_of_it(cache: BlockCache) -> None:
    url = memory_url()
    shards = {f"s{i}.tar": random.Random(i).randbytes(7 * BLOCK + 99) for i in range(3)}
    for name, data in shards.items():
        put(url, name, data)
    store = Store(SourceConfig(url), cache.stats)
    listed = {s.name: s for s in store.list_shards()}
    prefetcher = Prefetcher(2)
    reader = CachedReader(store, cache, cache.stats, retries=1, prefetcher=prefetcher)
    try:
        shard = listed["s1.tar"]
        assert (
            reader.read(shard, 3 * BLOCK + 5, 3 * BLOCK + 50)
            == shards["s1.tar"][3 * BLOCK + 5 : 3 * BLOCK + 50]
        )
        assert prefetcher.wait_idle(10)
        for index in range(reader.block_count(shard)):
            assert cache.path_of(BlockKey(reader.shard_key(shard), index)).exists()
        for other in ("s0.tar", "s2.tar"):  # untouched shards are not fetched
            assert not cache.path_of(BlockKey(reader.shard_key(listed[other]), 0)).exists()
        fetched = cache.stats.bytes_fetched
        assert fetched == shard.size  # each byte of the shard exactly once
        assert reader.read(shard, 0, shard.size) == shards["s1.tar"]
        assert cache.stats.bytes_fetched == fetched
    finally:
        prefetcher.close()


@pytest.mark.parametrize("split", [False, True])
def test_a_miss_fetches_its_block_or_only_its_bytes_first(cache: BlockCache, split: bool) -> None:
    url = memory_url()
    data = random.Random(9).randbytes(3 * BLOCK)
    put(url, "s.tar", data)
    store = Store(SourceConfig(url))
    (shard,) = store.list_shards()
    requests: list[tuple[int, int]] = []
    original = store.fetch

    def recording(s: object, start: int, end: int, piece: int, **options: Any) -> Fetched:
        requests.append((start, end))  # every ranged read, whole or in pieces, comes here
        return original(shard, start, end, piece, **options)

    store.fetch = recording  # type: ignore[method-assign]
    prefetcher = Prefetcher(1)
    reader = CachedReader(
        store, cache, cache.stats, retries=1, prefetcher=prefetcher, split_misses=split
    )
    try:
        assert reader.read(shard, BLOCK + 10, BLOCK + 20) == data[BLOCK + 10 : BLOCK + 20]
        assert requests[0] == ((BLOCK + 10, BLOCK + 20) if split else (BLOCK, 2 * BLOCK))
        assert prefetcher.wait_idle(10)
        assert reader.read(shard, 0, 3 * BLOCK) == data
        assert sum(b - a for a, b in requests) == 3 * BLOCK  # every byte once either way
    finally:
        prefetcher.close()


def test_a_read_racing_a_readahead_get_for_its_block_does_not_fetch_it_again(
    cache: BlockCache,
) -> None:
    """A readahead run chooses the later blocks of its GET while a read of one of them is
    between its look for a coming GET and its claim on the block (CI, stop 43: the last
    block of a shard fetched twice). The read, owning the claim, takes the run's bytes."""
    url = memory_url()
    data = random.Random(5).randbytes(2 * BLOCK + 999)
    put(url, "s.tar", data)
    store = Store(SourceConfig(url))
    (shard,) = store.list_shards()
    requests: list[tuple[int, int]] = []
    original_fetch, original_claim = store.fetch, cache.claim
    at_claim, run_get, claimed = threading.Event(), threading.Event(), threading.Event()

    def fetch(s: object, start: int, end: int, piece: int, **options: Any) -> Fetched:
        requests.append((start, end))
        if start == 0 and end > 2 * BLOCK:  # the run's GET, from block 0 through block 2
            run_get.set()
            claimed.wait(10)
        return original_fetch(shard, start, end, piece, **options)

    def claim(key: BlockKey, *, wait: bool = True) -> Any:
        if wait and key.index == 2:  # the read, past its look for a coming GET
            at_claim.set()
            run_get.wait(10)
            try:
                return original_claim(key)
            finally:
                claimed.set()
        return original_claim(key, wait=wait)

    store.fetch = fetch  # type: ignore[method-assign]
    cache.claim = claim  # type: ignore[method-assign,assignment]
    prefetcher = Prefetcher(1)
    reader = CachedReader(store, cache, cache.stats, retries=1, prefetcher=prefetcher)
    got: list[bytes] = []
    start = 2 * BLOCK + 10
    demand = threading.Thread(target=lambda: got.append(reader.read(shard, start, start + 50)))
    try:
        demand.start()
        assert at_claim.wait(10)
        reader.prefetch_blocks([(shard, 0), (shard, 1), (shard, 2)])
        demand.join(20)
        assert prefetcher.wait_idle(10)
        assert run_get.is_set() and claimed.is_set()  # the interleaving did happen
        assert got == [data[start : start + 50]]
        assert cache.contains(BlockKey(reader.shard_key(shard), 2))
        assert reader.read(shard, 0, shard.size) == data
        assert sum(b - a for a, b in requests) == shard.size, requests  # every byte once
    finally:
        prefetcher.close()


def test_a_hinted_plan_with_runs_hands_each_block_once_with_its_shard_followers() -> None:
    # blocks (shard, index) in first-use order, as a uniform-mode order interleaves them
    blocks = [(0, 2), (1, 0), (0, 0), (1, 1), (0, 1), (0, 3), (1, 2), (0, 5)]
    first_use = list(range(len(blocks)))
    one_by_one = HintedOrder(blocks, first_use, window=2)
    assert one_by_one.start() == [(0, 2), (1, 0)]
    assert one_by_one.reached(0) == [(0, 0)]

    plan = HintedOrder(blocks, first_use, window=2, run=4)
    first = plan.start()
    # (0, 2) brings (0, 3), and stops at (0, 4), which the plan does not need; (1, 0)
    # brings (1, 1) and (1, 2)
    assert first == [(0, 2), (0, 3), (1, 0), (1, 1), (1, 2)]
    assert runs_of(first) == [(0, [2, 3]), (1, [0, 1, 2])]  # two GETs, not five
    # (0, 0) brings (0, 1), and stops at (0, 2), handed already
    assert plan.reached(0) == [(0, 0), (0, 1)]
    assert [plan.reached(position) for position in range(1, 5)] == [[], [], [], []]
    assert plan.reached(5) == [(0, 5)]
    assert plan.reached(7) == []


@pytest.mark.parametrize("run", [1, 2, 4])
def test_a_hinted_plan_hands_every_block_exactly_once_whatever_the_run(run: int) -> None:
    rng = random.Random(run)
    needed = [(shard, index) for shard in range(5) for index in range(12) if rng.random() < 0.8]
    rng.shuffle(needed)
    plan = HintedOrder(needed, list(range(len(needed))), window=3, run=run)
    handed = plan.start()
    for position in range(len(needed)):
        handed += plan.reached(position)
    assert sorted(handed) == sorted(needed)  # each block once, none the plan lacks
    gets = len(runs_of(handed))
    if run == 1:
        assert handed == needed  # in first-use order, one GET each
    else:  # a shard's next block, needed later, comes with the GET of the one before
        assert gets < len(needed)


@pytest.mark.parametrize(
    ("streams", "block", "run"),
    [(8, 8 << 20, 1), (4, 8 << 20, 2), (8, 1 << 20, 4), (1, 256 << 10, 4)],
)
def test_a_hint_fetches_runs_only_as_long_as_every_stream_gets_landing_room(
    tmp_path: Path, streams: int, block: int, run: int
) -> None:
    # the readahead's landing memory (64 MiB) holds a GET of each stream: 8 GETs of one 8
    # MiB block at the default settings, so the default hands blocks one at a time
    config = CacheConfig(cache_dir=tmp_path / "cache", size="1G", min_free=0, block_size=block)
    cache = BlockCache(config, Stats())
    prefetcher = Prefetcher(streams)
    store = Store(SourceConfig(memory_url()), cache.stats)
    try:
        reader = CachedReader(store, cache, cache.stats, prefetcher=prefetcher)
        assert reader.hinted_run() == run
        assert CachedReader(store, cache, cache.stats).hinted_run() == 1  # no readahead
    finally:
        prefetcher.close()
        cache.close()

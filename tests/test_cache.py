"""The persistent block cache, filled as a reader fills it (``BlockFills``) from a fake
fetcher: bytes, verification, crash safety, the bound, degrading on a bad disk, claims, and
concurrency across threads and processes."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import random
import shutil
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from support.blocks import encoded_bytes
from support.mounts import wait_for
from support.page_cache import drop_from_page_cache

import shardfs.cache.block_cache
import shardfs.cache.claims
import shardfs.cache.health
import shardfs.cache.ledger
from shardfs.cache import (
    EVICT_ANY,
    EVICT_NONE,
    MAGIC,
    RETIRED_BEFORE,
    BlockCache,
    BlockKey,
    NoRoom,
    cache_info,
    clear_cache,
    encode_block,
    read_verified,
    shard_key,
)
from shardfs.cache.block_format import PAGE
from shardfs.config import CacheConfig, resolve_cache_size
from shardfs.errors import StoreReadError, UsageError
from shardfs.read.fills import BlockFills
from shardfs.stats import Stats

BLOCK = 4096
CHUNK = 512
HEADER = 56 + 8 * (BLOCK // CHUNK) + 8  # fixed part + one sum per chunk + header sum
ENCODED = HEADER + BLOCK  # header + data of one full block
ON_DISK = -(-ENCODED // PAGE) * PAGE  # its file, written with O_DIRECT: zeros to a page
KEY = shard_key("memory://bucket/train-000.tar", 1 << 20, "etag-1")
PROJECT = Path(__file__).resolve().parents[1]


def get(
    cache: BlockCache,
    key: BlockKey,
    start: int,
    end: int,
    block_len: int,
    fetch: Callable[[], bytes],
    *,
    evict_before: float = EVICT_ANY,
) -> bytes:
    """Bytes ``[start, end)`` of a block, fetched whole by ``fetch`` on a miss (as a reader
    without split misses does)."""

    def whole(lo: int, hi: int) -> bytes:
        assert (lo, hi) == (0, block_len)  # a whole-block miss asks for the whole block
        return fetch()

    fills = BlockFills(cache, cache.stats)
    return fills.read(key, start, end, block_len, whole, evict_before=evict_before)[0]


class Source:
    """Deterministic block contents and a fetcher per block that counts its calls."""

    def __init__(self, seed: int = 0, block_len: int = BLOCK) -> None:
        self.seed = seed
        self.block_len = block_len
        self.calls: list[int] = []
        self._lock = threading.Lock()

    def block(self, index: int) -> bytes:
        return random.Random(self.seed * 1_000_003 + index).randbytes(self.block_len)

    def fetcher(self, index: int, delay: float = 0.0) -> Callable[[], bytes]:
        def fetch() -> bytes:
            with self._lock:
                self.calls.append(index)
            if delay:
                time.sleep(delay)
            return self.block(index)

        return fetch

    def get(self, cache: BlockCache, index: int, start: int = 0, end: int | None = None) -> bytes:
        end = self.block_len if end is None else end
        return get(cache, BlockKey(KEY, index), start, end, self.block_len, self.fetcher(index))


@pytest.fixture
def cache_dir(tmp_path: Path) -> Path:
    return tmp_path / "cache"


@pytest.fixture
def open_cache(cache_dir: Path) -> Iterator[Callable[..., BlockCache]]:
    """Opens BlockCache instances on ``cache_dir`` (small blocks, no min_free); closes them."""
    opened: list[BlockCache] = []

    def make(ledger_connect: Any = None, **overrides: Any) -> BlockCache:
        settings: dict[str, Any] = {
            "cache_dir": cache_dir,
            "size": "64M",
            "min_free": 0,
            "block_size": BLOCK,
            "chunk_size": CHUNK,
            **overrides,
        }
        seam = {} if ledger_connect is None else {"ledger_connect": ledger_connect}
        cache = BlockCache(CacheConfig(**settings), Stats(), **seam)
        opened.append(cache)
        return cache

    yield make
    for cache in opened:
        cache.close()


def block_files(cache: BlockCache) -> list[Path]:
    return sorted(p for p in cache.blocks_dir.rglob("*") if p.is_file())


def tmp_files(cache: BlockCache) -> list[str]:
    return sorted(os.listdir(cache.tmp_dir))


def assert_block_file_valid(cache: BlockCache, index: int, expected: bytes) -> None:
    fd = os.open(cache.path_of(BlockKey(KEY, index)), os.O_RDONLY)
    try:
        assert read_verified(fd, BlockKey(KEY, index), 0, len(expected), len(expected)) == expected
    finally:
        os.close(fd)


class HeldReads:
    """Reads of cached blocks stopped half way, inside the cache's read of the block file
    (where a read keeps its block from eviction), until ``release()``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, source: Source) -> None:
        self.source = source
        self.inside = 0
        self.lock = threading.Lock()
        self.gate = threading.Event()
        self.threads: list[threading.Thread] = []
        self.results: dict[int, bytes] = {}
        real_read_data = shardfs.cache.block_cache.read_data

        def held_read_data(*args: Any, **kwargs: Any) -> bytes:
            with self.lock:
                self.inside += 1
            assert self.gate.wait(60)
            return real_read_data(*args, **kwargs)

        monkeypatch.setattr(shardfs.cache.block_cache, "read_data", held_read_data)

    def start(self, cache: BlockCache, indexes: list[int]) -> None:
        def read(index: int) -> None:
            self.results[index] = self.source.get(cache, index)

        for index in indexes:
            thread = threading.Thread(target=read, args=(index,))
            thread.start()
            self.threads.append(thread)
        wait_for(lambda: self.inside == len(self.threads), "the reads to reach the block files")

    def release(self) -> None:
        self.gate.set()
        for thread in self.threads:
            thread.join(30)
            assert not thread.is_alive()


# --- bytes, hits and misses -------------------------------------------------------------------

RANGES = [
    (0, 1),
    (0, CHUNK),
    (CHUNK - 1, CHUNK),
    (CHUNK - 1, CHUNK + 1),
    (CHUNK, 2 * CHUNK),
    (CHUNK + 7, 5 * CHUNK - 3),
    (1000, 3000),
    (BLOCK - CHUNK, BLOCK),
    (BLOCK - 1, BLOCK),
    (0, BLOCK),
    (17, 17),
]


def test_get_returns_exact_bytes_for_every_range(open_cache: Callable[..., BlockCache]) -> None:
    cache, source = open_cache(), Source()
    for start, end in RANGES:
        for index in (0, 1):
            assert source.get(cache, index, start, end) == source.block(index)[start:end]
    assert sorted(source.calls) == [0, 1]  # one fetch per block, whatever the ranges


def test_short_last_block_returns_exact_bytes(open_cache: Callable[..., BlockCache]) -> None:
    cache, source = open_cache(), Source(block_len=1000)  # not a multiple of the chunk size
    for start, end in [(0, 1000), (999, 1000), (500, 513), (511, 512), (512, 1000)]:
        assert source.get(cache, 3, start, end) == source.block(3)[start:end]
    assert source.calls == [3]
    assert_block_file_valid(cache, 3, source.block(3))


def test_miss_fetches_once_then_hits(open_cache: Callable[..., BlockCache]) -> None:
    cache, source = open_cache(), Source()
    assert source.get(cache, 0, 100, 200) == source.block(0)[100:200]
    assert (cache.stats.cache_misses, cache.stats.cache_hits) == (1, 0)
    assert source.get(cache, 0, 3000, 4000) == source.block(0)[3000:4000]
    assert (cache.stats.cache_misses, cache.stats.cache_hits) == (1, 1)
    assert source.calls == [0]
    assert cache.stats.blocks_written == 1
    assert cache.stats.snapshot()["hit_ratio"] == 0.5


def test_new_instance_serves_from_disk_without_fetching(
    open_cache: Callable[..., BlockCache],
) -> None:
    first, source = open_cache(), Source()
    for index in range(4):
        source.get(first, index)
    first.close()

    again = Source()  # same contents, fresh counters: a remount
    second = open_cache()
    for index in range(4):
        assert again.get(second, index, 10, 4000) == source.block(index)[10:4000]
    assert again.calls == []
    assert (second.stats.cache_hits, second.stats.cache_misses) == (4, 0)
    assert second.usage() == 4 * ENCODED


# --- verification -----------------------------------------------------------------------------


def flip_byte(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0xFF
    path.write_bytes(bytes(raw))


def damage_then_read(
    open_cache: Callable[..., BlockCache],
    damage: Callable[[BlockCache, Path], None],
    *,
    reopened: bool = False,
) -> tuple[BlockCache, Source]:
    """Cache block 0, damage its file, read it whole; checks the refetch and the new file.
    ``reopened``: read it through another cache on the folder (a later mount), which opens
    the file afresh: the writer keeps its block's file open with the header it wrote."""
    cache, source = open_cache(), Source()
    source.get(cache, 0)
    path = cache.path_of(BlockKey(KEY, 0))
    damage(cache, path)
    if reopened:
        cache = open_cache()

    assert source.get(cache, 0) == source.block(0)
    assert cache.stats.checksum_failures == 1
    assert source.calls == [0, 0]
    assert_block_file_valid(cache, 0, source.block(0))
    assert encoded_bytes(path) == ENCODED
    assert cache.usage() == ENCODED  # the bad file was forgotten, the new one counted once
    assert source.get(cache, 0) == source.block(0)  # and it is a hit again
    assert source.calls == [0, 0]
    return cache, source


@pytest.mark.parametrize("offset", [0, 1, CHUNK - 1, CHUNK, 3 * CHUNK + 100, BLOCK - 1])
def test_flipped_data_byte_is_detected_and_refetched(
    open_cache: Callable[..., BlockCache], offset: int
) -> None:
    damage_then_read(open_cache, lambda cache, path: flip_byte(path, HEADER + offset))


@pytest.mark.parametrize("length", [0, 10, HEADER - 1, HEADER, HEADER + CHUNK, ENCODED - 1])
def test_truncated_block_file_is_detected(
    open_cache: Callable[..., BlockCache], length: int
) -> None:
    def truncate(cache: BlockCache, path: Path) -> None:
        os.truncate(path, length)

    damage_then_read(open_cache, truncate)


@pytest.mark.parametrize(
    "offset",
    [
        8,  # header length
        12,  # chunk size
        16,  # data length
        24,  # block index
        40,  # shard key
        56,  # first chunk checksum
        56 + 8 * 7,  # last chunk checksum
        HEADER - 1,  # header checksum
    ],
)
def test_corrupt_header_is_detected(open_cache: Callable[..., BlockCache], offset: int) -> None:
    damage_then_read(open_cache, lambda cache, path: flip_byte(path, offset), reopened=True)


@pytest.mark.parametrize("offset", [8, 16, 56, HEADER - 1])
def test_header_damaged_after_the_write_leaves_the_writers_reads_right(
    open_cache: Callable[..., BlockCache], offset: int
) -> None:
    """The cache that wrote a block reads it with the header it wrote (no read back), so a
    header damaged on disk since changes none of its answers; data is checked as ever."""
    cache, source = open_cache(), Source()
    source.get(cache, 0)
    flip_byte(cache.path_of(BlockKey(KEY, 0)), offset)
    assert source.get(cache, 0) == source.block(0)
    assert source.calls == [0]
    assert cache.stats.checksum_failures == 0


def test_wrong_magic_is_detected(open_cache: Callable[..., BlockCache]) -> None:
    def wrong_magic(cache: BlockCache, path: Path) -> None:
        raw = path.read_bytes()
        assert raw.startswith(MAGIC)
        path.write_bytes(b"NOTABLK1" + raw[len(MAGIC) :])

    damage_then_read(open_cache, wrong_magic, reopened=True)


@pytest.mark.parametrize("other", [BlockKey(KEY, 1), BlockKey(shard_key("x", 1, "e"), 0)])
def test_block_copied_to_another_keys_path_is_detected(
    open_cache: Callable[..., BlockCache], other: BlockKey
) -> None:
    """A whole, self-consistent block file in the wrong place is still rejected."""
    wrong = Source(seed=99)

    def replace_with_other_block(cache: BlockCache, path: Path) -> None:
        path.write_bytes(encode_block(other, wrong.block(other.index), CHUNK))

    damage_then_read(open_cache, replace_with_other_block)


def test_corrupt_chunk_outside_the_read_is_only_detected_when_read(
    open_cache: Callable[..., BlockCache],
) -> None:
    """Only the chunks a read returns are verified: damage elsewhere surfaces later, and
    corrupted bytes are never returned."""
    cache, source = open_cache(), Source()
    data = source.block(0)
    source.get(cache, 0)
    flip_byte(cache.path_of(BlockKey(KEY, 0)), HEADER + 5 * CHUNK + 3)  # chunk 5

    assert source.get(cache, 0, 0, 5 * CHUNK) == data[: 5 * CHUNK]  # chunks 0-4: fine
    assert source.get(cache, 0, 6 * CHUNK, BLOCK) == data[6 * CHUNK :]  # chunks 6-7: fine
    assert cache.stats.checksum_failures == 0
    assert source.calls == [0]

    assert source.get(cache, 0, 5 * CHUNK + 3, 5 * CHUNK + 4) == data[5 * CHUNK + 3 : 5 * CHUNK + 4]
    assert cache.stats.checksum_failures == 1
    assert source.calls == [0, 0]
    assert_block_file_valid(cache, 0, data)


def test_damage_met_by_two_readers_at_once_is_discarded_once(
    open_cache: Callable[..., BlockCache], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reader A finds the damage and stalls; reader B finds it too, discards the file and
    caches the block again. A, going on, must neither count a second failure nor delete
    the block B cached (which would cost a third fetch)."""
    cache, source = open_cache(), Source()
    data = source.block(0)
    source.get(cache, 0)
    flip_byte(cache.path_of(BlockKey(KEY, 0)), HEADER + 5 * CHUNK + 3)
    found, go_on = threading.Event(), threading.Event()
    real = shardfs.cache.block_cache.read_data

    def stall_reader_a(*args: Any, **kwargs: Any) -> bytes:
        try:
            return real(*args, **kwargs)
        except shardfs.cache.block_cache.CorruptBlockError:
            if threading.current_thread().name == "reader-a":
                found.set()
                assert go_on.wait(10)
            raise

    monkeypatch.setattr(shardfs.cache.block_cache, "read_data", stall_reader_a)
    got: list[bytes] = []
    reader_a = threading.Thread(
        target=lambda: got.append(source.get(cache, 0, 5 * CHUNK, 6 * CHUNK)), name="reader-a"
    )
    reader_a.start()
    assert found.wait(10)
    assert source.get(cache, 0, 5 * CHUNK, 6 * CHUNK) == data[5 * CHUNK : 6 * CHUNK]  # B
    go_on.set()
    reader_a.join(10)
    assert got == [data[5 * CHUNK : 6 * CHUNK]]
    assert cache.stats.checksum_failures == 1
    assert_block_file_valid(cache, 0, data)  # B's block is still there
    calls = len(source.calls)
    assert source.get(cache, 0) == data
    assert len(source.calls) == calls  # and a hit


def test_block_of_another_length_is_rejected(open_cache: Callable[..., BlockCache]) -> None:
    """The caller's block length is checked against the header (a shorter shard version)."""
    cache, source = open_cache(), Source()
    source.get(cache, 0)
    short = Source(block_len=1000)
    assert short.get(cache, 0, 0, 1000) == short.block(0)
    assert cache.stats.checksum_failures == 1
    assert short.calls == [0]


# --- crash safety -----------------------------------------------------------------------------


def dead_pid() -> int:
    proc = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    return int(proc.stdout)


def test_stale_temp_files_of_dead_processes_are_removed_on_start(
    cache_dir: Path, open_cache: Callable[..., BlockCache]
) -> None:
    (cache_dir / "tmp").mkdir(parents=True)
    dead = f"{dead_pid()}-0-deadbeef.tmp"
    live = f"{os.getpid()}-0-cafef00d.tmp"
    junk = "not-a-pid.tmp"
    for name in (dead, live, junk):
        (cache_dir / "tmp" / name).write_bytes(b"partial block")

    cache = open_cache()
    assert tmp_files(cache) == [live]
    assert block_files(cache) == []


def test_failed_fetch_leaves_nothing_and_is_retried(
    open_cache: Callable[..., BlockCache], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shardfs.cache.claims, "_FAILURE_HOLD_S", 0.0)
    cache, source = open_cache(), Source()
    attempts: list[int] = []

    def failing() -> bytes:
        attempts.append(1)
        raise ConnectionError("store went away mid-download")

    with pytest.raises(ConnectionError):
        get(cache, BlockKey(KEY, 0), 0, BLOCK, BLOCK, failing)
    assert block_files(cache) == []
    assert tmp_files(cache) == []
    assert cache.usage() == 0

    assert source.get(cache, 0) == source.block(0)
    assert attempts == [1]
    assert source.calls == [0]


@pytest.mark.parametrize("length", [0, BLOCK - 1, BLOCK + 1])
def test_fetch_of_wrong_length_raises_and_stores_nothing(
    open_cache: Callable[..., BlockCache], length: int
) -> None:
    cache = open_cache()
    with pytest.raises(ValueError, match="fetched"):
        get(cache, BlockKey(KEY, 0), 0, 10, BLOCK, lambda: b"x" * length)
    assert block_files(cache) == []
    assert tmp_files(cache) == []
    assert cache.usage() == 0
    assert cache.stats.blocks_written == 0


# --- the bound --------------------------------------------------------------------------------


def disk_bytes(cache: BlockCache) -> int:
    """Header and data bytes of the block files on disk (what the cache counts)."""
    return sum(encoded_bytes(p) for p in block_files(cache))


def test_bound_holds_while_reading_many_blocks(open_cache: Callable[..., BlockCache]) -> None:
    limit = 10 * ENCODED + 100
    cache, source = open_cache(size=str(limit)), Source()
    assert cache.limit() == limit
    for index in range(60):
        assert source.get(cache, index, 5, 4000) == source.block(index)[5:4000]
        assert cache.usage() <= limit + ENCODED
        assert cache.usage() == disk_bytes(cache)
    assert cache.stats.blocks_evicted > 0
    assert cache.stats.blocks_evicted == 60 - len(block_files(cache))
    assert cache.stats.blocks_written == 60
    # The most recent block is always kept.
    assert cache.path_of(BlockKey(KEY, 59)).exists()


def assert_survivors_are_most_recent(cache: BlockCache, lru_order: list[int]) -> None:
    """The blocks still on disk are the most recently used ones: a suffix of ``lru_order``."""
    alive = [i for i in lru_order if cache.path_of(BlockKey(KEY, i)).exists()]
    assert alive == lru_order[len(lru_order) - len(alive) :], alive


@pytest.mark.parametrize("flush_every", [0.0, 5.0])
def test_eviction_takes_least_recently_used_first(
    open_cache: Callable[..., BlockCache], monkeypatch: pytest.MonkeyPatch, flush_every: float
) -> None:
    """Access times wait in memory (5 s by default); eviction flushes them first."""
    monkeypatch.setattr(shardfs.cache.ledger, "_ATIME_FLUSH_S", flush_every)
    cache, source = open_cache(size=str(10 * ENCODED)), Source()
    for index in range(10):
        source.get(cache, index)
    for index in (5, 0, 7):  # touch: these become the most recently used
        source.get(cache, index, 0, 1)
    order = [1, 2, 3, 4, 6, 8, 9, 5, 0, 7]
    assert cache.stats.blocks_evicted == 0
    for index in range(10, 22):
        source.get(cache, index)
        order.append(index)
        assert_survivors_are_most_recent(cache, order)
        assert cache.usage() <= 10 * ENCODED
    assert cache.stats.blocks_evicted == 22 - len(block_files(cache))
    assert not cache.path_of(BlockKey(KEY, 7)).exists()  # in the end even touched ones go
    assert source.calls == list(range(22))


def test_a_look_tells_the_bytes_free_without_eviction(
    open_cache: Callable[..., BlockCache],
) -> None:
    """``look``: room_for's answer and the bytes that fit under the bound now, less what a
    fetch in flight holds."""
    cache, source = open_cache(size=str(6 * ENCODED)), Source()
    assert cache.look(BLOCK) == (True, 6 * ENCODED)
    source.get(cache, 0)
    assert cache.look(BLOCK) == (True, 5 * ENCODED)
    with cache.reserving(BLOCK, EVICT_NONE) as reserved:
        assert reserved and cache.look(BLOCK) == (True, 4 * ENCODED)
    assert cache.look(BLOCK) == (True, 5 * ENCODED)


def test_retired_blocks_go_first_and_reads_do_not_warm_them(
    open_cache: Callable[..., BlockCache],
) -> None:
    """``retire``: blocks whose reads are done are the only ones ``RETIRED_BEFORE`` lets go,
    oldest retirement first, and a read of a retired block does not protect it again
    until ``unretire_all``."""
    cache, source = open_cache(size=str(6 * ENCODED)), Source()
    for index in range(6):
        source.get(cache, index)
    assert not cache.room_for(BLOCK, RETIRED_BEFORE)  # nothing retired: no room
    assert cache.look(BLOCK, RETIRED_BEFORE) == (False, 0)  # and no byte free
    cache.retire([BlockKey(KEY, 4), BlockKey(KEY, 1)])
    source.get(cache, 1, 0, 1)  # read after retirement: still retired
    assert cache.room_for(BLOCK, RETIRED_BEFORE)
    assert cache.look(BLOCK, RETIRED_BEFORE) == (True, 0)  # room by eviction, none free
    assert source.get(cache, 6) == source.block(6)  # a fetch evicting only retired blocks
    get(cache, BlockKey(KEY, 7), 0, BLOCK, BLOCK, source.fetcher(7), evict_before=RETIRED_BEFORE)
    kept = {i for i in range(8) if cache.path_of(BlockKey(KEY, i)).exists()}
    assert {0, 2, 3, 5} <= kept and not {1, 4} & kept, kept
    cache.retire([BlockKey(KEY, 5)])
    cache.unretire_all()
    source.get(cache, 5, 0, 1)  # a new order began: this read warms it again
    cache._ledger.flush_uses(force=True)
    assert not cache.room_for(BLOCK, RETIRED_BEFORE)


def test_blocks_being_read_are_not_evicted(
    open_cache: Callable[..., BlockCache], monkeypatch: pytest.MonkeyPatch
) -> None:
    cache, source = open_cache(), Source()
    for index in range(5):
        source.get(cache, index)
    held = HeldReads(monkeypatch, source)
    held.start(cache, [0, 3])  # two reads inside blocks 0 and 3 while eviction runs
    try:
        removed = cache.evict_to(0)
    finally:
        held.release()
    assert removed == 3
    assert held.results == {0: source.block(0), 3: source.block(3)}
    kept = sorted(str(cache.path_of(BlockKey(KEY, i))) for i in (0, 3))
    assert [str(p) for p in block_files(cache)] == kept
    assert cache.usage() == 2 * ENCODED == disk_bytes(cache)
    assert cache.stats.blocks_evicted == 3
    assert source.calls == list(range(5))  # the held reads were hits
    assert cache.evict_to(0) == 2  # once the reads ended, nothing holds them


# --- min_free and degrading -------------------------------------------------------------------


def fake_disk(monkeypatch: pytest.MonkeyPatch, free: int) -> None:
    usage = SimpleNamespace(total=1 << 40, used=(1 << 40) - free, free=free)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage)
    monkeypatch.setattr(shardfs.cache.ledger, "disk_free", lambda path: free)


def test_min_free_shrinks_the_bound(
    open_cache: Callable[..., BlockCache], monkeypatch: pytest.MonkeyPatch
) -> None:
    min_free = 1 << 20
    fake_disk(monkeypatch, free=min_free + 100 * ENCODED)
    cache, source = open_cache(size=str(50 * ENCODED), min_free=min_free), Source()
    assert cache.limit() == 50 * ENCODED
    for index in range(6):
        source.get(cache, index)
    assert cache.usage() == 6 * ENCODED

    fake_disk(monkeypatch, free=min_free - 2 * ENCODED)  # the disk filled up from elsewhere
    assert cache.limit() == 4 * ENCODED
    assert source.get(cache, 6) == source.block(6)
    assert cache.usage() <= 4 * ENCODED
    assert cache.usage() == disk_bytes(cache)
    assert cache.stats.blocks_evicted >= 3
    assert cache.stats.cache_write_errors == 0


def test_min_free_below_one_block_stops_writes_without_errors(
    open_cache: Callable[..., BlockCache], monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    min_free = 1 << 20
    fake_disk(monkeypatch, free=min_free - 10)
    cache, source = open_cache(size="1G", min_free=min_free), Source()
    assert cache.limit() == 0
    with caplog.at_level(logging.WARNING, logger="shardfs.cache"):
        for index in range(5):
            assert source.get(cache, index, 1, 100) == source.block(index)[1:100]
    assert block_files(cache) == []
    assert tmp_files(cache) == []
    assert cache.usage() == 0
    assert cache.stats.blocks_written == 0
    assert cache.stats.cache_write_errors >= 1
    assert len([r for r in caplog.records if "cache disk unusable" in r.message]) == 1


def fail_writes_into(monkeypatch: pytest.MonkeyPatch, folder: Path, what: str) -> None:
    """Make os.open (or os.write) fail with ENOSPC for files in ``folder``: root ignores
    chmod, so a read-only folder cannot be simulated with permissions."""
    real_open, real_write, real_writev = os.open, os.write, os.writev
    bad_fds: set[int] = set()

    def fake_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        inside = str(path).startswith(str(folder))
        if inside and what == "open":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        fd = real_open(path, flags, *args, **kwargs)
        if inside:
            bad_fds.add(fd)
        return fd

    def fake_write(fd: int, data: Any) -> int:
        if fd in bad_fds:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    def fake_writev(fd: int, buffers: Any) -> int:
        if fd in bad_fds:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_writev(fd, buffers)

    monkeypatch.setattr(os, "open", fake_open)
    monkeypatch.setattr(os, "write", fake_write)
    monkeypatch.setattr(os, "writev", fake_writev)


@pytest.mark.parametrize("what", ["open", "write"])
def test_unwritable_cache_disk_degrades_with_one_warning(
    open_cache: Callable[..., BlockCache],
    monkeypatch: pytest.MonkeyPatch,
    caplog: Any,
    what: str,
) -> None:
    cache, source = open_cache(), Source()
    fail_writes_into(monkeypatch, cache.tmp_dir, what)
    # retry the disk every time
    monkeypatch.setattr(shardfs.cache.health, "_DEGRADED_RETRY_S", 0.0)
    with caplog.at_level(logging.WARNING, logger="shardfs.cache"):
        for index in range(5):
            assert source.get(cache, index, 7, 3000) == source.block(index)[7:3000]
    assert cache.stats.cache_write_errors == 5
    assert cache.stats.blocks_written == 0
    assert block_files(cache) == []
    assert tmp_files(cache) == []
    assert cache.usage() == 0
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert "No space left on device" in warnings[0].getMessage()

    monkeypatch.undo()  # the disk recovers: writes resume
    assert source.get(cache, 9) == source.block(9)
    assert block_files(cache) == [cache.path_of(BlockKey(KEY, 9))]


def test_degraded_cache_does_not_retry_the_disk_at_once(
    open_cache: Callable[..., BlockCache], monkeypatch: pytest.MonkeyPatch
) -> None:
    cache, source = open_cache(), Source()
    fail_writes_into(monkeypatch, cache.tmp_dir, "open")
    for index in range(5):
        assert source.get(cache, index) == source.block(index)
    assert cache.stats.cache_write_errors == 1  # then 30 s without touching the disk
    assert source.calls == [0, 1, 2, 3, 4]


# --- concurrency ------------------------------------------------------------------------------


def test_threads_asking_for_one_block_fetch_it_once(
    open_cache: Callable[..., BlockCache], monkeypatch: pytest.MonkeyPatch
) -> None:
    cache, source = open_cache(), Source()
    waiting: list[int] = []
    real_outcome = shardfs.cache.claims.Flight.outcome

    def counted_outcome(self: Any) -> Any:
        waiting.append(1)
        return real_outcome(self)

    monkeypatch.setattr(shardfs.cache.claims.Flight, "outcome", counted_outcome)

    def fetch() -> bytes:
        # The fetch ends only once the seven other readers wait for it: the race happened.
        wait_for(lambda: len(waiting) == 7, "seven readers waiting for the one fetch")
        return source.fetcher(0)()

    results: dict[int, bytes] = {}
    errors: list[BaseException] = []

    def reader(n: int) -> None:
        try:
            results[n] = get(cache, BlockKey(KEY, 0), n * 100, n * 100 + 50, BLOCK, fetch)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=reader, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    assert results == {n: source.block(0)[n * 100 : n * 100 + 50] for n in range(8)}
    assert source.calls == [0]
    assert len(waiting) == 7
    assert (cache.stats.cache_misses, cache.stats.cache_hits) == (1, 7)


_WORKER = r"""
import json, os, sys, threading, time
from pathlib import Path
from shardfs.read.fills import BlockFills
from shardfs.cache import BlockCache, BlockKey
from shardfs.config import CacheConfig
from shardfs.stats import Stats

cache_dir, name, plan = Path(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
key, block = plan["key"], plan["block"]
(cache_dir / f"ready-{name}").touch()
deadline = time.monotonic() + 20
while not (cache_dir / "go").exists() and time.monotonic() < deadline:
    time.sleep(0.005)
cache = BlockCache(CacheConfig(cache_dir=cache_dir, size="64M", min_free=0,
                               block_size=block, chunk_size=512), Stats())
fills = BlockFills(cache, cache.stats)
results = {}

def content(index):
    return bytes([index % 251]) * block

def run(thread_no, delay, indexes, fetch_sleep):
    time.sleep(delay)
    for index in indexes:
        def fetch(lo, hi, index=index):
            with open(cache_dir / "fetches", "a") as f:
                f.write(f"{name} {index}\n")
            time.sleep(fetch_sleep)
            return content(index)
        try:
            data, _ = fills.read(BlockKey(key, index), 0, block, block, fetch)
            results[f"{thread_no}:{index}"] = "ok" if data == content(index) else "wrong bytes"
        except Exception as exc:
            results[f"{thread_no}:{index}"] = f"{type(exc).__name__}: {exc}"

threads = [threading.Thread(target=run, args=(n, *t)) for n, t in enumerate(plan["threads"])]
for t in threads: t.start()
for t in threads: t.join()
cache.close()
print(json.dumps(results))
"""


def run_processes(cache_dir: Path, plans: dict[str, list[tuple[float, list[int], float]]]) -> Any:
    """Start one worker process per plan, release them together, return their results and
    the fetches they made (one line per fetch, from all processes)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    procs = {}
    for name, threads in plans.items():
        plan = json.dumps({"key": KEY, "block": BLOCK, "threads": threads})
        procs[name] = subprocess.Popen(
            [sys.executable, "-c", _WORKER, str(cache_dir), name, plan],
            cwd=PROJECT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    try:
        deadline = time.monotonic() + 20
        while not all((cache_dir / f"ready-{n}").exists() for n in plans):
            assert time.monotonic() < deadline, "workers did not start"
            for proc in procs.values():
                assert proc.poll() is None, f"a worker died at start: {proc.communicate()[1]}"
            time.sleep(0.01)
        (cache_dir / "go").touch()
        results = {}
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=30)
            assert proc.returncode == 0, err
            results[name] = json.loads(out)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    fetches_file = cache_dir / "fetches"
    fetches = fetches_file.read_text().splitlines() if fetches_file.exists() else []
    return results, [int(line.split()[1]) for line in fetches]


def test_two_processes_fetch_each_block_once(cache_dir: Path) -> None:
    blocks = list(range(6))
    results, fetches = run_processes(
        cache_dir,
        {"a": [(0.0, blocks, 0.05)], "b": [(0.0, blocks, 0.05)]},
    )
    for name in ("a", "b"):
        assert set(results[name].values()) == {"ok"}, results[name]
    assert sorted(fetches) == blocks


_OPENER = r"""
import json, sys, time
from pathlib import Path
from shardfs.cache import BlockCache
from shardfs.config import CacheConfig
from shardfs.stats import Stats

root, name, trials = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
(root / f"ready-{name}").touch()
deadline = time.monotonic() + 20
while not (root / "go").exists() and time.monotonic() < deadline:
    time.sleep(0.002)
t0 = float((root / "go").read_text())
errors = []
for trial in range(trials):
    while time.time() < t0 + trial * 0.01:  # every process opens folder ``trial`` together
        pass
    try:
        config = CacheConfig(cache_dir=root / str(trial), size="1M", min_free=0)
        BlockCache(config, Stats()).close()
    except Exception as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
print(json.dumps(errors))
"""


def test_mounts_opening_a_new_folder_together_all_succeed(tmp_path: Path) -> None:
    """Four processes open each of 40 fresh cache folders at the same instant."""
    names, trials = "abcd", 40
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _OPENER, str(tmp_path), name, str(trials)],
            cwd=PROJECT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in names
    ]
    try:
        deadline = time.monotonic() + 20
        while not all((tmp_path / f"ready-{n}").exists() for n in names):
            assert time.monotonic() < deadline, "workers did not start"
            time.sleep(0.01)
        # Written whole under another name, then renamed: a worker that sees
        # "go" must never read it half-written.
        (tmp_path / "go.tmp").write_text(str(time.time() + 0.05))
        (tmp_path / "go.tmp").rename(tmp_path / "go")
        for proc in procs:
            out, err = proc.communicate(timeout=30)
            assert proc.returncode == 0, err
            assert json.loads(out) == []
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_two_multithreaded_processes_waiting_crosswise_do_not_fail(cache_dir: Path) -> None:
    """Process a holds block 0 and waits for block 1 that b holds, while b asks for block 0.

    This is no deadlock (each holder finishes its fetch), but POSIX record locks belong to
    the process, so the kernel may report EDEADLK; a read must not fail because of it.
    """
    results, fetches = run_processes(
        cache_dir,
        {
            "a": [(0.0, [0], 1.0), (0.2, [1], 0.0)],
            "b": [(0.0, [1], 1.0), (0.4, [0], 0.0)],
        },
    )
    for name in ("a", "b"):
        assert set(results[name].values()) == {"ok"}, results[name]
    assert sorted(fetches) == [0, 1]


def test_clear_cache_while_another_instance_is_open(
    cache_dir: Path, open_cache: Callable[..., BlockCache]
) -> None:
    cache, source = open_cache(), Source()
    for index in range(3):
        source.get(cache, index)
    info = cache_info(cache_dir)
    assert info["blocks"] == 3
    assert info["block_bytes"] == 3 * ENCODED

    assert clear_cache(cache_dir) == 3 * ENCODED
    info = cache_info(cache_dir)
    assert (info["blocks"], info["block_bytes"]) == (0, 0)
    assert block_files(cache) == []
    assert not list(cache_dir.glob("trash-*"))

    for index in range(3):
        assert source.get(cache, index, 1, 4000) == source.block(index)[1:4000]
    assert source.calls == [0, 1, 2, 0, 1, 2]
    assert cache.usage() == 3 * ENCODED == disk_bytes(cache)
    assert cache_info(cache_dir)["blocks"] == 3


def test_clear_cache_closes_blocks_held_open_and_they_are_refetched(
    cache_dir: Path, open_cache: Callable[..., BlockCache]
) -> None:
    """A block file read before the clear is held open; once cleared it must be neither
    served nor kept open (its disk space would stay used, invisible to the bound)."""
    cache, source = open_cache(), Source()
    for index in range(3):
        source.get(cache, index)
        assert source.get(cache, index, 0, 100) == source.block(index)[:100]  # now held open
    blocks = [str(cache.path_of(BlockKey(KEY, index))) for index in range(3)]
    assert sorted(t for t in open_targets() if t.startswith(str(cache_dir / "blocks"))) == blocks
    clear_cache(cache_dir)

    for index in range(3):
        assert source.get(cache, index, 0, 100) == source.block(index)[:100]
    assert source.calls == [0, 1, 2, 0, 1, 2]
    targets = open_targets()
    assert not [t for t in targets if t.startswith(str(cache_dir)) and t.endswith("(deleted)")]
    # The refetched blocks' files are held open (their writer keeps them), each once.
    assert sorted(t for t in targets if t.startswith(str(cache_dir / "blocks"))) == blocks


def open_targets() -> list[str]:
    """What this process's descriptors point at."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):
            found.append(os.readlink(f"/proc/self/fd/{fd}"))
    return found


def test_cache_info_of_missing_folder(tmp_path: Path) -> None:
    info = cache_info(tmp_path / "nothing")
    assert (info["blocks"], info["block_bytes"], info["index_files"]) == (0, 0, 0)


# --- keys and sizes ---------------------------------------------------------------------------


def test_shard_key_depends_on_location_size_and_etag() -> None:
    base = shard_key("s3://b/a.tar|", 100, "e1")
    assert len(base) == 32
    assert base == shard_key("s3://b/a.tar|", 100, "e1")
    others = {
        shard_key("s3://b/a.tar|http://other", 100, "e1"),
        shard_key("s3://c/a.tar|", 100, "e1"),
        shard_key("s3://b/a.tar|", 101, "e1"),
        shard_key("s3://b/a.tar|", 100, "e2"),
    }
    assert base not in others
    assert len(others) == 4


@pytest.mark.parametrize(
    ("spec", "disk", "expected"),
    [
        ("50%", 1000, 500),
        ("100%", 1000, 1000),
        (" 12.5% ", 800, 100),
        ("0.001%", 10**9, 10**4),
        ("4096", 1, 4096),
        ("64K", 1, 64 << 10),
        ("500G", 1, 500 << 30),
        ("1.5TiB", 1, int(1.5 * (1 << 40))),
    ],
)
def test_resolve_cache_size(spec: str, disk: int, expected: int) -> None:
    assert resolve_cache_size(spec, disk) == expected


@pytest.mark.parametrize("spec", ["0%", "150%", "-5%", "abc%", "%", "nan%", "abc", "-1G"])
def test_resolve_cache_size_rejects(spec: str) -> None:
    with pytest.raises(UsageError):
        resolve_cache_size(spec, 1 << 40)


# --- bookkeeping after failed writes ------------------------------------------------------------


def test_failed_rename_leaves_usage_matching_the_disk(
    open_cache: Callable[..., BlockCache], monkeypatch: pytest.MonkeyPatch
) -> None:
    cache, source = open_cache(), Source()
    source.get(cache, 0)

    def no_rename(src: Any, dst: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "replace", no_rename)
    assert source.get(cache, 1) == source.block(1)
    assert cache.stats.cache_write_errors == 1
    assert tmp_files(cache) == []
    assert cache.usage() == ENCODED == disk_bytes(cache)
    assert cache_info(cache.root)["blocks"] == 1


class LedgerFaults:
    """Statements of a cache's ledger made to fail, through the ``ledger_connect`` seam of
    ``BlockCache``: the next statement starting with ``once`` fails (once), and every one
    starting with ``always`` fails while it is set. Keeps every connection it opened."""

    def __init__(self) -> None:
        self.once = ""
        self.always = ""
        self.connections: list[sqlite3.Connection] = []

    def connect(self, path: Path) -> Any:
        conn = shardfs.cache.ledger.open_connection(path)
        self.connections.append(conn)
        return FaultyConnection(conn, self)


class FaultyConnection:
    """A ledger connection that fails the statements its ``LedgerFaults`` names."""

    def __init__(self, conn: sqlite3.Connection, faults: LedgerFaults) -> None:
        self.conn, self.faults = conn, faults

    def execute(self, sql: str, *args: Any) -> Any:
        faults = self.faults
        if faults.always and sql.startswith(faults.always):
            raise sqlite3.OperationalError("disk I/O error")
        if faults.once and sql.startswith(faults.once):
            faults.once = ""
            raise sqlite3.OperationalError("disk I/O error")
        return self.conn.execute(sql, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.conn, name)


def test_database_error_inside_a_transaction_does_not_wedge_the_cache(
    open_cache: Callable[..., BlockCache], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shardfs.cache.health, "_DEGRADED_RETRY_S", 0.0)
    faults = LedgerFaults()
    cache, source = open_cache(ledger_connect=faults.connect), Source()
    source.get(cache, 0)
    faults.once = "UPDATE total SET bytes = bytes +"
    assert source.get(cache, 1) == source.block(1)
    assert cache.stats.cache_write_errors == 1
    assert cache.usage() == ENCODED == disk_bytes(cache)

    assert source.get(cache, 2) == source.block(2)  # the next write works again
    assert cache.stats.cache_write_errors == 1
    assert cache.usage() == 2 * ENCODED == disk_bytes(cache)


def test_eviction_looks_past_many_blocks_being_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More blocks being read than one batch of candidates must not stop eviction early."""
    config = CacheConfig(cache_dir=tmp_path / "c", size="64M", min_free=0, block_size=BLOCK)
    cache, source = BlockCache(config, Stats()), Source()
    try:
        for index in range(100):
            source.get(cache, index)
        held = HeldReads(monkeypatch, source)
        held.start(cache, list(range(80)))  # the 80 oldest are being read
        try:
            used = cache.usage()
            removed = cache.evict_to(used - 10 * (used // 100))
        finally:
            held.release()
        assert removed >= 10
        assert all(cache.path_of(BlockKey(KEY, i)).exists() for i in range(80))
        assert held.results == {i: source.block(i) for i in range(80)}
    finally:
        cache.close()


# --- O_DIRECT writes ----------------------------------------------------------------------


@pytest.mark.parametrize("refuse", [False, True], ids=["direct", "refused"])
def test_blocks_are_exact_and_valid_with_or_without_o_direct(
    open_cache: Callable[..., BlockCache], monkeypatch: pytest.MonkeyPatch, refuse: bool
) -> None:
    """Direct writes are padded to the alignment and cut back; a folder that refuses
    O_DIRECT (EINVAL) gets buffered writes from then on, with identical files."""
    real_open = os.open
    direct_opens: list[str] = []

    def watching_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & os.O_DIRECT:
            direct_opens.append(str(path))
            if refuse:
                raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", watching_open)
    cache, source = open_cache(), Source()
    for index in range(3):
        assert source.get(cache, index) == source.block(index)
    assert len(direct_opens) == (1 if refuse else 3)  # refused once, then never tried again
    for index in range(3):
        path = cache.path_of(BlockKey(KEY, index))
        # O_DIRECT: padded to a whole page, with zeros (no cut: it would read the last
        # filesystem block back); buffered: the exact length.
        assert path.stat().st_size == (ENCODED if refuse else ON_DISK)
        assert path.read_bytes()[ENCODED:] == bytes(path.stat().st_size - ENCODED)
        assert_block_file_valid(cache, index, source.block(index))
    assert cache.usage() == 3 * ENCODED
    assert tmp_files(cache) == []


def _nowait_syscall_serves(path: Path, offset: int, length: int) -> bool:
    """Whether a bare ``preadv2(RWF_NOWAIT)`` of dropped pages gets their bytes (or the
    filesystem cannot tell): the platform's answer, to set the cache's against."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.preadv(fd, [bytearray(length)], offset, os.RWF_NOWAIT) > 0
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
            return True
        raise
    finally:
        os.close(fd)


def test_a_read_that_must_not_wait_skips_blocks_the_page_cache_lacks(
    open_cache: Callable[..., BlockCache],
) -> None:
    """``peek(nowait=True)`` answers from memory only: bytes on disk but not in the page
    cache give None (the caller reads them on a thread that may wait), never a disk wait."""
    size = 8 << 20  # big enough that reading the header reads no data near the end ahead
    settings = {"block_size": size, "chunk_size": 64 << 10}
    cache, source = open_cache(**settings), Source(block_len=size)
    assert source.get(cache, 0) == source.block(0)
    cache.close()  # no open block files kept: the next read opens and reads from scratch
    [path] = block_files(cache)
    cache = open_cache(**settings)
    key, start, end = BlockKey(KEY, 0), size - 100_000, size - 1000
    # Dropped and checked gone (mincore) right before each try. A busy kernel may read
    # pages back in between, and some disks complete the readahead that RWF_NOWAIT starts
    # before the kernel looks again (CI saw the bytes five times running): so a try in
    # which the cache got bytes is repeated with the bare syscall, in the same state. A
    # cache that ignored nowait gets bytes where the syscall is refused, and fails.
    answers, platform_serves = [], 0
    for _ in range(5):
        drop_from_page_cache(path, size - 200_000)
        answers.append(cache.peek(key, start, end, size, nowait=True))
        if answers[-1] is None:
            break
        drop_from_page_cache(path, size - 200_000)
        platform_serves += _nowait_syscall_serves(path, start, end - start)
    if answers[-1] is not None and platform_serves == len(answers):
        pytest.skip("this disk serves dropped pages to RWF_NOWAIT reads: nothing to tell")
    assert answers[-1] is None, f"peek(nowait=True) read dropped bytes {len(answers)} times"
    assert cache.peek(key, start, end, size) == source.block(0)[start:end]  # may wait
    assert cache.peek(key, start, end, size, nowait=True) == source.block(0)[start:end]
    assert source.calls == [0]  # all of it without a second fetch


# --- failures shared, per-path errors, a damaged ledger -----------------------------------


def test_waiters_share_a_failed_fetch_instead_of_refetching(
    open_cache: Callable[..., BlockCache], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shardfs.cache.claims, "_FAILURE_HOLD_S", 0.0)
    cache, source = open_cache(), Source()
    error = StoreReadError("train-000.tar: store unreachable")
    started, release = threading.Event(), threading.Event()
    calls: list[int] = []
    waiting: list[int] = []
    real_outcome = shardfs.cache.claims.Flight.outcome

    def counted_outcome(self: Any) -> Any:
        waiting.append(1)
        return real_outcome(self)

    monkeypatch.setattr(shardfs.cache.claims.Flight, "outcome", counted_outcome)

    def failing() -> bytes:
        calls.append(0)
        started.set()
        release.wait(30)
        raise error

    caught: list[BaseException] = []

    def reader() -> None:
        try:
            get(cache, BlockKey(KEY, 0), 0, 100, BLOCK, failing)
        except StoreReadError as exc:
            caught.append(exc)

    threads = [threading.Thread(target=reader) for _ in range(5)]
    threads[0].start()
    assert started.wait(10)
    for thread in threads[1:]:
        thread.start()
    wait_for(lambda: len(waiting) == 4, "four readers waiting for the failing fetch")
    release.set()
    for thread in threads:
        thread.join(10)
    assert calls == [0]  # one fetch; its four waiters got its failure, not a fetch each
    assert len(caught) == 5 and all(exc is error for exc in caught)
    assert source.get(cache, 0) == source.block(0)  # a later read tries again


@pytest.mark.parametrize("squat", ["folder-at-block", "file-at-shard-folder"])
def test_a_path_squatting_one_block_costs_that_block_only(
    open_cache: Callable[..., BlockCache], caplog: Any, squat: str
) -> None:
    cache, source = open_cache(), Source()
    path = cache.path_of(BlockKey(KEY, 1))
    if squat == "folder-at-block":
        path.mkdir(parents=True)
        (path / "inside").write_text("x")
    else:
        path.parent.parent.mkdir(parents=True)
        path.parent.write_text("a file where the shard's folder belongs")
    with caplog.at_level(logging.WARNING, logger="shardfs.cache"):
        for index in range(4):
            for _ in range(2):
                assert source.get(cache, index) == source.block(index)
    assert not cache.degraded
    if squat == "folder-at-block":
        assert source.calls == [0, 1, 1, 2, 3]  # block 1 from the store each time, once else
        assert sorted(p.name for p in block_files(cache)) == ["0", "2", "3", "inside"]
    else:  # blocks 0 to 3 share the shard folder that a file occupies
        assert source.calls == [0, 0, 1, 1, 2, 2, 3, 3]
    assert cache.stats.cache_write_errors >= 1
    assert all("cache disk unusable" not in r.getMessage() for r in caplog.records)


def test_damaged_ledger_is_rebuilt_from_the_block_files(
    open_cache: Callable[..., BlockCache], cache_dir: Path, caplog: Any
) -> None:
    first, source = open_cache(), Source()
    for index in range(3):
        source.get(first, index)
    used = first.usage()
    first.close()
    for suffix in ("", "-wal", "-shm"):
        Path(f"{cache_dir / 'cache.sqlite'}{suffix}").unlink(missing_ok=True)
    (cache_dir / "cache.sqlite").write_bytes(b"\x00garbage" * 512)
    with caplog.at_level(logging.WARNING, logger="shardfs.cache"):
        second = open_cache()
    assert second.usage() == used
    for index in range(3):
        assert source.get(second, index) == source.block(index)
    assert source.calls == [0, 1, 2]  # nothing fetched again
    assert len([r for r in caplog.records if "rebuilt it from 3" in r.getMessage()]) == 1


def test_a_failed_block_fails_at_once_for_a_moment_then_is_fetched_again(
    open_cache: Callable[..., BlockCache], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel follows a failed readahead with an immediate page READ: that READ gets the
    same failure at once instead of waiting out a second deadline; later reads refetch."""
    monkeypatch.setattr(shardfs.cache.claims, "_FAILURE_HOLD_S", 0.3)
    cache, source = open_cache(), Source()
    error = StoreReadError("train-000.tar: no answer within 30 s")
    calls: list[int] = []

    def failing() -> bytes:
        calls.append(0)
        raise error

    with pytest.raises(StoreReadError) as first:
        get(cache, BlockKey(KEY, 0), 0, 100, BLOCK, failing)
    with pytest.raises(StoreReadError) as second:
        get(cache, BlockKey(KEY, 0), 0, 100, BLOCK, failing)
    assert first.value is error and second.value is error
    assert calls == [0]
    assert source.get(cache, 1) == source.block(1)  # other blocks are not held

    deadline = time.monotonic() + 10
    data = None
    while data is None and time.monotonic() < deadline:
        try:
            data = source.get(cache, 0)
        except StoreReadError:
            time.sleep(0.05)
    assert data == source.block(0)
    assert calls == [0]  # the refetch went to the working source


# --- errors that must not cost a good block or the bound ---------------------------------------


# --- claims: the one right to fetch and store a block --------------------------------------


def test_a_block_is_stored_only_under_a_claim_its_caller_owns(
    open_cache: Callable[..., BlockCache],
) -> None:
    cache, source = open_cache(), Source()
    key = BlockKey(KEY, 0)
    claim = cache.claim(key)
    assert claim.owner and cache.in_flight(key)
    assert cache.claim(key, wait=False) is None  # held: a prefetch would fetch nothing
    assert cache.put(claim, source.block(0)) is True
    claim.release()
    claim.release()  # once only: a second release lets nobody else in twice
    assert not cache.in_flight(key)
    with pytest.raises(ValueError, match="without owning"):
        cache.put(claim, source.block(0))  # released: no longer the owner's to store
    assert cache.peek(key, 0, BLOCK, BLOCK) == source.block(0)
    assert_block_file_valid(cache, 0, source.block(0))


def test_waiting_for_a_fetch_neither_claims_the_block_nor_waits_when_none_runs(
    open_cache: Callable[..., BlockCache],
) -> None:
    cache, source = open_cache(), Source()
    key = BlockKey(KEY, 0)
    assert cache.wait_flight(key, 5.0) is False  # nobody fetches it: no wait, no claim
    assert not cache.in_flight(key)
    claim = cache.claim(key)
    waited: list[bool] = []
    waiter = threading.Thread(target=lambda: waited.append(cache.wait_flight(key, 30.0)))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # held while the owner fetches
    cache.put(claim, source.block(0))
    claim.release()
    waiter.join(30)
    assert waited == [True]
    assert cache.peek(key, 0, BLOCK, BLOCK) == source.block(0)


def count_waiters(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per thread that starts waiting for another thread's claim."""
    waiting: list[int] = []
    real_outcome = shardfs.cache.claims.Flight.outcome

    def counted_outcome(self: Any) -> Any:
        waiting.append(1)
        return real_outcome(self)

    monkeypatch.setattr(shardfs.cache.claims.Flight, "outcome", counted_outcome)
    return waiting


def test_a_claim_handed_to_another_thread_lets_the_waiters_in_when_that_thread_ends(
    open_cache: Callable[..., BlockCache], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A split miss hands its claim to a fill thread: a reader of the block waits for that
    thread (not for the one that claimed), then reads what it stored."""
    cache, source = open_cache(), Source()
    key = BlockKey(KEY, 0)
    claim = cache.claim(key)
    waiting = count_waiters(monkeypatch)
    results: list[bytes] = []

    def reader() -> None:
        results.append(get(cache, key, 0, BLOCK, BLOCK, source.fetcher(0)))

    def fill() -> None:
        with claim:
            cache.put(claim, source.block(0))

    read = threading.Thread(target=reader)
    read.start()
    wait_for(lambda: len(waiting) == 1, "the reader to wait for the claim")
    filler = threading.Thread(target=fill)
    filler.start()
    filler.join(30)
    read.join(30)
    assert results == [source.block(0)]
    assert source.calls == []  # the reader waited for the fill and fetched nothing
    assert cache.stats.cache_hits == 1


def test_a_claim_released_after_close_touches_no_descriptor(
    open_cache: Callable[..., BlockCache], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fill that outlives the cache releases its claim after ``close``: nothing is
    unlocked on the closed fd, whose number a later open may have reused."""
    cache = open_cache()
    claim = cache.claim(BlockKey(KEY, 0))
    unlocked: list[int] = []
    monkeypatch.setattr(shardfs.cache.claims, "unlock_byte", lambda fd, slot: unlocked.append(fd))
    cache.close()
    claim.release()
    assert unlocked == []
    assert not cache.in_flight(BlockKey(KEY, 0))  # its waiters were let in all the same
    with pytest.raises(OSError) as closed:
        cache.claim(BlockKey(KEY, 1))
    assert closed.value.errno == errno.EBADF


def test_waiters_share_a_block_that_could_not_be_stored(
    open_cache: Callable[..., BlockCache], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A block the cache cannot keep (here: the bound is smaller than one block, so the
    write fails and caching pauses) goes from its owner to its waiters: one fetch."""
    cache, source = open_cache(size="1K"), Source()
    waiting = count_waiters(monkeypatch)

    def fetch() -> bytes:
        wait_for(lambda: len(waiting) == 3, "three readers waiting for the one fetch")
        return source.fetcher(0)()

    results: dict[int, bytes] = {}
    threads = [
        threading.Thread(
            target=lambda n=n: results.__setitem__(
                n, get(cache, BlockKey(KEY, 0), n, n + 10, BLOCK, fetch)
            )
        )
        for n in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert results == {n: source.block(0)[n : n + 10] for n in range(4)}
    assert source.calls == [0]
    assert block_files(cache) == []  # nothing stored: shared from memory
    assert cache.degraded


def test_an_unreadable_ledger_total_never_lets_a_block_past_the_bound(
    open_cache: Callable[..., BlockCache],
) -> None:
    """With the ledger's total unreadable, the cache cannot know its usage: it admits no
    block (the reader still gets its bytes), instead of taking the usage for -1 bytes."""
    faults = LedgerFaults()
    cache, source = open_cache(size=str(2 * ENCODED), ledger_connect=faults.connect), Source()
    source.get(cache, 0)
    source.get(cache, 1)
    assert cache.usage() == 2 * ENCODED == cache.limit()
    faults.always = "SELECT bytes FROM total"
    try:
        assert cache.usage() == 2 * ENCODED  # reported: the last total the ledger gave
        assert cache.room_for(BLOCK, EVICT_ANY) is False
        with pytest.raises(NoRoom):
            get(cache, BlockKey(KEY, 2), 0, BLOCK, BLOCK, source.fetcher(2), evict_before=0.0)
        assert source.get(cache, 3) == source.block(3)  # served, not kept
    finally:
        faults.always = ""
    assert source.calls == [0, 1, 3]
    assert [p.name for p in block_files(cache)] == ["0", "1"]
    assert cache.usage() == 2 * ENCODED == disk_bytes(cache) == cache.limit()
    assert cache.stats.cache_write_errors == 1


def test_closing_the_cache_closes_every_threads_ledger_connection(
    open_cache: Callable[..., BlockCache],
) -> None:
    """Each thread that used the cache has its own SQLite connection; close() closes them
    all, not only the calling thread's (issue 13 item 3)."""
    faults = LedgerFaults()
    cache, source = open_cache(ledger_connect=faults.connect), Source()
    barrier = threading.Barrier(4)

    def use(index: int) -> None:
        barrier.wait(10)  # four threads at once: four connections
        assert source.get(cache, index) == source.block(index)

    threads = [threading.Thread(target=use, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    connections = faults.connections
    assert len(connections) >= 4
    cache.close()
    for conn in connections:
        with pytest.raises(sqlite3.ProgrammingError):
            conn.execute("SELECT 1")


def test_a_block_received_into_landing_memory_is_written_from_it(
    open_cache: Callable[..., BlockCache], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``landing`` memory is written in place: no second buffer is taken for the write, and
    the block reads back exactly; a block in plain bytes takes one to be copied into."""
    cache = open_cache()
    landing = cache._writer.landing
    data = random.Random(5).randbytes(BLOCK)
    view = cache.landing(BLOCK)
    view[:] = data
    takes: list[int] = []
    original = landing.take
    monkeypatch.setattr(landing, "take", lambda n: takes.append(n) or original(n))
    key = BlockKey(KEY, 0)
    with cache.claim(key) as claim:
        assert cache.put(claim, view)
    assert takes == []  # written from where it was received
    assert cache.peek(key, 0, BLOCK, BLOCK) == data
    with cache.claim(BlockKey(KEY, 1)) as claim:
        assert cache.put(claim, data)
    assert takes == [BLOCK]  # copied into an aligned buffer first
    assert cache.peek(BlockKey(KEY, 1), 0, BLOCK, BLOCK) == data


def test_room_held_for_a_gets_later_blocks_is_handed_to_their_store(
    open_cache: Callable[..., BlockCache],
) -> None:
    """One GET bringing several blocks holds room for the later ones until each is stored:
    room counted once, by nobody else meanwhile, and given back when not used."""
    from shardfs.cache import EVICT_NONE

    cache = open_cache(size=str(4 * ENCODED))
    shares = cache.hold([BLOCK] * 6, EVICT_NONE)
    assert shares == [ENCODED] * 4  # the leading blocks that fit
    assert not cache.room_for(BLOCK)  # another fetch finds none
    with cache.reserving(BLOCK, EVICT_NONE) as reserved:
        assert not reserved
    with cache.reserving(BLOCK, EVICT_NONE, held=shares[0]) as reserved:
        assert reserved  # the held share became this store's reservation
        assert not cache.room_for(BLOCK)
    # Nothing was stored: leaving gave that share back. Three blocks free, one kept spare:
    cache.release(sum(shares[1:3]))
    assert cache.hold([BLOCK] * 3, EVICT_NONE, spare=ENCODED) == [ENCODED] * 2
    cache.release(2 * ENCODED + shares[3])
    assert cache.hold([BLOCK] * 5, EVICT_NONE) == [ENCODED] * 4  # all given back
    assert cache.hold([BLOCK], EVICT_ANY) == [0]  # evicting anything: nothing to hold

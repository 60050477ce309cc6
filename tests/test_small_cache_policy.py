"""A block cache smaller than the data (issue 12), at the reader: a shuffled epoch fetches at
most the data once, whatever the cache's size, while plain LRU fetches a block per file.
Bytes are counted where they leave the store (the reader's statistics, checked against a
store that counts its own ranged reads)."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from shardfs.cache import RETIRED_BEFORE, BlockCache, BlockKey
from shardfs.config import CacheConfig, SourceConfig
from shardfs.read import reader as reader_module
from shardfs.read.files_ahead import OPENED_GRACE_S
from shardfs.read.fills import BlockFills
from shardfs.read.reader import ROOM_CHECK_S, CachedReader
from shardfs.stats import Stats
from shardfs.store.remote import Store
from shardfs.store.responses import Fetched, Landing
from shardfs.store.shards import ShardInfo

BLOCK = 4096
FILE = 300  # about 13 files per block: a whole block per miss costs about 13x
BLOCKS_PER_SHARD = 48
SHARDS = 4


class CountingStore(Store):
    """A local-folder store that counts the bytes its ranged reads return (its own count,
    beside the one it keeps in ``stats``)."""

    def __init__(self, url: str, stats: Stats) -> None:
        super().__init__(SourceConfig(url), stats)
        self.fetched = 0

    def fetch(
        self,
        shard: ShardInfo,
        start: int,
        end: int,
        piece: int,
        *,
        retries: int = 4,
        scan: bool = False,
        land: Landing | None = None,
    ) -> Fetched:
        """Every ranged read, whole or in pieces, comes through here."""
        got = super().fetch(shard, start, end, piece, retries=retries, scan=scan, land=land)
        self.fetched += sum(map(len, got.pieces))
        return got


def make_shards(folder: Path, prefix: str = "s", seed: int = 0) -> dict[str, bytes]:
    rng = random.Random(seed)
    shards = {f"{prefix}{i}.tar": rng.randbytes(BLOCK * BLOCKS_PER_SHARD) for i in range(SHARDS)}
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in shards.items():
        (folder / name).write_bytes(data)
    return shards


def files_of(store: Store) -> list[tuple[ShardInfo, int, int]]:
    """Every 'file' of the data: consecutive extents of ``FILE`` bytes in each shard."""
    return [
        (shard, start, min(start + FILE, shard.size))
        for shard in store.list_shards()
        for start in range(0, shard.size, FILE)
    ]


def data_bytes(store: Store) -> int:
    return sum(shard.size for shard in store.list_shards())


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return tmp_path / "store"


def open_cache(tmp_path: Path, fraction: float, stats: Stats) -> BlockCache:
    """A cache holding ``fraction`` of the shards' blocks (headers included)."""
    header = 64 + 8 * (BLOCK // 512)  # generous: the bound counts header bytes too
    blocks = int(fraction * SHARDS * BLOCKS_PER_SHARD)
    config = CacheConfig(
        cache_dir=tmp_path / "cache",
        size=str(blocks * (BLOCK + header)),
        min_free=0,
        block_size=BLOCK,
        chunk_size=512,
    )
    return BlockCache(config, stats)


def bounded_reader(
    tmp_path: Path, folder: Path, fraction: float
) -> tuple[dict[str, bytes], Stats, CountingStore, BlockCache, CachedReader]:
    """Fresh shards, and a reader over a cache of ``fraction`` of them that knows the
    data's size (a cache smaller than the data); the caller closes the cache."""
    shards = make_shards(folder)
    stats = Stats()
    store = CountingStore(str(folder), stats)
    cache = open_cache(tmp_path, fraction, stats)
    reader = CachedReader(store, cache, stats, retries=1, dataset_bytes=data_bytes(store))
    return shards, stats, store, cache, reader


def epoch(reader: CachedReader, store: CountingStore, shards: dict[str, bytes], seed: int) -> float:
    """Read every file once in a shuffled order; the bytes fetched over the data's size."""
    files = files_of(store)
    random.Random(seed).shuffle(files)
    before = store.fetched
    for shard, start, end in files:
        assert reader.read(shard, start, end, end) == shards[shard.name][start:end]
    return (store.fetched - before) / data_bytes(store)


@pytest.fixture
def cached(tmp_path: Path) -> Iterator[tuple[BlockCache, Stats]]:
    stats = Stats()
    cache = open_cache(tmp_path, 0.5, stats)
    yield cache, stats
    cache.close()


@pytest.mark.parametrize("fraction", [0.5, 0.25])
def test_shuffled_epochs_fetch_the_data_at_most_once(
    tmp_path: Path, folder: Path, fraction: float
) -> None:
    shards, stats, store, cache, reader = bounded_reader(tmp_path, folder, fraction)
    try:
        first = epoch(reader, store, shards, seed=1)
        second = epoch(reader, store, shards, seed=2)
    finally:
        cache.close()
    print(f"\ncache {fraction}: epoch 0 {first:.2f}x, epoch 1 {second:.2f}x")
    assert first <= 1.0
    # What the full cache holds is not fetched again: at most the rest of the data is.
    assert second <= 1.0 - fraction * 0.8
    assert stats.snapshot()["bytes_fetched"] == store.fetched
    assert stats.blocks_evicted == 0
    assert stats.range_reads > 0


def test_plain_lru_fetches_a_block_per_file(tmp_path: Path, folder: Path) -> None:
    """The contrast that shows the epochs above can fail: without the rule (a reader that
    does not know the data's size evicts least recently used blocks), a shuffled epoch
    fetches several times the data."""
    shards = make_shards(folder)
    stats = Stats()
    store = CountingStore(str(folder), stats)
    cache = open_cache(tmp_path, 0.5, stats)
    reader = CachedReader(store, cache, stats, retries=1)
    try:
        first = epoch(reader, store, shards, seed=1)
    finally:
        cache.close()
    print(f"\nplain LRU, cache 0.5: epoch 0 {first:.2f}x")
    assert first > 3.0
    assert stats.blocks_evicted > 0


def test_a_cache_that_holds_the_data_still_fetches_whole_blocks(
    tmp_path: Path, folder: Path
) -> None:
    shards, stats, store, cache, reader = bounded_reader(tmp_path, folder, 1.5)
    try:
        first = epoch(reader, store, shards, seed=1)
        second = epoch(reader, store, shards, seed=2)
    finally:
        cache.close()
    assert first == 1.0  # every block once, as whole blocks
    assert second == 0.0
    assert stats.range_reads == 0
    assert stats.store_requests == SHARDS * BLOCKS_PER_SHARD


def test_the_reader_says_whether_its_cache_holds_the_dataset(tmp_path: Path) -> None:
    """One answer for the hint (stream or keep) and for pieces units (whole or by range):
    the cache's bound, plus what is kept beside it, against the dataset's size."""
    stats = Stats()
    cache = open_cache(tmp_path, 0.5, stats)
    try:
        limit = cache.limit()
        store = CountingStore(str(tmp_path), stats)
        assert CachedReader(store, cache, stats, retries=1).cache_holds_dataset()  # unknown
        bigger = CachedReader(store, cache, stats, retries=1, dataset_bytes=limit + 10)
        assert not bigger.cache_holds_dataset()
        assert not bigger.cache_holds_dataset(beside=9)
        assert bigger.cache_holds_dataset(beside=10)
        held = CachedReader(store, cache, stats, retries=1, dataset_bytes=limit)
        assert held.cache_holds_dataset()
    finally:
        cache.close()


def test_blocks_no_read_uses_for_an_epoch_give_way(tmp_path: Path) -> None:
    """A cache full of another dataset's blocks: once this reader has read as much as its
    data without touching them, they are cold and its own blocks replace them, so its
    later epochs cost less than the first."""
    old_shards = make_shards(tmp_path / "old", prefix="old", seed=5)
    new_shards = make_shards(tmp_path / "new", prefix="new", seed=6)
    stats = Stats()
    cache = open_cache(tmp_path, 0.5, stats)
    try:
        old_store = CountingStore(str(tmp_path / "old"), stats)
        old = CachedReader(old_store, cache, stats, retries=1, dataset_bytes=data_bytes(old_store))
        epoch(old, old_store, old_shards, seed=1)
        assert stats.range_reads > 0  # the cache is full of the old data
        store = CountingStore(str(tmp_path / "new"), stats)
        reader = CachedReader(store, cache, stats, retries=1, dataset_bytes=data_bytes(store))
        costs = [epoch(reader, store, new_shards, seed=s) for s in range(3)]
    finally:
        cache.close()
    print(f"\nepochs over a cache full of other data: {[f'{c:.2f}' for c in costs]}")
    # The old blocks go cold only once an epoch's worth was read: blocks taken in after
    # that had some of their files read already, a little over the data's size at most.
    assert costs[0] <= 1.02
    assert costs[1] <= 1.02
    assert stats.blocks_evicted > 0
    assert costs[2] <= 0.5 + 0.1  # half the data is cached now; the rest by range
    assert costs[2] < costs[0]


def test_prefetched_blocks_evicted_unread_are_counted(tmp_path: Path, folder: Path) -> None:
    shards = make_shards(folder)
    stats = Stats()
    store = CountingStore(str(folder), stats)
    cache = open_cache(tmp_path, 0.25, stats)
    try:
        first = CachedReader(store, cache, stats, retries=1)
        fills = BlockFills(cache, stats)
        # Blocks fetched ahead of need (no read touches them) until the cache is full.
        for shard in store.list_shards():
            for index in range(BLOCKS_PER_SHARD):
                key = BlockKey(first.shard_key(shard), index)

                def fetch(lo: int, hi: int, shard: ShardInfo = shard, index: int = index) -> bytes:
                    base = index * BLOCK
                    return store.read_range(shard, base + lo, base + hi, retries=1)

                fills.prefetch(key, BLOCK, fetch)
        assert stats.evicted_unread_bytes == 0
        held = stats.prefetched_blocks
        assert held > 0
        # A plain-LRU reader now evicts them for its own misses, none of them read.
        reader = CachedReader(store, cache, stats, retries=1)
        shard = store.list_shards()[-1]
        for index in range(BLOCKS_PER_SHARD):
            start = index * BLOCK
            assert reader.read(shard, start, start + FILE) == shards[shard.name][start:][:FILE]
    finally:
        cache.close()
    assert stats.blocks_evicted > 0
    assert stats.evicted_unread_bytes > 0
    assert stats.evicted_unread_bytes >= BLOCK  # at least one whole block, header included


def test_the_live_set_counts_blocks_between_their_first_and_last_read() -> None:
    """What decides whether a hint streams: the most blocks in use at one position."""
    from shardfs.core.order_hints import _most_live

    # positions 0-5: block a read at 0-2, b at 1-3, c at 5 alone; d at 2-4
    assert _most_live([0, 1, 5, 2], [2, 3, 5, 4], 6) == 3  # a, b and d at position 2
    assert _most_live([0, 3], [2, 5], 6) == 1  # one after the other
    assert _most_live([], [], 0) == 0


class _InlinePrefetcher:
    """Runs each scheduled task at once, in order (what ``Prefetcher`` does on threads)."""

    def schedule(self, tasks: Iterator[Any] | list[Any], *, hinted: bool = False) -> int:
        count = 0
        for task in tasks:
            task()
            count += 1
        return count

    def run_soon(self, task: Any) -> None:
        task()


def test_a_file_fetched_ahead_leaves_out_the_block_the_cache_holds(
    tmp_path: Path, folder: Path
) -> None:
    """A hinted file straddling a cached block and a missing one, with the cache full, is
    fetched ahead for the missing block's part alone: no byte is paid for twice, and its
    read takes the two parts from the cache and from memory."""
    shards = make_shards(folder)
    stats = Stats()
    store = CountingStore(str(folder), stats)
    cache = open_cache(tmp_path, 0.25, stats)
    reader = CachedReader(
        store,
        cache,
        stats,
        retries=1,
        dataset_bytes=data_bytes(store),
    )
    try:
        by_name = {s.name: s for s in store.list_shards()}
        shard = by_name["s1.tar"]
        # The cache filled by reads (no readahead yet): s1 from block 5 on, then s0.
        blocks = [(shard, i) for i in range(5, BLOCKS_PER_SHARD)]
        blocks += [(by_name["s0.tar"], i) for i in range(BLOCKS_PER_SHARD)]
        for info, index in blocks:
            if not cache.room_for(BLOCK, RETIRED_BEFORE):
                break
            reader.read(info, index * BLOCK, index * BLOCK + 1, None)
        reader.prefetcher = _InlinePrefetcher()  # type: ignore[assignment]
        assert reader.wants_files_ahead()
        skey = reader.shard_key(shard)
        assert not cache.contains(BlockKey(skey, 4)) and cache.contains(BlockKey(skey, 5))
        start, end = 5 * BLOCK - 200, 5 * BLOCK + 100
        before = store.fetched
        assert reader.prefetch_files([(shard, start, end)]) == 1
        assert store.fetched - before == 200  # the missing block's part, nothing more
        assert reader.read(shard, start, end, end) == shards["s1.tar"][start:end]
        assert store.fetched - before == 200
        assert stats.files_ahead_read == 1
        # A file the cache holds whole is not fetched ahead at all.
        assert reader.prefetch_files([(shard, 6 * BLOCK, 6 * BLOCK + 300)]) == 0
    finally:
        cache.close()


def test_an_order_hint_looks_at_the_room_seldom_while_much_is_free_and_often_when_not(
    tmp_path: Path, folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``wants_files_ahead`` (asked on every hinted read) looks at the cache's room (a
    ledger query and a statvfs) at most every ``ROOM_CHECK_S`` while the cache is near
    full; while it has room for many blocks, only once fetches at ``FASTEST_FILL`` could
    have filled it. A look finds a cache filled meanwhile."""
    _, _, store, cache, reader = bounded_reader(tmp_path, folder, 0.25)
    reader.prefetcher = _InlinePrefetcher()  # type: ignore[assignment]
    clock = [1000.0]
    monkeypatch.setattr(reader_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    looks: list[int] = []
    look = cache.look
    monkeypatch.setattr(cache, "look", lambda *args: looks.append(1) or look(*args))
    # the empty cache's room would take 0.5 s to fill at FASTEST_FILL
    monkeypatch.setattr(reader_module, "FASTEST_FILL", look(BLOCK)[1] / 0.5)
    try:
        assert not reader.wants_files_ahead() and len(looks) == 1
        clock[0] += 0.4
        assert not reader.wants_files_ahead() and len(looks) == 1  # not looked at again
        by_name = {s.name: s for s in store.list_shards()}
        for index in range(BLOCKS_PER_SHARD):  # the cache fills meanwhile
            if not cache.room_for(BLOCK, RETIRED_BEFORE):
                break
            reader.read(by_name["s0.tar"], index * BLOCK, index * BLOCK + 1, None)
        assert not reader.wants_files_ahead() and len(looks) == 1
        clock[0] += 0.11
        assert reader.wants_files_ahead() and len(looks) == 2  # full: seen at the next look
        clock[0] += ROOM_CHECK_S * 0.8
        assert reader.wants_files_ahead() and len(looks) == 2
        clock[0] += ROOM_CHECK_S * 0.4
        assert reader.wants_files_ahead() and len(looks) == 3  # near full: looked at often
    finally:
        cache.close()


def test_a_file_fetched_ahead_is_handed_to_the_pusher_and_let_go_at_its_open(
    tmp_path: Path, folder: Path
) -> None:
    """With the cache full, a hinted file fetched ahead is told to the block listeners (the
    kernel pusher puts it into the page cache, so no READ need come); its bytes stay held
    until the hint says a reader opened it."""
    shards, stats, store, cache, reader = bounded_reader(tmp_path, folder, 0.25)
    told: list[tuple[str, int, int, bytes]] = []
    reader.local_blocks.subscribe(
        lambda shard, start, end, block: told.append((shard.name, start, end, bytes(block or b"")))
    )
    try:
        by_name = {s.name: s for s in store.list_shards()}
        for index in range(BLOCKS_PER_SHARD):  # fill the cache with s0's blocks
            if not cache.room_for(BLOCK, RETIRED_BEFORE):
                break
            reader.read(by_name["s0.tar"], index * BLOCK, index * BLOCK + 1, None)
        told.clear()
        reader.prefetcher = _InlinePrefetcher()  # type: ignore[assignment]
        assert reader.wants_files_ahead()
        shard, start, end = by_name["s2.tar"], 3 * BLOCK + 10, 3 * BLOCK + 310
        before = store.fetched
        assert reader.prefetch_files([(shard, start, end)]) == 1
        assert told == [("s2.tar", start, end, shards["s2.tar"][start:end])]
        assert reader.holds_files_ahead
        reader.files_opened([(by_name["s1.tar"], start, end), (shard, start, end)])
        assert reader.holds_files_ahead  # a READ may still follow the open, for a while
        time.sleep(OPENED_GRACE_S + 0.05)
        reader.files_opened([])  # the next batch of opens lets go of it
        assert not reader.holds_files_ahead and stats.files_ahead_opened == 1
        assert store.fetched - before == 300
    finally:
        cache.close()


def test_a_kept_block_pays_for_its_bytes_once_whatever_order_its_files_are_read_in(
    tmp_path: Path, folder: Path
) -> None:
    """A block a readahead GET brought but could not store is kept in memory. With the
    cache full, its files are read as ranges in any order: each takes its bytes from the
    kept block, and a file running into a block not held fetches only its part there, even
    after a read that ended where the kept block ends (stop 41's plain shuffle=True epoch
    fetched a file twice after such a read)."""
    shards, stats, store, cache, reader = bounded_reader(tmp_path, folder, 0.25)
    try:
        by_name = {s.name: s for s in store.list_shards()}
        shard, data = by_name["s1.tar"], shards["s1.tar"]
        blocks = [(shard, i) for i in range(5, BLOCKS_PER_SHARD)]
        blocks += [(by_name["s0.tar"], i) for i in range(BLOCKS_PER_SHARD)]
        for info, index in blocks:  # the cache filled: s1 from block 5 on, then s0
            if not cache.room_for(BLOCK, RETIRED_BEFORE):
                break
            reader.read(info, index * BLOCK, index * BLOCK + 1, None)
        skey = reader.shard_key(shard)
        assert cache.contains(BlockKey(skey, 5)) and not cache.contains(BlockKey(skey, 4))
        reader.keep_unstored(shard, skey, 4, data[4 * BLOCK : 5 * BLOCK])
        reader.keep_unstored(shard, skey, 2, data[2 * BLOCK : 3 * BLOCK])
        assert stats.blocks_kept_unstored == 2

        def fetched_for(start: int, end: int) -> int:
            before = store.fetched
            assert reader.read(shard, start, end, end) == data[start:end]
            return store.fetched - before

        # into the cached block 5: the read ends where the kept block ends
        assert fetched_for(5 * BLOCK - 100, 5 * BLOCK + 100) == 0
        assert fetched_for(4 * BLOCK + 500, 4 * BLOCK + 800) == 0  # still kept
        assert fetched_for(4 * BLOCK - 100, 4 * BLOCK + 100) == 100  # block 3's part only
        assert fetched_for(3 * BLOCK - 60, 3 * BLOCK + 40) == 40  # from kept 2 into 3
        assert fetched_for(2 * BLOCK - 30, 2 * BLOCK + 30) == 30  # from block 1 into kept 2
        assert fetched_for(2 * BLOCK + 100, 2 * BLOCK + 400) == 0
        assert stats.range_reads == 6
    finally:
        cache.close()


@pytest.mark.parametrize("fetched_by", ["a read", "readahead"])
def test_a_block_fetched_but_not_stored_pays_for_its_files_once(
    tmp_path: Path, folder: Path, monkeypatch: pytest.MonkeyPatch, fetched_by: str
) -> None:
    """A whole block fetched whose store then fails (its room went to another fetch, or the
    write failed) is held in memory: its other files are read from there, not fetched
    again, by a read (a shard-mode epoch paid 1 MB twice so: stop 43) or by readahead."""
    shards, stats, store, cache, reader = bounded_reader(tmp_path, folder, 0.5)
    try:
        shard = next(s for s in store.list_shards() if s.name == "s2.tar")
        data, start = shards["s2.tar"], 7 * BLOCK
        monkeypatch.setattr(cache, "put", lambda *args, **kwargs: False)
        if fetched_by == "a read":
            end = start + FILE
            assert reader.read(shard, start, end, end) == data[start:end]
        else:
            reader.prefetcher = _InlinePrefetcher()  # type: ignore[assignment]
            reader.prefetch_blocks([(shard, 7)])
        assert store.fetched == BLOCK  # the whole block, once
        assert not cache.contains(BlockKey(reader.shard_key(shard), 7))
        for at in range(start, start + BLOCK, FILE):
            end = min(at + FILE, start + BLOCK)
            assert reader.read(shard, at, end, end) == data[at:end]
        assert store.fetched == BLOCK, "a file of the block was fetched again"
        assert stats.blocks_kept_unstored == 1
    finally:
        cache.close()


def _hinted_full_cache(
    tmp_path: Path, folder: Path
) -> tuple[dict[str, bytes], Stats, CountingStore, BlockCache, CachedReader, list[Any]]:
    """A 0.25x cache filled with s0's blocks, its reader following a hint; and s0's blocks,
    which ``retire_blocks`` turns into room."""
    shards, stats, store, cache, reader = bounded_reader(tmp_path, folder, 0.25)
    s0 = next(s for s in store.list_shards() if s.name == "s0.tar")
    s0_blocks = [(s0, i) for i in range(BLOCKS_PER_SHARD)]
    for info, index in s0_blocks:
        if not cache.room_for(BLOCK, RETIRED_BEFORE):
            break
        reader.read(info, index * BLOCK, index * BLOCK + 1, None)
    reader.prefetcher = _InlinePrefetcher()  # type: ignore[assignment]
    reader.follow_hint = True
    reader.new_order()
    return shards, stats, store, cache, reader, s0_blocks


@pytest.mark.parametrize("room_taken_by", ["readahead", "a read"])
def test_a_block_part_of_which_came_as_a_range_is_not_fetched_whole_that_epoch(
    tmp_path: Path, folder: Path, room_taken_by: str
) -> None:
    """While a hint is followed, a file fetched ahead as a range (the cache full) marks its
    block: when room comes back later in the epoch, neither the hint's block plan nor a read
    fetches that block whole, which would pay for the file's bytes again (CI on stop 45's
    head: 87 KB fetched twice in a uniform-mode epoch); its other files come as ranges. The
    next hint may fetch it whole again."""
    shards, stats, store, cache, reader, s0_blocks = _hinted_full_cache(tmp_path, folder)
    try:
        shard = next(s for s in store.list_shards() if s.name == "s1.tar")
        data = shards["s1.tar"]
        assert reader.wants_files_ahead()
        lo, hi = 4 * BLOCK + 10, 4 * BLOCK + 310
        before = store.fetched
        assert reader.prefetch_files([(shard, lo, hi)]) == 1
        assert reader.read(shard, lo, hi, hi) == data[lo:hi]
        assert store.fetched - before == 300
        rest = [(4 * BLOCK, lo)]  # block 4's other files
        rest += [(at, min(at + FILE, 5 * BLOCK)) for at in range(hi, 5 * BLOCK, FILE)]
        reader.retire_blocks(s0_blocks)  # room comes back: whole blocks again, not block 4
        if room_taken_by == "readahead":
            reader.prefetch_blocks([(shard, 3), (shard, 4)])
        else:  # a read of block 3, then one of block 4
            for at, end in [(3 * BLOCK, 3 * BLOCK + FILE), rest.pop()]:
                assert reader.read(shard, at, end, end) == data[at:end]
        skey = reader.shard_key(shard)
        assert cache.contains(BlockKey(skey, 3)) and not cache.contains(BlockKey(skey, 4))
        ranged = stats.range_reads
        for at, end in rest:
            assert reader.read(shard, at, end, end) == data[at:end]
        assert stats.range_reads - ranged == len(rest)
        assert store.fetched - before == 2 * BLOCK, "bytes of block 4 were fetched twice"
        reader.new_order()  # the next epoch may cache block 4 whole
        reader.retire_blocks(s0_blocks)
        reader.prefetch_blocks([(shard, 4)])
        assert cache.contains(BlockKey(skey, 4))
    finally:
        cache.close()


@pytest.mark.parametrize("whole_by", ["readahead", "a read", "a split miss"])
def test_a_block_marked_paid_in_part_between_a_look_and_its_claim_is_not_fetched_whole(
    tmp_path: Path, folder: Path, monkeypatch: pytest.MonkeyPatch, whole_by: str
) -> None:
    """A whole-block GET looks at the paid-in-part marks again once it holds the block's
    claim: a range GET that marked the block after the first look (forced here, at the
    claim) is not paid for again. The hint's plan leaves the block out; a read fetches its
    own bytes as a range, and so does a split miss (``--miss-fetch range``: its own bytes
    first, the rest of the block after), which fetched the whole block in two parts
    before stop 47."""
    shards, stats, store, cache, reader, s0_blocks = _hinted_full_cache(tmp_path, folder)
    reader.split_misses = whole_by == "a split miss"
    try:
        shard = next(s for s in store.list_shards() if s.name == "s1.tar")
        skey, data = reader.shard_key(shard), shards["s1.tar"]
        reader.retire_blocks(s0_blocks)  # room for whole blocks
        claim = cache.claim

        def claim_after_a_range_marked(key: BlockKey, **kwargs: Any) -> Any:
            if key == BlockKey(skey, 4):
                reader.paid_in_part.add(skey, 4 * BLOCK + 10, 4 * BLOCK + 310)
            return claim(key, **kwargs)

        monkeypatch.setattr(cache, "claim", claim_after_a_range_marked)
        lo, hi = 4 * BLOCK + 400, 4 * BLOCK + 700
        before, ranged = store.fetched, stats.range_reads
        if whole_by == "readahead":
            reader.prefetch_blocks([(shard, 4)])
            assert store.fetched == before and stats.blocks_paid_in_part == 1
        else:
            assert reader.read(shard, lo, hi, hi) == data[lo:hi]
            assert store.fetched - before == hi - lo and stats.range_reads == ranged + 1
        assert not cache.contains(BlockKey(skey, 4))
    finally:
        cache.close()


@pytest.mark.parametrize("landed", ["stored", "kept"])
@pytest.mark.parametrize("range_by", ["a file fetched ahead", "a read"])
def test_a_range_takes_its_part_of_a_block_fetched_whole_as_it_marked_it(
    tmp_path: Path, folder: Path, monkeypatch: pytest.MonkeyPatch, range_by: str, landed: str
) -> None:
    """A range GET marks its blocks paid in part, then looks again: a block that a
    whole-block GET brought meanwhile (one that looked at the marks just before they were
    made: forced here, as the range marks) is taken from the cache, and only the rest of
    the range fetched. Where that GET then found no room to store the block (forced: every
    store fails), the block is held in memory as kept, and the range takes its part from
    there (before stop 47 it fetched that part again)."""
    shards, stats, store, cache, reader, s0_blocks = _hinted_full_cache(tmp_path, folder)
    try:
        shard = next(s for s in store.list_shards() if s.name == "s1.tar")
        skey, data = reader.shard_key(shard), shards["s1.tar"]
        add = reader.paid_in_part.add

        def a_block_get_lands_first(key: str, start: int, end: int) -> None:
            if not cache.contains(BlockKey(skey, 4)) and not stats.blocks_kept_unstored:
                reader.retire_blocks(s0_blocks)
                with monkeypatch.context() as patch:
                    if landed == "kept":
                        patch.setattr(cache, "put", lambda *args, **kwargs: False)
                    reader.prefetch_blocks([(shard, 4)])
                assert stats.blocks_kept_unstored == (landed == "kept")
            add(key, start, end)

        monkeypatch.setattr(reader.paid_in_part, "add", a_block_get_lands_first)
        lo, hi = 4 * BLOCK - 100, 4 * BLOCK + 200  # from block 3 into block 4
        before, ranged = store.fetched, stats.range_reads
        if range_by == "a file fetched ahead":
            assert reader.prefetch_files([(shard, lo, hi)]) == 1
        assert reader.read(shard, lo, hi, hi) == data[lo:hi]
        assert cache.contains(BlockKey(skey, 4)) == (landed == "stored")
        assert not cache.contains(BlockKey(skey, 3))
        assert store.fetched - before == BLOCK + 100, "block 4's part was fetched again"
        assert stats.range_reads == ranged + 1
        at, end = 4 * BLOCK + 200, 4 * BLOCK + 500  # block 4's other files: no GET either
        assert reader.read(shard, at, end, end) == data[at:end]
        assert store.fetched - before == BLOCK + 100
    finally:
        cache.close()

"""A GET for several blocks, handed on piece by piece as it lands (``Store.stream``), against
the real moto S3 server through the fault proxy: the first piece comes before the rest of
the body, a GET cut partway is asked again only for the pieces not yet handed on, and no
piece is handed on twice or differs from the store's bytes."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.fault_proxy import FaultProxy
from support.mounts import new_bucket
from support.s3 import S3Server

from shardfs.cache import BlockCache, BlockKey
from shardfs.config import CacheConfig, SourceConfig
from shardfs.read.block_runs import RUN_BLOCKS
from shardfs.read.readahead import Prefetcher
from shardfs.read.reader import CachedReader
from shardfs.stats import Stats
from shardfs.store.remote import Store
from shardfs.store.shards import ShardInfo

pytestmark = pytest.mark.s3  # moto only: no FUSE mount

PIECE = 64 << 10
SIZE = 10 * PIECE + 1234
START, END = 2 * PIECE, 8 * PIECE  # a run of 6 pieces


@pytest.fixture
def proxy(s3_server: S3Server) -> Iterator[FaultProxy]:
    with FaultProxy(s3_server) as running:
        yield running


def _setup(s3_server: S3Server, proxy: FaultProxy, name: str) -> tuple[Store, ShardInfo, bytes]:
    bucket = new_bucket(s3_server, name)
    data = random.Random(name).randbytes(SIZE)
    s3_server.filesystem().pipe_file(f"{bucket}/p/a.tar", data)
    store = Store(
        SourceConfig(
            f"s3://{bucket}/p",
            storage_options={"key": "testing", "secret": "testing"},
            endpoint_url=proxy.endpoint,
            read_timeout=20.0,
        ),
        Stats(),
    )
    (shard,) = store.list_shards()
    proxy.state.reset()
    return store, shard, data


def _gets(proxy: FaultProxy) -> list[tuple[int, int]]:
    """The object GETs' ranges as the proxy saw them, in order (first and last byte)."""
    return [tuple(e["range"]) for e in proxy.log() if e["method"] == "GET" and e["range"]]


def test_the_first_piece_comes_before_the_rest_of_the_body(
    s3_server: S3Server, proxy: FaultProxy
) -> None:
    """The proxy holds the body back for 1.5 s once half of it is out: the first piece is
    handed on before that, and the whole range comes in that one GET, byte for byte."""
    store, shard, data = _setup(s3_server, proxy, "stream-early")
    assert store.streams_pieces(shard)
    proxy.add("stall", where="body", seconds=1.5, on="fast")
    began = time.monotonic()
    pieces = store.stream(shard, START, END, PIECE)
    first = next(pieces)
    first_after = time.monotonic() - began
    rest = list(pieces)
    whole_after = time.monotonic() - began
    assert first_after < 1.0 <= 1.5 <= whole_after, (first_after, whole_after)
    assert [len(p) for p in [first, *rest]] == [PIECE] * 6
    assert b"".join([first, *rest]) == data[START:END]
    assert _gets(proxy) == [(START, END - 1)]
    assert store.stats.snapshot()["bytes_fetched"] == END - START


@pytest.mark.parametrize("fault", ["truncate", "reset"])
def test_a_get_cut_partway_is_asked_again_only_for_the_pieces_not_handed_on(
    s3_server: S3Server, proxy: FaultProxy, fault: str
) -> None:
    """60 % of the body, then the connection ends: the 3 whole pieces received are handed
    on once, and the second GET starts at the fourth piece."""
    store, shard, data = _setup(s3_server, proxy, f"stream-{fault}")
    proxy.add(fault, fraction=0.6, on="fast")
    got = list(store.stream(shard, START, END, PIECE))
    assert [len(p) for p in got] == [PIECE] * 6
    assert b"".join(got) == data[START:END]
    assert _gets(proxy) == [(START, END - 1), (START + 3 * PIECE, END - 1)]
    assert proxy.counts()["injected_total"] == 1


def test_a_reader_that_stops_early_leaves_the_connection_and_later_gets_are_exact(
    s3_server: S3Server, proxy: FaultProxy
) -> None:
    """Closing the stream after one piece closes its connection (the rest of the body is
    never taken for the next GET's answer): the next GETs get their own bytes."""
    store, shard, data = _setup(s3_server, proxy, "stream-close")
    pieces = store.stream(shard, START, END, PIECE)
    assert next(pieces) == data[START : START + PIECE]
    pieces.close()
    for start, end in [(0, 3 * PIECE), (5 * PIECE, SIZE)]:
        assert b"".join(store.stream(shard, start, end, PIECE)) == data[start:end]
    assert store.read_range(shard, 100, 200, retries=1) == data[100:200]
    assert _gets(proxy) == [(START, END - 1), (0, 3 * PIECE - 1), (5 * PIECE, SIZE - 1), (100, 199)]


def test_a_whole_object_answer_is_kept_and_cut_like_fetch_does(
    s3_server: S3Server, proxy: FaultProxy
) -> None:
    """A server that ignores Range (a 200 with the whole object) on a streamed GET: the
    range's pieces are cut from it, the caller is given the whole shard to keep, the store
    says so once and reads of that shard take no GET from then on."""
    store, shard, data = _setup(s3_server, proxy, "stream-whole")
    proxy.add("ignore_range", on="fast")
    kept: list[bytes] = []
    got = list(store.stream(shard, START, END, PIECE, whole=kept.append))
    assert [len(p) for p in got] == [PIECE] * 6 and b"".join(got) == data[START:END]
    assert kept == [data]
    assert store.range_warning is not None and "ignores Range" in store.range_warning
    assert not store.streams_pieces(shard)  # kept whole: served from memory
    assert b"".join(store.stream(shard, 0, PIECE, PIECE)) == data[:PIECE]
    assert len([e for e in proxy.log() if e["method"] == "GET"]) == 1
    assert store.stats.snapshot()["bytes_fetched"] == SIZE


def test_a_readahead_run_stores_each_block_as_it_lands_holding_one_block_of_landing_memory(
    s3_server: S3Server, proxy: FaultProxy, tmp_path: Path
) -> None:
    """Four blocks in one GET, the body held back for 1.5 s once half of it is out: the
    first block is in the cache while the rest is still on the wire, the run asks for
    landing memory one block at a time (not for the whole GET at once), and each block is
    stored once, with the store's bytes."""
    store, shard, data = _setup(s3_server, proxy, "stream-run")
    config = CacheConfig(cache_dir=tmp_path / "cache", size="64M", min_free=0, block_size=PIECE)
    cache = BlockCache(config, store.stats)
    asked: list[int] = []
    room = cache.landing_room

    def recording(length: int) -> object:
        asked.append(length)
        return room(length)

    cache.landing_room = recording  # type: ignore[method-assign,assignment]
    prefetcher = Prefetcher(1)
    reader = CachedReader(store, cache, store.stats, retries=1, prefetcher=prefetcher)
    skey = reader.shard_key(shard)
    try:
        proxy.add("stall", where="body", seconds=1.5, on="fast")
        began = time.monotonic()
        assert reader.prefetch_blocks([(shard, index) for index in range(2, 6)]) == 4
        while not cache.contains(BlockKey(skey, 2)) and time.monotonic() - began < 5:
            time.sleep(0.01)
        first_after = time.monotonic() - began
        assert first_after < 1.0 and not cache.contains(BlockKey(skey, 5)), first_after
        assert prefetcher.wait_idle(10)
        assert all(cache.contains(BlockKey(skey, index)) for index in range(2, 6))
        assert asked == [PIECE] * 4
        assert _gets(proxy) == [(2 * PIECE, 6 * PIECE - 1)]
        assert reader.read(shard, 2 * PIECE, 6 * PIECE) == data[2 * PIECE : 6 * PIECE]
        assert store.stats.snapshot()["bytes_fetched"] == 4 * PIECE  # read from the cache
    finally:
        prefetcher.close()
        cache.close()


def test_a_hint_over_a_store_that_streams_runs_at_any_block_size(
    s3_server: S3Server, proxy: FaultProxy, tmp_path: Path
) -> None:
    """A run holds one block of landing memory at a time where the store streams, so an
    order hint joins ``RUN_BLOCKS`` blocks even at 8 streams of 8 MiB blocks (where a run
    that lands whole is held to one block: tests/test_readahead.py)."""
    store, _, _ = _setup(s3_server, proxy, "stream-hint")
    config = CacheConfig(cache_dir=tmp_path / "cache", size="1G", min_free=0, block_size=8 << 20)
    cache = BlockCache(config, store.stats)
    prefetcher = Prefetcher(8)
    try:
        assert store.streams_pieces()
        reader = CachedReader(store, cache, store.stats, prefetcher=prefetcher)
        assert reader.hinted_run() == RUN_BLOCKS > 1
    finally:
        prefetcher.close()
        cache.close()


def test_a_piece_handed_on_is_held_by_the_caller_alone(
    s3_server: S3Server, proxy: FaultProxy
) -> None:
    """Once the caller lets a piece go, its landing buffer is free for the next GET, while
    the stream waits for the next ask: the stream's own frames keep no reference to it.
    (They did: 8 streams of 8 MiB blocks then held the readahead's whole landing memory,
    and each next piece waited a second for room.)"""
    from shardfs.cache.landing import LandingBuffers

    store, shard, data = _setup(s3_server, proxy, "stream-held")
    landing = LandingBuffers(chunk_size=PIECE)
    pieces = store.stream(shard, START, END, PIECE, land=landing.take)
    first = next(pieces)
    assert bytes(first) == data[START : START + PIECE]
    assert landing.in_use() > 0
    del first
    assert landing.in_use() == 0
    second = next(pieces)
    assert bytes(second) == data[START + PIECE : START + 2 * PIECE]
    del second
    rest = b"".join(bytes(p) for p in pieces)
    assert rest == data[START + 2 * PIECE : END]

"""Files fetched ahead of an order hint while the cache is full: each byte fetched once,
taken by its read, never fetched twice when the read comes first."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from shardfs.read.files_ahead import OPENED_GRACE_S, FilesAhead
from shardfs.read.range_reads import PaidInPart
from shardfs.stats import Stats

DATA = bytes(range(256)) * 40


def fetcher(calls: list[tuple[int, int]], start: int, end: int) -> bytes:
    calls.append((start, end))
    return DATA[start:end]


def test_a_filled_extent_serves_its_reads_then_goes() -> None:
    ahead, calls = FilesAhead(), []
    assert ahead.claim("s", 100, 600)
    assert not ahead.claim("s", 100, 600)  # held already
    assert ahead.fill("s", 100, lambda: fetcher(calls, 100, 600))
    assert ahead.held == 500
    assert ahead.take("s", 100, 300) == DATA[100:300]  # a first piece of the file
    assert ahead.take("s", 300, 600) == DATA[300:600]  # the last piece drops it
    assert ahead.held == 0
    assert ahead.take("s", 100, 600) is None
    assert calls == [(100, 600)]


def test_a_read_before_the_fetch_started_takes_the_claim_over() -> None:
    ahead, calls = FilesAhead(), []
    assert ahead.claim("s", 0, 50)
    assert ahead.take("s", 0, 50) is None  # the read fetches it itself...
    assert not ahead.fill("s", 0, lambda: fetcher(calls, 0, 50))  # ...and the task does not
    assert calls == []
    assert ahead.held == 0


def test_a_read_during_the_fetch_waits_for_it() -> None:
    ahead, calls = FilesAhead(), []
    assert ahead.claim("s", 0, 64)
    started, release = threading.Event(), threading.Event()

    def slow() -> bytes:
        started.set()
        assert release.wait(10)
        return fetcher(calls, 0, 64)

    filler = threading.Thread(target=ahead.fill, args=("s", 0, slow))
    filler.start()
    assert started.wait(10)
    got: list[bytes | None] = []
    reader = threading.Thread(target=lambda: got.append(ahead.take("s", 0, 64)))
    reader.start()
    release.set()
    filler.join(10)
    reader.join(10)
    assert got == [DATA[:64]]
    assert calls == [(0, 64)]


def test_a_failed_fetch_leaves_the_read_to_fetch_and_holds_nothing() -> None:
    ahead = FilesAhead()
    assert ahead.claim("s", 0, 10)

    def broken() -> bytes:
        raise OSError("store down")

    with pytest.raises(OSError):
        ahead.fill("s", 0, broken)
    assert ahead.take("s", 0, 10) is None
    assert ahead.held == 0


def test_the_budget_bounds_what_is_held() -> None:
    ahead = FilesAhead(budget=1000)
    assert ahead.claim("s", 0, 600)
    assert not ahead.claim("s", 600, 1200)  # would hold 1,200 bytes
    assert ahead.claim("t", 0, 400)
    assert ahead.held == 1000
    ahead.clear()
    assert ahead.held == 0
    assert ahead.claim("s", 600, 1200)


def test_a_claim_narrows_to_what_is_still_missing_before_its_fetch() -> None:
    ahead, calls = FilesAhead(), []
    assert ahead.claim("s", 100, 600)
    assert ahead.claim("s", 700, 800)
    assert not ahead.narrow("s", 100, 50, 600)  # only inside the claim
    assert not ahead.narrow("s", 100, 700, 800)
    assert ahead.narrow("s", 100, 400, 600)  # its first part got cached meanwhile
    assert ahead.held == 300
    assert ahead.take("s", 100, 400) is None  # no longer held: the cache serves it
    assert ahead.fill("s", 400, lambda: fetcher(calls, 400, 600))
    assert not ahead.narrow("s", 400, 450, 600)  # its fetch ran: too late
    assert ahead.take("s", 400, 600) == DATA[400:600]
    assert ahead.held == 100 and calls == [(400, 600)]
    assert not ahead.narrow("s", 100, 200, 300)  # gone


def test_a_kept_block_serves_the_reads_inside_it_and_no_file_of_it_is_claimed() -> None:
    ahead = FilesAhead(budget=3000)
    assert ahead.keep("s", 1000, DATA[1000:2000])
    assert ahead.held == 1000
    assert not ahead.claim("s", 1200, 1300)  # a file inside it: its read takes it
    assert ahead.take("s", 1200, 1300) == DATA[1200:1300]
    assert ahead.take("s", 1500, 1800) == DATA[1500:1800]  # reads in any order
    # a file running past its end: the part inside, its read fetches only the rest
    assert ahead.take("s", 1900, 2100) == DATA[1900:2000]
    assert not ahead.claim("s", 1900, 2100)  # overlaps it: that part is paid for
    assert ahead.next_start("s", 900, 1100) == 1000 and ahead.next_start("s", 0, 900) == 900
    assert ahead.claim("s", 2000, 2100)
    assert not ahead.keep("s", 1500, DATA[1500:2500])  # overlaps what is held
    assert not ahead.keep("s", 5000, DATA[:2000])  # past the budget
    ahead.clear()
    assert ahead.held == 0 and ahead.take("s", 1200, 1300) is None


def test_a_kept_block_stays_when_a_read_reaches_its_end_before_its_other_files() -> None:
    """Reads of a kept block come in any order: the one that ends where the block ends
    (the first part of a file running into the next block) is no sign that the files
    before it were read. Stop 41's plain shuffle=True epoch fetched a file twice so."""
    ahead = FilesAhead()
    assert ahead.keep("s", 1000, DATA[1000:2000])
    assert ahead.take("s", 1950, 2000) == DATA[1950:2000]
    assert ahead.take("s", 1200, 1300) == DATA[1200:1300]  # still held: not fetched again
    assert ahead.held == 1000
    # an extent fetched ahead (files in the hint's order) still goes at its last byte
    assert ahead.claim("s", 3000, 3100) and ahead.fill("s", 3000, lambda: DATA[3000:3100])
    assert ahead.take("s", 3000, 3100) == DATA[3000:3100]
    assert ahead.held == 1000


def test_a_run_block_with_no_room_left_is_kept_not_dropped() -> None:
    """A readahead GET brought blocks 4 and 5; block 5 then finds no room in the cache (a
    use warmed what its held room counted on): its bytes go to the files ahead."""
    from shardfs.read.block_runs import BlockRun
    from shardfs.read.fills import Arrivals

    size, kept, gets = 100, [], []

    class Cache:
        def contains(self, key: object) -> bool:
            return False

        def in_flight(self, key: object) -> bool:
            return False

        def hold(self, lens: list[int], evict_before: float, spare: int = 0) -> list[int]:
            return [length + 10 for length in lens]

        def release(self, held: int) -> None:
            pass

        def landing(self, length: int) -> memoryview:
            return memoryview(bytearray(length))

        def landing_room(self, length: int) -> contextlib.AbstractContextManager[None]:
            return contextlib.nullcontext()

    class Store:
        def streams_pieces(self, shard: object = None) -> bool:
            return True

    class Reader:
        cache, block_size, coming, store = Cache(), size, Arrivals(1.0), Store()
        paid_in_part, stats = PaidInPart(size), Stats()

        def stream_pieces(
            self, shard: object, start: int, end: int, piece: int, land: object
        ) -> Iterator[bytes]:
            gets.append((start, end))
            for at in range(start, end, piece):
                yield DATA[at : min(end, at + piece)]

        def prefetch_one(
            self,
            shard: object,
            skey: str,
            index: int,
            fetch: Any,
            evict_before: float,
            held: int = 0,
        ) -> bool:
            if index == 5:
                return False  # no room: nothing fetched, the GET's bytes unused
            fetch(0, size)
            return True

        def keep_unstored(self, shard: object, skey: str, index: int, block: Any) -> None:
            kept.append((index, bytes(block)))

    shard = SimpleNamespace(size=1000)
    assert BlockRun(Reader(), shard, "k", [4, 5], 0.0).task()  # type: ignore[arg-type]
    assert gets == [(400, 600)]  # one GET for both
    assert kept == [(5, DATA[500:600])]


def test_a_file_opened_from_the_page_cache_lets_go_of_what_was_fetched_ahead_of_it() -> None:
    """Files fetched ahead are pushed into the kernel's page cache, so no read takes them:
    their open lets them go, when the time it names has come. Kept blocks stay; a claim let
    go before its fetch started fetches nothing; an extent fetched since at the same place
    (a later epoch's) is not the one the open named."""
    ahead, calls = FilesAhead(), []
    assert ahead.claim("s", 100, 300) and ahead.fill("s", 100, lambda: fetcher(calls, 100, 300))
    assert ahead.claim("s", 300, 400)  # not fetched yet
    assert ahead.claim("s", 500, 600) and ahead.fill("s", 500, lambda: fetcher(calls, 500, 600))
    assert ahead.keep("s", 1000, DATA[1000:2000])
    grace = OPENED_GRACE_S
    # only extents wholly inside a file's range; a kept block is read in any order
    assert ahead.opened([("s", 0, 250), ("s", 100, 300), ("s", 1000, 2000)], now=1.0) == 0
    assert ahead.held == 1400  # a READ may still come
    assert ahead.opened([("s", 300, 400), ("s", 500, 600)], now=1.0 + grace) == 1
    assert ahead.held == 1200
    assert ahead.take("s", 500, 600) == DATA[500:600]  # a READ came after all: taken
    assert ahead.claim("s", 500, 600)  # fetched again, for another epoch
    assert ahead.fill("s", 500, lambda: fetcher(calls, 500, 600))
    # 300-400 only: the new 500-600 is not the one the open named
    assert ahead.opened([], now=5.0) == 1
    assert ahead.fill("s", 300, lambda: fetcher(calls, 300, 400)) is None
    assert ahead.held == 1100 and calls == [(100, 300), (500, 600), (500, 600)]


def test_files_fetched_ahead_inside_a_block_give_way_when_the_block_is_kept() -> None:
    """A readahead GET brought a block whose files were fetched ahead already (pushed, not
    yet opened): the block is kept all the same, so its other files are not fetched again;
    a file running past its edge stays held beside it."""
    ahead, calls = FilesAhead(), []
    assert ahead.claim("s", 1100, 1300) and ahead.fill(
        "s", 1100, lambda: fetcher(calls, 1100, 1300)
    )
    assert ahead.claim("s", 1900, 2200) and ahead.fill(
        "s", 1900, lambda: fetcher(calls, 1900, 2200)
    )
    assert ahead.keep("s", 1000, DATA[1000:2000])
    assert ahead.held == 1000 + 300
    assert ahead.take("s", 1500, 1600) == DATA[1500:1600]
    assert ahead.take("s", 1950, 2150) == DATA[1950:2150]
    assert not ahead.keep("s", 1500, DATA[1500:2500])  # another kept block's bytes


def test_bytes_a_read_waited_for_are_not_handed_on_to_be_pushed() -> None:
    """``fetch_claimed`` returns what it fetched, for the pusher, unless a read came while
    the fetch ran (that read hands the bytes to the kernel itself: a push would copy them a
    second time) or took them already."""
    ahead, calls = FilesAhead(), []
    assert ahead.claim("s", 0, 64)
    assert ahead.fetch_claimed(
        "s", 0, 64, lambda _: False, 1 << 20, lambda: True, lambda a, b: fetcher(calls, a, b)
    ) == (0, DATA[:64])
    assert ahead.claim("s", 100, 164)
    started, release = threading.Event(), threading.Event()

    def slow(a: int, b: int) -> bytes:
        started.set()
        assert release.wait(10)
        return fetcher(calls, a, b)

    got: list[object] = []
    runner = threading.Thread(
        target=lambda: got.append(
            ahead.fetch_claimed("s", 100, 164, lambda _: False, 1 << 20, lambda: True, slow)
        )
    )
    runner.start()
    assert started.wait(10)
    reader = threading.Thread(target=lambda: got.append(ahead.take("s", 100, 164)))
    reader.start()
    time.sleep(0.1)  # the read is waiting for the fetch
    release.set()
    runner.join(10)
    reader.join(10)
    assert sorted(got, key=repr) == sorted([None, DATA[100:164]], key=repr)
    assert calls == [(0, 64), (100, 164)]


def test_take_kept_hands_over_only_a_whole_kept_block_once() -> None:
    ahead = FilesAhead(budget=1 << 20)
    assert ahead.claim("s", 0, 100)  # a file fetched ahead: not a kept block
    assert ahead.take_kept("s", 0, 100) is None
    assert ahead.keep("s", 4096, b"k" * 4096)
    assert ahead.take_kept("s", 4096, 4000) is None  # not the block asked for
    assert ahead.take_kept("s", 4096, 8192) == b"k" * 4096
    assert ahead.take_kept("s", 4096, 8192) is None  # let go: its taker stores it
    assert not ahead.fetching("s", 4096)

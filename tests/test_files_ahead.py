"""Files fetched ahead of an order hint while the cache is full: each byte fetched once,
taken by its read, never fetched twice when the read comes first."""

from __future__ import annotations

import threading

import pytest

from shardfs.read.files_ahead import FilesAhead

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

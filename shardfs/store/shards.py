"""The types every family names for a shard, in a leaf that loads no fsspec: ``ShardInfo``
(a shard as listed) and ``Readable`` (what a shard streams through); and ``ShardStream``, a
shard read front to back for index scans: the next chunk is fetched while the caller parses
this one, so a scan waits on the network about once, not once per chunk."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class ShardInfo:
    """A shard as listed in the store: ``name`` is relative to the source root."""

    name: str
    size: int
    etag: str

    @property
    def identity(self) -> tuple[str, int, str]:
        return (self.name, self.size, self.etag)


class Readable(Protocol):
    """Anything with a sequential ``read(n)``: a file, a socket stream, an fsspec file."""

    def read(self, n: int = -1, /) -> bytes: ...


Fetch = Callable[[int, int], bytes]
"""Bytes ``[start, end)`` of the shard, checked; or more, from ``start`` up to the end of
the shard, where the store sent the whole shard (a server that ignores Range)."""


class ShardStream:
    """Sequential ``read(n)`` over ``size`` bytes fetched in ``chunk``-byte ranges, one
    range ahead of the reader."""

    def __init__(self, fetch: Fetch, size: int, chunk: int) -> None:
        self._fetch = fetch
        self._size = size
        self._chunk = max(1, chunk)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="scan-ahead")
        self._buffer = b""
        self._pos = 0  # within _buffer
        self._next_start = 0  # shard offset of the next chunk to request
        self._ahead: Future[bytes] | None = None
        self._ahead_start = 0  # shard offset of the chunk in ``_ahead``
        self._request_next()

    def _request_next(self) -> None:
        start = self._next_start
        end = min(start + self._chunk, self._size)
        if start >= end:
            self._ahead = None
            return
        self._next_start = end
        self._ahead_start = start
        self._ahead = self._pool.submit(self._fetch, start, end)

    def _refill(self) -> bool:
        ahead = self._ahead
        if ahead is None:
            return False
        self._buffer = ahead.result()
        self._pos = 0
        # A longer answer brought the chunks after it too: they are not asked for again.
        self._next_start = max(self._next_start, self._ahead_start + len(self._buffer))
        self._request_next()
        return True

    def read(self, n: int = -1, /) -> bytes:
        if n < 0:
            parts = [self._buffer[self._pos :]]
            while self._refill():
                parts.append(self._buffer)
            self._buffer, self._pos = b"", 0
            return b"".join(parts)
        if self._pos >= len(self._buffer) and not self._refill():
            return b""
        data = self._buffer[self._pos : self._pos + n]
        self._pos += len(data)
        return data

    def close(self) -> None:
        if self._ahead is not None:
            self._ahead.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)

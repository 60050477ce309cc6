"""A faster path for ranged GETs on S3: presigned URLs fetched with a lean HTTP client.

s3fs sends every request through aiobotocore and aiohttp, which costs about a core-second
of Python per 500 MB on this project's machine. A presigned URL lets a plain HTTP client do
the same GET with far less work per byte, and ``lean_http`` with far less work per request
than urllib3. The request carries ``If-Match`` with the indexed
ETag, and the answer is checked like every other (``responses.check_answer``), so a shard
replaced in the store is refused, never served.

Only ``store.Store`` uses this module; a request this path cannot answer goes through s3fs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Generator
from typing import Any

from .lean_http import HTTPFailure, LeanPool
from .responses import Landing, TransientError, check_answer, check_length, checks_etag

_URL_LIFETIME_S = 3600
_RENEW_BEFORE_S = 300


class PresignedRanges:
    """Ranged GETs of S3 objects through presigned URLs (cached per object)."""

    def __init__(self, fs: Any, *, connect_timeout: float, stall_timeout: float) -> None:
        self._fs = fs
        self._connect_timeout = connect_timeout
        self._stall_timeout = stall_timeout
        self._pool = LeanPool()
        self._urls: dict[str, tuple[str, float]] = {}
        self._lock = threading.Lock()

    def _url(self, path: str) -> str:
        now = time.monotonic()
        with self._lock:
            cached = self._urls.get(path)
        if cached is not None and cached[1] > now:
            return cached[0]
        url = str(self._fs.url(path, expires=_URL_LIFETIME_S))
        with self._lock:
            self._urls[path] = (url, now + _URL_LIFETIME_S - _RENEW_BEFORE_S)
        return url

    def _request(self, path: str, headers: dict[str, str], deadline: float) -> Any:
        remaining = max(0.05, deadline - time.monotonic())
        timeout = (min(self._connect_timeout, remaining), min(self._stall_timeout, remaining))
        try:
            return self._pool.request("GET", self._url(path), headers=headers, timeout=timeout)
        except (OSError, HTTPFailure) as exc:  # timeouts, resets, refused connections
            raise TransientError(str(exc) or type(exc).__name__) from exc

    def answer(self, path: str, start: int, end: int, size: int, etag: str, deadline: float) -> Any:
        """The response to a ranged GET of bytes ``[start, end)`` of the object at ``path``
        as indexed (``size``, ``etag``), its status and headers checked (``check_answer``):
        a 206, or a 200 with the whole object (a server that ignores Range). Its body is
        read by ``body`` or ``stream``."""
        headers = {"Range": f"bytes={start}-{end - 1}"}
        if checks_etag(etag):
            headers["If-Match"] = f'"{etag}"'
        response = self._request(path, headers, deadline)
        if response.status == 403:  # an expired or rejected signature: sign again once
            _discard(response)
            with self._lock:
                self._urls.pop(path, None)
            response = self._request(path, headers, deadline)
        try:
            check_answer(
                what=f"{path} [{start}:{end}]",
                status=response.status,
                content_range=response.headers.get("Content-Range"),
                etag_header=response.headers.get("ETag"),
                start=start,
                end=end,
                size=size,
                etag=etag,
            )
        except BaseException:
            _discard(response)
            raise
        return response

    def get(
        self,
        path: str,
        start: int,
        end: int,
        size: int,
        etag: str,
        deadline: float,
        piece: int,
        land: Landing | None = None,
    ) -> list[bytes | memoryview]:
        """Bytes ``[start, end)`` of the object at ``path`` as indexed (``size``, ``etag``),
        by ``deadline`` (``time.monotonic()``) or a TransientError; as consecutive pieces of
        ``piece`` bytes (the last may be shorter), each read from the socket on its own so
        that no piece is a copy cut from a larger buffer. A server that ignores Range (a
        200) gives the whole object, as one piece: the caller keeps it (``store.Store``).
        ``land(n)`` gives memory for each piece of a 206 to be received into."""
        response = self.answer(path, start, end, size, etag, deadline)
        return self.body(response, path, start, end, size, deadline, piece, land)

    @staticmethod
    def body(
        response: Any,
        path: str,
        start: int,
        end: int,
        size: int,
        deadline: float,
        piece: int,
        land: Landing | None = None,
    ) -> list[bytes | memoryview]:
        """The whole body of an ``answer``, as ``get`` gives it."""
        what = f"{path} [{start}:{end}]"
        if response.status == 206:
            return list(_pieces(response, what, 206, (start, end, size), piece, deadline, land))
        whole = _pieces(response, what, 200, (start, end, size), size, deadline)
        return [b"".join(whole)]  # the whole object (a server that ignores Range)

    @staticmethod
    def stream(
        response: Any,
        path: str,
        start: int,
        end: int,
        size: int,
        deadline: float,
        piece: int,
        land: Landing | None = None,
    ) -> Generator[bytes | memoryview, None, None]:
        """The body of a 206 ``answer`` as ``get``'s pieces, each handed on as soon as it
        has landed, while the next ones are still on the wire: only whole pieces, so a body
        cut short raises (WrongLengthError, TransientError) before its last piece. Between
        two pieces the caller may take its time, within ``deadline``; a caller that stops
        early closes the connection (the generator's ``close``, once it has started)."""
        what = f"{path} [{start}:{end}]"
        return _pieces(response, what, 206, (start, end, size), piece, deadline, land)


def _discard(response: Any) -> None:
    """Close a connection whose body was not read to the end: it cannot be reused."""
    response.close()
    response.release_conn()


def _pieces(
    response: Any,
    what: str,
    status: int,
    asked: tuple[int, int, int],
    piece: int,
    deadline: float,
    land: Landing | None = None,
) -> Generator[bytes | memoryview, None, None]:
    """The body of an answer with ``status`` to a GET of ``asked`` (start, end, the
    object's size), in pieces of ``piece`` bytes, the deadline checked between pieces; each
    piece received into memory from ``land`` when given. Read undecoded: the range is over
    the stored bytes, whatever their encoding. A body of another length raises
    (``check_length``) before the piece it ends in. The connection goes back to the pool
    once the body is read, and is closed otherwise (a failure, a caller that stopped)."""
    start, end, size = asked
    length = end - start if status == 206 else size
    left = length
    done = False
    try:
        while left > 0:
            want = min(piece, left)
            try:
                if land is not None:
                    data: bytes | memoryview = land(want)
                    got = response.readinto(data)
                else:
                    data = response.read(want, decode_content=False)
                    got = len(data)
            except (OSError, HTTPFailure) as exc:  # reset, bad chunk, stall
                raise TransientError(str(exc) or type(exc).__name__) from exc
            if got != want:
                check_length(what, status, length - left + got, start, end, size)
            left -= want
            handed = [data]
            del data  # held by the caller alone until it asks for the next (``Store.stream``)
            yield handed.pop()
            if left > 0 and time.monotonic() > deadline:
                raise TransientError("the read deadline passed while the body arrived")
        done = True
    finally:
        if done:
            response.release_conn()
        else:
            _discard(response)

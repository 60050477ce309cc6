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
        headers = {"Range": f"bytes={start}-{end - 1}"}
        if checks_etag(etag):
            headers["If-Match"] = f'"{etag}"'
        response = self._request(path, headers, deadline)
        if response.status == 403:  # an expired or rejected signature: sign again once
            _discard(response)
            with self._lock:
                self._urls.pop(path, None)
            response = self._request(path, headers, deadline)
        what = f"{path} [{start}:{end}]"
        try:
            check_answer(
                what=what,
                status=response.status,
                content_range=response.headers.get("Content-Range"),
                etag_header=response.headers.get("ETag"),
                start=start,
                end=end,
                size=size,
                etag=etag,
            )
            if response.status == 206:
                pieces = _read_pieces(response, end - start, piece, deadline, land)
                check_length(what, 206, sum(map(len, pieces)), start, end, size)
            else:  # the whole object (a server that ignores Range)
                whole = b"".join(_read_pieces(response, size, size, deadline))
                check_length(what, 200, len(whole), start, end, size)
                pieces = [whole]
        except BaseException:
            _discard(response)
            raise
        response.release_conn()
        return pieces


def _discard(response: Any) -> None:
    """Close a connection whose body was not read to the end: it cannot be reused."""
    response.close()
    response.release_conn()


def _read_pieces(
    response: Any, length: int, piece: int, deadline: float, land: Landing | None = None
) -> list[bytes | memoryview]:
    """Up to ``length`` body bytes in pieces of ``piece``, the deadline checked between
    pieces; each piece received into memory from ``land`` when given. Read undecoded: the
    range is over the stored bytes, whatever their encoding."""
    pieces: list[bytes | memoryview] = []
    left = length
    try:
        while left > 0:
            data: bytes | memoryview
            if land is not None:
                data = land(min(piece, left))
                got = response.readinto(data)
                data = data if got == len(data) else data[:got]
            else:
                data = response.read(min(piece, left), decode_content=False)
            if not data:
                break
            pieces.append(data)
            left -= len(data)
            if left > 0 and time.monotonic() > deadline:
                raise TransientError("the read deadline passed while the body arrived")
    except (OSError, HTTPFailure) as exc:  # reset, bad chunk, stall
        raise TransientError(str(exc) or type(exc).__name__) from exc
    return pieces

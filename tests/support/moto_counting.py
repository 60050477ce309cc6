"""Moto's S3 server behind a WSGI middleware that counts requests and bytes sent.

Run as ``python tests/support/moto_counting.py --host 127.0.0.1 --port PORT``.

``GET /_counts`` returns the counters as JSON and ``POST /_counts/reset`` zeroes
them; neither is counted. ``GET /_counts/ranges`` lists every GetObject body sent since the
reset, in order, as ``[key, first offset, end offset, bytes sent before]`` (to tell which
fetch paid twice). Body bytes are counted from the iterable the app
returns, so a ranged GET counts only the bytes of its range. GetObject requests
and bytes are also counted per ``bucket/key`` (``get_object_*_by_key``).
``get_object_refetched_bytes`` counts the GetObject body bytes whose offsets in their object
were already sent since the last reset (each response's first offset from its
Content-Range): a byte paid for twice, whatever the total says.

Shaping (a store with latency): ``--latency-ms MS`` holds each S3 response until MS after
its request arrived (first-byte latency), ``--bandwidth-mb MB`` sends each response body at
no more than MB x 10^6 bytes/s. Both apply per request, and so per connection (a connection
carries one request at a time); the counters are unchanged by them. The environment's
``MOTO_COUNTING_LATENCY_MS`` / ``MOTO_COUNTING_BANDWIDTH_MB`` give the defaults, and
``POST /_shape?latency_ms=MS&bandwidth_mb=MB`` changes them at run time (no parameters:
off), as ``POST /_delay`` slows single keys.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import re
import signal
import socket
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from types import FrameType
from typing import IO, Any, cast
from urllib.parse import parse_qsl

from moto.server import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
from werkzeug.serving import make_server
from werkzeug.wsgi import LimitedStream

StartResponse = Callable[..., Any]
WSGIApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]

DELAY_PATH = "/_delay"  # POST ?key=SUBSTRING&seconds=S: slow GetObject on matching keys
SHAPE_PATH = "/_shape"  # POST ?latency_ms=MS&bandwidth_mb=MB: shape every S3 response
COUNTS_PATH = "/_counts"
RESET_PATH = "/_counts/reset"
RANGES_PATH = "/_counts/ranges"
LATENCY_ENV = "MOTO_COUNTING_LATENCY_MS"
BANDWIDTH_ENV = "MOTO_COUNTING_BANDWIDTH_MB"
# A body is paced in pieces this large: at 100 MB/s one piece is 0.66 ms on the wire.
PACE_BYTES = 64 << 10

# Query parameters that may accompany a GetObject or a bucket listing. Anything
# else (?acl, ?tagging, ?uploads, ?location, ...) is some other operation.
_GET_OBJECT_PARAMS = frozenset({"versionId", "partNumber", "x-id"})
_LIST_PARAMS = frozenset(
    {
        "list-type",
        "prefix",
        "delimiter",
        "marker",
        "max-keys",
        "encoding-type",
        "continuation-token",
        "start-after",
        "fetch-owner",
        "x-id",
    }
)


# A presigned URL carries its signature in the query (SigV4: X-Amz-*; SigV2: these three).
_PRESIGN_V2_PARAMS = frozenset({"AWSAccessKeyId", "Signature", "Expires"})


_CONTENT_RANGE = re.compile(r"bytes (\d+)-\d+/")


def _is_presign(param: str) -> bool:
    return param.startswith("X-Amz-") or param in _PRESIGN_V2_PARAMS


def classify(method: str, path: str, query: str) -> str | None:
    """Return "get_object", "list" or None for an S3 request (path-style addressing)."""
    if method != "GET":
        return None
    bucket, _, key = path.lstrip("/").partition("/")
    if not bucket:
        return None  # ListBuckets
    params = {name for name, _ in parse_qsl(query, keep_blank_values=True)}
    if key:
        plain = all(
            p in _GET_OBJECT_PARAMS or p.startswith("response-") or _is_presign(p) for p in params
        )
        return "get_object" if plain else None
    return "list" if params <= _LIST_PARAMS else None


class Counters:
    """Per-method request and body-byte counters, safe to update from many threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.requests: dict[str, int] = {}
            self.bytes: dict[str, int] = {}
            self.get_object_requests = 0
            self.get_object_bytes = 0
            self.list_requests = 0
            # "bucket/key" -> GetObject requests / body bytes, to tell shard reads apart.
            self.get_object_requests_by_key: dict[str, int] = {}
            self.get_object_bytes_by_key: dict[str, int] = {}
            self.get_object_refetched_bytes = 0
            # "bucket/key" -> the offsets sent, as sorted disjoint [start, end) runs.
            self._sent: dict[str, tuple[list[int], list[int]]] = {}
            # Each response's body: [key, start, end, of those bytes already sent before].
            self.ranges: list[list[Any]] = []

    def add_request(self, method: str, kind: str | None, key: str = "") -> None:
        with self._lock:
            self.requests[method] = self.requests.get(method, 0) + 1
            self.bytes.setdefault(method, 0)
            if kind == "get_object":
                self.get_object_requests += 1
                by_key = self.get_object_requests_by_key
                by_key[key] = by_key.get(key, 0) + 1
            elif kind == "list":
                self.list_requests += 1

    def add_bytes(
        self,
        method: str,
        kind: str | None,
        n: int,
        key: str = "",
        offset: int | None = None,
        body: list[Any] | None = None,
    ) -> None:
        """``n`` body bytes sent; for a GetObject, ``offset`` is where they start in the
        object (None: unknown, not checked for refetches) and ``body`` the response's entry
        in ``ranges`` (created on its first bytes, then extended)."""
        with self._lock:
            self.bytes[method] = self.bytes.get(method, 0) + n
            if kind == "get_object":
                self.get_object_bytes += n
                by_key = self.get_object_bytes_by_key
                by_key[key] = by_key.get(key, 0) + n
                if offset is not None and n:
                    again = self._mark_sent(key, offset, offset + n)
                    self.get_object_refetched_bytes += again
                    if body is not None:
                        if not body:
                            body[:] = [key, offset, offset, 0]
                            self.ranges.append(body)
                        body[2] += n
                        body[3] += again

    def _mark_sent(self, key: str, start: int, end: int) -> int:
        """Record ``[start, end)`` of ``key`` as sent; how many of its bytes already were."""
        starts, ends = self._sent.setdefault(key, ([], []))
        first = bisect.bisect_left(ends, start)  # runs ending at or before start stay apart
        last = bisect.bisect_right(starts, end)  # runs starting at or after end stay apart
        overlap = sum(max(0, min(end, ends[i]) - max(start, starts[i])) for i in range(first, last))
        if first < last:  # merge the runs that touch or overlap into one
            start, end = min(start, starts[first]), max(end, ends[last - 1])
        starts[first:last] = [start]
        ends[first:last] = [end]
        return overlap

    def ranges_sent(self) -> list[list[Any]]:
        with self._lock:
            return [list(entry) for entry in self.ranges]

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "requests": dict(self.requests),
                "bytes": dict(self.bytes),
                "get_object_requests": self.get_object_requests,
                "get_object_bytes": self.get_object_bytes,
                "list_requests": self.list_requests,
                "get_object_requests_by_key": dict(self.get_object_requests_by_key),
                "get_object_bytes_by_key": dict(self.get_object_bytes_by_key),
                "get_object_refetched_bytes": self.get_object_refetched_bytes,
            }


@dataclass(frozen=True)
class Shaping:
    """First-byte latency and a bandwidth cap for every S3 response (0: none)."""

    latency_ms: float = 0.0
    bandwidth_mb: float = 0.0  # 10^6 bytes/s per response

    @classmethod
    def from_query(cls, query: str) -> Shaping:
        params = urllib.parse.parse_qs(query)
        latency = float(params.get("latency_ms", ["0"])[0])
        bandwidth = float(params.get("bandwidth_mb", ["0"])[0])
        if latency < 0 or bandwidth < 0:
            raise ValueError("latency_ms and bandwidth_mb must be >= 0")
        return cls(latency, bandwidth)

    def hold_first_byte(self, arrived: float) -> None:
        """Sleep until ``latency_ms`` after ``arrived`` (time.monotonic())."""
        wait = arrived + self.latency_ms / 1e3 - time.monotonic()
        if wait > 0:
            time.sleep(wait)

    def paced(self, chunks: Iterable[bytes]) -> Iterator[bytes]:
        """``chunks`` in pieces of at most PACE_BYTES, each released once the cap has let
        its last byte through; so N bytes take at least N / cap. A stalled client gets no
        burst after: the pace restarts from the moment it was late."""
        if not self.bandwidth_mb:
            yield from chunks
            return
        rate = self.bandwidth_mb * 1e6
        due = time.monotonic()
        for chunk in chunks:
            view = memoryview(chunk)
            for start in range(0, len(view), PACE_BYTES):
                piece = view[start : start + PACE_BYTES]
                due = max(due, time.monotonic()) + len(piece) / rate
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                yield bytes(piece)


def body_offset(status: str, headers: list[tuple[str, str]]) -> int | None:
    """Where a GetObject response's body starts in its object: 0 for a whole object, the
    first offset of its Content-Range for a 206, None for anything else (an error)."""
    code = status.split(" ", 1)[0]
    if code == "200":
        return 0
    if code != "206":
        return None
    for name, value in headers:
        if name.lower() == "content-range":
            match = _CONTENT_RANGE.match(value.strip())
            return int(match.group(1)) if match else None
    return None


class CountingMiddleware:
    """Wrap a WSGI app, counting each request and the body bytes handed to the server."""

    def __init__(self, app: WSGIApp, shaping: Shaping | None = None) -> None:
        self.app = app
        self.counters = Counters()
        self.delays: dict[str, float] = {}  # key substring -> seconds, for fault injection
        self.shaping = shaping or Shaping()

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        arrived = time.monotonic()
        method = str(environ.get("REQUEST_METHOD", "GET")).upper()
        path = str(environ.get("PATH_INFO", ""))
        if path in (COUNTS_PATH, RESET_PATH, RANGES_PATH):
            return self._serve_counts(method, path, start_response)
        if path == DELAY_PATH:
            return self._set_delay(str(environ.get("QUERY_STRING", "")), start_response)
        if path == SHAPE_PATH:
            return self._set_shaping(str(environ.get("QUERY_STRING", "")), start_response)
        kind = classify(method, path, str(environ.get("QUERY_STRING", "")))
        # PATH_INFO is already percent-decoded (WSGI).
        key = path.lstrip("/") if kind == "get_object" else ""
        self.counters.add_request(method, kind, key)
        for part, seconds in list(self.delays.items()):
            if key and part in key:
                time.sleep(seconds)  # counted first, so a test can see the request waiting
        shaping = self.shaping  # one setting for the whole response
        offset: list[int | None] = [None]  # where the body starts in the object

        def starting(status: str, headers: list[tuple[str, str]], *rest: Any) -> Any:
            offset[0] = body_offset(status, headers)
            return start_response(status, headers, *rest)

        body = self.app(environ, starting if kind == "get_object" else start_response)
        # werkzeug sends the status line with the first body bytes; moto has built the whole
        # response by now, so holding here delays every byte of it.
        shaping.hold_first_byte(arrived)
        if method == "HEAD":
            # werkzeug never writes a body for HEAD, whatever the app returns.
            return body
        return self._count_body(shaping.paced(body), method, kind, key, body, offset[0])

    def _count_body(
        self,
        chunks: Iterable[bytes],
        method: str,
        kind: str | None,
        key: str,
        body: object,
        offset: int | None,
    ) -> Iterator[bytes]:
        entry: list[Any] = []  # this body's line in ``ranges``
        try:
            for chunk in chunks:
                # Count before yielding so the counters are current by the time
                # the client has the bytes in hand.
                self.counters.add_bytes(method, kind, len(chunk), key, offset, entry)
                if offset is not None:
                    offset += len(chunk)
                yield chunk
        finally:
            close = getattr(body, "close", None)  # the app's own iterable (WSGI)
            if close is not None:
                close()

    def _set_delay(self, query: str, start_response: StartResponse) -> Iterable[bytes]:
        params = urllib.parse.parse_qs(query)
        key = params.get("key", [""])[0]
        seconds = float(params.get("seconds", ["0"])[0])
        if key and seconds > 0:
            self.delays[key] = seconds
        else:
            self.delays.clear()
        start_response("200 OK", [("Content-Type", "application/json")])
        return [json.dumps(self.delays).encode()]

    def _set_shaping(self, query: str, start_response: StartResponse) -> Iterable[bytes]:
        try:
            self.shaping = Shaping.from_query(query)
        except ValueError as exc:
            start_response("400 Bad Request", [("Content-Type", "text/plain")])
            return [str(exc).encode()]
        start_response("200 OK", [("Content-Type", "application/json")])
        return [json.dumps(asdict(self.shaping)).encode()]

    def _serve_counts(
        self, method: str, path: str, start_response: StartResponse
    ) -> Iterable[bytes]:
        if path == RESET_PATH and method == "POST":
            self.counters.reset()
            payload = b'{"reset": true}'
        elif path == COUNTS_PATH and method == "GET":
            payload = json.dumps(self.counters.snapshot()).encode()
        elif path == RANGES_PATH and method == "GET":
            payload = json.dumps(self.counters.ranges_sent()).encode()
        else:
            start_response("405 Method Not Allowed", [("Content-Length", "0")])
            return [b""]
        start_response(
            "200 OK",
            [("Content-Type", "application/json"), ("Content-Length", str(len(payload)))],
        )
        return [payload]


class QuietRequestHandler(MotoRequestHandler):
    """Moto's handler without a log line per request (tests make thousands), keeping
    connections alive as S3 does.

    werkzeug's own handler closes every connection after one answer, so each GET of a
    client that pools connections (lean_http, aiohttp, urllib3) paid a fresh TCP connection,
    and the server a fresh thread: costs S3 never charges a kept-alive client, measured here
    as if they were the client's own. This handler answers over HTTP/1.1 and keeps the
    connection open after any answer of known length, the request body read to its end."""

    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        super().setup()
        # The head and the body go out as separate writes: with Nagle's algorithm a small
        # body would wait for the client's delayed ACK of the head (40 ms per request here).
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        pass

    def run_wsgi(self) -> None:
        environ = self.make_environ()
        if environ.get("wsgi.input_terminated"):  # a chunked body: read by the app, then close
            self.close_connection = True
        else:
            length = int(environ.get("CONTENT_LENGTH") or 0)
            environ["wsgi.input"] = LimitedStream(cast(IO[bytes], self.rfile), length)
        self._status = ""
        self._headers: list[tuple[str, str]] = []
        self._sent, self._body = False, True

        def start_response(
            status: str, headers: list[tuple[str, str]], exc_info: Any = None
        ) -> Callable[[bytes], None]:
            if exc_info is not None and self._sent:
                raise exc_info[1].with_traceback(exc_info[2])
            self._status, self._headers = status, headers
            return self._write

        try:
            answer = self.server.app(environ, start_response)
            try:
                for data in answer:
                    self._write(data)
                self._write(b"")  # the head, for an empty body
            finally:
                close = getattr(answer, "close", None)
                if close is not None:
                    close()
            if not self.close_connection:
                environ["wsgi.input"].exhaust()  # the next request starts after this body
        except (ConnectionError, TimeoutError):
            self.close_connection = True
        except Exception:
            self.close_connection = True
            if not self._sent:
                self.send_error(500)
            raise

    def _write(self, data: bytes) -> None:
        if not self._sent:
            self._send_head()
        if data and self._body:
            self.wfile.write(data)

    def _send_head(self) -> None:
        code, _, reason = self._status.partition(" ")
        status = int(code)
        self.send_response(status, reason)
        names = set()
        for name, value in self._headers:
            self.send_header(name, value)
            names.add(name.lower())
        self._body = self.command != "HEAD" and not (100 <= status < 200 or status in (204, 304))
        if self._body and "content-length" not in names:
            self.close_connection = True  # the body ends where the connection does
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self._sent = True


def build_app(shaping: Shaping | None = None) -> CountingMiddleware:
    dispatcher = DomainDispatcherApplication(create_backend_app)
    # Build the S3 app now rather than on the first request, so readiness
    # means ready to serve S3.
    dispatcher.get_application({"PATH_INFO": "/"})
    return CountingMiddleware(dispatcher, shaping)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--verbose", action="store_true", help="log every request")
    parser.add_argument(
        "--latency-ms",
        type=float,
        default=float(os.environ.get(LATENCY_ENV, "0")),
        help=f"first-byte latency of every S3 response (0; env {LATENCY_ENV})",
    )
    parser.add_argument(
        "--bandwidth-mb",
        type=float,
        default=float(os.environ.get(BANDWIDTH_ENV, "0")),
        help=f"cap on each response body, 10^6 bytes/s (0: none; env {BANDWIDTH_ENV})",
    )
    args = parser.parse_args(argv)
    if args.latency_ms < 0 or args.bandwidth_mb < 0:
        parser.error("--latency-ms and --bandwidth-mb must be >= 0")
    shaping = Shaping(args.latency_ms, args.bandwidth_mb)

    os.environ.setdefault("MOTO_PORT", str(args.port))
    handler = MotoRequestHandler if args.verbose else QuietRequestHandler
    server = make_server(
        args.host, args.port, build_app(shaping), threaded=True, request_handler=handler
    )

    def stop(signum: int, frame: FrameType | None) -> None:
        # shutdown() waits for serve_forever() to return, so it must run elsewhere.
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"serving moto S3 on http://{args.host}:{server.port}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())

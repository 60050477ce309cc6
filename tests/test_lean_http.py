"""The presigned path's HTTP client against a real HTTP/1.1 server on loopback: kept-alive
connections are reused, and answers that end a connection, arrive in chunks, stop short or
break HTTP are read as they are."""

from __future__ import annotations

import io
import socket
import socketserver
import threading
import time
import urllib.parse
from collections.abc import Iterator

import pytest

from shardfs.store.lean_http import (
    HTTPFailure,
    LeanPool,
    LeanResponse,
    _read_head,
    _read_head_lines,
    _receive_waiting,
    _split,
)

BODY = bytes(range(256)) * 40


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.connections = 0
        self.mode = "keep"
        self.requests: list[bytes] = []


class _Handler(socketserver.StreamRequestHandler):
    server: _Server

    def handle(self) -> None:
        self.server.connections += 1
        while True:
            head = b""
            while not head.endswith(b"\r\n\r\n"):
                line = self.rfile.readline()
                if not line:
                    return
                head += line
            self.server.requests.append(head)
            mode = self.server.mode
            if mode == "garbage":
                self.wfile.write(b"NOT HTTP\r\n\r\n")
                return
            if mode == "chunked":
                self.wfile.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                for at in range(0, len(BODY), 3000):
                    piece = BODY[at : at + 3000]
                    self.wfile.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
                self.wfile.write(b"0\r\n\r\n")
                continue
            if mode == "bad_header":
                self.wfile.write(b"HTTP/1.1 200 OK\r\nno colon here\r\nContent-Length: 0\r\n\r\n")
                return
            if mode == "lf_only":  # bare line feeds: read a line at a time
                self.wfile.write(f"HTTP/1.1 206 Partial\nContent-Length: {len(BODY)}\n\n".encode())
                self.wfile.write(BODY)
                continue
            length = len(BODY) + (10 if mode == "short" else 0)
            close = b"Connection: close\r\n" if mode == "close" else b""
            head = (
                b"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 0-1/2\r\n"
                + f"Content-Length: {length}\r\n".encode()
                + close
                + b"\r\n"
            )
            if mode in ("trickle", "stall"):  # the body in pieces, with pauses
                self.wfile.write(head)
                self.wfile.flush()
                for at in range(0, len(BODY), len(BODY) // 4):
                    time.sleep(0.1 if mode == "trickle" or at == 0 else 3.0)
                    self.wfile.write(BODY[at : at + len(BODY) // 4])
                    self.wfile.flush()
                continue
            if mode == "split_head":  # the head in pieces: its first receive is not whole
                for at in range(0, len(head), 7):
                    self.wfile.write(head[at : at + 7])
                    self.wfile.flush()
                    time.sleep(0.01)
                self.wfile.write(BODY)
                continue
            self.wfile.write(head + BODY)
            if mode in ("close", "short", "drop"):
                return  # "drop": closes without saying so, as an idle timeout does


@pytest.fixture
def server() -> Iterator[_Server]:
    srv = _Server()
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _get(pool: LeanPool, srv: _Server, path: str = "/b/k?sig=1") -> tuple[LeanResponse, bytes]:
    port = srv.server_address[1]
    response = pool.request(
        "GET", f"http://127.0.0.1:{port}{path}", {"Range": "bytes=0-1"}, timeout=(2.0, 2.0)
    )
    body = b""
    while data := response.read(4096):
        body += data
    response.release_conn()
    return response, body


def test_a_kept_alive_connection_serves_every_request(server: _Server) -> None:
    pool = LeanPool()
    for _ in range(5):
        response, body = _get(pool, server)
        assert (response.status, body) == (206, BODY)
        assert response.headers.get("Content-Range") == "bytes 0-1/2"
    assert server.connections == 1
    first = server.requests[0]
    assert first.startswith(b"GET /b/k?sig=1 HTTP/1.1\r\nHost: 127.0.0.1:")
    assert b"\r\nRange: bytes=0-1\r\n" in first


def test_connection_close_is_honoured(server: _Server) -> None:
    server.mode = "close"
    pool = LeanPool()
    for _ in range(3):
        assert _get(pool, server)[1] == BODY
    assert server.connections == 3


def test_an_idle_connection_the_server_dropped_is_replaced(server: _Server) -> None:
    server.mode = "drop"
    pool = LeanPool()
    for _ in range(3):
        assert _get(pool, server)[1] == BODY
    assert server.connections == 3


def test_a_chunked_body_is_decoded_and_the_connection_kept(server: _Server) -> None:
    server.mode = "chunked"
    pool = LeanPool()
    assert _get(pool, server)[1] == BODY
    assert _get(pool, server)[1] == BODY
    assert server.connections == 1


def test_a_body_cut_short_is_short_and_its_connection_is_not_reused(server: _Server) -> None:
    server.mode = "short"
    pool = LeanPool()
    assert _get(pool, server)[1] == BODY  # 10 bytes fewer than Content-Length promised
    server.mode = "keep"
    assert _get(pool, server)[1] == BODY
    assert server.connections == 2


def test_an_answer_that_is_not_http_is_a_failure(server: _Server) -> None:
    server.mode = "garbage"
    with pytest.raises(HTTPFailure, match="bad status line"):
        _get(LeanPool(), server)


@pytest.mark.parametrize("mode", ["keep", "split_head", "lf_only"])
def test_a_head_whole_in_pieces_or_with_bare_line_feeds_reads_alike(
    server: _Server, mode: str
) -> None:
    server.mode = mode
    pool = LeanPool()
    for _ in range(2):  # the second answer's head follows a body on the same connection
        response, body = _get(pool, server)
        assert body == BODY
        assert response.status == 206
        assert response.headers.get("Content-Length") == str(len(BODY))
        assert response.version == "HTTP/1.1"
    assert server.connections == 1
    if mode != "lf_only":
        assert response.headers.text("content-range") == "bytes 0-1/2"


HEADS = [
    b'HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 0-1/2\r\nETag:  "Ab"  \r\n'
    b"X-Empty:\r\nx-amz-Meta: a:b\r\nContent-Length: 4\r\n\r\n",
    b"HTTP/1.0 200\r\n\r\n",
    b"HTTP/1.1 200 OK\nA: b\r\n\r\n",  # a bare LF ends the status line
    b"HTTP/1.1 200 OK\r\nA: b\nC: d\r\n\r\n",  # and a field
    b"HTTP/1.1 200 OK\nContent-Length: 4\n\n",  # the head ends with bare LFs...
    b"HTTP/1.1 200 OK\r\nContent-Length: 4\n\r\n",  # ...or a CRLF after a bare LF
    b"HTTP/1.1 200 OK\r\nName \t:\t a  b \t\r\nB:c:d\r\nB: e\r\n:\r\n\r\n",  # blanks, colons, twice
]


@pytest.mark.parametrize("head", HEADS)
def test_a_head_read_in_one_piece_reads_as_a_line_at_a_time(head: bytes) -> None:
    body = b"ab\r\n\r\ncd"  # looks like a head's end: never taken for one
    whole, lines = (io.BufferedReader(io.BytesIO(head + body)) for _ in range(2))
    assert _read_head(whole) == _read_head_lines(lines)
    assert whole.read() == lines.read() == body


@pytest.mark.parametrize(
    "head",
    [b"HTTP/1.1 200 OK\r\nno colon\r\n\r\n", b"HTTP/1.1 200 OK\r\n" + b"A: b\r\n" * 201 + b"\r\n"],
)
def test_a_bad_head_read_in_one_piece_fails_as_a_line_at_a_time(head: bytes) -> None:
    failures = []
    for read in (_read_head, _read_head_lines):
        with pytest.raises(HTTPFailure) as failure:
            read(io.BufferedReader(io.BytesIO(head)))
        failures.append(str(failure.value).split(" ")[:2])
    assert failures[0] == failures[1]


def test_a_header_line_without_a_colon_is_a_failure(server: _Server) -> None:
    server.mode = "bad_header"
    with pytest.raises(HTTPFailure, match="bad header line"):
        _get(LeanPool(), server)


def test_a_refused_connection_is_an_os_error() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(OSError):
        LeanPool().request("GET", f"http://127.0.0.1:{port}/x", {}, timeout=(1.0, 1.0))


def _get_into(
    pool: LeanPool, srv: _Server, stall: float, want: int = len(BODY)
) -> tuple[int, bytes]:
    """A GET whose body is received into memory (as a block is), ``stall`` the longest a
    receive may wait with nothing arriving."""
    port = srv.server_address[1]
    response = pool.request("GET", f"http://127.0.0.1:{port}/b/k", {}, timeout=(2.0, stall))
    buffer = bytearray(want)
    try:
        got = response.readinto(memoryview(buffer))
    except BaseException:
        response.close()
        raise
    response.release_conn()
    return got, bytes(buffer[:got])


def test_a_body_received_into_memory_waits_out_pauses_and_keeps_its_connection(
    server: _Server,
) -> None:
    server.mode = "trickle"  # four pieces, 0.1 s apart: each pause shorter than the stall
    pool = LeanPool()
    assert _get_into(pool, server, stall=1.0) == (len(BODY), BODY)
    server.mode = "keep"  # the connection, back to its own timeout, serves the next one
    assert _get_into(pool, server, stall=1.0) == (len(BODY), BODY)
    assert _get(pool, server)[1] == BODY
    assert server.connections == 1


def test_a_body_that_stops_arriving_is_a_timeout_within_two_stalls(server: _Server) -> None:
    server.mode = "stall"  # a quarter of the body, then 3 s of nothing
    pool = LeanPool()
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        _get_into(pool, server, stall=0.3)
    assert time.monotonic() - started < 2.0


def test_a_body_cut_short_received_into_memory_is_short(server: _Server) -> None:
    server.mode = "short"  # Content-Length 10 bytes more than the body, then closed
    pool = LeanPool()
    assert _get_into(pool, server, stall=1.0, want=len(BODY) + 10) == (len(BODY), BODY)
    server.mode = "keep"
    assert _get_into(pool, server, stall=1.0) == (len(BODY), BODY)
    assert server.connections == 2  # the short answer's connection was not reused


def test_a_stall_shorter_than_the_kernels_clock_still_ends() -> None:
    """A stall of a nanosecond is no receive timeout of zero, which would wait for ever."""
    a, b = socket.socketpair()
    outcome: list[object] = []

    def receive() -> None:
        try:
            outcome.append(_receive_waiting(a, memoryview(bytearray(200)), 0, 1e-9))
        except TimeoutError as exc:
            outcome.append(exc)

    try:
        b.sendall(bytes(100))  # half of what is asked, then nothing
        thread = threading.Thread(target=receive, daemon=True)
        thread.start()
        thread.join(timeout=10.0)
        assert not thread.is_alive()
        assert len(outcome) == 1 and isinstance(outcome[0], TimeoutError)
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:5000/bucket/key?X-Amz-Signature=1&b=2",
        "HTTPS://Bucket.S3.amazonaws.com/a/b%20c?x=1#fragment",
        "http://h",
        "http://h?x=1",
        "http://[::1]:8080/p?q",
        "http://user:pw@h:81/x",
        "http://h#f",
        "http://h/a#b?c",
    ],
)
def test_a_url_splits_as_urllib_splits_it(url: str) -> None:
    split = urllib.parse.urlsplit(url)
    scheme = split.scheme.lower()
    port = split.port or (443 if scheme == "https" else 80)
    target = (split.path or "/") + (f"?{split.query}" if split.query else "")
    assert _split(url) == ((scheme, split.hostname, port), split.netloc, target)


@pytest.mark.parametrize("url", ["ftp://h/x", "http:///x", "nonsense"])
def test_a_url_that_is_not_http_is_a_failure(url: str) -> None:
    with pytest.raises(HTTPFailure, match="not an http"):
        _split(url)

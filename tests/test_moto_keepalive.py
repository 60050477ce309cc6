"""The test store keeps connections alive, as S3 does (``moto_counting.QuietRequestHandler``).

werkzeug's handler closed every connection after one answer, so each GET of a pooling client
paid a TCP handshake and a fresh server thread that S3 never charges. These tests send
several requests down one connection and check each answer, and that the counters still
count each one.
"""

from __future__ import annotations

import http.client
import os
import socket
import threading
import urllib.parse

import pytest
from support import moto_counting
from support.s3 import S3Server
from werkzeug.serving import make_server

pytestmark = pytest.mark.s3


def _signed(server: S3Server, path: str, method: str = "get_object") -> str:
    """The path and query of a presigned URL (moto refuses unsigned reads)."""
    url = urllib.parse.urlsplit(server.filesystem().url(path, client_method=method))
    return f"{url.path}?{url.query}"


def _answer(
    conn: http.client.HTTPConnection, method: str, path: str, body: bytes = b""
) -> tuple[int, bytes, str | None]:
    conn.request(method, path, body=body if body else None)
    response = conn.getresponse()
    data = response.read()
    return response.status, data, response.getheader("Connection")


def test_one_connection_carries_a_put_a_ranged_get_a_head_and_a_get(s3_server: S3Server) -> None:
    s3_server.create_bucket("keepalive")
    payload = os.urandom(300_000)
    get = _signed(s3_server, "keepalive/one.bin")
    conn = http.client.HTTPConnection(s3_server.host, s3_server.port, timeout=30)
    try:
        s3_server.reset_counts()
        put = _signed(s3_server, "keepalive/one.bin", "put_object")
        status, _, closing = _answer(conn, "PUT", put, payload)
        assert status == 200 and closing is None
        sock = conn.sock
        assert sock is not None  # http.client drops the socket after "Connection: close"

        conn.request("GET", get, headers={"Range": "bytes=1000-1999"})
        response = conn.getresponse()
        assert response.status == 206 and response.read() == payload[1000:2000]
        assert conn.sock is sock

        conn.request("HEAD", _signed(s3_server, "keepalive/one.bin", "head_object"))
        response = conn.getresponse()
        assert response.status == 200 and response.read() == b""
        assert int(response.getheader("Content-Length") or -1) == len(payload)
        assert conn.sock is sock  # a HEAD's length announces no body to skip

        status, data, closing = _answer(conn, "GET", get)
        assert status == 200 and data == payload and closing is None
        assert conn.sock is sock

        status, error, _ = _answer(conn, "GET", _signed(s3_server, "keepalive/missing.bin"))
        assert status == 404 and b"NoSuchKey" in error
        status, data, _ = _answer(conn, "GET", get)
        assert status == 200 and data == payload and conn.sock is sock  # after an error too
    finally:
        conn.close()
    counts = s3_server.counts()
    assert counts["get_object_requests"] == 4  # the ranged GET, two whole ones, the 404
    assert counts["get_object_bytes"] == 1000 + 2 * len(payload) + len(error)


def test_a_put_body_the_store_does_not_read_is_skipped_before_the_next_request(
    s3_server: S3Server,
) -> None:
    """A request refused (no such bucket) may leave its body unread on the connection: the
    next request must start after that body, not inside it (which the body, made of request
    lines, would otherwise turn into requests)."""
    s3_server.create_bucket("keepalive")
    conn = http.client.HTTPConnection(s3_server.host, s3_server.port, timeout=30)
    try:
        refused = _signed(s3_server, "no-such-bucket-here/x.bin", "put_object")
        status, _, _ = _answer(conn, "PUT", refused, b"GET / HTTP/1.1\r\n" * 4096)
        assert status == 404
        sock = conn.sock
        assert sock is not None
        payload = b"after the refused body"
        status, _, _ = _answer(
            conn, "PUT", _signed(s3_server, "keepalive/two.bin", "put_object"), payload
        )
        assert status == 200
        status, data, _ = _answer(conn, "GET", _signed(s3_server, "keepalive/two.bin"))
        assert status == 200 and data == payload and conn.sock is sock
    finally:
        conn.close()


def test_the_server_sends_without_waiting_for_acks() -> None:
    """An answer's head and body are separate writes: with Nagle's algorithm the body of a
    small answer waits for the client's delayed ACK of the head, 40 ms per request on a
    kept-alive connection. The handler turns it off on every connection it serves."""
    seen: list[int] = []

    class Probe(moto_counting.QuietRequestHandler):
        def setup(self) -> None:
            super().setup()
            seen.append(self.connection.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

    server = make_server(
        "127.0.0.1", 0, moto_counting.build_app(), threaded=True, request_handler=Probe
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        for _ in range(3):
            conn.request("GET", "/_counts")
            response = conn.getresponse()
            assert response.status == 200 and b"get_object_bytes" in response.read()
        conn.close()
    finally:
        server.shutdown()
        thread.join(timeout=30)
    assert seen == [1]  # one connection carried the three requests, without delay

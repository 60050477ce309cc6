"""A small HTTP/1.1 client for the presigned GETs of ``presigned``: one request line, a few
headers, the status and headers parsed by hand, the body read straight off the socket, and
kept-alive connections reused.

urllib3 and ``http.client`` spend most of a ranged GET's Python time on work this path
does not need: URL parsing and normalising per request, header validation, and parsing the
answer's headers with the ``email`` package. In uniform mode through a small cache, where
each file is its own GET, that was about 60% of the daemon's GIL time (py-spy ``--gil``,
issue 21). Everything here raises ``OSError`` (timeouts, resets, refused connections) or
``HTTPFailure`` (an answer that is not HTTP as expected); the caller makes both transient.
"""

from __future__ import annotations

import functools
import io
import re
import socket
import ssl
import struct
import threading
import urllib.parse
from typing import BinaryIO

_MAX_HEADER_LINE = 64 << 10
_MAX_HEADERS = 200
_IDLE_PER_HOST = 32
# A field line: the name up to the first colon, the value to the CRLF, both stripped after.
# Greedy, so a match never backtracks: the lazy form with the blanks in the pattern, run
# twice per GET, took 38 us for moto's twelve fields; this one and the strips take 11.
_FIELD = re.compile(r"([^:\r\n]*):([^\r\n]*)\r\n")


class HTTPFailure(Exception):
    """An answer that breaks HTTP: a bad status line, header or chunk."""


class Headers(dict[str, str]):
    """Response headers by lower-cased name; ``get`` takes any case."""

    def get(self, name: str, default: str | None = None) -> str | None:  # type: ignore[override]
        return super().get(name.lower(), default)

    def text(self, name: str) -> str:
        """The header's value, lower-cased; "" when absent."""
        return super().get(name.lower(), "").lower()


class _Connection:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.file: io.BufferedReader = sock.makefile("rb")

    def close(self) -> None:
        self.file.close()
        self.sock.close()


class LeanResponse:
    """One answer: ``status``, ``headers``, the body by ``read(n)``; ``release_conn`` hands
    a wholly read connection back for reuse, ``close`` drops it."""

    def __init__(self, pool: LeanPool, key: tuple[str, str, int], conn: _Connection) -> None:
        self._pool = pool
        self._key = key
        self._conn: _Connection | None = conn
        self.status, self.headers, self.version = _read_head(conn.file)
        self._keep = self.version == "HTTP/1.1" and (self.headers.text("connection") != "close")
        self._chunked = "chunked" in self.headers.text("transfer-encoding")
        self._chunk_left = 0
        self._done = False
        length = self.headers.get("content-length")
        self._left: int | None = None
        if not self._chunked and length is not None:
            try:
                self._left = int(length)
            except ValueError:
                raise HTTPFailure(f"bad Content-Length {length!r}") from None
        if self._left is None and not self._chunked:
            self._keep = False  # the body runs to the connection's end

    def read(self, n: int, decode_content: bool = False) -> bytes:
        """Up to ``n`` bytes of the body (fewer only where it ends); b"" at its end."""
        conn = self._conn
        if conn is None or self._done or n <= 0:
            return b""
        if self._chunked:
            return self._read_chunked(conn.file, n)
        want = n if self._left is None else min(n, self._left)
        data = conn.file.read(want)
        if self._left is not None:
            self._left -= len(data)
            self._done = self._left == 0
            if len(data) < want:
                self._keep = False  # cut short: the connection is spent
                self._done = True
        elif not data:
            self._done = True
        return data

    def readinto(self, view: memoryview) -> int:
        """Fill ``view`` from the body (less only where the body ends); the bytes filled."""
        conn = self._conn
        if conn is None or self._done or not len(view):
            return 0
        if self._chunked:  # rare for a ranged GET: read, then copy
            filled = 0
            while filled < len(view):
                data = self._read_chunked(conn.file, len(view) - filled)
                if not data:
                    break
                view[filled : filled + len(data)] = data
                filled += len(data)
            return filled
        want = len(view) if self._left is None else min(len(view), self._left)
        filled = _receive(conn, view[:want])
        if self._left is not None:
            self._left -= filled
            self._done = self._left == 0
            if filled < want:
                self._keep = False  # cut short: the connection is spent
                self._done = True
        elif filled < want:
            self._done = True
        return filled

    def _read_chunked(self, file: BinaryIO, n: int) -> bytes:
        if self._chunk_left == 0:
            line = file.readline(_MAX_HEADER_LINE)
            try:
                self._chunk_left = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise HTTPFailure(f"bad chunk size line {line[:40]!r}") from None
            if self._chunk_left == 0:
                while file.readline(_MAX_HEADER_LINE) not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                self._done = True
                return b""
        data = file.read(min(n, self._chunk_left))
        self._chunk_left -= len(data)
        if not data:
            self._keep, self._done = False, True
        elif self._chunk_left == 0:
            file.read(2)  # the chunk's CRLF
        return data

    def release_conn(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._keep and self._done:
            self._pool.put_back(self._key, conn)
        else:
            conn.close()

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()


def _receive(conn: _Connection, view: memoryview) -> int:
    """Fill ``view`` from the connection (less only where it ends): first the bytes its
    reader holds, then straight from the socket."""
    held = conn.file.peek(1)  # the reader's buffered bytes (one read into it when none)
    filled = conn.file.readinto(view[: len(held)]) if held else 0
    if filled < len(held):  # the buffer holds more than the view takes: not emptied
        return filled
    sock = conn.sock
    stall = sock.gettimeout()
    if filled < len(view) and type(sock) is socket.socket and stall:
        return _receive_waiting(sock, view, filled, stall)
    while filled < len(view):
        got = sock.recv_into(view[filled:])
        if not got:
            break
        filled += got
    return filled


def _receive_waiting(sock: socket.socket, view: memoryview, filled: int, stall: float) -> int:
    """The rest of ``view`` from a plain socket in as few receives as the kernel allows:
    blocking, with ``MSG_WAITALL`` and ``stall`` as the kernel's receive timeout. A block's
    body came in about 43 receives of its own, each an interpreter round and a hand-over of
    the interpreter lock; the kernel now waits for the bytes itself. Each receive returns
    what came within ``stall`` seconds; one that got nothing raises TimeoutError, as the
    socket's own timeout did (a stall is noticed within one to two ``stall`` periods)."""
    micros = max(1, int(stall * 1e6))  # a zero timeval would wait for ever
    sock.settimeout(None)
    sock.setsockopt(
        socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", *divmod(micros, 1_000_000))
    )
    try:
        while filled < len(view):
            try:
                got = sock.recv_into(view[filled:], 0, socket.MSG_WAITALL)
            except BlockingIOError:  # the receive timeout passed with nothing received
                raise TimeoutError("timed out") from None
            if not got:
                break
            filled += got
    finally:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 0))
        sock.settimeout(stall)
    return filled


def _read_head(file: BinaryIO) -> tuple[int, Headers, str]:
    """The status, headers and HTTP version of an answer. A head already received whole
    (the usual case: one segment) is taken and parsed in one piece, one pattern match
    and a step per field; any other is read a line at a time."""
    held = file.peek(_MAX_HEADER_LINE)  # type: ignore[attr-defined]  # BufferedReader's
    end = held.find(b"\r\n\r\n")
    if end < 0 or held.find(b"\n\n", 0, end) >= 0 or held.find(b"\n\r\n", 0, end) >= 0:
        return _read_head_lines(file)  # not whole yet, or ended earlier by a bare LF
    head = file.read(end + 4).decode("latin-1")
    line_end = head.index("\n")
    status, version = _status(head[:line_end].rstrip("\r"))
    fields = head[line_end + 1 : -2]  # each field with its line end; the empty line left out
    count = fields.count("\n")
    if count > _MAX_HEADERS:
        raise HTTPFailure(f"more than {_MAX_HEADERS} header lines")
    pairs = _FIELD.findall(fields)
    if len(pairs) != count:  # a bare LF, or a line that is no field
        headers = Headers()
        for line in fields.split("\n")[:-1]:
            _add_field(headers, line)
        return status, headers, version
    return status, Headers({name.strip().lower(): value.strip() for name, value in pairs}), version


def _add_field(headers: Headers, line: str) -> None:
    """Add one header line (its line end included or not) to ``headers``."""
    name, colon, value = line.partition(":")
    if not colon:
        raise HTTPFailure(f"bad header line {line[:60]!r}")
    headers[name.strip().lower()] = value.strip()


def _status(line: str) -> tuple[int, str]:
    """The status code and HTTP version of a status line (its line end stripped)."""
    parts = line.split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        raise HTTPFailure(f"bad status line {line[:60]!r}")
    return int(parts[1]), parts[0]


def _read_head_lines(file: BinaryIO) -> tuple[int, Headers, str]:
    line = file.readline(_MAX_HEADER_LINE)
    if not line:
        raise ConnectionResetError("the server closed the connection before answering")
    status, version = _status(line.decode("latin-1").rstrip("\r\n"))
    headers = Headers()
    for _ in range(_MAX_HEADERS):
        raw = file.readline(_MAX_HEADER_LINE)
        if raw in (b"\r\n", b"\n"):
            return status, headers, version
        if not raw.endswith(b"\n"):
            raise HTTPFailure("the answer's headers end early or a line is too long")
        _add_field(headers, raw.decode("latin-1"))
    raise HTTPFailure(f"more than {_MAX_HEADERS} header lines")


def _split(url: str) -> tuple[tuple[str, str, int], str, str]:
    """The connection key (scheme, host, port), the host as written, and the request
    target of an http(s) URL. The scheme and host part is split once per server
    (``_server``); a GET's URL differs only in what follows."""
    scheme, sep, rest = url.partition("://")
    netloc, slash, path = rest.partition("/")
    if not sep or "?" in netloc or "#" in netloc:  # no path before the query: split it all
        split = urllib.parse.urlsplit(url)
        scheme, netloc = split.scheme, split.netloc
        target = (split.path or "/") + (f"?{split.query}" if split.query else "")
    else:
        target = slash + path.partition("#")[0] or "/"
    key = _server(scheme, netloc)
    if key is None:
        raise HTTPFailure(f"not an http(s) URL: {url[:80]!r}")
    return key, netloc, target


@functools.lru_cache(maxsize=64)
def _server(scheme: str, netloc: str) -> tuple[str, str, int] | None:
    """(scheme, host, port) of an http(s) server; None for any other."""
    split = urllib.parse.urlsplit(f"{scheme}://{netloc}/")
    scheme = split.scheme.lower()
    if scheme not in ("http", "https") or not split.hostname:
        return None
    return scheme, split.hostname, split.port or (443 if scheme == "https" else 80)


class LeanPool:
    """Kept-alive connections per (scheme, host, port), shared by threads."""

    def __init__(self) -> None:
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._lock = threading.Lock()
        self._tls: ssl.SSLContext | None = None

    def put_back(self, key: tuple[str, str, int], conn: _Connection) -> None:
        with self._lock:
            idle = self._idle.setdefault(key, [])
            if len(idle) < _IDLE_PER_HOST:
                idle.append(conn)
                return
        conn.close()

    def _connect(self, key: tuple[str, str, int], connect_timeout: float) -> _Connection:
        scheme, host, port = key
        sock = socket.create_connection((host, port), timeout=connect_timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if scheme == "https":
                if self._tls is None:
                    self._tls = ssl.create_default_context()
                sock = self._tls.wrap_socket(sock, server_hostname=host)
        except BaseException:
            sock.close()
            raise
        return _Connection(sock)

    def request(
        self,
        method: str,
        url: str,
        headers: dict[str, str],
        *,
        timeout: tuple[float, float],
        **_: object,
    ) -> LeanResponse:
        """Send ``method url`` and read the answer's head; ``timeout`` is (connect, each
        read). A kept-alive connection the server closed meanwhile is replaced once."""
        key, netloc, target = _split(url)
        lines = [f"{method} {target} HTTP/1.1", f"Host: {netloc}"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        payload = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        connect_timeout, read_timeout = timeout
        while True:
            with self._lock:
                idle = self._idle.get(key)
                conn = idle.pop() if idle else None
            reused = conn is not None
            if conn is None:
                conn = self._connect(key, connect_timeout)
            try:
                conn.sock.settimeout(read_timeout)
                conn.sock.sendall(payload)
                return LeanResponse(self, key, conn)
            except (ConnectionError, HTTPFailure) as exc:
                conn.close()
                if reused and not isinstance(exc, HTTPFailure):
                    continue  # the server closed an idle connection: a fresh one, once each
                raise
            except BaseException:
                conn.close()
                raise

"""An HTTP reverse proxy in front of the moto S3 server that injects faults on request.

Integration tests hand the proxy's address to a mount as ``--endpoint-url``; the proxy
forwards every request to moto unchanged (path, query and the client's own ``Host``
header, so presigned URLs keep working: moto does not check signatures) until a rule
matches, and then misbehaves the way a real store or network sometimes does.

Each GET on an object is put in one of these request kinds:

- ``scan``: a ranged GET, presigned or not, while the phase is ``scan``;
- ``fast``: a presigned GET (the query carries ``X-Amz-Signature`` or ``Signature``) while
  the phase is ``read`` (the default): shardfs's urllib3 read path;
- ``fallback``: a ranged GET without a presigned query while the phase is ``read``: s3fs;
- ``plain``: a GET without ``Range`` (sidecar, classes.txt).

The index scan reads through the same ranged GETs as files do, so the test says which one
it is doing: ``set_phase("scan")`` before a mount that scans, ``set_phase("read")`` after
it returns. That is exact where a guess from range sizes would not be.

A rule names a fault and which requests it hits: a key substring, the request kinds,
``skip`` (matching requests let through first), ``times`` (injections before the rule is
spent; None: no end), ``probability`` (drawn from the rule's own RNG, seeded) and
``per_range`` (the first request for each key and range is hit, its retries are not: every
fetch meets the fault once, whichever thread makes it, so a case does not depend on which
GET happens to come first). Faults:

====================  ================================================================
``status``            answer ``status`` (500, 503, 429, 404, 403, ...) with an S3 error
``reset``             send the headers and ``fraction`` of the body, then a TCP reset
``truncate``          headers promise N bytes; ``fraction`` of them, then a clean close
``short_206``         a 206 with consistent headers but fewer bytes than asked
``long_206``          a 206 with consistent headers but ``shift`` more bytes than asked
``shifted_range``     the bytes of a range ``shift`` away, with a truthful Content-Range
``wrong_content_range``  the right bytes, with a Content-Range naming another range
``etag``              the right bytes under a different ETag header
``stall``             sleep ``seconds`` before the headers (``where="headers"``) or mid-body
``blackhole``         read the request and never answer until the rule is removed
``ignore_range``      forward the GET without its Range: moto answers 200, the whole object
====================  ================================================================

The range faults (``short_206``, ``long_206``, ``shifted_range``, ``wrong_content_range``)
only match requests that carry a single ``bytes=A-B`` range. Model: mountpoint-s3's
FailureClient, moved to the wire so that every client shardfs uses meets the same faults.
"""

from __future__ import annotations

import contextlib
import http.client
import itertools
import json
import random
import re
import socket
import struct
import threading
import time
import urllib.parse
from dataclasses import dataclass, field, fields
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

from support.s3 import S3Server

FAULTS = (
    "status",
    "reset",
    "truncate",
    "short_206",
    "long_206",
    "shifted_range",
    "wrong_content_range",
    "etag",
    "stall",
    "blackhole",
    "ignore_range",
)
RANGE_FAULTS = frozenset({"short_206", "long_206", "shifted_range", "wrong_content_range"})
KINDS = frozenset({"fast", "scan", "fallback", "plain", "other"})
CONTROL = "/_faults"  # "_faults" cannot be a bucket name, so no S3 request is taken for it
_CHUNK = 64 * 1024
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "expect",
    }
)
_ERROR_CODES = {
    400: "BadRequest",
    403: "AccessDenied",
    404: "NoSuchKey",
    429: "TooManyRequests",
    500: "InternalError",
    503: "SlowDown",
}
_RANGE = re.compile(r"bytes=(\d+)-(\d+)")
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+)")


@dataclass
class Rule:
    """One fault and the requests it hits (see the module docstring)."""

    fault: str
    key: str = ""
    on: str = "any"  # comma-separated request kinds, or "any"
    skip: int = 0
    times: int | None = 1
    probability: float = 1.0
    seed: int = 0
    status: int = 503
    seconds: float = 1.0
    where: str = "headers"
    fraction: float = 0.5
    shift: int = 4096
    per_range: bool = False  # at most one injection per (key, range): retries get through
    id: int = 0
    matched: int = 0
    injected: int = 0
    _rng: random.Random = field(default_factory=random.Random, repr=False)
    _released: threading.Event = field(default_factory=threading.Event, repr=False)
    _hit_ranges: set[tuple[str, tuple[int, int] | None]] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if self.fault not in FAULTS:
            raise ValueError(f"unknown fault {self.fault!r}; known: {', '.join(FAULTS)}")
        kinds = self.kinds()
        if kinds is not None and not kinds <= KINDS:
            raise ValueError(f"unknown request kind in {self.on!r}; known: {sorted(KINDS)}")
        if self.where not in ("headers", "body"):
            raise ValueError(f"stall where must be headers or body, not {self.where!r}")
        self._rng = random.Random(self.seed)

    def kinds(self) -> frozenset[str] | None:
        if self.on == "any":
            return None
        return frozenset(part.strip() for part in self.on.split(",") if part.strip())

    def public(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}


@dataclass(frozen=True)
class Request:
    """What the proxy knows about a request before it decides to misbehave."""

    method: str
    path: str  # path and query as sent
    key: str  # "bucket/key", percent-decoded; "" for bucket and service requests
    kind: str
    range: tuple[int, int] | None  # the inclusive byte range asked for, if one


def classify(method: str, target: str, headers: Any, phase: str) -> Request:
    """Split a request line into key and request kind (path-style addressing)."""
    parts = urllib.parse.urlsplit(target)
    bucket, _, key = urllib.parse.unquote(parts.path).lstrip("/").partition("/")
    full_key = f"{bucket}/{key}" if key else ""
    match = _RANGE.fullmatch(str(headers.get("Range", "")).strip())
    asked = (int(match.group(1)), int(match.group(2))) if match else None
    if method != "GET" or not full_key:
        kind = "other"
    else:
        params = {name for name, _ in urllib.parse.parse_qsl(parts.query, True)}
        if not headers.get("Range"):
            kind = "plain"
        elif phase == "scan":
            kind = "scan"
        elif params & {"X-Amz-Signature", "Signature"}:
            kind = "fast"
        else:
            kind = "fallback"
    return Request(method, target, full_key, kind, asked)


class FaultState:
    """Rules, the phase, counters and the request log, shared by the handler threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.rules: list[Rule] = []
        self.phase = "read"
        self.stopping = threading.Event()
        self._ids = itertools.count(1)
        self.reset()

    def reset(self) -> None:
        with self.lock:
            self.log: list[dict[str, Any]] = []
            self.forwarded = 0
            self.injected: dict[str, int] = {}
            self.requests_by_kind: dict[str, int] = {}
            # Body bytes sent to the client for GETs of each "bucket/key" (faults included).
            self.bytes_by_key: dict[str, int] = {}
            self.requests_by_key: dict[str, int] = {}

    def add(self, rule: Rule) -> int:
        with self.lock:
            rule.id = next(self._ids)
            self.rules.append(rule)
            return rule.id

    def remove(self, rule_id: int | None = None) -> int:
        """Remove one rule (or all); black-holed requests of a removed rule are let go."""
        with self.lock:
            gone = [r for r in self.rules if rule_id is None or r.id == rule_id]
            self.rules = [r for r in self.rules if r not in gone]
        for rule in gone:
            rule._released.set()
        return len(gone)

    def pick(self, request: Request) -> Rule | None:
        """The first live rule that hits this request, consumed by one injection."""
        with self.lock:
            self.requests_by_kind[request.kind] = self.requests_by_kind.get(request.kind, 0) + 1
            if request.key and request.method == "GET":
                by_key = self.requests_by_key
                by_key[request.key] = by_key.get(request.key, 0) + 1
            chosen = None
            for rule in self.rules:
                if not self._hits(rule, request):
                    continue
                rule.matched += 1
                if rule.matched <= rule.skip:
                    continue
                if rule.times is not None and rule.injected >= rule.times:
                    continue
                if rule.probability < 1.0 and rule._rng.random() >= rule.probability:
                    continue
                if rule.per_range:
                    if (request.key, request.range) in rule._hit_ranges:
                        continue
                    rule._hit_ranges.add((request.key, request.range))
                rule.injected += 1
                chosen = rule
                break
            if chosen is None:
                self.forwarded += 1
            else:
                self.injected[chosen.fault] = self.injected.get(chosen.fault, 0) + 1
            self.log.append(
                {
                    "n": len(self.log) + 1,
                    "method": request.method,
                    "key": request.key,
                    "kind": request.kind,
                    "range": list(request.range) if request.range else None,
                    "fault": chosen.fault if chosen else None,
                    "rule": chosen.id if chosen else None,
                    "time": time.time(),
                }
            )
            return chosen

    @staticmethod
    def _hits(rule: Rule, request: Request) -> bool:
        if request.kind == "other" or rule.key not in request.key:
            return False
        kinds = rule.kinds()
        if kinds is not None and request.kind not in kinds:
            return False
        return not (rule.fault in RANGE_FAULTS and request.range is None)

    def add_bytes(self, key: str, n: int) -> None:
        if key and n:
            with self.lock:
                self.bytes_by_key[key] = self.bytes_by_key.get(key, 0) + n

    def counts(self) -> dict[str, Any]:
        with self.lock:
            return {
                "forwarded": self.forwarded,
                "injected": dict(self.injected),
                "injected_total": sum(self.injected.values()),
                "requests_by_kind": dict(self.requests_by_kind),
                "requests_by_key": dict(self.requests_by_key),
                "bytes_by_key": dict(self.bytes_by_key),
                "phase": self.phase,
            }


class _Upstream:
    """A response from moto: status, headers (hop-by-hop ones dropped) and the open body."""

    def __init__(self, conn: http.client.HTTPConnection, response: http.client.HTTPResponse):
        self.conn = conn
        self.response = response
        self.status = response.status
        self.reason = response.reason
        self.headers = [(k, v) for k, v in response.getheaders() if k.lower() not in _HOP_BY_HOP]

    def header(self, name: str) -> str | None:
        for key, value in self.headers:
            if key.lower() == name.lower():
                return value
        return None

    def set_header(self, name: str, value: str | None) -> None:
        self.headers = [(k, v) for k, v in self.headers if k.lower() != name.lower()]
        if value is not None:
            self.headers.append((name, value))

    def read_all(self) -> bytes:
        try:
            return self.response.read()
        finally:
            self.conn.close()

    def chunks(self) -> Any:
        try:
            while chunk := self.response.read(_CHUNK):
                yield chunk
        finally:
            self.conn.close()


class _Abort(Exception):
    """The connection was broken on purpose; nothing more is to be sent on it."""


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as aiohttp and urllib3 expect
    server: _ProxyServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._handle()

    do_HEAD = do_PUT = do_POST = do_DELETE = do_GET

    def finish(self) -> None:
        with contextlib.suppress(OSError):
            super().finish()

    # -- the request ----------------------------------------------------------

    def _body(self) -> bytes | None:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            parts = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    break
                parts.append(self.rfile.read(size))
                self.rfile.readline()
            return b"".join(parts)
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else None

    def _handle(self) -> None:
        body = self._body()
        if self.path.split("?")[0].rstrip("/").startswith(CONTROL):
            self._control(body)
            return
        state = self.server.state
        request = classify(self.command, self.path, self.headers, state.phase)
        rule = state.pick(request)
        try:
            if rule is None:
                self._relay(self._forward(request, body), request)
            else:
                self._inject(rule, request, body)
        except _Abort:
            self.close_connection = True
        except (ConnectionError, TimeoutError, OSError):
            self.close_connection = True

    def _forward(
        self, request: Request, body: bytes | None, range_header: str | None = None
    ) -> _Upstream:
        host, port = self.server.upstream
        conn = http.client.HTTPConnection(host, port, timeout=120)
        conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
        for name, value in self.headers.items():
            lowered = name.lower()
            if lowered in _HOP_BY_HOP or lowered == "content-length":
                continue
            if lowered == "range" and range_header is not None:
                if not range_header:
                    continue  # "": the request goes without one
                value = range_header
            conn.putheader(name, value)
        if body is not None:
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        return _Upstream(conn, conn.getresponse())

    # -- answering ------------------------------------------------------------

    def _head(self, status: int, reason: str, headers: list[tuple[str, str]]) -> None:
        self.send_response_only(status, reason)
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()

    def _send(self, key: str, data: bytes) -> None:
        self.wfile.write(data)
        self.server.state.add_bytes(key, len(data))

    def _relay(self, upstream: _Upstream, request: Request, stall: float = 0.0) -> None:
        """Pass moto's answer on, streamed; ``stall`` sleeps once half the body is out."""
        length = upstream.header("Content-Length")
        if length is None and self.command != "HEAD":
            data = upstream.read_all()
            upstream.set_header("Content-Length", str(len(data)))
            self._head(upstream.status, upstream.reason, upstream.headers)
            self._send(request.key, data)
            return
        self._head(upstream.status, upstream.reason, upstream.headers)
        if self.command == "HEAD":
            upstream.read_all()
            return
        sent, half = 0, int(length or 0) // 2
        for chunk in upstream.chunks():
            if stall and sent <= half < sent + len(chunk):
                self._send(request.key, chunk[: half - sent])
                self._sleep(stall)
                self._send(request.key, chunk[half - sent :])
                stall = 0.0
            else:
                self._send(request.key, chunk)
            sent += len(chunk)

    def _sleep(self, seconds: float) -> None:
        self.server.state.stopping.wait(seconds)

    def _reset(self) -> None:
        """Abort the connection with a TCP RST (SO_LINGER 0), as a dying peer would."""
        self.wfile.flush()
        time.sleep(0.05)  # let what was sent reach the client before the reset
        with contextlib.suppress(OSError):
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
        raise _Abort

    def _close(self) -> None:
        """End the connection cleanly (FIN) whatever the headers promised."""
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_WR)
        raise _Abort

    def _inject(self, rule: Rule, request: Request, body: bytes | None) -> None:
        fault = rule.fault
        if fault == "status":
            self._error(rule.status)
        elif fault == "blackhole":
            while not rule._released.wait(0.2):
                if self.server.state.stopping.is_set():
                    break
            self._reset()
        elif fault == "stall":
            if rule.where == "headers":
                self._sleep(rule.seconds)
                self._relay(self._forward(request, body), request)
            else:
                self._relay(self._forward(request, body), request, stall=rule.seconds)
        elif fault == "etag":
            upstream = self._forward(request, body)
            if upstream.header("ETag") is not None:
                upstream.set_header("ETag", '"00000000000000000000000000000bad"')
            self._relay(upstream, request)
        elif fault == "ignore_range":
            self._relay(self._forward(request, body, range_header=""), request)
        elif fault in ("reset", "truncate"):
            self._break(rule, request, body)
        else:
            self._wrong_range(rule, request, body)

    def _error(self, status: int) -> None:
        code = _ERROR_CODES.get(status, "InternalError")
        payload = (
            f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
            f"<Message>injected by the fault proxy</Message></Error>"
        ).encode()
        headers = [("Content-Type", "application/xml"), ("Content-Length", str(len(payload)))]
        if status in (429, 503):
            headers.append(("Retry-After", "0"))
        self._head(status, http.client.responses.get(status, "Error"), headers)
        if self.command != "HEAD":
            self.wfile.write(payload)

    def _break(self, rule: Rule, request: Request, body: bytes | None) -> None:
        upstream = self._forward(request, body)
        data = upstream.read_all()
        upstream.set_header("Content-Length", str(len(data)))
        self._head(upstream.status, upstream.reason, upstream.headers)
        self._send(request.key, data[: int(len(data) * rule.fraction)])
        if rule.fault == "reset":
            self._reset()
        self._close()

    def _wrong_range(self, rule: Rule, request: Request, body: bytes | None) -> None:
        assert request.range is not None
        start, end = request.range
        shift = max(1, rule.shift)
        if rule.fault == "wrong_content_range":
            upstream = self._forward(request, body)
            data = upstream.read_all()
            found = _CONTENT_RANGE.fullmatch(upstream.header("Content-Range") or "")
            total = found.group(3) if found else "*"
            upstream.set_header("Content-Range", f"bytes {start + shift}-{end + shift}/{total}")
            self._answer(upstream, request, data)
            return
        # Fetch a window wide enough for every variant, then serve the chosen slice of it.
        wide = f"bytes={max(0, start - shift)}-{end + shift}"
        upstream = self._forward(request, body, range_header=wide)
        data = upstream.read_all()
        found = _CONTENT_RANGE.fullmatch(upstream.header("Content-Range") or "")
        if upstream.status != 206 or found is None:
            self._answer(upstream, request, data)  # an error answer: pass it on as it is
            return
        first, last, total = (int(g) for g in found.groups())
        if rule.fault == "short_206":
            lo, hi = start, start + max(0, int((end - start + 1) * rule.fraction)) - 1
        elif rule.fault == "long_206":
            lo, hi = (start, end + shift) if last >= end + shift else (first, end)
        elif last >= end + shift:  # shifted_range: forwards if it fits, else backwards
            lo, hi = start + shift, end + shift
        else:
            lo, hi = first, first + (end - start)
        hi = min(hi, last)
        upstream.set_header("Content-Range", f"bytes {lo}-{hi}/{total}")
        self._answer(upstream, request, data[lo - first : hi - first + 1])

    def _answer(self, upstream: _Upstream, request: Request, data: bytes) -> None:
        upstream.set_header("Content-Length", str(len(data)))
        self._head(upstream.status, upstream.reason, upstream.headers)
        if self.command != "HEAD":
            self._send(request.key, data)

    # -- the control API --------------------------------------------------------

    def _control(self, body: bytes | None) -> None:
        state = self.server.state
        path = self.path.split("?")[0].rstrip("/")
        tail = path[len(CONTROL) :].strip("/")
        try:
            payload: Any = json.loads(body) if body else {}
            result: Any
            if self.command == "POST" and tail == "":
                rules = payload if isinstance(payload, list) else [payload]
                result = {"ids": [state.add(Rule(**spec)) for spec in rules]}
            elif self.command == "DELETE" and tail == "":
                result = {"removed": state.remove()}
            elif self.command == "DELETE" and tail.isdigit():
                result = {"removed": state.remove(int(tail))}
            elif self.command == "GET" and tail == "":
                with state.lock:
                    result = {"rules": [r.public() for r in state.rules], "phase": state.phase}
            elif self.command == "GET" and tail == "log":
                with state.lock:
                    result = {"log": list(state.log)}
            elif self.command == "GET" and tail == "counts":
                result = state.counts()
            elif self.command == "POST" and tail == "reset":
                state.reset()
                result = {"reset": True}
            elif self.command == "POST" and tail == "phase":
                phase = str(payload.get("phase", ""))
                if phase not in ("scan", "read"):
                    raise ValueError(f"phase must be scan or read, not {phase!r}")
                state.phase = phase
                result = {"phase": phase}
            else:
                self._json(404, {"error": f"no control endpoint {self.command} {path}"})
                return
        except (ValueError, TypeError) as exc:
            self._json(400, {"error": str(exc)})
            return
        self._json(200, result)

    def _json(self, status: int, payload: Any) -> None:
        data = json.dumps(payload).encode()
        headers = [("Content-Type", "application/json"), ("Content-Length", str(len(data)))]
        self._head(status, http.client.responses.get(status, ""), headers)
        self.wfile.write(data)


class _ProxyServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], upstream: tuple[str, int]) -> None:
        super().__init__(address, _Handler)
        self.upstream = upstream
        self.state = FaultState()


class FaultProxy:
    """The proxy on a free port, for the life of a ``with`` block, in front of ``server``.

    Rules can be installed in-process (``add``) or over HTTP (``POST /_faults``, JSON with
    the fields of ``Rule``); ``DELETE /_faults`` removes them all, ``GET /_faults/log`` and
    ``GET /_faults/counts`` report, ``POST /_faults/phase`` sets the phase.
    """

    def __init__(self, server: S3Server, host: str = "127.0.0.1") -> None:
        self.s3 = server
        self.host = host
        self._server: _ProxyServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def state(self) -> FaultState:
        assert self._server is not None, "the proxy is not running"
        return self._server.state

    @property
    def port(self) -> int:
        assert self._server is not None, "the proxy is not running"
        return int(self._server.server_address[1])

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def env(self) -> dict[str, str]:
        """``S3Server.env()`` with the endpoint pointing at the proxy."""
        return {**self.s3.env(), "AWS_ENDPOINT_URL": self.endpoint}

    def start(self) -> FaultProxy:
        self._server = _ProxyServer((self.host, 0), (self.s3.host, self.s3.port))
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="fault-proxy", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.state.stopping.set()
        server.state.remove()
        server.shutdown()
        server.server_close()
        if self._thread is not None:
            self._thread.join(10)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- in-process control ---------------------------------------------------------

    def add(self, fault: str, **fields: Any) -> int:
        """Install a rule (the fields of ``Rule``); return its id."""
        return self.state.add(Rule(fault=fault, **fields))

    def remove(self, rule_id: int | None = None) -> int:
        return self.state.remove(rule_id)

    def clear(self) -> None:
        """Remove every rule and zero the counters and the log; the phase goes to read."""
        self.state.remove()
        self.state.reset()
        self.state.phase = "read"

    def set_phase(self, phase: str) -> None:
        if phase not in ("scan", "read"):
            raise ValueError(f"phase must be scan or read, not {phase!r}")
        self.state.phase = phase

    def counts(self) -> dict[str, Any]:
        return self.state.counts()

    def log(self) -> list[dict[str, Any]]:
        with self.state.lock:
            return list(self.state.log)

    def rule(self, rule_id: int) -> Rule | None:
        with self.state.lock:
            return next((r for r in self.state.rules if r.id == rule_id), None)


# -- changing the store between requests (straight to moto, not through the proxy) ---------


def replace_object(server: S3Server, key: str, data: bytes) -> str:
    """Write new content under ``bucket/key``; return the new ETag."""
    fs = server.filesystem()
    fs.pipe_file(key, data)
    return str(fs.info(key)["ETag"]).strip('"')


def delete_object(server: S3Server, key: str) -> None:
    server.filesystem().rm_file(key)


def other_version(data: bytes, payload_spans: list[tuple[int, int]], grow: int = 0) -> bytes:
    """The same tar with every byte of each member's data inverted (the headers kept, so
    it still indexes alike), plus ``grow`` zero bytes at the end: same name, new content."""
    out = bytearray(data)
    for start, end in payload_spans:
        out[start:end] = bytes(b ^ 0xFF for b in out[start:end])
    return bytes(out) + b"\0" * grow

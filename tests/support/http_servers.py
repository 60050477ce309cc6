"""Local HTTP servers for the source tests, each in a thread of the test process.

``FileServer`` serves a folder the way static file servers and CDNs do: single byte ranges
(206 with Content-Range), ETag and Last-Modified (each can be switched off), ``If-Match`` and
``If-Unmodified-Since`` (412 when the file is another version), and, if asked, an HTML folder
listing like ``python -m http.server``'s. ``redirect_to`` makes it a server that lists no
folders and answers every file request with 302 to another server, as the Hugging Face hub
sends its downloads to a CDN. Writes (``PUT``) are refused, with 501 as ``python -m
http.server`` does, or with ``put_status``.

``RangelessServer`` is ``python -m http.server`` itself (the standard library's
``SimpleHTTPRequestHandler``), which ignores ``Range`` and answers every GET with the whole
file. Both count the body bytes they send per path (``Sent``), to check the counters of
shardfs against the server's own.
"""

from __future__ import annotations

import email.utils
import hashlib
import html
import json
import os
import threading
import urllib.parse
from collections import Counter
from http.server import BaseHTTPRequestHandler, SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar


class Sent:
    """Body bytes and GETs a server sent, per URL path; safe to update from many threads.
    Bytes are counted just before they are written, so a client never sees more than this
    counts."""

    def __init__(self) -> None:
        self._bytes: Counter[str] = Counter()
        self._gets: Counter[str] = Counter()
        self._lock = threading.Lock()

    def add(self, path: str, n: int, *, get: bool = True) -> None:
        """``n`` body bytes sent on ``path``; ``get``: as the answer to one more GET."""
        with self._lock:
            self._bytes[path] += n
            self._gets[path] += int(get)

    def clear(self) -> None:
        with self._lock:
            self._bytes.clear()
            self._gets.clear()

    def bytes_to(self, suffix: str = "") -> int:
        """Body bytes of the answers to paths ending in ``suffix``."""
        with self._lock:
            return sum(n for path, n in self._bytes.items() if path.endswith(suffix))

    def gets_to(self, suffix: str = "") -> int:
        """GETs answered with a body on paths ending in ``suffix``."""
        with self._lock:
            return sum(n for path, n in self._gets.items() if path.endswith(suffix))


_Served = TypeVar("_Served", bound="_ServedInThread")


class _ServedInThread:
    """An HTTP server on 127.0.0.1 (a free port), served by a thread for the life of a
    ``with`` block; subclasses build ``_server`` with their handler."""

    _server: ThreadingHTTPServer

    def _serve(self, handler: Any) -> None:
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def __enter__(self: _Served) -> _Served:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)


class FileServer(_ServedInThread):
    """Serve ``root`` on 127.0.0.1 (a free port) for the life of a ``with`` block.

    ``counts`` counts requests by method (``GET``, ``HEAD``, ``GET-range``, ``redirect``,
    ``412``), ``sent`` the body bytes of file answers; ``reset_counts()`` clears both.
    """

    def __init__(
        self,
        root: Path,
        *,
        listing: bool = True,
        etag: bool = True,
        last_modified: bool = True,
        redirect_to: str | None = None,
        put_status: int = 501,
    ) -> None:
        self.root = root.resolve()
        self.put_status = put_status
        self.listing = listing
        self.etag = etag
        self.last_modified = last_modified
        self.redirect_to = redirect_to.rstrip("/") if redirect_to else None
        self.counts: Counter[str] = Counter()
        self.sent = Sent()
        self._lock = threading.Lock()
        self._serve(_handler_for(self))

    def count(self, what: str) -> None:
        with self._lock:
            self.counts[what] += 1

    def reset_counts(self) -> None:
        with self._lock:
            self.counts.clear()
        self.sent.clear()


def _etag(status: os.stat_result) -> str:
    return f'"{status.st_size:x}-{status.st_mtime_ns:x}-{status.st_ino:x}"'


def _http_date(seconds: float) -> str:
    return email.utils.formatdate(int(seconds), usegmt=True)


def _parse_range(header: str, size: int) -> tuple[int, int] | None:
    """``bytes=A-B`` / ``bytes=A-`` / ``bytes=-N`` as [first, last], or None if unusable."""
    spec = header.strip().removeprefix("bytes=")
    if "," in spec or "-" not in spec:
        return None
    first_text, last_text = spec.split("-", 1)
    if not first_text:
        first, last = max(0, size - int(last_text)), size - 1
    else:
        first = int(first_text)
        last = min(int(last_text), size - 1) if last_text else size - 1
    return first, last


def _handler_for(server: FileServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass  # quiet: tests read the counters

        def do_HEAD(self) -> None:
            self._serve(body=False)

        def do_GET(self) -> None:
            self._serve(body=True)

        def do_PUT(self) -> None:
            server.count(self.command)
            # Read the body first: a socket closed with bytes unread resets the connection,
            # and the client would see that instead of the answer.
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if server.put_status == 501:  # what a server that only serves files answers
                self.send_error(501, f"Unsupported method ({self.command!r})")
            else:
                self.send_error(server.put_status)

        def _local(self) -> Path | None:
            path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
            local = (server.root / path.lstrip("/")).resolve()
            if local != server.root and server.root not in local.parents:
                return None
            return local

        def _plain(
            self, status: int, text: str = "", headers: dict[str, str] | None = None
        ) -> None:
            body = text.encode()
            self.send_response(status)
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _serve(self, *, body: bool) -> None:
            server.count(self.command)
            local = self._local()
            if local is None or not local.exists():
                self._plain(404, "not found")
                return
            if local.is_dir():
                self._folder(local)
                return
            if server.redirect_to is not None:
                server.count("redirect")
                self._plain(302, "", {"Location": server.redirect_to + self.path})
                return
            self._file(local, body=body)

        def _folder(self, local: Path) -> None:
            if not server.listing or server.redirect_to is not None:
                self._plain(404, "no listing here")
                return
            path = urllib.parse.urlsplit(self.path).path
            if not path.endswith("/"):
                self._plain(301, "", {"Location": path + "/"})
                return
            rows = []
            for entry in sorted(local.iterdir()):
                name = entry.name + ("/" if entry.is_dir() else "")
                href = urllib.parse.quote(name)
                rows.append(f'<li><a href="{href}">{html.escape(name)}</a></li>')
            page = "<html><body><ul>\n" + "\n".join(rows) + "\n</ul></body></html>\n"
            data = page.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        def _file(self, local: Path, *, body: bool) -> None:
            with local.open("rb") as handle:
                status = os.fstat(handle.fileno())
                size = status.st_size
                validators = {}
                if server.etag:
                    validators["ETag"] = _etag(status)
                if server.last_modified:
                    validators["Last-Modified"] = _http_date(status.st_mtime)
                if self._precondition_failed(status):
                    server.count("412")
                    self._plain(412, "precondition failed", validators)
                    return
                asked = self.headers.get("Range")
                ranged = _parse_range(asked, size) if asked else None
                if ranged is not None and ranged[0] >= size:
                    self._plain(416, "", {"Content-Range": f"bytes */{size}"})
                    return
                first, last = ranged if ranged is not None else (0, size - 1)
                handle.seek(first)
                data = handle.read(last - first + 1) if body else b""
            if ranged is not None:
                server.count(f"{self.command}-range")
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {first}-{last}/{size}")
            else:
                self.send_response(200)
            self.send_header("Content-Type", "application/x-tar")
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(last - first + 1))
            for name, value in validators.items():
                self.send_header(name, value)
            self.end_headers()
            if body:
                server.sent.add(urllib.parse.urlsplit(self.path).path, len(data))
                self.wfile.write(data)

        def _precondition_failed(self, status: os.stat_result) -> bool:
            if_match = self.headers.get("If-Match")
            if if_match and server.etag and if_match.strip() not in ("*", _etag(status)):
                return True
            since = self.headers.get("If-Unmodified-Since")
            if since and server.last_modified:
                parsed = email.utils.parsedate_to_datetime(since)
                if int(status.st_mtime) > int(parsed.timestamp()):
                    return True
            return False

    return Handler


class RangelessServer(_ServedInThread):
    """``python -m http.server`` on a folder, in a thread: it ignores ``Range`` (every GET
    of a file is a 200 with the whole file), as a newcomer's first server does. ``sent``
    counts the body bytes of its answers per path, as they were written to the socket."""

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        self.sent = Sent()
        sent = self.sent

        class Handler(SimpleHTTPRequestHandler):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, directory=str(root), **kwargs)

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def copyfile(self, source: Any, outputfile: Any) -> None:
                path = urllib.parse.urlsplit(self.path).path
                sent.add(path, 0)
                super().copyfile(source, _CountingWriter(outputfile, sent, path))

        self._serve(Handler)


class _CountingWriter:
    """A socket file that counts the bytes written through it, in ``sent`` under ``path``."""

    def __init__(self, inner: Any, sent: Sent, path: str) -> None:
        self._inner = inner
        self._sent = sent
        self._path = path

    def write(self, data: bytes) -> int:
        self._sent.add(self._path, len(data), get=False)
        self._inner.write(data)
        return len(data)


class FakeHub:
    """The few Hugging Face hub API calls ``HfFileSystem`` makes to list and read a dataset
    repository, answered from a local folder (point ``HF_ENDPOINT`` at ``url``).

    ``/api/datasets/REPO[/revision/REV]`` (repo info), ``/api/datasets/REPO/tree/REV/PATH``
    (listing, ``recursive`` honoured), ``/api/datasets/REPO/paths-info/REV`` (POST) and
    ``/datasets/REPO/resolve/REV/PATH`` (the file, served by a ``FileServer`` of the folder
    through a 302 redirect, as the hub does). ``requests`` records every path asked for.
    """

    SHA = "0123456789abcdef0123456789abcdef01234567"

    def __init__(self, root: Path, repo: str = "org/shards") -> None:
        self.root = root.resolve()
        self.repo = repo
        self.requests: list[str] = []
        self.files = FileServer(self.root, listing=False)
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _hub_handler_for(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def entry(self, path: Path) -> dict[str, Any]:
        rel = path.relative_to(self.root).as_posix()
        if path.is_dir():
            return {"type": "directory", "oid": "d" * 40, "path": rel}
        data = path.read_bytes()
        sha256 = hashlib.sha256(data).hexdigest()
        return {
            "type": "file",
            "oid": hashlib.sha1(data).hexdigest(),
            "size": len(data),
            "path": rel,
            "lfs": {"oid": sha256, "size": len(data), "pointerSize": 134},
        }

    def __enter__(self) -> FakeHub:
        self.files.__enter__()
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)
        self.files.__exit__(exc_type, exc, tb)


def _hub_handler_for(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    api = f"/api/datasets/{hub.repo}"

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _json(self, status: int, value: Any) -> None:
            body = json.dumps(value).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("X-Repo-Commit", FakeHub.SHA)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _local(self, rel: str) -> Path | None:
            local = (hub.root / rel).resolve()
            if local != hub.root and hub.root not in local.parents:
                return None
            return local if local.exists() else None

        def do_HEAD(self) -> None:
            self.do_GET()

        def do_POST(self) -> None:
            hub.requests.append(f"POST {self.path}")
            split = urllib.parse.urlsplit(self.path)
            if not split.path.startswith(f"{api}/paths-info/"):
                self._json(404, {"error": "not found"})
                return
            length = int(self.headers.get("Content-Length", 0))
            form = urllib.parse.parse_qs(self.rfile.read(length).decode())
            body = form.get("paths", [])
            if not body and self.headers.get("Content-Type", "").startswith("application/json"):
                body = []
            found = [self._local(p) for p in body]
            self._json(200, [hub.entry(p) for p in found if p is not None])

        def do_GET(self) -> None:
            hub.requests.append(f"{self.command} {self.path}")
            split = urllib.parse.urlsplit(self.path)
            path = urllib.parse.unquote(split.path)
            query = urllib.parse.parse_qs(split.query)
            if path in (api, f"{api}/revision/main", f"{api}/revision/{FakeHub.SHA}"):
                self._json(200, {"id": hub.repo, "sha": FakeHub.SHA, "private": False})
                return
            for revision in ("main", FakeHub.SHA):
                tree = f"{api}/tree/{revision}"
                if path == tree or path.startswith(tree + "/"):
                    self._tree(path[len(tree) :].lstrip("/"), query)
                    return
                resolve = f"/datasets/{hub.repo}/resolve/{revision}/"
                if path.startswith(resolve):
                    rel = path[len(resolve) :]
                    if self._local(rel) is None:
                        self._json(404, {"error": "Entry not found"})
                        return
                    self.send_response(302)
                    self.send_header("Location", hub.files.url + "/" + urllib.parse.quote(rel))
                    self.send_header("Content-Length", "0")
                    self.send_header("X-Repo-Commit", FakeHub.SHA)
                    self.end_headers()
                    return
            self._json(404, {"error": "not found"})

        def _tree(self, rel: str, query: dict[str, list[str]]) -> None:
            local = self._local(rel)
            if local is None or not local.is_dir():
                self._json(404, {"error": "Entry not found"})
                return
            recursive = query.get("recursive", ["false"])[0].lower() == "true"
            paths = local.rglob("*") if recursive else local.iterdir()
            self._json(200, [hub.entry(p) for p in sorted(paths)])

    return Handler

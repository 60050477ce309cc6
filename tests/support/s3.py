"""A moto S3 server in a subprocess, with request and byte counters."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import s3fs

SERVER_SCRIPT = Path(__file__).with_name("moto_counting.py")
ACCESS_KEY = "testing"
SECRET_KEY = "testing"
REGION = "us-east-1"

# Talk to the local server directly even if the environment sets a proxy.
_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


class S3ServerError(RuntimeError):
    """The server did not start, or answered the control endpoint badly."""


class StillBusyError(RuntimeError):
    """What ``until_quiet`` watched kept changing until its deadline."""


T = TypeVar("T")


def until_quiet(
    sample: Callable[[], T],
    key: Callable[[T], object] = lambda value: value,
    *,
    quiet: float = 0.5,
    timeout: float = 60.0,
    what: str = "the server",
) -> T:
    """The last ``sample()`` once ``key`` of it stayed the same for ``quiet`` seconds.

    Background fetches (readahead, prefetch) go on after a read returns, so a byte count
    taken at once would miss some; the one place tests and the bench wait for them to
    stop. Polled every 50 ms against a deadline; ``StillBusyError`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    last = sample()
    since = time.monotonic()
    while time.monotonic() - since < quiet:
        if time.monotonic() > deadline:
            raise StillBusyError(f"{what} was still busy after {timeout:g} s")
        time.sleep(0.05)
        now = sample()
        if key(now) != key(last):
            since = time.monotonic()
        last = now
    return last


def settled_counts(server: S3Server, quiet: float = 0.5, timeout: float = 60.0) -> dict[str, Any]:
    """The server's counts once its GetObject bytes stayed the same for ``quiet`` seconds
    (background fetches done); ``StillBusyError`` after ``timeout`` seconds of traffic."""
    return until_quiet(
        server.counts,
        lambda counts: counts["get_object_bytes"],
        quiet=quiet,
        timeout=timeout,
        what="the S3 server",
    )


def repeats(ranges: list[list[Any]]) -> list[str]:
    """One line per GetObject body that repeated bytes (``S3Server.ranges_sent()``), with
    the earlier bodies of the same object it overlaps: which fetch paid twice."""
    lines = []
    for number, (key, start, end, again) in enumerate(ranges):
        if again:
            before = [f"#{n} [{s}, {e})" for n, (k, s, e, _) in enumerate(ranges[:number])
                      if k == key and s < end and start < e]  # fmt: skip
            lines.append(f"#{number} {key} [{start}, {end}): {again} again, of {', '.join(before)}")
    return lines


class S3Server:
    """Run ``moto_counting.py`` on a free port for the life of a ``with`` block.

    ``counts()`` reports requests and body bytes per HTTP method, plus
    ``get_object_requests``, ``get_object_bytes`` and ``list_requests``, and
    ``get_object_requests_by_key`` / ``get_object_bytes_by_key`` ({"bucket/key": n}).

    ``latency_ms`` and ``bandwidth_mb`` start it shaped (first-byte latency, a cap per
    response in 10^6 bytes/s; moto_counting.py); None leaves the environment's setting.
    ``shape()`` changes them while it runs.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        *,
        start_timeout: float = 30.0,
        attempts: int = 3,
        latency_ms: float | None = None,
        bandwidth_mb: float | None = None,
    ) -> None:
        self.host = host
        self.shaping_args: list[str] = []
        if latency_ms is not None:
            self.shaping_args += ["--latency-ms", str(latency_ms)]
        if bandwidth_mb is not None:
            self.shaping_args += ["--bandwidth-mb", str(bandwidth_mb)]
        self.start_timeout = start_timeout
        self.attempts = attempts
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._logdir = tempfile.TemporaryDirectory(prefix="moto-")
        self._log_path = Path(self._logdir.name) / "server.log"

    @property
    def pid(self) -> int | None:
        """The server process (for pinning it to a core), None when not running."""
        return self._proc.pid if self._proc is not None else None

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def env(self) -> dict[str, str]:
        """Variables that point boto-based clients in a subprocess at this server."""
        no_proxy = ",".join(
            p for p in (os.environ.get("NO_PROXY", ""), self.host, "localhost") if p
        )
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_EC2_METADATA_DISABLED": "true",
            "NO_PROXY": no_proxy,
            "no_proxy": no_proxy,
        }

    # -- lifecycle ---------------------------------------------------------

    def start(self) -> S3Server:
        last_error = ""
        for _ in range(self.attempts):
            # The port can be taken between free_port() and the bind; retry then.
            self.port = free_port(self.host)
            command = [sys.executable, str(SERVER_SCRIPT), "--host", self.host, *self.shaping_args]
            with self._log_path.open("ab") as log:
                self._proc = subprocess.Popen(
                    [*command, "--port", str(self.port)],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            try:
                self._wait_ready()
                return self
            except S3ServerError as exc:
                last_error = str(exc)
                self.stop()
        raise S3ServerError(
            f"moto server did not start after {self.attempts} attempts: {last_error}"
        )

    def _wait_ready(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.start_timeout
        delay = 0.02
        while True:
            if self._proc.poll() is not None:
                raise S3ServerError(
                    f"server exited with code {self._proc.returncode}:\n{self.log_tail()}"
                )
            try:
                self.counts()
                return
            except (OSError, S3ServerError):
                pass
            if time.monotonic() > deadline:
                raise S3ServerError(
                    f"server not ready within {self.start_timeout}s:\n{self.log_tail()}"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.25)

    def stop(self, timeout: float = 10.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)

    def log_tail(self, limit: int = 4000) -> str:
        try:
            return self._log_path.read_text(errors="replace")[-limit:]
        except OSError:
            return ""

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
        self._logdir.cleanup()

    # -- counters ----------------------------------------------------------

    def _control(self, method: str, path: str) -> Any:
        data = b"" if method == "POST" else None
        request = urllib.request.Request(self.endpoint + path, data=data, method=method)
        try:
            with _opener.open(request, timeout=10) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            raise S3ServerError(f"{method} {path}: HTTP {exc.code}") from exc

    def counts(self) -> dict[str, Any]:
        result: dict[str, Any] = self._control("GET", "/_counts")
        return result

    def ranges_sent(self) -> list[list[Any]]:
        """Every GetObject body since the last reset, in order: [key, start, end, bytes of
        it sent before] (moto_counting.py)."""
        result: list[list[Any]] = self._control("GET", "/_counts/ranges")
        return result

    def reset_counts(self) -> None:
        self._control("POST", "/_counts/reset")

    def delay_gets(self, key_part: str = "", seconds: float = 0.0) -> None:
        """Make every GetObject on a key containing ``key_part`` wait ``seconds`` (a slow
        store); with no arguments, remove every delay."""
        query = urllib.parse.urlencode({"key": key_part, "seconds": seconds})
        self._control("POST", f"/_delay?{query}")

    def shape(self, latency_ms: float = 0.0, bandwidth_mb: float = 0.0) -> dict[str, float]:
        """From now on, hold each S3 response ``latency_ms`` after its request arrived and
        send its body at no more than ``bandwidth_mb`` x 10^6 bytes/s (0: none; no
        arguments: unshaped). Returns the server's setting."""
        query = urllib.parse.urlencode({"latency_ms": latency_ms, "bandwidth_mb": bandwidth_mb})
        result: dict[str, float] = self._control("POST", f"/_shape?{query}")
        return result

    # -- S3 helpers --------------------------------------------------------

    def filesystem(self, **kwargs: Any) -> s3fs.S3FileSystem:
        """A fresh (uncached) s3fs filesystem pointed at this server."""
        options: dict[str, Any] = {
            "key": ACCESS_KEY,
            "secret": SECRET_KEY,
            "client_kwargs": {"endpoint_url": self.endpoint, "region_name": REGION},
            "skip_instance_cache": True,
        }
        options.update(kwargs)
        return s3fs.S3FileSystem(**options)

    def create_bucket(self, name: str, *, exist_ok: bool = True) -> None:
        fs = self.filesystem()
        if exist_ok and fs.exists(name):
            return
        # Not fs.mkdir(): with region_name set, s3fs sends LocationConstraint
        # "us-east-1", which S3 (and moto) reject.
        fs.call_s3("create_bucket", Bucket=name)
        fs.invalidate_cache()

    def upload_dir(self, local_dir: str | os.PathLike[str], dest: str) -> list[str]:
        """Upload every file under ``local_dir`` to ``dest`` ("bucket/prefix"); return the keys."""
        root = Path(local_dir)
        fs = self.filesystem()
        dest = dest.rstrip("/")
        uploaded = []
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            target = f"{dest}/{path.relative_to(root).as_posix()}"
            fs.put_file(str(path), target)
            uploaded.append(target)
        return uploaded

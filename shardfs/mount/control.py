"""The control channel of a running mount: a unix socket that answers with live stats.

``shardfs stats MOUNTPOINT`` connects to the socket of that mountpoint, sends one command
line and reads one JSON document. The socket, the daemon's pid file, its lock file (and a
marker when the mount created its mountpoint) live in a private runtime folder
(``$XDG_RUNTIME_DIR`` or the temp folder), named after the mountpoint. The daemon holds
the lock from before its scan until it exits, so a second mount of the same mountpoint
fails at once instead of stacking a second mount on it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import socket
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import MountError
from .table import mount_containing, not_a_shardfs_mount, table_path

log = logging.getLogger(__name__)


def runtime_dir() -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    path = Path(base) / f"shardfs-{os.getuid()}"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def _runtime_name(mountpoint: Path) -> str:
    # Spelled as the mount table spells it, without a stat of the mountpoint: that would
    # enter a dead mount, or fill the kernel's attribute cache of a live one.
    return hashlib.sha256(table_path(mountpoint).encode()).hexdigest()[:16]


def pid_file(mountpoint: Path) -> Path:
    return runtime_dir() / f"{_runtime_name(mountpoint)}.pid"


def socket_path(mountpoint: Path) -> Path:
    return runtime_dir() / f"{_runtime_name(mountpoint)}.sock"


def lock_path(mountpoint: Path) -> Path:
    return runtime_dir() / f"{_runtime_name(mountpoint)}.lock"


def lock_held(mountpoint: Path) -> bool:
    """Whether a process holds the mountpoint's lock (a mount starts or runs there)."""
    try:
        fd = os.open(lock_path(mountpoint), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # and with it the probe's own lock
    return False


def created_marker(mountpoint: Path) -> Path:
    """Present while the mountpoint is a folder that a mount created (it is removed at
    unmount): kept past a killed daemon, so the next ``umount`` or mount still knows."""
    return runtime_dir() / f"{_runtime_name(mountpoint)}.created"


def remove_created_mountpoint(mountpoint: Path, *, by_its_daemon: bool = False) -> bool:
    """Remove the mountpoint if a mount created it and it is an empty folder, mounted no
    more; True if it is gone. Any other folder is left as it is, and so is one where a
    mount starts or runs, unless the caller is that mount's daemon (``by_its_daemon``)."""
    marker = created_marker(mountpoint)
    if not marker.exists() or (not by_its_daemon and lock_held(mountpoint)):
        return False
    try:
        os.rmdir(mountpoint)
    except FileNotFoundError:
        pass
    except OSError as exc:  # still mounted, or someone put files in it: not ours to remove
        log.info("left the mountpoint %s in place (%s)", mountpoint, exc.strerror)
        return False
    with contextlib.suppress(FileNotFoundError):
        marker.unlink()
    return True


def lock_mountpoint(mountpoint: Path) -> int:
    """Take the mountpoint's lock for this process's life; return its descriptor. It holds
    this process's pid. MountError when another process holds it. The lock file is never
    removed: another process may be waiting on that very file."""
    path = lock_path(mountpoint)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        os.close(fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise MountError(f"{mountpoint}: cannot lock {path} ({exc.strerror})") from exc
        who = f" (pid {holder})" if holder.isdigit() else ""
        raise MountError(
            f"{mountpoint}: another shardfs mount is starting or running here{who}"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


class ControlServer:
    """Answers ``stats`` on a unix socket from a thread of its own, joined by ``close``."""

    def __init__(self, mountpoint: Path, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.path = socket_path(mountpoint)
        self.snapshot = snapshot
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(str(self.path))
        os.chmod(self.path, 0o600)
        self._sock.listen(8)
        self._thread = threading.Thread(target=self._serve, name="control", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with conn:
                try:
                    conn.settimeout(5)
                    command = conn.recv(64).decode("ascii", "replace").strip()
                    if command == "stats":
                        reply: dict[str, Any] = self.snapshot()
                    else:
                        reply = {"error": f"unknown command {command!r}"}
                    conn.sendall(json.dumps(reply).encode() + b"\n")
                except Exception:
                    log.exception("control request failed")

    def close(self) -> None:
        """Stop answering and wait for the thread. A bare close would leave the thread in
        ``accept`` (closing a socket does not wake a thread waiting on it); shutting the
        listening socket down does."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._sock.close()
        self._thread.join()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def serving_mountpoint(path: Path) -> Path:
    """The mountpoint whose daemon answers for ``path``: ``path`` itself where its socket
    is (a mount still scanning is in no mount table yet), else the shardfs mount ``path``
    lies in, found in the mount table. MountError saying what ``path`` is when neither."""
    if socket_path(path).exists():
        return path
    entry = mount_containing(path)
    if entry is not None and entry.is_shardfs:
        return Path(entry.mountpoint)
    if entry is not None and table_path(path) == entry.mountpoint:
        raise MountError(not_a_shardfs_mount(path, entry))
    where = f" (it lies in the {entry.fstype} mount at {entry.mountpoint})" if entry else ""
    raise MountError(f"{path}: not inside a shardfs mount{where}")


def query(mountpoint: Path, command: str = "stats", timeout: float = 10.0) -> dict[str, Any]:
    """Ask the daemon serving ``mountpoint``; MountError if none answers."""
    path = socket_path(mountpoint)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(str(path))
            sock.sendall(command.encode() + b"\n")
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
    except OSError as exc:
        raise MountError(f"{mountpoint}: no shardfs mount answers there ({exc.strerror})") from exc
    try:
        reply: dict[str, Any] = json.loads(b"".join(chunks))
    except ValueError as exc:
        raise MountError(f"{mountpoint}: garbled reply from the daemon") from exc
    return reply

"""The atomic writer: a block is written whole to ``tmp/`` and then renamed into place.

A daemon killed at any moment thus leaves either a whole block or none; temp files of dead
processes are removed at start by listing ``tmp/`` alone (their names begin with the pid).
Blocks are written with ``O_DIRECT`` where the filesystem takes it: no copy into the page
cache (a block is read back rarely, and its files go to the kernel anyway). Such a file
ends with up to a page of zeros after its data.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import shutil
import uuid
from pathlib import Path

from ..atomic import process_running
from .landing import LandingBuffers

log = logging.getLogger(__name__)


def remove_any(path: Path) -> None:
    """Remove whatever sits at ``path``: a file, a link or a whole folder."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _write_all(fd: int, *pieces: bytes | memoryview) -> None:
    """Write every piece, in order, with as few system calls as the kernel allows."""
    views = [memoryview(piece) for piece in pieces if piece]
    while views:
        written = os.writev(fd, views)
        while views and written >= len(views[0]):
            written -= len(views[0])
            views.pop(0)
        if views and written:
            views[0] = views[0][written:]


class AtomicWriter:
    """Writes files under a temp folder and renames them into place; owns the aligned
    buffers of its ``O_DIRECT`` writes."""

    def __init__(self, tmp_dir: Path, chunk_size: int) -> None:
        self.tmp_dir = tmp_dir
        self._tmp_prefix = f"{tmp_dir}{os.sep}"
        self._names = itertools.count()
        self._token = uuid.uuid4().hex[:8]
        self._direct = hasattr(os, "O_DIRECT")
        self.landing = LandingBuffers(chunk_size)  # the aligned memory of O_DIRECT writes

    def remove_stale(self) -> None:
        """Delete temp files whose writer process is gone; only ``tmp/`` is listed."""
        for entry in os.scandir(self.tmp_dir):
            pid_text = entry.name.split("-", 1)[0]
            if not (pid_text.isdigit() and process_running(int(pid_text))):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)

    def temp_path(self) -> str:
        """A name in ``tmp/`` that no other writer, in this process or another, uses."""
        # The pid and a counter keep names apart within a process; the token, drawn once per
        # writer, keeps them apart from a dead process that had the same pid. A plain str:
        # a block's paths are built per block, and pathlib's cost shows at 1 MiB blocks.
        return f"{self._tmp_prefix}{os.getpid()}-{next(self._names)}-{self._token}.tmp"

    def write(self, path: str, header: bytes, data: bytes | memoryview) -> None:
        """Create ``path`` holding ``header + data``; it must not exist yet."""
        if self._direct:
            try:
                self._write_direct(path, header, data)
                return
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._direct = False  # the filesystem refuses O_DIRECT: write through it
                log.info("cache folder does not take O_DIRECT; writing blocks buffered")
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _write_all(fd, header, data)
        finally:
            os.close(fd)

    @staticmethod
    def publish(tmp: str, final: str) -> None:
        """Rename a written temp file into place, replacing what was there; the folder is
        made only when missing (the rename says so), not checked for every block."""
        try:
            os.replace(tmp, final)
        except FileNotFoundError:
            if not os.path.exists(tmp):
                raise
            os.makedirs(os.path.dirname(final), exist_ok=True)
            os.replace(tmp, final)

    @staticmethod
    def discard(tmp: str) -> None:
        """Remove a temp file that will not be published (if it was created at all)."""
        with contextlib.suppress(OSError):
            os.unlink(tmp)

    def _write_direct(self, path: str, header: bytes, data: bytes | memoryview) -> None:
        """Write header + data bypassing the page cache: one aligned write, padded with
        zeros to a whole page, which the file keeps (the header says where the data ends).
        Cutting the file to its exact length would cost a synchronous read of its last
        filesystem block, which ``O_DIRECT`` left out of the page cache, to zero its tail.
        Data received into a landing buffer is written from where it lies; any other is
        copied into one first."""
        size = len(header) + len(data)
        whole = self.landing.in_place(header, data)
        if whole is None:
            view = self.landing.take(len(data))
            view[:] = data
            whole = self.landing.in_place(header, view)
            assert whole is not None  # a view take() just gave
        try:
            whole[size:] = bytes(len(whole) - size)  # not what earlier blocks left there
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o644)
            try:
                if os.write(fd, whole) != len(whole):
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            finally:
                os.close(fd)
        finally:
            whole.release()

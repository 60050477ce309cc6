"""Files that appear whole or not at all: written under a temp name beside their final path,
then renamed over it (a rename within one folder is atomic), the temp file removed on any
failure. The index, the view and shards that ``pack`` writes to a local folder are built
this way; the block cache has its own writer (``cache/writer.py``: O_DIRECT, a tmp folder
cleaned by pid)."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def replacing(final: Path, *, prefix: str, suffix: str = "", mode: int = 0o600) -> Iterator[Path]:
    """A fresh, empty temp file ``PREFIX + PID-NS + SUFFIX`` beside ``final`` (created with
    ``mode``, less the umask); renamed to ``final`` when the block ends without an exception,
    removed when it raises. The pid in the name lets a later run tell a killed writer's
    leftovers (``store.remove_temp_files``)."""
    temp = _create_beside(final, prefix, suffix, mode)
    try:
        yield temp
        os.replace(temp, final)
    finally:
        with contextlib.suppress(FileNotFoundError):
            temp.unlink()


def _create_beside(final: Path, prefix: str, suffix: str, mode: int) -> Path:
    while True:
        temp = final.parent / f"{prefix}{os.getpid()}-{time.monotonic_ns()}{suffix}"
        try:
            os.close(os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode))
        except FileExistsError:
            continue  # two threads in the same nanosecond: take the next one
        return temp


def process_running(pid: int) -> bool:
    """True while ``pid`` runs. An exited or killed process may stay a zombie until its
    (new) parent reaps it, which a container's init may never do; a zombie is gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat_file:
            state = stat_file.read().rpartition(")")[2].split()
    except OSError:
        return True  # no /proc: trust kill(0)
    return not state or state[0] not in ("Z", "X")

"""Files that appear whole or not at all: written under a temp name beside their final path,
then renamed over it (a rename within one folder is atomic), the temp file removed on any
failure. The index and the view are built this way; the block cache has its own writer
(``cache/writer.py``: O_DIRECT, a tmp folder cleaned by pid)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def replacing(final: Path, *, prefix: str, suffix: str = "") -> Iterator[Path]:
    """A fresh temp path beside ``final``; renamed to ``final`` when the block ends without
    an exception, removed when it raises."""
    fd, name = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=final.parent)
    os.close(fd)
    temp = Path(name)
    try:
        yield temp
        os.replace(temp, final)
    finally:
        with contextlib.suppress(FileNotFoundError):
            temp.unlink()

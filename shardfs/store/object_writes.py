"""Writing next to the shards: what ``shardfs pack`` uploads, each object whole or not at all.

``Store`` takes these methods from ``ObjectWrites``; they need only its filesystem, its
paths and its error translation.
"""

from __future__ import annotations

import contextlib
import posixpath
import re
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, TypeVar

import fsspec

from ..atomic import replacing
from .client import translate_errors

T = TypeVar("T")
LOCAL_PROTOCOLS = ("file", "local")
# The temp names of atomic_writer on a local folder: ``.NAME.tmp-PID-NS``.
_TEMP_NAME = re.compile(r"\..+\.tmp-\d+-\d+")


class ObjectWrites:
    """Uploads and small objects, for a store with ``fs``, ``protocol``, ``_path`` (a name's
    store path) and ``_call`` (a call with its errors translated)."""

    fs: fsspec.AbstractFileSystem
    protocol: str
    _path: Callable[[str], str]
    _call: Callable[[str, Callable[[], Any]], Any]

    def _upload(self, local_path: str, name: str) -> None:
        """Upload a local file in one PUT (or one completed multipart upload), which object
        stores make visible whole: ``name`` appears complete or not at all."""
        path = self._path(name)
        self._call(name, lambda: self.fs.put_file(local_path, path))
        self.fs.invalidate_cache(path)

    @contextlib.contextmanager
    def atomic_writer(self, name: str) -> Iterator[IO[bytes]]:
        """A file to write ``name`` into; it appears complete when the block exits cleanly,
        and not at all otherwise. A local destination is written in place under a hidden
        temp name (``atomic.replacing``, no second copy); other stores get a local temp file
        and one upload."""
        if self.protocol not in LOCAL_PROTOCOLS:
            with tempfile.NamedTemporaryFile(prefix=".shardfs-pack-", suffix=".tar") as tmp:
                yield tmp
                tmp.flush()
                self._upload(tmp.name, name)
            return
        path = Path(self._path(name))
        with contextlib.ExitStack() as stack:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                temp = stack.enter_context(replacing(path, prefix=f".{path.name}.tmp-", mode=0o666))
                handle = stack.enter_context(open(temp, "wb"))
            except OSError as exc:
                raise translate_errors(name, exc) from exc
            yield handle  # closed, then renamed over ``path``, as the stack unwinds
        self.fs.invalidate_cache(str(path))

    def remove_temp_files(self, names: list[str]) -> list[str]:
        """Delete the temp names a killed ``atomic_writer`` left among ``names``."""
        left = [n for n in names if _TEMP_NAME.fullmatch(posixpath.basename(n))]
        for name in left:
            path = self._path(name)
            try:
                self.fs.rm_file(path)
            except FileNotFoundError:
                pass
            except Exception as exc:
                raise translate_errors(name, exc) from exc
            self.fs.invalidate_cache(path)
        return left

    def write_object(self, name: str, data: bytes) -> None:
        """Write a small object next to the shards in one PUT."""
        path = self._path(name)
        if self.protocol in LOCAL_PROTOCOLS:
            self._call(name, lambda: self.fs.makedirs(posixpath.dirname(path), exist_ok=True))
        self._call(name, lambda: self.fs.pipe_file(path, data))
        self.fs.invalidate_cache(path)

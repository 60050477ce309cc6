"""Block files kept open with their verified headers, and the reads that pin them.

A read pins its block's path for as long as it uses the file: a pinned path is never evicted
by this process, and a file retired while its path is pinned (evicted by another mount,
replaced, pushed out of the table) stays open until the path's last read ends. The pin count
per path is the one count of readers; the open files carry none of their own.
"""

from __future__ import annotations

import os
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass

from .block_format import BlockKey, CorruptBlockError, Header, read_header

_OPEN_BLOCKS = 64  # block files kept open with their verified headers


@dataclass(slots=True)
class OpenBlock:
    """A block file kept open with its verified header."""

    fd: int
    header: Header


class OpenBlocks:
    """The table of open block files and the pins of the reads using them, under one lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: OrderedDict[str, OpenBlock] = OrderedDict()
        # Reads in progress per block path. Every fd here is closed when its path's count
        # drops to zero (or at once when retired unpinned).
        self.pins: Counter[str] = Counter()
        self._retired: dict[str, list[int]] = {}

    def pinned(self, path: str) -> _Pin:
        """Hold ``path`` for one read: not evicted, its files not closed, until the exit."""
        return _Pin(self, path)

    def _pin(self, path: str) -> None:
        with self._lock:
            self.pins[path] += 1

    def _unpin(self, path: str) -> None:
        with self._lock:
            self.pins[path] -= 1
            if self.pins[path] <= 0:
                del self.pins[path]
                for fd in self._retired.pop(path, ()):
                    os.close(fd)

    def pinned_paths(self) -> set[str]:
        """The paths that reads hold now (eviction looks past them)."""
        with self._lock:
            return {path for path, count in self.pins.items() if count > 0}

    def acquire(self, path: str, key: BlockKey, block_len: int) -> OpenBlock | None:
        """The open block file at ``path`` (opened and header-verified once), or None when
        there is none. The caller holds ``pinned(path)`` while it uses the file."""
        with self._lock:
            block = self._open.get(path)
            if block is not None and os.fstat(block.fd).st_nlink == 0:
                # Removed by `cache clear` or another mount's eviction: holding it open
                # would keep its disk space and serve a block the cache no longer has.
                del self._open[path]
                self._retire_locked(path, block)
                block = None
            if block is not None:
                if block.header.data_len != block_len:  # as read_header checks a fresh one
                    raise CorruptBlockError("wrong length")
                self._open.move_to_end(path)
                return block
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            header = read_header(fd, key, block_len)
        except BaseException:
            os.close(fd)
            raise
        block = OpenBlock(fd, header)
        with self._lock:
            if path in self._open:  # another thread opened it meanwhile: use one
                os.close(fd)
                return self._open[path]
            self._open[path] = block
            self._bound_locked()
        return block

    def adopt(self, path: str, block: OpenBlock) -> None:
        """Hold ``block`` (a file this process just wrote at ``path``, and its header) as
        the open file of ``path``, in place of any earlier one: its first read then needs
        no read back of the header, which ``O_DIRECT`` left out of the page cache."""
        with self._lock:
            old = self._open.pop(path, None)
            if old is not None:
                self._retire_locked(path, old)
            self._open[path] = block
            self._bound_locked()

    def close_path(self, path: str) -> None:
        """Stop using the open file of ``path`` (evicted, discarded or replaced)."""
        with self._lock:
            block = self._open.pop(path, None)
            if block is not None:
                self._retire_locked(path, block)

    def close_all(self) -> None:
        """Retire every open file; the ones that reads still use close when those end."""
        with self._lock:
            for path, block in self._open.items():
                self._retire_locked(path, block)
            self._open.clear()

    def _bound_locked(self) -> None:
        """Retire the least recently used open files past ``_OPEN_BLOCKS``."""
        while len(self._open) > _OPEN_BLOCKS:
            oldest_path, oldest = self._open.popitem(last=False)
            self._retire_locked(oldest_path, oldest)

    def _retire_locked(self, path: str, block: OpenBlock) -> None:
        if self.pins.get(path, 0) > 0:
            self._retired.setdefault(path, []).append(block.fd)
        else:
            os.close(block.fd)


class _Pin:
    """``OpenBlocks.pinned``: a small object rather than a generator (a read or a push
    pins its block a few times per block)."""

    __slots__ = ("_blocks", "_path")

    def __init__(self, blocks: OpenBlocks, path: str) -> None:
        self._blocks = blocks
        self._path = path

    def __enter__(self) -> None:
        self._blocks._pin(self._path)

    def __exit__(self, *_: object) -> None:
        self._blocks._unpin(self._path)

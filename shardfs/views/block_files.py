"""The files of one cache block as the kernel pusher and the compiled path take them.

Every block that becomes local is looked up once for its files, and three consumers use
the answer: the early publish from memory, the batched kernel pushes and the publish from
the block file. Each of them hands C three arrays (inode, position in the block's data,
size). Built from one ``Node`` per file, that cost the daemon a namedtuple and a tuple per
file and three passes over them per consumer, about a tenth of its interpreter calls in a
cold epoch. ``ShardWindows`` keeps the files of a stretch of a shard as arrays in offset
order (one query per stretch), so a block's files are two bisections and a few slices.
"""

from __future__ import annotations

import threading
from array import array
from bisect import bisect_left, bisect_right
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from itertools import compress

WINDOW_BYTES = 256 << 20  # shard offsets whose files one query loads
WINDOW_FILES = 1 << 20  # files kept in loaded windows, the oldest window dropped first
_WINDOW_COST = 16  # files a window counts for besides its own (its objects' memory)
_BEFORE = 4  # files before a block looked at for one crossing its start (members follow
# one another, so a file crossing the start is among the last few to begin before it)


class FileTable:
    """Files of one block: ``inos``, ``positions`` (in the block's data) and ``sizes``, three
    arrays of the same length, in the layout C reads (uint64, int64, int64)."""

    __slots__ = ("inos", "positions", "sizes")

    def __init__(self, inos: array[int], positions: array[int], sizes: array[int]) -> None:
        if not len(inos) == len(positions) == len(sizes):
            raise ValueError("a file table's arrays differ in length")
        self.inos = inos
        self.positions = positions
        self.sizes = sizes

    @classmethod
    def of(cls, files: Iterable[tuple[int, int, int]]) -> FileTable:
        """A table of (inode, position, size) triples."""
        rows = list(files)
        return cls(
            array("Q", [ino for ino, _, _ in rows]),
            array("q", [at for _, at, _ in rows]),
            array("q", [size for _, _, size in rows]),
        )

    def __len__(self) -> int:
        return len(self.inos)

    def __iter__(self) -> Iterator[tuple[int, int, int]]:
        return zip(self.inos, self.positions, self.sizes, strict=True)

    def __repr__(self) -> str:
        return f"FileTable({list(self)!r})"


Row = tuple[int, int, int]  # (offset, size, ino) of one file
# (shard, from, to) -> the rows of the files beginning in [from, to), in offset order
FilesFrom = Callable[[int, int, int], list[Row]]
# (shard, offset, count) -> the rows of the last ``count`` files beginning before offset
FilesBefore = Callable[[int, int, int], list[Row]]


class _Window:
    __slots__ = ("ends", "inos", "offsets", "sizes")

    def __init__(self, rows: list[Row]) -> None:
        self.offsets = array("q", [offset for offset, _, _ in rows])
        self.sizes = array("q", [size for _, size, _ in rows])
        self.inos = array("Q", [ino for _, _, ino in rows])
        ends = [offset + size for offset, size, _ in rows]
        # Members lie one after another, so their ends rise with their offsets, and the
        # files of a block crossing its end are the last ones; else (no such window in a
        # view built from archives) each is looked at.
        self.ends = array("q", ends) if ends == sorted(ends) else None


class ShardWindows:
    """Non-empty regular files of each shard, loaded a window of ``WINDOW_BYTES`` of shard
    offsets at a time through ``files_from`` and kept up to ``max_files``; ``files_before``
    finds the files before a window's first block."""

    def __init__(
        self, files_from: FilesFrom, files_before: FilesBefore,
        window: int = WINDOW_BYTES, max_files: int = WINDOW_FILES,
    ) -> None:  # fmt: skip
        self._files_from = files_from
        self._files_before = files_before
        self.window = window
        self.max_files = max_files
        self._windows: OrderedDict[tuple[int, int], _Window] = OrderedDict()
        self._held = 0
        self._lock = threading.Lock()

    def _get(self, shard: int, number: int) -> _Window:
        key = (shard, number)
        with self._lock:
            found = self._windows.get(key)
            if found is not None:
                self._windows.move_to_end(key)
                return found
        start = number * self.window
        found = _Window(self._files_from(shard, start, start + self.window))
        with self._lock:
            if key not in self._windows:
                self._windows[key] = found
                self._held += len(found.inos) + _WINDOW_COST
                while self._held > self.max_files and len(self._windows) > 1:
                    _, old = self._windows.popitem(last=False)
                    self._held -= len(old.inos) + _WINDOW_COST
        return found

    def touching(self, shard: int, start: int, end: int) -> tuple[FileTable, list[int]]:
        """The files with bytes in ``[start, end)`` of ``shard``: (those lying wholly inside,
        positions counted from ``start``; the inodes of those crossing its edges)."""
        first, last = start // self.window, max(start, end - 1) // self.window
        windows = [self._get(shard, number) for number in range(first, last + 1)]
        head = windows[0]
        offsets, sizes, inos, ends = head.offsets, head.sizes, head.inos, head.ends
        for more in windows[1:]:  # a block wider than the rest of its window: rare
            offsets, sizes, inos = offsets + more.offsets, sizes + more.sizes, inos + more.inos
            ends = None
        lo, hi = bisect_left(offsets, start), bisect_left(offsets, end)
        across = [inos[k] for k in range(max(0, lo - _BEFORE), lo) if offsets[k] + sizes[k] > start]
        if lo < _BEFORE and first > 0:  # the last few files before it began in earlier windows
            earlier = self._files_before(shard, start, _BEFORE)
            across = [ino for offset, size, ino in earlier if offset + size > start]
        if ends is not None:  # the files crossing the end are the last ones
            inside = bisect_right(ends, end, lo, hi)
            across += inos[inside:hi]
            return self._table(offsets[lo:inside], sizes[lo:inside], inos[lo:inside], start), across
        inside_offsets, inside_sizes, inside_inos = offsets[lo:hi], sizes[lo:hi], inos[lo:hi]
        fits = [at + size <= end for at, size in zip(inside_offsets, inside_sizes, strict=True)]
        if not all(fits):
            across += [ino for ino, fit in zip(inside_inos, fits, strict=True) if not fit]
            inside_offsets = array("q", compress(inside_offsets, fits))
            inside_sizes = array("q", compress(inside_sizes, fits))
            inside_inos = array("Q", compress(inside_inos, fits))
        return self._table(inside_offsets, inside_sizes, inside_inos, start), across

    @staticmethod
    def _table(offsets: array[int], sizes: array[int], inos: array[int], start: int) -> FileTable:
        return FileTable(inos, array("q", [offset - start for offset in offsets]), sizes)

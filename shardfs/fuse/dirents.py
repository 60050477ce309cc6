"""Directory listings packed once into the kernel's READDIR / READDIRPLUS reply format.

A listing reply is a run of records, each a ``fuse_dirent`` (inode, next offset, name
length, type, name padded to 8 bytes), preceded for READDIRPLUS by a ``fuse_entry_out``
(the entry and its attributes). The layouts are the kernel's FUSE protocol
(``linux/fuse.h``); the bytes are the ones libfuse's ``fuse_add_direntry`` and
``fuse_add_direntry_plus`` write, which the tests check byte for byte.

A folder's records are packed in one pass, and every request of the listing is then a slice
of that buffer: a million-entry scan spends no Python per entry per request.
"""

from __future__ import annotations

import bisect
import itertools
import stat
import struct
from array import array
from collections.abc import Iterable

from ..core.filesystem import Entry

# fuse_dirent: ino, off, namelen, type; the name follows.
_DIRENT = struct.Struct("<QQII")
# fuse_entry_out (nodeid, generation, entry_valid, attr_valid, their nanoseconds, then
# fuse_attr: ino, size, blocks, atime, mtime, ctime, three nanoseconds, mode, nlink, uid,
# gid, rdev, blksize, flags), then fuse_dirent. The kernel reads the three times as signed
# seconds, so a member dated before 1970 is packed as a negative number.
_DIRENT_PLUS = struct.Struct("<QQQQII" + "QQQqqq" + "IIIIIIIIII" + "QQII")
assert _DIRENT.size == 24 and _DIRENT_PLUS.size == 152
_PADDING = [b"\0" * n for n in range(8)]


def _timeout(seconds: float) -> tuple[int, int]:
    """Seconds and nanoseconds the way libfuse splits an entry or attribute timeout."""
    if seconds <= 0:
        return 0, 0
    whole = int(seconds)
    return whole, min(int((seconds - whole) * 1e9), 999_999_999)


class PackedListing:
    """Every record of one folder; ``reply`` cuts the part a request asks for."""

    def __init__(self, data: bytes, ends: array[int], given: array[int]) -> None:
        self.data = data
        self.ends = ends  # ends[i]: the byte just past record i
        self.given = given  # per record: the inode it hands the kernel, or 0

    def __len__(self) -> int:
        return len(self.ends)

    def reply(self, offset: int, size: int) -> tuple[bytes, range]:
        """Records from number ``offset`` on that fit in ``size`` bytes, and their numbers."""
        ends = self.ends
        if offset >= len(ends):
            return b"", range(offset, offset)
        start = ends[offset - 1] if offset else 0
        stop = bisect.bisect_right(ends, start + size, lo=offset)
        if stop == offset:
            return b"", range(offset, offset)
        return self.data[start : ends[stop - 1]], range(offset, stop)

    def given_in(self, records: range) -> list[int]:
        """Inodes the records ``records`` handed to the kernel (READDIRPLUS full entries)."""
        return [ino for ino in self.given[records.start : records.stop] if ino]


def pack(
    entries: Iterable[Entry], *, plus: bool, uid: int, gid: int, blksize: int, timeout: float
) -> PackedListing:
    """Pack ``entries`` in order; record ``i`` tells the kernel to continue at ``i + 1``."""
    chunks: list[bytes] = []
    lengths: list[int] = []
    given = array("Q")
    valid, valid_ns = _timeout(timeout)
    pack_dirent, pack_plus = _DIRENT.pack, _DIRENT_PLUS.pack
    append, append_length, append_given = chunks.append, lengths.append, given.append
    for position, (name, ino, mode, nlink, size, blocks, mtime, full) in enumerate(entries, 1):
        kind = stat.S_IFMT(mode) >> 12
        length = len(name)
        pad = -length & 7
        if not plus:
            append(pack_dirent(ino, position, length, kind))
            append_given(0)
            record = 24 + length + pad
        elif full:
            header = pack_plus(
                ino, 0, valid, valid, valid_ns, valid_ns,
                ino, size, blocks, mtime, mtime, mtime, 0, 0, 0,
                mode, nlink, uid, gid, 0, blksize, 0,
                ino, position, length, kind,
            )  # fmt: skip
            append(header)
            append_given(ino)
            record = 152 + length + pad
        else:  # nodeid 0: the kernel takes the name and type and makes no entry
            header = pack_plus(
                0, 0, 0, 0, 0, 0,
                ino, 0, 0, 0, 0, 0, 0, 0, 0,
                mode, 0, 0, 0, 0, 0, 0,
                ino, position, length, kind,
            )  # fmt: skip
            append(header)
            append_given(0)
            record = 152 + length + pad
        append(name)
        append(_PADDING[pad])
        append_length(record)
    return PackedListing(b"".join(chunks), array("Q", itertools.accumulate(lengths)), given)

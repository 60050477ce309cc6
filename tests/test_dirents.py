"""Listings packed in the kernel's reply format: byte for byte what libfuse writes, and cut
into requests without losing, splitting or repeating a record."""

from __future__ import annotations

import ctypes
import random
import stat
import struct

import pytest

from shardfs.core.filesystem import Entry
from shardfs.fuse import binding as libfuse
from shardfs.fuse import dirents

UID, GID, BLKSIZE = 1234, 5678, 1 << 17

ENTRIES = [
    Entry(b".", 7, stat.S_IFDIR | 0o555, 2, 0, 0, 0, False),
    Entry(b"..", 1, stat.S_IFDIR | 0o555, 2, 0, 0, 0, False),
    Entry(b"a", 9, stat.S_IFREG | 0o444, 1, 10, 1, 1_700_000_000, False),
    Entry(b"class-0001", 8, stat.S_IFDIR | 0o555, 2, 0, 0, 1_600_000_000, True),
    Entry("caf\u00e9 \u65e5\u672c.jpg".encode(), 10, stat.S_IFREG | 0o555, 1, 99_999, 196, 5, True),
    Entry(b"x" * 255, 11, stat.S_IFLNK | 0o777, 1, 3, 1, 1_700_000_001, False),
    Entry(b"exactly8", 2**40, stat.S_IFREG | 0o444, 1, 2**33, 2**24, 2**31, True),
    Entry(b"sixteen-bytes-ab", 13, stat.S_IFREG | 0o444, 1, 4096, 8, 0, True),
    Entry(b"before-1970", 14, stat.S_IFREG | 0o444, 1, 1, 1, -86_400, True),  # signed times
    Entry(b"hostile-mtime", 15, stat.S_IFREG | 0o444, 1, 1, 1, -(2**63), True),
]


def _libfuse_records(entries: list[Entry], *, plus: bool, timeout: float) -> bytes:
    """The same listing written by libfuse's own fuse_add_direntry(_plus)."""
    lib = libfuse.lib()
    out = b""
    for position, entry in enumerate(entries, 1):
        param = libfuse.EntryParam()
        if entry.full:
            param.ino = entry.ino
            param.attr_timeout = param.entry_timeout = timeout
            attr = param.attr
            attr.st_nlink, attr.st_uid, attr.st_gid = entry.nlink, UID, GID
            attr.st_size, attr.st_blksize, attr.st_blocks = entry.size, BLKSIZE, entry.blocks
            attr.st_atim.tv_sec = attr.st_mtim.tv_sec = attr.st_ctim.tv_sec = entry.mtime
        param.attr.st_ino, param.attr.st_mode = entry.ino, entry.mode
        buffer = ctypes.create_string_buffer(4096)
        if plus:
            used = lib.fuse_add_direntry_plus(
                None, buffer, 4096, entry.name, ctypes.byref(param), position
            )
        else:
            used = lib.fuse_add_direntry(
                None, buffer, 4096, entry.name, ctypes.byref(param.attr), position
            )
        out += buffer.raw[:used]
    return out


@pytest.mark.parametrize("plus", [True, False])
@pytest.mark.parametrize("timeout", [86400.0, 1.25, 0.0])
def test_records_are_the_bytes_libfuse_writes(plus: bool, timeout: float) -> None:
    packed = dirents.pack(ENTRIES, plus=plus, uid=UID, gid=GID, blksize=BLKSIZE, timeout=timeout)
    expected = _libfuse_records(ENTRIES, plus=plus, timeout=timeout)
    assert len(packed.data) == len(expected) and packed.data == expected
    assert len(packed) == len(ENTRIES) and packed.ends[-1] == len(expected)
    assert list(packed.given) == [e.ino if plus and e.full else 0 for e in ENTRIES]


def _parse(data: bytes, *, plus: bool) -> list[tuple[int, int, bytes]]:
    """(inode, next offset, name) of every record in a reply."""
    records, at = [], 0
    while at < len(data):
        at += 128 if plus else 0
        ino, next_offset, length, _kind = struct.unpack_from("<QQII", data, at)
        records.append((ino, next_offset, data[at + 24 : at + 24 + length]))
        at += (24 + length + 7) & ~7
    assert at == len(data)
    return records


@pytest.mark.parametrize("plus", [True, False])
def test_requests_of_any_size_get_whole_records_each_exactly_once(plus: bool) -> None:
    rng = random.Random(5)
    entries = [
        Entry(f"n{i:05d}{'y' * rng.randrange(40)}".encode(), 100 + i, stat.S_IFREG | 0o444,
              1, rng.randrange(10_000), 1, 0, rng.random() < 0.5)
        for i in range(3000)
    ]  # fmt: skip
    packed = dirents.pack(entries, plus=plus, uid=0, gid=0, blksize=4096, timeout=1.0)
    for _ in range(20):
        offset, seen = 0, []
        while True:
            size = rng.choice([200, 4096, 65536, 131072, rng.randrange(1, 9000)])
            data, records = packed.reply(offset, size)
            assert len(data) <= size
            parsed = _parse(data, plus=plus)
            assert [p[1] for p in parsed] == [r + 1 for r in records]
            if not data:  # the end, or a request too small for the next record
                start = packed.ends[offset - 1] if offset else 0
                assert offset == len(entries) or size < packed.ends[offset] - start
                if offset == len(entries):
                    break
                continue
            seen += parsed
            offset = parsed[-1][1]  # the kernel continues at the last record's offset
        assert [(ino, name) for ino, _, name in seen] == [(e.ino, e.name) for e in entries]
    given = packed.given_in(range(10, 20))
    assert given == [e.ino for e in entries[10:20] if plus and e.full]


def test_past_the_end_and_empty_listings() -> None:
    packed = dirents.pack([], plus=True, uid=0, gid=0, blksize=4096, timeout=1.0)
    assert packed.reply(0, 4096) == (b"", range(0, 0))
    packed = dirents.pack(ENTRIES[:2], plus=True, uid=0, gid=0, blksize=4096, timeout=1.0)
    assert packed.reply(2, 4096) == (b"", range(2, 2))
    assert packed.reply(0, 10) == (b"", range(0, 0))  # no room for even one record

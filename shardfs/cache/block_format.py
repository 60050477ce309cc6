"""The on-disk block format: a header, then the data.

The header carries the shard key, the block index, the data length and an xxh3-64 checksum
of every chunk (plus one of the header itself). A read verifies only the chunks it returns,
so a warm small read stays cheap while no byte is ever served unchecked.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import struct
from collections.abc import Callable
from dataclasses import dataclass

import xxhash

_chunk_sums: Callable[[bytes | memoryview, int], bytes] | None
try:  # the same sums in C, without the interpreter lock (optional, like the FUSE hot path)
    from ._sums import chunk_sums as _chunk_sums
except ImportError:  # pragma: no cover - where no compiler built it
    _chunk_sums = None

MAGIC = b"SHFSBLK1"
_FIXED = struct.Struct("<8sIIQQ16sII")  # magic, header len, chunk, data len, index, key, n, 0


def shard_key(location: str, size: int, etag: str, block_size: int = 0) -> str:
    """A shard's cache identity: where it lives, which version it is, and how it is cut into
    blocks (block ``i`` under another block size is other bytes, possibly of equal length)."""
    text = f"{location}\0{size}\0{etag}"
    if block_size:
        text += f"\0{block_size}"
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class BlockKey:
    shard: str  # shard_key(), 32 hex digits
    index: int


class CorruptBlockError(Exception):
    """A block file failed a check; internal to the cache, never reaches a reader."""


class NotInMemory(Exception):
    """A read that must not wait on the disk found bytes the page cache does not hold."""


def header_len(block_len: int, chunk_size: int) -> int:
    """The length of a block's header: fixed fields, one checksum per chunk, its own."""
    count = (block_len + chunk_size - 1) // chunk_size
    return _FIXED.size + 8 * count + 8


def block_header(key: BlockKey, data: bytes | memoryview, chunk_size: int) -> bytes:
    """The header written before a block's data: sizes, key, and per-chunk checksums."""
    count = (len(data) + chunk_size - 1) // chunk_size
    head = _FIXED.pack(
        MAGIC,
        header_len(len(data), chunk_size),
        chunk_size,
        len(data),
        key.index,
        bytes.fromhex(key.shard),
        count,
        0,
    ) + chunk_sums(data, chunk_size)
    return head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head))


def chunk_sums(data: bytes | memoryview, chunk_size: int) -> bytes:
    """Each chunk's xxh3-64 as little-endian 64-bit words: in C where it is built (one call
    per block, the interpreter lock let go), else chunk by chunk through xxhash."""
    if _chunk_sums is not None:
        return _chunk_sums(data, chunk_size)
    view = memoryview(data)
    count = (len(data) + chunk_size - 1) // chunk_size
    return struct.pack(
        f"<{count}Q",
        *(
            xxhash.xxh3_64_intdigest(view[i * chunk_size : (i + 1) * chunk_size])
            for i in range(count)
        ),
    )


def encoded_size(block_len: int, chunk_size: int) -> int:
    """Bytes a block of ``block_len`` takes in the cache: its header, then its data."""
    return header_len(block_len, chunk_size) + block_len


def encode_block(key: BlockKey, data: bytes, chunk_size: int) -> bytes:
    """Header + data, as written to disk."""
    return block_header(key, data, chunk_size) + data


@dataclass(slots=True)
class Header:
    """A block file's verified header: what a read needs to check the chunks it returns."""

    header_len: int
    chunk: int
    data_len: int
    sums: bytes


def written_header(header: bytes) -> Header:
    """The ``Header`` of a block this process encoded itself (``block_header``'s bytes):
    verified by construction, so a file just written with it needs no read back."""
    _, header_len, chunk, data_len, _, _, count, _ = _FIXED.unpack_from(header)
    return Header(header_len, chunk, data_len, bytes(header[_FIXED.size : _FIXED.size + 8 * count]))


def read_header(fd: int, key: BlockKey, expected_len: int) -> Header:
    """Parse and verify the header of the block in ``fd``."""
    fixed = os.pread(fd, _FIXED.size, 0)
    if len(fixed) != _FIXED.size:
        raise CorruptBlockError("truncated header")
    magic, header_len, chunk, data_len, index, raw_key, count, _ = _FIXED.unpack(fixed)
    if magic != MAGIC or raw_key.hex() != key.shard or index != key.index:
        raise CorruptBlockError("wrong magic or key")
    if data_len != expected_len or chunk <= 0 or count != (data_len + chunk - 1) // chunk:
        raise CorruptBlockError("wrong length")
    if header_len != _FIXED.size + 8 * count + 8:
        raise CorruptBlockError("wrong header length")
    rest = os.pread(fd, header_len - _FIXED.size, _FIXED.size)
    if len(rest) != header_len - _FIXED.size:
        raise CorruptBlockError("truncated header")
    (header_sum,) = struct.unpack_from("<Q", rest, 8 * count)
    if xxhash.xxh3_64_intdigest(fixed + rest[: 8 * count]) != header_sum:
        raise CorruptBlockError("header checksum mismatch")
    return Header(header_len, chunk, data_len, rest[: 8 * count])


def read_data(fd: int, header: Header, start: int, end: int, *, nowait: bool = False) -> bytes:
    """Bytes ``[start, end)`` of the block's data, each chunk they touch verified.

    ``nowait``: raise NotInMemory instead of waiting for the disk (RWF_NOWAIT): blocks are
    written around the page cache, so the first read of one is a disk read."""
    chunk = header.chunk
    first, last = start // chunk, (end - 1) // chunk
    span_start = first * chunk
    span_end = min((last + 1) * chunk, header.data_len)
    length = span_end - span_start
    data: bytes | bytearray | None = None
    if nowait:
        data = _read_nowait(fd, length, header.header_len + span_start)
    if data is None:
        data = os.pread(fd, length, header.header_len + span_start)
    if len(data) != length:
        raise CorruptBlockError("truncated data")
    view = memoryview(data)
    _check_chunks(view, header, first)
    return bytes(view[start - span_start : end - span_start])


def read_all_into(fd: int, header: Header, buffer: bytearray | memoryview) -> memoryview:
    """The block's whole data read into ``buffer`` (reused: no fresh pages to fault in),
    every chunk verified; returns the view of ``buffer`` that holds it."""
    if len(buffer) < header.data_len:
        raise ValueError(f"a buffer of {len(buffer)} bytes for {header.data_len}")
    view = memoryview(buffer)[: header.data_len]
    if os.preadv(fd, [view], header.header_len) != header.data_len:
        raise CorruptBlockError("truncated data")
    _check_chunks(view, header, 0)
    return view


def _check_chunks(view: memoryview, header: Header, first: int) -> None:
    """Check whole chunks read from chunk ``first`` on against the header's sums (one
    ``chunk_sums`` call); CorruptBlockError naming the first chunk that differs."""
    got = chunk_sums(view, header.chunk)
    expected = header.sums[8 * first : 8 * first + len(got)]
    if got != expected:
        bad = next(i for i in range(0, len(got), 8) if got[i : i + 8] != expected[i : i + 8])
        raise CorruptBlockError(f"checksum mismatch in chunk {first + bad // 8}")


def _read_nowait(fd: int, length: int, offset: int) -> bytearray | None:
    """``length`` bytes at ``offset`` if the page cache holds them all; NotInMemory if not;
    None where the filesystem cannot tell (no RWF_NOWAIT): then read as usual."""
    buffer = bytearray(length)
    try:
        got = os.preadv(fd, [buffer], offset, os.RWF_NOWAIT)
    except BlockingIOError:
        raise NotInMemory from None
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
            return None
        raise
    if got != length:  # partly cached, or short: the waiting read sorts it out
        raise NotInMemory
    return buffer


def read_verified(fd: int, key: BlockKey, start: int, end: int, expected_len: int) -> bytes:
    """Bytes ``[start, end)`` of the block in ``fd``, header and chunks verified."""
    return read_data(fd, read_header(fd, key, expected_len), start, end)


PAGE = 4096
"""An ``O_DIRECT`` write's unit: a block file written so is padded with zeros to it."""


def block_file_size(path: str, shard: str, index: int) -> int | None:
    """The encoded size of a well-formed block file for ``(shard, index)``, or None: a whole
    header that names this key and checks, then as many data bytes as it announces, and at
    most the padding to a whole page after them (``O_DIRECT`` writes leave it). The data
    checksums are left to the reads, which verify every chunk they return."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        fixed = os.pread(fd, _FIXED.size, 0)
        if len(fixed) != _FIXED.size:
            return None
        data_len = _FIXED.unpack(fixed)[3]
        header = read_header(fd, BlockKey(shard, index), data_len)
    except (CorruptBlockError, struct.error, OSError, ValueError):
        return None
    finally:
        os.close(fd)
    encoded = header.header_len + header.data_len
    return encoded if encoded <= size <= -(-encoded // PAGE) * PAGE else None

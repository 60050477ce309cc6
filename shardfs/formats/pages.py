"""Decoding the small parts of a parquet file in memory: snappy blocks, the RLE/bit-packed
hybrid (definition levels, dictionary indices) and PLAIN values, for the label and
image-path columns, whose bytes are read whole. Image pages are never decoded here: they
are served as byte ranges. Every length is checked; malformed input raises ``PageError``."""

from __future__ import annotations

import zlib

from .thrift import CompactReader, ThriftError


class PageError(ValueError):
    """Malformed page data."""


def snappy_decompress(data: bytes, limit: int) -> bytes:
    """A raw snappy block (parquet's SNAPPY codec), refused if it expands past ``limit``."""
    reader = CompactReader(data)
    try:
        length = reader.varint()
    except ThriftError as exc:
        raise PageError(f"snappy length: {exc.reason}") from None
    if length > limit:
        raise PageError(f"snappy block declares {length} bytes, over the page's {limit}")
    out = bytearray()
    pos = reader.pos
    end = len(data)
    while pos < end:
        tag = data[pos]
        pos += 1
        kind = tag & 3
        if kind == 0:  # literal
            n = tag >> 2
            if n >= 60:
                extra = n - 59
                if pos + extra > end:
                    raise PageError("snappy literal length truncated")
                n = int.from_bytes(data[pos : pos + extra], "little")
                pos += extra
            n += 1
            if pos + n > end or len(out) + n > length:
                raise PageError("snappy literal runs past the block")
            out += data[pos : pos + n]
            pos += n
            continue
        if kind == 1:
            if pos + 1 > end:
                raise PageError("snappy copy truncated")
            n, offset = ((tag >> 2) & 7) + 4, ((tag >> 5) << 8) | data[pos]
            pos += 1
        else:
            width = 2 if kind == 2 else 4
            if pos + width > end:
                raise PageError("snappy copy truncated")
            n, offset = (tag >> 2) + 1, int.from_bytes(data[pos : pos + width], "little")
            pos += width
        if offset == 0 or offset > len(out) or len(out) + n > length:
            raise PageError("snappy copy out of range")
        start = len(out) - offset
        while n > 0:  # an overlapping copy repeats the last ``offset`` bytes
            chunk = out[start : start + min(n, offset)]
            out += chunk
            start += len(chunk)
            n -= len(chunk)
    if len(out) != length:
        raise PageError(f"snappy block holds {len(out)} bytes, not the {length} it declares")
    return bytes(out)


def decompress(codec: int, data: bytes, size: int) -> bytes:
    """A page's bytes in the clear: UNCOMPRESSED (0), SNAPPY (1) or GZIP (2)."""
    if codec == 0:
        return data
    if codec == 1:
        return snappy_decompress(data, size)
    if codec == 2:
        inflater = zlib.decompressobj(31)
        try:
            out = inflater.decompress(data, size)
        except zlib.error as exc:
            raise PageError(f"gzip: {exc}") from None
        return out
    raise PageError(f"codec {codec} is not read by shardfs")


def hybrid(data: bytes, pos: int, end: int, bit_width: int, count: int) -> list[int]:
    """``count`` values of the RLE/bit-packed hybrid encoding in ``data[pos:end]``."""
    if not 0 <= bit_width <= 32:
        raise PageError(f"bit width {bit_width}")
    reader = CompactReader(data[:end], pos)
    values: list[int] = []
    byte_width = (bit_width + 7) // 8
    mask = (1 << bit_width) - 1
    while len(values) < count:
        try:
            header = reader.varint()
        except ThriftError:
            raise PageError("levels or indices run past their section") from None
        if header & 1:  # bit-packed: groups of 8 values in bit_width bytes each
            groups = header >> 1
            size = groups * bit_width
            if reader.pos + size > end or groups == 0:
                raise PageError("a bit-packed run runs past its section")
            packed = int.from_bytes(data[reader.pos : reader.pos + size], "little")
            reader.pos += size
            take = min(groups * 8, count - len(values))
            values += [(packed >> (i * bit_width)) & mask for i in range(take)]
        else:
            run = header >> 1
            if reader.pos + byte_width > end or run == 0:
                raise PageError("an RLE run runs past its section")
            value = int.from_bytes(data[reader.pos : reader.pos + byte_width], "little")
            reader.pos += byte_width
            values += [value] * min(run, count - len(values))
    return values


def plain_values(physical: int, data: bytes, pos: int, count: int) -> list[int | bytes]:
    """``count`` PLAIN values of INT32 (1), INT64 (2) or BYTE_ARRAY (6) from ``pos``."""
    out: list[int | bytes] = []
    if physical in (1, 2):
        width = 4 if physical == 1 else 8
        if pos + width * count > len(data):
            raise PageError(f"{count} PLAIN values run past the page")
        for i in range(count):
            start = pos + i * width
            out.append(int.from_bytes(data[start : start + width], "little", signed=True))
        return out
    if physical == 6:
        for _ in range(count):
            if pos + 4 > len(data):
                raise PageError("a PLAIN byte array's length runs past the page")
            length = int.from_bytes(data[pos : pos + 4], "little")
            pos += 4
            if pos + length > len(data):
                raise PageError("a PLAIN byte array runs past the page")
            out.append(data[pos : pos + length])
            pos += length
        return out
    raise PageError(f"physical type {physical} is not read by shardfs")

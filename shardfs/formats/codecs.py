"""The codecs of decode units (``units.Unit``): each turns a unit's raw bytes into exactly
its declared decoded size, or raises ``DecodeError``. Bytes that decode to more than the
unit declares are refused as they come (a bomb never fills memory).

- whole-unit codecs (``WHOLE``): the unit's raw bytes in, its decoded bytes out: deflate
  (zip method 8), gzip and zlib streams, zstd, snappy (cramjam where installed: the
  ``formats`` extra; snappy falls back to the pure-Python decoder parquet's small columns
  use);
- seekable codecs (``SEEKABLE``): a unit too large to decode whole for one file (a gzip
  stream of a whole shard), opened over a file object of its raw bytes and read at decoded
  offsets from the nearest seek point that ``Unit.state`` records.
"""

from __future__ import annotations

import io
import zlib
from collections.abc import Callable
from typing import Any, Protocol

from .pages import PageError, snappy_decompress
from .units import DecodedSpace, Unit

_cram: Any
try:  # the ``formats`` extra: compiled snappy and zstd
    import cramjam as _cram
except ImportError:  # pragma: no cover - the extra is part of every test install
    _cram = None


class DecodeError(ValueError):
    """A unit's bytes do not decode to what its index row says."""


def _inflate(wbits: int) -> Callable[[bytes, int], bytes]:
    def decode(raw: bytes, size: int) -> bytes:
        inflater = zlib.decompressobj(wbits)
        try:
            out = inflater.decompress(raw, size + 1)
        except zlib.error as exc:
            raise DecodeError(f"not a valid stream: {exc}") from None
        if len(out) > size or inflater.unconsumed_tail:
            raise DecodeError(f"decodes to more than the {size} bytes declared")
        return out

    return decode


def _zstd_into(raw: bytes, size: int) -> bytearray:
    out = bytearray(size + 1)
    try:
        written = _cram.zstd.decompress_into(raw, out)
    except _cram.DecompressionError as exc:
        raise DecodeError(f"not a valid zstd frame: {exc}") from None
    if written > size:
        raise DecodeError(f"decodes to more than the {size} bytes declared")
    del out[written:]  # no copy: a shard-sized unit is not copied twice (about 3x faster)
    return out


def _snappy(raw: bytes, size: int) -> bytes | bytearray:
    if _cram is not None:
        out = bytearray(size + 1)
        try:
            written = _cram.snappy.decompress_raw_into(raw, out)
        except _cram.DecompressionError as exc:
            raise DecodeError(f"not a valid snappy block: {exc}") from None
        if written > size:
            raise DecodeError(f"decodes to more than the {size} bytes declared")
        del out[written:]
        return out
    try:
        return snappy_decompress(raw, size)
    except PageError as exc:
        raise DecodeError(str(exc)) from None


Decoded = bytes | bytearray
"""A unit's decoded bytes (a bytearray where the codec writes into one: no copy)."""

WHOLE: dict[str, Callable[[bytes, int], Decoded]] = {
    "deflate": _inflate(-15),
    "gzip": _inflate(31),
    "zlib": _inflate(15),
    "zstd": _zstd_into,
    "snappy": _snappy,
}


class SeekableReader(Protocol):
    """An open seekable unit: ``read_at`` its decoded bytes, thread-unsafe (callers lock)."""

    def read_at(self, offset: int, length: int) -> bytes: ...

    def close(self) -> None: ...


RawStream = io.RawIOBase | io.BufferedIOBase
"""A file object of a shard's raw bytes (read, seek, tell)."""

SEEKABLE: dict[str, Callable[[Unit, RawStream], SeekableReader]] = {}
"""Codec -> opener of a seekable unit over a file object of the shard's raw bytes."""

SPANS: dict[str, Callable[[Unit, int, int], tuple[int, int]]] = {}
"""Codec -> the raw bytes ``[lo, hi)`` of the shard that decoding ``[start, end)`` of a unit
reads (a seekable codec's nearest seek point on); absent: the whole unit."""


def raw_span(unit: Unit, start: int, end: int) -> tuple[int, int]:
    """Where in the shard the decoded bytes ``[start, end)`` of ``unit`` come from."""
    span = SPANS.get(unit.codec)
    return span(unit, start, end) if span is not None else (unit.offset, unit.end)


def decode(unit: Unit, raw: bytes) -> Decoded:
    """A whole unit's decoded bytes, exactly ``unit.size`` of them, or ``DecodeError``."""
    codec = WHOLE.get(unit.codec)
    if codec is None:
        raise DecodeError(f"unknown codec {unit.codec!r}")
    out = codec(raw, unit.size)
    if len(out) != unit.size:
        raise DecodeError(f"decodes to {len(out)} bytes, not the {unit.size} declared")
    return out


def raw_placement(space: DecodedSpace, offset: int, size: int) -> tuple[int, int]:
    """The raw bytes ``[lo, hi)`` of the shard that a decoded file at ``offset`` is read
    from: where the placement table and the order hint place it. A file no unit holds (an
    index that disagrees with itself) is placed at the end of the last unit."""
    try:
        _, unit, within = space.locate(offset)
    except KeyError:
        last = space.units[-1] if space.units else Unit("", 0, 0, 0)
        return last.end, last.end
    return raw_span(unit, within, within + size)

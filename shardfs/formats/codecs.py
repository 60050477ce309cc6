"""The codecs of decode units (``units.Unit``): each turns a unit's raw bytes into exactly
its declared decoded size, or raises ``DecodeError``. Bytes that decode to more than the
unit declares are refused as they come (a bomb never fills memory).

- whole-unit codecs (``WHOLE``): the unit's raw bytes in, its decoded bytes out: deflate
  (zip method 8), gzip and zlib streams, zstd, snappy (cramjam where installed: the
  ``formats`` extra; snappy falls back to the pure-Python decoder parquet's small columns
  use);
- ``pieces``: a unit whose decoded bytes are stored verbatim in the shard but for a few
  (a snappy page of JPEGs: literal runs, and copies of them): its state lists where each
  segment is stored and keeps the bytes that are not, and a file is read from the raw bytes
  under it, with no decoding (``units``);
- seekable codecs (``SEEKABLE``): a unit too large to decode whole for one file (a gzip
  stream of a whole shard), opened over a file object of its raw bytes and read at decoded
  offsets from the nearest seek point that ``Unit.state`` records. ``gzip-seek`` is
  rapidgzip's (the ``formats`` extra; docs/formats.md says why this library): its
  exported index is the state, its errors are translated here alone (``gzip_errors``).
"""

from __future__ import annotations

import atexit
import importlib
import io
import struct
import threading
import weakref
import zlib
from bisect import bisect_left, bisect_right
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import lru_cache
from typing import Any, Protocol

from ..errors import ShardfsError, UsageError
from .pages import PageError, snappy_decompress
from .units import PIECES as PIECES
from .units import DecodedSpace, Unit, pieces_span
from .units import DecodeError as DecodeError
from .units import pieces_read as pieces_read
from .units import pieces_state as pieces_state

_cram: Any
try:  # the ``formats`` extra: compiled snappy and zstd
    import cramjam as _cram
except ImportError:  # pragma: no cover - the extra is part of every test install
    _cram = None

_rapidgzip: Any
try:  # the ``formats`` extra: gzip seek points (untyped: imported by name)
    _rapidgzip = importlib.import_module("rapidgzip")
except ImportError:  # pragma: no cover - the extra is part of every test install
    _rapidgzip = None


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


def _cram_into(codec: str, what: str, raw: bytes, size: int) -> bytearray:
    """``raw`` decoded by cramjam's ``codec`` into one bytearray, trimmed in place (no copy:
    a shard-sized unit is not copied twice, about 3x faster than slicing it out)."""
    if _cram is None:
        raise DecodeError(f"{what} needs the 'cramjam' package (pip install 'shardfs[formats]')")
    out = bytearray(size + 1)  # one byte over: a unit decoding past its size is caught
    into = _cram.zstd.decompress_into if codec == "zstd" else _cram.snappy.decompress_raw_into
    try:
        written = into(raw, out)
    except _cram.DecompressionError as exc:
        raise DecodeError(f"not a valid {what}: {exc}") from None
    if written > size:
        raise DecodeError(f"decodes to more than the {size} bytes declared")
    del out[written:]
    return out


def _zstd_into(raw: bytes, size: int) -> bytearray:
    return _cram_into("zstd", "zstd frame", raw, size)


def _snappy(raw: bytes, size: int) -> bytes | bytearray:
    if _cram is not None:
        return _cram_into("snappy", "snappy block", raw, size)
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


POINTS: dict[str, Callable[[Unit], list[int]]] = {}
"""Codec -> the decoded offsets of a seekable unit's seek points (read from its state)."""


def seek_points(unit: Unit) -> list[int]:
    """Where a seekable unit can be decoded from: its chunks start there (none: one chunk)."""
    points = POINTS.get(unit.codec)
    return points(unit) if points is not None else []


def raw_span(unit: Unit, start: int, end: int) -> tuple[int, int]:
    """Where in the shard the decoded bytes ``[start, end)`` of ``unit`` come from."""
    span = SPANS.get(unit.codec)
    return span(unit, start, end) if span is not None else (unit.offset, unit.end)


def decode(unit: Unit, raw: bytes) -> Decoded:
    """A whole unit's decoded bytes, exactly ``unit.size`` of them, or ``DecodeError``."""
    if unit.codec == PIECES:
        base, view = unit.offset, memoryview(raw)
        return pieces_read(unit, 0, unit.size, lambda lo, hi: view[lo - base : hi - base])
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


SPANS[PIECES] = pieces_span


# -- gzip streams with seek points (rapidgzip) -----------------------------------------------

GZIP_SEEK = "gzip-seek"
# rapidgzip's chunk: a seek point about every 4 MiB of raw bytes, and what a read at a
# random offset decodes (docs/formats.md, tar.gz, has the measurements behind it).
GZIP_SPACING = 4 << 20
_PIECE = 1 << 20  # a scan's raw reads: whole MiB pieces (``RawFile``)
SCAN_PIECES = 12  # the pieces a scan keeps: rapidgzip's look-ahead of a chunk and back


class RawFile(io.RawIOBase):
    """A file object for the gzip library over ``read(offset, length)``; an exception of
    the reads (a store error) is kept, so that it is raised as itself.

    With ``keep``, reads are made of aligned ``_PIECE``s and the latest ``keep`` of them
    are kept: rapidgzip looks a chunk ahead and seeks back (4.3 MB on a JPEG shard), and a
    scan must ask for each raw byte once (at mount time a second ask is a second download).
    """

    mode = "rb"

    def __init__(self, read: Callable[[int, int], bytes], size: int, keep: int = 0) -> None:
        self._read = read
        self.size = size
        self.pos = 0
        self.failure: BaseException | None = None
        self._keep = keep
        self._pieces: OrderedDict[int, bytes] = OrderedDict()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = max(0, {0: 0, 1: self.pos, 2: self.size}[whence] + offset)
        return self.pos

    def readinto(self, buffer: Any) -> int:
        length = min(len(buffer), max(self.size - self.pos, 0))
        try:
            data = (
                self._piece_read(self.pos, length) if self._keep else self._read(self.pos, length)
            )
        except BaseException as exc:
            self.failure = exc
            raise
        buffer[: len(data)] = data
        self.pos += len(data)
        return len(data)

    def _piece_read(self, offset: int, length: int) -> bytes:
        parts = []
        end = offset + length
        while offset < end:
            start = offset - offset % _PIECE
            piece = self._pieces.get(start)
            if piece is None:
                piece = self._read(start, min(_PIECE, self.size - start))
                self._pieces[start] = piece
                while len(self._pieces) > self._keep:
                    self._pieces.popitem(last=False)
            else:
                self._pieces.move_to_end(start)
            part = piece[offset - start : end - start]
            if not part:
                break  # the source ended early: a short read
            parts.append(part)
            offset += len(part)
        return b"".join(parts)


def _file_reads(fileobj: RawStream, base: int) -> Callable[[int, int], bytes]:
    def read(offset: int, length: int) -> bytes:
        fileobj.seek(base + offset)
        return fileobj.read(length)

    return read


@contextmanager
def gzip_errors(raw: RawFile) -> Iterator[None]:
    """The one place the gzip library's errors become ``DecodeError``; a failed read of
    the raw bytes (a store error) is raised as itself."""
    try:
        yield
    except ShardfsError:
        raise
    except Exception as exc:
        if raw.failure is not None:
            raise raw.failure from None
        if isinstance(exc, (OSError, ValueError, RuntimeError, EOFError)):
            raise DecodeError(f"not a valid gzip stream near byte {raw.pos}: {exc}") from None
        raise


# rapidgzip's files must be closed before the interpreter finalizes (an open one aborts
# the process from its thread): every open one is closed at exit.
_OPEN: weakref.WeakSet[Any] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for opened in list(_OPEN):
        opened.close()


def open_gzip(raw: RawFile, index: bytes | None = None) -> Any:
    """A rapidgzip file over ``raw``, one thread: building its seek points as it is read
    (no ``index``), or with the exported ``index`` imported. Closed by ``close_gzip``."""
    if _rapidgzip is None:
        raise UsageError("gzip-compressed tars need rapidgzip: pip install 'shardfs[formats]'")
    with gzip_errors(raw):
        opened = _rapidgzip.RapidgzipFile(raw, parallelization=1, chunk_size=GZIP_SPACING)
        _OPEN.add(opened)
        if index is not None:
            try:
                opened.import_index(io.BytesIO(index))
            except BaseException:
                close_gzip(opened)
                raise
    return opened


def close_gzip(opened: Any) -> None:
    _OPEN.discard(opened)
    opened.close()


# A gzip-seek unit's state: its seek points as (raw offset, decoded offset) pairs, which
# say where a file's raw bytes lie without the library, then rapidgzip's exported index.
_COUNT = struct.Struct("<I")
_POINT = struct.Struct("<QQ")


def gzip_state(points: list[tuple[int, int]], exported: bytes) -> bytes:
    """A unit's state from its seek points (raw, decoded) and the library's index."""
    table = b"".join(_POINT.pack(raw, decoded) for raw, decoded in points)
    return _COUNT.pack(len(points)) + table + exported


def _point_table(state: bytes) -> tuple[list[tuple[int, int]], int]:
    try:
        (count,) = _COUNT.unpack_from(state)
        end = _COUNT.size + count * _POINT.size
        if end > len(state):
            raise DecodeError("the seek points are cut short")
        points = [_POINT.unpack_from(state, _COUNT.size + i * _POINT.size) for i in range(count)]
    except struct.error:
        raise DecodeError("no seek points") from None
    return points, end


def gzip_points(state: bytes) -> tuple[list[tuple[int, int]], bytes]:
    """The seek points and the exported index of a unit's state; ``DecodeError`` when it
    is not one."""
    points, end = _point_table(state)
    return points, state[end:]


@lru_cache(maxsize=16)
def _offsets(state: bytes) -> tuple[list[int], list[int]]:
    """A state's seek points as raw and decoded offsets, sorted: the shards being placed
    ask for the same few states over and over (a bytes object hashes once)."""
    points, _ = _point_table(state)
    return [raw for raw, _ in points], [decoded for _, decoded in points]


def _gzip_span(unit: Unit, start: int, end: int) -> tuple[int, int]:
    """The raw bytes decoding ``[start, end)`` of a gzip-seek unit reads: from the seek
    point at or before ``start`` to the first one at or after ``end`` (a point may start
    inside a byte: one more)."""
    try:
        raws, decoded = _offsets(unit.state)
    except DecodeError:
        return unit.offset, unit.end
    first = bisect_right(decoded, start) - 1
    last = bisect_left(decoded, end)
    lo = raws[first] if first >= 0 else 0
    hi = raws[last] + 1 if last < len(raws) else unit.length
    return unit.offset + lo, unit.offset + min(hi, unit.length)


def export_gzip(opened: Any) -> bytes:
    """A fully read rapidgzip file's state: its seek points (block offsets are in bits)
    and its exported index."""
    points = sorted((bits // 8, decoded) for bits, decoded in opened.block_offsets().items())
    exported = io.BytesIO()
    opened.export_index(exported)
    return gzip_state(points, exported.getvalue())


class GzipReader:
    """A ``gzip-seek`` unit opened over a file object of its shard's raw bytes: each read
    decodes from the seek point before it (rapidgzip keeps the chunks it decoded, so files
    read near each other decode once); one read at a time (its own lock)."""

    def __init__(self, unit: Unit, fileobj: RawStream) -> None:
        self._unit = unit
        self._raw = RawFile(_file_reads(fileobj, unit.offset), unit.length)
        self._file = open_gzip(self._raw, gzip_points(unit.state)[1])
        self._lock = threading.Lock()

    def read_at(self, offset: int, length: int) -> bytes:
        length = max(0, min(length, self._unit.size - offset))
        with self._lock, gzip_errors(self._raw):
            self._file.seek(offset)
            data: bytes = self._file.read(length)
        if len(data) != length:
            raise DecodeError(f"gzip stream ends before decoded byte {offset + length}")
        return data

    def close(self) -> None:
        with self._lock:
            close_gzip(self._file)


def _gzip_points(unit: Unit) -> list[int]:
    return list(_offsets(unit.state)[1])


SEEKABLE[GZIP_SEEK] = GzipReader
SPANS[GZIP_SEEK] = _gzip_span
POINTS[GZIP_SEEK] = _gzip_points

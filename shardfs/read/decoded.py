"""Reads of decoded files: bytes at a shard's decoded offsets (``formats.units``).

A read at a decoded offset finds its unit in the view, reads the unit's raw bytes through
the same ``RangeReader`` as every other read (so the block cache, readahead and egress
accounting see them as any bytes of the shard), decodes them and slices. Decoded units are
kept in a cache bounded in bytes, least recently used out first: the files of one unit (the
values of a parquet page, the samples of a zstd MDS shard) are then decoded once while they
are read near each other, as shard order and the order hint read them. One unit is decoded
by one thread at a time; the others wait for its bytes.

A seekable unit (a gzip stream: ``codecs.SEEKABLE``) is never decoded whole: a few opened
decoders are kept, each used under its own lock, and read from their nearest seek point.
"""

from __future__ import annotations

import threading
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

from ..errors import CorruptShardError
from ..formats import codecs
from ..formats.units import Unit
from ..store.shards import ShardInfo
from .seam import RangeReader

DEFAULT_BUDGET = 256 << 20  # decoded bytes kept
OPEN_SEEKABLE = 8  # opened seekable decoders kept
PIECES_KEPT = 256  # pieces units kept with their states (a few KB each)

_Key = tuple[int, int]  # (shard id, decoded start of the unit, or of a seekable's chunk)
_Opened = tuple[codecs.SeekableReader, threading.Lock, list[int]]  # and its chunk bounds


class _NotLocal(Exception):
    """A raw range of a pieces file is not local: the read must wait."""


def _slice(data: codecs.Decoded, start: int, length: int) -> bytes:
    """A file's bytes out of its decoded unit, copied once."""
    return bytes(memoryview(data)[start : start + length])


class UnitTable(Protocol):
    def unit_at(self, shard: int, offset: int, *, state: bool = False) -> tuple[int, Unit]: ...


class DecodedReads:
    """Bytes of decoded files, from their units' raw bytes, with decoded units cached."""

    def __init__(self, units: UnitTable, reader: RangeReader, budget: int = DEFAULT_BUDGET):
        self._units = units
        self._reader = reader
        self._budget = budget
        self._lock = threading.Lock()
        self._decoded: OrderedDict[_Key, codecs.Decoded] = OrderedDict()
        self._held = 0
        self._decoding: dict[_Key, threading.Lock] = {}
        self._open: OrderedDict[_Key, _Opened] = OrderedDict()
        self._pieces: OrderedDict[_Key, tuple[Unit, bool]] = OrderedDict()
        self.units_decoded = 0  # units and chunks decoded (one decoded twice counts twice)

    def read(self, shard_id: int, shard: ShardInfo, start: int, end: int) -> bytes:
        """Decoded bytes ``[start, end)`` of a shard's decoded space (one unit holds them)."""
        unit_start, unit = self._units.unit_at(shard_id, start)
        within, length = start - unit_start, min(end, unit_start + unit.size) - start
        key = (shard_id, unit_start)
        try:
            if unit.codec == codecs.PIECES:
                unit, whole = self._pieces_unit(shard_id, unit_start)
                if not whole:
                    return self._read_pieces(shard, unit, within, length)
            if unit.codec in codecs.SEEKABLE:
                return self._read_seekable(key, shard, within, length)
            return _slice(self._whole(key, shard, unit), within, length)
        except codecs.DecodeError as exc:
            raise CorruptShardError(shard.name, unit.offset, f"{unit.codec} data: {exc}") from None

    def read_local(
        self, shard_id: int, start: int, end: int, shard: ShardInfo | None = None
    ) -> bytes | None:
        """The same bytes if their unit (a seekable unit's chunk) is decoded and kept, or,
        of a pieces unit of ``shard``, its raw bytes are local; else None (never waits)."""
        unit_start, unit = self._units.unit_at(shard_id, start)
        end = min(end, unit_start + unit.size)
        if unit.codec == codecs.PIECES:
            unit, whole = self._pieces_unit(shard_id, unit_start)
            if shard is not None and not whole:
                return self._pieces_local(shard, unit, start - unit_start, end - unit_start)
        base = unit_start  # where the kept bytes start: the unit's, or its chunk's
        with self._lock:
            if unit.codec in codecs.SEEKABLE:
                opened = self._open.get((shard_id, unit_start))
                if opened is None:
                    return None
                bounds = opened[2]
                chunk = bisect_right(bounds, start - unit_start) - 1
                if end - unit_start > bounds[chunk + 1]:
                    return None  # the bytes run into the next chunk
                base += bounds[chunk]
            data = self._decoded.get((shard_id, base))
            if data is None:
                return None
            self._decoded.move_to_end((shard_id, base))
        return _slice(data, start - base, end - start)

    def _whole_pieces(self, unit: Unit) -> bool:
        """Whether a pieces unit is read whole, its raw bytes assembled once and kept as a
        decoded unit's are (its files then slices of memory): when it is small beside the
        budget and the dataset fits in the block cache and this cache together, so a unit
        is fetched once; else each file reads only the raw bytes under it (a dataset far
        larger than both, where whole units would be fetched once per image)."""
        holds = getattr(self._reader, "cache_holds_dataset", None)  # others keep no cache
        return holds is not None and unit.size <= self._budget // 8 and holds(self._budget)

    def _read_pieces(self, shard: ShardInfo, unit: Unit, within: int, length: int) -> bytes:
        """Bytes of a pieces unit: the raw bytes under them, read as any extent (no unit is
        decoded, nothing is kept here: the block cache keeps the raw bytes)."""

        def read(lo: int, hi: int) -> bytes:
            return self._reader.read(shard, lo, hi, hi)

        return codecs.pieces_read(unit, within, within + length, read)

    def _pieces_local(self, shard: ShardInfo, unit: Unit, within: int, end: int) -> bytes | None:
        def read(lo: int, hi: int) -> bytes:
            data = self._reader.read_local(shard, lo, hi)
            if data is None:
                raise _NotLocal
            return data

        try:
            return codecs.pieces_read(unit, within, end, read)
        except (_NotLocal, codecs.DecodeError):
            return None  # the read that waits fetches them, or names the fault

    def _pieces_unit(self, shard_id: int, unit_start: int) -> tuple[Unit, bool]:
        """A pieces unit with its state, and whether it is read whole (``_whole_pieces``),
        kept for the files read after it: one query, one parse of the state and one look
        at the cache's bound per unit, not per read."""
        key = (shard_id, unit_start)
        with self._lock:
            kept = self._pieces.get(key)
            if kept is not None:
                self._pieces.move_to_end(key)
                return kept
        _, unit = self._units.unit_at(shard_id, unit_start, state=True)
        kept = (unit, self._whole_pieces(unit))
        with self._lock:
            self._pieces[key] = kept
            while len(self._pieces) > PIECES_KEPT:
                self._pieces.popitem(last=False)
        return kept

    def _whole(self, key: _Key, shard: ShardInfo, unit: Unit) -> codecs.Decoded:
        def produce() -> codecs.Decoded:
            return codecs.decode(unit, self._reader.read(shard, unit.offset, unit.end, unit.end))

        return self._cached(key, produce)

    def _cached(self, key: _Key, produce: Callable[[], codecs.Decoded]) -> codecs.Decoded:
        """The decoded bytes kept under ``key``, else ``produce``d by one thread while the
        others asking for the same key wait, then kept."""
        with self._lock:
            data = self._decoded.get(key)
            if data is not None:
                self._decoded.move_to_end(key)
                return data
            flight = self._decoding.setdefault(key, threading.Lock())
        with flight:
            with self._lock:
                data = self._decoded.get(key)
            if data is not None:
                return data
            try:
                data = produce()
            finally:
                with self._lock:
                    self._decoding.pop(key, None)
            with self._lock:
                self.units_decoded += 1
                self._keep(key, data)
            return data

    def _keep(self, key: _Key, data: codecs.Decoded) -> None:
        """Keep a decoded unit, dropping the least recently used ones past the budget (a
        unit larger than the whole budget is not kept)."""
        if len(data) > self._budget:
            return
        self._decoded[key] = data
        self._held += len(data)
        while self._held > self._budget:
            _, dropped = self._decoded.popitem(last=False)
            self._held -= len(dropped)

    def _read_seekable(self, key: _Key, shard: ShardInfo, within: int, length: int) -> bytes:
        """Bytes of a seekable unit, decoded a chunk at a time (from one seek point to the
        next) and the chunks kept as whole units are: a shuffled read of a gzip shard then
        decodes each chunk once while the chunks fit in the budget, not once per file."""
        with self._lock:
            opened = self._open.get(key)
            if opened is not None:
                self._open.move_to_end(key)
        if opened is None:
            opened = self._open_seekable(key, shard)
        decoder, lock, bounds = opened
        parts = []
        end = within + length
        chunk = bisect_right(bounds, within) - 1
        while within < end:
            lo, hi = bounds[chunk], bounds[chunk + 1]
            if hi - lo > self._budget // 8:  # a chunk too large to keep: read just the bytes
                with lock:
                    parts.append(decoder.read_at(within, min(end, hi) - within))
                within = min(end, hi)
                chunk += 1
                continue

            def produce(lo: int = lo, hi: int = hi) -> codecs.Decoded:
                with lock:
                    return decoder.read_at(lo, hi - lo)

            data = self._cached((key[0], key[1] + lo), produce)
            parts.append(_slice(data, within - lo, min(end, hi) - within))
            within = min(end, hi)
            chunk += 1
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _open_seekable(self, key: _Key, shard: ShardInfo) -> _Opened:
        _, unit = self._units.unit_at(key[0], key[1], state=True)

        def read(offset: int, length: int) -> bytes:
            return self._reader.read(shard, offset, min(offset + length, shard.size))

        # The shard's raw bytes as a file object, read through the reader (the cache).
        decoder = codecs.SEEKABLE[unit.codec](unit, codecs.RawFile(read, shard.size))
        points = sorted({0, *codecs.seek_points(unit)} - {unit.size})
        bounds = [p for p in points if 0 <= p < unit.size] + [unit.size]
        closing: list[_Opened] = []
        with self._lock:
            opened = self._open.get(key)
            if opened is not None:  # another thread opened it meanwhile
                closing.append((decoder, threading.Lock(), bounds))
            else:
                opened = self._open[key] = (decoder, threading.Lock(), bounds)
            while len(self._open) > OPEN_SEEKABLE:
                closing.append(self._open.popitem(last=False)[1])
        for old, old_lock, _ in closing:
            with old_lock:  # not while another thread reads through it
                old.close()
        return opened

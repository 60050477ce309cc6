"""Decode units: the parts of a shard whose bytes are not served as stored but decoded
first (a deflated zip member, a zstd MDS shard, a snappy parquet page, a gzip stream).

A unit is a raw extent of its shard, a codec and the size of its decoded bytes. The files
that live in a unit are slices of its decoded bytes, and their index rows say so through
offsets in the shard's *decoded space*: the units of a shard laid end to end from
``DECODED_BASE``, far above any real shard offset. Every part of the mount that handles
offsets (the tree, the placement table, the sampler's order) then works unchanged; a read
at an offset at or above ``DECODED_BASE`` is a read of a unit (``shardfs.read.decoded``),
and block pushes, which look at real shard offsets only, never meet one.

A scanner whose shard holds units returns a ``DecodedScan``: its rows (direct extents and
decoded slices alike) and its units in the order of their decoded space.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field

from .members import MemberRow

DECODED_BASE = 1 << 50  # 1 PiB: no shard is this large, no decoded space reaches 2 ** 63
MAX_EXPANSION = 1024  # a unit may decode to at most this many times its raw bytes (bombs)


@dataclass(frozen=True)
class Unit:
    """One decode unit: ``codec`` decodes the shard's bytes ``[offset, offset + length)``
    into ``size`` bytes; ``state`` is the codec's own data (a gzip stream's seek points)."""

    codec: str
    offset: int
    length: int
    size: int
    state: bytes = b""

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass
class DecodedSpace:
    """The decoded space of one shard, built by its scanner: ``add`` places a unit after the
    previous ones and gives the decoded offset its bytes start at."""

    units: list[Unit] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)

    def add(self, unit: Unit) -> int:
        start = self.starts[-1] + self.units[-1].size if self.units else DECODED_BASE
        self.units.append(unit)
        self.starts.append(start)
        return start

    def locate(self, offset: int) -> tuple[int, Unit, int]:
        """(index, unit, offset within its decoded bytes) of a decoded offset; KeyError
        when no unit holds it."""
        index = bisect_right(self.starts, offset) - 1
        if index < 0 or offset - self.starts[index] >= max(self.units[index].size, 1):
            raise KeyError(offset)
        return index, self.units[index], offset - self.starts[index]


@dataclass
class DecodedScan:
    """What a scanner of a shard that holds decode units returns."""

    rows: list[MemberRow]
    space: DecodedSpace


def is_decoded(offset: int) -> bool:
    return offset >= DECODED_BASE

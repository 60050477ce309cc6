"""What a parser of a random-access format reads a shard through: its name, its size and
byte ranges at offsets. Formats whose index sits at the end (zip's central directory,
parquet's footer) or in a table at the front (MDS) read only the ranges they need; the
scan supplies the reads, so a parser never sees the store."""

from __future__ import annotations

from typing import NoReturn, Protocol

from ..errors import CorruptShardError


class ShardBytes(Protocol):
    """One shard, read by range. ``read_at`` returns exactly ``length`` bytes, or fewer only
    where the shard ends; a parser treats a short read as a truncated shard."""

    @property
    def name(self) -> str: ...

    @property
    def size(self) -> int: ...

    def read_at(self, offset: int, length: int) -> bytes: ...

    def read_cached(self, offset: int, length: int) -> bytes:
        """As ``read_at``, for bytes the files are served from later (the units a scanner
        decodes at index time): a mount reads them by whole cache blocks that it hands to
        the block cache, so an epoch does not download them again."""
        ...


class BytesShard:
    """A shard held in memory: for tests, and for parsers that read a nested member."""

    def __init__(self, name: str, data: bytes | bytearray) -> None:
        self._name = name
        self._data = data
        self.reads = 0  # how many ranges were asked for

    @property
    def name(self) -> str:
        return self._name

    @property
    def size(self) -> int:
        return len(self._data)

    def read_at(self, offset: int, length: int) -> bytes:
        self.reads += 1
        return bytes(memoryview(self._data)[offset : offset + length])

    def read_cached(self, offset: int, length: int) -> bytes:
        return self.read_at(offset, length)


class CheckedReads:
    """A parser's reads of one shard: each range lies inside the shard and comes back whole,
    or the shard is bad (``CorruptShardError`` at the offset, saying what was read)."""

    def __init__(self, shard: ShardBytes) -> None:
        self.shard = shard

    def fail(self, offset: int, reason: str) -> NoReturn:
        raise CorruptShardError(self.shard.name, offset, reason)

    def read(self, offset: int, length: int, what: str, cached: bool = False) -> bytes:
        """``length`` bytes at ``offset``; with ``cached`` through ``read_cached`` (bytes the
        files are served from later, or that share their cache blocks)."""
        if offset < 0 or length < 0 or offset + length > self.shard.size:
            self.fail(offset, f"{what} ({length} bytes) lies past the end of the shard")
        read = self.shard.read_cached if cached else self.shard.read_at
        data = read(offset, length)
        if len(data) != length:
            self.fail(offset, f"{what} is truncated")
        return data

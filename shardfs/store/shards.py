"""The types every family names for a shard, in a leaf that loads no fsspec: ``ShardInfo``
(a shard as listed) and ``Readable`` (what a shard streams through)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class ShardInfo:
    """A shard as listed in the store: ``name`` is relative to the source root."""

    name: str
    size: int
    etag: str

    @property
    def identity(self) -> tuple[str, int, str]:
        return (self.name, self.size, self.etag)


class Readable(Protocol):
    """Anything with a sequential ``read(n)``: a file, a socket stream, an fsspec file."""

    def read(self, n: int = -1, /) -> bytes: ...

"""Several sources mounted as one tree (``shardfs mount A B MNT``): a ``Store`` over one
``Store`` per source, on the same store or not.

A shard's name is its name in its own source plus `` (source N)``, N counting from 1 in
command-line order: names stay unique across sources, a shard's folder (where its members
show) is the one it has in its source, and messages say which source a shard came from.
The shards are listed source by source, so where two sources present the same path the
later source wins, as the later shard does within one. Each request goes to the part that
owns the shard, by that name; ``open_store`` picks this class or a plain ``Store``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
from collections.abc import Callable, Generator, Iterator
from typing import IO, NoReturn

from ..config import SourceConfig
from ..errors import UsageError
from ..stats import Stats
from ..store.shards import Readable
from .client import S3_PROTOCOLS
from .remote import Store
from .responses import Fetched, Landing, Piece, Pieces
from .shards import ShardInfo


def open_store(config: SourceConfig, stats: Stats | None = None) -> Store:
    """The store of a source: a ``StoreSet`` when it names several; ``stats`` counts what
    it fetches (every part into the same counters)."""
    return StoreSet(config, stats) if config.extra_urls else Store(config, stats)


def _suffix(number: int) -> str:
    return f" (source {number})"


def _split_source(name: str) -> tuple[str, int | None]:
    """``NAME (source N)`` -> (NAME, N); any other name -> (name, None)."""
    head, mark, tail = name.rpartition(" (source ")
    if mark and tail.endswith(")") and tail[:-1].isdigit():
        return head, int(tail[:-1])
    return name, None


def name_in_source(name: str) -> str:
    """A shard's name as its own source names it: without the `` (source N)`` a set of
    sources adds (what its suffix, and so its format, is read from)."""
    return _split_source(name)[0]


class StoreSet(Store):
    """The shards of several sources as one store (see the module)."""

    def __init__(self, config: SourceConfig, stats: Stats | None = None) -> None:
        # No Store.__init__: there is no one filesystem.
        self.config = config
        self.stats = stats if stats is not None else Stats()
        self.version_warning = None
        self._parts: list[tuple[Store, str]] = []
        for number, url in enumerate(config.urls, start=1):
            scheme = url.split("://", 1)[0] if "://" in url else "file"
            endpoint = config.endpoint_url if scheme in S3_PROTOCOLS else None
            part = Store(
                dataclasses.replace(config, url=url, extra_urls=(), endpoint_url=endpoint),
                self.stats,
            )
            self._parts.append((part, _suffix(number)))

    def parts(self) -> list[tuple[Store, str]]:
        return list(self._parts)

    def _owner(self, shard: ShardInfo) -> tuple[Store, ShardInfo]:
        """The part that holds ``shard``, and the shard as that part names it."""
        head, number = _split_source(shard.name)
        if number is not None and 1 <= number <= len(self._parts):
            return self._parts[number - 1][0], ShardInfo(head, shard.size, shard.etag)
        raise ValueError(f"{shard.name!r} names no shard of {self.describe()}")

    @property
    def root(self) -> str:
        return ", ".join(part.root for part, _ in self._parts)

    @property
    def identity(self) -> str:
        text = "|".join(part.identity for part, _ in self._parts)
        return hashlib.sha256(f"set|{text}".encode()).hexdigest()[:20]

    def location(self, shard: ShardInfo) -> str:
        part, own = self._owner(shard)
        return part.location(own)

    def describe(self) -> str:
        return self.config.describe()

    def list_shards(self) -> list[ShardInfo]:
        """Every part's shards, part by part (each sorted by name), named with its suffix."""
        shards: list[ShardInfo] = []
        warnings = []
        for part, suffix in self._parts:
            shards += [ShardInfo(s.name + suffix, s.size, s.etag) for s in part.list_shards()]
            if part.version_warning:
                warnings.append(part.version_warning)
        self.version_warning = "; ".join(warnings) or None
        return shards

    @property
    def listing_warnings(self) -> list[str]:
        return [line for part, _ in self._parts for line in part.listing_warnings]

    @property
    def range_warning(self) -> str | None:  # type: ignore[override]
        """The first part's word that its server ignores Range (each part says it once)."""
        return next((p.range_warning for p, _ in self._parts if p.range_warning), None)

    def check_current(self, shard: ShardInfo) -> None:
        part, own = self._owner(shard)
        part.check_current(own)

    def read_range(self, shard: ShardInfo, start: int, end: int, *, retries: int = 4) -> bytes:
        part, own = self._owner(shard)
        return part.read_range(own, start, end, retries=retries)

    def read_pieces(
        self, shard: ShardInfo, start: int, end: int, piece: int, *, retries: int = 4
    ) -> Pieces:
        part, own = self._owner(shard)
        return part.read_pieces(own, start, end, piece, retries=retries)

    def fetch(
        self,
        shard: ShardInfo,
        start: int,
        end: int,
        piece: int,
        *,
        retries: int = 4,
        scan: bool = False,
        land: Landing | None = None,
    ) -> Fetched:
        part, own = self._owner(shard)
        return part.fetch(own, start, end, piece, retries=retries, scan=scan, land=land)

    def streams_pieces(self, shard: ShardInfo | None = None) -> bool:
        if shard is None:
            return all(part.streams_pieces() for part, _ in self._parts)
        return self._owner(shard)[0].streams_pieces()

    def stream(
        self,
        shard: ShardInfo,
        start: int,
        end: int,
        piece: int,
        *,
        retries: int = 4,
        land: Landing | None = None,
        whole: Callable[[bytes], None] | None = None,
    ) -> Generator[Piece, None, None]:
        part, own = self._owner(shard)
        return part.stream(own, start, end, piece, retries=retries, land=land, whole=whole)

    @property
    def checks_identity(self) -> bool:
        return all(part.checks_identity for part, _ in self._parts)

    @contextlib.contextmanager
    def open_stream(self, shard: ShardInfo, block_size: int = 8 << 20) -> Iterator[Readable]:
        part, own = self._owner(shard)
        with part.open_stream(own, block_size) as stream:
            yield stream

    # Objects next to the shards belong to one source: they are read from a part
    # (``parts``), and several sources are written to one at a time.

    def _one_source_only(self, what: str) -> NoReturn:
        raise UsageError(f"{self.describe()}: {what} takes one source, not several")

    def read_object(self, name: str) -> bytes | None:
        self._one_source_only(f"reading {name}")

    def write_object(self, name: str, data: bytes) -> None:
        self._one_source_only(f"writing {name}")

    def list_names(self) -> list[str]:
        self._one_source_only("listing every object")

    @contextlib.contextmanager
    def atomic_writer(self, name: str) -> Iterator[IO[bytes]]:
        self._one_source_only(f"writing {name}")
        yield  # pragma: no cover (unreachable: a generator for contextmanager)

    def remove_temp_files(self, names: list[str]) -> list[str]:
        self._one_source_only("removing temp files")

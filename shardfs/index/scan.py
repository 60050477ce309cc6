"""One shard streamed front to back into index rows: the tar parser's members, their
paths made safe, small label members read in the same pass; optionally every block of the
stream handed to the block cache, so that the bytes a scan downloads are not downloaded
again when files are read."""

from __future__ import annotations

import logging
import posixpath
import sqlite3
import threading
from collections.abc import Callable

from ..formats.members import MemberRow, tar_rows
from ..formats.registry import Scanner, reads_whole_blocks, scanner_for
from ..formats.tar import MemberKind
from ..formats.units import DecodedScan
from ..store.remote import Store
from ..store.sets import name_in_source
from ..store.shards import Readable, ShardInfo

ShardScan = list[MemberRow] | DecodedScan
"""One shard's index rows, with its decode units when it has any."""

log = logging.getLogger(__name__)


BlockSink = Callable[[ShardInfo, int, bytes], None]
"""Receives (shard, block index, block bytes) for every whole block a scan streamed."""


class _BlockTee:
    """Passes a shard stream through while cutting it into cache blocks for a sink, so the
    bytes a scan downloads are not downloaded again when files are read."""

    def __init__(
        self, stream: Readable, shard: ShardInfo, block_size: int, sink: BlockSink
    ) -> None:
        self._stream = stream
        self._shard = shard
        self._block_size = block_size
        self._sink = sink
        self._buffer = bytearray()
        self._index = 0
        self._sink_failed = False

    def read(self, n: int = -1, /) -> bytes:
        data = self._stream.read(n)
        self._buffer += data
        while len(self._buffer) >= self._block_size:
            self._emit(bytes(self._buffer[: self._block_size]))
            del self._buffer[: self._block_size]
        return data

    def finish(self) -> None:
        """Read the archive's tail padding too, so that the last block is whole."""
        while self.read(1 << 20):
            pass
        if self._buffer and self._index * self._block_size + len(self._buffer) == self._shard.size:
            self._emit(bytes(self._buffer))
        self._buffer.clear()

    def _emit(self, block: bytes) -> None:
        if self._sink_failed:
            return
        try:
            self._sink(self._shard, self._index, block)
        except (OSError, sqlite3.Error) as exc:
            # The cache disk failed: the scan goes on (the blocks are an optimisation
            # here), says so once, and stops handing this shard's blocks over. Any other
            # error is a bug and is raised.
            log.warning("not caching the blocks of %s while indexing: %s", self._shard.name, exc)
            self._sink_failed = True
        self._index += 1


class _StoreBytes:
    """A shard of the store read by range, for the scanners of random-access formats.

    With a block sink, reads are made of whole cache blocks, each fetched once and handed
    to the sink once: the bytes a scanner reads (the data between zip headers, say) are not
    downloaded again when files are read. The blocks of the first read (a format's index at
    the end) and of the latest are kept, so a scan moving forward in windows fetches each
    block once; only a block that left both can be fetched again."""

    def __init__(
        self, store: Store, shard: ShardInfo, sink: BlockSink | None = None, block_size: int = 0
    ) -> None:
        self._store = store
        self._shard = shard
        self._sink = sink if block_size > 0 else None
        self._block_size = block_size
        self.whole_blocks = False  # every read by whole blocks (``reads_whole_blocks``)
        self._lock = threading.Lock()
        self._kept: dict[int, bytes] = {}
        self._first: set[int] | None = None
        self._given: set[int] = set()
        self._sink_failed = False

    @property
    def name(self) -> str:
        return self._shard.name

    @property
    def size(self) -> int:
        return self._shard.size

    def read_at(self, offset: int, length: int) -> bytes:
        end = min(offset + length, self._shard.size)
        if end <= offset:
            return b""
        if self._sink is None or not self.whole_blocks:
            return self._store.read_range(self._shard, offset, end)
        return self._read_blocks(offset, end)

    def read_cached(self, offset: int, length: int) -> bytes:
        end = min(offset + length, self._shard.size)
        if end <= offset:
            return b""
        if self._sink is None:
            return self._store.read_range(self._shard, offset, end)
        return self._read_blocks(offset, end)

    def _read_blocks(self, offset: int, end: int) -> bytes:
        with self._lock:  # a scanner may read from several threads (parquet's pages)
            return self._read_blocks_locked(offset, end)

    def _read_blocks_locked(self, offset: int, end: int) -> bytes:
        size = self._block_size
        first, last = offset // size, (end - 1) // size
        wanted = range(first, last + 1)
        missing = [index for index in wanted if index not in self._kept]
        while missing:  # each run of missing blocks in one ranged GET
            run = 1
            while run < len(missing) and missing[run] == missing[0] + run:
                run += 1
            lo = missing[0] * size
            data = self._store.read_range(self._shard, lo, min(lo + run * size, self._shard.size))
            for at, index in enumerate(missing[:run]):
                block = data[at * size : (at + 1) * size]
                self._kept[index] = block
                self._give(index, block)
            del missing[:run]
        if self._first is None:
            self._first = set(wanted)
        keep = self._first | set(wanted)
        self._kept = {i: block for i, block in self._kept.items() if i in keep}
        joined = b"".join(self._kept[index] for index in wanted)
        return joined[offset - first * size : end - first * size]

    def _give(self, index: int, block: bytes) -> None:
        if index in self._given or self._sink is None or self._sink_failed:
            return
        self._given.add(index)
        try:
            self._sink(self._shard, index, block)
        except (OSError, sqlite3.Error) as exc:  # as for the tar scan's tee
            log.warning("not caching the blocks of %s while indexing: %s", self._shard.name, exc)
            self._sink_failed = True


def _scan_by_range(
    store: Store,
    shard: ShardInfo,
    scanner: Scanner,
    sink: BlockSink | None,
    block_size: int,
    whole_blocks: bool,
) -> ShardScan:
    """A random-access format's rows, their paths placed under the shard's folder."""
    shard_dir = posixpath.dirname(shard.name)
    source = _StoreBytes(store, shard, sink, block_size)
    source.whole_blocks = whole_blocks
    scanned = scanner(source)
    rows = scanned.rows if isinstance(scanned, DecodedScan) else scanned
    if shard_dir:
        placed: list[MemberRow] = []
        for path, offset, size, mode, mtime, kind, link, label in rows:
            if kind == MemberKind.HARDLINK:
                link = posixpath.join(shard_dir, link)
            path = posixpath.join(shard_dir, path)
            placed.append((path, offset, size, mode, mtime, kind, link, label))
        rows = placed
    if isinstance(scanned, DecodedScan) and scanned.space.units:
        return DecodedScan(rows, scanned.space)
    return rows


def scan_shard(
    store: Store,
    shard: ShardInfo,
    block_sink: BlockSink | None = None,
    block_size: int = 0,
) -> ShardScan:
    """Index one shard: a row per member worth serving. A tar shard is streamed front to
    back, and with ``block_sink`` every block of it is handed to the sink too; a shard of
    another format is read by range by its registered scanner, by whole blocks handed to
    the sink where the format's scan reads most of them anyway (``reads_whole_blocks``)."""
    name, shard_format = name_in_source(shard.name), store.config.shard_format
    scanner = scanner_for(name, shard_format)
    if scanner is not None:
        whole = reads_whole_blocks(name, shard_format)
        return _scan_by_range(store, shard, scanner, block_sink, block_size, whole)
    shard_dir = posixpath.dirname(shard.name)
    with store.open_stream(shard) as raw:
        tee = _BlockTee(raw, shard, block_size, block_sink) if block_sink and block_size else None
        rows = tar_rows(tee if tee is not None else raw, shard.name, shard_dir)
        if tee is not None:
            tee.finish()
    return rows

"""The filesystem core: lookups, attributes, directory listings and reads, without FUSE.

Tests drive this class directly; ``fuse.operations`` is a thin adapter over it.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from .. import placement
from ..cache.block_cache import BlockFile
from ..cache.block_format import BlockKey
from ..config import ReadConfig
from ..errors import IsADirError, NoSuchAttributeError, NotADirError, NotFoundError
from ..formats.codecs import raw_span
from ..formats.tar import MemberKind
from ..formats.units import is_decoded
from ..read.decoded import DecodedReads
from ..read.reader import CachedReader
from ..read.seam import RangeReader
from ..stats import Stats
from ..store.shards import ShardInfo
from ..views.block_files import FileTable
from ..views.nodes import ROOT_INO, Node
from ..views.view import View
from .attributes import AttributeRule, Attributes, Owner
from .order_hints import OrderHints

log = logging.getLogger(__name__)

# Owner is imported from here by mount (the core is built with one).
__all__ = ["XATTR_OFFSET", "XATTR_SHARD", "Entry", "Owner", "ShardFileSystem"]


class Entry(NamedTuple):
    """One name of a listing with what ``stat`` shows of it."""

    name: bytes
    ino: int
    mode: int
    nlink: int
    size: int
    blocks: int
    mtime: int
    full: bool  # READDIRPLUS hands the kernel the inode and attributes; else name and type


XATTR_SHARD = "user.shardfs.shard"
XATTR_OFFSET = "user.shardfs.offset"
_FILE_XATTRS = (XATTR_SHARD, XATTR_OFFSET)


@dataclass
class _OpenFile:
    """An open file: the node plus the last window of its bytes fetched from the store."""

    node: Node
    window_start: int = 0
    window: bytes = b""
    lock: threading.Lock = field(default_factory=threading.Lock)


class ShardFileSystem:
    """A read-only tree over a materialised view, reading bytes through a RangeReader.

    Two virtual files sit at the root, found by lookup and never listed (see
    ``shardfs.placement``): the placement table, and the hint file that takes the order in
    which this node will read, which the core then reads ahead in (``OrderHints``)."""

    def __init__(
        self,
        view: View,
        reader: RangeReader,
        config: ReadConfig,
        stats: Stats,
        *,
        owner: Owner | None = None,
    ) -> None:
        self.view = view
        self.reader = reader
        self.config = config
        self.stats = stats
        self._handles: dict[int, _OpenFile] = {}
        self._next_handle = itertools.count(1)
        self._handles_lock = threading.Lock()
        owner = owner if owner is not None else Owner()
        self.uid = owner.uid
        self.gid = owner.gid
        self.shown = AttributeRule(owner, int(time.time()))
        self.table_ino = view.max_ino + 1
        self.hint_ino = view.max_ino + 2
        self.hints = OrderHints(view, reader, self.stats)
        self.decoded = DecodedReads(view, reader)
        # One bit per inode: files already served or pushed (for egress amplification);
        # shared with the compiled FUSE path, which counts the files it serves: never resized.
        self.delivered = bytearray(view.max_ino // 8 + 1)

    # -- the placement table and the order hint -------------------------------------------

    def _virtual(self, ino: int) -> Node | None:
        if ino == self.table_ino:
            size = len(self.hints.table().data)
        elif ino != self.hint_ino:
            return None
        else:
            size = 0
        return Node(ino, MemberKind.FILE, -1, 0, size, 0o444, self.shown.mount_time, "")

    def is_virtual(self, node: Node) -> bool:
        return node.ino in (self.table_ino, self.hint_ino)

    def take_hint_chunk(self, chunk: bytes) -> None:
        """One ioctl of an order hint (``OrderHints.take_chunk``)."""
        self.hints.take_chunk(chunk)

    def follow_hint(self, hint: placement.Hint) -> None:
        """Follow a decoded, checked hint now (on this thread)."""
        self.hints.follow(hint)

    def _virtual_read(self, node: Node, offset: int, size: int) -> bytes:
        if node.ino == self.table_ino:
            return self.hints.table().data[offset : offset + size]
        return b""

    def attributes(self, node: Node) -> Attributes:
        """Everything ``stat`` shows of a node (``AttributeRule.of``)."""
        return self.shown.of(node)

    def listing(self, folder: Node, full_from: int = 0) -> list[Entry]:
        """Every name of ``folder`` with what ``stat`` shows of it, "." and ".." first, in
        listing order. Folders and files of at least ``full_from`` bytes are marked full (a
        listing may hand the kernel their attributes); "." and ".." never are."""
        if not folder.is_dir:
            raise NotADirError(f"inode {folder.ino}")
        mount_time = self.shown.mount_time
        directory = int(MemberKind.DIRECTORY)
        mode_of = self.shown.mode
        dir_mode = mode_of(directory, 0)
        entries = [
            Entry(b".", folder.ino, dir_mode, 2, 0, 0, 0, False),
            Entry(b"..", self.view.parent_of(folder.ino), dir_mode, 2, 0, 0, 0, False),
        ]
        append = entries.append
        # The fields of ``AttributeRule.of``, computed inline: a call per entry costs a tenth of
        # a listing (measured); test_listing_shows_what_stat_shows keeps the two equal.
        for name, ino, kind, size, mode, mtime in self.view.listing_rows(folder.ino):
            is_dir = kind == directory
            append(
                Entry(
                    name,
                    ino,
                    mode_of(kind, mode),
                    2 if is_dir else 1,
                    size,
                    (size + 511) // 512,
                    mtime or mount_time,
                    is_dir or size >= full_from,
                )
            )
        return entries

    def node(self, ino: int) -> Node:
        if ino > self.view.max_ino:
            virtual = self._virtual(ino)
            if virtual is not None:
                return virtual
        return self.view.node(ino)

    def child(self, parent: Node, name: str) -> Node:
        if not parent.is_dir:
            raise NotADirError(name)
        if parent.ino == ROOT_INO and name in (placement.TABLE_NAME, placement.HINT_NAME):
            return self.node(self.table_ino if name == placement.TABLE_NAME else self.hint_ino)
        found = self.view.child(parent.ino, name)
        if found is None:
            raise NotFoundError(name)
        return found

    def _span(self, node: Node, offset: int, size: int) -> tuple[ShardInfo, int, int] | None:
        """(shard, start, end) of a read in shard offsets, or None when it reads nothing."""
        if node.is_dir:
            raise IsADirError(str(node.ino))
        end = min(offset + size, node.size)
        if offset >= end:
            return None
        return self.view.shards[node.shard], node.offset + offset, node.offset + end

    def _fetch(self, node: Node, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of a file's shard, or of the shard's decoded space."""
        shard = self.view.shards[node.shard]
        if is_decoded(start):
            return self.decoded.read(node.shard, shard, start, end)
        return self.reader.read(shard, start, end, node.offset + node.size)

    def read_node(self, node: Node, offset: int, size: int) -> bytes:
        """Bytes of a file by node; may wait on the store."""
        if node.shard < 0:
            return self._virtual_read(node, offset, size)
        span = self._span(node, offset, size)
        if span is None:
            return b""
        self.hints.note_read(node)
        data = self._fetch(node, span[1], span[2])
        self._served(node, len(data))
        if offset + len(data) >= node.size:
            self.hints.note_done(node.ino)
        return data

    def read_node_local(self, node: Node, offset: int, size: int) -> bytes | None:
        """Like ``read_node`` when the bytes are already local, else None (never waits)."""
        if node.shard < 0:
            return self._virtual_read(node, offset, size)
        span = self._span(node, offset, size)
        if span is None:
            return b""
        if is_decoded(span[1]):
            data = self.decoded.read_local(node.shard, span[1], span[2], span[0])
        else:
            data = self.reader.read_local(*span)
        if data is not None:
            self.hints.note_read(node)
            self._served(node, len(data))
            if offset + len(data) >= node.size:
                self.hints.note_done(node.ino)
        return data

    def opened_in_kernel(self, inodes: Iterable[int]) -> None:
        """Readers opened files whose whole bytes the kernel's page cache holds (pushed, or
        read before): no READ will come, so these are their reads as far as the hint goes."""
        self.hints.note_opened(inodes)

    def _served(self, node: Node, length: int) -> None:
        self.stats.add(bytes_served=length)
        self._deliver(node)

    def _deliver(self, node: Node) -> None:
        """Count a file's bytes the first time it reaches a reader or the kernel's cache."""
        byte, bit = divmod(node.ino, 8)
        if byte < len(self.delivered) and not self.delivered[byte] & (1 << bit):
            self.delivered[byte] |= 1 << bit  # a race may count a file twice: harmless
            self.stats.add(delivered_bytes=node.size)

    @property
    def uses_block_cache(self) -> bool:
        return isinstance(self.reader, CachedReader)

    @property
    def block_size(self) -> int:
        """The block cache's block size (1 MiB without the cache)."""
        return self.reader.block_size if isinstance(self.reader, CachedReader) else 1 << 20

    def watch_local_blocks(
        self, callback: Callable[[ShardInfo, int, int, bytes | memoryview | None], None] | None
    ) -> None:
        """Have ``callback(shard, start, end, block)`` told when a block of bytes becomes
        local (once per block; ``block`` holds its bytes when they were just fetched, else
        None); None stops every such callback. Only reads through the block cache have
        blocks: the callback subscribes to the reader's ``local_blocks`` events."""
        if isinstance(self.reader, CachedReader):
            events = self.reader.local_blocks
            if callback is None:
                events.clear()
            else:
                events.subscribe(callback)

    def block_files(self, shard: ShardInfo, start: int, end: int) -> tuple[FileTable, list[Node]]:
        """Files with bytes in ``[start, end)`` of ``shard``: (wholly inside, positions
        counted from ``start``; crossing its edges)."""
        return self.view.block_files(self.view.shard_ids[shard], start, end)

    def published_block(self, node: Node) -> tuple[BlockFile, FileTable] | None:
        """The cached block holding all of ``node``, for reads answered without this core:
        its file, header verified (each read checks its chunks against the header's sums),
        and the table of every file lying wholly in it; None when
        the file is not in one cached block. The caller owns the block's descriptor. Reads
        answered that way skip the order hint, the block cache's recency and the
        statistics; the caller counts them."""
        reader, index = self.reader, self._block_of(node)
        if index is None or not isinstance(reader, CachedReader):
            return None
        size = reader.block_size
        shard = self.view.shards[node.shard]
        found = reader.block_file(shard, index)
        if found is None:
            return None
        start = index * size
        files, _ = self.view.block_files(node.shard, start, min(start + size, shard.size))
        return found, files

    def _block_of(self, node: Node) -> int | None:
        """The index of the one cache block holding all of ``node``'s bytes, if one does."""
        reader = self.reader
        if node.shard < 0 or is_decoded(node.offset) or not isinstance(reader, CachedReader):
            return None
        index = node.offset // reader.block_size
        if node.size <= 0 or (node.offset + node.size - 1) // reader.block_size != index:
            return None
        return index

    def wait_block(self, node: Node) -> bool:
        """Wait while this process fetches the cache blocks holding all of ``node``: the one
        block, or the two a file across a block's end lies in (a readahead GET, or another
        read's miss), each up to the store's read timeout; whether any was being fetched. A
        block stored is told to ``watch_local_blocks``' listener before this returns."""
        reader = self.reader
        if not isinstance(reader, CachedReader):
            return False
        first = self._block_of(node)
        indexes = [first] if first is not None else self._two_blocks_of(node)
        skey = reader.shard_key(self.view.shards[node.shard]) if indexes else ""
        waited = False
        for index in indexes:
            if reader.coming.expected(skey, index):
                reader.coming.wait(skey, index)
                waited = True
            elif reader.cache.wait_flight(BlockKey(skey, index), reader.coming.timeout):
                waited = True
        return waited

    def _two_blocks_of(self, node: Node) -> list[int]:
        """The two cache blocks a file crossing a block's end lies in (the compiled path
        answers its READs from both); none for any other file."""
        size = self.block_size
        if node.shard < 0 or is_decoded(node.offset) or node.size <= 0:
            return []
        first, last = node.offset // size, (node.offset + node.size - 1) // size
        return [first, last] if last == first + 1 else []

    def block_file(self, shard: ShardInfo, start: int) -> BlockFile | None:
        """``published_block``'s file for the block starting at shard offset ``start`` (the
        pusher's, whose files it knows): None when ``start`` is no block's start or the
        block is not cached. The caller owns the descriptor."""
        reader = self.reader
        if not isinstance(reader, CachedReader) or start % reader.block_size:
            return None
        return reader.block_file(shard, start // reader.block_size)

    def block_used(self, shard: int, index: int) -> None:
        """Reads of files in block ``index`` of shard ``shard`` were answered without this
        core (``published_block``): the block cache counts them for its recency."""
        if isinstance(self.reader, CachedReader):
            self.reader.block_used(self.view.shards[shard], index)

    def block_local(
        self, shard: ShardInfo, start: int, buffer: bytearray | memoryview
    ) -> memoryview | None:
        """The cached block starting at byte ``start`` of ``shard``, read into ``buffer``
        (of ``block_size`` bytes) with every chunk verified, or None (no network, no
        statistics)."""
        reader = self.reader
        if not isinstance(reader, CachedReader):
            return None
        return reader.verified_block(shard, start // reader.block_size, buffer)

    def blocks_let_go(self) -> None:
        """A holder of fetched blocks in memory (the kernel pusher) let one go: readahead
        waiting for landing room looks again at once."""
        if isinstance(self.reader, CachedReader):
            self.reader.cache.landing_released()

    def file_bytes_local(self, node: Node) -> bytes | None:
        """A whole file if its bytes are in the block cache, or decoded in memory (no
        network, no statistics)."""
        if node.shard < 0:
            return None
        if is_decoded(node.offset):
            shard = self.view.shards[node.shard]
            data = self.decoded.read_local(node.shard, node.offset, node.offset + node.size, shard)
        elif not isinstance(self.reader, CachedReader):
            return None
        else:
            data = _cached_span(self.reader, self.view.shards[node.shard], node)
        if data is not None:
            self._deliver(node)
        return data

    def open_node(self, node: Node) -> int:
        """A handle whose reads keep a window of the file (for reads without the cache)."""
        if node.is_dir:
            raise IsADirError(str(node.ino))
        handle = next(self._next_handle)
        with self._handles_lock:
            self._handles[handle] = _OpenFile(node)
        return handle

    def release(self, handle: int) -> None:
        with self._handles_lock:
            self._handles.pop(handle, None)

    def read(self, handle: int, offset: int, size: int) -> bytes:
        with self._handles_lock:
            opened = self._handles.get(handle)
        if opened is None:
            raise NotFoundError(f"file handle {handle}")
        node = opened.node
        end = min(offset + size, node.size)
        if offset >= end:
            return b""
        if node.shard < 0:
            return self._virtual_read(node, offset, size)
        self.hints.note_read(node)
        with opened.lock:
            data = self._read_window(opened, offset, end, size)
        self._served(node, len(data))
        if offset + len(data) >= node.size:
            self.hints.note_done(node.ino)
        return data

    def _read_window(self, opened: _OpenFile, offset: int, end: int, size: int) -> bytes:
        """Serve from the handle's window, refilling it from the reader when needed."""
        node = opened.node
        start_in_window = offset - opened.window_start
        if start_in_window >= 0 and end - opened.window_start <= len(opened.window):
            return opened.window[start_in_window : start_in_window + (end - offset)]
        if node.size <= self.config.whole_file_limit:
            window_start, window_end = 0, node.size
        else:
            window_start = offset
            window_end = min(node.size, offset + max(size, self.config.window))
        data = self._fetch(node, node.offset + window_start, node.offset + window_end)
        opened.window_start, opened.window = window_start, data
        return data[offset - window_start : end - window_start]

    @staticmethod
    def node_xattrs(node: Node) -> list[str]:
        return list(_FILE_XATTRS) if node.kind == MemberKind.FILE and node.shard >= 0 else []

    def node_xattr(self, node: Node, name: str, where: str = "") -> bytes:
        if node.kind == MemberKind.FILE and node.shard >= 0:
            if name == XATTR_SHARD:
                return self.view.shards[node.shard].name.encode()
            if name == XATTR_OFFSET:  # a decoded file: where its unit's bytes start
                offset = node.offset
                if is_decoded(offset):
                    start, unit = self.view.unit_at(node.shard, offset, state=True)
                    offset = raw_span(unit, offset - start, offset - start + node.size)[0]
                return str(offset).encode()
        raise NoSuchAttributeError(f"{where or node.ino}: no attribute {name}")

    def statfs(self) -> dict[str, int]:
        report = self.view.report
        block = 4096
        return {
            "f_bsize": block,
            "f_frsize": block,
            "f_blocks": (report.bytes + block - 1) // block,
            "f_bfree": 0,
            "f_bavail": 0,
            "f_files": report.files + report.directories,
            "f_ffree": 0,
            "f_favail": 0,
            "f_namemax": 1024,
        }


def _cached_span(reader: CachedReader, shard: ShardInfo, node: Node) -> bytes | None:
    """A file's bytes from the block cache, block by block when it crosses block edges (a
    kernel push of a file whose blocks are all cached), or None if any part is missing."""
    size = reader.block_size
    start, end = node.offset, node.offset + node.size
    parts: list[bytes] = []
    for edge in range(start - start % size, end, size):
        part = reader.read_local(shard, max(start, edge), min(end, edge + size), quiet=True)
        if part is None:
            return None
        parts.append(part)
    return parts[0] if len(parts) == 1 else b"".join(parts)  # no copy of a lone part

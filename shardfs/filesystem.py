"""The filesystem core: lookups, attributes, directory listings and reads, without FUSE.

Tests drive this class directly; ``fuse.operations`` is a thin adapter over it.
"""

from __future__ import annotations

import itertools
import logging
import os
import stat
import threading
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import NamedTuple

from . import placement
from .config import MountConfig, ReadConfig
from .errors import (
    IsADirError,
    NoSuchAttributeError,
    NotADirError,
    NotFoundError,
    UsageError,
)
from .readahead import HintedOrder
from .reader import CachedReader, RangeReader
from .stats import Stats
from .store import ShardInfo
from .tar import MemberKind
from .views import ROOT_INO, Node, View, st_mode

log = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class Owner:
    """Who owns every file and folder, and their permission bits.

    uid, gid: default the mounting process's. file_mode, dir_mode: permission bits of
    every regular file and every folder; None keeps ``views.st_mode``'s rule (read-only
    for everyone, plus a file's own execute bits). Symlinks always show 0o777."""

    uid: int = field(default_factory=os.getuid)
    gid: int = field(default_factory=os.getgid)
    file_mode: int | None = None
    dir_mode: int | None = None

    @classmethod
    def of(cls, config: MountConfig) -> Owner:
        return cls(
            uid=os.getuid() if config.uid is None else config.uid,
            gid=os.getgid() if config.gid is None else config.gid,
            file_mode=config.file_mode,
            dir_mode=config.dir_mode,
        )

    def mode_rule(self) -> Callable[[int, int], int]:
        """``(kind, stored mode) -> st_mode``: ``views.st_mode`` with the overrides."""
        if self.file_mode is None and self.dir_mode is None:
            return st_mode
        file_mode, dir_mode = self.file_mode, self.dir_mode

        @lru_cache(maxsize=256)
        def rule(kind: int, mode: int) -> int:
            shown = st_mode(kind, mode)
            if dir_mode is not None and stat.S_ISDIR(shown):
                return stat.S_IFDIR | dir_mode
            if file_mode is not None and stat.S_ISREG(shown):
                return stat.S_IFREG | file_mode
            return shown

        return rule


@dataclass
class _OpenFile:
    """An open file: the node plus the last window of its bytes fetched from the store."""

    node: Node
    window_start: int = 0
    window: bytes = b""
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class _Table:
    """The placement table of the view, built once: its bytes and the row of each inode."""

    fingerprint: str
    data: bytes
    rows: int
    row_of_ino: array[int]  # 'i': table row of each inode, -1 for none
    shard_ids: list[int]  # table shard id -> view shard id
    shards: array[int]  # table shard id of each row
    offsets: array[int]
    sizes: array[int]


FILES_AHEAD = 128
"""Hint positions whose files are queued ahead of the furthest read: while the cache is
full they are fetched as ranges (at most ``files_ahead.DEFAULT_BUDGET`` bytes held)."""


@dataclass
class _ActiveHint:
    """An order hint being followed: each row's position in it, and the block plan."""

    epoch: int
    position_of_row: array[int]  # 'i': first position of each row in the hint, -1 if absent
    plan: HintedOrder
    rows: Sequence[int]  # the hint's rows, in reading order
    files_queued: int = 0  # hint positions below this had their files queued
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class _HintParts:
    """A hint whose chunks are still arriving."""

    buffer: bytearray
    offsets: set[int] = field(default_factory=set)
    received: int = 0


_HINT_PARTS = 4  # hints being received at once (one per sender, normally one)


class ShardFileSystem:
    """A read-only tree over a materialised view, reading bytes through a RangeReader.

    Two virtual files sit at the root, found by lookup and never listed (see
    ``shardfs.placement``): the placement table, and the hint file that takes the order in
    which this node will read, which the core then reads ahead in."""

    BLOCK_SIZE = 1 << 17  # st_blksize: the I/O size readers are told to prefer

    def __init__(
        self,
        view: View,
        reader: RangeReader,
        config: ReadConfig | None = None,
        stats: Stats | None = None,
        *,
        owner: Owner | None = None,
    ) -> None:
        self.view = view
        self.reader = reader
        self.config = config or ReadConfig()
        self.stats = stats if stats is not None else Stats()
        self._handles: dict[int, _OpenFile] = {}
        self._next_handle = itertools.count(1)
        self._handles_lock = threading.Lock()
        owner = owner if owner is not None else Owner()
        self.uid = owner.uid
        self.gid = owner.gid
        self._mode = owner.mode_rule()
        self._mount_time = int(time.time())
        self.table_ino = view.max_ino + 1
        self.hint_ino = view.max_ino + 2
        self._table: _Table | None = None
        self._table_lock = threading.Lock()
        self._hint: _ActiveHint | None = None
        self._hint_parts: dict[bytes, _HintParts] = {}
        self._hint_lock = threading.Lock()
        # One bit per inode: files already served or pushed (for egress amplification).
        self._delivered = bytearray(view.max_ino // 8 + 1)

    # -- the placement table and the order hint -------------------------------------------

    def _virtual(self, ino: int) -> Node | None:
        if ino == self.table_ino:
            size = len(self.table().data)
        elif ino != self.hint_ino:
            return None
        else:
            size = 0
        return Node(ino, MemberKind.FILE, -1, 0, size, 0o444, self._mount_time, "")

    def is_virtual(self, node: Node) -> bool:
        return node.ino in (self.table_ino, self.hint_ino)

    def table(self) -> _Table:
        """The placement table, built at its first use and kept for the mount's life."""
        with self._table_lock:
            if self._table is None:
                started = time.monotonic()
                self._table = self._build_table()
                log.info(
                    "placement table: %d rows, %d bytes in %.2f s",
                    self._table.rows,
                    len(self._table.data),
                    time.monotonic() - started,
                )
            return self._table

    def _build_table(self) -> _Table:
        view = self.view
        shard_ids = sorted(view.shards)
        dense = {sid: i for i, sid in enumerate(shard_ids)}
        row_of_ino = array("i", [-1]) * (view.max_ino + 1)
        inos = array("i")
        rows = []
        for path, node in view.files():
            inos.append(node.ino)
            rows.append((path, dense[node.shard], node.offset, node.size))
        for row, ino in enumerate(inos):
            row_of_ino[ino] = row
        names = [view.shards[sid].name for sid in shard_ids]
        fingerprint, data = placement.encode_table(names, rows)
        return _Table(
            fingerprint,
            data,
            len(rows),
            row_of_ino,
            shard_ids,
            array("i", (shard for _, shard, _, _ in rows)),
            array("q", (offset for _, _, offset, _ in rows)),
            array("q", (size for _, _, _, size in rows)),
        )

    def take_hint_chunk(self, chunk: bytes) -> None:
        """One ioctl of an order hint (``placement.hint_chunks``). UsageError (EINVAL) when
        the hint is for another table or malformed; the last chunk starts following it."""
        try:
            hint_id, total, offset, data = placement.parse_chunk(chunk)
        except ValueError as exc:
            raise UsageError(f"order hint refused: {exc}") from None
        table = self.table()
        if offset == 0:
            fingerprint = placement.hint_fingerprint(data)
            if fingerprint != table.fingerprint:
                raise UsageError(
                    f"order hint refused: it is for table {fingerprint}, "
                    f"this mount's is {table.fingerprint}"
                )
        with self._hint_lock:
            parts = self._hint_parts.get(hint_id)
            if parts is None:
                if offset != 0:
                    raise UsageError("order hint refused: a chunk came before its first one")
                while len(self._hint_parts) >= _HINT_PARTS:
                    self._hint_parts.pop(next(iter(self._hint_parts)))
                parts = self._hint_parts[hint_id] = _HintParts(bytearray(total))
            if len(parts.buffer) != total:
                raise UsageError("order hint refused: chunks disagree on its length")
            if offset not in parts.offsets:
                parts.offsets.add(offset)
                parts.received += len(data)
                parts.buffer[offset : offset + len(data)] = data
            if parts.received < total:
                return
            del self._hint_parts[hint_id]
        self.take_hint(bytes(parts.buffer))

    def take_hint(self, payload: bytes) -> None:
        """Follow a whole order hint: UsageError (EINVAL) if it is not one for this table.
        The block plan is made on a thread of its own (a second for 1.28M rows)."""
        table = self.table()
        try:
            hint = placement.decode_hint(payload)
        except ValueError as exc:
            raise UsageError(f"order hint refused: {exc}") from None
        if hint.fingerprint != table.fingerprint:
            raise UsageError(
                f"order hint refused: it is for table {hint.fingerprint}, "
                f"this mount's is {table.fingerprint}"
            )
        if hint.rows and not 0 <= min(hint.rows) <= max(hint.rows) < table.rows:
            raise UsageError("order hint refused: it names rows the table does not have")
        self.stats.add(hints_taken=1)
        threading.Thread(
            target=self._follow, args=(table, hint), name="shardfs-hint", daemon=True
        ).start()

    def follow_hint(self, hint: placement.Hint) -> None:
        """Follow a decoded, checked hint now (on this thread)."""
        self._follow(self.table(), hint)

    def _follow(self, table: _Table, hint: placement.Hint) -> None:
        reader = self.reader
        block_size = reader.block_size if isinstance(reader, CachedReader) else 1 << 20
        position_of_row = array("i", [-1]) * table.rows
        blocks: list[tuple[int, int]] = []
        first_use: list[int] = []
        seen: set[tuple[int, int]] = set()
        shards, offsets, sizes = table.shards, table.offsets, table.sizes
        for position, row in enumerate(hint.rows):
            if position_of_row[row] >= 0:
                continue
            position_of_row[row] = position
            offset = offsets[row]
            shard = shards[row]
            for index in range(
                offset // block_size, (offset + max(sizes[row], 1) - 1) // block_size + 1
            ):
                if (shard, index) not in seen:
                    seen.add((shard, index))
                    blocks.append((shard, index))
                    first_use.append(position)
        plan = HintedOrder(blocks, first_use)
        active = self._hint = _ActiveHint(hint.epoch, position_of_row, plan, hint.rows)
        log.info(
            "following an order hint: epoch %d, %d reads over %d blocks",
            hint.epoch,
            len(hint.rows),
            len(blocks),
        )
        if isinstance(reader, CachedReader):
            reader.follow_hint = True
        self._queue(table, plan.start())
        self._queue_files(table, active, 0)

    def _queue(self, table: _Table, blocks: list[tuple[int, int]]) -> None:
        if blocks and isinstance(self.reader, CachedReader):
            shards = self.view.shards
            ids = table.shard_ids
            self.reader.prefetch_blocks([(shards[ids[shard]], index) for shard, index in blocks])

    def _note_read(self, node: Node) -> None:
        """A read of ``node``: count it if hinted, and move the hint's window forward."""
        hint = self._hint
        table = self._table
        if hint is None or table is None or node.ino >= len(table.row_of_ino):
            return
        row = table.row_of_ino[node.ino]
        if row < 0:
            return
        position = hint.position_of_row[row]
        if position < 0:
            return
        self.stats.add(hinted_reads=1)
        if position > hint.plan.furthest:
            self._queue(table, hint.plan.reached(position))
        if position + FILES_AHEAD > hint.files_queued:
            self._queue_files(table, hint, position)

    def _queue_files(self, table: _Table, hint: _ActiveHint, position: int) -> None:
        """Queue the files the readers will ask for next, ``FILES_AHEAD`` hint positions
        past ``position``: while the cache is full, the reader fetches them as ranges."""
        reader = self.reader
        if not isinstance(reader, CachedReader) or not reader.wants_files_ahead():
            return  # later reads ask again: the window has not moved
        with hint.lock:
            first = max(hint.files_queued, position + 1 if position else 0)
            upto = min(len(hint.rows), position + FILES_AHEAD)
            if upto <= first:
                return
            hint.files_queued = upto
        shards, ids = self.view.shards, table.shard_ids
        extents = []
        for row in hint.rows[first:upto]:
            start = table.offsets[row]
            shard = shards[ids[table.shards[row]]]
            extents.append((shard, start, start + table.sizes[row]))
        reader.prefetch_files(extents)

    def _virtual_read(self, node: Node, offset: int, size: int) -> bytes:
        if node.ino == self.table_ino:
            return self.table().data[offset : offset + size]
        return b""

    def stat_fields(self, node: Node) -> tuple[int, int, int, int, int]:
        """(mode, link count, size, 512-byte blocks, mtime) of a node; with ``uid``,
        ``gid`` and ``BLOCK_SIZE`` that is everything ``stat`` shows."""
        size = node.size
        return (
            self._mode(node.kind, node.mode),
            2 if node.is_dir else 1,
            size,
            (size + 511) // 512,
            node.mtime or self._mount_time,
        )

    def listing(self, folder: Node, full_from: int = 0) -> list[Entry]:
        """Every name of ``folder`` with what ``stat`` shows of it, "." and ".." first, in
        listing order. Folders and files of at least ``full_from`` bytes are marked full (a
        listing may hand the kernel their attributes); "." and ".." never are."""
        if not folder.is_dir:
            raise NotADirError(f"inode {folder.ino}")
        mount_time = self._mount_time
        directory = int(MemberKind.DIRECTORY)
        mode_of = self._mode
        dir_mode = mode_of(directory, 0)
        entries = [
            Entry(b".", folder.ino, dir_mode, 2, 0, 0, 0, False),
            Entry(b"..", self.view.parent_of(folder.ino), dir_mode, 2, 0, 0, 0, False),
        ]
        append = entries.append
        # The fields of ``stat_fields``, computed inline: a call per entry costs a tenth of
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

    def read_node(self, node: Node, offset: int, size: int) -> bytes:
        """Bytes of a file by node; may wait on the store."""
        if node.shard < 0:
            return self._virtual_read(node, offset, size)
        span = self._span(node, offset, size)
        if span is None:
            return b""
        self._note_read(node)
        data = self.reader.read(*span, node.offset + node.size)
        self._served(node, len(data))
        return data

    def read_node_local(self, node: Node, offset: int, size: int) -> bytes | None:
        """Like ``read_node`` when the bytes are already local, else None (never waits)."""
        if node.shard < 0:
            return self._virtual_read(node, offset, size)
        span = self._span(node, offset, size)
        if span is None:
            return b""
        data = self.reader.read_local(*span)
        if data is not None:
            self._note_read(node)
            self._served(node, len(data))
        return data

    def _served(self, node: Node, length: int) -> None:
        self.stats.add(bytes_served=length)
        self._deliver(node)

    def _deliver(self, node: Node) -> None:
        """Count a file's bytes the first time it reaches a reader or the kernel's cache."""
        byte, bit = divmod(node.ino, 8)
        if byte < len(self._delivered) and not self._delivered[byte] & (1 << bit):
            self._delivered[byte] |= 1 << bit  # a race may count a file twice: harmless
            self.stats.add(delivered_bytes=node.size)

    @property
    def uses_block_cache(self) -> bool:
        return isinstance(self.reader, CachedReader)

    def watch_local_blocks(
        self, callback: Callable[[ShardInfo, int, int, bytes | None], None] | None
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

    def files_within(self, shard: ShardInfo, start: int, end: int) -> list[Node]:
        """Files lying wholly inside bytes ``[start, end)`` of ``shard``."""
        return self.view.files_within(self.view.shard_ids[shard], start, end)

    def file_bytes_local(self, node: Node) -> bytes | None:
        """A whole file if its bytes are in the block cache (no network, no statistics)."""
        if not isinstance(self.reader, CachedReader) or node.shard < 0:
            return None
        shard = self.view.shards[node.shard]
        data = self.reader.read_local(shard, node.offset, node.offset + node.size, quiet=True)
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
        self._note_read(node)
        with opened.lock:
            data = self._read_window(opened, offset, end, size)
        self._served(node, len(data))
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
        shard = self.view.shards[node.shard]
        data = self.reader.read(
            shard, node.offset + window_start, node.offset + window_end, node.offset + node.size
        )
        opened.window_start, opened.window = window_start, data
        return data[offset - window_start : end - window_start]

    @staticmethod
    def node_xattrs(node: Node) -> list[str]:
        return list(_FILE_XATTRS) if node.kind == MemberKind.FILE and node.shard >= 0 else []

    def node_xattr(self, node: Node, name: str, where: str = "") -> bytes:
        if node.kind == MemberKind.FILE and node.shard >= 0:
            if name == XATTR_SHARD:
                return self.view.shards[node.shard].name.encode()
            if name == XATTR_OFFSET:
                return str(node.offset).encode()
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

"""The placement table and the order hint (``shardfs.placement``): the table lists where
every file lies, built at its first read; a hint is the order in which this node will read
those files, which the reader then fetches ahead of the reads, block by block and file by
file."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from .. import placement
from ..config import format_bytes
from ..errors import UsageError
from ..formats.codecs import raw_placement
from ..formats.units import DecodedSpace, is_decoded
from ..read.readahead import HINT_WINDOW, HintedOrder
from ..read.reader import CachedReader
from ..read.seam import RangeReader
from ..stats import Stats
from ..views.nodes import Node
from ..views.view import View

log = logging.getLogger(__name__)


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
class _Retirement:
    """For a cache smaller than the data: the hinted rows of each block not yet read, so
    that a block whose files were all read gives its room to the next ones at once."""

    block_of: dict[tuple[int, int], int]  # (table shard, block index) -> plan block
    unread: array[int]  # 'i': per plan block, hinted rows in it not read yet
    read: bytearray  # per table row: read (or opened once in the kernel's page cache)


@dataclass
class _ActiveHint:
    """An order hint being followed: each row's position in it, and the block plan."""

    epoch: int
    position_of_row: array[int]  # 'i': first position of each row in the hint, -1 if absent
    plan: HintedOrder
    rows: Sequence[int]  # the hint's rows, in reading order
    retirement: _Retirement | None = None
    files_queued: int = 0  # hint positions below this had their files queued
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Per table row: a reader reached it (a READ came, or its open in the kernel was
    # noted). Files ahead are queued past the position last noted; a note that comes late
    # (opens are taken in batches) must not queue a file a read already fetched itself.
    reached: bytearray = field(init=False)

    def __post_init__(self) -> None:
        self.reached = bytearray(len(self.position_of_row))


@dataclass
class _HintParts:
    """A hint whose chunks are still arriving."""

    buffer: bytearray
    offsets: set[int] = field(default_factory=set)
    received: int = 0


_HINT_PARTS = 4  # hints being received at once (one per sender, normally one)


_STREAM_ROOM = 0.85
"""Of the cache's blocks, what a streaming hint may fill: eviction frees a tenth at a time."""
_MIN_WINDOW = 4
"""Blocks ahead of the readers below which the cache cannot stream a hint's order."""


def _most_live(first_use: list[int], last_use: list[int], positions: int) -> int:
    """The most blocks between their first and their last use at any one position."""
    steps = [0] * (positions + 1)
    for first, last in zip(first_use, last_use, strict=True):
        steps[first] += 1
        steps[last + 1] -= 1
    return max(itertools.accumulate(steps), default=0)


def _block_range(offset: int, size: int, block_size: int) -> range:
    """The blocks a file of ``size`` bytes at shard ``offset`` lies in."""
    return range(offset // block_size, (offset + max(size, 1) - 1) // block_size + 1)


class OrderHints:
    """The placement table of one view, and the order hint being followed over it."""

    def __init__(self, view: View, reader: RangeReader, stats: Stats) -> None:
        self.view = view
        self.reader = reader
        self.stats = stats
        self._table: _Table | None = None
        self._table_lock = threading.Lock()
        self._hint: _ActiveHint | None = None
        self._hint_parts: dict[bytes, _HintParts] = {}
        self._hint_lock = threading.Lock()
        # One byte per inode, 1 for the files of the hint followed: their reads must reach
        # note_read and note_done, or note_opened (the compiled FUSE path queues its READs
        # that reach such a file's end, as it does their opens). Never resized: the FUSE
        # side shares it.
        self.watched = bytearray(view.max_ino + 1)

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
        spaces: dict[int, DecodedSpace] = {}
        for path, node in view.files():
            inos.append(node.ino)
            offset, size = node.offset, node.size
            if is_decoded(offset):  # placed where its unit's bytes are stored
                if node.shard not in spaces:
                    spaces.clear()  # files come in shard order: one shard's units at a time
                    spaces[node.shard] = view.units_of(node.shard)
                offset, end = raw_placement(spaces[node.shard], node.offset, node.size)
                size = end - offset
            rows.append((path, dense[node.shard], offset, size))
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

    def take_chunk(self, chunk: bytes) -> None:
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
        self.take(bytes(parts.buffer))

    def take(self, payload: bytes) -> None:
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

    def follow(self, hint: placement.Hint) -> None:
        """Follow a decoded, checked hint now (on this thread)."""
        self._follow(self.table(), hint)

    def _follow(self, table: _Table, hint: placement.Hint) -> None:
        reader = self.reader
        block_size = self._block_size()
        position_of_row = array("i", [-1]) * table.rows
        blocks: list[tuple[int, int]] = []
        first_use: list[int] = []
        last_use: list[int] = []
        block_of: dict[tuple[int, int], int] = {}
        unread = array("i")
        shards, offsets, sizes = table.shards, table.offsets, table.sizes
        for position, row in enumerate(hint.rows):
            if position_of_row[row] >= 0:
                continue
            position_of_row[row] = position
            shard = shards[row]
            for index in _block_range(offsets[row], sizes[row], block_size):
                j = block_of.get((shard, index))
                if j is None:
                    j = block_of[(shard, index)] = len(blocks)
                    blocks.append((shard, index))
                    first_use.append(position)
                    last_use.append(position)
                    unread.append(0)
                unread[j] += 1
                last_use[j] = position
        window, retirement, run = HINT_WINDOW, None, 1
        if isinstance(reader, CachedReader):
            reader.follow_hint = True
            reader.new_order()
            room = int(reader.cache_blocks() * _STREAM_ROOM)
            live = _most_live(first_use, last_use, len(hint.rows))
            small = not reader.cache_holds_dataset()
            # Streaming: the blocks being read and a window ahead fit the cache at once.
            reader.streaming_hint = small and live + _MIN_WINDOW <= room
            if reader.streaming_hint:
                window = min(HINT_WINDOW, room - live)
                retirement = _Retirement(block_of, unread, bytearray(table.rows))
            if not small:  # every block is kept: a block's followers in its shard come with it
                run = reader.hinted_run()
            if small and not reader.streaming_hint:
                need = -(-(live + _MIN_WINDOW) * reader.block_size // _STREAM_ROOM)
                log.warning(
                    "order hint: the readers use up to %d blocks at once and the cache holds "
                    "%d: files are fetched one by one as ranges, which is slower; a cache of "
                    "%s, or a sampler mixing fewer shards at a time, streams whole blocks",
                    live,
                    reader.cache_blocks(),
                    format_bytes(int(need)),
                )
        plan = HintedOrder(blocks, first_use, window, run=run)
        active = _ActiveHint(hint.epoch, position_of_row, plan, hint.rows, retirement)
        self._watch(table, position_of_row)
        self._hint = active
        log.info(
            "following an order hint: epoch %d, %d reads over %d blocks, %d ahead%s",
            hint.epoch,
            len(hint.rows),
            len(blocks),
            window,
            ", read blocks retired" if retirement else "",
        )
        self._queue(table, plan.start())
        self._queue_files(table, active, 0)

    def _queue(self, table: _Table, blocks: list[tuple[int, int]]) -> None:
        if blocks and isinstance(self.reader, CachedReader):
            shards = self.view.shards
            ids = table.shard_ids
            self.reader.prefetch_blocks([(shards[ids[shard]], index) for shard, index in blocks])

    def _watch(self, table: _Table, position_of_row: array[int]) -> None:
        """Mark the hint's files in ``watched`` (one copy of the whole table, so a reader
        of it sees each byte old or new, never cleared in between)."""
        watched = bytearray(len(self.watched))
        for ino, row in enumerate(table.row_of_ino):
            if row >= 0 and position_of_row[row] >= 0:
                watched[ino] = 1
        self.watched[:] = watched

    def _hinted(self, ino: int) -> tuple[_ActiveHint, _Table, int, int] | None:
        """(hint, table, row, position) of inode ``ino`` in the hint followed, if in it."""
        hint = self._hint
        table = self._table
        if hint is None or table is None or ino >= len(table.row_of_ino):
            return None
        row = table.row_of_ino[ino]
        if row < 0:
            return None
        position = hint.position_of_row[row]
        return None if position < 0 else (hint, table, row, position)

    def note_read(self, node: Node, *, count: bool = True) -> None:
        """A read of ``node``: count it if hinted (unless the compiled path answers it and
        counts it), and move the hint's window forward."""
        found = self._hinted(node.ino)
        if found is not None:
            hint, table, row, position = found
            if count:
                self.stats.add(hinted_reads=1)
            hint.reached[row] = 1  # before the read looks for its bytes
            self._advance(hint, table, row, position)

    def note_done(self, ino: int) -> None:
        """A read of inode ``ino`` reached its end. With a cache smaller than the data, a
        block whose hinted files are all done is retired."""
        found = self._hinted(ino)
        if found is not None:
            hint, table, row, _ = found
            self._retire_row(hint, table, row)

    def note_opened(self, inodes: Iterable[int]) -> None:
        """Readers opened these files, whose whole bytes the kernel holds (no READ will
        come), or read them to their end through the compiled FUSE path's READs: each
        counts as reached (``note_read``) and done (``note_done``), and the hint's
        window moves once for them all. The opens come in batches (of 50 ms, taken by the
        compiled FUSE path's thread); moving from the batch's nearest to its furthest
        position queues what a move per open would, as what is queued only ever grows."""
        hint, table = self._hint, self._table
        if hint is None or table is None:
            return
        row_of_ino, position_of_row, reached = table.row_of_ino, hint.position_of_row, hint.reached
        inodes_known = len(row_of_ino)
        rows = []
        nearest = furthest = (-1, -1)  # (position, row)
        for ino in inodes:
            row = row_of_ino[ino] if ino < inodes_known else -1
            position = position_of_row[row] if row >= 0 else -1
            if position < 0:
                continue
            reached[row] = 1
            rows.append(row)
            if len(rows) == 1 or position < nearest[0]:
                nearest = (position, row)
            furthest = max(furthest, (position, row))
        if not rows:
            return
        reader = self.reader
        if isinstance(reader, CachedReader) and reader.holds_files_ahead:
            shards, ids, offsets = self.view.shards, table.shard_ids, table.offsets
            reader.files_opened([  # what was fetched ahead of them goes
                (shards[ids[table.shards[row]]], offsets[row], offsets[row] + table.sizes[row])
                for row in rows
            ])  # fmt: skip
        if hint.retirement is not None:  # first: what the window's move queues takes their room
            for row in rows:
                self._retire_row(hint, table, row)
        self._advance(hint, table, nearest[1], nearest[0])
        if furthest[0] > nearest[0]:
            self._advance(hint, table, furthest[1], furthest[0])

    def _retire_row(self, hint: _ActiveHint, table: _Table, row: int) -> None:
        """Row ``row`` of the hint is read: a cache smaller than the data retires each block
        whose hinted rows are now all read."""
        retirement = hint.retirement
        if retirement is None or retirement.read[row]:
            return
        shard = table.shards[row]
        done = []
        with hint.lock:
            if retirement.read[row]:
                return
            retirement.read[row] = 1
            for index in _block_range(table.offsets[row], table.sizes[row], self._block_size()):
                j = retirement.block_of.get((shard, index))
                if j is not None:
                    retirement.unread[j] -= 1
                    if retirement.unread[j] == 0:
                        done.append(index)
        if done and isinstance(self.reader, CachedReader):
            info = self.view.shards[table.shard_ids[shard]]
            self.reader.retire_blocks([(info, index) for index in done])

    def _block_size(self) -> int:
        reader = self.reader
        return reader.block_size if isinstance(reader, CachedReader) else 1 << 20

    def _advance(self, hint: _ActiveHint, table: _Table, _row: int, position: int) -> None:
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
        reached = hint.reached
        for row in hint.rows[first:upto]:
            if reached[row]:
                continue  # read already (it fetched its own bytes): not fetched twice
            start = table.offsets[row]
            shard = shards[ids[table.shards[row]]]
            extents.append((shard, start, start + table.sizes[row]))
        reader.prefetch_files(extents)

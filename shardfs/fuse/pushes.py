"""Kernel pushes: files of cached blocks put into the kernel's page cache ahead of reads."""

from __future__ import annotations

import errno
import logging
import mmap
import os
import queue
import threading
import time
from array import array
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

from ..core.filesystem import ShardFileSystem
from ..store.shards import ShardInfo
from ..views.block_files import FileTable
from ..views.view import Node
from . import binding as libfuse
from . import hot_path
from .edges import EdgeFiles

log = logging.getLogger(__name__)

_PUSH_RETRY_S = 0.05
_PUSH_RETRIES = 5
# Bytes of fetched blocks that may wait in memory for the pusher. Past that, a block is
# queued without them: its READs go to Python, which reads them from disk, and the pusher
# reads the block back whole. On two busy cores the pusher fell 8-23 blocks behind in a
# cold read: a bound of 8 8 MiB blocks sent 5-22 % of the files through Python.
_PUSH_QUEUE_BYTES = 256 << 20
Block = bytes | memoryview


class _LocalBlock(NamedTuple):
    """A block that became local, queued for its pushes."""

    shard: ShardInfo
    start: int
    end: int
    data: Block | None  # its bytes, when kept in memory
    touching: tuple[FileTable, list[Node]] | None  # core.block_files's, if looked up
    early: object  # what ``publish_early`` returned: released after the pushes


_PushItem = _LocalBlock | int | None


class KernelPusher:
    """Puts the files of each block that becomes local into the kernel's page cache.

    It listens to the reader's ``local_blocks`` events (through
    ``ShardFileSystem.watch_local_blocks``): a block is first on local disk (stored by this
    process, or hit). ``block_local`` only queues; a thread of its own then stores every
    file lying wholly in that block with FUSE_NOTIFY_STORE, so readers of those files find
    their pages cached and send no READ at all. Only inodes the kernel holds (from a lookup
    or a listing, until it gives all their lookups back with FORGET) can be stored: a file
    whose inode is not held waits, and is pushed when a listing hands the inode to the
    kernel again (after a lookup, the READ that follows takes the bytes). A file straddling
    blocks is pushed once all its blocks have passed (``edges.EdgeFiles`` holds its parts
    meanwhile).
    A block queued with its bytes is first handed to ``publish_early`` (the compiled path
    answers its files' READs from those bytes, for a reader quicker than the pushes) and
    handed to ``release`` once its pushes are done, or when it is dropped at ``stop``.
    """

    def __init__(self, core: ShardFileSystem) -> None:
        self.core = core
        self.session: libfuse.Session | None = None
        self._queue: queue.SimpleQueue[_PushItem] = queue.SimpleQueue()
        size = core.view.max_ino + 1
        # Files whose whole bytes the kernel was given (pushed, or one READ from offset 0).
        self.in_kernel = bytearray(size)
        # Inodes the kernel holds (given by lookups or READDIRPLUS, not all given back by
        # FORGET): only those can be stored.
        self._known = bytearray(size)
        # Per inode, the entries the kernel was given less those it gave back: the kernel
        # drops an inode it no longer uses (drop_caches, memory pressure) with its pages,
        # and tells of it with FORGET. Kept here, or by C (``count_in``).
        self.lookup_counts = array("I", bytes(4 * size))
        self._counts_lock = threading.Lock()
        self._count_in_c: Callable[[Sequence[int], int], None] | None = None
        # Files of local blocks that could not be pushed because their inode was unknown.
        self._waiting = bytearray(size)
        self._retries: dict[int, tuple[float, int]] = {}  # inode -> (when, attempts)
        self.retried = 0  # pushes tried again so far
        self._buffer: mmap.mmap | None = None  # a block read for its files (this thread's)
        self._batch: hot_path.BatchPush | None = None  # a block's files in one C call
        self._edges = EdgeFiles()  # parts of files crossing block edges (this thread's)
        self._abort = False
        # Told of each block pushed, with its files: the compiled path publishes its block
        # file (PushedBlocks.publish_pushed).
        # ``publish(shard, start, files, replacing, edges)``; ``replacing``: the block was
        # published early (below) and must be published again, from its block file;
        # ``edges``: the files crossing its ends.
        self.publish: Callable[[ShardInfo, int, FileTable, bool, list[Node]], None] | None = None
        # Told of each block kept in memory as it is queued, with its files: the compiled
        # path answers their READs from those bytes until the pushes are done
        # (PushedBlocks.publish_early); what it returns goes to ``release`` after them.
        # ``publish_early(shard, start, block, files, edges)``
        self.publish_early: (
            Callable[[ShardInfo, int, Block, FileTable, list[Node]], object] | None
        ) = None
        self.release: Callable[[object], None] = lambda _: None
        self._thread = threading.Thread(target=self._run, name="shardfs-push", daemon=True)

    @property
    def behind(self) -> bool:
        """Whether blocks wait in the queue: the pusher may be about to publish them."""
        return not self._queue.empty()

    @property
    def retrying(self) -> int:
        """Pushes the kernel refused so far that will be tried again shortly."""
        return len(self._retries)

    def start(self, session: libfuse.Session) -> None:
        self.session = session
        target = getattr(session, "store_target", None)  # a fake session may have none
        if target is not None:
            self._batch = hot_path.batch_push(target(), self.in_kernel, self._known, self._waiting)
        self._thread.start()

    def block_local(self, shard: ShardInfo, start: int, end: int, block: Block | None) -> None:
        if block is not None and self._queue.qsize() * len(block) >= _PUSH_QUEUE_BYTES:
            block = None  # the pusher is far behind: hold no more blocks in memory
        early, touching = None, None
        if block is not None and self.publish_early is not None and not self._abort:
            # READs that come before the pushes are answered from these bytes meanwhile
            touching = self.core.block_files(shard, start, end)
            files, edges = touching
            if len(files) or edges:  # a block of edges alone: for the files across them
                try:
                    early = self.publish_early(shard, start, block, files, edges)
                except Exception:  # READs of these files go to Python meanwhile
                    log.exception("publishing a fetched block early failed")
        self._queue.put(_LocalBlock(shard, start, end, block, touching, early))

    @property
    def known(self) -> bytearray:
        """One byte per inode, 1 while the kernel holds it (``given``, and C's LOOKUPs, set
        it; a FORGET of its last lookup clears it); shared with C, never resized."""
        return self._known

    def count_in(self, count: Callable[[Sequence[int], int], None]) -> None:
        """Let C count the lookups (``HotPath.count_lookups``; it answers FORGETs)."""
        self._count_in_c = count

    def given(self, inos: Sequence[int]) -> None:
        """A reply is about to hand the kernel an entry of each of ``inos`` (a LOOKUP's or a
        READDIRPLUS's): counted before it goes, as a FORGET of them may follow at once."""
        self._hand_over(inos, 1)

    def not_given(self, inos: Sequence[int]) -> None:
        """The reply that was to hand these entries did not reach the kernel."""
        self._hand_over(inos, -1)

    def _hand_over(self, inos: Sequence[int], delta: int) -> None:
        if self._count_in_c is not None:
            self._count_in_c(inos, delta)
        else:
            self._count(((ino, delta) for ino in inos), forget=False)

    def forgot(self, forgets: Iterable[tuple[int, int]]) -> None:
        """FORGETs (inode, lookups given back), when Python answers them (no compiled path)."""
        self._count(((ino, -n) for ino, n in forgets), forget=True)

    def _count(self, deltas: Iterable[tuple[int, int]], *, forget: bool) -> None:
        """As C's count_lookups: at 0 the kernel holds the inode no more, nor its pages."""
        counts, known, in_kernel = self.lookup_counts, self._known, self.in_kernel
        dropped = 0
        with self._counts_lock:
            for ino, delta in deltas:
                if ino >= len(counts):
                    continue
                held = counts[ino]
                n = min(held + delta, 0xFFFFFFFF)
                if n <= 0:
                    n = 0
                    known[ino] = in_kernel[ino] = 0
                    dropped += forget and held > 0
                elif delta > 0:
                    known[ino] = 1
                counts[ino] = n
        if dropped:
            self.core.stats.add(inodes_forgotten=dropped)

    def inode_known(self, ino: int, *, push_waiting: bool = True) -> None:
        """The kernel was just given ``ino`` (counted by ``given``); push the file if its
        block was waiting for it.

        ``push_waiting=False`` (a LOOKUP, which an open and a READ of the same file follow at
        once) leaves the file to that READ: a push would race it and copy the bytes twice."""
        self._known[ino] = 1
        if self._waiting[ino] and push_waiting:
            self._waiting[ino] = 0
            self._queue.put(ino)

    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=_PUSH_RETRY_S if self._retries else None)
            except queue.Empty:
                item = -1
            if item is None:
                return
            try:
                if self._abort:
                    continue
                if isinstance(item, _LocalBlock):
                    self._push_block(item)
                elif item >= 0:
                    self._push_inodes([item])
                self._push_retries()
            except Exception:
                log.exception("pushing cached files to the kernel failed")
            finally:
                if isinstance(item, _LocalBlock):
                    if item.early is not None:
                        self.release(item.early)  # after the pushes, or when dropped
                    in_memory = item.data is not None
                    item = None  # the last reference to its bytes here
                    if in_memory:
                        self.core.blocks_let_go()

    def _push_block(self, item: _LocalBlock) -> None:
        shard, start, end = item.shard, item.start, item.end
        files, edges = item.touching or self.core.block_files(shard, start, end)
        across = [node for node in edges if not self.in_kernel[node.ino]]
        block = item.data
        if block is None and len(files) + len(across) > 1:
            # one verified read of the block for all its files, into one reused buffer
            # (no fresh pages), instead of one read per file
            block = self._read_block(shard, start)
        if block is not None:
            self._push_table(files, block)
        else:  # not readable now: each file from the block cache
            self._push_inodes(list(files.inos))
        if (len(files) or edges) and self.publish is not None:
            self.publish(shard, start, files, item.early is not None, edges)
        if across and block is not None:
            for node, data in self._edges.add(across, start, block):
                self._push_table(FileTable.of([(node.ino, 0, node.size)]), data)

    def _read_block(self, shard: ShardInfo, start: int) -> memoryview | None:
        if self._buffer is None:
            self._buffer = mmap.mmap(-1, self.core.block_size)
        return self.core.block_local(shard, start, memoryview(self._buffer))

    def _push_retries(self) -> None:
        now = time.monotonic()
        due = [ino for ino, (when, _) in self._retries.items() if when <= now]
        if due:
            self.retried += len(due)
            self._push_inodes(due)

    def _push_table(self, files: FileTable, block: Block) -> None:
        """Push files of a block in memory (``files``' positions are in ``block``): in one
        C call when the compiled path is built, else file by file."""
        if self._batch is not None and not self._abort:
            self._push_batch(self._batch, files, block)
        else:
            self._push_each(files, block)

    def _push_inodes(self, inos: list[int]) -> None:
        """Push files from the block cache."""
        self._push_each(FileTable.of((ino, 0, 0) for ino in inos), None)

    def _push_each(self, files: FileTable, block: Block | None) -> None:
        """Push files one by one, taking their bytes from ``block`` when given, else from
        the block cache (positions and sizes unused)."""
        session = self.session
        assert session is not None
        pushed = 0
        for ino, position, size in files:
            if self._abort:
                break
            # A retry ends here whatever happens next; only "not there yet" renews it.
            attempts = self._retries.pop(ino, (0.0, 0))[1]
            if self.in_kernel[ino]:
                continue
            if not self._known[ino]:
                self._waiting[ino] = 1
                if not self._known[ino]:  # else the session thread marked it meanwhile
                    continue
                self._waiting[ino] = 0
            if block is not None:  # the file's bytes, given in place (no copy)
                result = session.notify_store(ino, 0, block, position, size)
            else:
                data = self.core.file_bytes_local(self.core.node(ino))
                if data is None:
                    continue
                result, size = session.notify_store(ino, 0, data), len(data)
            if result == 0:
                self.in_kernel[ino] = 1
                pushed += size
            elif result == -errno.ENOENT:
                self._not_there_yet(ino, attempts)
            else:
                log.debug("notify_store(%d) failed: %s", ino, os.strerror(-result))
        if pushed:
            self.core.stats.add(bytes_pushed=pushed)

    def _push_batch(
        self, batch: hot_path.BatchPush, files: FileTable, block: bytes | memoryview
    ) -> None:
        """``_push_each`` of a block in memory, its per-file work in C (the same rules)."""
        # A retry ends here whatever happens; only "not there yet" renews it.
        retries, attempts = self._retries, {}
        if retries:
            attempts = {ino: retries.pop(ino)[1] for ino in files.inos if ino in retries}
        pushed, results = batch.push(block, files)
        if len(results) and min(results) < 0:  # most blocks: every file pushed or waiting
            for ino, result in zip(files.inos, results, strict=True):
                if result == -errno.ENOENT:
                    self._not_there_yet(ino, attempts.get(ino, 0))
                elif result < 0:
                    log.debug("notify_store(%d) failed: %s", ino, os.strerror(-result))
        if pushed:
            self.core.stats.add(bytes_pushed=pushed)

    def _not_there_yet(self, ino: int, attempts: int) -> None:
        """The kernel has no such inode. It may still be taking it in (a reply is handled
        by the requesting process after we send it): try again shortly, a few times; then
        wait for the next lookup of the inode."""
        self.core.stats.add(pushes_refused=1)
        if attempts < _PUSH_RETRIES:
            self._retries[ino] = (time.monotonic() + _PUSH_RETRY_S, attempts + 1)
            return
        self._known[ino] = 0
        self._waiting[ino] = 1

    def stop(self) -> None:
        """Stop pushing, dropping what is queued; call while the session still answers
        reads (a push may wait for a READ of the same page to be answered)."""
        self._abort = True
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

"""The compiled hot path (``_hot.c``): READs of published files, LOOKUPs in published
folders (``_entries.c``), ioctls and forgets answered without the interpreter, and a block's
kernel pushes in one call; this module is its control plane. Of the files an order hint
follows (``OrderHints.watched``), the opens C sees and its READs reaching a file's end reach
the hint on a thread of their own (``shardfs-opened``), never on the one answering requests.

A file is *published* once the block file holding all of it was opened and its header
verified (``ShardFileSystem.published_block``): its later READs are one ``pread`` in C,
checked against that header's xxh3 sums chunk by chunk. A file lying across two blocks
is published once both are (``publish_edge``), and read from both.
Without the built extension (no compiler at install) or with ``SHARDFS_HOT_PATH=0``, every
request is answered in Python as before: same replies, more CPU per file.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import resource
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .c_memory import array_address as _buffer
from .c_memory import data_address as _data_address
from .c_memory import table_address as _address
from .c_memory import tables as _tables
from .hot_library import COUNTERS as _COUNTERS
from .hot_library import Counters as _Counters
from .hot_library import load
from .hot_reports import HotReports

if TYPE_CHECKING:
    from ..cache.block_cache import BlockFile
    from ..views.block_files import FileTable

FolderEntry = tuple[bytes, int, int, int, int]
"""A folder entry as ``HotPath.publish_folder`` takes it: name, ino, st_mode, size, mtime."""

log = logging.getLogger(__name__)

_HANDLERS = ("read", "ioctl", "forget", "forget_multi")
OPENED_TYPE = ctypes.CFUNCTYPE(None, ctypes.c_uint64)
# Threads of C's that answer READs of published files whose pages are not in memory (the
# page cache dropped, a dataset larger than RAM): they wait on the disk, so that the session
# thread never does and no such READ goes through the interpreter. Idle ones cost nothing.
DISK_READERS = 8
# Of the process's descriptor limit, the share published blocks may hold; the rest stays
# for sockets, the cache and the index. Each keeps its block file open, and once C's disk
# readers read it, the same file opened again with O_DIRECT.
PUBLISHED_FD_SHARE = 0.5
DESCRIPTORS_PER_BLOCK = 2
# Folder entries C may hold for LOOKUPs (about 60 bytes each plus the name: some 400 MB at
# most); the folders of a tree larger than that are looked up in Python past the bound.
MAX_ENTRIES = 1 << 22


def _library() -> ctypes.CDLL | None:
    if os.environ.get("SHARDFS_HOT_PATH", "1") == "0":
        return None
    return load()


def publish_limit(most: int) -> int:
    """How many blocks may be published at once: ``most``, or as many as a share of the
    descriptors this process may open (``RLIMIT_NOFILE``) holds, whichever is less."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return most
    return max(1, min(most, int(soft * PUBLISHED_FD_SHARE) // DESCRIPTORS_PER_BLOCK))


def direct_reads() -> bool:
    """Whether C's disk readers read block files with O_DIRECT: unless
    ``SHARDFS_DIRECT_READS=0`` (a cache folder on a disk that gains from the kernel's
    readahead, such as a spinning one)."""
    return os.environ.get("SHARDFS_DIRECT_READS", "1") != "0"


def available() -> bool:
    """Whether the compiled hot path is built and not switched off."""
    return _library() is not None


@dataclass(frozen=True)
class Lookups:
    """What C needs to answer LOOKUPs as ``FuseOperations.lookup`` does: the pusher's
    ``known`` table (one byte per inode, shared, never resized; None without a pusher), the
    owner every entry shows, its ``st_blksize``, how long the kernel may keep it, and how
    many entries C may hold. With ``counts`` (the pusher's ``lookup_counts``, one uint32
    per inode), C also counts the entries the kernel holds of each inode, at its LOOKUPs
    and FORGETs and at Python's replies (``HotPath.count_lookups``)."""

    known: bytearray | None
    uid: int
    gid: int
    blksize: int
    timeout: float
    max_entries: int = MAX_ENTRIES
    counts: array[int] | None = None


@dataclass(frozen=True)
class Placed:
    """Where C holds a published block: its slot, and its generation there."""

    slot: int
    generation: int


@dataclass
class InMemory:
    """A block ``HotPath.publish_memory`` answers from: C's slot, its generation there, and
    the object holding the bytes (kept alive until ``HotPath.drop``)."""

    slot: int
    generation: int
    held: object


class HotPath:
    """One mount's compiled handlers and their state.

    ``install`` puts the handlers into a libfuse operations table in place of the Python
    ones, which stay their fallback; the session's userdata must then be ``userdata``.
    The byte arrays are shared with C, not copied, and must never be resized: ``in_kernel``
    (1: the kernel holds the whole file), ``watched`` (1: the order hint follows the file)
    and ``delivered`` (one bit per inode, set when a file's bytes are first counted)."""

    def __init__(
        self,
        lib: ctypes.CDLL,
        fuse: Any,
        *,
        hint_ino: int,
        hint_cmd: int,
        inodes: int,
        in_kernel: bytearray | None,
        watched: bytearray,
        delivered: bytearray,
        opened: Callable[[Sequence[int]], None],
        used: Callable[[Any], None],
        lookups: Lookups | None = None,
    ) -> None:
        """``lookups``: also answer LOOKUPs of the folders ``publish_folder`` is given.
        ``opened(inodes)`` is told, in batches, of the opens (TCGETS) of watched files the
        kernel holds whole and of C's READs reaching a watched file's end; ``used(token)``,
        about once a SWEEP_S, of each published block that answered READs meanwhile."""
        if len(watched) < inodes or len(delivered) * 8 < inodes:
            raise ValueError("the shared tables must cover every inode")
        if in_kernel is not None and len(in_kernel) < inodes:
            raise ValueError("the shared tables must cover every inode")
        if lookups is not None and lookups.known is not None and len(lookups.known) < inodes:
            raise ValueError("the shared tables must cover every inode")
        self._lib = lib
        self._shared = (in_kernel, watched, delivered)  # kept alive while C points into them
        self._lookups = lookups
        self._reply_entry = ctypes.cast(fuse.fuse_reply_entry, ctypes.c_void_p).value
        self._opened = OPENED_TYPE(lambda ino: opened((ino,)))  # C's, when its queue is full
        self._reports = HotReports(lib, lib.hot_max_blocks(), used=used, opened=opened)
        self._tokens = self._reports.tokens  # by C's block slot
        fns = (ctypes.c_void_p * 7)(
            ctypes.cast(fuse.fuse_reply_err, ctypes.c_void_p).value,
            ctypes.cast(fuse.fuse_reply_buf, ctypes.c_void_p).value,
            ctypes.cast(fuse.fuse_reply_none, ctypes.c_void_p).value,
            ctypes.cast(fuse.fuse_req_userdata, ctypes.c_void_p).value,
            None,
            None,
            ctypes.cast(self._opened, ctypes.c_void_p).value,
        )
        self._fns = fns
        self._ctx: int | None = None
        self._final: dict[str, int] | None = None  # the counters when closed
        self._args = (hint_ino, hint_cmd, inodes, _address(in_kernel), _address(watched),
                      _address(delivered))  # fmt: skip

    @property
    def userdata(self) -> int:
        assert self._ctx is not None, "install first"
        return self._ctx

    def install(self, ops: Any) -> int:
        """Put the compiled handlers into ``ops`` (``binding.LowLevelOps``) in place of the
        Python ones set there, which become their fallbacks; returns the userdata."""
        self._fns[4] = ops.read
        self._fns[5] = ops.ioctl
        hint_ino, hint_cmd, inodes, in_kernel, watched, delivered = self._args
        ctx = self._lib.hot_new(self._fns, hint_ino, hint_cmd, inodes, in_kernel, watched,
                                delivered)  # fmt: skip
        if not ctx:
            raise MemoryError("the FUSE hot path's tables")
        self._ctx = ctx
        self._lib.hot_limit_blocks(ctx, publish_limit(self._lib.hot_max_blocks()))
        self._lib.hot_direct_reads(ctx, direct_reads())
        if self._lib.hot_start_disk_readers(ctx, DISK_READERS) < DISK_READERS:
            log.warning("C's disk readers did not all start: READs of pages not in memory "
                        "may go to Python")  # fmt: skip
        found = self._lookups
        if found is not None and found.counts is not None and found.known is not None:
            if len(found.counts) < inodes:
                raise ValueError("the shared tables must cover every inode")
            self._lib.hot_track_inodes(ctx, _buffer(found.counts), _address(found.known))
        self._reports.start(ctx)
        handlers = (ctypes.c_void_p * (len(_HANDLERS) + 1))()
        self._lib.hot_handlers(handlers)
        for name, handler in zip(_HANDLERS, handlers, strict=False):
            setattr(ops, name, handler)
        if self._serve_lookups(ctx, ops.lookup):
            ops.lookup = handlers[len(_HANDLERS)]
        return int(ctx)

    def _serve_lookups(self, ctx: int, python_lookup: int) -> bool:
        found = self._lookups
        if found is None:
            return False
        result = self._lib.hot_serve_lookups(
            ctx, python_lookup, self._reply_entry, _address(found.known), found.uid,
            found.gid, found.blksize, found.timeout, found.max_entries,
        )  # fmt: skip
        if result < 0:
            log.warning("LOOKUPs stay in Python: %s", os.strerror(-result))
            self._lookups = None
        return bool(result == 0)

    def count_lookups(self, inos: Sequence[int], delta: int) -> None:
        """The kernel was given (``delta`` 1) or did not get (-1) an entry of each of
        ``inos`` by a reply of Python's: C keeps the counts (``Lookups.counts``)."""
        if self._ctx is None or not inos:
            return
        values = array("Q", inos)
        self._lib.hot_count_lookups(self._ctx, _buffer(values), len(values), delta)

    @property
    def serves_lookups(self) -> bool:
        """Whether C answers LOOKUPs of published folders."""
        return self._ctx is not None and self._lookups is not None

    def publish_folder(self, parent: int, entries: Sequence[FolderEntry]) -> int:
        """Answer the LOOKUPs of these entries of folder ``parent`` in C from now on:
        ``entries`` ((name, ino, st_mode, size, mtime)) are all its names but "." and "..".
        Returns how many were added (0: published already), or -1 when C holds as many
        entries as it may (``Lookups.max_entries``): that folder's LOOKUPs stay Python's."""
        if not self.serves_lookups:
            return 0
        ends, inos, sizes, mtimes = array("q"), array("Q"), array("q"), array("q")
        modes = array("I")
        at = 0
        for name, ino, mode, size, mtime in entries:
            at += len(name)
            ends.append(at)
            inos.append(ino)
            modes.append(mode)
            sizes.append(size)
            mtimes.append(mtime)
        names = b"".join(entry[0] for entry in entries)
        result = self._lib.hot_publish_folder(
            self._ctx, parent, len(entries), names, _buffer(ends), _buffer(inos),
            _buffer(sizes), _buffer(mtimes), _buffer(modes),
        )  # fmt: skip
        if result == -errno.ENOSPC:
            return -1
        if result < 0:
            raise OSError(-result, os.strerror(-result))
        return int(result)

    def folder_published(self, parent: int) -> bool:
        return self.serves_lookups and bool(self._lib.hot_folder_published(self._ctx, parent))

    def settle(self) -> None:
        """``HotReports.settle``: before a new order hint."""
        self._reports.settle()

    def publish(self, block: BlockFile, files: FileTable, token: Any = None) -> Placed | None:
        """Answer READs of ``files`` (positions in the block's data) from the block's file,
        which this call takes over (closed when no longer used). C checks every chunk it
        reads against the sums of the block's verified header, as Python's reads do;
        ``token`` names the block to ``used``. Returns where C holds it (None: not
        published)."""
        assert self._ctx is not None
        try:
            tables = _tables(files)
        except BaseException:
            os.close(block.fd)  # taken over: never left open, even when C never got it
            raise
        generation = ctypes.c_int32()
        result = self._lib.hot_publish(
            self._ctx, block.fd, block.data_at, block.data_len, block.chunk, block.sums,
            len(block.sums), len(files), *tables, ctypes.byref(generation),
        )  # fmt: skip
        if result < 0:
            log.debug("publishing a block failed: %s", os.strerror(-result))
            return None
        self._tokens[result] = token
        return Placed(result, generation.value)

    def publish_edge(
        self, ino: int, size: int, first: Placed, pos: int, head: int, second: Placed
    ) -> bool:
        """Answer READs of a file across two published blocks: its first ``head`` bytes
        end block ``first``'s data, from ``pos``; the rest begin block ``second``'s. False
        when either block left its slot since (its READs stay Python's)."""
        if self._ctx is None:
            return False
        result = self._lib.hot_publish_edge(
            self._ctx, ino, size, first.slot, first.generation, pos, head, second.slot,
            second.generation,
        )  # fmt: skip
        if result < 0 and result != -errno.ESTALE:
            log.debug("publishing a file across blocks failed: %s", os.strerror(-result))
        return bool(result == 0)

    def publish_memory(
        self, data: bytes | memoryview, files: FileTable, token: Any = None
    ) -> InMemory | None:
        """Answer READs of ``files`` (positions in ``data``) from ``data`` itself,
        a block in memory whose files are not in the kernel yet: no copy, no sums. ``data``
        must stay alive and unchanged until ``drop`` of the returned handle (None: not
        published, READs go on to Python)."""
        if self._ctx is None or not data:
            return None
        address, held = _data_address(data)
        generation = ctypes.c_int32()
        slot = self._lib.hot_publish_memory(
            self._ctx, address, len(data), len(files), *_tables(files), ctypes.byref(generation)
        )
        if slot < 0:
            log.debug("publishing a block in memory failed: %s", os.strerror(-slot))
            return None
        self._tokens[slot] = token
        return InMemory(slot, generation.value, held)

    def drop(self, block: InMemory) -> None:
        """Stop answering from a block ``publish_memory`` published (unless another took its
        slot since); once this returns, its memory is the caller's again."""
        if self._ctx is not None:
            self._lib.hot_drop(self._ctx, block.slot, block.generation)
        block.held = None

    def answer(self, req: int, ino: int, size: int, offset: int) -> bool:
        """Answer READ ``req`` in C if its file is published now (in memory or in its block
        file), as if it had just come; whether C took it (then it is answered, or queued
        for a disk reader, which hands it back to Python's handler if it cannot)."""
        return self._ctx is not None and bool(
            self._lib.hot_answer(self._ctx, req, ino, size, offset)
        )

    def published(self, ino: int) -> bool:
        return self._ctx is not None and bool(self._lib.hot_published(self._ctx, ino))

    def counters(self) -> dict[str, int]:
        """What C has answered so far (``_COUNTERS``)."""
        if self._ctx is None:
            return dict(self._final or dict.fromkeys(_COUNTERS, 0))
        out = _Counters()
        self._lib.hot_counters(self._ctx, ctypes.byref(out))
        return {name: int(getattr(out, name)) for name in _COUNTERS}

    def stats(self) -> dict[str, int]:
        """The counters as the mount's statistics name them (``Stats.add_source``)."""
        counts = self.counters()
        return {
            "cache_hits": counts["reads"],
            "hot_path_reads": counts["reads"],
            "files_published": counts["published"],
            "hot_path_not_in_memory": counts["not_in_memory"],
            "hot_path_disk_reads": counts["disk_reads"],
            "hot_path_direct_reads": counts["direct_reads"],
            "hot_path_memory_reads": counts["memory_reads"],
            "hot_path_edge_reads": counts["edge_reads"],
            "hinted_reads": counts["watched_reads"],  # beside Python's (note_read)
            "bytes_served": counts["bytes"],
            "delivered_bytes": counts["delivered_bytes"],
            # Python reads those chunks again and counts the damage in checksum_failures
            "hot_path_checksum_failures": counts["checksum_failures"],
            "hot_path_lookups": counts["lookups"],
            "inodes_forgotten": counts["forgotten"],
        }

    def close(self) -> None:
        """Free the state: only once the session answers no more requests."""
        self._reports.close()
        if self._ctx is not None:
            self._final = self.counters()
            ctx, self._ctx = self._ctx, None
            self._lib.hot_free(ctx)
            log.info("compiled hot path: %s", ", ".join(f"{k} {v}" for k, v in self._final.items()))


# hot_push's results per file: pushed, already in the kernel, left waiting for its inode
PUSHED, IN_KERNEL, WAITING = 0, 1, 2


class BatchPush:
    """A block's files stored into the kernel in one call (``hot_push``), without the
    interpreter: the pusher's per-file work, in C. The pusher's tables (``in_kernel``,
    ``known``, ``waiting``: one byte per inode) are shared with C, never resized."""

    def __init__(
        self, lib: ctypes.CDLL, store: tuple[int, int], in_kernel: bytearray,
        known: bytearray, waiting: bytearray,
    ) -> None:  # fmt: skip
        """``store``: the address of ``fuse_lowlevel_notify_store`` and the session's."""
        self._lib = lib
        self._store = store
        self._inodes = min(len(in_kernel), len(known), len(waiting))
        self._tables = tuple(_address(t) for t in (in_kernel, known, waiting))
        self._shared = (in_kernel, known, waiting)  # kept alive while C points into them

    def push(self, data: bytes | memoryview, files: FileTable) -> tuple[int, array[int]]:
        """Store ``files`` (positions in ``data``); returns the bytes pushed and
        each file's result (PUSHED, IN_KERNEL, WAITING, or a negative errno: EINVAL for a
        file outside ``data`` or an inode past the tables)."""
        results = array("i", bytes(4 * len(files)))
        base, _held = _data_address(data)
        pushed = self._lib.hot_push(
            *self._store, base, len(data), len(files), *_tables(files), self._inodes,
            *self._tables, _buffer(results),
        )  # fmt: skip
        return int(pushed), results


def batch_push(
    store: tuple[int, int], in_kernel: bytearray, known: bytearray, waiting: bytearray
) -> BatchPush | None:
    """The compiled pusher, or None when the extension is not built or switched off."""
    lib = _library()
    return None if lib is None else BatchPush(lib, store, in_kernel, known, waiting)


def create(fuse: Any, **tables: Any) -> HotPath | None:
    """The hot path over libfuse ``fuse`` (``binding.lib()``), or None when not built."""
    lib = _library()
    return None if lib is None else HotPath(lib, fuse, **tables)

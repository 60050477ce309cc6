"""The FUSE adapter: kernel requests onto ShardFileSystem, errors onto errno, threads.

It speaks libfuse's low-level (inode) protocol (``libfuse``). One thread runs the session:
lookups, attributes, listings and reads of bytes already in the block cache are answered
there, without handing the interpreter lock between threads. A read that has to wait on the
store goes to a worker thread, which answers it when its bytes arrive, so one slow GET never
holds up anyone else. With the block cache, ``open`` answers ENOSYS: the kernel then opens
files itself (no open or release requests) and keeps their pages cached; and where the
compiled hot path is built (``hot_path``), ioctls, forgets and READs of the files of
verified, published blocks never reach this class at all.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import os
import termios
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from .. import placement
from ..config import MountConfig
from ..core.attributes import BLOCK_SIZE
from ..core.filesystem import ShardFileSystem
from ..errors import NotFoundError, ShardfsError
from ..formats.tar import MemberKind
from ..formats.units import is_decoded
from ..views.view import Node
from . import binding as libfuse
from . import dirents, hot_path
from .folder_entries import FolderEntries
from .pushed_blocks import PushedBlocks
from .pushes import KernelPusher

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., None])
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
_MISS_WORKERS = 32
_TCGETS = termios.TCGETS  # isatty()
_HINT_IOCTL = placement.HINT_IOCTL
# Files below this size are listed by name and type only, without attributes: a full
# READDIRPLUS entry costs about 10 us in the daemon and the kernel (measured), which for a
# tiny file is the cost of reading it, and it would make listing a million of them slow.
_FULL_ENTRY_MIN_SIZE = 4096


def _error_number(exc: BaseException, operation: str) -> int:
    """The errno answering ``exc``: ShardfsError carries one, anything else is EIO (logged)."""
    if isinstance(exc, ShardfsError):
        if exc.errno not in (errno.ENOENT, errno.ENODATA):
            log.warning("%s: %s", operation, exc)
        return exc.errno
    log.error("%s failed", operation, exc_info=exc)
    return errno.EIO


def _answers(func: F) -> F:
    """Answer a request whose handler raised (before replying) with the matching errno."""

    @functools.wraps(func)
    def wrapper(self: FuseOperations, req: int, *args: Any) -> None:
        try:
            func(self, req, *args)
        except BaseException as exc:  # a C callback must never let an exception escape
            self.reply_err(req, _error_number(exc, func.__name__))

    return cast(F, wrapper)


@dataclass
class _Listing:
    """An open folder: its records are packed at the first READDIR(PLUS) request."""

    folder: Node
    packed: dict[bool, dirents.PackedListing] = field(default_factory=dict)


class FuseOperations:
    """Kernel requests for a read-only shardfs mount."""

    def __init__(
        self,
        core: ShardFileSystem,
        config: MountConfig,
        on_ready: Callable[[], None] | None = None,
        *,
        keep_handles: bool = False,
        pusher: KernelPusher | None = None,
        lib: Any = None,
    ) -> None:
        """``lib`` answers the requests (libfuse's ``fuse_reply_*`` functions; a fake in
        tests); ``pusher`` is told which inodes the kernel knows and which files it holds."""
        self.core = core
        self.config = config
        self.on_ready = on_ready
        # Without the block cache a read is a GET: open files then keep a window of their
        # bytes (core handles). With it, files need no open at all (zero-open).
        self.keep_handles = keep_handles
        self.timeout = float(config.kernel_timeout)
        self.lib = lib if lib is not None else libfuse.lib()
        self.reply_err = self.lib.fuse_reply_err
        self._hint_ino = core.hint_ino
        self._reply_buf = self.lib.fuse_reply_buf
        self._listings: dict[int, _Listing] = {}
        self._next_listing = 1
        self.pusher = pusher
        self.workers = (
            ThreadPoolExecutor(_MISS_WORKERS, thread_name_prefix="shardfs-read")
            if config.threads
            else None
        )
        # The compiled handlers (reads of published files, ioctls, forgets), over libfuse
        # itself only: a fake ``lib`` in tests gets every request here.
        self.hot: hot_path.HotPath | None = None
        if lib is None and not keep_handles and core.uses_block_cache:
            self.hot = hot_path.create(
                self.lib,
                hint_ino=self._hint_ino,
                hint_cmd=_HINT_IOCTL,
                inodes=core.view.max_ino + 1,
                in_kernel=pusher.in_kernel if pusher is not None else None,
                watched=core.hints.watched,
                delivered=core.delivered,
                opened=self._opened,
                used=self._block_used,
                lookups=hot_path.Lookups(
                    known=pusher.known if pusher is not None else None,
                    counts=pusher.lookup_counts if pusher is not None else None,
                    uid=core.shown.uid,
                    gid=core.shown.gid,
                    blksize=BLOCK_SIZE,
                    timeout=self.timeout,
                ),
            )
        if self.hot is not None:
            core.stats.add_source(self.hot.stats)
            if pusher is not None:
                pusher.count_in(self.hot.count_lookups)
                pushed = PushedBlocks(core, self.hot)
                pusher.publish = pushed.publish_pushed
                pusher.publish_early = pushed.publish_early
                pusher.release = pushed.release_early
        self._publishing: set[tuple[int, int]] = set()
        self._folders = FolderEntries(core, self.hot, self.workers)

    def callbacks(self) -> dict[str, Callable[..., None]]:
        names = [
            "init", "lookup", "forget", "forget_multi", "getattr", "readlink", "open", "read",
            "release", "opendir", "readdir", "readdirplus", "releasedir", "statfs", "getxattr",
            "listxattr", "ioctl",
        ]  # fmt: skip
        return {name: getattr(self, name) for name in names}

    # -- helpers -------------------------------------------------------------------------

    def _stat(self, node: Node, target: libfuse.Stat) -> None:
        """Copy what the core shows of ``node`` (``attributes.AttributeRule``) into ``target``."""
        shown = self.core.attributes(node)
        target.st_ino = shown.ino
        target.st_mode = shown.mode
        target.st_nlink = shown.nlink
        target.st_uid = shown.uid
        target.st_gid = shown.gid
        target.st_size = shown.size
        target.st_blksize = shown.blksize
        target.st_blocks = shown.blocks
        target.st_atim.tv_sec = target.st_mtim.tv_sec = target.st_ctim.tv_sec = shown.mtime

    def _entry(self, node: Node) -> libfuse.EntryParam:
        entry = libfuse.EntryParam()
        entry.attr_timeout = entry.entry_timeout = self.timeout
        entry.ino = node.ino
        self._stat(node, entry.attr)
        return entry

    def _reply_data(self, req: int, data: bytes) -> None:
        self._reply_buf(req, data, len(data))

    # -- requests ------------------------------------------------------------------------

    def init(self, _userdata: int, conn: Any) -> None:
        try:
            # Always READDIRPLUS: a listing then carries every entry's attributes, so
            # ImageFolder's scan spares one LOOKUP per file later.
            conn.contents.want &= ~libfuse.FUSE_CAP_READDIRPLUS_AUTO
            if self.on_ready is not None:
                self.on_ready()
        except Exception:  # raised from a C callback it would be lost: ``serve`` stops
            log.exception("FUSE init failed")

    @_answers
    def lookup(self, req: int, parent: int, name: bytes) -> None:
        folder = self.core.node(parent)
        try:
            node = self.core.child(folder, os.fsdecode(name))
        except NotFoundError:
            entry = libfuse.EntryParam()  # inode 0: a negative entry the kernel may keep
            entry.entry_timeout = self.timeout
            self.lib.fuse_reply_entry(req, ctypes.byref(entry))
            return
        pusher = self.pusher if not self.core.is_virtual(node) else None
        if pusher is not None:
            pusher.given((node.ino,))
        # ``given`` marked the inode held; a file waiting for it is left to the READ that
        # follows (``inode_known(push_waiting=False)``: a push would race it).
        error = self.lib.fuse_reply_entry(req, ctypes.byref(self._entry(node)))
        if error and pusher is not None:
            pusher.not_given((node.ino,))  # interrupted: the kernel took nothing
        self.core.stats.add(python_lookups=1)
        if not self.core.is_virtual(node):
            self._folders.soon(folder)

    def forget(self, req: int, ino: int, nlookup: int) -> None:
        # Inodes are rows of the view: nothing to free. The pusher counts what the kernel
        # holds (C does when the compiled path is built).
        if self.pusher is not None:
            self.pusher.forgot(((ino, nlookup),))
        self.lib.fuse_reply_none(req)

    def forget_multi(self, req: int, count: int, forgets: int) -> None:
        if self.pusher is not None and count:
            pairs = (ctypes.c_uint64 * (2 * count)).from_address(forgets)
            self.pusher.forgot(zip(pairs[0::2], pairs[1::2], strict=True))
        self.lib.fuse_reply_none(req)

    @_answers
    def getattr(self, req: int, ino: int, _fi: Any) -> None:
        attributes = libfuse.Stat()
        self._stat(self.core.node(ino), attributes)
        self.lib.fuse_reply_attr(req, ctypes.byref(attributes), self.timeout)

    @_answers
    def readlink(self, req: int, ino: int) -> None:
        node = self.core.node(ino)
        if node.kind != MemberKind.SYMLINK:
            self.reply_err(req, errno.EINVAL)
            return
        self.lib.fuse_reply_readlink(req, os.fsencode(node.link))

    @_answers
    def open(self, req: int, ino: int, fi: Any) -> None:
        info = fi.contents
        if info.flags & _WRITE_FLAGS:
            self.reply_err(req, errno.EROFS)
            return
        node = self.core.node(ino)
        if node.is_dir:
            self.reply_err(req, errno.EISDIR)
            return
        if not self.keep_handles:
            # ENOSYS tells the kernel (FUSE_CAP_NO_OPEN_SUPPORT) to open files itself from
            # now on, keeping their page cache: no open or release reaches us again.
            self.reply_err(req, errno.ENOSYS)
            return
        info.fh = self.core.open_node(node)
        info.keep_cache = 1
        if self.lib.fuse_reply_open(req, fi) == -errno.ENOENT:  # interrupted: no release
            self.core.release(info.fh)

    @_answers
    def read(self, req: int, ino: int, size: int, offset: int, fi: int) -> None:
        if self.keep_handles:
            handle = libfuse.FileInfo.from_address(fi).fh
            self._later(req, "read", self.core.read, handle, offset, size)
            return
        node = self.core.node(ino)
        data = self.core.read_node_local(node, offset, size)
        if data is None:
            self._later(req, "read", self._read_waited, req, node, offset, size)
            return
        self.core.stats.add(python_reads=1)
        self._reply_buf(req, data, len(data))
        self._delivered(node, offset, data)
        if self.hot is not None and ino <= self.core.view.max_ino:
            self._publish_soon(node)

    def _publish_soon(self, node: Node) -> None:
        """Have the compiled path answer the later READs of the files of ``node``'s block
        (on a worker thread: the block file opened, its header read and verified)."""
        if is_decoded(node.offset):
            return  # a decoded file has no block of its own to publish
        key = (node.shard, node.offset // self.core.block_size)
        if key in self._publishing or self.workers is None:
            return
        if self.pusher is not None and self.pusher.behind:
            return  # it may hold this block in memory and publish it: a later READ asks again
        self._publishing.add(key)
        self.workers.submit(self._publish, node, key)

    def _publish(self, node: Node, key: tuple[int, int]) -> None:
        hot = self.hot
        try:
            if hot is not None and not hot.published(node.ino):
                found = self.core.published_block(node)
                if found is not None:
                    hot.publish(*found, token=key)
                    self.core.stats.add(publishes_after_reads=1)
        except Exception:  # the Python path still answers
            log.exception("publishing the block of inode %d failed", node.ino)
        finally:
            self._publishing.discard(key)

    def _block_used(self, key: tuple[int, int]) -> None:
        self.core.block_used(*key)

    def _opened(self, inodes: Sequence[int]) -> None:
        """The compiled ioctl handler saw the opens of files the kernel holds whole."""
        try:
            self.core.opened_in_kernel(inodes)
        except Exception:  # already answered: a failure here only loses the signs
            log.exception("noting the opens of %d inodes failed", len(inodes))

    def _read_waited(self, req: int, node: Node, offset: int, size: int) -> bytes | None:
        """A READ that could not be answered at once (on a worker thread). One whose block
        was being fetched waits for it (a file across a block's end, for both of its
        blocks); C then answers it from the fetched bytes (published in memory when the
        block was stored), else Python reads it (None: C answered). The hint of a file
        it follows hears of the read before the wait, so its window moves while the
        reader waits; C counts the read and tells the hint of the file's end."""
        hot = self.hot
        if hot is not None:
            hints = self.core.hints
            if hints.watched[node.ino]:
                hints.note_read(node, count=False)
            if self.core.wait_block(node) and hot.answer(req, node.ino, size, offset):
                return None
        self.core.stats.add(python_reads=1, python_reads_later=1)
        return self._read_node(node, offset, size)

    def _read_node(self, node: Node, offset: int, size: int) -> bytes:
        data = self.core.read_node(node, offset, size)
        self._delivered(node, offset, data)
        return data

    def _delivered(self, node: Node, offset: int, data: bytes) -> None:
        """A READ answered with ``data``: when that is the whole file, nothing to push."""
        whole = offset == 0 and len(data) == node.size
        if whole and self.pusher is not None and not self.core.is_virtual(node):
            self.pusher.in_kernel[node.ino] = 1

    def _later(
        self, req: int, operation: str, func: Callable[..., bytes | None], *args: Any
    ) -> None:
        """Answer ``req`` with ``func(*args)`` from a worker thread (inline when single);
        ``func`` returns None when it answered ``req`` itself."""

        def answer() -> None:
            try:
                data = func(*args)
            except BaseException as exc:
                self.reply_err(req, _error_number(exc, operation))
                return
            if data is not None:
                self._reply_buf(req, data, len(data))

        if self.workers is None:
            answer()
        else:
            self.workers.submit(answer)

    @_answers
    def release(self, req: int, _ino: int, fi: Any) -> None:
        if self.keep_handles:
            self.core.release(fi.contents.fh)
        self.reply_err(req, 0)

    @_answers
    def opendir(self, req: int, ino: int, fi: Any) -> None:
        node = self.core.node(ino)
        if not node.is_dir:
            self.reply_err(req, errno.ENOTDIR)
            return
        handle = self._next_listing
        self._next_listing += 1
        self._listings[handle] = _Listing(node)
        info = fi.contents
        info.fh = handle
        # The kernel may cache the listing, and keep it across opens: it never changes.
        info.cache_readdir = info.keep_cache = 1
        if self.lib.fuse_reply_open(req, fi) == -errno.ENOENT:  # interrupted: no releasedir
            self._listings.pop(handle, None)

    def _readdir(self, req: int, size: int, offset: int, fi: Any, *, plus: bool) -> None:
        listing = self._listings[fi.contents.fh]
        packed = listing.packed.get(plus)
        if packed is None:  # packed whole at the first request; later ones are slices
            entries = self.core.listing(listing.folder, _FULL_ENTRY_MIN_SIZE)
            self.core.stats.add(folders_listed=1)
            self._folders.soon(listing.folder, entries)
            shown = self.core.shown
            packed = listing.packed[plus] = dirents.pack(
                entries, plus=plus, uid=shown.uid, gid=shown.gid,
                blksize=BLOCK_SIZE, timeout=self.timeout,
            )  # fmt: skip
        data, records = packed.reply(offset, size)
        pusher = self.pusher if plus else None
        if pusher is None:
            self._reply_buf(req, data, len(data))
            return
        given = packed.given_in(records)
        pusher.given(given)  # before the kernel has them: a FORGET may follow at once
        if self._reply_buf(req, data, len(data)):
            pusher.not_given(given)  # interrupted: the kernel took nothing
            return
        for ino in given:
            pusher.inode_known(ino)

    @_answers
    def readdir(self, req: int, _ino: int, size: int, offset: int, fi: Any) -> None:
        self._readdir(req, size, offset, fi, plus=False)

    @_answers
    def readdirplus(self, req: int, _ino: int, size: int, offset: int, fi: Any) -> None:
        self._readdir(req, size, offset, fi, plus=True)

    @_answers
    def releasedir(self, req: int, _ino: int, fi: Any) -> None:
        self._listings.pop(fi.contents.fh, None)
        self.reply_err(req, 0)

    @_answers
    def statfs(self, req: int, _ino: int) -> None:
        data = libfuse.StatVfs()
        for name, value in self.core.statfs().items():
            setattr(data, name, value)
        self.lib.fuse_reply_statfs(req, ctypes.byref(data))

    def _reply_xattr(self, req: int, value: bytes, size: int) -> None:
        if size == 0:
            self.lib.fuse_reply_xattr(req, len(value))
        elif size < len(value):
            self.reply_err(req, errno.ERANGE)
        else:
            self._reply_data(req, value)

    @_answers
    def getxattr(self, req: int, ino: int, name: bytes, size: int) -> None:
        value = self.core.node_xattr(self.core.node(ino), os.fsdecode(name))
        self._reply_xattr(req, value, size)

    @_answers
    def listxattr(self, req: int, ino: int, size: int) -> None:
        names = self.core.node_xattrs(self.core.node(ino))
        self._reply_xattr(req, b"".join(os.fsencode(name) + b"\0" for name in names), size)

    def ioctl(
        self, req: int, ino: int, cmd: int, _arg: int, _fi: int | None, _flags: int,
        in_buf: int, in_size: int, _out_size: int,
    ) -> None:  # fmt: skip
        """The order hint arrives as ioctls on the hint file (a read-only mount passes them
        on, where it refuses writes); every other ioctl is not ours. Those others include
        the TCGETS of every default-buffered Python ``open()`` (``isatty``), which no reply
        can switch off: they are answered here with the least work, nothing that can raise."""
        if ino != self._hint_ino or cmd != _HINT_IOCTL or not in_buf:
            self.reply_err(req, errno.ENOTTY)
            # Python's open() asks isatty() first: for a file the kernel holds whole, that
            # is the only sign of its read, which the order hint's retirement counts.
            pusher = self.pusher
            known = pusher is not None and ino < len(pusher.in_kernel) and pusher.in_kernel[ino]
            if cmd == _TCGETS and known:
                try:  # already answered: a failure here only loses the sign
                    self.core.opened_in_kernel((ino,))
                except Exception:
                    log.exception("noting the open of inode %d failed", ino)
            return
        self._take_hint(req, in_buf, in_size)

    @_answers
    def _take_hint(self, req: int, in_buf: int, in_size: int) -> None:
        if self.hot is not None:  # what C saw so far belongs to the last hint, not this one
            self.hot.settle()
        self.core.take_hint_chunk(ctypes.string_at(in_buf, in_size))
        self.lib.fuse_reply_ioctl(req, 0, None, 0)

    def close(self) -> None:
        """Wait for reads still being answered by worker threads; free the compiled
        handlers' state (the session loop has ended: no request can reach them)."""
        if self.workers is not None:
            self.workers.shutdown(wait=True)
        if self.hot is not None:
            self.hot.close()

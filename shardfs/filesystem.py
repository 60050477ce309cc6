"""The filesystem core: lookups, attributes, directory listings and reads, without FUSE.

Tests drive this class directly; ``fuse_ops`` is a thin adapter over it.
"""

from __future__ import annotations

import itertools
import os
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache

from .config import MountConfig, ReadConfig
from .dirents import Entry
from .errors import IsADirectoryError_, NoSuchAttributeError, NotADirectoryError_, NotFoundError
from .reader import CachedReader, RangeReader
from .stats import Stats
from .store import ShardInfo
from .tar import MemberKind
from .views import Node, View, st_mode

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


class ShardFileSystem:
    """A read-only tree over a materialised view, reading bytes through a RangeReader."""

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

    def getattr(self, path: str) -> dict[str, int]:
        return self.attributes(self.view.lookup(path))

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

    def attributes(self, node: Node) -> dict[str, int]:
        mode, nlink, size, blocks, mtime = self.stat_fields(node)
        return {
            "st_ino": node.ino,
            "st_mode": mode,
            "st_nlink": nlink,
            "st_size": size,
            "st_blocks": blocks,
            "st_blksize": self.BLOCK_SIZE,
            "st_uid": self.uid,
            "st_gid": self.gid,
            "st_mtime": mtime,
            "st_ctime": mtime,
            "st_atime": mtime,
        }

    def readdir(self, path: str) -> list[tuple[str, Node]]:
        node = self.view.lookup(path)
        if not node.is_dir:
            raise NotADirectoryError_(path)
        return list(self.view.children(node))

    def listing(self, folder: Node, full_from: int = 0) -> list[Entry]:
        """Every name of ``folder`` with what ``stat`` shows of it, "." and ".." first, in
        listing order. Folders and files of at least ``full_from`` bytes are marked full (a
        listing may hand the kernel their attributes); "." and ".." never are."""
        if not folder.is_dir:
            raise NotADirectoryError_(f"inode {folder.ino}")
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

    def readlink(self, path: str) -> str:
        node = self.view.lookup(path)
        if node.kind != MemberKind.SYMLINK:
            raise NotFoundError(f"{path} is not a symlink")
        return node.link

    def open(self, path: str) -> int:
        return self.open_node(self.view.lookup(path))

    def node(self, ino: int) -> Node:
        return self.view.node(ino)

    def child(self, parent: Node, name: str) -> Node:
        if not parent.is_dir:
            raise NotADirectoryError_(name)
        found = self.view.child(parent.ino, name)
        if found is None:
            raise NotFoundError(name)
        return found

    def read_path(self, path: str, offset: int, size: int) -> bytes:
        """A read without an open handle: each call goes to the reader (the block cache
        makes that cheap), so the kernel need not send open and release at all."""
        return self.read_node(self.view.lookup(path), offset, size)

    def _span(self, node: Node, offset: int, size: int) -> tuple[ShardInfo, int, int] | None:
        """(shard, start, end) of a read in shard offsets, or None when it reads nothing."""
        if node.is_dir:
            raise IsADirectoryError_(str(node.ino))
        end = min(offset + size, node.size)
        if offset >= end:
            return None
        return self.view.shards[node.shard], node.offset + offset, node.offset + end

    def read_node(self, node: Node, offset: int, size: int) -> bytes:
        """Bytes of a file by node; may wait on the store."""
        span = self._span(node, offset, size)
        if span is None:
            return b""
        data = self.reader.read(*span)
        self.stats.add(bytes_served=len(data))
        return data

    def read_node_local(self, node: Node, offset: int, size: int) -> bytes | None:
        """Like ``read_node`` when the bytes are already local, else None (never waits)."""
        span = self._span(node, offset, size)
        if span is None:
            return b""
        data = self.reader.read_local(*span)
        if data is not None:
            self.stats.add(bytes_served=len(data))
        return data

    @property
    def uses_block_cache(self) -> bool:
        return isinstance(self.reader, CachedReader)

    def watch_local_blocks(
        self, callback: Callable[[ShardInfo, int, int, bytes | None], None] | None
    ) -> None:
        """Have ``callback(shard, start, end, block)`` told when a block of bytes becomes
        local (once per block; ``block`` holds its bytes when they were just fetched, else
        None); None stops it. Only reads through the block cache have blocks."""
        if isinstance(self.reader, CachedReader):
            self.reader.on_block = callback

    def files_within(self, shard: ShardInfo, start: int, end: int) -> list[Node]:
        """Files lying wholly inside bytes ``[start, end)`` of ``shard``."""
        return self.view.files_within(self.view.shard_ids[shard], start, end)

    def file_bytes_local(self, node: Node) -> bytes | None:
        """A whole file if its bytes are in the block cache (no network, no statistics)."""
        if not isinstance(self.reader, CachedReader):
            return None
        shard = self.view.shards[node.shard]
        return self.reader.read_local(shard, node.offset, node.offset + node.size, quiet=True)

    def open_node(self, node: Node) -> int:
        """A handle whose reads keep a window of the file (for reads without the cache)."""
        if node.is_dir:
            raise IsADirectoryError_(str(node.ino))
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
        with opened.lock:
            data = self._read_window(opened, offset, end, size)
        self.stats.add(bytes_served=len(data))
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
        data = self.reader.read(shard, node.offset + window_start, node.offset + window_end)
        opened.window_start, opened.window = window_start, data
        return data[offset - window_start : end - window_start]

    def listxattr(self, path: str) -> list[str]:
        return self.node_xattrs(self.view.lookup(path))

    def getxattr(self, path: str, name: str) -> bytes:
        return self.node_xattr(self.view.lookup(path), name, path)

    @staticmethod
    def node_xattrs(node: Node) -> list[str]:
        return list(_FILE_XATTRS) if node.kind == MemberKind.FILE else []

    def node_xattr(self, node: Node, name: str, where: str = "") -> bytes:
        if node.kind == MemberKind.FILE:
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

"""What ``stat`` shows of a node, in one place: mode, link count, size, blocks, times,
owner and preferred I/O size. The listing fast path (``ShardFileSystem.listing``) computes
the same fields inline from this rule's parts, for speed; a test keeps the two equal."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import NamedTuple

from ..config import MountConfig
from ..formats.tar import MemberKind
from ..views.nodes import Node, st_mode

BLOCK_SIZE = 1 << 16
"""st_blksize: the I/O size readers are told to prefer.

Python's ``open()`` sizes its buffer by it, and the first read of a file not in the page
cache asks for a buffer's worth: the kernel's first readahead window follows that size. At
64 KiB the window is the whole readahead (128 KiB, the kernel's default), so a file of up
to 128 KiB that was not pushed is one READ, as with the 128 KiB of before; at 4 KiB it was
three (PIL decoding through a mount without pushes, counted by the daemon). A 128 KiB
buffer sits at glibc's default mmap threshold, and in some heap states each opened file
faulted it in afresh: decoding JPEGs from local disk in such a state took 168 page faults
per file with a 4 KiB buffer, 184 with 64 KiB and 200 with 128 KiB (stop 41)."""


@dataclass(frozen=True)
class Owner:
    """Who owns every file and folder, and their permission bits.

    uid, gid: default the mounting process's. file_mode, dir_mode: permission bits of
    every regular file and every folder; None keeps ``st_mode``'s rule (read-only for
    everyone, plus a file's own execute bits). Symlinks always show 0o777."""

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
        """``(kind, stored mode) -> st_mode``: ``st_mode`` with the overrides."""
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


class Attributes(NamedTuple):
    """Everything ``stat`` shows of a node; atime, mtime and ctime are all ``mtime``."""

    ino: int
    mode: int
    nlink: int
    uid: int
    gid: int
    size: int
    blksize: int
    blocks: int  # 512-byte blocks
    mtime: int


class AttributeRule:
    """How one mount shows its nodes: ``owner``'s ids and modes, and the mount time for
    members stored without one."""

    def __init__(self, owner: Owner, mount_time: int) -> None:
        self.uid = owner.uid
        self.gid = owner.gid
        self.mode = owner.mode_rule()
        self.mount_time = mount_time

    def of(self, node: Node) -> Attributes:
        size = node.size
        return Attributes(
            node.ino,
            self.mode(node.kind, node.mode),
            2 if node.kind == MemberKind.DIRECTORY else 1,
            self.uid,
            self.gid,
            size,
            BLOCK_SIZE,
            (size + 511) // 512,
            node.mtime or self.mount_time,
        )

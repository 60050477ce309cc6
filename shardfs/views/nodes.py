"""The nodes of a presented tree: one row of a view's ``nodes`` table each, as a tuple
(listings build many of these). Inode 1 is the root."""

from __future__ import annotations

import stat
from functools import lru_cache
from typing import NamedTuple

from ..formats.tar import MemberKind

ROOT_INO = 1


@lru_cache(maxsize=256)
def st_mode(kind: int, mode: int) -> int:
    """The mode ``stat`` shows for a member of ``kind`` stored with permission bits ``mode``:
    read-only for everyone (plus the member's own execute bits)."""
    if kind == MemberKind.DIRECTORY:
        return stat.S_IFDIR | 0o555
    if kind == MemberKind.SYMLINK:
        return stat.S_IFLNK | 0o777
    return stat.S_IFREG | (mode & 0o555 | 0o444)


class Node(NamedTuple):
    """One entry of the presented tree (a tuple: listings build many of these)."""

    ino: int
    kind: MemberKind
    shard: int
    offset: int
    size: int
    mode: int
    mtime: int
    link: str

    @property
    def is_dir(self) -> bool:
        return self.kind == MemberKind.DIRECTORY

    @property
    def st_mode(self) -> int:
        return st_mode(self.kind, self.mode)


_KINDS = {int(kind): kind for kind in MemberKind}
NODE_COLUMNS = "ino, kind, shard, offset, size, mode, mtime, link"
"""The columns of ``nodes`` that ``node_of`` takes, in its order."""


def node_of(row: tuple[int, int, int, int, int, int, int, str]) -> Node:
    ino, kind, shard, offset, size, mode, mtime, link = row
    return Node(ino, _KINDS[kind], shard, offset, size, mode, mtime, link)

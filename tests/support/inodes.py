"""Reach the filesystem core the way the kernel does: by inode, one name at a time.

The core offers only the inode API (what the FUSE adapter calls); tests name files by path
and walk to them here, so they exercise the same calls the kernel's lookups make."""

from __future__ import annotations

from shardfs.core.filesystem import ShardFileSystem
from shardfs.views.nodes import ROOT_INO, Node


def resolve(fs: ShardFileSystem, path: str) -> Node:
    """The node at ``path`` (relative to the mount's root), by LOOKUPs from the root."""
    node = fs.node(ROOT_INO)
    for name in path.split("/"):
        if name:
            node = fs.child(node, name)
    return node


def stat_of(fs: ShardFileSystem, path: str) -> dict[str, int]:
    """What ``stat`` shows of ``path``: the fields the adapter copies into its reply."""
    node = resolve(fs, path)
    shown = fs.attributes(node)
    return {
        "st_ino": shown.ino,
        "st_mode": shown.mode,
        "st_nlink": shown.nlink,
        "st_size": shown.size,
        "st_blocks": shown.blocks,
        "st_mtime": shown.mtime,
        "st_uid": shown.uid,
        "st_gid": shown.gid,
    }


def names_in(fs: ShardFileSystem, path: str) -> list[str]:
    """The names a listing of the folder ``path`` gives, without "." and ".."."""
    return [entry.name.decode() for entry in fs.listing(resolve(fs, path))[2:]]


def open_path(fs: ShardFileSystem, path: str) -> int:
    return fs.open_node(resolve(fs, path))

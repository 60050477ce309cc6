"""Files that straddle blocks, put together from their blocks' bytes as those arrive.

A block's kernel pushes (``pushes.py``) cover the files lying wholly inside it. A file
crossing a block boundary has its bytes in two blocks (or more, when it is larger than a
block), which become local at different moments. Without help, each such file is read
through the daemon: with 1 MiB blocks and 100 KB images that is one file in ten, and each
of those READs costs far more than a push. ``EdgeFiles`` keeps each such file's part of a
block as the block passes through the pusher and hands back the whole file once every
part has arrived. What it holds is bounded: the oldest incomplete files are dropped (they
are read as usual), and files larger than ``max_file`` are never collected.
"""

from __future__ import annotations

from ..views.view import Node

EDGE_BYTES = 32 << 20  # parts of incomplete files held at once
EDGE_MAX_FILE = 16 << 20  # larger files are left to READs


class EdgeFiles:
    """Parts of files crossing block boundaries, by inode, until each file is whole."""

    def __init__(self, limit: int = EDGE_BYTES, max_file: int = EDGE_MAX_FILE) -> None:
        self.limit = limit
        self.max_file = max_file
        self._parts: dict[int, dict[int, bytes]] = {}  # ino -> {offset in file: bytes}
        self._held = 0

    @property
    def held(self) -> int:
        """Bytes of incomplete files held now."""
        return self._held

    def add(
        self, nodes: list[Node], start: int, block: bytes | memoryview
    ) -> list[tuple[Node, bytes]]:
        """Take the parts of ``nodes`` (files crossing the edges of the block at shard offset
        ``start``) from ``block``; return each file whose parts are now all here, whole."""
        end = start + len(block)
        whole: list[tuple[Node, bytes]] = []
        for node in nodes:
            lo, hi = max(start, node.offset), min(end, node.offset + node.size)
            if node.size > self.max_file or lo >= hi:
                continue
            parts = self._parts.setdefault(node.ino, {})
            old = parts.get(lo - node.offset)
            if old is not None:  # the same block again (fetched twice): keep one copy
                self._held -= len(old)
            parts[lo - node.offset] = bytes(block[lo - start : hi - start])
            self._held += hi - lo
            if sum(len(part) for part in parts.values()) == node.size:
                self.forget(node.ino)
                whole.append((node, b"".join(parts[at] for at in sorted(parts))))
        self._trim()
        return whole

    def forget(self, ino: int) -> None:
        """Drop what is held of ``ino`` (the file is whole, or the kernel holds it)."""
        parts = self._parts.pop(ino, None)
        if parts:
            self._held -= sum(len(part) for part in parts.values())

    def _trim(self) -> None:
        while self._held > self.limit and self._parts:
            self.forget(next(iter(self._parts)))  # the file waiting longest

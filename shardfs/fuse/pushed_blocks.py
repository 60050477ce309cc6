"""The kernel pusher's blocks handed to the compiled path: published from memory while
their files wait for their pushes, and from their block file once pushed, so that C answers
the READs of their files (``pushes.KernelPusher``'s ``publish_early``, ``release`` and
``publish`` hooks). A file lying across two blocks is published once both are."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from ..core.filesystem import ShardFileSystem
from ..formats.units import is_decoded
from ..store.shards import ShardInfo
from ..views.block_files import FileTable
from ..views.nodes import Node
from .hot_path import HotPath, InMemory, Placed

log = logging.getLogger(__name__)

BlockId = tuple[int, int]  # (shard id, block index)


class PushedBlocks:
    """The pusher's hooks over one mount's compiled path."""

    def __init__(self, core: ShardFileSystem, hot: HotPath) -> None:
        self.core = core
        self.hot = hot
        # Where C holds each block published here, last placement first, for the files
        # across their edges; at most one block per C slot (a slot's new block replaces it).
        self._placed: dict[BlockId, Placed] = {}
        self._in_slot: dict[int, BlockId] = {}
        self._lock = threading.Lock()

    def publish_early(
        self,
        shard: ShardInfo,
        start: int,
        block: bytes | memoryview,
        files: FileTable,
        edges: Sequence[Node] = (),
    ) -> InMemory | None:
        """A block just fetched, queued for its pushes: until they are done, C answers the
        READs of its files from these bytes (a READ may come first: the reader opened the
        file before the pusher reached it). On the thread that stored the block. ``edges``:
        the files crossing its ends."""
        hot = self.hot
        token = self._block_id(shard, start)
        early = hot.publish_memory(block, files, token)
        if early is not None:
            self._placed_at(token, Placed(early.slot, early.generation), edges)
        return early

    def release_early(self, block: object) -> None:
        if isinstance(block, InMemory):
            self.hot.drop(block)

    def publish_pushed(
        self,
        shard: ShardInfo,
        start: int,
        files: FileTable,
        replacing: bool = False,
        edges: Sequence[Node] = (),
    ) -> None:
        """The pusher's block, its files pushed, published from its block file: once the
        page cache lets go of its files, their READs are answered in C from the first one
        (not after a READ in Python, ``FuseOperations._publish``'s way). On the pusher's
        thread. ``replacing``: it was published early, from memory, and is published again
        here. ``edges``: the files crossing its ends."""
        hot = self.hot
        if not replacing and len(files) and hot.published(files.inos[0]):
            return
        try:
            found = self.core.block_file(shard, start)
            if found is not None:
                token = self._block_id(shard, start)
                self._placed_at(token, hot.publish(found, files, token=token), edges)
        except Exception:  # the pushes go on; READs of these files go to Python
            log.exception("publishing a pushed block failed")

    def _block_id(self, shard: ShardInfo, start: int) -> BlockId:
        return (self.core.view.shard_ids[shard], start // self.core.block_size)

    def _placed_at(self, block: BlockId, placed: Placed | None, edges: Sequence[Node]) -> None:
        """``block`` was just published at ``placed``: each file across one of its ends whose
        other block is published too is published across both."""
        if placed is None:
            return
        shard, index = block
        size = self.core.block_size
        start = index * size
        with self._lock:
            holder = self._in_slot.get(placed.slot)
            if holder is not None:
                held = self._placed.get(holder)
                if held is not None and held.slot == placed.slot:
                    if held.generation > placed.generation:
                        return  # a later block took the slot meanwhile: this one is gone
                    del self._placed[holder]
            self._placed[block] = placed
            self._in_slot[placed.slot] = block
            first: Placed | None
            second: Placed | None
            for node in edges:
                if is_decoded(node.offset):
                    continue
                if node.offset < start:  # it begins in the block before
                    before = self._placed.get((shard, index - 1))
                    first, second, first_start = before, placed, start - size
                else:
                    after = self._placed.get((shard, index + 1))
                    first, second, first_start = placed, after, start
                head = first_start + size - node.offset
                if first is None or second is None or not 0 < node.size - head <= size:
                    continue  # the other block is not published, or it spans more than two
                self.hot.publish_edge(
                    node.ino, node.size, first, node.offset - first_start, head, second
                )

"""The kernel pusher's blocks handed to the compiled path: published from memory while
their files wait for their pushes, and from their block file once pushed, so that C answers
the READs of their files (``pushes.KernelPusher``'s ``publish_early``, ``release`` and
``publish`` hooks)."""

from __future__ import annotations

import logging

from ..core.filesystem import ShardFileSystem
from ..store.shards import ShardInfo
from ..views.block_files import FileTable
from .hot_path import HotPath, InMemory

log = logging.getLogger(__name__)


class PushedBlocks:
    """The pusher's hooks over one mount's compiled path."""

    def __init__(self, core: ShardFileSystem, hot: HotPath) -> None:
        self.core = core
        self.hot = hot

    def publish_early(
        self, shard: ShardInfo, start: int, block: bytes | memoryview, files: FileTable
    ) -> InMemory | None:
        """A block just fetched, queued for its pushes: until they are done, C answers the
        READs of its files from these bytes (a READ may come first: the reader opened the
        file before the pusher reached it). On the thread that stored the block."""
        hot = self.hot
        if self.core.hints.watched[files.inos[0]]:
            return None
        token = (self.core.view.shard_ids[shard], start // self.core.block_size)
        return hot.publish_memory(block, files, token)

    def release_early(self, block: object) -> None:
        if isinstance(block, InMemory):
            self.hot.drop(block)

    def publish_pushed(
        self, shard: ShardInfo, start: int, files: FileTable, replacing: bool = False
    ) -> None:
        """The pusher's block, its files pushed, published from its block file: once the
        page cache lets go of its files, their READs are answered in C from the first one
        (not after a READ in Python, ``FuseOperations._publish``'s way). On the pusher's
        thread. ``replacing``: it was published early, from memory, and is published again
        here."""
        hot, first = self.hot, files.inos[0]
        if self.core.hints.watched[first]:
            return
        if not replacing and hot.published(first):
            return
        try:
            found = self.core.block_file(shard, start)
            if found is not None:
                token = (self.core.view.shard_ids[shard], start // self.core.block_size)
                hot.publish(found, files, token=token)
        except Exception:  # the pushes go on; READs of these files go to Python
            log.exception("publishing a pushed block failed")

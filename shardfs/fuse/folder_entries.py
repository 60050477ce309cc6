"""Folders handed to the compiled path for their LOOKUPs (``_entries.c``): a folder's names
and what ``stat`` shows of them, published whole on a worker thread, after which C answers
every LOOKUP in it as ``FuseOperations.lookup`` would."""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor

from .. import placement
from ..core.filesystem import Entry, ShardFileSystem
from ..views.nodes import ROOT_INO, Node
from .hot_path import HotPath

log = logging.getLogger(__name__)

# The mount's own files in its root, which Python's LOOKUP answers (``ShardFileSystem.child``).
_OWN_NAMES = frozenset(os.fsencode(name) for name in (placement.TABLE_NAME, placement.HINT_NAME))


class FolderEntries:
    """Publishes folders to ``hot`` (nothing without it, or without workers)."""

    def __init__(
        self, core: ShardFileSystem, hot: HotPath | None, workers: ThreadPoolExecutor | None
    ) -> None:
        self.core = core
        self.hot = hot
        self.workers = workers
        self._publishing: set[int] = set()

    def soon(self, folder: Node, entries: list[Entry] | None = None) -> None:
        """Have C answer the later LOOKUPs in ``folder`` (``entries``: its listing, if built
        already), handed over on a worker thread: a folder of a million names takes a while.
        Two threads may both hand it over; C keeps the first."""
        hot = self.hot
        if hot is None or self.workers is None or not hot.serves_lookups:
            return
        if folder.ino in self._publishing or hot.folder_published(folder.ino):
            return
        self._publishing.add(folder.ino)
        self.workers.submit(self._publish, folder, entries)

    def _publish(self, folder: Node, entries: list[Entry] | None) -> None:
        hot = self.hot
        try:
            if hot is None or not hot.serves_lookups or hot.folder_published(folder.ino):
                return
            if entries is None:
                entries = self.core.listing(folder)
            shown = [
                (e.name, e.ino, e.mode, e.size, e.mtime)
                for e in entries[2:]  # "." and ".." are the kernel's
                if not (folder.ino == ROOT_INO and e.name in _OWN_NAMES)
            ]
            if hot.publish_folder(folder.ino, shown) > 0:
                self.core.stats.add(folders_published=1)
        except Exception:  # its LOOKUPs stay Python's
            log.exception("publishing folder %d for LOOKUPs failed", folder.ino)
        finally:
            self._publishing.discard(folder.ino)

"""How well the cache disk works: paused after a disk-wide error, and the block paths that
fail on their own.

Errors that concern one block path (a folder squatting it, say) cost that block alone; only
errors of the whole disk (full, read-only, failing) turn caching off for a while.
"""

from __future__ import annotations

import errno
import logging
import time

from ..stats import Stats

log = logging.getLogger(__name__)

_DEGRADED_RETRY_S = 30.0
_BAD_PATHS_KEPT = 4096

# Errors that say the cache disk as a whole is unusable: caching pauses for a while. Any
# other OSError concerns one path (EISDIR, ENOTDIR, EEXIST, ENAMETOOLONG, ELOOP, ...) and
# costs only its block.
_DISK_WIDE = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EACCES, errno.EPERM}
)


def disk_wide(exc: OSError) -> bool:
    """Whether ``exc`` says the whole cache disk is unusable (not one path)."""
    return exc.errno in _DISK_WIDE


class DiskHealth:
    """Whether caching is paused, and which block paths are served from the store only."""

    def __init__(self, stats: Stats) -> None:
        self.stats = stats
        self._degraded_until = 0.0
        self._warned = False
        # Block paths that failed on their own (a folder squatting one, say): served from
        # the store without touching the disk again; every other block is cached as usual.
        self._bad_paths: set[str] = set()

    @property
    def degraded(self) -> bool:
        return time.monotonic() < self._degraded_until

    def is_bad(self, path: str) -> bool:
        return path in self._bad_paths

    def degrade(self, exc: BaseException) -> None:
        """A full or read-only cache disk: keep serving from the store, warn once."""
        self.stats.add(cache_write_errors=1)
        self._degraded_until = time.monotonic() + _DEGRADED_RETRY_S
        if not self._warned:
            self._warned = True
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            log.warning("cache disk unusable (%s); reading from the store without caching", reason)
        log.debug("cache write failed", exc_info=exc)

    def skip_path(self, path: str, exc: OSError) -> None:
        """A block path that fails on its own: count it, warn once for it, and serve that
        block from the store from now on; the rest of the cache carries on."""
        self.stats.add(cache_write_errors=1)
        if path in self._bad_paths:
            return
        if len(self._bad_paths) < _BAD_PATHS_KEPT:
            self._bad_paths.add(path)
        log.warning("cannot cache block %s (%s); serving it from the store", path, exc.strerror)

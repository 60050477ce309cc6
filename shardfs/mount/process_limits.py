"""The daemon's process limits: the descriptors it may open, raised to what the system
allows. Published cache blocks hold up to two each (``fuse/hot_path.publish_limit``), and
many systems start a process at 1,024 while allowing far more."""

from __future__ import annotations

import logging
import resource

log = logging.getLogger(__name__)

OPEN_FILES_WANTED = 1 << 16  # enough for every published block, sockets and cache files


def raise_open_files(wanted: int = OPEN_FILES_WANTED) -> int:
    """Raise the soft ``RLIMIT_NOFILE`` towards ``wanted``, within the hard limit; returns
    the soft limit now (unchanged where it was higher already or cannot be raised)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.debug("raising the open files limit to %d failed: %s", target, exc)
            return soft
        log.debug("open files limit raised from %d to %d", soft, target)
        return target
    return soft

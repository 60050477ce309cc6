"""glibc's allocator set for a daemon that receives blocks of a megabyte or more.

By default every such buffer is mapped fresh and unmapped when freed, and each of the
daemon's threads may get an arena of its own that is trimmed back: the kernel then faults
in new pages for every block it copies in from the network, 4 to 9 us a page in this VM
(a quarter of a cold file's system time, `make bench-files`). Kept mapped and shared,
those pages are reused.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
# Free memory above this at the heap's top goes back to the system: bounds what a burst of
# reads leaves resident.
TRIM_THRESHOLD = 128 << 20
# Allocations below this come from the heap, so freed blocks are reused (glibc's ceiling
# for it is 32 MiB on 64-bit).
MMAP_THRESHOLD = 32 << 20
ARENAS = 1  # the interpreter lock serialises the threads' allocations anyway

_SETTINGS = {
    "MALLOC_TRIM_THRESHOLD_": (_M_TRIM_THRESHOLD, TRIM_THRESHOLD),
    "MALLOC_MMAP_THRESHOLD_": (_M_MMAP_THRESHOLD, MMAP_THRESHOLD),
    "MALLOC_ARENA_MAX": (_M_ARENA_MAX, ARENAS),
}


def tune() -> list[str]:
    """Set the three where glibc is the allocator and the environment leaves them unset
    (a user's ``MALLOC_*`` wins); returns the names set. Call before threads start."""
    name = ctypes.util.find_library("c")
    if name is None:
        return []
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return []  # not glibc
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    done = []
    for variable, (option, value) in _SETTINGS.items():
        if variable in os.environ:
            continue
        if mallopt(option, value) == 1:
            done.append(variable)
        else:
            log.debug("mallopt(%d, %d) refused", option, value)
    return done

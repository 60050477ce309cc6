"""Native names for the daemon's threads: each thread started through ``threading`` takes
its Python name (cut to the kernel's 15 bytes), so that ``top -H``, ``ps -L``, ``perf`` and
``/proc/PID/task/*/comm`` tell ``shardfs-fuse`` from ``prefetch-3``. Costs one call per
thread start and nothing per request."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
import threading
from types import FrameType
from typing import Any

log = logging.getLogger(__name__)

_PR_SET_NAME = 15  # prctl(2)
_NAME_BYTES = 15  # the kernel's TASK_COMM_LEN, less its terminating zero


def _prctl() -> Any | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    return getattr(libc, "prctl", None)


def native_name(name: str) -> bytes:
    """``name`` as the kernel keeps a thread's: at most 15 bytes of UTF-8."""
    return name.encode("utf-8", "replace")[:_NAME_BYTES]


def install() -> bool:
    """Name every thread ``threading`` starts from now on after its Python name; False
    where prctl(2) is not reachable (then nothing changes)."""
    prctl = _prctl()
    if prctl is None:
        return False

    def name_this_thread(frame: FrameType, event: str, arg: object) -> None:
        # threading runs this as the new thread's profile function before its run(): the
        # first event names the thread and removes the function again.
        sys.setprofile(None)
        if prctl(_PR_SET_NAME, native_name(threading.current_thread().name), 0, 0, 0) != 0:
            log.debug("naming thread %s failed", threading.current_thread().name)

    threading.setprofile(name_this_thread)
    return True

"""The compiled hot path's library (``_hot.c``, ``_entries.c``) loaded through ctypes: the
signature of every function Python calls, and the counters C keeps, in C's order."""

from __future__ import annotations

import ctypes
import functools
import logging

log = logging.getLogger(__name__)

COUNTERS = (
    "reads", "bytes", "delivered_bytes", "published", "dropped_blocks", "checksum_failures",
    "not_in_memory", "disk_reads", "memory_reads", "lookups", "forgotten", "direct_reads",
    "edge_reads", "watched_reads",
)  # fmt: skip


class Counters(ctypes.Structure):
    """C's ``struct hot_counters``."""

    _fields_ = [(name, ctypes.c_uint64) for name in COUNTERS]


@functools.cache
def load() -> ctypes.CDLL | None:
    try:
        from . import _hot  # type: ignore[attr-defined]
    except ImportError:
        log.info("the compiled FUSE hot path is not built: every request goes to Python")
        return None
    lib = ctypes.CDLL(_hot.__file__)
    lib.hot_new.restype = ctypes.c_void_p
    lib.hot_new.argtypes = [
        ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint64, ctypes.c_uint, ctypes.c_uint64,
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
    ]  # fmt: skip
    lib.hot_publish.restype = ctypes.c_int
    lib.hot_publish.argtypes = [
        ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
        ctypes.c_char_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_void_p, ctypes.POINTER(ctypes.c_int32),
    ]  # fmt: skip
    lib.hot_publish_edge.restype = ctypes.c_int
    lib.hot_publish_edge.argtypes = [
        ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int64, ctypes.c_uint, ctypes.c_int32,
        ctypes.c_int64, ctypes.c_int64, ctypes.c_uint, ctypes.c_int32,
    ]  # fmt: skip
    lib.hot_publish_memory.restype = ctypes.c_int
    lib.hot_publish_memory.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64, ctypes.c_void_p,
        ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int32),
    ]  # fmt: skip
    lib.hot_drop.argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.c_int32]
    lib.hot_answer.restype = ctypes.c_int
    lib.hot_answer.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int64,
    ]  # fmt: skip
    lib.hot_published.restype = ctypes.c_int
    lib.hot_published.argtypes = [ctypes.c_void_p, ctypes.c_uint64]
    lib.hot_counters.argtypes = [ctypes.c_void_p, ctypes.POINTER(Counters)]
    lib.hot_clear.argtypes = [ctypes.c_void_p]
    lib.hot_sweep.restype = ctypes.c_uint
    lib.hot_sweep.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.hot_max_blocks.restype = ctypes.c_uint
    lib.hot_free.argtypes = [ctypes.c_void_p]
    lib.hot_handlers.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    lib.hot_limit_blocks.argtypes = [ctypes.c_void_p, ctypes.c_uint]
    lib.hot_direct_reads.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.hot_start_disk_readers.restype = ctypes.c_uint
    lib.hot_start_disk_readers.argtypes = [ctypes.c_void_p, ctypes.c_uint]
    lib.hot_queue_opened.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.hot_take_opened.restype = ctypes.c_uint
    lib.hot_take_opened.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
    lib.hot_serve_lookups.restype = ctypes.c_int
    lib.hot_serve_lookups.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint32,
        ctypes.c_uint32, ctypes.c_int64, ctypes.c_double, ctypes.c_uint64,
    ]  # fmt: skip
    lib.hot_track_inodes.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.hot_count_lookups.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int64,
    ]  # fmt: skip
    lib.hot_publish_folder.restype = ctypes.c_int64
    lib.hot_publish_folder.argtypes = [
        ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_char_p, ctypes.c_void_p,
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
    ]  # fmt: skip
    lib.hot_folder_published.restype = ctypes.c_int
    lib.hot_folder_published.argtypes = [ctypes.c_void_p, ctypes.c_uint64]
    lib.hot_push.restype = ctypes.c_int64
    lib.hot_push.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64,
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p,
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
    ]  # fmt: skip
    return lib

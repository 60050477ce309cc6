"""A ctypes binding of the part of libfuse 3's low-level API that shardfs uses. No policy.

The low-level API addresses files by inode and lets a request be answered later from any
thread (``fuse_reply_*``). That is what the adapter needs: cached reads are answered on the
session's own thread, and reads that must wait on the network are answered by worker threads.
Structure layouts are libfuse 3.x on 64-bit Linux (``fuse_lowlevel.h``, ``fuse_common.h``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
import sys
from collections.abc import Callable, Sequence
from typing import Any

FUSE_CAP_READDIRPLUS = 1 << 13
FUSE_CAP_READDIRPLUS_AUTO = 1 << 14

c_ino = ctypes.c_uint64
c_req = ctypes.c_void_p


class Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_int64), ("tv_nsec", ctypes.c_int64)]


class Stat(ctypes.Structure):
    """``struct stat`` as glibc lays it out on x86-64 (other architectures differ)."""

    _fields_ = [
        ("st_dev", ctypes.c_uint64),
        ("st_ino", ctypes.c_uint64),
        ("st_nlink", ctypes.c_uint64),
        ("st_mode", ctypes.c_uint32),
        ("st_uid", ctypes.c_uint32),
        ("st_gid", ctypes.c_uint32),
        ("_pad0", ctypes.c_int32),
        ("st_rdev", ctypes.c_uint64),
        ("st_size", ctypes.c_int64),
        ("st_blksize", ctypes.c_int64),
        ("st_blocks", ctypes.c_int64),
        ("st_atim", Timespec),
        ("st_mtim", Timespec),
        ("st_ctim", Timespec),
        ("_reserved", ctypes.c_int64 * 3),
    ]


class EntryParam(ctypes.Structure):
    _fields_ = [
        ("ino", c_ino),
        ("generation", ctypes.c_uint64),
        ("attr", Stat),
        ("attr_timeout", ctypes.c_double),
        ("entry_timeout", ctypes.c_double),
    ]


class FileInfo(ctypes.Structure):
    _fields_ = [
        ("flags", ctypes.c_int),
        ("writepage", ctypes.c_uint, 1),
        ("direct_io", ctypes.c_uint, 1),
        ("keep_cache", ctypes.c_uint, 1),
        ("flush", ctypes.c_uint, 1),
        ("nonseekable", ctypes.c_uint, 1),
        ("flock_release", ctypes.c_uint, 1),
        ("cache_readdir", ctypes.c_uint, 1),
        ("noflush", ctypes.c_uint, 1),
        ("padding", ctypes.c_uint, 24),
        ("padding2", ctypes.c_uint, 32),
        ("fh", ctypes.c_uint64),
        ("lock_owner", ctypes.c_uint64),
        ("poll_events", ctypes.c_uint32),
    ]


class ConnInfo(ctypes.Structure):
    _fields_ = [
        ("proto_major", ctypes.c_uint),
        ("proto_minor", ctypes.c_uint),
        ("max_write", ctypes.c_uint),
        ("max_read", ctypes.c_uint),
        ("max_readahead", ctypes.c_uint),
        ("capable", ctypes.c_uint),
        ("want", ctypes.c_uint),
        ("max_background", ctypes.c_uint),
        ("congestion_threshold", ctypes.c_uint),
        ("time_gran", ctypes.c_uint),
        ("reserved", ctypes.c_uint * 22),
    ]


class StatVfs(ctypes.Structure):
    _fields_ = [
        ("f_bsize", ctypes.c_ulong),
        ("f_frsize", ctypes.c_ulong),
        ("f_blocks", ctypes.c_uint64),
        ("f_bfree", ctypes.c_uint64),
        ("f_bavail", ctypes.c_uint64),
        ("f_files", ctypes.c_uint64),
        ("f_ffree", ctypes.c_uint64),
        ("f_favail", ctypes.c_uint64),
        ("f_fsid", ctypes.c_ulong),
        ("f_flag", ctypes.c_ulong),
        ("f_namemax", ctypes.c_ulong),
        ("_spare", ctypes.c_int * 6),
    ]


class Buf(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("flags", ctypes.c_int),
        ("mem", ctypes.c_void_p),
        ("fd", ctypes.c_int),
        ("pos", ctypes.c_int64),
    ]


class BufVec(ctypes.Structure):
    _fields_ = [
        ("count", ctypes.c_size_t),
        ("idx", ctypes.c_size_t),
        ("off", ctypes.c_size_t),
        ("buf", Buf * 1),
    ]


class Args(ctypes.Structure):
    _fields_ = [
        ("argc", ctypes.c_int),
        ("argv", ctypes.POINTER(ctypes.c_char_p)),
        ("allocated", ctypes.c_int),
    ]


_FI = ctypes.POINTER(FileInfo)

# The callbacks shardfs answers, with their C signatures (the return type is void).
CALLBACK_TYPES: dict[str, Any] = {
    "init": ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(ConnInfo)),
    "lookup": ctypes.CFUNCTYPE(None, c_req, c_ino, ctypes.c_char_p),
    "forget": ctypes.CFUNCTYPE(None, c_req, c_ino, ctypes.c_uint64),
    "getattr": ctypes.CFUNCTYPE(None, c_req, c_ino, _FI),
    "readlink": ctypes.CFUNCTYPE(None, c_req, c_ino),
    "open": ctypes.CFUNCTYPE(None, c_req, c_ino, _FI),
    # fi as a plain address: only reads through open handles (no block cache) look at it.
    "read": ctypes.CFUNCTYPE(None, c_req, c_ino, ctypes.c_size_t, ctypes.c_int64, c_req),
    "release": ctypes.CFUNCTYPE(None, c_req, c_ino, _FI),
    "opendir": ctypes.CFUNCTYPE(None, c_req, c_ino, _FI),
    "readdir": ctypes.CFUNCTYPE(None, c_req, c_ino, ctypes.c_size_t, ctypes.c_int64, _FI),
    "releasedir": ctypes.CFUNCTYPE(None, c_req, c_ino, _FI),
    "statfs": ctypes.CFUNCTYPE(None, c_req, c_ino),
    "getxattr": ctypes.CFUNCTYPE(None, c_req, c_ino, ctypes.c_char_p, ctypes.c_size_t),
    "listxattr": ctypes.CFUNCTYPE(None, c_req, c_ino, ctypes.c_size_t),
    "forget_multi": ctypes.CFUNCTYPE(None, c_req, ctypes.c_size_t, ctypes.c_void_p),
    "readdirplus": ctypes.CFUNCTYPE(None, c_req, c_ino, ctypes.c_size_t, ctypes.c_int64, _FI),
    # (req, ino, cmd, arg, fi, flags, in_buf, in_bufsz, out_bufsz); every default-buffered
    # open() sends one (isatty): fi, unused, stays a plain address (no pointer object).
    "ioctl": ctypes.CFUNCTYPE(
        None,
        c_req,
        c_ino,
        ctypes.c_uint,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_uint,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_size_t,
    ),
}

# Every slot of struct fuse_lowlevel_ops, in order (libfuse 3.x).
_OP_SLOTS = [
    "init",
    "destroy",
    "lookup",
    "forget",
    "getattr",
    "setattr",
    "readlink",
    "mknod",
    "mkdir",
    "unlink",
    "rmdir",
    "symlink",
    "rename",
    "link",
    "open",
    "read",
    "write",
    "flush",
    "release",
    "fsync",
    "opendir",
    "readdir",
    "releasedir",
    "fsyncdir",
    "statfs",
    "setxattr",
    "getxattr",
    "listxattr",
    "removexattr",
    "access",
    "create",
    "getlk",
    "setlk",
    "bmap",
    "ioctl",
    "poll",
    "write_buf",
    "retrieve_reply",
    "forget_multi",
    "flock",
    "fallocate",
    "readdirplus",
    "copy_file_range",
    "lseek",
]


class LowLevelOps(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in _OP_SLOTS]


def _load() -> ctypes.CDLL:
    if platform.machine() != "x86_64" or sys.platform != "linux":
        raise RuntimeError("the FUSE binding supports Linux on x86-64 only")
    name = ctypes.util.find_library("fuse3") or "libfuse3.so.3"
    try:
        lib = ctypes.CDLL(name)
    except OSError as exc:
        raise RuntimeError(f"libfuse 3 is not installed ({exc}); install fuse3") from exc
    signatures: dict[str, tuple[Any, list[Any]]] = {
        "fuse_session_new": (
            ctypes.c_void_p,
            [ctypes.POINTER(Args), ctypes.POINTER(LowLevelOps), ctypes.c_size_t, ctypes.c_void_p],
        ),
        "fuse_session_mount": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_char_p]),
        "fuse_session_loop": (ctypes.c_int, [ctypes.c_void_p]),
        "fuse_session_unmount": (None, [ctypes.c_void_p]),
        "fuse_session_destroy": (None, [ctypes.c_void_p]),
        "fuse_session_exit": (None, [ctypes.c_void_p]),
        "fuse_lowlevel_notify_store": (
            ctypes.c_int,
            [ctypes.c_void_p, c_ino, ctypes.c_int64, ctypes.POINTER(BufVec), ctypes.c_int],
        ),
        "fuse_reply_err": (ctypes.c_int, [c_req, ctypes.c_int]),
        "fuse_reply_none": (None, [c_req]),
        "fuse_req_userdata": (ctypes.c_void_p, [c_req]),
        "fuse_reply_entry": (ctypes.c_int, [c_req, ctypes.POINTER(EntryParam)]),
        "fuse_reply_attr": (ctypes.c_int, [c_req, ctypes.POINTER(Stat), ctypes.c_double]),
        "fuse_reply_open": (ctypes.c_int, [c_req, _FI]),
        "fuse_reply_buf": (ctypes.c_int, [c_req, ctypes.c_char_p, ctypes.c_size_t]),
        "fuse_reply_readlink": (ctypes.c_int, [c_req, ctypes.c_char_p]),
        "fuse_reply_statfs": (ctypes.c_int, [c_req, ctypes.POINTER(StatVfs)]),
        "fuse_reply_xattr": (ctypes.c_int, [c_req, ctypes.c_size_t]),
        "fuse_reply_ioctl": (ctypes.c_int, [c_req, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]),
        "fuse_add_direntry": (
            ctypes.c_size_t,
            [
                c_req,
                ctypes.c_void_p,
                ctypes.c_size_t,
                ctypes.c_char_p,
                ctypes.POINTER(Stat),
                ctypes.c_int64,
            ],
        ),
        "fuse_add_direntry_plus": (
            ctypes.c_size_t,
            [
                c_req,
                ctypes.c_void_p,
                ctypes.c_size_t,
                ctypes.c_char_p,
                ctypes.POINTER(EntryParam),
                ctypes.c_int64,
            ],
        ),
    }
    for symbol, (restype, argtypes) in signatures.items():
        function = getattr(lib, symbol)
        function.restype = restype
        function.argtypes = argtypes
    return lib


_lib: ctypes.CDLL | None = None


def lib() -> ctypes.CDLL:
    """libfuse3, loaded on first use."""
    global _lib
    if _lib is None:
        _lib = _load()
    return _lib


class Session:
    """One mounted FUSE session: ``run`` serves until unmounted or signalled."""

    def __init__(
        self,
        callbacks: dict[str, Callable[..., None]],
        mountpoint: str,
        options: Sequence[str],
        *,
        install: Callable[[LowLevelOps], int] | None = None,
    ) -> None:
        """``install(ops)`` may replace some of the callbacks set in ``ops`` with compiled
        handlers (``hot_path.HotPath``); it returns the session's userdata for them."""
        self._lib = lib()
        self._ops = LowLevelOps()
        self._keep: list[Any] = []  # C function pointers must outlive the session
        for name, func in callbacks.items():
            c_func = CALLBACK_TYPES[name](func)
            self._keep.append(c_func)
            setattr(self._ops, name, ctypes.cast(c_func, ctypes.c_void_p).value)
        userdata = install(self._ops) if install is not None else None
        argv = [b"shardfs", b"-o", ",".join(options).encode()]
        self._argv = (ctypes.c_char_p * len(argv))(*argv)
        self._args = Args(len(argv), self._argv, 0)
        self._se = self._lib.fuse_session_new(
            ctypes.byref(self._args), ctypes.byref(self._ops), ctypes.sizeof(self._ops), userdata
        )
        if not self._se:
            raise RuntimeError("fuse_session_new failed (bad mount options?)")
        if self._lib.fuse_session_mount(self._se, mountpoint.encode()) != 0:
            self._lib.fuse_session_destroy(self._se)
            self._se = None
            raise RuntimeError(f"cannot mount {mountpoint}")
        self._mounted = True
        # notify_store's reusable request: one buffer, and the bytes it points into.
        self._notify_store = self._lib.fuse_lowlevel_notify_store
        self._store_vector = BufVec(1, 0, 0)
        self._store_piece = self._store_vector.buf[0]
        self._store_ref = ctypes.byref(self._store_vector)
        self._store_data: bytes | memoryview | None = None
        self._store_base = 0

    def run(self) -> int:
        """Serve requests on this thread until unmounted or ``exit`` (plus a signal that
        interrupts the thread's wait for the next request)."""
        return int(self._lib.fuse_session_loop(self._se))

    def notify_store(
        self,
        ino: int,
        offset: int,
        data: bytes | memoryview,
        start: int = 0,
        length: int | None = None,
    ) -> int:
        """Put ``length`` bytes of ``data`` from ``start`` (by default all of it) into the
        kernel's page cache of inode ``ino`` at ``offset``, with no copy on our side.

        Returns 0, or a negative errno (``-ENOENT`` when the kernel does not know the inode).
        Never call it from a thread that answers requests: the kernel may wait for a read
        of the same page to be answered first. One thread at a time (the pusher's): the
        request vector is reused, and so is the address of the last ``data`` (every file of
        a block is pushed from the same bytes; the conversions cost more than the call).
        """
        if length is None:
            length = len(data) - start
        if start < 0 or length < 0 or start + length > len(data):
            raise ValueError(f"bytes [{start}:{start + length}] of {len(data)}")
        if data is not self._store_data:
            if isinstance(data, memoryview):  # a writable buffer's view (a reused block)
                base = ctypes.addressof((ctypes.c_char * len(data)).from_buffer(data))
            else:
                base = ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value or 0
            self._store_base = base
            self._store_data = data  # holds the bytes while their address is kept
        piece = self._store_piece
        piece.size = length
        piece.mem = self._store_base + start
        return int(self._notify_store(self._se, ino, offset, self._store_ref, 0))

    def store_target(self) -> tuple[int, int]:
        """``fuse_lowlevel_notify_store``'s address and this session's, for a compiled
        caller (``hot_path.BatchPush``): the same rules as ``notify_store``."""
        address = ctypes.cast(self._notify_store, ctypes.c_void_p).value
        assert address and self._se, "a mounted session"
        return address, int(self._se)

    def exit(self) -> None:
        self._lib.fuse_session_exit(self._se)

    def close(self) -> None:
        if self._se:
            if self._mounted:
                self._lib.fuse_session_unmount(self._se)
                self._mounted = False
            self._lib.fuse_session_destroy(self._se)
            self._se = None

"""What the page cache holds of a file, and dropping it, for tests that check which reads
go past it."""

from __future__ import annotations

import ctypes
import mmap
import os
import time
from pathlib import Path

import pytest


def resident_pages(path: Path, start: int = 0, end: int | None = None) -> int:
    """How many pages of ``path[start:end]`` the page cache holds: mincore(2) over a mapping
    of them, which reads nothing in."""
    end = path.stat().st_size if end is None else end
    page = mmap.PAGESIZE
    first, last = start // page, (end + page - 1) // page
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
    libc.mmap.argtypes += [ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    length = (last - first) * page
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, first * page)
        assert address not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            vector = ctypes.create_string_buffer(last - first)
            assert libc.mincore(address, length, vector) == 0, os.strerror(ctypes.get_errno())
            return sum(byte & 1 for byte in vector.raw)
        finally:
            libc.munmap(address, length)
    finally:
        os.close(fd)


def drop_from_page_cache(path: Path, start: int = 0, end: int | None = None) -> None:
    """Evict ``path`` from the page cache. The kernel may keep pages (another reader, a
    busy machine), so the pages the test needs gone are checked, and dropped again."""
    end = path.stat().st_size if end is None else end
    for _ in range(20):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        if resident_pages(path, start, end) == 0:
            return
        time.sleep(0.05)
    pytest.skip(f"the kernel keeps {path.name} in the page cache despite POSIX_FADV_DONTNEED")

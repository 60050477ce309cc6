"""Addresses of Python memory handed to C (the compiled hot path's calls): shared byte
tables, a block's bytes without a copy, and the arrays of a block's files."""

from __future__ import annotations

import ctypes
from array import array

from ..views.block_files import FileTable


def table_address(buffer: bytearray | None) -> int | None:
    """The address of a table shared with C (None for none or an empty one)."""
    if buffer is None or not buffer:
        return None
    return ctypes.addressof((ctypes.c_char * len(buffer)).from_buffer(buffer))


class _PyBuffer(ctypes.Structure):
    """CPython's ``Py_buffer`` (the buffer protocol's view of an object's memory)."""

    _fields_ = [
        ("buf", ctypes.c_void_p), ("obj", ctypes.c_void_p), ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t), ("readonly", ctypes.c_int), ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p), ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p), ("internal", ctypes.c_void_p),
    ]  # fmt: skip


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
_get_buffer.restype = ctypes.c_int
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = [ctypes.POINTER(_PyBuffer)]
_release_buffer.restype = None
_PYBUF_SIMPLE = 0  # contiguous bytes, read-only allowed


def data_address(data: bytes | memoryview) -> tuple[int, object]:
    """The address of ``data``'s bytes and the object that holds them (keep it alive while
    C reads them). Never a copy: a read-only slice of a larger object (a block cut from a
    fetched range) is addressed in place, through the buffer protocol."""
    if isinstance(data, bytes):
        return ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value or 0, data
    if not data.readonly:
        if not data:
            return 0, data
        probe = ctypes.c_char.from_buffer(data)  # no array type of this length to build
        try:
            return ctypes.addressof(probe), data
        finally:
            del probe  # releases the export at once
    if not data.c_contiguous:
        raw = data.tobytes()
        return ctypes.cast(ctypes.c_char_p(raw), ctypes.c_void_p).value or 0, raw
    view = _PyBuffer()
    if _get_buffer(data, ctypes.byref(view), _PYBUF_SIMPLE) != 0:
        raise BufferError("no buffer for the block's bytes")
    address = view.buf or 0
    _release_buffer(ctypes.byref(view))  # ``data`` itself, kept alive, holds the memory
    return address, data


def tables(files: FileTable) -> tuple[int | None, int | None, int | None]:
    """The addresses of a file table's three arrays (inodes, positions, sizes), as C takes
    them (None for an empty table)."""
    return array_address(files.inos), array_address(files.positions), array_address(files.sizes)


def array_address(values: array[int]) -> int | None:
    address, _ = values.buffer_info()
    return address if values else None

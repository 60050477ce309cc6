"""Ranged GETs through any other fsspec filesystem (GCS, the Hugging Face hub, memory).

Such a store offers no checked path of ours: only the answer's length can be checked
against the request. Only ``store.Store`` uses this module.
"""

from __future__ import annotations

from typing import Any

from .responses import WrongLengthError


def get_range(fs: Any, path: str, name: str, start: int, end: int, timeout: float) -> bytes:
    """Bytes ``[start, end)`` of the object at ``path`` (shard ``name``), or
    WrongLengthError when the store sends another length."""
    loop = getattr(fs, "loop", None)
    cat = getattr(fs, "_cat_file", None)
    if getattr(fs, "async_impl", False) and loop is not None and cat is not None:
        from fsspec.asyn import sync

        data = bytes(sync(loop, cat, path, start=start, end=end, timeout=timeout))
    else:
        data = bytes(fs.cat_file(path, start=start, end=end))
    if len(data) != end - start:
        raise WrongLengthError(f"{name}: store returned {len(data)} bytes for [{start}:{end}]")
    return data

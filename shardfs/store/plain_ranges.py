"""Ranged reads that take no HTTP client of ours: shards in a local folder, read with
``pread`` and refused if the file is not the indexed version, and any other fsspec
filesystem (GCS, the Hugging Face hub, memory), where only the answer's length can be
checked. Only ``store.Store`` uses this module.
"""

from __future__ import annotations

import os
from typing import Any

from .client import version_of
from .responses import PreconditionFailed, WrongLengthError
from .shards import ShardInfo


def read_local_file(path: str, shard: ShardInfo, start: int, end: int) -> bytes:
    """Bytes of a shard in a local folder, refused if the file is not the indexed version."""
    fd = os.open(path, os.O_RDONLY)
    try:
        status = os.fstat(fd)
        version = version_of({"mtime": status.st_mtime})
        if status.st_size != shard.size or (
            shard.etag.startswith("mtime:") and version != shard.etag
        ):
            raise PreconditionFailed(f"{path}: size or modification time differs from the index")
        data = os.pread(fd, end - start, start)
    finally:
        os.close(fd)
    if len(data) != end - start:
        raise WrongLengthError(f"{path}: read {len(data)} bytes of [{start}:{end}]")
    return data


def fsspec_range(fs: Any, path: str, name: str, start: int, end: int, timeout: float) -> bytes:
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

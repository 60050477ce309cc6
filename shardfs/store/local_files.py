"""Shards in a local folder, read with ``pread`` instead of through fsspec."""

from __future__ import annotations

import os

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

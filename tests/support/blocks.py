"""Block files of a cache folder, as tests look at them."""

from __future__ import annotations

from pathlib import Path

from shardfs.cache import block_file_size


def encoded_bytes(path: Path) -> int:
    """A valid block file's header + data length, which the cache counts (a file written
    with O_DIRECT has up to a page of zeros after them)."""
    size = block_file_size(str(path), path.parent.name, int(path.name))
    assert size is not None, f"not a valid block file: {path}"
    return size

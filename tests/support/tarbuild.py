"""Helpers for the unit tests: tar shards built in memory with ``tarfile``, and unique
prefixes on fsspec's process-global memory filesystem."""

from __future__ import annotations

import io
import tarfile
import uuid
from collections.abc import Iterable

import fsspec

from shardfs.config import SourceConfig
from shardfs.store.remote import Store

MTIME = 1_700_000_000

Entry = tuple[str, bytes] | tarfile.TarInfo
"""A regular file as ``(name, data)``, or any other member as a ready ``TarInfo``."""


def directory(name: str, mode: int = 0o750) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE
    info.mode = mode
    info.mtime = MTIME
    return info


def symlink(name: str, target: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = tarfile.SYMTYPE
    info.linkname = target
    info.mtime = MTIME
    return info


def hardlink(name: str, target: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = tarfile.LNKTYPE
    info.linkname = target
    info.mtime = MTIME
    return info


def make_tar(entries: Iterable[Entry], fmt: int = tarfile.PAX_FORMAT) -> bytes:
    """A complete tar archive of ``entries``, in order."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for entry in entries:
            if isinstance(entry, tarfile.TarInfo):
                tar.addfile(entry)
                continue
            name, data = entry
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            info.mtime = MTIME
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def data_offset(archive: bytes, name: str) -> int:
    """Where the data of member ``name`` starts, according to ``tarfile``."""
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        return tar.getmember(name).offset_data


def memory_url() -> str:
    """A fresh ``memory://`` prefix; the memory filesystem is shared by the whole process."""
    return f"memory://unit-{uuid.uuid4().hex[:12]}/data"


def put(url: str, name: str, data: bytes) -> None:
    fs, root = fsspec.core.url_to_fs(url)
    fs.pipe_file(f"{root}/{name}", data)


def remove(url: str, name: str) -> None:
    fs, root = fsspec.core.url_to_fs(url)
    fs.rm(f"{root}/{name}")


def store_with(shards: dict[str, bytes], url: str | None = None) -> Store:
    """A Store over a fresh memory prefix holding ``shards`` (name -> bytes)."""
    url = url or memory_url()
    for name, data in shards.items():
        put(url, name, data)
    return Store(SourceConfig(url))

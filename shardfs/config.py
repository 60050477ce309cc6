"""Configuration: one frozen dataclass per component. The CLI builds these, nothing else."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .errors import UsageError

Layout = Literal["auto", "raw", "imagefolder"]


def default_cache_dir() -> Path:
    """``$SHARDFS_CACHE_DIR``, else ``$XDG_CACHE_HOME/shardfs``, else ``~/.cache/shardfs``."""
    if env := os.environ.get("SHARDFS_CACHE_DIR"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "shardfs"


@dataclass(frozen=True)
class SourceConfig:
    """Where the shards live.

    url: fsspec URL (or plain local path) of a folder/prefix holding ``*.tar`` shards, of one
        ``.tar``, a brace pattern such as ``s3://b/train-{000000..000146}.tar``, or a glob
        such as ``https://host/train-*.tar`` (on stores that list).
    storage_options: passed to the fsspec filesystem (``--storage-option key=value``).
        Default: none.
    endpoint_url: S3-compatible endpoint (``--endpoint-url``). Default: None, which lets
        the standard environment (``AWS_ENDPOINT_URL``) decide.
    read_timeout: seconds a ranged read may take, retries included, before it fails (EIO
        for a reader) (``--read-timeout``). Default: 30.
    connect_timeout: seconds to open a connection to the store. Default: 10.
    stall_timeout: seconds a response may go without sending a byte before the request is
        abandoned and retried. Default: 10.
    extra_urls: further sources, each like ``url`` and on any store, mounted into the same
        tree (``shardfs mount A B MNT``); where two present the same path, the later source
        wins, as the later shard does. The storage options apply to every source, the
        endpoint to the S3 ones. Default: none.
    shard_format: ``auto`` (each shard's parser by its name's suffix) or a format (``tar``,
        ``zip``, ``parquet``, ``mds``): a folder listing then takes that format's shards
        alone, and a glob or brace pattern takes every name it matches as that format
        (``--format``). Default: auto.
    """

    url: str
    storage_options: dict[str, Any] = field(default_factory=dict)
    endpoint_url: str | None = None
    read_timeout: float = 30.0
    connect_timeout: float = 10.0
    stall_timeout: float = 10.0
    extra_urls: tuple[str, ...] = ()
    shard_format: str = "auto"

    @property
    def urls(self) -> tuple[str, ...]:
        """Every source URL, in command-line order."""
        return (self.url, *self.extra_urls)

    def describe(self) -> str:
        """The sources as the user named them, for messages."""
        return ", ".join(self.urls)


@dataclass(frozen=True)
class ViewConfig:
    """How shard members are presented.

    layout: ``auto`` (default) picks ``imagefolder`` when members look like webdataset
        samples with labels, else ``raw``.
    classes: class names, index = label (``--classes FILE``). Default: None, which uses a
        ``classes.txt`` next to the shards when present, else zero-padded labels.
    """

    layout: Layout = "auto"
    classes: tuple[str, ...] | None = None


@dataclass(frozen=True)
class IndexConfig:
    """How the global index is built and kept.

    cache_dir: where the SQLite index and views are persisted. Default: ``default_cache_dir()``.
    skip_bad_shards: leave out corrupt shards with a warning instead of failing. Default: False.
    scan_workers: shards streamed in parallel while indexing. Default: 8.
    use_sidecar: use a valid index sidecar stored next to the shards. Default: True.
    """

    cache_dir: Path = field(default_factory=default_cache_dir)
    skip_bad_shards: bool = False
    scan_workers: int = 8
    use_sidecar: bool = True


@dataclass(frozen=True)
class ReadConfig:
    """How file reads reach the store.

    whole_file_limit: a file up to this size is fetched with one ranged GET on its first
        read and served from memory until closed. Default: 8 MiB.
    window: larger files are fetched in windows of this size. Default: 8 MiB.
    retries: attempts per ranged GET before the read fails with EIO. Default: 4.
    """

    whole_file_limit: int = 8 << 20
    window: int = 8 << 20
    retries: int = 4


@dataclass(frozen=True)
class MountConfig:
    """How the FUSE mount behaves.

    mountpoint: an existing empty directory.
    foreground: stay attached instead of daemonizing. Default: False.
    kernel_timeout: seconds the kernel may cache entries and attributes; the dataset is
        immutable, so this is long. Default: 86400.
    allow_other: let other users read the mount. Default: False.
    allow_root: let root (besides the owner) read the mount. Default: False.
    nonempty: mount over a folder that is not empty (its content is hidden meanwhile).
        Default: False.
    threads: answer reads that wait on the store from worker threads, so one slow GET
        does not block other readers. Default: True.
    kernel_push: put the files of each block that reaches the block cache into the
        kernel's page cache, so reading them needs no request to the daemon. Default: True.
    uid, gid: the owner and group every file and folder shows (``--uid``, ``--gid``).
        Default: None, the user and group of the mounting process.
    file_mode: permission bits of every regular file (``--file-mode``). Default: None,
        read-only for everyone plus the member's own execute bits.
    dir_mode: permission bits of every folder (``--dir-mode``). Default: None, 0o555.
    fsname: what the mount table shows as the mounted source (``findmnt``, ``df``,
        ``mount``); the CLI gives the source URLs (``source_urls.table_name``). Its type is
        always ``fuse.shardfs``, by which shardfs finds its mounts. Default: ``shardfs``.
    """

    mountpoint: Path
    foreground: bool = False
    kernel_timeout: float = 86400.0
    allow_other: bool = False
    allow_root: bool = False
    nonempty: bool = False
    threads: bool = True
    kernel_push: bool = True
    uid: int | None = None
    gid: int | None = None
    file_mode: int | None = None
    dir_mode: int | None = None
    fsname: str = "shardfs"


def parse_storage_option(text: str) -> tuple[str, Any]:
    """Parse ``key=value``; dotted keys nest (``client_kwargs.region_name=x``).

    Values that read as JSON (numbers, true/false, objects) are decoded, others stay strings.
    """
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise UsageError(f"storage option must be key=value, got {text!r}")
    value: Any
    try:
        value = json.loads(raw)
    except ValueError:
        value = raw
    if isinstance(value, str) and raw.lower() in ("true", "false"):
        value = raw.lower() == "true"
    return key, value


def storage_options_from_pairs(pairs: list[str]) -> dict[str, Any]:
    """Build nested storage options from repeated ``--storage-option key=value`` flags."""
    options: dict[str, Any] = {}
    for text in pairs:
        key, value = parse_storage_option(text)
        *parents, leaf = key.split(".")
        if not all(parents) or not leaf:
            raise UsageError(f"storage option {key!r} has an empty part between dots")
        target = options
        for part in parents:
            target = target.setdefault(part, {})
            if not isinstance(target, dict):
                raise UsageError(f"storage option {key!r} conflicts with an earlier value")
        if isinstance(target.get(leaf), dict) and not isinstance(value, dict):
            raise UsageError(f"storage option {key!r} conflicts with an earlier value")
        target[leaf] = value
    return options


LOGS_KEPT = 20  # a backgrounded mount's logs kept in CACHE_DIR/logs (newest first)

_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """Parse ``512``, ``64K``, ``256MB``, ``500G``, ``1.5TiB`` into bytes (binary units)."""
    cleaned = text.strip().upper().removesuffix("IB").removesuffix("B")
    number, unit = cleaned, ""
    if cleaned and cleaned[-1] in _SIZE_UNITS:
        number, unit = cleaned[:-1], cleaned[-1]
    try:
        value = float(number)
    except ValueError:
        raise UsageError(f"not a size: {text!r} (examples: 64K, 256MB, 500G)") from None
    if not math.isfinite(value):
        raise UsageError(f"not a size: {text!r} (examples: 64K, 256MB, 500G)")
    if value < 0:
        raise UsageError(f"size must not be negative: {text!r}")
    return int(value * _SIZE_UNITS[unit])


def format_bytes(count: float) -> str:
    """``512 B``, ``7.3 MiB``: sizes in messages, in binary units like ``parse_size``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


def plural(count: int, noun: str) -> str:
    """``1 shard``, ``2 shards``: counts in messages."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


@dataclass(frozen=True)
class CacheConfig:
    """The persistent block cache.

    cache_dir: where blocks live (``CACHE_DIR/blocks``). Default: ``default_cache_dir()``.
    size: the bound, in bytes or as a percentage of the cache disk (``"20%"``).
        Default: ``"50%"`` of the disk that holds ``cache_dir``.
    min_free: free space always left on the cache disk; the cache shrinks below ``size``
        to keep it. Default: 1 GiB.
    block_size: bytes per block; a block never spans two shards. Default: 8 MiB (see
        docs/design.md for the measurement).
    chunk_size: bytes per checksummed chunk inside a block, so a small read verifies only
        what it returns. Default: 64 KiB.
    enabled: False serves every read from the store (``--no-cache``). Default: True.
    """

    cache_dir: Path = field(default_factory=default_cache_dir)
    size: str = "50%"
    min_free: int = 1 << 30
    block_size: int = 8 << 20
    chunk_size: int = 64 << 10
    enabled: bool = True


def resolve_cache_size(spec: str, disk_bytes: int) -> int:
    """``"500G"`` -> bytes; ``"20%"`` -> that share of ``disk_bytes``."""
    text = spec.strip()
    if text.endswith("%"):
        try:
            share = float(text[:-1])
        except ValueError:
            raise UsageError(f"not a percentage: {spec!r}") from None
        if not 0 < share <= 100:
            raise UsageError(f"cache size percentage must be in (0, 100]: {spec!r}")
        return int(disk_bytes * share / 100)
    return parse_size(text)


Prefetch = Literal["none", "shard", "all"]
MissFetch = Literal["block", "range"]


@dataclass(frozen=True)
class ReadaheadConfig:
    """Background fetching into the block cache.

    prefetch: ``shard`` (default) fetches the rest of a shard once a reader touches it;
        ``all`` fetches every shard from mount time on; ``none`` fetches only what is read.
    streams: concurrent background GETs (``--prefetch-streams``). Default: 8 (see
        docs/design.md for the measurement).
    miss_fetch: what a read that misses the cache fetches: ``block`` (default) its whole
        block in one GET; ``range`` only the bytes asked for, with the rest of the block
        fetched in the background. See docs/design.md for the measurement.
    """

    prefetch: Prefetch = "shard"
    streams: int = 8
    miss_fetch: MissFetch = "block"

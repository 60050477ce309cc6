"""Which parser indexes a shard, by its name: tar shards are streamed front to back by
``shardfs.index.scan``; every other format registers a scanner here that reads the shard
by range (``ShardBytes``) and returns its index rows.

A scanner's rows follow the tar rows' contract (``MemberRow``): paths relative to the
shard's folder that went through ``normalize_member_path``, data offsets that are direct
byte ranges of the shard, and ``CorruptShardError`` (``UnsafeMemberError``) for a shard it
cannot present."""

from __future__ import annotations

from collections.abc import Callable

from ..store.urls import is_shard_name
from .mds import scan_mds, scan_mds_zstd
from .members import MemberRow
from .parquet import scan_parquet
from .source import ShardBytes
from .tar_gz import scan_tar_gz
from .units import DecodedScan
from .zip import scan_zip

Scanner = Callable[[ShardBytes], "list[MemberRow] | DecodedScan"]

# Name suffix -> scanner. Every suffix here is also in ``shardfs.store.urls.SHARD_SUFFIXES``
# (tests/test_formats_registry.py checks it), so that listings pick the shards up.
SCANNERS: dict[str, Scanner] = {
    ".zip": scan_zip,
    ".parquet": scan_parquet,
    ".mds": scan_mds,
    ".mds.zstd": scan_mds_zstd,
    ".tar.gz": scan_tar_gz,
    ".tgz": scan_tar_gz,
}


# Formats whose scan reads by whole cache blocks, handed to the cache: a zip's local headers
# sit before every member, so its scan touches nearly every block anyway, and those bytes
# are then not fetched again. The others read exact small ranges (a parquet footer and page
# heads, an MDS offsets table and labels) and leave the images to the first epoch, so that
# a mount costs a few percent of the data, also through a cache smaller than the dataset.
WHOLE_BLOCK_SCANS = (".zip",)


def reads_whole_blocks(name: str, shard_format: str = "auto") -> bool:
    """Whether the scan of this shard reads whole cache blocks (``WHOLE_BLOCK_SCANS``)."""
    if shard_format != "auto" and not is_shard_name(name, shard_format):
        return f".{shard_format}" in WHOLE_BLOCK_SCANS
    return name.endswith(WHOLE_BLOCK_SCANS)


# The scanner of each format for ``--format``, whatever the shard's name (tar: None).
FORMAT_SCANNERS: dict[str, Scanner | None] = {
    "tar": None,
    "zip": scan_zip,
    "parquet": scan_parquet,
    "mds": scan_mds,
}


def scanner_for(name: str, shard_format: str = "auto") -> Scanner | None:
    """The scanner of a shard, or None for a tar shard (streamed by the index scan): by the
    name's suffix; with ``shard_format`` (``--format``), that format's, whatever the name."""
    if shard_format != "auto" and not is_shard_name(name, shard_format):
        return FORMAT_SCANNERS[shard_format]
    for suffix, scanner in SCANNERS.items():
        if name.endswith(suffix):
            return scanner
    return None

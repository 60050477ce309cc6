"""Which parser indexes a shard, by its name: tar shards are streamed front to back by
``shardfs.index.scan``; every other format registers a scanner here that reads the shard
by range (``ShardBytes``) and returns its index rows.

A scanner's rows follow the tar rows' contract (``MemberRow``): paths relative to the
shard's folder that went through ``normalize_member_path``, data offsets that are direct
byte ranges of the shard, and ``CorruptShardError`` (``UnsafeMemberError``) for a shard it
cannot present."""

from __future__ import annotations

from collections.abc import Callable

from .mds import refuse_zstd, scan_mds
from .members import MemberRow
from .parquet import scan_parquet
from .source import ShardBytes

Scanner = Callable[[ShardBytes], list[MemberRow]]

# Name suffix -> scanner. Every suffix here is also in ``shardfs.store.urls.SHARD_SUFFIXES``
# (tests/test_formats_registry.py checks it), so that listings pick the shards up.
SCANNERS: dict[str, Scanner] = {
    ".parquet": scan_parquet,
    ".mds": scan_mds,
    ".mds.zstd": refuse_zstd,
}


def scanner_for(name: str) -> Scanner | None:
    """The scanner of a shard name, or None for a tar shard (streamed by the index scan)."""
    for suffix, scanner in SCANNERS.items():
        if name.endswith(suffix):
            return scanner
    return None

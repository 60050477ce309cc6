"""The configuration objects that several commands build from their parsed flags. The
commands build these and hand them to the core; they decide nothing else."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..config import (
    CacheConfig,
    IndexConfig,
    ReadaheadConfig,
    SourceConfig,
    default_cache_dir,
    format_bytes,
    parse_size,
    resolve_cache_size,
    storage_options_from_pairs,
)
from ..errors import UsageError

MIN_CACHE_BLOCKS = 4  # fewer, and readers evict each other's blocks before they are read


def source_config(args: argparse.Namespace) -> SourceConfig:
    urls = args.dest if args.command == "pack" else args.source
    urls = [urls] if isinstance(urls, str) else urls  # several for mount, index, warm, verify
    return SourceConfig(
        url=urls[0],
        extra_urls=tuple(urls[1:]),
        storage_options=storage_options_from_pairs(args.storage_option),
        endpoint_url=args.endpoint_url,
        read_timeout=getattr(args, "read_timeout", SourceConfig.read_timeout),
        shard_format=getattr(args, "shard_format", "auto"),
    )


def index_config(args: argparse.Namespace) -> IndexConfig:
    cache_dir = args.cache_dir if args.cache_dir is not None else default_cache_dir()
    return IndexConfig(
        cache_dir=cache_dir.absolute(),
        skip_bad_shards=getattr(args, "skip_bad_shards", False),
        use_sidecar=not getattr(args, "no_sidecar", False),
    )


def cache_config(args: argparse.Namespace, cache_dir: Path) -> CacheConfig:
    block_size = parse_size(args.block_size)
    if not 64 << 10 <= block_size <= 256 << 20:
        raise UsageError(f"--block-size {args.block_size}: must be between 64K and 256M")
    config = CacheConfig(
        cache_dir=cache_dir,
        size=args.cache_size,
        min_free=parse_size(args.cache_min_free),
        block_size=block_size,
        enabled=not getattr(args, "no_cache", False),
    )
    resolve_cache_size(config.size, 1)  # reject a malformed --cache-size before mounting
    if config.enabled:
        _check_cache_bound(config)
    return config


def _check_cache_bound(config: CacheConfig) -> None:
    """Refuse a bound under a few blocks: with it every read evicts a block another reader
    still needs, and the same bytes are fetched again and again. A share of the disk
    (``50%``) is not checked: if it comes out that small, the disk is small or full, and the
    cache degrades (one warning; reads go to the store, fetching only what is read)."""
    if config.size.strip().endswith("%"):
        return
    least = MIN_CACHE_BLOCKS * config.block_size
    if parse_size(config.size) < least:
        raise UsageError(
            f"--cache-size {config.size}: under {MIN_CACHE_BLOCKS} blocks of "
            f"{format_bytes(config.block_size)}, so reads would fetch the same blocks again "
            f"and again; give at least {format_bytes(least)}, or --no-cache to read without "
            "a cache"
        )


def readahead_config(args: argparse.Namespace) -> ReadaheadConfig:
    if args.prefetch_streams < 1:
        raise UsageError("--prefetch-streams must be at least 1")
    return ReadaheadConfig(
        prefetch=getattr(args, "prefetch", "all"),
        streams=args.prefetch_streams,
        miss_fetch=getattr(args, "miss_fetch", "block"),
    )

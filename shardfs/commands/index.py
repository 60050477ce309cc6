"""``shardfs index``: build the index ahead of the first mount, and optionally store it
next to the shards so that no machine has to scan them."""

from __future__ import annotations

import argparse
import sys

from ..config import plural
from ..errors import UsageError
from ._arguments import long_options_argument, read_arguments, source_arguments
from ._command import Command
from ._configs import index_config, source_config
from ._output import progress_printer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source_arguments(parser, several=True)
    long_options_argument(parser)
    read_arguments(parser)
    parser.add_argument(
        "--write-sidecar",
        action="store_true",
        help="upload the index next to the shards as .shardfs-index.sqlite",
    )


def run(args: argparse.Namespace) -> int:
    from ..index.db import SIDECAR_NAME, IndexBuilder, write_sidecar
    from ..mount.mountpoints import check_cache_dir
    from ..store.sets import open_store

    source = source_config(args)
    if args.write_sidecar and source.extra_urls:
        raise UsageError(
            "--write-sidecar takes one SOURCE: a sidecar lies next to one source's shards "
            "(run shardfs index --write-sidecar once per source)"
        )
    if args.write_sidecar and source.shard_format != "auto":
        raise UsageError(
            f"--write-sidecar with --format {source.shard_format}: a sidecar serves mounts "
            "that pick each shard's format by its name; index without --format to write one"
        )
    indexing = index_config(args)
    check_cache_dir(indexing.cache_dir)
    store = open_store(source)
    shards = store.list_shards()
    for line in store.listing_warnings:
        print(f"shardfs: warning: {line}", file=sys.stderr)
    builder = IndexBuilder(store, indexing, progress=progress_printer())
    path = builder.build(shards)
    for bad in builder.bad_shards():
        print(
            f"shardfs: warning: skipped bad shard {bad.name}: {bad.reason} at offset {bad.offset}",
            file=sys.stderr,
        )
    print(f"indexed {plural(len(shards), 'shard')} ({builder.scanned_shards} scanned) into {path}")
    if args.write_sidecar:
        write_sidecar(store, path)
        print(f"wrote sidecar {SIDECAR_NAME} next to the shards")
    return 0


COMMAND = Command(
    name="index",
    summary="build the index ahead of time (optionally as a sidecar next to the shards)",
    description="Scan the shards of SOURCE into the persisted index (of several SOURCEs: "
    "the one index their mount uses). With --write-sidecar, also store it next to the "
    "shards so that any machine mounts without scanning.",
    examples=("shardfs index s3://bucket/train/ --write-sidecar",),
    add_arguments=add_arguments,
    run=run,
)

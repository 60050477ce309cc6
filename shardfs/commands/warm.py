"""``shardfs warm``: fetch a whole dataset into the block cache ahead of the mounts."""

from __future__ import annotations

import argparse
import sys

from ._arguments import (
    cache_arguments,
    long_options_argument,
    prefetch_arguments,
    read_arguments,
    source_arguments,
)
from ._command import Command
from ._configs import cache_config, index_config, readahead_config, source_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source_arguments(parser, several=True)
    long_options_argument(parser)
    read_arguments(parser)
    cache_arguments(parser)
    prefetch_arguments(parser, misses=False)


def run(args: argparse.Namespace) -> int:
    from ..tools.warm import warm

    indexing = index_config(args)
    report = warm(
        source_config(args),
        indexing,
        cache_config(args, indexing.cache_dir),
        readahead_config(args),
        show_progress=sys.stderr.isatty(),
    )
    print(report.summary())
    return 0


COMMAND = Command(
    name="warm",
    summary="stream a whole dataset into the local block cache",
    description="Fetch every block of every shard of SOURCE (or of several) into the block "
    "cache, with concurrent ranged GETs, so that the next mount reads nothing from the store.",
    examples=(
        "shardfs warm s3://bucket/train/ --cache-size 200G",
        "shardfs warm s3://bucket/train/ -o prefetch_streams=32",
    ),
    add_arguments=add_arguments,
    run=run,
)

"""``shardfs verify`` (also run by ``pack --verify``): compare a packed dataset with the
tree it was packed from, by hash, without mounting."""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path

from ..config import ViewConfig
from ..errors import UsageError
from ._arguments import long_options_argument, read_arguments, source_arguments
from ._command import Command
from ._configs import index_config, source_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src_dir", type=Path, help="the folder tree that was packed")
    source_arguments(parser, several=True)
    long_options_argument(parser)
    read_arguments(parser)


def run(args: argparse.Namespace) -> int:
    if not args.src_dir.is_dir():
        raise UsageError(f"{args.src_dir}: not a folder")
    return compare(args)


def compare(args: argparse.Namespace) -> int:
    """Compare ``args.src_dir`` with the shards at the source (``dest`` for pack); 4 on a
    difference."""
    from ..tools.progress import new_bar, scan_progress, shows_progress
    from ..tools.verify import verify

    bar = new_bar("verifying", unit="shard") if shows_progress() else None
    lock = threading.Lock()  # shards are hashed on several threads

    def hashed(done: int, total: int, _done_bytes: int, _total_bytes: int) -> None:
        if bar is not None:
            with lock:
                bar.total = total
                bar.update(max(0, done - bar.n))

    try:
        report = verify(
            args.src_dir,
            source_config(args),
            index_config(args),
            ViewConfig(layout="auto"),
            progress=hashed,
            scan_progress=scan_progress(),
        )
    finally:
        if bar is not None:
            bar.close()
    if report.ok:
        print(f"verified: {report.summary()}")
        return 0
    print(f"shardfs: error: verify failed: {report.summary()}", file=sys.stderr)
    return 4


COMMAND = Command(
    name="verify",
    summary="compare a packed dataset with its source tree, by hash, without mounting",
    description="Read every file of SOURCE's shards (of several SOURCEs: of the tree their "
    "mount shows) and compare it, by SHA-256, with the same file under SRC_DIR; report files "
    "missing, extra or different. Exit 4 on a difference.",
    examples=("shardfs verify ./imagenet/train s3://bucket/train",),
    add_arguments=add_arguments,
    run=run,
)

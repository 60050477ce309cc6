"""``shardfs pack``: write a folder tree as tar shards plus an index sidecar, and with
``--verify`` compare the result with the tree."""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ..config import format_bytes, parse_size, plural
from ..errors import UsageError
from ._arguments import cache_dir_argument, long_options_argument, source_arguments
from ._command import Command
from ._configs import source_config
from .verify import compare


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src_dir", type=Path, help="the folder tree to pack")
    source_arguments(parser, positional="dest", what="where to write the shards")
    long_options_argument(parser)
    cache_dir_argument(parser, "with --verify: where the index of the packed shards goes")
    parser.add_argument(
        "--format",
        choices=("tree", "webdataset"),
        default="tree",
        help="tree (default): members are CLASS/FILE, mounted with the raw view; webdataset: "
        "CLASS/KEY.ext + CLASS/KEY.cls and a classes.txt, mounted with the imagefolder view",
    )
    parser.add_argument(
        "--shard-size",
        default="256M",
        metavar="SIZE",
        help="close a shard before it exceeds SIZE (default: 256M)",
    )
    parser.add_argument("--max-count", type=int, default=None, help="at most N files per shard")
    parser.add_argument(
        "--shuffle-seed",
        type=int,
        default=None,
        metavar="N",
        help="spread files (and so classes) across shards in a random order fixed by N; "
        "default: sorted order",
    )
    parser.add_argument(
        "--resume", action="store_true", help="continue an interrupted pack into DEST"
    )
    parser.add_argument(
        "--skip-errors",
        action="store_true",
        help="leave out unreadable files and broken symlinks, and list them",
    )
    parser.add_argument(
        "--workers", type=int, default=4, help="shards written in parallel (default: 4)"
    )
    parser.add_argument(
        "--verify",
        action="store_true",
        help="afterwards, compare the packed dataset with SRC_DIR by hash",
    )


def run(args: argparse.Namespace) -> int:
    from ..tools.pack import PackConfig, Packer

    if args.max_count is not None and args.max_count < 1:
        raise UsageError("--max-count must be at least 1")
    config = PackConfig(
        format=args.format,
        shard_size=parse_size(args.shard_size),
        max_count=args.max_count,
        shuffle_seed=args.shuffle_seed,
        resume=args.resume,
        skip_errors=args.skip_errors,
        workers=args.workers,
    )
    progress, close = _progress_bar()
    started = time.perf_counter()
    try:
        report = Packer(args.src_dir, source_config(args), config, progress=progress).run()
    finally:
        close()
    seconds = time.perf_counter() - started
    for text in report.left_out:
        print(f"shardfs: left out {text}", file=sys.stderr)
    for error in report.errors:
        print(f"shardfs: skipped: {error}", file=sys.stderr)
    resumed = f", {report.skipped_existing} already there" if report.skipped_existing else ""
    print(
        f"packed {plural(report.files, 'file')} ({format_bytes(report.bytes)}) into "
        f"{plural(report.shards, 'shard')} at {args.dest}{resumed} in {seconds:.1f} s "
        f"({report.bytes / max(seconds, 1e-9) / 1e6:.0f} MB/s)"
    )
    if args.verify:
        return compare(args)
    return 0


def _progress_bar() -> tuple[Callable[[int, int, int, int], None] | None, Callable[[], None]]:
    """A bar (bytes, throughput, ETA, files) when stderr is a terminal."""
    from ..tools.progress import new_bar, shows_progress

    if not shows_progress():
        return None, lambda: None
    bar = new_bar("packing")
    lock = threading.Lock()

    def progress(files: int, total_files: int, done: int, total: int) -> None:
        with lock:
            bar.total = total
            bar.update(done - bar.n)
            bar.set_postfix_str(f"{files}/{total_files} files", refresh=False)

    return progress, bar.close


COMMAND = Command(
    name="pack",
    summary="pack a folder tree (e.g. an ImageFolder) into tar shards plus an index sidecar",
    description="Pack every file under SRC_DIR into tar shards at DEST (any fsspec URL, "
    "outside SRC_DIR), with an index sidecar so the first mount needs no scan. No file is "
    "dropped: shards hold any number of files and the last one may be small. shardfs's own "
    "files are no data: an earlier pack's output inside SRC_DIR is left out, and said so.",
    examples=(
        "shardfs pack ./imagenet/train s3://bucket/train --format webdataset --verify",
        "shardfs pack ./photos /data/shards --shard-size 1G --shuffle-seed 0",
    ),
    add_arguments=add_arguments,
    run=run,
)

"""Flags that several commands share, so each is spelled and documented once."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..config import ReadaheadConfig, default_cache_dir
from ..store.urls import SHARD_FORMATS, shard_patterns


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value < 86400:
        raise argparse.ArgumentTypeError(f"must be more than 0 and less than a day: {text!r}")
    return value


def source_arguments(
    parser: argparse.ArgumentParser,
    positional: str = "source",
    what: str = "",
    *,
    several: bool = False,
) -> None:
    """The source positional (``several``: one or more, mounted as one tree) and the
    options that reach the store."""
    parser.add_argument(
        positional,
        nargs="+" if several else None,
        help=what
        or "where the shards are (tar, tar.gz, zip, parquet, MDS: see --format): a "
        "folder or prefix (s3://b/p/, gs://..., https://host/p/, file:///data, a local "
        "path), one shard, a brace pattern "
        "(https://host/train-{000..146}.tar) or a glob (s3://b/p/train-*.tar)"
        + (
            "; several sources, on any stores, make one tree, where a path in two is "
            "served from the later one"
            if several
            else ""
        ),
    )
    parser.add_argument(
        "--storage-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="fsspec storage option, repeatable; dotted keys nest (e.g. --storage-option "
        "anon=true, --storage-option client_kwargs.region_name=eu-west-1)",
    )
    parser.add_argument(
        "--endpoint-url",
        help="S3-compatible endpoint (default: AWS_ENDPOINT_URL or AWS itself)",
    )


def read_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the commands that read shards (mount, warm, index, verify)."""
    parser.add_argument(
        "--read-timeout",
        type=_positive_seconds,
        default=30.0,
        metavar="SECONDS",
        help="a read from the store that has not succeeded after this long, retries "
        "included, fails (EIO for a reader) (default: 30)",
    )
    cache_dir_argument(parser)
    parser.add_argument(
        "--skip-bad-shards",
        action="store_true",
        help="leave out corrupt or truncated shards with a warning instead of failing",
    )
    parser.add_argument(
        "--no-sidecar",
        action="store_true",
        help="ignore an index sidecar stored next to the shards",
    )
    parser.add_argument(
        "--format",
        dest="shard_format",  # pack's --format is its output's
        choices=SHARD_FORMATS,
        default="auto",
        help="the shards' format: auto (by each name's suffix: "
        f"{shard_patterns()}), or one format, whose shards alone a folder listing then "
        "takes and as which a glob or brace pattern reads every name it matches "
        "(default: auto)",
    )


def cache_dir_argument(parser: argparse.ArgumentParser, what: str = "") -> None:
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help=f"{what or 'where the index, views and block cache live'} "
        f"(default: {default_cache_dir()})",
    )


def long_options_argument(parser: argparse.ArgumentParser, *, mounts: bool = False) -> None:
    """``-o``: for mount, FUSE/fstab mount options and mount's long options; for the other
    commands, their own long options (``-o cache_size=50G`` is ``--cache-size 50G``)."""
    what = (
        "mount options, comma-separated, repeatable: ro, allow_other, allow_root, uid=N, "
        "gid=N, default_permissions, nonempty, fstab options (nodev, noauto, _netdev, ...: "
        "ignored), and every long option below written with underscores "
        "(cache_size=50G,prefetch=all,no_cache)"
        if mounts
        else "long options below written with underscores, comma-separated, repeatable "
        "(e.g. -o endpoint_url=http://host:9000)"
    )
    parser.add_argument(
        "-o", dest="options", action="append", default=[], metavar="OPTIONS", help=what
    )


def cache_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cache-size",
        default="50%",
        metavar="SIZE",
        help="bound of the block cache, e.g. 500G or 20%% of the cache disk (default: 50%%)",
    )
    parser.add_argument(
        "--cache-min-free",
        default="1G",
        metavar="SIZE",
        help="free space always left on the cache disk (default: 1G)",
    )
    parser.add_argument(
        "--block-size",
        default="8M",
        metavar="SIZE",
        help="cache block size; a block never spans two shards (default: 8M)",
    )


def prefetch_arguments(parser: argparse.ArgumentParser, *, misses: bool = True) -> None:
    if misses:
        parser.add_argument(
            "--miss-fetch",
            choices=("block", "range"),
            default="block",
            help="on a cache miss fetch the whole block in one GET (block, default) or only the "
            "bytes asked for and the rest of the block in the background (range)",
        )
    parser.add_argument(
        "--prefetch-streams",
        type=int,
        default=ReadaheadConfig.streams,
        metavar="N",
        help=f"concurrent background GETs (default: {ReadaheadConfig.streams})",
    )

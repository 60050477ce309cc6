"""``shardfs cache``: show what the cache folder holds, or clear it."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..config import default_cache_dir, format_bytes
from ..errors import UsageError
from ._arguments import cache_dir_argument
from ._command import Command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "action",
        choices=("info", "clear"),
        help="info: what is cached; clear: drop every cached block (safe while mounted)",
    )
    cache_dir_argument(parser, "the cache folder")
    parser.add_argument(
        "--all", action="store_true", help="with clear: also drop the indexes and views"
    )
    parser.add_argument("--json", action="store_true", help="print JSON")


def run(args: argparse.Namespace) -> int:
    cache_dir = (args.cache_dir if args.cache_dir is not None else default_cache_dir()).absolute()
    if not cache_dir.is_dir():
        raise UsageError(f"--cache-dir {cache_dir}: no such folder")
    if args.action == "clear":
        _clear(cache_dir, everything=args.all, as_json=args.json)
    else:
        _info(cache_dir, as_json=args.json)
    return 0


def _clear(cache_dir: Path, *, everything: bool, as_json: bool) -> None:
    from ..cache import clear_cache

    freed = clear_cache(cache_dir, everything=everything)
    if as_json:
        cleared = ["blocks", "indexes", "views"] if everything else ["blocks"]
        body = {"cache_dir": str(cache_dir), "cleared": cleared, "block_bytes_freed": freed}
        print(json.dumps(body, indent=2, sort_keys=True))
        return
    what = "blocks, indexes and views" if everything else "blocks"
    print(f"cleared cached {what} in {cache_dir} ({format_bytes(freed)} of blocks)")


def _info(cache_dir: Path, *, as_json: bool) -> None:
    from ..cache import cache_info

    info = cache_info(cache_dir)
    if as_json:
        print(json.dumps(info, indent=2, sort_keys=True))
        return
    print(f"cache folder   {info['cache_dir']}")
    print(f"blocks         {info['blocks']} ({format_bytes(int(info['block_bytes']))})")
    print(f"indexes        {info['index_files']} ({format_bytes(int(info['index_bytes']))})")
    print(f"views          {info['views_files']} ({format_bytes(int(info['views_bytes']))})")


COMMAND = Command(
    name="cache",
    summary="inspect or clear the local cache folder",
    description="Show what the cache folder holds (blocks, indexes, views), or drop the cached "
    "blocks. Clearing is safe while mounts run: they fetch again what they need.",
    examples=("shardfs cache info", "shardfs cache clear --all --cache-dir /scratch/shardfs"),
    add_arguments=add_arguments,
    run=run,
)

"""``shardfs stats``: ask a running mount's daemon for its counters and print them."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ..config import format_bytes
from ._command import Command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "mountpoint", type=Path, metavar="PATH", help="the mountpoint, or any path inside it"
    )
    parser.add_argument("--json", action="store_true", help="print JSON")


def run(args: argparse.Namespace) -> int:
    from ..mount.control import query, serving_mountpoint

    values = query(serving_mountpoint(args.mountpoint.absolute()))
    if args.json:
        print(json.dumps(values, indent=2, sort_keys=True))
        return 0
    for name, value in _rows(values):
        print(f"{name:<20} {value}")
    return 0


def _rows(values: dict[str, Any]) -> list[tuple[str, str]]:
    """The table, one (name, value) a line. Counters that older daemons lack read as 0."""
    return [
        ("source", values["source"]),
        ("files", f"{values['files']} ({values['layout']} layout)"),
        ("bytes served", format_bytes(values["bytes_served"])),
        ("bytes pushed", format_bytes(values["bytes_pushed"])),
        (
            "  inodes let go",
            f"{values.get('inodes_forgotten', 0)} by the kernel "
            f"({values.get('pushes_refused', 0)} pushes refused)",
        ),
        (
            "bytes fetched",
            f"{format_bytes(values['bytes_fetched'])} in {values['store_requests']} requests",
        ),
        (
            "  by the index scan",
            f"{format_bytes(values.get('scan_bytes', 0))} in "
            f"{values.get('scan_requests', 0)} requests",
        ),
        (
            "cache hits / misses",
            f"{values['cache_hits']} / {values['cache_misses']} "
            f"(hit ratio {values['hit_ratio']:.1%})",
        ),
        (
            "cache used / limit",
            f"{format_bytes(values['cache_bytes_used'])} / "
            f"{format_bytes(values['cache_bytes_limit'])}",
        ),
        (
            "blocks evicted",
            f"{values['blocks_evicted']} "
            f"({format_bytes(values.get('evicted_unread_bytes', 0))} fetched ahead, never read)",
        ),
        (
            "egress amplification",
            f"{values.get('egress_amplification', 0.0):.2f}x "
            f"(fetched, scan included / {format_bytes(values.get('delivered_bytes', 0))} "
            "of files delivered)",
        ),
        ("whole-shard answers", _whole_shard_answers(values.get("whole_shard_answers", 0))),
        (
            "small-cache misses",
            f"{values.get('range_reads', 0)} reads fetched as ranges, "
            f"{values.get('blocks_not_admitted', 0)} blocks not kept",
        ),
        ("hinted reads", f"{values.get('hinted_reads', 0)} ({values.get('hints_taken', 0)} hints)"),
        ("reads waited on net", str(values.get("reads_waited_on_network", 0))),
        ("prefetched unread", format_bytes(values.get("prefetched_unread_bytes", 0))),
        ("checksum failures", str(values["checksum_failures"])),
        ("cache write errors", str(values["cache_write_errors"])),
    ]


def _whole_shard_answers(count: int) -> str:
    if not count:
        return "0 (every ranged GET got its range)"
    return f"{count} ranged GETs answered with the whole shard (the server ignores Range)"


COMMAND = Command(
    name="stats",
    summary="live counters of a mount: bytes fetched and served, cache hits, evictions",
    description="Ask the daemon of the mount that holds PATH for its counters since it mounted: "
    "bytes served and fetched (as they crossed the wire, the index scan at mount included), store "
    "requests, cache hits, misses and evictions, cache usage.",
    examples=(
        "shardfs stats /mnt/train",
        "shardfs stats /mnt/train/cat   (any path inside the mount)",
        "shardfs stats /mnt/train --json | jq .hit_ratio",
    ),
    add_arguments=add_arguments,
    run=run,
)

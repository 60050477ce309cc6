"""``shardfs umount``: unmount and wait for the daemon to exit, removing dead mounts too."""

from __future__ import annotations

import argparse
from pathlib import Path

from ._command import Command
from ._output import notice


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("mountpoint", type=Path)
    parser.add_argument(
        "--lazy",
        action="store_true",
        help="detach the mount even while a process still uses it; the daemon exits once "
        "the last user lets go",
    )


def run(args: argparse.Namespace) -> int:
    from ..mount.daemon import unmount

    mountpoint = args.mountpoint.absolute()
    outcome = unmount(mountpoint, lazy=args.lazy)
    if outcome == "dead":
        notice(f"removed a dead shardfs mount at {mountpoint}")
    elif outcome == "detached":
        notice(f"detached {mountpoint}; its daemon exits once the last process using it ends")
    return 0


COMMAND = Command(
    name="umount",
    summary="unmount a shardfs mount and wait for its daemon to exit",
    description="Unmount MOUNTPOINT and wait until its daemon has exited. A dead mount (its "
    "daemon was killed) is removed too.",
    examples=("shardfs umount /mnt/train", "shardfs umount --lazy /mnt/train"),
    add_arguments=add_arguments,
    run=run,
)

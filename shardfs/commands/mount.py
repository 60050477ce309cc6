"""``shardfs mount``: check the arguments, then start the daemon and wait until it is ready
(or, with ``--foreground``, be the daemon). The daemon is ``shardfs`` itself, started again
with the arguments this command was given plus ``--foreground``."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import (
    LOGS_KEPT,
    IndexConfig,
    MountConfig,
    ReadConfig,
    SourceConfig,
    ViewConfig,
)
from ..errors import ShardfsError, UsageError
from ._arguments import (
    cache_arguments,
    long_options_argument,
    prefetch_arguments,
    read_arguments,
    source_arguments,
)
from ._command import Command
from ._configs import cache_config, index_config, readahead_config, source_config
from ._output import notice, progress_printer

if TYPE_CHECKING:  # index loads fsspec; the CLI starts without it
    from ..index.db import Progress


def _mode(text: str) -> int:
    """An octal permission mode such as 0440 (0o440 and 440 too)."""
    try:
        value = int(text.removeprefix("0o"), 8)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an octal mode: {text!r} (e.g. 0440)") from None
    if not 0 <= value <= 0o777:
        raise argparse.ArgumentTypeError(f"mode must be between 0 and 0777: {text!r}")
    return value


def _owner(database: str) -> Callable[[str], int]:
    """A user or group: a number, or a name looked up in the passwd or group database."""

    def parse(text: str) -> int:
        if text.isdigit():
            value = int(text)
            if value >= 1 << 32:
                raise argparse.ArgumentTypeError(f"{database} id out of range: {text}")
            return value
        import grp
        import pwd

        try:
            if database == "user":
                return pwd.getpwnam(text).pw_uid
            return grp.getgrnam(text).gr_gid
        except KeyError:
            raise argparse.ArgumentTypeError(f"no such {database}: {text!r}") from None

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source_arguments(parser, several=True)
    read_arguments(parser)
    parser.add_argument(
        "mountpoint",
        type=Path,
        help="an empty folder; a missing one is created (its parent must exist) and removed "
        "again at unmount",
    )
    long_options_argument(parser, mounts=True)
    _view_arguments(parser)
    _daemon_arguments(parser)
    _ownership_arguments(parser)
    _session_arguments(parser)
    cache_arguments(parser)
    prefetch_arguments(parser)
    parser.add_argument(
        "--prefetch",
        choices=("none", "shard", "all"),
        default="shard",
        help="shard (default): once a shard is read, fetch the rest of it in the background; "
        "all: fetch every shard from mount time on; none: fetch only what is read",
    )
    parser.add_argument(
        "--no-cache",
        action="store_true",
        help="read every byte from the store; keep nothing on local disk",
    )
    parser.add_argument("--ready-fd", type=int, default=None, help=argparse.SUPPRESS)
    parser.set_defaults(allow_root=False, nonempty=False)


def _view_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--layout",
        choices=("auto", "raw", "imagefolder"),
        default="auto",
        help="raw: member paths as they are; imagefolder: KEY.jpg + KEY.cls as CLASS/KEY.jpg; "
        "auto (default): imagefolder when the shards hold labelled samples",
    )
    parser.add_argument(
        "--classes",
        type=Path,
        help="file with one class name per line (line index = label); default: classes.txt "
        "next to the shards if present, else zero-padded labels",
    )


def _daemon_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--foreground", "-f", action="store_true", help="stay attached; log to stderr"
    )
    parser.add_argument(
        "--log-file",
        type=Path,
        default=None,
        metavar="PATH",
        help="where the mount's log goes (default: CACHE_DIR/logs/mount-DAEMONPID.log, "
        f"the last {LOGS_KEPT} kept; with --foreground: stderr)",
    )


def _ownership_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--allow-other", action="store_true", help="let other users read the mount")
    parser.add_argument(
        "--uid",
        type=_owner("user"),
        default=None,
        metavar="USER",
        help="owner every file and folder shows (default: the user who mounts)",
    )
    parser.add_argument(
        "--gid",
        type=_owner("group"),
        default=None,
        metavar="GROUP",
        help="group every file and folder shows (default: the mounting user's group)",
    )
    parser.add_argument(
        "--file-mode",
        type=_mode,
        default=None,
        metavar="MODE",
        help="octal permissions of every file, e.g. 0440 (default: 0444 plus the execute "
        "bits stored in the shard)",
    )
    parser.add_argument(
        "--dir-mode",
        type=_mode,
        default=None,
        metavar="MODE",
        help="octal permissions of every folder, e.g. 0550 (default: 0555)",
    )


def _session_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--single-threaded",
        action="store_true",
        help="answer every FUSE request on the session thread, reads that wait on the store "
        "included (a slow GET then blocks every reader)",
    )
    parser.add_argument(
        "--no-kernel-push",
        action="store_true",
        help="do not put the files of each cached block into the kernel's page cache ahead "
        "of reads (by default readers of those files send the daemon no request at all; "
        "there are no pushes with --no-cache)",
    )


def _view_config(args: argparse.Namespace) -> ViewConfig:
    classes = None
    if args.classes is not None:
        from ..views.view import parse_classes  # here only: it brings in the store's stack

        try:
            classes = tuple(parse_classes(args.classes.read_text(encoding="utf-8")))
        except OSError as exc:
            raise UsageError(f"--classes {args.classes}: {exc.strerror}") from exc
        except UnicodeDecodeError as exc:
            raise UsageError(f"--classes {args.classes}: not UTF-8 text ({exc.reason})") from exc
    return ViewConfig(layout=args.layout, classes=classes)


def _mount_config(args: argparse.Namespace, source: SourceConfig) -> MountConfig:
    from ..store.urls import table_name

    return MountConfig(
        mountpoint=args.mountpoint.absolute(),
        fsname=table_name(source.urls),
        foreground=args.foreground,
        allow_other=args.allow_other,
        allow_root=args.allow_root,
        nonempty=args.nonempty,
        threads=not args.single_threaded,
        kernel_push=not args.no_kernel_push,
        uid=args.uid,
        gid=args.gid,
        file_mode=args.file_mode,
        dir_mode=args.dir_mode,
    )


def run(args: argparse.Namespace) -> int:
    source = source_config(args)
    indexing = index_config(args)
    view = _view_config(args)  # a bad --classes fails here, before a daemon is started
    mount_config = _mount_config(args, source)
    if args.allow_other and args.allow_root:
        raise UsageError("allow_other and allow_root exclude each other; give one")
    if not args.foreground:
        return _start_daemon(args, source, indexing.cache_dir, mount_config)
    _serve(args, source, indexing, view, mount_config)
    return 0


def _start_daemon(
    args: argparse.Namespace, source: SourceConfig, cache_dir: Path, config: MountConfig
) -> int:
    """Check what can be checked here, then run ``shardfs`` again, as the daemon, with the
    argv that ``main`` was given (``args.argv``), and wait for it to be ready."""
    from ..mount.daemon import log_file_for, spawn_daemon
    from ..mount.mountpoints import check_cache_dir, check_mountpoint

    cache_config(args, cache_dir)
    readahead_config(args)
    check_mountpoint(config.mountpoint, notice=notice, nonempty=args.nonempty)
    check_cache_dir(cache_dir)
    missing = not os.path.lexists(config.mountpoint)  # the daemon makes it
    log_path = log_file_for(cache_dir, args.log_file)
    code, text = spawn_daemon(
        args.argv, config.mountpoint, log_path, sys.stderr.isatty(), verbose=args.verbose > 0
    )
    if code != 0:
        print(f"shardfs: error: {text}", file=sys.stderr)
        return code
    if missing:
        notice(f"created mountpoint {config.mountpoint} (removed at unmount)")
    files, _, rest = text.partition(" ")
    layout, _, images = rest.partition(" ")
    summary = f"mounted {source.describe()} at {config.mountpoint} ({files} files, {layout} layout)"
    print(f"{summary}: {images}" if images else summary)
    return 0


def _serve(
    args: argparse.Namespace,
    source: SourceConfig,
    indexing: IndexConfig,
    view: ViewConfig,
    config: MountConfig,
) -> None:
    """Be the daemon: mount and serve until unmounted, telling the waiting parent (if any)
    about progress, readiness or the error that stopped the mount."""
    from ..mount.daemon import ReadyChannel
    from ..mount.lifecycle import MountSettings, run_foreground

    channel = ReadyChannel(args.ready_fd)
    progress: Progress | None
    if channel.attached:

        def progress(done: int, total: int, done_bytes: int, total_bytes: int) -> None:
            channel.send("progress", f"{done} {total} {done_bytes} {total_bytes}")

    else:
        progress = progress_printer()
    try:
        settings = MountSettings(
            source=source,
            index=indexing,
            view=view,
            mount=config,
            read=ReadConfig(),
            cache=cache_config(args, indexing.cache_dir),
            readahead=readahead_config(args),
        )
        run_foreground(settings, channel, progress)
    except ShardfsError as exc:
        channel.send("error", f"{exc.exit_code} {exc}")
        raise
    except BaseException as exc:
        channel.send("error", f"1 unexpected error: {type(exc).__name__}: {exc}")
        raise


COMMAND = Command(
    name="mount",
    summary="mount a sharded dataset, or several as one tree (returns once it is ready)",
    description="Mount SOURCE at MOUNTPOINT, read-only; several SOURCEs make one tree. "
    "Indexes the shards on first use (or uses a sidecar / the persisted index) and returns "
    "once the mount is ready. Also run by mount(8) as mount.shardfs, for `mount -t shardfs` "
    "and /etc/fstab, with one SOURCE (an fstab line has one; a brace pattern names several "
    "shards of one folder).",
    examples=(
        "shardfs mount s3://bucket/train/ /mnt/train",
        "shardfs mount a.tar b.tar /mnt/ab",
        "shardfs mount -o allow_other,uid=1000,cache_size=50G s3://bucket/train/ /mnt/train",
        "shardfs mount --storage-option anon=true s3://public-bucket/data/ /mnt/data",
        "shardfs mount ./shards /mnt/data --layout raw --no-cache",
    ),
    add_arguments=add_arguments,
    run=run,
)

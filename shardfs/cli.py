"""The ``shardfs`` command line. It builds configuration objects and calls the core; errors
become one line on stderr and an exit code (tracebacks only with ``-v``)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from . import __version__
from .config import (
    LOGS_KEPT,
    CacheConfig,
    IndexConfig,
    MountConfig,
    ReadaheadConfig,
    ReadConfig,
    SourceConfig,
    ViewConfig,
    default_cache_dir,
    format_bytes,
    parse_size,
    plural,
    resolve_cache_size,
    storage_options_from_pairs,
)
from .errors import ShardfsError, UsageError
from .mount_options import apply_options, split_options

EXIT_CODES = """exit codes:
  0  success
  1  unexpected error (run with -v for a traceback)
  2  bad arguments or configuration
  3  the store could not be reached, or the bucket/prefix/shards were not found
  4  bad data: a corrupt or truncated shard, an unsafe member path, a changed shard
  5  mountpoint problem: missing, not empty, already mounted or being mounted, busy,
     or FUSE failed
  130 interrupted (143: stopped by SIGTERM)
"""

log = logging.getLogger("shardfs")


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value < 86400:
        raise argparse.ArgumentTypeError(f"must be more than 0 and less than a day: {text!r}")
    return value


def _source_arguments(
    parser: argparse.ArgumentParser, positional: str = "source", what: str = ""
) -> None:
    parser.add_argument(
        positional,
        help=what
        or "where the *.tar shards are: a folder or prefix (s3://b/p/, gs://..., "
        "https://host/p/, file:///data, a local path), one .tar, a brace pattern "
        "(https://host/train-{000..146}.tar) or a glob (s3://b/p/train-*.tar)",
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


def _read_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the commands that read shards (mount, warm, index, verify)."""
    parser.add_argument(
        "--read-timeout",
        type=_positive_seconds,
        default=30.0,
        metavar="SECONDS",
        help="a read from the store that has not succeeded after this long, retries "
        "included, fails (EIO for a reader) (default: 30)",
    )
    _cache_dir_argument(parser)
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


def _cache_dir_argument(parser: argparse.ArgumentParser, what: str = "") -> None:
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help=f"{what or 'where the index, views and block cache live'} "
        f"(default: {default_cache_dir()})",
    )


def _long_options_argument(parser: argparse.ArgumentParser, *, mounts: bool = False) -> None:
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


def _cache_arguments(parser: argparse.ArgumentParser) -> None:
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


def _prefetch_arguments(parser: argparse.ArgumentParser, *, misses: bool = True) -> None:
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


def _examples(*lines: str) -> str:
    """An epilog: examples, then the exit codes."""
    return "examples:\n" + "".join(f"  {line}\n" for line in lines) + "\n" + EXIT_CODES


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


def _mount_arguments(mount: argparse.ArgumentParser) -> None:
    mount.add_argument("mountpoint", type=Path, help="an existing, empty folder")
    _long_options_argument(mount, mounts=True)
    mount.add_argument(
        "--layout",
        choices=("auto", "raw", "imagefolder"),
        default="auto",
        help="raw: member paths as they are; imagefolder: KEY.jpg + KEY.cls as CLASS/KEY.jpg; "
        "auto (default): imagefolder when the shards hold labelled samples",
    )
    mount.add_argument(
        "--classes",
        type=Path,
        help="file with one class name per line (line index = label); default: classes.txt "
        "next to the shards if present, else zero-padded labels",
    )
    mount.add_argument(
        "--foreground", "-f", action="store_true", help="stay attached; log to stderr"
    )
    mount.add_argument(
        "--log-file",
        type=Path,
        default=None,
        metavar="PATH",
        help="where the mount's log goes (default: CACHE_DIR/logs/mount-DAEMONPID.log, "
        f"the last {LOGS_KEPT} kept; with --foreground: stderr)",
    )
    mount.add_argument("--allow-other", action="store_true", help="let other users read the mount")
    mount.add_argument(
        "--uid",
        type=_owner("user"),
        default=None,
        metavar="USER",
        help="owner every file and folder shows (default: the user who mounts)",
    )
    mount.add_argument(
        "--gid",
        type=_owner("group"),
        default=None,
        metavar="GROUP",
        help="group every file and folder shows (default: the mounting user's group)",
    )
    mount.add_argument(
        "--file-mode",
        type=_mode,
        default=None,
        metavar="MODE",
        help="octal permissions of every file, e.g. 0440 (default: 0444 plus the execute "
        "bits stored in the shard)",
    )
    mount.add_argument(
        "--dir-mode",
        type=_mode,
        default=None,
        metavar="MODE",
        help="octal permissions of every folder, e.g. 0550 (default: 0555)",
    )
    mount.add_argument(
        "--single-threaded",
        action="store_true",
        help="answer every FUSE request on the session thread, reads that wait on the store "
        "included (a slow GET then blocks every reader)",
    )
    mount.add_argument(
        "--no-kernel-push",
        action="store_true",
        help="do not put the files of each cached block into the kernel's page cache ahead "
        "of reads (by default readers of those files send the daemon no request at all; "
        "there are no pushes with --no-cache)",
    )
    _cache_arguments(mount)
    _prefetch_arguments(mount)
    mount.add_argument(
        "--prefetch",
        choices=("none", "shard", "all"),
        default="shard",
        help="shard (default): once a shard is read, fetch the rest of it in the background; "
        "all: fetch every shard from mount time on; none: fetch only what is read",
    )
    mount.add_argument(
        "--no-cache",
        action="store_true",
        help="read every byte from the store; keep nothing on local disk",
    )
    mount.add_argument("--ready-fd", type=int, default=None, help=argparse.SUPPRESS)
    mount.set_defaults(allow_root=False, nonempty=False)


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "-v", "--verbose", action="count", default=0, help="log more; show tracebacks"
    )
    parser = argparse.ArgumentParser(
        prog="shardfs",
        description="Mount tar shards from object storage as a read-only directory tree.",
        epilog=_examples(
            "shardfs mount s3://bucket/train/ /mnt/train",
            "shardfs stats /mnt/train",
            "shardfs umount /mnt/train",
            "shardfs COMMAND --help   (each command's options and examples)",
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[common],
    )
    parser.add_argument("--version", action="version", version=f"shardfs {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def command(name: str, summary: str, description: str, *examples: str) -> Any:
        sub = commands.add_parser(
            name,
            parents=[common],
            help=summary,
            description=description,
            epilog=_examples(*examples),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        sub.set_defaults(command_parser=sub)
        return sub

    mount = command(
        "mount",
        "mount a sharded dataset (returns once the mount is ready)",
        "Mount SOURCE at MOUNTPOINT, read-only. Indexes the shards on first use (or uses a "
        "sidecar / the persisted index) and returns once the mount is ready. Also run by "
        "mount(8) as mount.shardfs, for `mount -t shardfs` and /etc/fstab.",
        "shardfs mount s3://bucket/train/ /mnt/train",
        "shardfs mount -o allow_other,uid=1000,cache_size=50G s3://bucket/train/ /mnt/train",
        "shardfs mount --storage-option anon=true s3://public-bucket/data/ /mnt/data",
        "shardfs mount ./shards /mnt/data --layout raw --no-cache",
    )
    _source_arguments(mount)
    _read_arguments(mount)
    _mount_arguments(mount)

    warm = command(
        "warm",
        "stream a whole dataset into the local block cache",
        "Fetch every block of every shard of SOURCE into the block cache, with concurrent "
        "ranged GETs, so that the next mount reads nothing from the store.",
        "shardfs warm s3://bucket/train/ --cache-size 200G",
        "shardfs warm s3://bucket/train/ -o prefetch_streams=32",
    )
    _source_arguments(warm)
    _long_options_argument(warm)
    _read_arguments(warm)
    _cache_arguments(warm)
    _prefetch_arguments(warm, misses=False)

    pack = command(
        "pack",
        "pack a folder tree (e.g. an ImageFolder) into tar shards plus an index sidecar",
        "Pack every file under SRC_DIR into tar shards at DEST (any fsspec URL), with an "
        "index sidecar so the first mount needs no scan. No file is dropped: shards hold any "
        "number of files and the last one may be small.",
        "shardfs pack ./imagenet/train s3://bucket/train --format webdataset --verify",
        "shardfs pack ./photos /data/shards --shard-size 1G --shuffle-seed 0",
    )
    pack.add_argument("src_dir", type=Path, help="the folder tree to pack")
    _source_arguments(pack, positional="dest", what="where to write the shards")
    _long_options_argument(pack)
    _cache_dir_argument(pack, "with --verify: where the index of the packed shards goes")
    pack.add_argument(
        "--format",
        choices=("tree", "webdataset"),
        default="tree",
        help="tree (default): members are CLASS/FILE, mounted with the raw view; webdataset: "
        "CLASS/KEY.ext + CLASS/KEY.cls and a classes.txt, mounted with the imagefolder view",
    )
    pack.add_argument(
        "--shard-size",
        default="256M",
        metavar="SIZE",
        help="close a shard before it exceeds SIZE (default: 256M)",
    )
    pack.add_argument("--max-count", type=int, default=None, help="at most N files per shard")
    pack.add_argument(
        "--shuffle-seed",
        type=int,
        default=None,
        metavar="N",
        help="spread files (and so classes) across shards in a random order fixed by N; "
        "default: sorted order",
    )
    pack.add_argument(
        "--resume", action="store_true", help="continue an interrupted pack into DEST"
    )
    pack.add_argument(
        "--skip-errors",
        action="store_true",
        help="leave out unreadable files and broken symlinks, and list them",
    )
    pack.add_argument(
        "--workers", type=int, default=4, help="shards written in parallel (default: 4)"
    )
    pack.add_argument(
        "--verify",
        action="store_true",
        help="afterwards, compare the packed dataset with SRC_DIR by hash",
    )

    verify = command(
        "verify",
        "compare a packed dataset with its source tree, by hash, without mounting",
        "Read every file of SOURCE's shards and compare it, by SHA-256, with the same file "
        "under SRC_DIR; report files missing, extra or different. Exit 4 on a difference.",
        "shardfs verify ./imagenet/train s3://bucket/train",
    )
    verify.add_argument("src_dir", type=Path, help="the folder tree that was packed")
    _source_arguments(verify)
    _long_options_argument(verify)
    _read_arguments(verify)

    stats = command(
        "stats",
        "live counters of a mount: bytes fetched and served, cache hits, evictions",
        "Ask the daemon serving MOUNTPOINT for its counters since it mounted: bytes served "
        "and fetched, store requests, cache hits, misses and evictions, cache usage.",
        "shardfs stats /mnt/train",
        "shardfs stats /mnt/train --json | jq .hit_ratio",
    )
    stats.add_argument("mountpoint", type=Path)
    stats.add_argument("--json", action="store_true", help="print JSON")

    cache = command(
        "cache",
        "inspect or clear the local cache folder",
        "Show what the cache folder holds (blocks, indexes, views), or drop the cached "
        "blocks. Clearing is safe while mounts run: they fetch again what they need.",
        "shardfs cache info",
        "shardfs cache clear --all --cache-dir /scratch/shardfs",
    )
    cache.add_argument(
        "action",
        choices=("info", "clear"),
        help="info: what is cached; clear: drop every cached block (safe while mounted)",
    )
    _cache_dir_argument(cache, "the cache folder")
    cache.add_argument(
        "--all", action="store_true", help="with clear: also drop the indexes and views"
    )
    cache.add_argument("--json", action="store_true", help="print JSON")

    umount = command(
        "umount",
        "unmount a shardfs mount and wait for its daemon to exit",
        "Unmount MOUNTPOINT and wait until its daemon has exited. A dead mount (its daemon "
        "was killed) is removed too.",
        "shardfs umount /mnt/train",
        "shardfs umount --lazy /mnt/train",
    )
    umount.add_argument("mountpoint", type=Path)
    umount.add_argument(
        "--lazy",
        action="store_true",
        help="detach the mount even while a process still uses it; the daemon exits once "
        "the last user lets go",
    )

    index = command(
        "index",
        "build the index ahead of time (optionally as a sidecar next to the shards)",
        "Scan the shards of SOURCE into the persisted index. With --write-sidecar, also "
        "store it next to the shards so that any machine mounts without scanning.",
        "shardfs index s3://bucket/train/ --write-sidecar",
    )
    _source_arguments(index)
    _long_options_argument(index)
    _read_arguments(index)
    index.add_argument(
        "--write-sidecar",
        action="store_true",
        help="upload the index next to the shards as .shardfs-index.sqlite",
    )
    return parser


def _source_config(args: argparse.Namespace) -> SourceConfig:
    return SourceConfig(
        url=args.dest if args.command == "pack" else args.source,
        storage_options=storage_options_from_pairs(args.storage_option),
        endpoint_url=args.endpoint_url,
        read_timeout=getattr(args, "read_timeout", SourceConfig.read_timeout),
    )


def _index_config(args: argparse.Namespace) -> IndexConfig:
    cache_dir = args.cache_dir if args.cache_dir is not None else default_cache_dir()
    return IndexConfig(
        cache_dir=cache_dir.absolute(),
        skip_bad_shards=getattr(args, "skip_bad_shards", False),
        use_sidecar=not getattr(args, "no_sidecar", False),
    )


def _view_config(args: argparse.Namespace) -> ViewConfig:
    from .views import parse_classes

    classes = None
    if args.classes is not None:
        try:
            classes = tuple(parse_classes(args.classes.read_text(encoding="utf-8")))
        except OSError as exc:
            raise UsageError(f"--classes {args.classes}: {exc.strerror}") from exc
        except UnicodeDecodeError as exc:
            raise UsageError(f"--classes {args.classes}: not UTF-8 text ({exc.reason})") from exc
    return ViewConfig(layout=args.layout, classes=classes)


def _progress_printer() -> object | None:
    """A tqdm bar for index scans when stderr is a terminal."""
    if not sys.stderr.isatty():
        return None
    from .mount import update_progress_bar

    state: dict[str, object] = {}

    def progress(done: int, total: int, done_bytes: int, total_bytes: int) -> None:
        state["bar"] = update_progress_bar(
            state.get("bar"), f"{done} {total} {done_bytes} {total_bytes}"
        )

    return progress


MIN_CACHE_BLOCKS = 4  # fewer, and readers evict each other's blocks before they are read


def _cache_config(args: argparse.Namespace, cache_dir: Path) -> CacheConfig:
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


def _readahead_config(args: argparse.Namespace) -> ReadaheadConfig:
    if args.prefetch_streams < 1:
        raise UsageError("--prefetch-streams must be at least 1")
    return ReadaheadConfig(
        prefetch=getattr(args, "prefetch", "all"),
        streams=args.prefetch_streams,
        miss_fetch=getattr(args, "miss_fetch", "block"),
    )


def cmd_warm(args: argparse.Namespace) -> int:
    from .warm import warm

    index_config = _index_config(args)
    report = warm(
        _source_config(args),
        index_config,
        _cache_config(args, index_config.cache_dir),
        _readahead_config(args),
        show_progress=sys.stderr.isatty(),
    )
    print(report.summary())
    return 0


def cmd_mount(args: argparse.Namespace) -> int:
    from .mount import (
        ReadyChannel,
        check_cache_dir,
        check_mountpoint,
        log_file_for,
        run_foreground,
        spawn_daemon,
    )

    source = _source_config(args)
    index_config = _index_config(args)
    view_config = _view_config(args)
    mountpoint = args.mountpoint.absolute()
    mount_config = MountConfig(
        mountpoint=mountpoint,
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
    if args.allow_other and args.allow_root:
        raise UsageError("allow_other and allow_root exclude each other; give one")
    if not args.foreground:
        _cache_config(args, index_config.cache_dir)
        _readahead_config(args)
        check_mountpoint(mountpoint, notice=_notice, nonempty=args.nonempty)
        check_cache_dir(index_config.cache_dir)
        log_path = log_file_for(index_config.cache_dir, args.log_file)
        code, text = spawn_daemon(
            args.argv, mountpoint, log_path, sys.stderr.isatty(), verbose=args.verbose > 0
        )
        if code != 0:
            print(f"shardfs: error: {text}", file=sys.stderr)
            return code
        files, _, layout = text.partition(" ")
        print(f"mounted {source.url} at {mountpoint} ({files} files, {layout} layout)")
        return 0

    channel = ReadyChannel(args.ready_fd)
    progress = None
    if channel.attached:

        def progress(done: int, total: int, done_bytes: int, total_bytes: int) -> None:
            channel.send("progress", f"{done} {total} {done_bytes} {total_bytes}")

    else:
        progress = _progress_printer()  # type: ignore[assignment]
    try:
        run_foreground(
            source,
            index_config,
            view_config,
            mount_config,
            ReadConfig(),
            _cache_config(args, index_config.cache_dir),
            _readahead_config(args),
            channel,
            progress,
        )
    except ShardfsError as exc:
        channel.send("error", f"{exc.exit_code} {exc}")
        raise
    except BaseException as exc:
        channel.send("error", f"1 unexpected error: {type(exc).__name__}: {exc}")
        raise
    return 0


def _notice(text: str) -> None:
    print(f"shardfs: {text}", file=sys.stderr)


def cmd_umount(args: argparse.Namespace) -> int:
    from .mount import unmount

    mountpoint = args.mountpoint.absolute()
    outcome = unmount(mountpoint, lazy=args.lazy)
    if outcome == "dead":
        _notice(f"removed a dead shardfs mount at {mountpoint}")
    elif outcome == "detached":
        _notice(f"detached {mountpoint}; its daemon exits once the last process using it ends")
    return 0


def cmd_index(args: argparse.Namespace) -> int:
    from .index import SIDECAR_NAME, IndexBuilder, write_sidecar
    from .mount import check_cache_dir
    from .store import Store

    source = _source_config(args)
    index_config = _index_config(args)
    check_cache_dir(index_config.cache_dir)
    store = Store(source)
    shards = store.list_shards()
    if store.version_warning:
        print(f"shardfs: warning: {store.version_warning}", file=sys.stderr)
    builder = IndexBuilder(store, index_config, progress=_progress_printer())  # type: ignore[arg-type]
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


def cmd_pack(args: argparse.Namespace) -> int:
    from .pack import PackConfig, Packer

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
    progress, close = _pack_progress()
    started = time.perf_counter()
    try:
        report = Packer(args.src_dir, _source_config(args), config, progress=progress).run()
    finally:
        close()
    seconds = time.perf_counter() - started
    for error in report.errors:
        print(f"shardfs: skipped: {error}", file=sys.stderr)
    resumed = f", {report.skipped_existing} already there" if report.skipped_existing else ""
    print(
        f"packed {plural(report.files, 'file')} ({format_bytes(report.bytes)}) into "
        f"{plural(report.shards, 'shard')} at {args.dest}{resumed} in {seconds:.1f} s "
        f"({report.bytes / max(seconds, 1e-9) / 1e6:.0f} MB/s)"
    )
    if args.verify:
        return _run_verify(args)
    return 0


def _pack_progress() -> tuple[Callable[[int, int, int, int], None] | None, Callable[[], None]]:
    """A tqdm bar (bytes, throughput, ETA, files) when stderr is a terminal."""
    if not sys.stderr.isatty():
        return None, lambda: None
    from tqdm import tqdm

    bar = tqdm(unit="B", unit_scale=True, desc="packing")
    lock = threading.Lock()

    def progress(files: int, total_files: int, done: int, total: int) -> None:
        with lock:
            bar.total = total
            bar.update(done - bar.n)
            bar.set_postfix_str(f"{files}/{total_files} files", refresh=False)

    return progress, bar.close


def _run_verify(args: argparse.Namespace) -> int:
    from .verify import verify

    report = verify(
        args.src_dir, _source_config(args), _index_config(args), ViewConfig(layout="auto")
    )
    if report.ok:
        print(f"verified: {report.summary()}")
        return 0
    print(f"shardfs: error: verify failed: {report.summary()}", file=sys.stderr)
    return 4


def cmd_verify(args: argparse.Namespace) -> int:
    if not args.src_dir.is_dir():
        raise UsageError(f"{args.src_dir}: not a folder")
    return _run_verify(args)


def cmd_stats(args: argparse.Namespace) -> int:
    from .control import query

    values = query(args.mountpoint.absolute())
    if args.json:
        print(json.dumps(values, indent=2, sort_keys=True))
        return 0
    rows = [
        ("source", values["source"]),
        ("files", f"{values['files']} ({values['layout']} layout)"),
        ("bytes served", format_bytes(values["bytes_served"])),
        ("bytes pushed", format_bytes(values["bytes_pushed"])),
        (
            "bytes fetched",
            f"{format_bytes(values['bytes_fetched'])} in {values['store_requests']} requests",
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
            f"(fetched / {format_bytes(values.get('delivered_bytes', 0))} of files delivered)",
        ),
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
    for name, value in rows:
        print(f"{name:<20} {value}")
    return 0


def cmd_cache(args: argparse.Namespace) -> int:
    from .cache import cache_info, clear_cache

    cache_dir = (args.cache_dir if args.cache_dir is not None else default_cache_dir()).absolute()
    if not cache_dir.is_dir():
        raise UsageError(f"--cache-dir {cache_dir}: no such folder")
    if args.action == "clear":
        freed = clear_cache(cache_dir, everything=args.all)
        if args.json:
            cleared = ["blocks", "indexes", "views"] if args.all else ["blocks"]
            body = {"cache_dir": str(cache_dir), "cleared": cleared, "block_bytes_freed": freed}
            print(json.dumps(body, indent=2, sort_keys=True))
            return 0
        what = "blocks, indexes and views" if args.all else "blocks"
        print(f"cleared cached {what} in {cache_dir} ({format_bytes(freed)} of blocks)")
        return 0
    info = cache_info(cache_dir)
    if args.json:
        print(json.dumps(info, indent=2, sort_keys=True))
        return 0
    print(f"cache folder   {info['cache_dir']}")
    print(f"blocks         {info['blocks']} ({format_bytes(int(info['block_bytes']))})")
    print(f"indexes        {info['index_files']} ({format_bytes(int(info['index_bytes']))})")
    print(f"views          {info['views_files']} ({format_bytes(int(info['views_bytes']))})")
    return 0


COMMANDS = {
    "mount": cmd_mount,
    "umount": cmd_umount,
    "index": cmd_index,
    "stats": cmd_stats,
    "pack": cmd_pack,
    "warm": cmd_warm,
    "verify": cmd_verify,
    "cache": cmd_cache,
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = argv  # what a backgrounded mount's daemon is started with
    level = logging.WARNING if args.verbose == 0 else logging.INFO
    if args.verbose >= 2:
        level = logging.DEBUG
    foreground = getattr(args, "foreground", False)
    if foreground and args.verbose == 0:
        level = logging.INFO
    log_file = getattr(args, "log_file", None) if foreground and args.ready_fd is None else None
    logging.basicConfig(
        level=level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        filename=log_file,
    )
    try:
        if getattr(args, "options", None):
            apply_options(
                args.command_parser, args, split_options(args.options), command=args.command
            )
        return COMMANDS[args.command](args)
    except ShardfsError as exc:
        if args.verbose:
            traceback.print_exc()
        print(f"shardfs: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("shardfs: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # stdout went away (e.g. piped into head): stop quietly, as other tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as exc:
        if args.verbose:
            traceback.print_exc()
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        print(
            f"shardfs: unexpected error: {type(exc).__name__}: {detail} (run with -v for details)",
            file=sys.stderr,
        )
        return 1


HELPER_USAGE = "usage: mount.shardfs SOURCE MOUNTPOINT [-sfnv] [-o OPTIONS]"


def mount_helper(argv: Sequence[str] | None = None) -> int:
    """``mount.shardfs``, which mount(8) runs for ``mount -t shardfs`` and fstab lines:
    ``mount.shardfs SOURCE MOUNTPOINT [-sfnvrw] [-o OPTIONS] [-t TYPE] [-N NS]``.

    mount(8) adds ``rw`` unless ``ro`` is given, so ``rw`` is dropped here (the mount is
    read-only all the same). ``-s`` (sloppy) drops unknown options with a warning, ``-f``
    (fake) checks the options and mounts nothing, ``-n`` (no mtab) means nothing here."""
    words = list(sys.argv[1:] if argv is None else argv)
    positional: list[str] = []
    options: list[str] = []
    verbose = fake = sloppy = False
    while words:
        word = words.pop(0)
        if word in ("-o", "-t", "-N"):
            if not words:
                print(f"mount.shardfs: {word} needs a value; {HELPER_USAGE}", file=sys.stderr)
                return 2
            value = words.pop(0)
            if word == "-o":
                options.append(value)
        elif word.startswith("-o"):
            options.append(word[2:])
        elif word.startswith("-") and len(word) > 1 and word != "--":
            for letter in word[1:]:
                if letter not in "sfnvrw":
                    print(f"mount.shardfs: unknown flag -{letter}; {HELPER_USAGE}", file=sys.stderr)
                    return 2
                verbose |= letter == "v"
                fake |= letter == "f"
                sloppy |= letter == "s"
                if letter == "r":
                    options.append("ro")
        else:
            positional.append(word)
    if len(positional) != 2:
        print(f"mount.shardfs: {HELPER_USAGE}", file=sys.stderr)
        return 2
    items = [item for item in split_options(options) if item != "rw"]
    if sloppy:
        items = _drop_unknown_options(positional, items)
    command = ["mount", *positional, *(["-o", ",".join(items)] if items else [])]
    if verbose:
        command.append("-v")
    if fake:
        return _check_only(command)
    return main(command)


def _drop_unknown_options(positional: list[str], items: list[str]) -> list[str]:
    """For mount -s: the items ``shardfs mount`` takes; the others are named and dropped."""
    parser = build_parser()
    kept = []
    for item in items:
        args = parser.parse_args(["mount", *positional])
        try:
            apply_options(args.command_parser, args, [item], command="mount")
        except UsageError as exc:
            print(f"shardfs: warning: ignored ({exc})", file=sys.stderr)
            continue
        kept.append(item)
    return kept


def _check_only(command: list[str]) -> int:
    """For mount -f: parse and check the options, mount nothing."""
    parser = build_parser()
    args = parser.parse_args(command)
    try:
        if args.options:
            apply_options(args.command_parser, args, split_options(args.options), command="mount")
    except UsageError as exc:
        print(f"shardfs: error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())

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

from . import __version__
from .config import (
    CacheConfig,
    IndexConfig,
    MountConfig,
    ReadaheadConfig,
    ReadConfig,
    SourceConfig,
    ViewConfig,
    default_cache_dir,
    parse_size,
    resolve_cache_size,
    storage_options_from_pairs,
)
from .errors import ShardfsError, UsageError

EXIT_CODES = """exit codes:
  0  success
  1  unexpected error (run with -v for a traceback)
  2  bad arguments or configuration
  3  the store could not be reached, or the bucket/prefix/shards were not found
  4  bad data: a corrupt or truncated shard, an unsafe member path, a changed shard
  5  mountpoint problem: missing, not empty, already mounted, busy, or FUSE failed
  130 interrupted
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
        or "fsspec URL of the folder/prefix holding *.tar shards (s3://b/p/, gs://..., "
        "file:///data, a local path) or a brace pattern like s3://b/train-{000..146}.tar",
    )
    parser.add_argument(
        "-o",
        dest="options",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="fsspec storage option, repeatable (e.g. -o anon=true, "
        "-o client_kwargs.region_name=eu-west-1)",
    )
    parser.add_argument(
        "--endpoint-url",
        help="S3-compatible endpoint (default: AWS_ENDPOINT_URL or AWS itself)",
    )
    parser.add_argument(
        "--read-timeout",
        type=_positive_seconds,
        default=30.0,
        metavar="SECONDS",
        help="a read from the store that has not succeeded after this long, retries "
        "included, fails (EIO for a reader) (default: 30)",
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help=f"where the index, views and block cache live (default: {default_cache_dir()})",
    )
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


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "-v", "--verbose", action="count", default=0, help="log more; show tracebacks"
    )
    parser = argparse.ArgumentParser(
        prog="shardfs",
        description="Mount tar shards from object storage as a read-only directory tree.",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[common],
    )
    parser.add_argument("--version", action="version", version=f"shardfs {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    mount = commands.add_parser(
        "mount",
        parents=[common],
        help="mount a sharded dataset (returns once the mount is ready)",
        description="Mount SOURCE at MOUNTPOINT, read-only. Indexes the shards on first use "
        "(or uses a sidecar / the persisted index) and returns once the mount is ready.",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _source_arguments(mount)
    mount.add_argument("mountpoint", type=Path, help="an existing, empty folder")
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
    mount.add_argument("--allow-other", action="store_true", help="let other users read the mount")
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

    warm = commands.add_parser(
        "warm",
        parents=[common],
        help="stream a whole dataset into the local block cache",
        description="Fetch every block of every shard of SOURCE into the block cache, with "
        "concurrent ranged GETs, so that the next mount reads nothing from the store.",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _source_arguments(warm)
    _cache_arguments(warm)
    _prefetch_arguments(warm, misses=False)

    pack = commands.add_parser(
        "pack",
        parents=[common],
        help="pack a folder tree (e.g. an ImageFolder) into tar shards plus an index sidecar",
        description="Pack every file under SRC_DIR into tar shards at DEST (any fsspec URL), "
        "with an index sidecar so the first mount needs no scan. No file is dropped: shards "
        "hold any number of files and the last one may be small.",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    pack.add_argument("src_dir", type=Path, help="the folder tree to pack")
    _source_arguments(pack, positional="dest", what="where to write the shards")
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

    verify = commands.add_parser(
        "verify",
        parents=[common],
        help="compare a packed dataset with its source tree, by hash, without mounting",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    verify.add_argument("src_dir", type=Path, help="the folder tree that was packed")
    _source_arguments(verify)

    stats = commands.add_parser(
        "stats",
        parents=[common],
        help="live counters of a mount: bytes fetched and served, cache hits, evictions",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    stats.add_argument("mountpoint", type=Path)
    stats.add_argument("--json", action="store_true", help="print JSON")

    cache = commands.add_parser(
        "cache",
        parents=[common],
        help="inspect or clear the local cache folder",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cache.add_argument(
        "action",
        choices=("info", "clear"),
        help="info: what is cached; clear: drop every cached block (safe while mounted)",
    )
    cache.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help=f"the cache folder (default: {default_cache_dir()})",
    )
    cache.add_argument(
        "--all", action="store_true", help="with clear: also drop the indexes and views"
    )
    cache.add_argument("--json", action="store_true", help="with info: print JSON")

    umount = commands.add_parser(
        "umount",
        parents=[common],
        help="unmount a shardfs mount and wait for its daemon to exit",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    umount.add_argument("mountpoint", type=Path)
    umount.add_argument(
        "--lazy",
        action="store_true",
        help="detach the mount even while a process still uses it; the daemon exits once "
        "the last user lets go",
    )

    index = commands.add_parser(
        "index",
        parents=[common],
        help="build the index ahead of time (optionally as a sidecar next to the shards)",
        description="Scan the shards of SOURCE into the persisted index. With --write-sidecar, "
        "also store it next to the shards so that any machine mounts without scanning.",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _source_arguments(index)
    index.add_argument(
        "--write-sidecar",
        action="store_true",
        help="upload the index next to the shards as .shardfs-index.sqlite",
    )
    return parser


def _source_config(args: argparse.Namespace) -> SourceConfig:
    return SourceConfig(
        url=args.dest if args.command == "pack" else args.source,
        storage_options=storage_options_from_pairs(args.options),
        endpoint_url=args.endpoint_url,
        read_timeout=args.read_timeout,
    )


def _index_config(args: argparse.Namespace) -> IndexConfig:
    cache_dir = args.cache_dir if args.cache_dir is not None else default_cache_dir()
    return IndexConfig(
        cache_dir=cache_dir.absolute(),
        skip_bad_shards=args.skip_bad_shards,
        use_sidecar=not args.no_sidecar,
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
    return config


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
        threads=not args.single_threaded,
        kernel_push=not args.no_kernel_push,
    )
    if not args.foreground:
        _cache_config(args, index_config.cache_dir)
        _readahead_config(args)
        check_mountpoint(mountpoint, notice=_notice)
        check_cache_dir(index_config.cache_dir)
        log_path = index_config.cache_dir / "logs" / f"mount-{os.getpid()}.log"
        argv = [a for a in sys.argv[1:]]
        code, text = spawn_daemon(argv, log_path, sys.stderr.isatty())
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
    builder = IndexBuilder(store, index_config, progress=_progress_printer())  # type: ignore[arg-type]
    path = builder.build(shards)
    for bad in builder.bad_shards():
        print(
            f"shardfs: warning: skipped bad shard {bad.name}: {bad.reason} at offset {bad.offset}",
            file=sys.stderr,
        )
    print(f"indexed {len(shards)} shards ({builder.scanned_shards} scanned) into {path}")
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
        f"packed {report.files} files ({_format_bytes(report.bytes)}) into {report.shards} "
        f"shards at {args.dest}{resumed} in {seconds:.1f} s "
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


def _format_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


def cmd_stats(args: argparse.Namespace) -> int:
    from .control import query

    values = query(args.mountpoint.absolute())
    if args.json:
        print(json.dumps(values, indent=2, sort_keys=True))
        return 0
    rows = [
        ("source", values["source"]),
        ("files", f"{values['files']} ({values['layout']} layout)"),
        ("bytes served", _format_bytes(values["bytes_served"])),
        ("bytes pushed", _format_bytes(values["bytes_pushed"])),
        (
            "bytes fetched",
            f"{_format_bytes(values['bytes_fetched'])} in {values['store_requests']} requests",
        ),
        (
            "cache hits / misses",
            f"{values['cache_hits']} / {values['cache_misses']} "
            f"(hit ratio {values['hit_ratio']:.1%})",
        ),
        (
            "cache used / limit",
            f"{_format_bytes(values['cache_bytes_used'])} / "
            f"{_format_bytes(values['cache_bytes_limit'])}",
        ),
        ("blocks evicted", str(values["blocks_evicted"])),
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
        what = "blocks, indexes and views" if args.all else "blocks"
        print(f"cleared cached {what} in {cache_dir} ({_format_bytes(freed)} of blocks)")
        return 0
    info = cache_info(cache_dir)
    if args.json:
        print(json.dumps(info, indent=2, sort_keys=True))
        return 0
    print(f"cache folder   {info['cache_dir']}")
    print(f"blocks         {info['blocks']} ({_format_bytes(int(info['block_bytes']))})")
    print(f"indexes        {info['index_files']} ({_format_bytes(int(info['index_bytes']))})")
    print(f"views          {info['views_files']} ({_format_bytes(int(info['views_bytes']))})")
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
    args = parser.parse_args(argv)
    level = logging.WARNING if args.verbose == 0 else logging.INFO
    if args.verbose >= 2:
        level = logging.DEBUG
    if getattr(args, "foreground", False) and args.verbose == 0:
        level = logging.INFO
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
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


if __name__ == "__main__":
    sys.exit(main())

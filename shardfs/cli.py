"""The ``shardfs`` command line: the parser, built from the command modules in
``shardfs.commands``, and the one place where errors become one line on stderr and an exit
code (tracebacks only with ``-v``). Also ``mount.shardfs``, the helper mount(8) runs."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import textwrap
import traceback
from collections.abc import Sequence

from . import __version__
from .commands import COMMANDS, Command
from .errors import ShardfsError, UsageError
from .mount.options import apply_options, close_option, long_options, option_name, split_options

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

_BY_NAME = {command.name: command for command in COMMANDS}


def _examples(*lines: str) -> str:
    """An epilog: examples, then the exit codes."""
    return "examples:\n" + "".join(f"  {line}\n" for line in lines) + "\n" + EXIT_CODES


def _verbosity(default: object) -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    common.add_argument(
        "-v", "--verbose", action="count", default=default, help="log more; show tracebacks"
    )
    return common


def build_parser() -> argparse.ArgumentParser:
    top = _verbosity(0)
    # A command's own -v adds to one given before the command word instead of resetting it.
    common = _verbosity(argparse.SUPPRESS)
    parser = argparse.ArgumentParser(
        prog="shardfs",
        allow_abbrev=False,
        description="Mount sharded datasets (tar, tar.gz, zip, parquet, MDS) from object "
        "storage as a read-only directory tree.",
        epilog=_examples(
            "shardfs mount s3://bucket/train/ /mnt/train",
            "shardfs stats /mnt/train",
            "shardfs umount /mnt/train",
            "shardfs COMMAND --help   (each command's options and examples)",
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[top],
    )
    parser.add_argument("--version", action="version", version=f"shardfs {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        _add_command(subparsers, common, command)
    return parser


def _add_command(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
    common: argparse.ArgumentParser,
    command: Command,
) -> None:
    sub = subparsers.add_parser(
        command.name,
        parents=[common],
        # An abbreviation could silently become another option (--ready-f is --ready-fd).
        allow_abbrev=False,
        help=command.summary,
        description=command.description,
        epilog=_examples(*command.examples),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub.set_defaults(command_parser=sub)  # -o items are checked against this parser
    command.add_arguments(sub)


def _configure_logging(args: argparse.Namespace) -> None:
    """WARNING by default, INFO with -v or a foreground mount, DEBUG with -vv; a foreground
    mount run by hand logs to --log-file when given."""
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


def _refuse_extras(
    parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str], extras: list[str]
) -> None:
    """Words no parser took: the error (exit 2) goes with the usage of the command they
    were given to, and names the real option a mistyped one most likely meant."""
    owner = args.command_parser
    first = argv.index(extras[0]) if extras[0] in argv else len(argv)
    if first < argv.index(args.command):
        owner = parser  # given before the command, as top-level options are
    unknown = [word.split("=", 1)[0] for word in extras if word.startswith("--")]
    if not unknown:
        owner.error(f"unrecognized arguments: {' '.join(extras)}")
    names = [
        flag
        for action in owner._actions
        if action.help != argparse.SUPPRESS
        for flag in action.option_strings
        if flag.startswith("--")
    ]
    hints = [
        f"unknown option {word}" + (f"; did you mean {meant}?" if meant else "")
        for word in unknown
        for meant in [close_option(word, names)]
    ]
    owner.error("; ".join(hints))


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args, extras = parser.parse_known_args(argv)
    if extras:
        _refuse_extras(parser, args, argv, extras)
    args.argv = argv  # what a backgrounded mount's daemon is started with
    _configure_logging(args)
    try:
        if getattr(args, "options", None):
            apply_options(
                args.command_parser, args, split_options(args.options), command=args.command
            )
        return _BY_NAME[args.command].run(args)
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
    if "-h" in words or "--help" in words:
        print(helper_help(), end="")
        return 0
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
        elif word.startswith("--") and word != "--":
            print(f"mount.shardfs: unknown option {word}; {HELPER_USAGE}", file=sys.stderr)
            return 2
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


def helper_help() -> str:
    """``mount.shardfs --help``: the mount(8) form, its flags, and what ``-o`` takes; the
    long options are read from ``shardfs mount``'s own parser, so the list stays true."""
    mount_parser = argparse.ArgumentParser(add_help=False)
    _BY_NAME["mount"].add_arguments(mount_parser)
    items = []
    for action in long_options(mount_parser):
        value = action.metavar or ("|".join(map(str, action.choices or ())) or action.dest.upper())
        items.append(option_name(action) + ("" if action.nargs == 0 else f"={value}"))
    wrapped = textwrap.fill(", ".join(items), width=88, initial_indent="  ", subsequent_indent="  ")
    return f"""{HELPER_USAGE}

Mount SOURCE at MOUNTPOINT as `shardfs mount SOURCE MOUNTPOINT` does. mount(8) runs this
helper for `mount -t shardfs SOURCE MOUNTPOINT` and for /etc/fstab lines of type shardfs;
it returns once the mount is ready.

options:
  -o OPTIONS   mount options, comma-separated, repeatable (below)
  -s           sloppy: drop unknown -o options with a warning
  -f           fake: check the options, mount nothing
  -n           no mtab: nothing to do (accepted)
  -v           verbose
  -r, -w       accepted: every shardfs mount is read-only (the rw mount(8) adds is dropped)
  -t TYPE, -N NAMESPACE
               passed by mount(8); ignored
  -h, --help   show this help and exit

-o takes ro, allow_other, allow_root, default_permissions, nonempty, uid=N, gid=N; options
meant for mount(8) or systemd (nodev, nosuid, noauto, _netdev, nofail, defaults, x-*, ...),
which are ignored; and every long option of shardfs mount written with underscores:
{wrapped}

example /etc/fstab line:
  s3://bucket/train/  /mnt/train  shardfs  ro,allow_other,_netdev,nofail,cache_size=50G  0 0

`shardfs mount --help` says what each option does.

{EXIT_CODES}"""


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

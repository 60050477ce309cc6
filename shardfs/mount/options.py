"""``-o`` options, written the way FUSE tools and ``/etc/fstab`` write them.

``-o`` takes a comma-separated list, and may be repeated. Each item is one of:

- a FUSE or fstab mount option (``mount`` only): ``ro``, ``allow_other``, ``allow_root``,
  ``default_permissions``, ``nonempty``, ``uid=N``, ``gid=N``; ``rw`` is refused (the
  filesystem is read-only); options that only mean something to mount(8), systemd or
  another kind of filesystem (``nodev``, ``noauto``, ``_netdev``, ``x-systemd.*``, ...) are
  accepted and ignored, so an fstab line copied from another FUSE tool works;
- a long option of the same command with underscores: ``cache_size=50G`` is
  ``--cache-size 50G``, ``no_cache`` is ``--no-cache``. Its value is checked by the same
  parser as the flag's, and ``-o`` values are applied after the flags.

An unknown item that is a near miss of a real name (``cache_szie``) fails with a line that
names it; one that is like none of them is most likely a storage option: fsspec storage
options are not ``-o`` options, they go with ``--storage-option KEY=VALUE`` (or ``-o
storage_option=KEY=VALUE`` in fstab), and the old ``-o key=value`` spelling fails with a
line that names the new flag.
"""

from __future__ import annotations

import argparse
import difflib

from ..errors import UsageError

# Meaningful to the FUSE mount itself; handled here.
FUSE_OPTIONS = frozenset({"ro", "rw", "allow_root", "default_permissions", "nonempty"})

# Accepted for fstab and mount(8) and ignored: FUSE mounts are already nodev and nosuid,
# nothing on a read-only tree of data files needs exec rules or access times, and the
# rest are read by mount(8) or systemd, never by the filesystem.
IGNORED_OPTIONS = frozenset(
    {
        "dev", "nodev", "suid", "nosuid", "exec", "noexec", "auto", "noauto", "user",
        "nouser", "users", "_netdev", "nofail", "defaults", "async", "sync", "atime",
        "noatime", "relatime", "norelatime", "strictatime", "nodiratime", "lazytime",
    }
)  # fmt: skip

# FUSE mount options that are also long options of mount (--allow-other, --uid, --gid).
_MOUNT_ONLY = FUSE_OPTIONS | {"allow_other", "uid", "gid"}

# Long options that make no sense inside -o.
_NOT_FROM_O = frozenset({"help", "version", "verbose", "ready_fd", "options", "command_parser"})


def split_options(texts: list[str]) -> list[str]:
    """``["ro,uid=1", "cache_size=5G"]`` -> ``["ro", "uid=1", "cache_size=5G"]``."""
    return [item.strip() for text in texts for item in text.split(",") if item.strip()]


def _ignored(name: str) -> bool:
    return name in IGNORED_OPTIONS or name.startswith(("x-", "comment"))


def apply_options(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    items: list[str],
    *,
    command: str,
) -> None:
    """Apply every ``-o`` item to ``args``, as if its flag had been given. UsageError (one
    line) for an unknown item, a value the flag refuses, or a mount option given to a
    command that does not mount."""
    mounts = command == "mount"
    actions = parser._option_string_actions
    for item in items:
        name, has_value, value = item.partition("=")
        if not mounts and (name in _MOUNT_ONLY or _ignored(name)):
            raise UsageError(f"-o {name}: a mount option; shardfs {command} does not mount")
        if _ignored(name):
            continue
        if name in FUSE_OPTIONS:
            _apply_fuse_option(args, name, bool(has_value))
            continue
        flag = "--" + name.replace("_", "-")
        action = actions.get(flag)
        if action is None or action.dest in _NOT_FROM_O or "-" in name:
            raise UsageError(_unknown(item, name, parser, command))
        if action.nargs == 0:
            if has_value:
                raise UsageError(f"-o {name}: takes no value (write -o {name})")
            action(parser, args, None, flag)
            continue
        if not has_value or not value:
            raise UsageError(f"-o {name}: needs a value (-o {name}=VALUE)")
        try:
            converted = parser._get_values(action, [value])
        except argparse.ArgumentError as exc:
            raise UsageError(f"-o {item}: {exc.message}") from None
        action(parser, args, converted, flag)


def _apply_fuse_option(args: argparse.Namespace, name: str, has_value: bool) -> None:
    if has_value:
        raise UsageError(f"-o {name}: takes no value")
    if name == "rw":
        raise UsageError("-o rw: shardfs is a read-only filesystem (leave rw out; ro is implied)")
    if name == "allow_root":
        args.allow_root = True
    elif name == "nonempty":
        args.nonempty = True
    # ro and default_permissions hold for every shardfs mount


def long_options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The parser's long options that ``-o`` can give, in the order of ``--help``."""
    return [
        action
        for action in parser._actions
        if action.dest not in _NOT_FROM_O and any(s.startswith("--") for s in action.option_strings)
    ]


def option_name(action: argparse.Action) -> str:
    """``--cache-size`` as ``-o`` spells it: ``cache_size``."""
    flag = next(s for s in action.option_strings if s.startswith("--"))
    return flag[2:].replace("-", "_")


# How alike a typo and a name must be (difflib's ratio): 0.8 takes a swapped or missing
# letter (cache_szie, nodve, alow_other) and leaves cache_szie -> cache_dir out.
_CLOSE = 0.8


def close_option(name: str, candidates: list[str]) -> str | None:
    """The real name a typo most likely meant (``cache_szie`` -> ``cache_size``), or None."""
    found = difflib.get_close_matches(name, candidates, n=1, cutoff=_CLOSE)
    return found[0] if found else None


def _unknown(item: str, name: str, parser: argparse.ArgumentParser, command: str) -> str:
    actions = parser._option_string_actions
    spelled = "--" + name.replace("_", "-")
    if "-" in name and spelled in actions:
        return f"-o {item}: write it with underscores: -o {item.replace('-', '_', name.count('-'))}"
    if "." not in name:  # a dotted name is a storage option's, not a typo of ours
        names = {option_name(a) for a in long_options(parser)}
        if command == "mount":
            names |= (FUSE_OPTIONS - {"rw"}) | _MOUNT_ONLY | IGNORED_OPTIONS
        meant = close_option(name, sorted(names))
        if meant is not None:
            _, has_value, value = item.partition("=")
            suggestion = meant + (f"={value}" if has_value else "")
            return f"-o {item}: unknown option; did you mean -o {suggestion}?"
    if spelled in actions or not ("=" in item or "." in name):
        return f"-o {name}: unknown option (see shardfs {command} --help)"
    if command == "mount":
        return (
            f"-o {item}: not a mount option; fsspec storage options now go with "
            f"--storage-option {item}"
        )
    return (
        f"-o {item}: not an option of shardfs {command} (fsspec storage options go with "
        f"--storage-option {item})"
    )

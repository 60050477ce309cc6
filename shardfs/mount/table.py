"""What the kernel's mount table says about a path: mounted or not, by which filesystem,
and whether its FUSE daemon still answers.

Why not ``os.path.ismount``: it stats the path, and the root of a FUSE mount whose daemon
died answers ENOTCONN, so ismount says False for exactly the mount that most needs
removing. ``/proc/self/mountinfo`` lists every mount without asking the filesystem.
"""

from __future__ import annotations

import errno
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import MountError

MOUNTINFO = Path("/proc/self/mountinfo")
SHARDFS_FSTYPE = "fuse.shardfs"

# The kernel writes space, tab, newline and backslash in mountinfo fields as \ooo.
_OCTAL = re.compile(rb"\\([0-7]{3})")

# What a FUSE mount answers once its daemon is gone: ECONNABORTED for a request that the
# dying daemon's last moments caught (seen right after SIGKILL), ENOTCONN afterwards.
_DISCONNECTED = (errno.ENOTCONN, errno.ECONNABORTED)


@dataclass(frozen=True)
class MountEntry:
    """One line of the mount table."""

    mountpoint: str
    """Absolute path, unescaped."""
    fstype: str
    """e.g. ``fuse.shardfs``, ``tmpfs``."""
    source: str
    """What was mounted: for our mounts, the source URLs (``source_urls.table_name``);
    shardfs tells its mounts by ``fstype``, never by this."""

    @property
    def is_shardfs(self) -> bool:
        return self.fstype == SHARDFS_FSTYPE


def unescape(field: bytes) -> str:
    """A mountinfo field as a path string (bytes that are not UTF-8 survive as surrogates)."""
    return os.fsdecode(_OCTAL.sub(lambda m: bytes([int(m[1], 8) & 0xFF]), field))


def parse_mountinfo(data: bytes) -> list[MountEntry]:
    """Every well-formed line of mountinfo, in table order (a later entry on the same
    mountpoint is stacked on top of an earlier one).

    A line reads ``ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE
    SUPER_OPTIONS``; the optional fields vary in number, so the ``-`` separator is searched.
    """
    entries = []
    for line in data.split(b"\n"):
        fields = line.split(b" ")
        try:
            separator = fields.index(b"-", 6)
        except ValueError:
            continue
        if separator + 2 >= len(fields):
            continue
        entries.append(
            MountEntry(
                mountpoint=unescape(fields[4]),
                fstype=unescape(fields[separator + 1]),
                source=unescape(fields[separator + 2]),
            )
        )
    return entries


def table_path(path: Path | str) -> str:
    """``path`` spelled as the mount table spells it: absolute, with symlinks resolved.

    Only the parent folder is resolved through the filesystem; the last component may be
    a dead mount, which answers ENOTCONN to any stat (and a hung one would block). It is
    followed only if it is itself a symlink, which readlink tells without entering it.
    """
    absolute = os.path.abspath(path)
    for _ in range(40):  # the kernel's own bound on nested links
        parent, name = os.path.split(absolute)
        resolved = os.path.join(os.path.realpath(parent), name) if name else parent
        try:
            target = os.readlink(resolved)
        except OSError:
            return resolved
        absolute = os.path.abspath(os.path.join(os.path.dirname(resolved), target))
    return resolved


def _read_table(path: Path | str, table: Path) -> list[MountEntry]:
    try:
        data = table.read_bytes()
    except OSError as exc:
        raise MountError(f"{path}: cannot read the mount table {table} ({exc.strerror})") from exc
    return parse_mountinfo(data)


def find_mount(path: Path | str, table: Path = MOUNTINFO) -> MountEntry | None:
    """The mount whose mountpoint is exactly ``path`` (the topmost if stacked), or None."""
    wanted = table_path(path)
    found = None
    for entry in _read_table(path, table):
        if entry.mountpoint == wanted:
            found = entry
    return found


def mount_containing(path: Path | str, table: Path = MOUNTINFO) -> MountEntry | None:
    """The mount that ``path`` lies in: the one with the longest mountpoint that is
    ``path`` or a folder above it (the topmost if stacked). Read from the table alone, so
    a dead mount on the way is not entered."""
    wanted = table_path(path)
    found = None
    for entry in _read_table(path, table):
        top = entry.mountpoint.rstrip("/") + "/"
        inside = wanted == entry.mountpoint or wanted.startswith(top)
        if inside and (found is None or len(entry.mountpoint) >= len(found.mountpoint)):
            found = entry
    return found


def not_a_shardfs_mount(path: Path | str, entry: MountEntry | None) -> str:
    """Why ``path``, whose own mount table entry is ``entry``, is no shardfs mountpoint:
    another filesystem's mount, or no mount at all (then where it lies instead)."""
    if entry is not None:
        return f"{path} is not a shardfs mount (it is {entry.fstype})"
    if not os.path.lexists(path):
        return f"{path}: not mounted (no such file or folder)"
    around = mount_containing(path)
    if around is None:
        return f"{path}: not mounted"
    if around.is_shardfs:
        return (
            f"{path}: not mounted; it lies inside the shardfs mount at {around.mountpoint} "
            f"(shardfs umount {around.mountpoint})"
        )
    where = f"the {around.fstype} mount at {around.mountpoint}"
    return f"{path}: not mounted (not a mountpoint: it lies in {where})"


def is_disconnected(mountpoint: str) -> bool:
    """True if the FUSE daemon behind ``mountpoint`` is gone.

    statfs always reaches the daemon, where stat may be answered from attributes the
    kernel still holds (a dead mount whose root was listed stats fine)."""
    try:
        os.statvfs(mountpoint)
    except OSError as exc:
        return exc.errno in _DISCONNECTED
    return False

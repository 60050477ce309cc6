"""Whether a folder can be mounted on, and why FUSE refused when it could not: the checks
``shardfs mount`` makes before it starts, the mountpoint it makes when missing, and the
diagnosis after a failed mount."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import MountError, UsageError
from .control import created_marker
from .daemon import forget_dead_daemon, run_unmount_command
from .table import find_mount, is_disconnected

log = logging.getLogger(__name__)


def check_mountpoint(
    mountpoint: Path, *, notice: Callable[[str], None] = log.warning, nonempty: bool = False
) -> None:
    """Refuse a mountpoint that is not a folder, already mounted, or not empty (unless
    ``nonempty``), or that is missing along with its parent folder. A missing one whose
    parent exists passes: the mount makes it (``make_mountpoint``).

    A dead shardfs mount left there (its daemon was killed) is removed first, and
    ``notice`` says so; a dead mount of another filesystem is not ours to remove."""
    entry = find_mount(mountpoint)
    if entry is not None:
        if not is_disconnected(entry.mountpoint):
            if entry.is_shardfs:
                raise MountError(f"{mountpoint}: already mounted (shardfs umount {mountpoint})")
            raise MountError(f"{mountpoint}: already mounted ({entry.fstype})")
        if not entry.is_shardfs:
            raise MountError(
                f"{mountpoint}: a dead {entry.fstype} mount is left here, not a shardfs one; "
                f"remove it with: fusermount3 -u {mountpoint}"
            )
        run_unmount_command(entry.mountpoint, mountpoint, lazy=False)
        forget_dead_daemon(mountpoint)
        notice(f"removed a dead shardfs mount at {mountpoint}")
    try:
        if not mountpoint.exists() and not mountpoint.is_symlink():
            if not mountpoint.parent.is_dir():
                raise MountError(
                    f"{mountpoint}: mountpoint does not exist, nor does its parent folder "
                    f"{mountpoint.parent} (create it first, e.g. mkdir -p {mountpoint})"
                )
            return
        if not mountpoint.is_dir():
            raise MountError(f"{mountpoint}: mountpoint is not a folder")
        if not nonempty and any(mountpoint.iterdir()):
            raise MountError(
                f"{mountpoint}: mountpoint is not empty (-o nonempty mounts over it, "
                "hiding what it holds)"
            )
    except OSError as exc:
        raise MountError(f"{mountpoint}: {exc.strerror}") from exc


def make_mountpoint(mountpoint: Path) -> bool:
    """Create a missing mountpoint (its parent exists: ``check_mountpoint``) and mark it as
    made by shardfs, so that the unmount removes it (``control.remove_created_mountpoint``).
    True if it was made now."""
    try:
        mountpoint.mkdir()
    except FileExistsError:
        return False
    except OSError as exc:
        raise MountError(f"{mountpoint}: cannot create the mountpoint ({exc.strerror})") from exc
    created_marker(mountpoint).touch()
    return True


def check_cache_dir(cache_dir: Path) -> None:
    """The cache folder must exist (or be creatable) and be writable."""
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=cache_dir, prefix=".probe-"):
            pass
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise UsageError(f"--cache-dir {cache_dir}: not writable ({reason})") from exc


_CAP_SYS_ADMIN = 21


def diagnose_fuse_failure(
    mountpoint: Path,
    *,
    allow_other: bool,
    device: Path = Path("/dev/fuse"),
    fuse_conf: Path = Path("/etc/fuse.conf"),
    fusermount: str | None = None,
    euid: int | None = None,
    status: Path = Path("/proc/self/status"),
) -> str | None:
    """Why this process cannot mount FUSE at ``mountpoint``, with the fix; None if no cause
    is seen. libfuse prints its reason only on stderr (the daemon's log), so its checks are
    repeated here, after a failed mount, to put the cause in the user's one line.

    ``fusermount`` is the helper an unprivileged mount runs (default: found as libfuse
    finds it); the other arguments let tests point the checks at files of their own."""
    user_id = os.geteuid() if euid is None else euid
    if not os.path.exists(device):
        return (
            f"{device} does not exist: load the fuse kernel module (sudo modprobe fuse), "
            "or in a container pass the device (--device /dev/fuse)"
        )
    try:
        os.close(os.open(device, os.O_RDWR | os.O_CLOEXEC))
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM):
            return _device_permission_cause(device, exc)
        return (
            f"{device} cannot be opened ({exc.strerror}): is the fuse kernel module loaded? "
            "(sudo modprobe fuse)"
        )
    if not _may_mount(status):
        return (
            "this process may not mount (CAP_SYS_ADMIN is not in its capability bounding "
            "set); in a container, add --cap-add SYS_ADMIN --device /dev/fuse"
        )
    if user_id == 0:
        return None
    helper = fusermount if fusermount is not None else _find_fusermount()
    if helper is None or not os.access(helper, os.X_OK):
        return (
            "fusermount3 is not installed or cannot be run (an unprivileged user mounts "
            "through it): "
            "install fuse3 (apt install fuse3, or dnf install fuse3)"
        )
    info = os.stat(helper)
    if info.st_uid != 0 or not info.st_mode & stat.S_ISUID:
        return (
            f"{helper} is not setuid root, so an unprivileged user cannot mount with it: "
            f"reinstall fuse3, or sudo chmod u+s {helper}"
        )
    if allow_other and not _user_allow_other(fuse_conf):
        return (
            f"allow_other needs the line user_allow_other in {fuse_conf} for users other "
            "than root: add it (as root), or mount without allow_other"
        )
    if not os.access(mountpoint, os.W_OK):
        return (
            f"this user has no write access to the mountpoint {mountpoint}, which "
            "fusermount3 requires: mount on a folder you own"
        )
    return None


def _device_permission_cause(device: Path, exc: OSError) -> str:
    import grp
    import pwd

    info = os.stat(device)
    owner = _name_of(pwd.getpwuid, info.st_uid)
    group = _name_of(grp.getgrgid, info.st_gid)
    mode = stat.filemode(info.st_mode)
    fixes = f"make it usable by all as most systems do (sudo chmod 0666 {device})"
    if info.st_gid != 0 and info.st_mode & 0o060 == 0o060:
        fixes = (
            f"add this user to the {group} group (sudo usermod -aG {group} $USER, then log in "
            f"again), or {fixes}"
        )
    found = f"{exc.strerror}; it is {mode} {owner}:{group}"
    return f"{device} cannot be opened by this user ({found}): {fixes}"


def _name_of(lookup: Callable[[int], Any], number: int) -> str:
    try:
        return str(lookup(number)[0])
    except KeyError:
        return str(number)


def _find_fusermount() -> str | None:
    """fusermount3 as libfuse runs it: its install folder first, then PATH."""
    for name in ("fusermount3", "fusermount"):
        for path in (f"/usr/bin/{name}", f"/bin/{name}", shutil.which(name)):
            if path and os.path.isfile(path):
                return path
    return None


def _may_mount(status: Path) -> bool:
    """False when CAP_SYS_ADMIN is outside the bounding set: neither this process nor a
    setuid fusermount3 it runs can mount then. True when it cannot be told."""
    try:
        for line in status.read_text().splitlines():
            if line.startswith("CapBnd:"):
                return bool(int(line.split()[1], 16) >> _CAP_SYS_ADMIN & 1)
    except (OSError, ValueError, IndexError):
        pass
    return True


def _user_allow_other(fuse_conf: Path) -> bool:
    try:
        lines = fuse_conf.read_text().splitlines()
    except OSError:
        return False
    return any(line.split("#", 1)[0].strip() == "user_allow_other" for line in lines)

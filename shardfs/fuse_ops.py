"""The FUSE adapter: kernel callbacks onto ShardFileSystem, errors onto errno. Nothing else."""

from __future__ import annotations

import errno
import functools
import logging
import os
from collections.abc import Callable
from typing import Any, TypeVar, cast

import mfusepy

from .config import MountConfig
from .errors import ReadOnlyError, ShardfsError
from .filesystem import ShardFileSystem

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])
_TIME_FIELDS = ("st_atime", "st_mtime", "st_ctime")
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC


def _errno(func: F) -> F:
    """Answer ShardfsError with its errno and anything unexpected with EIO (logged)."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except ShardfsError as exc:
            if exc.errno not in (errno.ENOENT, errno.ENODATA):
                log.warning("%s: %s", func.__name__, exc)
            raise mfusepy.FuseOSError(exc.errno) from exc
        except mfusepy.FuseOSError:
            raise
        except Exception as exc:
            log.exception("%s failed", func.__name__)
            raise mfusepy.FuseOSError(errno.EIO) from exc

    return cast(F, wrapper)


def _read_only(*_args: Any, **_kwargs: Any) -> None:
    raise mfusepy.FuseOSError(ReadOnlyError.errno)


class FuseOperations(mfusepy.Operations):  # type: ignore[misc]
    """Kernel callbacks for a read-only shardfs mount."""

    use_ns = True

    def __init__(
        self,
        core: ShardFileSystem,
        config: MountConfig,
        on_ready: Callable[[], None] | None = None,
        *,
        zero_open: bool = False,
    ) -> None:
        self.core = core
        self.config = config
        self.on_ready = on_ready
        self.zero_open = zero_open

    def init_with_config(self, _conn: Any, fuse_config: Any) -> None:
        # The dataset is immutable: let the kernel keep pages, entries and attributes.
        timeout = self.config.kernel_timeout
        fuse_config.kernel_cache = 1
        fuse_config.entry_timeout = timeout
        fuse_config.attr_timeout = timeout
        fuse_config.negative_timeout = timeout
        fuse_config.use_ino = 1
        if self.on_ready is not None:
            self.on_ready()

    @_errno
    def getattr(self, path: str, fh: int | None = None) -> dict[str, int]:
        attributes = self.core.getattr(path)
        for name in _TIME_FIELDS:  # use_ns: mfusepy expects nanoseconds
            attributes[name] *= 1_000_000_000
        return attributes

    @_errno
    def readdir(self, path: str, fh: int) -> list[Any]:
        entries: list[Any] = [".", ".."]
        for name, node in self.core.readdir(path):
            entries.append((name, {"st_mode": node.st_mode, "st_ino": node.ino}, 0))
        return entries

    @_errno
    def readlink(self, path: str) -> str:
        return self.core.readlink(path)

    @_errno
    def open(self, path: str, flags: int) -> int:
        if flags & _WRITE_FLAGS:
            raise ReadOnlyError(path)
        if self.zero_open:
            # ENOSYS tells the kernel (FUSE_CAP_NO_OPEN_SUPPORT) to open files itself from
            # now on, keeping their page cache: no open or release reaches us again, and
            # reads come by path.
            raise mfusepy.FuseOSError(errno.ENOSYS)
        return self.core.open(path)

    @_errno
    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        if self.zero_open or not fh:
            return self.core.read_path(path, offset, size)
        return self.core.read(fh, offset, size)

    @_errno
    def release(self, path: str, fh: int) -> int:
        if fh:
            self.core.release(fh)
        return 0

    @_errno
    def getxattr(self, path: str, name: str, position: int = 0) -> bytes:
        return self.core.getxattr(path, name)

    @_errno
    def listxattr(self, path: str) -> list[str]:
        return self.core.listxattr(path)

    @_errno
    def statfs(self, path: str) -> dict[str, int]:
        return self.core.statfs()

    @_errno
    def access(self, path: str, amode: int) -> int:
        self.core.getattr(path)
        if amode & os.W_OK:
            raise ReadOnlyError(path)
        return 0

    create = mkdir = mknod = rename = rmdir = symlink = link = unlink = _read_only
    write = truncate = chmod = chown = utimens = setxattr = removexattr = _read_only


def serve(
    core: ShardFileSystem,
    config: MountConfig,
    on_ready: Callable[[], None],
    *,
    zero_open: bool = False,
) -> None:
    """Mount and serve until unmounted or signalled (SIGINT/SIGTERM unmount cleanly)."""
    options: dict[str, Any] = {
        "foreground": True,
        "nothreads": not config.threads,
        "ro": True,
        "fsname": "shardfs",
        "subtype": "shardfs",
        "default_permissions": True,
    }
    if config.allow_other:
        options["allow_other"] = True
    operations = FuseOperations(core, config, on_ready, zero_open=zero_open)
    mfusepy.FUSE(operations, str(config.mountpoint), **options)

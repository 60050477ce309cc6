"""The shardfs exception hierarchy.

Every error a user can meet is a ``ShardfsError``; each class carries the errno the
FUSE adapter answers with and the exit code the CLI returns.

    ShardfsError
     ├── UsageError               bad arguments or configuration (exit 2)
     ├── SourceError              the store could not be reached or listed
     │    ├── SourceNotFoundError    bucket/prefix missing, or no shards in it
     │    └── StoreReadError         a ranged read failed after retries
     ├── ShardChangedError        a shard no longer matches the index (ESTALE)
     ├── CorruptShardError        a tar shard is truncated or malformed
     │    ├── UnsafeMemberError      a member path would escape the mount or is no Linux path
     │    └── UnsupportedMemberError a member is compressed or encrypted (zip): no byte range
     ├── IndexFileError           the persisted index is unreadable
     ├── MountError               the mountpoint cannot be used
     │    └── FuseUnavailableError   this user may not mount FUSE here
     └── FileSystemError          a path lookup failed inside the mounted tree
          ├── NotFoundError          ENOENT
          ├── NotADirError           ENOTDIR
          ├── IsADirError            EISDIR
          ├── NoSuchAttributeError   ENODATA
          └── ReadOnlyError          EROFS
"""

from __future__ import annotations

import errno


class ShardfsError(Exception):
    """Base class: one clear line of text, an errno for FUSE and an exit code for the CLI."""

    errno: int = errno.EIO
    exit_code: int = 1


class UsageError(ShardfsError):
    """The command line or configuration is invalid."""

    errno = errno.EINVAL
    exit_code = 2


class SourceError(ShardfsError):
    """The store behind the source could not be reached or listed."""

    exit_code = 3


class SourceNotFoundError(SourceError):
    """The bucket or prefix does not exist, or it holds no shards."""

    errno = errno.ENOENT


class StoreReadError(SourceError):
    """A read from the store failed even after retries."""


class ShardChangedError(ShardfsError):
    """A shard changed in the store since it was indexed; its old bytes must not be served."""

    errno = errno.ESTALE
    exit_code = 4


class CorruptShardError(ShardfsError):
    """A tar shard is truncated or malformed; the message names the shard and the offset."""

    exit_code = 4

    def __init__(self, shard: str, offset: int, reason: str) -> None:
        super().__init__(f"{shard}: {reason} at offset {offset}")
        self.shard = shard
        self.offset = offset
        self.reason = reason


class UnsafeMemberError(CorruptShardError):
    """A member path is absolute, climbs out with '..', or cannot be a Linux path (not UTF-8,
    a NUL, a name over 255 bytes, a path over 4,095 bytes or 256 levels)."""


class UnsupportedMemberError(CorruptShardError):
    """A member cannot be served as a byte range of the shard: it is compressed or
    encrypted (a zip member neither stored nor deflated). The message names the member
    and the fix."""


class IndexFileError(ShardfsError):
    """The persisted index is unreadable or from an incompatible version."""

    exit_code = 4


class MountError(ShardfsError):
    """The mountpoint does not exist, is not empty, is already mounted, or FUSE failed."""

    errno = errno.EBUSY
    exit_code = 5


class FuseUnavailableError(MountError):
    """FUSE cannot be used by this user here: ``/dev/fuse`` missing or not accessible,
    fusermount3 missing, or ``allow_other`` not allowed; the message names the fix."""


class FileSystemError(ShardfsError):
    """A lookup inside the mounted tree failed."""


class NotFoundError(FileSystemError):
    """No such file or directory in the view."""

    errno = errno.ENOENT


class NotADirError(FileSystemError):
    """A directory operation on a file."""

    errno = errno.ENOTDIR


class IsADirError(FileSystemError):
    """A file operation on a directory."""

    errno = errno.EISDIR


class NoSuchAttributeError(FileSystemError):
    """The extended attribute does not exist."""

    errno = errno.ENODATA


class ReadOnlyError(FileSystemError):
    """The mount is read-only."""

    errno = errno.EROFS

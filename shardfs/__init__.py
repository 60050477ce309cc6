"""shardfs: mount sharded datasets in object storage as a read-only directory tree.

Only configuration and errors are re-exported here, so ``import shardfs`` stays light: it
loads neither fsspec, libfuse nor torch.
"""

__version__ = "0.1.0"

from .config import IndexConfig, MountConfig, ReadConfig, SourceConfig, ViewConfig
from .errors import (
    CorruptShardError,
    FileSystemError,
    FuseUnavailableError,
    IndexFileError,
    IsADirError,
    MountError,
    NoSuchAttributeError,
    NotADirError,
    NotFoundError,
    ReadOnlyError,
    ShardChangedError,
    ShardfsError,
    SourceError,
    SourceNotFoundError,
    StoreReadError,
    UnsafeMemberError,
    UnsupportedMemberError,
    UsageError,
)

__all__ = [
    "CorruptShardError",
    "FileSystemError",
    "FuseUnavailableError",
    "IndexConfig",
    "IndexFileError",
    "IsADirError",
    "MountConfig",
    "MountError",
    "NoSuchAttributeError",
    "NotADirError",
    "NotFoundError",
    "ReadConfig",
    "ReadOnlyError",
    "ShardChangedError",
    "ShardfsError",
    "SourceConfig",
    "SourceError",
    "SourceNotFoundError",
    "StoreReadError",
    "UnsafeMemberError",
    "UnsupportedMemberError",
    "UsageError",
    "ViewConfig",
    "__version__",
]

"""shardfs: mount tar shards in object storage as a read-only directory tree."""

__version__ = "0.1.0"

__all__ = ["__version__"]

"""The persistent block cache: shard-aligned blocks on local disk, bounded, crash-safe, verified.

Layout under ``CACHE_DIR``::

    blocks/ab/<shard key>/<block index>   one file per block: header + data
    tmp/<pid>-<n>.tmp                    blocks being written (renamed into blocks/)
    cache.sqlite                         size and last use of each block (for the bound)
    locks                                byte-range locks: one fetch per block across mounts

The parts, each the one owner of its lock and its file:

- ``block_format``: the header with a checksum per chunk; reads verify what they return;
- ``writer``: temp file, then rename (a killed daemon leaves a whole block or none);
- ``landing``: the page-aligned buffers blocks are received into and written from;
- ``ledger``: ``cache.sqlite``, the bound, eviction victims, retired blocks;
- ``info``: ``cache info`` and ``cache clear``, without a mount;
- ``claims``: one fetch per block in this process and, via ``locks``, across mounts, held
  as a ``Claim`` that its owner may hand to another thread;
- ``open_blocks``: block files kept open, and the reads that pin them;
- ``block_cache``: ``BlockCache``, which ties them together: look up, claim, put, evict.
  It never fetches; readers fill it (``shardfs.read.fills``).

The block files are the truth; the ledger is only bookkeeping over them. An unreadable
ledger is rebuilt from the block headers (one warning), and an unusable ``locks`` file is
recreated, so no single damaged file stops a mount or loses a valid block.
"""

from .block_cache import BlockCache, NoRoom
from .block_format import (
    MAGIC,
    BlockKey,
    CorruptBlockError,
    NotInMemory,
    block_file_size,
    block_header,
    encode_block,
    encoded_size,
    read_data,
    read_header,
    read_verified,
    shard_key,
)
from .claims import Claim, open_lock_file
from .info import cache_info, clear_cache
from .ledger import heal_cache_folder, ledger_damaged, rebuild_ledger
from .space import EVICT_ANY, EVICT_NONE, RETIRED_BEFORE
from .writer import remove_any

__all__ = [
    "EVICT_ANY",
    "EVICT_NONE",
    "MAGIC",
    "RETIRED_BEFORE",
    "BlockCache",
    "BlockKey",
    "Claim",
    "CorruptBlockError",
    "NoRoom",
    "NotInMemory",
    "block_file_size",
    "block_header",
    "cache_info",
    "clear_cache",
    "encode_block",
    "encoded_size",
    "heal_cache_folder",
    "ledger_damaged",
    "open_lock_file",
    "read_data",
    "read_header",
    "read_verified",
    "rebuild_ledger",
    "remove_any",
    "shard_key",
]

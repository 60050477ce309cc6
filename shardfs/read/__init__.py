"""Reading: where the bytes of a presented file come from.

- ``seam``: what the core asks of a reader (``RangeReader``), and the cache key of a shard;
- ``reader``: ``CachedReader``: cache hit, block fill, range;
- ``direct``: ``DirectReader`` (``--no-cache``): every read a ranged GET;
- ``fills``: filling a missing block from the store, one fetch per block;
- ``readahead``: background fetches: the rest of a block, then whole shards;
- ``files_ahead``: files an order hint names, fetched ahead as ranges when the cache is full;
- ``local_blocks``: the news that a block (or a file fetched ahead) is local, for whoever
  pushes it to the kernel.
"""

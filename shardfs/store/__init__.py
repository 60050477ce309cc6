"""The store: the only code that talks to object storage, through fsspec.

A source URL becomes a list of shards, and a shard becomes checked bytes:

- ``urls``: which shards a URL names (a folder, one ``.tar``, a brace pattern, a glob);
- ``listing``: finding those shards in the store (a listing, or HEADs for exact names);
- ``client``: the fsspec filesystem, its options and timeouts, and ``translate_errors``,
  the one place where a foreign library's errors become ``ShardfsError``;
- ``remote``: ``Store``, ranged reads, streams and small objects, for every other family;
- ``s3_ranges``, ``presigned``, ``http_ranges``: the ranged GET of each kind of store;
- ``plain_ranges``: shards in a local folder (``pread``) and in any other fsspec store;
- ``responses``: the one check of every answer (status, range, version, length);
- ``object_writes``: what ``pack`` writes next to the shards, each object whole or not at all;
- ``whole_shards``: shards a server sent whole (it ignores ``Range``), kept in memory;
- ``sets``: several sources as one store (``shardfs mount A B MNT``);
- ``shards``: ``ShardInfo`` and ``Readable``, the types other families name, and
  ``ShardStream``, a shard read front to back for the index scan, one chunk ahead; without
  fsspec.

Docstring-only, so that importing ``shards`` does not load fsspec.
"""

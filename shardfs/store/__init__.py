"""The store: the only code that talks to object storage, through fsspec.

A source URL becomes a list of shards, and a shard becomes checked bytes:

- ``urls``: which shards a URL names (a folder, one ``.tar``, a brace pattern, a glob);
- ``listing``: finding those shards in the store (a listing, or HEADs for exact names);
- ``client``: the fsspec filesystem, its options and timeouts, and ``translate_errors``,
  the one place where a foreign library's errors become ``ShardfsError``;
- ``remote``: ``Store``, ranged reads, streams and small objects, for every other family;
- ``s3_ranges``, ``presigned``, ``http_ranges``: the ranged GET of each kind of store;
- ``responses``: the one check of every answer (status, range, version, length);
- ``stream``: a shard read front to back for the index scan, one chunk ahead;
- ``local_files``: shards in a local folder, read with ``pread``;
- ``whole_shards``: shards a server sent whole (it ignores ``Range``), kept in memory;
- ``sets``: several sources as one store (``shardfs mount A B MNT``);
- ``shards``: ``ShardInfo`` and ``Readable``, the types other families name, without fsspec.

Docstring-only, so that importing ``shards`` does not load fsspec.
"""

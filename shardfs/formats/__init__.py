"""Shard formats: what the bytes of a shard hold, and how member names are judged.

- ``tar``: the streaming tar parser (ustar, pax and GNU headers), members with data offsets;
- ``registry``: which parser indexes a shard, by name (tar is streamed; other formats
  register a scanner that reads by range);
- ``zip``: zip shards (zip64 too) read by range: stored members as direct extents;
- ``source``: ``ShardBytes``, the by-range view of a shard those scanners read;
- ``members``: the rules for what an index row may hold: safe relative paths, symlink
  targets, sample keys and labels.

The parsers know nothing of stores or indexes: they read a ``Readable`` or a ``ShardBytes``.
"""

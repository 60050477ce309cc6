"""Shard formats: what the bytes of a shard hold, and how member names are judged.

- ``tar``: the streaming tar parser (ustar, pax and GNU headers), members with data offsets;
- ``members``: the rules for what an index row may hold: safe relative paths, symlink
  targets, sample keys and labels.

The parsers know nothing of stores or indexes: they read a ``Readable``.
"""

"""The global index: every member of every shard, built once and kept in SQLite.

- ``scan``: one shard streamed front to back into index rows (the format's parser, the
  member rules, the labels);
- ``db``: the index itself: schema, incremental updates against a new listing, the sidecar
  that ``pack`` writes, and lookups for the views.
"""

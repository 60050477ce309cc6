"""Tools that work on a dataset without mounting it.

- ``pack``: a folder tree into tar shards plus an index sidecar, dropping nothing;
- ``verify``: a packed dataset against its source tree, by hash;
- ``warm``: a whole dataset streamed into the block cache with concurrent GETs;
- ``progress``: the progress bars of scans, packs and warms, on any terminal.
"""

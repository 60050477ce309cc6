"""The filesystem core: what FUSE asks, answered without FUSE, so tests drive it directly.

- ``filesystem``: lookups, attributes, listings, handles and reads over a view and a reader;
- ``attributes``: what ``stat`` shows of a node (owner, modes, sizes, times), in one place;
- ``order_hints``: the placement table the core serves and the order hint it takes in.
"""

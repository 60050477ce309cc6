"""The life of a mount: building it, running it as a daemon, stopping it.

- ``lifecycle``: ``Mount``, which builds every part of one mount and stops them in order;
- ``daemon``: ``shardfs mount`` re-running itself in the background, readiness, signals;
- ``control``: the unix socket a running mount answers ``stats`` on, and its pid file;
- ``mountpoints``: whether a folder can be mounted on, and why FUSE refused;
- ``options``: ``-o`` options as FUSE tools and ``/etc/fstab`` write them;
- ``allocator``: glibc's allocator set to reuse the pages of received blocks;
- ``table``: what the kernel's mount table says about a path (a leaf: the training
  process reads it through ``shardfs.placement``).

Docstring-only, so that ``shardfs.placement`` can import ``table`` without loading FUSE.
"""

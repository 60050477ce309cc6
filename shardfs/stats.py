"""Live counters of a mount, shared by the filesystem core, the reader and the block cache."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any


@dataclass
class Stats:
    """Monotonic counters; ``add`` is thread-safe, ``snapshot`` gives a consistent copy."""

    bytes_served: int = 0
    bytes_pushed: int = 0
    # Shard bytes that crossed the wire (``store.Store`` counts them): reads, readahead,
    # ``warm`` and index scans; where a server ignored Range, the whole shard it sent.
    bytes_fetched: int = 0
    store_requests: int = 0  # GETs of shard bytes sent, retries included
    scan_bytes: int = 0  # of bytes_fetched, what index scans fetched (their blocks are kept)
    scan_requests: int = 0  # of store_requests, the index scans' GETs
    whole_shard_answers: int = 0  # ranged GETs answered with the whole shard (Range ignored)
    cache_hits: int = 0
    cache_misses: int = 0
    blocks_written: int = 0
    prefetched_blocks: int = 0
    blocks_evicted: int = 0
    blocks_retired: int = 0  # blocks whose hinted files were all read (small cache, hint)
    checksum_failures: int = 0
    cache_write_errors: int = 0
    folders_listed: int = 0  # listings the daemon built (the kernel caches them after)
    hints_taken: int = 0  # order hints accepted (see shardfs.placement)
    hinted_reads: int = 0  # reads of files in the current order hint
    reads_waited_on_network: int = 0  # reads that found their bytes neither local nor fetched ahead
    prefetched_bytes: int = 0  # bytes of blocks readahead stored
    prefetched_bytes_read: int = 0  # of those, bytes of blocks some read has since touched
    evicted_unread_bytes: int = 0  # bytes of blocks fetched ahead, evicted before any read
    blocks_not_admitted: int = 0  # fetched blocks not kept: room only by evicting warm ones
    range_reads: int = 0  # reads fetched as ranges: their block would evict warm blocks
    files_fetched_ahead: int = 0  # files an order hint had fetched as ranges, cache full
    files_ahead_read: int = 0  # reads served by those
    files_ahead_opened: int = 0  # of those files, opened from the kernel's cache (pushed)
    delivered_bytes: int = 0  # bytes of distinct files served or pushed to the kernel
    hot_path_reads: int = 0  # of cache_hits, READs the compiled FUSE path answered
    files_published: int = 0  # files handed to the compiled path with their cached block
    hot_path_not_in_memory: int = 0  # READs C left to Python: the block's pages were not in memory
    hot_path_checksum_failures: int = 0  # READs C left to Python: a chunk failed its sum there
    publishes_after_reads: int = 0  # blocks published to C after a READ in Python (header read)
    hot_path_disk_reads: int = 0  # of hot_path_reads, READs waiting on the disk in C's readers
    hot_path_direct_reads: int = 0  # of those, read with O_DIRECT (past the page cache)
    hot_path_memory_reads: int = 0  # of hot_path_reads, READs of fetched blocks before their push
    hot_path_edge_reads: int = 0  # of hot_path_reads, READs of files across two blocks' edge
    python_reads: int = 0  # READs of file bytes answered in Python (not by the compiled path)
    python_reads_later: int = 0  # of python_reads, those a worker answered (they waited)
    hot_path_lookups: int = 0  # LOOKUPs the compiled path answered (names in published folders)
    python_lookups: int = 0  # LOOKUPs answered in Python
    folders_published: int = 0  # folders whose entries were handed to the compiled path
    landing_room_timeouts: int = 0  # readahead GETs that stopped waiting for landing memory
    landing_mapped_bytes: int = 0  # fresh landing memory mapped (its pages faulted in once)
    blocks_kept_unstored: int = 0  # blocks fetched, then not stored (no room, failed write): held
    blocks_paid_in_part: int = 0  # blocks a hint's plan left out: part came as a range this epoch
    inodes_forgotten: int = 0  # inodes the kernel dropped (FORGET of all its lookups), pages too
    pushes_refused: int = 0  # kernel pushes refused: the kernel no longer held the inode
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    # Counters kept elsewhere (the compiled FUSE hot path), added in at each snapshot.
    _sources: list[Callable[[], dict[str, int]]] = field(
        default_factory=list, repr=False, compare=False
    )

    def add_source(self, source: Callable[[], dict[str, int]]) -> None:
        """Have ``source()`` (counter name -> count so far) added into every snapshot."""
        self._sources.append(source)

    def add(self, **deltas: int) -> None:
        values = self.__dict__  # the counters, without a getattr and a setattr call each
        with self._lock:
            for name, delta in deltas.items():
                values[name] += delta

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            values: dict[str, Any] = {
                f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")
            }
        for source in self._sources:
            for name, count in source().items():
                values[name] += count
        lookups = values["cache_hits"] + values["cache_misses"]
        values["hit_ratio"] = values["cache_hits"] / lookups if lookups else 0.0
        # Prefetched blocks no read has touched (yet): still waiting, or evicted unread.
        values["prefetched_unread_bytes"] = (
            values["prefetched_bytes"] - values["prefetched_bytes_read"]
        )
        # What the store sent (index scans included) over what readers got, each file
        # counted once: 1.0 when each byte read was downloaded once; more when blocks were
        # fetched again or not used (tar headers, files not read, whole shards sent).
        delivered = values["delivered_bytes"]
        values["egress_amplification"] = values["bytes_fetched"] / delivered if delivered else 0.0
        return values

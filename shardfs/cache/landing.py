"""Landing buffers: fetched blocks received straight into the memory they are written from.

A block is written to the cache with ``O_DIRECT`` (``writer.py``), which needs its header
and data contiguous in page-aligned memory. Received as ``bytes``, every block was copied
once more into such a buffer, and the fresh ``bytes`` cost page faults besides. A landing
buffer is a page-aligned mapping with room for the block's header in front: the socket
fills the data part (``take``), the writer puts the header before it and writes the whole
mapping as it is (``in_place``).

A buffer goes back to use only when nothing refers to it any more: the data part is handed
on as a ``memoryview``, and every view of a mapping keeps a reference to it (the pusher's
queue, a reader's slice). Idle buffers are kept up to ``keep`` bytes (as many 1 MiB
blocks as 8 MiB ones fill), the rest unmapped: a fresh mapping costs a page fault per page.

A buffer is private anonymous memory, asked for in transparent huge pages where the kernel
offers them (``madvise`` mode, as on Debian): an 8 MiB block then faults in as four 2 MiB
pages, not 2,048 small ones. A buffer cannot always be reused (the pusher holds blocks
until it reaches them), and in this VM a fresh small page costs about 3 us to fault in:
receiving an 8 MiB block into fresh shared memory took 7.4-8.0 ms of the fetch thread's
time, into fresh huge pages 0.6-1.2 ms (``bench/per_file.py`` shows the faults per file).
Shared anonymous memory (Python's default mapping) is shmem, which takes no huge pages
here; nothing needs a buffer shared, as no process is forked with one.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import sys
import threading
import time
from collections.abc import Iterator

from .block_format import PAGE, header_len

KEEP_BYTES = 64 << 20  # idle buffers kept for reuse
# Landing memory that readahead may hold before its next GET waits (``room``): blocks
# fetched far ahead of the kernel pusher sit in buffers, and each buffer past the ones in
# reuse is fresh memory, which this VM faults in at up to 10 us a page. A first epoch over a
# full cache held 17 blocks of 8 MiB at once: 0.35 s of the daemon's 0.8 s went to zeroing
# their pages (perf, stop 40). Readahead still runs far ahead of the readers: at 300
# images/s they take 30 MB/s.
READAHEAD_BYTES = 64 << 20
# A GET waiting for room looks again when a holder lets buffers go (``released``: the
# pusher, once per block), else at this interval. Looking every 2 ms cost the fetch threads
# about 7 looks per block in a cold epoch.
_ROOM_POLL_S = 0.02
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux's value
HUGE_PAGE = 2 << 20  # x86-64's and arm64's (4 KiB base pages) transparent huge page
# References to a free mapping while ``in_use`` looks at it: the list, the loop's name,
# and getrefcount's own argument (``_free_map`` loops over a copy of the list: one more).
_UNUSED_REFS = 3


def _address(buffer: mmap.mmap | memoryview) -> int:
    """The address of a writable buffer's first byte."""
    probe = ctypes.c_char.from_buffer(buffer)
    try:
        return ctypes.addressof(probe)
    finally:
        del probe  # releases the export at once


def anonymous_map(size: int) -> mmap.mmap:
    """A private anonymous mapping of at least ``size`` bytes, in huge pages where it can.

    A mapping of ``HUGE_PAGE`` or more is sized to whole huge pages, so that the kernel
    places it on a huge page boundary, and the huge pages it covers within ``size`` are
    asked for; the rest stays in small pages (the bytes past ``size`` are never touched,
    so they cost address space only). Where the kernel has no transparent huge pages, or
    refuses the advice, the mapping is plain small pages."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    if size < HUGE_PAGE:
        return mmap.mmap(-1, size, flags=flags)
    mapping = mmap.mmap(-1, -(-size // HUGE_PAGE) * HUGE_PAGE, flags=flags)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        # refused where the kernel has no transparent huge pages: small pages then
        with contextlib.suppress(OSError):
            mapping.madvise(advice, 0, size // HUGE_PAGE * HUGE_PAGE)
    return mapping


def _fault_in(mapping: mmap.mmap, size: int) -> None:
    """Back the first ``size`` bytes of ``mapping`` with memory: one write per page (the
    kernel's MADV_POPULATE_WRITE where it has it, since Linux 5.14)."""
    with contextlib.suppress(OSError, ValueError):
        mapping.madvise(MADV_POPULATE_WRITE, 0, size)
        return
    with memoryview(mapping) as view:
        view[:size:PAGE] = bytes(-(-size // PAGE))


class LandingBuffers:
    """Page-aligned mappings of block size plus header room, reused once unreferenced."""

    def __init__(self, chunk_size: int, keep: int = KEEP_BYTES) -> None:
        self.chunk_size = chunk_size
        self.keep = keep
        self._maps: list[mmap.mmap] = []
        self._bases: dict[int, int] = {}  # id(mapping) -> address
        self._coming = 0  # bytes of the GETs inside ``room``
        self.mapped_bytes = 0  # fresh memory mapped so far (each page faulted in once)
        self._lock = threading.Lock()
        self._released = threading.Condition()
        self._releases = 0  # ``released`` calls so far

    def _sizes(self, length: int) -> tuple[int, int]:
        """(the header room before a block of ``length`` bytes, the whole pages both fill)."""
        lead = header_len(length, self.chunk_size)
        return lead, -(-(lead + length) // PAGE) * PAGE

    def _add_locked(self, mapping: mmap.mmap) -> None:
        """Count and keep a new mapping (under the lock)."""
        self.mapped_bytes += len(mapping)
        self._maps.append(mapping)
        self._bases[id(mapping)] = _address(mapping)

    def take(self, length: int) -> memoryview:
        """A writable view of ``length`` bytes to receive a block's data into, placed just
        after the room its header needs."""
        lead, size = self._sizes(length)
        with self._lock:
            found = self._free_map(size)
            if found is None:
                found = anonymous_map(size)
                self._add_locked(found)
        return memoryview(found)[lead : lead + length]

    def prefill(self, length: int, count: int) -> int:
        """Map and fault in ``count`` idle buffers for blocks of ``length`` bytes now, so
        that the first GETs into them find memory already backed (at mount, before any
        reader waits: a fresh page costs this VM microseconds at its first touch, paid by a
        fetch otherwise). They are kept like any idle buffer (``keep`` grows to hold them).
        Returns the bytes mapped."""
        _, size = self._sizes(length)
        mapped = 0
        for _ in range(count):
            mapping = anonymous_map(size)
            _fault_in(mapping, size)
            with self._lock:
                self._add_locked(mapping)
            mapped += len(mapping)
        with self._lock:
            self.keep = max(self.keep, sum(len(mapping) for mapping in self._maps))
        return mapped

    def in_place(self, header: bytes, data: bytes | memoryview) -> memoryview | None:
        """When ``data`` is a view that ``take`` gave, with ``header`` of the length made
        room for: the header written in front of it, and a view of header + data padded to
        whole pages (for an ``O_DIRECT`` write). Else None."""
        if not isinstance(data, memoryview) or not isinstance(data.obj, mmap.mmap) or not data:
            return None
        with self._lock:
            base = self._bases.get(id(data.obj))
        if base is None or data.readonly or not data.contiguous:
            return None
        lead = _address(data) - base
        if lead != len(header) or lead != header_len(len(data), self.chunk_size):
            return None
        whole = memoryview(data.obj)
        whole[:lead] = header
        return whole[: -(-(lead + len(data)) // PAGE) * PAGE]

    def in_use(self) -> int:
        """Bytes of the buffers something still refers to (a block not yet written or
        pushed, a reader's slice)."""
        with self._lock:
            return self._in_use_locked()

    def _in_use_locked(self) -> int:
        # A plain loop over the list itself (nothing changes it under the lock): a
        # generator over a copy cost three interpreter calls per buffer, at every look.
        used = 0
        for mapping in self._maps:
            if sys.getrefcount(mapping) > _UNUSED_REFS:
                used += len(mapping)
        return used

    @contextlib.contextmanager
    def room(
        self, length: int, limit: int = READAHEAD_BYTES, timeout: float = 1.0
    ) -> Iterator[bool]:
        """Wait (up to ``timeout``) until ``length`` more bytes stay within ``limit`` (the
        buffers in use, and the GETs inside this block for their whole lengths), or nothing
        is in use; yields whether they do, and counts them until the exit. For readahead
        only: a read that waits on its block must never wait here."""
        deadline = 0.0
        while True:
            seen = self._releases  # an int read: atomic under the interpreter lock
            with self._lock:
                held = self._in_use_locked() + self._coming
                fits = held == 0 or held + length <= limit
                if not fits:
                    now = time.monotonic()
                    deadline = deadline or now + timeout
                if fits or now >= deadline:
                    self._coming += length
                    break
            with self._released:
                if self._releases == seen:  # else a release came meanwhile: look again now
                    self._released.wait(min(_ROOM_POLL_S, deadline - now))
        try:
            yield fits
        finally:
            with self._lock:
                self._coming -= length

    def released(self) -> None:
        """A holder let buffers go (the pusher, done with a block): a GET waiting for room
        looks again at once."""
        with self._released:
            self._releases += 1
            self._released.notify_all()

    def _free_map(self, size: int) -> mmap.mmap | None:
        """An unreferenced mapping of at least ``size`` bytes; idle ones past ``keep`` bytes
        are unmapped on the way (under the lock)."""
        found = None
        idle = 0
        for mapping in list(self._maps):
            if sys.getrefcount(mapping) > _UNUSED_REFS + 1:  # + the copied list
                continue
            if found is None and len(mapping) >= size:
                found = mapping
                continue
            idle += len(mapping)
            if idle > self.keep:
                self._maps.remove(mapping)
                self._bases.pop(id(mapping), None)
                mapping.close()
        return found

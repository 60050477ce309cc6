"""Claims on a block: one fetch per block within the process and across processes.

Within the process, the first thread to miss a block owns its flight; the others wait on it
and share its outcome. Across processes (several mounts of one cache folder), the owner also
holds a byte of the ``locks`` file that stands for the block (one of ``LOCK_SLOTS``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from .block_format import BlockKey
from .writer import remove_any

log = logging.getLogger(__name__)

LOCK_SLOTS = 1 << 16
SETUP_SLOT = LOCK_SLOTS  # the byte after the block slots: mounts set the ledger up in turn
# A block whose fetch just failed fails at once for this long: the kernel answers a failed
# readahead with an immediate single-page READ, which would otherwise wait out a second
# read deadline on a store that does not answer.
_FAILURE_HOLD_S = 1.0


def open_lock_file(root: Path) -> int:
    """The ``locks`` file, opened read-write; recreated (one warning) when something else
    sits at its name: a folder, a link, a pipe, or a file that will not open."""
    path = root / "locks"
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EIO):
            raise
        problem = exc.strerror or str(exc)
    else:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return fd
        os.close(fd)
        problem = "not a regular file"
    log.warning("cache lock file %s was unusable (%s); recreated it", path, problem)
    remove_any(path)
    return os.open(path, flags, 0o644)


def lock_byte(fd: int, offset: int) -> None:
    """Hold byte ``offset`` of the lock file; one holder across processes."""
    while True:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX, 1, offset)
            return
        except OSError as exc:
            # Record locks belong to the process, so two multithreaded mounts waiting
            # crosswise look like a deadlock to the kernel. It is none (a holder never
            # waits for another slot), so wait and try again.
            if exc.errno != errno.EDEADLK:
                raise
            time.sleep(0.01)


def unlock_byte(fd: int, offset: int) -> None:
    fcntl.lockf(fd, fcntl.LOCK_UN, 1, offset)


@contextlib.contextmanager
def holding(fd: int, offset: int) -> Iterator[None]:
    lock_byte(fd, offset)
    try:
        yield
    finally:
        unlock_byte(fd, offset)


def slot_of(key: BlockKey) -> int:
    """The byte of the lock file that stands for ``key`` (shared by unrelated keys)."""
    return (int(key.shard[:8], 16) ^ key.index) % LOCK_SLOTS


class LockFile:
    """The ``locks`` file of a cache folder: one byte per slot, locked across processes."""

    def __init__(self, root: Path) -> None:
        self.fd = open_lock_file(root)

    def lock(self, slot: int) -> None:
        lock_byte(self.fd, slot)

    def unlock(self, slot: int) -> None:
        unlock_byte(self.fd, slot)

    def holding(self, slot: int) -> contextlib.AbstractContextManager[None]:
        return holding(self.fd, slot)

    def close(self) -> None:
        os.close(self.fd)


class Flight:
    """One fetch of a block in progress. Threads that wait on it share its result: its
    failure (a black-holed store then fails every waiter once, not each in turn), or its
    bytes when they could not be stored; a stored block is read from disk as usual."""

    __slots__ = ("block", "done", "error")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: Exception | None = None
        self.block: bytes | None = None

    def outcome(self) -> bytes | None:
        """Wait for the fetch; raise its failure, or return its unstored block (else None)."""
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.block


class Claims:
    """The flights of this process and the failures held after them, under one lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._flights: dict[BlockKey, Flight] = {}
        self._failed: dict[BlockKey, tuple[Exception, float]] = {}

    def open_flight(self, key: BlockKey) -> tuple[Flight, bool]:
        """The flight of ``key`` and whether the caller owns it (it started it)."""
        with self._lock:
            flight = self._flights.get(key)
            if flight is not None:
                return flight, False
            flight = self._flights[key] = Flight()
            return flight, True

    def claim(self, key: BlockKey, *, wait: bool = True) -> bool:
        """Become the one thread fetching ``key``; else (if ``wait``) wait for the owner,
        raising its failure."""
        flight, owner = self.open_flight(key)
        if not owner and wait:
            flight.outcome()
        return owner

    def release(self, key: BlockKey, error: Exception | None = None) -> None:
        """End the flight of ``key`` (its owner only); its waiters wake."""
        with self._lock:
            flight = self._flights.pop(key)
        if error is not None and flight.error is None:
            flight.error = error
        flight.done.set()

    def in_flight(self, key: BlockKey) -> bool:
        return key in self._flights

    def raise_recent_failure(self, key: BlockKey) -> None:
        """Raise the failure of the last fetch of ``key`` while it is held."""
        with self._lock:
            failed = self._failed.get(key)
        if failed is not None and time.monotonic() < failed[1]:
            raise failed[0]

    def remember_failure(self, key: BlockKey, exc: Exception) -> None:
        now = time.monotonic()
        with self._lock:
            if key in self._failed and self._failed[key][0] is exc:
                return  # raised from the memory itself: the hold does not grow
            for old in [k for k, (_, until) in self._failed.items() if until <= now]:
                del self._failed[old]
            self._failed[key] = (exc, now + _FAILURE_HOLD_S)

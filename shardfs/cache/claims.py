"""Claims on a block: one fetch per block within the process and across processes.

Within the process, the first thread to miss a block owns its flight; the others wait on it
and share its outcome. Across processes (several mounts of one cache folder), the owner also
holds a byte of the ``locks`` file that stands for the block (one of ``LOCK_SLOTS``).

Both are held through one handle, a ``Claim``, which its owner may pass to a task on another
thread (the rest of a block fetched after the bytes a reader waits on).
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
    """The ``locks`` file of a cache folder: one byte per slot, locked across processes.

    Closing it drops every lock this process held; a claim released afterwards (a fill that
    outlived the cache) unlocks nothing, and never an fd number reused meanwhile."""

    def __init__(self, root: Path) -> None:
        self.fd = open_lock_file(root)
        self._closed = False

    def lock(self, slot: int) -> None:
        if self._closed:
            raise OSError(errno.EBADF, "the block cache is closed")
        lock_byte(self.fd, slot)

    def unlock(self, slot: int) -> None:
        if not self._closed:
            unlock_byte(self.fd, slot)

    def holding(self, slot: int) -> contextlib.AbstractContextManager[None]:
        return holding(self.fd, slot)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
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

    def wait(self, key: BlockKey, timeout: float) -> bool:
        """Wait (up to ``timeout``) for the flight of ``key`` to end; whether there was one."""
        with self._lock:
            flight = self._flights.get(key)
        if flight is None:
            return False
        flight.done.wait(timeout)
        return True

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


class Claim:
    """The right to fetch and store one block: this process's flight of it and, across
    processes, its slot of the ``locks`` file.

    A claim either *owns* the block (``owner``; release it once, on any thread, with
    ``release`` or by leaving its ``with``), or is what a waiter got once the owner finished:
    then ``shared`` holds the owner's block if it could not be stored, and ``release`` does
    nothing. The owner tells its waiters about a failure with ``fail``; they raise it instead
    of fetching the block again in turn."""

    __slots__ = ("_claims", "_flight", "_locks", "_slot", "key", "owner")

    def __init__(
        self,
        key: BlockKey,
        flight: Flight,
        *,
        owner: bool,
        claims: Claims | None = None,
        locks: LockFile | None = None,
    ) -> None:
        self.key = key
        self.owner = owner
        self._flight = flight
        self._claims = claims
        self._locks = locks
        self._slot = slot_of(key)

    @property
    def shared(self) -> bytes | None:
        """For a waiter: the block its owner fetched but could not store (else None)."""
        return None if self.owner else self._flight.block

    @property
    def held(self) -> bool:
        """Whether this handle still owns the block (not released yet)."""
        return self._claims is not None

    def share(self, block: bytes) -> None:
        """Hand the fetched block to the waiters (it could not be stored)."""
        self._flight.block = block

    def fail(self, exc: Exception, *, hold: bool = False) -> None:
        """Make the waiters raise ``exc``; ``hold``: fail new reads of the block at once for
        a moment too (a store that does not answer is not asked again at once)."""
        if self._flight.error is None:
            self._flight.error = exc
        if hold and self._claims is not None:
            self._claims.remember_failure(self.key, exc)

    def release(self) -> None:
        """Let others in: unlock the slot, end the flight (waiters wake). Idempotent."""
        claims, locks = self._claims, self._locks
        if claims is None or locks is None:
            return
        self._claims = self._locks = None
        try:
            locks.unlock(self._slot)
        finally:
            claims.release(self.key)

    def __enter__(self) -> Claim:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def claim_block(claims: Claims, locks: LockFile, key: BlockKey, *, wait: bool) -> Claim | None:
    """Claim ``key``: its flight in this process, then its slot across processes.

    Another thread of this process has it: None at once unless ``wait``; else wait for it
    and get a waiter's claim (or its failure raised). ``wait`` is a read that needs the
    block: a fetch of it that failed a moment ago fails it at once (``_FAILURE_HOLD_S``)."""
    flight, owner = claims.open_flight(key)
    if not owner:
        if not wait:
            return None
        flight.outcome()
        return Claim(key, flight, owner=False)
    try:
        if wait:
            claims.raise_recent_failure(key)
        locks.lock(slot_of(key))
    except Exception as exc:
        claims.release(key, exc)
        raise
    except BaseException:
        claims.release(key)
        raise
    return Claim(key, flight, owner=True, claims=claims, locks=locks)

"""What the compiled hot path (``hot_path``) saw, told to Python on threads of their own, so
that the thread answering requests never waits for the interpreter: which published
blocks answered READs (``used``, once a SWEEP_S, while C lets go of the blocks the cache
removed), and the opens and file-end READs of the files an order hint follows (``opened``,
in batches). ``settle`` tells both at once, on the caller's thread: before a new hint.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger(__name__)

# How often published blocks are checked for removal from the cache: what they may hold
# of the disk beyond the cache's bound is what the cache evicts in that time.
SWEEP_S = 1.0
_TAKE_OPENED = 1024  # inodes taken from C's queue of opens at a time
# How long the opens thread lets opens gather once woken. The hint hears of them that much
# later: at 300 images/s, 15 files' worth, where readahead runs blocks ahead. Half of the
# thread's CPU went per wake-up: at 10 ms, 0.11-0.16 s per 3,000-file epoch; at 50 ms,
# 0.05-0.07 s (docs/benchmark.md, stop 39).
OPENED_BATCH_S = 0.05


class HotReports:
    """The two report threads of one ``HotPath``: ``tokens`` names each of C's block slots
    to ``used``; ``opened(inodes)`` hears of the opens C queued."""

    def __init__(
        self,
        lib: ctypes.CDLL,
        slots: int,
        *,
        used: Callable[[Any], None],
        opened: Callable[[Sequence[int]], None],
    ) -> None:
        self._lib = lib
        self.tokens: list[Any] = [None] * slots
        self._used = used
        self._on_opened = opened
        self._flags = ctypes.create_string_buffer(slots)
        self._ctx: int | None = None
        self._fd = -1
        self._closing = threading.Event()
        self._sweep_lock = threading.Lock()
        self._opened_lock = threading.Lock()
        self._sweeper = threading.Thread(target=self._sweep, name="shardfs-hot", daemon=True)
        self._opens = threading.Thread(target=self._take_opened, name="shardfs-opened", daemon=True)

    def start(self, ctx: int) -> None:
        """Start both threads over C's state ``ctx``."""
        self._ctx = ctx
        self._sweeper.start()
        self._fd = os.eventfd(0, os.EFD_CLOEXEC)
        self._lib.hot_queue_opened(ctx, self._fd)
        self._opens.start()

    def settle(self) -> None:
        """Tell now, on this thread, what C saw so far: the blocks that answered READs and
        the opens it queued. Before a new order hint: they belong to the one before, whose
        retired blocks they would warm again (the next epoch's first blocks then found no
        room), or whose reads they would count as the new one's."""
        self.swept()
        self.opened_now()

    def _sweep(self) -> None:
        while not self._closing.wait(SWEEP_S):
            self.swept()

    def swept(self) -> None:
        """Let go of published blocks the cache removed, and tell ``used`` which blocks
        answered READs since the last time; one caller at a time."""
        with self._sweep_lock:
            if self._ctx is None:
                return
            self._lib.hot_sweep(self._ctx, self._flags)
            for slot, flag in enumerate(self._flags.raw):
                token = self.tokens[slot]
                if flag and token is not None:
                    try:
                        self._used(token)
                    except Exception:  # recency only: the reads were answered
                        log.exception("noting the use of a published block failed")

    def _take_opened(self) -> None:
        taken = (ctypes.c_uint64 * _TAKE_OPENED)()
        while True:
            os.eventfd_read(self._fd)  # C writes when its queue gets a first inode
            if self._closing.is_set():
                return
            # Let the opens of the next few milliseconds join the queue: one wake-up, one
            # call into C and one hold of the interpreter lock for them all.
            self._closing.wait(OPENED_BATCH_S)
            self.opened_now(taken)

    def opened_now(self, taken: ctypes.Array[ctypes.c_uint64] | None = None) -> None:
        """Tell ``opened`` of the opens C queued so far; one caller at a time."""
        taken = taken if taken is not None else (ctypes.c_uint64 * _TAKE_OPENED)()
        with self._opened_lock:
            while self._ctx is not None:
                count = self._lib.hot_take_opened(self._ctx, taken, len(taken))
                if count:
                    try:
                        self._on_opened(taken[:count])
                    except Exception:  # signs lost, the opens themselves were answered
                        log.exception("noting the opens of %d inodes failed", count)
                if count < len(taken):
                    return

    def close(self) -> None:
        """Stop both threads, telling the last opens queued; before C's state is freed."""
        self._closing.set()
        if self._sweeper.is_alive():
            self._sweeper.join()
        if self._fd >= 0:
            if self._ctx is not None:
                self._lib.hot_queue_opened(self._ctx, -1)  # no more queued
            os.eventfd_write(self._fd, 1)
            if self._opens.is_alive():
                self._opens.join()
            self.opened_now()  # the last ones queued
            os.close(self._fd)
            self._fd = -1
        self._ctx = None

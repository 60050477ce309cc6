"""The FUSE session: mount, run the request loop on its own thread, stop it on a signal
or an unmount, and take everything down in one order (pushes, loop, workers, session)."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable

from ..config import MountConfig
from ..filesystem import ShardFileSystem
from . import binding as libfuse
from .operations import FuseOperations
from .pushes import KernelPusher

log = logging.getLogger(__name__)

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_WAKE_SIGNAL = signal.SIGUSR2


class _LoopThread:
    """The session loop on a thread of its own, which can be woken from its wait."""

    def __init__(self, session: libfuse.Session, ended: threading.Event) -> None:
        self.session = session
        self.ended = ended  # set when the loop returns (unmounted from outside, or an error)
        self._lock = threading.Lock()
        self._running = False
        self.thread = threading.Thread(target=self._run, name="shardfs-fuse", daemon=True)

    def start(self) -> None:
        with self._lock:
            self._running = True
        self.thread.start()

    def _run(self) -> None:
        try:
            status = self.session.run()
        finally:
            with self._lock:
                self._running = False
            self.ended.set()
        if status:
            log.info("FUSE loop ended with status %d", status)

    def stop(self) -> None:
        """End the loop (no more requests are read) and wait for it."""
        self.session.exit()
        while self.thread.is_alive():
            with self._lock:  # never signal a thread that has finished
                if self._running and self.thread.ident is not None:
                    # Interrupt the wait for the next request (the read is not restarted).
                    signal.pthread_kill(self.thread.ident, _WAKE_SIGNAL)
            self.thread.join(0.2)


def serve(
    core: ShardFileSystem,
    config: MountConfig,
    on_ready: Callable[[], None],
    *,
    keep_handles: bool = False,
) -> None:
    """Mount and serve until unmounted or signalled (SIGINT/SIGTERM/SIGHUP unmount cleanly).

    Raises RuntimeError when the mount itself fails, and what ``on_ready`` raised when it
    fails (after unmounting). Call from the main thread: the session runs on its own thread
    while this one waits for signals.
    """
    options = ["ro", "fsname=shardfs", "subtype=shardfs", "default_permissions"]
    if config.allow_other:
        options.append("allow_other")
    if config.allow_root:  # libfuse lets the owner and root in and denies the others
        options.append("allow_root")
    stop = threading.Event()
    failed: list[Exception] = []

    def ready() -> None:
        try:
            on_ready()
        except Exception as exc:  # the mount cannot go on: stop, and raise it from here
            failed.append(exc)
            stop.set()
            raise

    pusher = KernelPusher(core) if config.kernel_push and core.uses_block_cache else None
    operations = FuseOperations(core, config, ready, keep_handles=keep_handles, pusher=pusher)

    def on_signal(_signum: int, _frame: object) -> None:
        stop.set()

    previous = {number: signal.signal(number, on_signal) for number in _STOP_SIGNALS}
    previous[_WAKE_SIGNAL] = signal.signal(_WAKE_SIGNAL, lambda _signum, _frame: None)
    try:
        session = libfuse.Session(operations.callbacks(), str(config.mountpoint), options)
        loop = _LoopThread(session, stop)
        try:
            if pusher is not None:
                pusher.start(session)
                core.watch_local_blocks(pusher.block_local)
            loop.start()
            stop.wait()  # a stop signal, or the loop's end; signal handlers run meanwhile
        finally:
            # In this order: pushes end while reads are still answered (a push can wait on
            # one), then the loop, then reads in worker threads; only then is the session
            # unmounted and freed, so no reply ever goes to a closed session.
            if pusher is not None:
                core.watch_local_blocks(None)
                pusher.stop()
            loop.stop()
            operations.close()
            session.close()
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
    if failed:
        raise failed[0]

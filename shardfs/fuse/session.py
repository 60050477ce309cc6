"""The FUSE session: mount, run the request loop on its own thread, stop it on a signal
or an unmount, and take it down in one order (pushes, loop, workers, session)."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from typing import Any

from ..config import MountConfig
from ..core.filesystem import ShardFileSystem
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


def _escaped(value: str) -> str:
    """An option value as libfuse's option parser reads it back: a comma or backslash
    (both may appear in a URL) escaped with a backslash, not taken as a separator."""
    return value.replace("\\", "\\\\").replace(",", "\\,")


def mount_options(config: MountConfig) -> list[str]:
    """libfuse's ``-o`` options for a mount: the type is ``fuse.shardfs`` (how shardfs
    finds its mounts), the source shown is ``config.fsname``."""
    options = ["ro", f"fsname={_escaped(config.fsname)}", "subtype=shardfs", "default_permissions"]
    if config.allow_other:
        options.append("allow_other")
    if config.allow_root:  # libfuse lets the owner and root in and denies the others
        options.append("allow_root")
    return options


class FuseSession:
    """One FUSE mount of a core: its operations adapter, kernel pusher and request loop.

    ``start`` mounts, starts the pusher, then the loop; ``wait`` returns on a stop signal
    (SIGINT, SIGTERM, SIGHUP) or when the loop ends (unmounted from outside), and raises
    what ``on_ready`` raised. ``stop`` takes the session down in this order: pushes end
    while reads are still answered (a push can wait on one), then the loop, then reads in
    worker threads; only then is the session unmounted and freed, so no reply ever goes to
    a closed session. ``stop`` is idempotent and undoes a partial ``start``.

    Call ``start`` and ``wait`` from the main thread: they install signal handlers, which
    run while ``wait`` waits."""

    def __init__(
        self,
        core: ShardFileSystem,
        config: MountConfig,
        on_ready: Callable[[], None],
        *,
        keep_handles: bool = False,
    ) -> None:
        self.core = core
        self.config = config
        self._on_ready = on_ready
        self._stop = threading.Event()
        self._failed: list[Exception] = []
        use_pusher = config.kernel_push and core.uses_block_cache
        self.pusher = KernelPusher(core) if use_pusher else None
        self.operations = FuseOperations(
            core, config, self._ready, keep_handles=keep_handles, pusher=self.pusher
        )
        self._previous: dict[int, Any] = {}
        self._session: libfuse.Session | None = None
        self._loop: _LoopThread | None = None
        self._pushing = False

    def _ready(self) -> None:
        try:
            self._on_ready()
        except Exception as exc:  # the mount cannot go on: stop, and raise it from wait()
            self._failed.append(exc)
            self._stop.set()
            raise

    def _on_signal(self, _signum: int, _frame: object) -> None:
        self._stop.set()

    def start(self) -> None:
        """Mount and serve on the loop's own thread. RuntimeError when the mount fails."""
        for number in _STOP_SIGNALS:
            self._previous[number] = signal.signal(number, self._on_signal)
        self._previous[_WAKE_SIGNAL] = signal.signal(_WAKE_SIGNAL, lambda _signum, _frame: None)
        hot = self.operations.hot
        self._session = libfuse.Session(
            self.operations.callbacks(),
            str(self.config.mountpoint),
            mount_options(self.config),
            install=hot.install if hot is not None else None,
        )
        if self.pusher is not None:
            self.pusher.start(self._session)
            self._pushing = True
            self.core.watch_local_blocks(self.pusher.block_local)
        self._loop = _LoopThread(self._session, self._stop)
        self._loop.start()

    def wait(self) -> None:
        """Until a stop signal or the loop's end; raises what ``on_ready`` raised."""
        self._stop.wait()
        if self._failed:
            raise self._failed[0]

    def stop(self) -> None:
        """Pushes, loop, workers, then unmount (see the class); each at most once."""
        if self._pushing and self.pusher is not None:
            self._pushing = False
            self.core.watch_local_blocks(None)
            self.pusher.stop()
        if self._loop is not None:
            loop, self._loop = self._loop, None
            loop.stop()
        self.operations.close()
        if self._session is not None:
            session, self._session = self._session, None
            session.close()
        previous, self._previous = self._previous, {}
        for number, handler in previous.items():
            signal.signal(number, handler)


def serve(
    core: ShardFileSystem,
    config: MountConfig,
    on_ready: Callable[[], None],
    *,
    keep_handles: bool = False,
) -> None:
    """Mount and serve until unmounted or signalled (SIGINT/SIGTERM/SIGHUP unmount cleanly).

    Raises RuntimeError when the mount itself fails, and what ``on_ready`` raised when it
    fails (after unmounting). Call from the main thread. A whole mount uses ``FuseSession``
    through ``shardfs.mount.lifecycle.Mount``, which stops it with the rest of the mount."""
    fuse = FuseSession(core, config, on_ready, keep_handles=keep_handles)
    try:
        fuse.start()
        fuse.wait()
    finally:
        fuse.stop()

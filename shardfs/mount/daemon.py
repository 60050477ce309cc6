"""Running a mount as a daemon: ``shardfs mount`` re-runs itself in the foreground as a
detached child and waits on a pipe (``ReadyChannel``) until the child reports that the
mount is ready or why it failed, so the command exits 0 only once the tree is usable; the
daemon's log files; unmounting, a dead mount included."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

from ..atomic import process_running
from ..errors import MountError
from ..tools.progress import update_progress_bar
from .control import pid_file, remove_created_mountpoint, socket_path
from .table import find_mount, is_disconnected, not_a_shardfs_mount

log = logging.getLogger(__name__)


class ReadyChannel:
    """The child's side of the pipe: progress, warnings, then ``ready`` or ``error``."""

    def __init__(self, fd: int | None) -> None:
        self._file = os.fdopen(fd, "w", buffering=1) if fd is not None else None

    @property
    def attached(self) -> bool:
        return self._file is not None

    def send(self, kind: str, text: str = "") -> None:
        if self._file is None:
            return
        try:
            self._file.write(f"{kind} {text}".rstrip().replace("\n", " ") + "\n")
            if kind in ("ready", "error"):
                self._file.close()
                self._file = None
        except OSError:
            self._file = None  # the parent went away; carry on


def warn_both(channel: ReadyChannel, text: str) -> None:
    log.warning("%s", text)
    channel.send("warn", text)


def note_both(channel: ReadyChannel, text: str) -> None:
    log.info("%s", text)
    channel.send("note", text)


def log_file_for(cache_dir: Path, chosen: Path | None) -> Path:
    """Where a backgrounded mount's daemon logs: ``chosen`` (``--log-file``), else a new
    file in ``CACHE_DIR/logs``, named by the daemon's pid once it runs (see spawn_daemon)."""
    if chosen is not None:
        return chosen.absolute()
    return cache_dir / "logs" / f"mount-starting-{os.getpid()}.log"


def _prune_logs(folder: Path, keep: int) -> None:
    """Keep the newest ``keep`` mount logs, and every log of a daemon still running."""
    logs = []
    for path in folder.glob("mount-*.log"):
        pid = path.stem.removeprefix("mount-")
        if pid.isdigit() and process_running(int(pid)):
            continue
        with contextlib.suppress(OSError):
            logs.append((path.stat().st_mtime, path))
    logs.sort(reverse=True)
    for _, path in logs[keep:]:
        with contextlib.suppress(OSError):
            path.unlink()


class _Stopped(Exception):
    """The waiting parent got SIGINT or SIGTERM."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


_PARENT_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_DAEMON_STOP_GRACE = 10.0  # seconds a stopped daemon gets to unmount before SIGKILL


class _StopSignals:
    """SIGINT and SIGTERM while the parent waits for its daemon. Until ``arm`` (the child
    is being started, so it cannot be named yet) they are held back; from then on, and for
    one held back, they raise ``_Stopped``. Leaving the block restores the old handlers."""

    def __init__(self) -> None:
        self._armed = False
        self._pending: list[int] = []
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _StopSignals:
        for number in _PARENT_STOP_SIGNALS:
            self._previous[number] = signal.signal(number, self._on_signal)
        return self

    def __exit__(self, *_exc: object) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)

    def _on_signal(self, signum: int, _frame: object) -> None:
        if not self._armed:
            self._pending.append(signum)
            return
        raise _Stopped(signum)

    def arm(self) -> None:
        self._armed = True
        if self._pending:
            raise _Stopped(self._pending[0])


class _ProgressLines:
    """Shows what the daemon reports on the ready channel until ``ready`` or ``error``.

    The daemon runs detached from the terminal, so the scan's bar is drawn here, by the
    process the user started, from the numbers the daemon sends."""

    def __init__(self, show_progress: bool) -> None:
        self.show_progress = show_progress
        self.bar: Any = None

    def follow(self, pipe: Iterable[str]) -> tuple[str, str] | None:
        """Show progress, warnings and notes; return the final (kind, text), or None when
        the daemon closed the channel without one."""
        for line in pipe:
            kind, _, text = line.rstrip("\n").partition(" ")
            if kind == "progress" and self.show_progress:
                done, total, done_bytes, total_bytes = (int(x) for x in text.split())
                self.bar = update_progress_bar(self.bar, done, total, done_bytes, total_bytes)
            elif kind == "warn":
                _print_line(self.bar, f"shardfs: warning: {text}")
            elif kind == "note":
                _print_line(self.bar, f"shardfs: {text}")
            elif kind in ("ready", "error"):
                return kind, text
        return None

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def spawn_daemon(
    argv: Sequence[str],
    mountpoint: Path,
    log_path: Path,
    show_progress: bool,
    *,
    verbose: bool = False,
) -> tuple[int, str]:
    """Start ``shardfs mount --foreground`` detached and wait until it is ready or fails.

    Returns (exit code, summary line). SIGINT or SIGTERM while waiting stops the daemon
    and removes whatever it mounted, so nothing is left behind. With ``verbose``, a daemon
    that fails shows its traceback here (from its log)."""
    from ..config import LOGS_KEPT

    log_path.parent.mkdir(parents=True, exist_ok=True)
    named_by_pid = log_path.name.startswith("mount-starting-")
    if named_by_pid:
        _prune_logs(log_path.parent, LOGS_KEPT - 1)
    lines = _ProgressLines(show_progress)
    child: subprocess.Popen[bytes] | None = None
    read_fd, write_fd = os.pipe()
    try:
        with _StopSignals() as signals:
            try:
                child, log_start = _start_child(argv, log_path, write_fd)
                signals.arm()
                if named_by_pid:
                    log_path = _name_log_by_pid(log_path, child.pid)
                os.close(write_fd)
                write_fd = -1
                with os.fdopen(read_fd, "r") as pipe:
                    read_fd = -1
                    outcome = lines.follow(pipe)
                code, summary = _daemon_outcome(
                    outcome, child, log_path, log_start, verbose=verbose
                )
                if code != 0:
                    _reap_failed(child, mountpoint)
                return code, summary
            except _Stopped as stopped:
                lines.close()
                if child is not None:
                    _stop_daemon(child, mountpoint)
                name = signal.Signals(stopped.signum).name
                return 128 + stopped.signum, (
                    f"interrupted ({name}) before the mount was ready; stopped the mount "
                    "daemon, nothing is mounted"
                )
    finally:
        for fd in (read_fd, write_fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        lines.close()


def _start_child(
    argv: Sequence[str], log_path: Path, write_fd: int
) -> tuple[subprocess.Popen[bytes], int]:
    """The daemon, in a session of its own, logging to ``log_path``; returns it and where
    its part of the log starts."""
    with open(log_path, "ab") as log_file:
        log_start = log_file.tell()
        child = subprocess.Popen(
            [sys.executable, "-m", "shardfs", *argv, "--foreground", "--ready-fd",
             str(write_fd)],
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=log_file,
            pass_fds=(write_fd,),
            start_new_session=True,
        )  # fmt: skip
    return child, log_start


def _name_log_by_pid(log_path: Path, pid: int) -> Path:
    named = log_path.with_name(f"mount-{pid}.log")
    os.replace(log_path, named)  # the daemon keeps writing to the same file
    return named


def _daemon_outcome(
    outcome: tuple[str, str] | None,
    child: subprocess.Popen[bytes],
    log_path: Path,
    log_start: int,
    *,
    verbose: bool,
) -> tuple[int, str]:
    """(exit code, summary line) from what the daemon said last on the ready channel."""
    if outcome is not None and outcome[0] == "ready":
        return 0, outcome[1]
    if outcome is not None:  # error
        code, _, message = outcome[1].partition(" ")
        if verbose:
            _show_daemon_traceback(child, log_path, log_start)
        return int(code), message
    status = child.wait()
    if verbose:
        _show_daemon_traceback(child, log_path, log_start)
    return 1, f"the mount daemon exited with status {status} before it was ready; see {log_path}"


def _reap_failed(child: subprocess.Popen[bytes], mountpoint: Path) -> None:
    """Wait for a daemon that reported an error to exit, as it does on its own, so that its
    hold on the mountpoint is gone once ``shardfs mount`` returns: a retry at once (say with
    --skip-bad-shards) would otherwise find "another shardfs mount is starting or running
    here". One that has not exited within the grace period is stopped."""
    try:
        child.wait(_DAEMON_STOP_GRACE)
    except subprocess.TimeoutExpired:
        _stop_daemon(child, mountpoint)


def _stop_daemon(child: subprocess.Popen[bytes], mountpoint: Path) -> None:
    """End a daemon that is not ready yet, and any mount it made meanwhile.

    SIGTERM first: before it mounts, that ends it at once; once mounting, its handler
    unmounts and exits. SIGKILL if it does not end in time, then the mount is removed."""
    with contextlib.suppress(ProcessLookupError):
        child.send_signal(signal.SIGTERM)
    try:
        child.wait(_DAEMON_STOP_GRACE)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
    if find_mount(mountpoint) is not None:
        with contextlib.suppress(MountError):
            run_unmount_command(str(mountpoint), mountpoint, lazy=True)
        forget_dead_daemon(mountpoint)
    remove_created_mountpoint(mountpoint)  # where the daemon ended before it could


def _show_daemon_traceback(child: subprocess.Popen[bytes], log_path: Path, start: int) -> None:
    """Print the failed daemon's traceback from its log (what it wrote from byte ``start``
    on), and where the log is."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.wait(10)  # the daemon prints its traceback after it reported the error
    try:
        with open(log_path, "rb") as log_file:
            log_file.seek(start)
            text = log_file.read().decode("utf-8", "replace")
    except OSError:
        text = ""
    start = text.find("Traceback (most recent call last)")
    if start >= 0:
        end = text.find("\nshardfs: error:", start)
        sys.stderr.write(text[start : end + 1 if end >= 0 else len(text)])
    print(f"shardfs: the daemon's log is {log_path}", file=sys.stderr)


def _print_line(bar: Any, text: str) -> None:
    """A line on stderr, above the progress bar if one is shown."""
    if bar is not None:
        bar.write(text, file=sys.stderr)
    else:
        print(text, file=sys.stderr)


Unmounted = Literal["live", "dead", "detached"]


def unmount(mountpoint: Path, *, lazy: bool = False, timeout: float = 30.0) -> Unmounted:
    """Unmount a shardfs mount, live or left dead by a killed daemon.

    A live mount is unmounted and its daemon waited for ("live"). A dead one is only
    removed from the mount table ("dead"), and its mountpoint too if a mount created it.
    ``lazy`` detaches the mount even while a process still uses it; its daemon then exits
    once the last user lets go ("detached"). A live daemon removes a mountpoint it created
    as it exits."""
    entry = find_mount(mountpoint)
    if entry is None or not entry.is_shardfs:
        raise MountError(not_a_shardfs_mount(mountpoint, entry))
    dead = is_disconnected(entry.mountpoint)
    pid = None if dead else _daemon_pid(mountpoint)
    run_unmount_command(entry.mountpoint, mountpoint, lazy=lazy)
    if dead:
        forget_dead_daemon(mountpoint)
        remove_created_mountpoint(mountpoint)  # the killed daemon could not
        return "dead"
    if lazy:
        return "detached"
    deadline = time.monotonic() + timeout
    while pid is not None and time.monotonic() < deadline:
        if not process_running(pid):
            break
        time.sleep(0.05)
    else:
        if pid is not None:
            raise MountError(f"{mountpoint}: unmounted, but daemon pid {pid} is still running")
    return "live"


def _daemon_pid(mountpoint: Path) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return int(pid_file(mountpoint).read_text())
    return None


def forget_dead_daemon(mountpoint: Path) -> None:
    """Drop the pid file and socket a killed daemon left, so nothing later waits on that
    pid or asks that socket."""
    pid = _daemon_pid(mountpoint)
    if pid is not None and not process_running(pid):
        for path in (pid_file(mountpoint), socket_path(mountpoint)):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def run_unmount_command(table_path: str, mountpoint: Path, *, lazy: bool) -> None:
    """fusermount3 -u (what an unprivileged user may run), or umount without it."""
    tool = shutil.which("fusermount3") or shutil.which("fusermount")
    if tool:
        command = [tool, "-u", *(["-z"] if lazy else []), table_path]
    else:
        command = ["umount", *(["-l"] if lazy else []), table_path]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode == 0:
        return
    message = (result.stderr or result.stdout).strip().splitlines()
    detail = message[-1] if message else f"exit status {result.returncode}"
    if "busy" in detail.lower():
        raise MountError(
            f"{mountpoint}: busy (a process has a file open or its working folder inside); "
            f"stop it and retry, or detach now with: shardfs umount --lazy {mountpoint}"
        )
    raise MountError(f"{mountpoint}: unmount failed ({detail})")

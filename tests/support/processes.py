"""Running the CLI and reading the mount table from tests: shardfs as a subprocess, a
daemon started and stopped, whether a path is mounted, whether FUSE is usable here."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

FUSERMOUNT = "fusermount3"

# Processes started by spawn_shardfs(), so teardown can end what a test left running.
spawned_processes: list[subprocess.Popen[str]] = []


def fuse_problem() -> str | None:
    """Why FUSE mounts cannot work here, or None if they can."""
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse does not exist (run the container with --device /dev/fuse)"
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return "/dev/fuse is not readable and writable by this user"
    if shutil.which(FUSERMOUNT) is None:
        return f"{FUSERMOUNT} is not on PATH (install the fuse3 package)"
    return None


def require_fuse() -> None:
    """Fail, never skip: integration tests that cannot run must be seen."""
    problem = fuse_problem()
    if problem is not None:
        pytest.fail(f"FUSE integration tests cannot run: {problem}", pytrace=False)


def _merged_env(env: dict[str, str] | None) -> dict[str, str]:
    return {**os.environ, **(env or {})}


def run_shardfs(
    *args: str | os.PathLike[str], env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m shardfs ARGS`` to completion; ``env`` is laid over os.environ."""
    return subprocess.run(
        [sys.executable, "-m", "shardfs", *map(str, args)],
        env=_merged_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def spawn_shardfs(
    *args: str | os.PathLike[str], env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    """Start ``python -m shardfs ARGS`` (e.g. a foreground mount) without waiting.

    The process is recorded; the ``mountpoint`` fixture ends any recorded
    process whose arguments name its directory.
    """
    with _sigint_as_from_a_terminal():
        proc = subprocess.Popen(
            [sys.executable, "-m", "shardfs", *map(str, args)],
            env=_merged_env(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    spawned_processes.append(proc)
    return proc


@contextlib.contextmanager
def _sigint_as_from_a_terminal() -> Iterator[None]:
    """Spawn with SIGINT at its default, as from a terminal. A suite started as a background
    job of a script (`make test &`) has SIGINT ignored, which a child inherits through exec,
    and a command then rightly ignores a test's SIGINT (seen: `shardfs index` exited 0 once
    its delayed GET ended). A caught handler is reset to the default at exec."""
    ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    if not ignored or threading.current_thread() is not threading.main_thread():
        yield
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _unescape_mountinfo(field: str) -> str:
    # /proc/self/mountinfo writes space, tab, newline and backslash as \ooo.
    for code in ("\\040", "\\011", "\\012", "\\134"):
        field = field.replace(code, chr(int(code[1:], 8)))
    return field


def is_mounted(path: Path) -> bool:
    """True if ``path`` is a mount point, even one whose FUSE daemon has died.

    os.path.ismount() alone says False for a dead FUSE mount (stat fails with
    ENOTCONN), which is exactly the mount teardown must still remove.
    """
    target = os.path.realpath(path)
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 4 and _unescape_mountinfo(fields[4]) == target:
                    return True
    except OSError:
        pass
    return os.path.ismount(path)


def daemons_naming(path: Path) -> list[int]:
    """Pids of live mount daemons (``shardfs mount ... --foreground``) whose arguments name
    ``path``."""
    wanted = os.fsencode(str(path))
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue  # gone meanwhile
        if b"--foreground" in args and wanted in args and b"shardfs" in args:
            found.append(int(entry.name))
    return found


def unmount(path: Path) -> None:
    """Lazily unmount ``path``; errors are ignored (teardown must not raise)."""
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        subprocess.run(
            [FUSERMOUNT, "-u", "-z", str(path)], capture_output=True, timeout=30, check=False
        )


def stop_process(proc: subprocess.Popen[str], timeout: float = 10.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)
    # communicate() closes the pipes and reaps the process.
    with contextlib.suppress(ValueError, subprocess.TimeoutExpired):
        proc.communicate(timeout=timeout)

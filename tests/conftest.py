"""Shared fixtures: a moto S3 server, FUSE mountpoints, and a way to run the CLI."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.s3 import S3Server

FUSERMOUNT = "fusermount3"

# Processes started by spawn_shardfs(), so teardown can end what a test left running.
_spawned: list[subprocess.Popen[str]] = []


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
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardfs", *map(str, args)],
        env=_merged_env(env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _spawned.append(proc)
    return proc


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


# Markers. ``make test-unit`` deselects both, so it needs neither FUSE nor moto.
#   integration: does real FUSE mounts (fails, never skips, where FUSE cannot work);
#   s3: talks to the moto S3 server (a subprocess on a local port), no FUSE needed.
# A test is marked from the fixtures it uses, so a new test cannot be filed wrong; a test
# that starts its own server or mount carries the marker by hand.
_FIXTURE_MARKERS = {"mountpoint": "integration", "s3_server": "s3"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        for fixture, marker in _FIXTURE_MARKERS.items():
            if fixture in used and item.get_closest_marker(marker) is None:
                item.add_marker(marker)


@pytest.fixture(autouse=True)
def _integration_requires_fuse(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("integration") is not None:
        require_fuse()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """One moto S3 server for the session; call ``reset_counts()`` before measuring."""
    with S3Server() as server:
        yield server


@pytest.fixture
def mountpoint(tmp_path: Path) -> Iterator[Path]:
    """An empty directory to mount on; unmounted and its processes ended at teardown."""
    require_fuse()
    path = tmp_path / "mnt"
    path.mkdir()
    try:
        yield path
    finally:
        if is_mounted(path):
            unmount(path)
        for proc in list(_spawned):
            if isinstance(proc.args, list) and str(path) in proc.args:
                stop_process(proc)
                _spawned.remove(proc)


@pytest.fixture(scope="session", autouse=True)
def _stop_leftover_processes() -> Iterator[None]:
    yield
    while _spawned:
        stop_process(_spawned.pop())


@pytest.fixture
def tmpfs() -> Iterator[list[Path]]:
    """Folders a test mounts a tmpfs on (``support.mounts.mount_tmpfs``); unmounted at
    teardown, lazily, however many times each was mounted."""
    paths: list[Path] = []
    yield paths
    for path in reversed(paths):
        while os.path.ismount(path):
            subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)

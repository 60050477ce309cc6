"""A mount's life before it is ready: SIGINT or SIGTERM of ``shardfs mount`` while the
daemon scans stops the daemon and leaves no mount; a second mount of the same mountpoint
meanwhile fails at once (exit 5) and never stacks. The scan is made slow with the moto
server's GET delay, so the signal lands while the daemon is busy."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.mounts import (
    assert_one_error_line,
    mount,
    new_bucket,
    process_gone,
    umount,
    wait_for,
)
from support.processes import is_mounted, run_shardfs, spawn_shardfs
from support.s3 import S3Server
from support.tarbuild import make_tar

from shardfs.mount.control import lock_path

pytestmark = pytest.mark.integration

FILES = {f"d/{i:03d}.bin": bytes([i]) * (1000 + i) for i in range(20)}
SCAN_DELAY = 4.0  # seconds every GET of the bucket waits: the scan outlasts the test's steps


@pytest.fixture
def env(s3_server: S3Server) -> dict[str, str]:
    return s3_server.env()


@pytest.fixture
def slow_source(s3_server: S3Server) -> Iterator[tuple[str, str]]:
    """(source URL, bucket) whose shards take SCAN_DELAY seconds per GET."""
    bucket = new_bucket(s3_server, "slowscan")
    items = list(FILES.items())
    fs = s3_server.filesystem()
    for number, start in enumerate(range(0, len(items), 10)):
        fs.pipe_file(f"{bucket}/p/s{number}.tar", make_tar(items[start : start + 10]))
    s3_server.delay_gets(bucket, SCAN_DELAY)
    try:
        yield f"s3://{bucket}/p/", bucket
    finally:
        s3_server.delay_gets()


def mountpoint_entries(path: Path) -> int:
    """How many mounts sit on ``path`` (stacked mounts count each)."""
    target = os.path.realpath(path)
    with open("/proc/self/mountinfo", encoding="utf-8") as mountinfo:
        return sum(1 for line in mountinfo if line.split()[4] == target)


def daemon_holding_lock(mountpoint: Path, parent: subprocess.Popen[str]) -> int:
    """Wait until the mount's daemon holds the mountpoint lock; return its pid."""
    path = lock_path(mountpoint)
    found: list[int] = []

    def held() -> bool:
        assert parent.poll() is None, parent.communicate()
        try:
            text = path.read_text().strip()
        except FileNotFoundError:
            return False
        if text.isdigit() and int(text) != parent.pid and not process_gone(int(text)):
            found.append(int(text))
            return True
        return False

    wait_for(held, "the mount daemon to take the mountpoint lock")
    return found[-1]


@pytest.mark.parametrize(
    ("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"]
)
def test_signal_before_ready_stops_the_daemon_and_leaves_no_mount(
    signum: int,
    code: int,
    slow_source: tuple[str, str],
    s3_server: S3Server,
    env: dict[str, str],
    mountpoint: Path,
    tmp_path: Path,
) -> None:
    source, _bucket = slow_source
    cache = tmp_path / "cache"
    parent = spawn_shardfs("mount", source, mountpoint, "--cache-dir", cache, env=env)
    daemon = daemon_holding_lock(mountpoint, parent)

    parent.send_signal(signum)
    _, stderr = parent.communicate(timeout=60)
    assert parent.returncode == code, stderr
    lines = stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    name = signal.Signals(signum).name
    assert lines[0] == (
        f"shardfs: error: interrupted ({name}) before the mount was ready; "
        "stopped the mount daemon, nothing is mounted"
    )
    assert process_gone(daemon), f"daemon {daemon} still runs"
    assert not is_mounted(mountpoint)

    # Nothing is left that blocks the next mount: no lock, no half-made state.
    s3_server.delay_gets()
    mount(source, mountpoint, cache, env=env)
    data = (mountpoint / "d/007.bin").read_bytes()
    assert hashlib.sha256(data).digest() == hashlib.sha256(FILES["d/007.bin"]).digest()
    assert mountpoint_entries(mountpoint) == 1
    umount(mountpoint, env)


def test_second_mount_while_the_first_starts_fails_and_never_stacks(
    slow_source: tuple[str, str],
    s3_server: S3Server,
    env: dict[str, str],
    mountpoint: Path,
    tmp_path: Path,
) -> None:
    source, _bucket = slow_source
    first = spawn_shardfs("mount", source, mountpoint, "--cache-dir", tmp_path / "c1", env=env)
    daemon = daemon_holding_lock(mountpoint, first)

    second = run_shardfs("mount", source, mountpoint, "--cache-dir", tmp_path / "c2", env=env)
    line = assert_one_error_line(second)
    assert second.returncode == 5
    assert line == (
        f"shardfs: error: {mountpoint}: another shardfs mount is starting or running here "
        f"(pid {daemon})"
    )

    s3_server.delay_gets()  # let the first finish its scan
    stdout, stderr = first.communicate(timeout=120)
    assert first.returncode == 0, stderr
    assert stdout.startswith(f"mounted {source} at {mountpoint} (20 files")
    assert mountpoint_entries(mountpoint) == 1
    assert (mountpoint / "d/019.bin").read_bytes() == FILES["d/019.bin"]

    # While it serves, another mount is refused too, and still nothing stacks.
    third = run_shardfs("mount", source, mountpoint, "--cache-dir", tmp_path / "c3", env=env)
    assert "already mounted" in assert_one_error_line(third)
    assert third.returncode == 5
    assert mountpoint_entries(mountpoint) == 1
    umount(mountpoint, env)
    assert process_gone(daemon)

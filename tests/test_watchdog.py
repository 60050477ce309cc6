"""The daemon's watchdog (shardfs/mount/watchdog.py) without a stuck kernel: how it finds
the mount's device, tells a dead daemon, and aborts a connection. The case it exists for,
a daemon killed while a push waits on a page, is the SIGKILL test of test_mount_cache.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardfs.mount import watchdog


def test_the_device_of_a_mountpoint_comes_from_mountinfo() -> None:
    assert watchdog.device_of("/") == os.stat("/").st_dev
    assert watchdog.device_of("/no/such/mount point") is None


def test_a_daemon_counts_as_dead_once_its_main_thread_exited() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)  # fmt: skip
    try:
        assert not watchdog.daemon_dead(child.pid)
        assert child.stdin is not None
        child.stdin.close()
        for _ in range(200):  # exited, not reaped yet: a zombie
            if watchdog.daemon_dead(child.pid):
                break
            os.sched_yield()
            subprocess.run(["sleep", "0.01"], check=True)
        assert watchdog.daemon_dead(child.pid)
    finally:
        child.wait()
    assert watchdog.daemon_dead(child.pid)  # reaped: gone


def test_the_connection_of_the_device_is_aborted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(watchdog, "CONNECTIONS", tmp_path)
    (tmp_path / "41").mkdir()
    (tmp_path / "41" / "abort").write_text("")
    assert watchdog.abort_connection(os.makedev(0, 41))
    assert (tmp_path / "41" / "abort").read_text() == "1"
    assert not watchdog.abort_connection(os.makedev(0, 42))  # no such connection


def test_a_watchdog_of_a_path_that_is_no_mount_exits_at_once() -> None:
    assert watchdog.watch(os.getpid(), "/no/such/mount point") == 0

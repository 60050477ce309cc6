"""The index scan's progress bar: drawn on any terminal (one that reports no size
included) for a scan longer than a second, by the process attached to the terminal (for
a mount, the waiting ``shardfs mount``, from the numbers its detached daemon sends), and
never when stderr is not a terminal. The scan is made slow with the moto server's GET
delay."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.mounts import new_bucket, umount
from support.processes import is_mounted, run_shardfs
from support.s3 import S3Server
from support.tarbuild import make_tar

from shardfs.tools.progress import FALLBACK_SIZE, SHOW_AFTER, TICK, new_bar, update_progress_bar

SHARDS = 3
SCAN_DELAY = 1.5 * SHOW_AFTER  # seconds each GET waits: the scan outlasts SHOW_AFTER


def test_index_progress_reaches_the_bar_as_numbers() -> None:
    """The scan's progress travels as numbers to the bar (parsed once where it arrives as
    text from the daemon's pipe)."""
    bar = update_progress_bar(None, 1, 4, 1000, 8000)
    bar = update_progress_bar(bar, 3, 4, 5000, 8000)
    assert (bar.n, bar.total) == (5000, 8000)
    assert bar.postfix == "3/4 shards"
    assert not bar.disable
    bar = update_progress_bar(bar, 4, 4, 8000, 8000)
    assert bar.disable  # closed with the scan
    again = update_progress_bar(bar, 0, 2, 0, 100)  # a later scan gets a bar of its own
    assert again is not bar and again.total == 100
    again.close()


def test_a_bar_shows_only_after_a_second_and_then_its_clock_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No bar for work shorter than SHOW_AFTER; a longer one is drawn (80 columns where the
    stream reports no size) and redrawn without news, so a long shard does not look hung."""
    shown = io.StringIO()
    monkeypatch.setattr(sys, "stderr", shown)
    quick = new_bar("quick", 100)
    quick.update(100)
    quick.close()
    assert shown.getvalue() == ""

    slow = new_bar("slow", 100)
    slow.update(10)  # the only news
    time.sleep(SHOW_AFTER + 3 * TICK)
    slow.close()
    frames = [f for f in shown.getvalue().split("\r") if f.startswith("slow:")]
    assert len(frames) >= 3, frames  # redrawn by the clock alone
    assert all(len(f.rstrip("\n")) <= FALLBACK_SIZE[0] for f in frames)
    elapsed = [re.search(r"\[(\d\d):(\d\d)<", f) for f in frames]
    seconds = [int(m[1]) * 60 + int(m[2]) for m in elapsed if m]
    assert seconds == sorted(seconds) and seconds[-1] >= SHOW_AFTER + 2 * TICK  # the clock ran
    assert " 10.0/100 " in frames[-1]  # while the count stood still


@pytest.fixture
def slow_source(s3_server: S3Server) -> Iterator[str]:
    bucket = new_bucket(s3_server, "progress")
    fs = s3_server.filesystem()
    for number in range(SHARDS):
        files = [(f"d{number}/{i}.bin", bytes([i]) * 5000) for i in range(10)]
        fs.pipe_file(f"{bucket}/p/s{number}.tar", make_tar(files))
    s3_server.delay_gets(bucket, SCAN_DELAY)
    try:
        yield f"s3://{bucket}/p/"
    finally:
        s3_server.delay_gets()


def run_on_a_terminal(
    args: list[str], env: dict[str, str], columns: int, timeout: float = 120
) -> tuple[int, str]:
    """``python -m shardfs ARGS`` with stdout and stderr on a new pseudo-terminal of
    ``columns`` columns (0: a terminal that reports no size); (exit code, what it showed)."""
    master, slave = pty.openpty()
    if columns:
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardfs", *args],
        stdin=subprocess.DEVNULL,
        stdout=slave,
        stderr=slave,
        env={**os.environ, **env},
    )
    os.close(slave)
    shown = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                continue
            try:
                chunk = os.read(master, 1 << 16)
            except OSError:  # EIO: every writer closed the terminal
                break
            if not chunk:
                break
            shown += chunk
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return code, shown.decode("utf-8", "replace")


def assert_a_finished_bar(shown: str) -> None:
    assert "indexing shards:" in shown, shown
    final = [part for part in shown.split("\r") if "indexing shards: 100%" in part]
    assert final and f"{SHARDS}/{SHARDS} shards" in final[-1], shown


@pytest.mark.integration
@pytest.mark.parametrize("columns", [0, 100], ids=["unsized-terminal", "100-columns"])
def test_a_mount_on_a_terminal_draws_the_scan_bar(
    columns: int, slow_source: str, s3_server: S3Server, mountpoint: Path, tmp_path: Path
) -> None:
    args = ["mount", slow_source, str(mountpoint), "--cache-dir", str(tmp_path / "cache")]
    code, shown = run_on_a_terminal(args, s3_server.env(), columns)
    assert code == 0, shown
    assert is_mounted(mountpoint)
    umount(mountpoint, s3_server.env())
    assert_a_finished_bar(shown)
    assert shown.rstrip().endswith(f"({SHARDS * 10} files, raw layout)")


@pytest.mark.parametrize("command", ["index", "warm"])
def test_index_and_warm_on_a_terminal_draw_the_scan_bar(
    command: str, slow_source: str, s3_server: S3Server, tmp_path: Path
) -> None:
    args = [command, slow_source, "--cache-dir", str(tmp_path / "cache")]
    code, shown = run_on_a_terminal(args, s3_server.env(), columns=0)
    assert code == 0, shown
    assert_a_finished_bar(shown)


@pytest.mark.integration
def test_without_a_terminal_no_bar_is_drawn(
    slow_source: str, s3_server: S3Server, mountpoint: Path, tmp_path: Path
) -> None:
    env = s3_server.env()
    mounted = run_shardfs("mount", slow_source, mountpoint, "--cache-dir", tmp_path / "m", env=env)
    assert mounted.returncode == 0, mounted.stderr
    umount(mountpoint, env)
    indexed = run_shardfs("index", slow_source, "--cache-dir", tmp_path / "i", env=env)
    assert indexed.returncode == 0, indexed.stderr
    for result in (mounted, indexed):
        assert "indexing shards" not in result.stderr
        assert "\r" not in result.stderr + result.stdout

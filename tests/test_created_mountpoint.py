"""A missing mountpoint whose parent folder exists is created by the mount, said in one
line, and removed again when that mount ends: by ``shardfs umount``, by the daemon's own
exit on SIGTERM or Ctrl-C, and when the mount fails. A folder that was there before is
never removed. (A daemon killed with SIGKILL: ``tests/test_dead_mounts.py``; a missing
parent folder: ``tests/test_mount_errors.py``.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from support.datagen import make_imagefolder, pack_with_gnu_tar, sha256_tree
from support.mounts import assert_one_error_line, mount, process_gone, umount, wait_for
from support.processes import is_mounted, run_shardfs, spawn_shardfs, stop_process

from shardfs.mount.control import created_marker, lock_held, pid_file, remove_created_mountpoint
from shardfs.mount.mountpoints import make_mountpoint

pytestmark = pytest.mark.integration

CLASS_SIZES = {"ant": 3, "bee": 2}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, str]]:
    """Two GNU tar shards in a local folder: (source, {path: sha256})."""
    base = tmp_path_factory.mktemp("created")
    make_imagefolder(base / "src", CLASS_SIZES)
    pack_with_gnu_tar(base / "src", base / "shards", files_per_shard=3)
    return str(base / "shards"), sha256_tree(base / "src")


@pytest.fixture
def missing(mountpoint: Path) -> Path:
    """A mountpoint that does not exist (its parent does); the ``mountpoint`` fixture still
    unmounts it and ends its processes at teardown."""
    mountpoint.rmdir()
    return mountpoint


def created_line(path: Path) -> str:
    return f"shardfs: created mountpoint {path} (removed at unmount)"


def test_a_missing_mountpoint_is_created_said_once_and_removed_by_umount(
    dataset: tuple[str, dict[str, str]], missing: Path, tmp_path: Path
) -> None:
    source, expected = dataset
    result = mount(source, missing, tmp_path / "cache", env={})
    assert created_line(missing) in result.stderr.splitlines(), result.stderr
    assert result.stderr.count("created mountpoint") == 1
    assert sha256_tree(missing) == expected
    umount(missing)
    assert not missing.exists()
    assert not created_marker(missing).exists()
    assert missing.parent.is_dir()


def test_an_existing_mountpoint_is_left_in_place(
    dataset: tuple[str, dict[str, str]], mountpoint: Path, tmp_path: Path
) -> None:
    source, expected = dataset
    result = mount(source, mountpoint, tmp_path / "cache", env={})
    assert "created mountpoint" not in result.stderr
    assert sha256_tree(mountpoint) == expected
    umount(mountpoint)
    assert mountpoint.is_dir() and list(mountpoint.iterdir()) == []


@pytest.mark.parametrize(
    ("signum", "foreground"),
    [(signal.SIGTERM, False), (signal.SIGINT, True)],
    ids=["SIGTERM-to-the-daemon", "Ctrl-C-of-a-foreground-mount"],
)
def test_a_daemon_ended_by_a_signal_removes_the_mountpoint_it_created(
    signum: int,
    foreground: bool,
    dataset: tuple[str, dict[str, str]],
    missing: Path,
    tmp_path: Path,
) -> None:
    source, expected = dataset
    cache = tmp_path / "cache"
    if foreground:
        proc = spawn_shardfs("mount", source, missing, "--cache-dir", cache, "-f")
        wait_for(lambda: pid_file(missing).exists(), "the foreground mount to be ready")
        daemon = proc.pid
    else:
        mount(source, missing, cache, env={})
        daemon = int(pid_file(missing).read_text())
    try:
        assert sha256_tree(missing) == expected
        os.kill(daemon, signum)
        wait_for(lambda: process_gone(daemon), f"daemon {daemon} to exit")
    finally:
        if foreground:
            stop_process(proc)
    assert not is_mounted(missing)
    assert not missing.exists()
    assert not created_marker(missing).exists()


def test_a_failed_mount_removes_the_mountpoint_it_created(missing: Path, tmp_path: Path) -> None:
    shards = tmp_path / "bad"
    shards.mkdir()
    (shards / "broken.tar").write_bytes(b"not a tar header" * 64)
    result = run_shardfs("mount", shards, missing, "--cache-dir", tmp_path / "cache")
    line = assert_one_error_line(result)
    assert "broken.tar" in line
    assert not is_mounted(missing)
    assert not missing.exists()
    assert not created_marker(missing).exists()


def test_a_created_mountpoint_is_left_to_the_mount_that_holds_it(tmp_path: Path) -> None:
    """Only the daemon of a mount that starts or runs there removes it; a command that
    stops another daemon (or clears a dead mount) meanwhile leaves it in place."""
    target = tmp_path / "mnt"
    assert make_mountpoint(target) and created_marker(target).exists()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from pathlib import Path; "
            "from shardfs.mount.control import lock_mountpoint; "
            "lock_mountpoint(Path(sys.argv[1])); print('locked', flush=True); sys.stdin.read()",
            str(target),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
        assert lock_held(target)
        assert not remove_created_mountpoint(target)
        assert target.is_dir()
        assert remove_created_mountpoint(target, by_its_daemon=True)
        assert not target.exists() and not created_marker(target).exists()
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(30)
    assert not lock_held(target)

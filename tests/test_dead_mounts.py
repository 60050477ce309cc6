"""A daemon killed with SIGKILL (as the OOM killer does) leaves a dead mount; shardfs's own
commands must clear it: ``shardfs umount`` removes it, ``shardfs mount`` mounts over it."""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.datagen import make_imagefolder, pack_with_gnu_tar, sha256_tree
from support.mounts import assert_one_error_line, mount, process_gone, umount, wait_for
from support.processes import (
    daemons_naming,
    is_mounted,
    require_fuse,
    run_shardfs,
    spawn_shardfs,
    stop_process,
    unmount,
)

import shardfs
from shardfs.mount.control import created_marker, pid_file, socket_path
from shardfs.mount.table import find_mount

pytestmark = pytest.mark.integration

CLASS_SIZES = {"ant": 3, "bee": 2}
REPO = Path(shardfs.__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, str]]:
    """Two GNU tar shards in a local folder: (source, {path: sha256})."""
    base = tmp_path_factory.mktemp("dead")
    make_imagefolder(base / "src", CLASS_SIZES)
    pack_with_gnu_tar(base / "src", base / "shards", files_per_shard=3)
    return str(base / "shards"), sha256_tree(base / "src")


def daemon_pid(mountpoint: Path) -> int:
    """The pid of the daemon serving ``mountpoint`` (mounted by its absolute path), found
    from its command line: pid_file() resolves the mountpoint, and that stat would leave the
    root's attributes in the kernel, so a dead mount would no longer look dead to stat."""
    found = daemons_naming(mountpoint)
    assert len(found) == 1, f"daemons of {mountpoint}: {found}"
    return found[0]


def kill_daemon(mountpoint: Path) -> int:
    """SIGKILL the daemon and check that a dead mount is what is left."""
    pid = daemon_pid(mountpoint)
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: process_gone(pid), f"daemon {pid} to die")
    assert is_mounted(mountpoint), "the kernel dropped the mount by itself"
    with pytest.raises(OSError) as failure:
        os.statvfs(mountpoint)
    assert failure.value.errno in (errno.ENOTCONN, errno.ECONNABORTED)
    return pid


def mount_without_stat(source: str, target: Path, cache: Path) -> None:
    """``shardfs mount``, checked in the mount table only: conftest's is_mounted resolves
    the mountpoint, and that stat would leave the root's attributes in the kernel."""
    result = run_shardfs("mount", source, target, "--cache-dir", cache)
    assert result.returncode == 0, result.stderr
    assert find_mount(target) is not None


def removed_line(mountpoint: Path) -> str:
    return f"shardfs: removed a dead shardfs mount at {mountpoint}"


def hold_cwd(folder: Path) -> subprocess.Popen[bytes]:
    """A process whose working folder is ``folder`` until its stdin closes."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], cwd=folder, stdin=subprocess.PIPE
    )
    assert os.readlink(f"/proc/{holder.pid}/cwd") == str(folder)
    return holder


def release(holder: subprocess.Popen[bytes]) -> None:
    assert holder.stdin is not None
    holder.stdin.close()
    assert holder.wait(30) == 0


def check_umount_and_remount_over_dead(
    source: str,
    expected: dict[str, str],
    target: Path,
    cache: Path,
    *,
    read_root: bool,
    spelled: str | None = None,
    cwd: Path | None = None,
) -> None:
    """Kill, ``shardfs umount``; kill again, ``shardfs mount`` over the dead mount.

    ``spelled``/``cwd``: name the mountpoint to both commands as this (relative) path."""
    name = spelled or str(target)

    def shardfs_cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "shardfs", *map(str, args)],
            cwd=cwd,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    mount_without_stat(source, target, cache)
    if read_root:
        assert sha256_tree(target) == expected
    kill_daemon(target)
    if not read_root:
        assert not os.path.ismount(target)  # the trap: stat answers ENOTCONN

    result = shardfs_cli("umount", name)
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [removed_line((cwd or Path()).absolute() / name)]
    assert not is_mounted(target)
    assert not pid_file(target).exists()
    assert not socket_path(target).exists()
    assert list(target.iterdir()) == []

    mount_without_stat(source, target, cache)
    if read_root:
        assert sha256_tree(target) == expected
    killed = kill_daemon(target)

    result = shardfs_cli("mount", source, name, "--cache-dir", cache)
    assert result.returncode == 0, result.stderr
    assert removed_line((cwd or Path()).absolute() / name) in result.stderr.splitlines()
    assert "Traceback" not in result.stderr
    assert is_mounted(target)
    live = int(pid_file(target).read_text())
    assert live != killed and not process_gone(live)
    assert sha256_tree(target) == expected
    umount(target)
    assert process_gone(live)


@pytest.mark.parametrize("read_root", [False, True], ids=["root-never-read", "root-read"])
def test_umount_and_mount_clear_a_killed_daemons_mount(
    read_root: bool, dataset: tuple[str, dict[str, str]], mountpoint: Path, tmp_path: Path
) -> None:
    source, expected = dataset
    check_umount_and_remount_over_dead(
        source, expected, mountpoint, tmp_path / "cache", read_root=read_root
    )


def test_a_foreground_mount_over_a_dead_one_logs_the_removal(
    dataset: tuple[str, dict[str, str]], mountpoint: Path, tmp_path: Path
) -> None:
    source, expected = dataset
    mount_without_stat(source, mountpoint, tmp_path / "cache")
    killed = str(kill_daemon(mountpoint))
    proc = spawn_shardfs("mount", source, mountpoint, "--cache-dir", tmp_path / "cache", "-f")

    def ready() -> bool:
        try:
            return pid_file(mountpoint).read_text() != killed
        except FileNotFoundError:
            return False

    try:
        wait_for(ready, "the foreground mount to be ready")
        assert sha256_tree(mountpoint) == expected
        umount(mountpoint)
        _, log = proc.communicate(timeout=30)
    finally:
        stop_process(proc)
    assert proc.returncode == 0, log
    assert f"removed a dead shardfs mount at {mountpoint}" in log


def test_a_killed_daemons_created_mountpoint_goes_with_its_dead_mount(
    dataset: tuple[str, dict[str, str]], mountpoint: Path, tmp_path: Path
) -> None:
    """A mountpoint that a mount created outlives its killed daemon only as long as the
    dead mount: ``shardfs umount`` removes both, and so does the end of a mount made over
    the dead one."""
    source, expected = dataset
    cache = tmp_path / "cache"
    mountpoint.rmdir()
    mount_without_stat(source, mountpoint, cache)
    kill_daemon(mountpoint)
    assert created_marker(mountpoint).exists()
    result = run_shardfs("umount", mountpoint)
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [removed_line(mountpoint)]
    assert not os.path.lexists(mountpoint)
    assert not created_marker(mountpoint).exists()

    mount_without_stat(source, mountpoint, cache)
    kill_daemon(mountpoint)
    result = run_shardfs("mount", source, mountpoint, "--cache-dir", cache)
    assert result.returncode == 0, result.stderr
    assert removed_line(mountpoint) in result.stderr.splitlines()
    assert sha256_tree(mountpoint) == expected
    umount(mountpoint)
    assert not os.path.lexists(mountpoint)
    assert not created_marker(mountpoint).exists()


@pytest.fixture
def odd_mountpoint(tmp_path: Path) -> Iterator[Path]:
    """A mountpoint whose name mountinfo must escape (space -> \\040, backslash -> \\134)."""
    require_fuse()
    path = tmp_path / "dead mnt\\x"
    path.mkdir()
    yield path
    if is_mounted(path):
        unmount(path)


def test_a_mountpoint_with_a_space_in_its_name(
    dataset: tuple[str, dict[str, str]], odd_mountpoint: Path, tmp_path: Path
) -> None:
    source, expected = dataset
    mount(source, odd_mountpoint, tmp_path / "cache", env={})
    escaped = str(odd_mountpoint).replace("\\", "\\134").replace(" ", "\\040")
    assert f" {escaped} " in Path("/proc/self/mountinfo").read_text()
    umount(odd_mountpoint)
    check_umount_and_remount_over_dead(
        source, expected, odd_mountpoint, tmp_path / "cache", read_root=False
    )


def test_a_symlinked_mountpoint_named_by_a_relative_path(
    dataset: tuple[str, dict[str, str]], mountpoint: Path, tmp_path: Path
) -> None:
    (tmp_path / "link").symlink_to(mountpoint)
    source, expected = dataset
    check_umount_and_remount_over_dead(
        source,
        expected,
        mountpoint,
        tmp_path / "cache",
        read_root=False,
        spelled="link",
        cwd=tmp_path,
    )


def test_a_busy_live_mount_is_refused_then_detached_lazily(
    dataset: tuple[str, dict[str, str]], mountpoint: Path, tmp_path: Path
) -> None:
    source, expected = dataset
    mount(source, mountpoint, tmp_path / "cache", env={})
    pid = daemon_pid(mountpoint)
    holder = hold_cwd(mountpoint / "ant")
    try:
        result = run_shardfs("umount", mountpoint)
        line = assert_one_error_line(result)
        assert result.returncode == 5
        assert "busy" in line
        assert sha256_tree(mountpoint) == expected  # untouched and still served

        result = run_shardfs("umount", "--lazy", mountpoint)
        assert result.returncode == 0, result.stderr
        assert "detached" in result.stderr
        assert not is_mounted(mountpoint)
        assert not process_gone(pid)  # the holder still reads through it
        ant = sorted(Path(name).name for name in expected if name.startswith("ant/"))
        assert sorted(os.listdir(f"/proc/{holder.pid}/cwd")) == ant
    finally:
        release(holder)
    wait_for(lambda: process_gone(pid), "the daemon to exit once its last user left")


def test_a_busy_dead_mount_is_refused_with_one_line(
    dataset: tuple[str, dict[str, str]], mountpoint: Path, tmp_path: Path
) -> None:
    source, expected = dataset
    mount(source, mountpoint, tmp_path / "cache", env={})
    holder = hold_cwd(mountpoint)
    try:
        kill_daemon(mountpoint)
        for args in (
            ("umount", mountpoint),
            ("mount", source, mountpoint, "--cache-dir", tmp_path / "cache"),
        ):
            result = run_shardfs(*args)
            line = assert_one_error_line(result)
            assert result.returncode == 5, args
            assert "busy" in line
            assert is_mounted(mountpoint)
    finally:
        release(holder)
    result = run_shardfs("umount", mountpoint)
    assert result.returncode == 0, result.stderr
    assert not is_mounted(mountpoint)
    mount(source, mountpoint, tmp_path / "cache", env={})
    assert sha256_tree(mountpoint) == expected
    umount(mountpoint)


def dead_fuse_mount(path: Path, subtype: str) -> None:
    """A FUSE mount of type ``fuse.SUBTYPE`` whose /dev/fuse is closed at once: what a
    crashed daemon of another FUSE filesystem leaves behind."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open("/dev/fuse", os.O_RDWR)
    try:
        options = f"fd={fd},rootmode=40000,user_id={os.getuid()},group_id={os.getgid()}"
        flags = 1 | 2 | 4  # MS_RDONLY | MS_NOSUID | MS_NODEV
        if libc.mount(
            subtype.encode(), os.fsencode(path), f"fuse.{subtype}".encode(), flags, options.encode()
        ):
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code), str(path))
    finally:
        os.close(fd)


def test_a_dead_mount_of_another_filesystem_is_left_alone(
    dataset: tuple[str, dict[str, str]], mountpoint: Path, tmp_path: Path
) -> None:
    dead_fuse_mount(mountpoint, "otherfs")
    assert is_mounted(mountpoint)

    result = run_shardfs("mount", dataset[0], mountpoint, "--cache-dir", tmp_path / "cache")
    line = assert_one_error_line(result)
    assert result.returncode == 5
    assert "fuse.otherfs" in line
    assert is_mounted(mountpoint)

    result = run_shardfs("umount", mountpoint)
    line = assert_one_error_line(result)
    assert result.returncode == 5
    assert "not a shardfs" in line
    assert is_mounted(mountpoint)

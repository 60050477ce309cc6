"""How a live mount behaves: read-only, xattrs, inodes, d_type, signals, foreground, symlinks."""

from __future__ import annotations

import ctypes
import errno
import hashlib
import io
import os
import random
import signal
import stat
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support.datagen import make_imagefolder, pack_with_gnu_tar, relative_files, sha256_tree
from support.mounts import mount, new_bucket, process_gone, umount, wait_for
from support.processes import is_mounted, spawn_shardfs, stop_process
from support.s3 import S3Server

from shardfs.mount.control import pid_file, query

pytestmark = pytest.mark.integration

CLASS_SIZES = {"ant": 3, "bee": 3, "ελάφι": 3}


@pytest.fixture
def env(s3_server: S3Server) -> dict[str, str]:
    return s3_server.env()


@pytest.fixture(scope="module")
def dataset(
    s3_server: S3Server, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, list[Path], str]:
    """9 images in three GNU tar shards (4, 4, 1 files): (tree, shards, source URL)."""
    base = tmp_path_factory.mktemp("behaviour")
    make_imagefolder(base / "src", CLASS_SIZES)
    shards = pack_with_gnu_tar(base / "src", base / "shards", files_per_shard=4)
    bucket = new_bucket(s3_server, "behaviour")
    s3_server.upload_dir(base / "shards", f"{bucket}/p")
    return base / "src", shards, f"s3://{bucket}/p/"


@pytest.fixture
def mounted(
    dataset: tuple[Path, list[Path], str],
    env: dict[str, str],
    mountpoint: Path,
    tmp_path: Path,
) -> Iterator[Path]:
    mount(dataset[2], mountpoint, tmp_path / "cache", env=env)
    yield mountpoint
    if is_mounted(mountpoint):
        umount(mountpoint)


def first_file(root: Path) -> Path:
    return root / relative_files(root)[0]


# -- read-only -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "attempt",
    [
        pytest.param(lambda m, f: os.open(f, os.O_RDWR), id="open-for-write"),
        pytest.param(lambda m, f: os.open(f, os.O_WRONLY | os.O_APPEND), id="open-for-append"),
        pytest.param(
            lambda m, f: os.open(m / "ant" / "new.jpg", os.O_WRONLY | os.O_CREAT), id="create"
        ),
        pytest.param(lambda m, f: os.mkdir(m / "newdir"), id="mkdir"),
        pytest.param(lambda m, f: (m / "ant" / "touched").touch(), id="touch-new"),
        pytest.param(lambda m, f: os.utime(f), id="touch-existing"),
        pytest.param(lambda m, f: os.unlink(f), id="unlink"),
        pytest.param(lambda m, f: os.rename(f, m / "moved.jpg"), id="rename"),
        pytest.param(lambda m, f: os.chmod(f, 0o777), id="chmod"),
        pytest.param(lambda m, f: os.truncate(f, 0), id="truncate"),
    ],
)
def test_writes_are_refused_with_erofs(
    attempt: Callable[[Path, Path], object], mounted: Path
) -> None:
    target = first_file(mounted)
    before = target.read_bytes()
    with pytest.raises(OSError) as info:
        attempt(mounted, target)
    assert info.value.errno == errno.EROFS, info.value
    assert target.read_bytes() == before
    assert not (mounted / "newdir").exists()
    assert not (mounted / "ant" / "new.jpg").exists()


# -- xattrs, inodes, readdir -----------------------------------------------------------------


def test_xattr_names_the_shard_of_each_file(
    dataset: tuple[Path, list[Path], str], mounted: Path
) -> None:
    expected = {}
    for shard in dataset[1]:
        with tarfile.open(shard, encoding="utf-8") as tar:
            expected.update({m.name: shard.name for m in tar.getmembers() if m.isfile()})
    assert len(expected) == sum(CLASS_SIZES.values())
    for rel, shard_name in expected.items():
        assert os.getxattr(mounted / rel, "user.shardfs.shard") == shard_name.encode()
        assert "user.shardfs.shard" in os.listxattr(mounted / rel)
    with pytest.raises(OSError) as info:
        os.getxattr(mounted / rel, "user.shardfs.nonexistent")
    assert info.value.errno == errno.ENODATA


def inode_table(root: Path) -> dict[str, int]:
    table = {".": os.lstat(root).st_ino}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder) / name
            table[path.relative_to(root).as_posix()] = os.lstat(path).st_ino
    return table


def test_inodes_are_unique_and_stable_across_remounts(
    dataset: tuple[Path, list[Path], str],
    env: dict[str, str],
    mountpoint: Path,
    tmp_path: Path,
) -> None:
    cache = tmp_path / "cache"
    mount(dataset[2], mountpoint, cache, env=env)
    first = inode_table(mountpoint)
    umount(mountpoint)
    assert len(first) == 1 + len(CLASS_SIZES) + sum(CLASS_SIZES.values())
    assert len(set(first.values())) == len(first)

    mount(dataset[2], mountpoint, cache, env=env)
    assert inode_table(mountpoint) == first
    umount(mountpoint)


class _Dirent(ctypes.Structure):
    # glibc's struct dirent on 64-bit Linux.
    _fields_ = (
        ("d_ino", ctypes.c_uint64),
        ("d_off", ctypes.c_int64),
        ("d_reclen", ctypes.c_ushort),
        ("d_type", ctypes.c_ubyte),
        ("d_name", ctypes.c_char * 256),
    )


DT_DIR, DT_REG, DT_LNK, DT_UNKNOWN = 4, 8, 10, 0


def raw_readdir(path: Path, *, dots: bool = False) -> dict[str, tuple[int, int]]:
    """``{name: (d_type, d_ino)}`` straight from readdir(3), without any stat ("." and ".."
    left out unless ``dots``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.opendir.restype = ctypes.c_void_p
    libc.opendir.argtypes = (ctypes.c_char_p,)
    libc.readdir.restype = ctypes.POINTER(_Dirent)
    libc.readdir.argtypes = (ctypes.c_void_p,)
    libc.closedir.argtypes = (ctypes.c_void_p,)
    handle = libc.opendir(os.fsencode(path))
    if not handle:
        raise OSError(ctypes.get_errno(), f"opendir {path}")
    entries = {}
    try:
        while entry := libc.readdir(handle):
            name = os.fsdecode(entry.contents.d_name)
            if dots or name not in (".", ".."):
                entries[name] = (entry.contents.d_type, entry.contents.d_ino)
    finally:
        libc.closedir(handle)
    return entries


def test_readdir_returns_d_type_and_inode(mounted: Path) -> None:
    root = raw_readdir(mounted)
    assert sorted(root) == sorted(CLASS_SIZES)
    assert {d_type for d_type, _ in root.values()} == {DT_DIR}
    for name, (_, d_ino) in root.items():
        assert d_ino == os.lstat(mounted / name).st_ino
    files = raw_readdir(mounted / "ελάφι")
    assert len(files) == CLASS_SIZES["ελάφι"]
    assert {d_type for d_type, _ in files.values()} == {DT_REG}
    # os.scandir agrees (it only falls back to stat for DT_UNKNOWN).
    with os.scandir(mounted) as it:
        assert all(entry.is_dir(follow_symlinks=False) for entry in it)


def test_every_entry_shows_64_kib_as_its_io_size(mounted: Path) -> None:
    """st_blksize is 64 KiB: Python's open() sizes its buffer by it, and its first read of
    a file then asks for the kernel's whole readahead window (one READ for a small file)."""
    sizes = {os.lstat(mounted).st_blksize}
    for folder, dirs, files in os.walk(mounted):
        sizes.update(os.lstat(Path(folder) / name).st_blksize for name in dirs + files)
    assert sizes == {1 << 16}
    with open(next(p for p in mounted.rglob("*") if p.is_file()), "rb") as f:
        assert os.fstat(f.fileno()).st_blksize == 1 << 16


def test_dot_and_dot_dot_carry_the_folder_and_its_parent(mounted: Path) -> None:
    root_ino = os.lstat(mounted).st_ino
    assert raw_readdir(mounted, dots=True)[".."] == (DT_DIR, root_ino)  # the root holds itself
    for name in CLASS_SIZES:
        entries = raw_readdir(mounted / name, dots=True)
        assert entries["."] == (DT_DIR, os.lstat(mounted / name).st_ino)
        assert entries[".."] == (DT_DIR, root_ino)


def test_the_kernel_keeps_a_listing_across_opens(mounted: Path) -> None:
    """Each folder is listed by the daemon once; later listings (an ImageFolder per epoch)
    come from the kernel's cache."""
    for _ in range(3):
        assert sorted(os.listdir(mounted)) == sorted(CLASS_SIZES)
    assert query(mounted)["folders_listed"] == 1
    for _ in range(3):
        for name in CLASS_SIZES:
            assert len(os.listdir(mounted / name)) == CLASS_SIZES[name]
    assert query(mounted)["folders_listed"] == 1 + len(CLASS_SIZES)


# -- lifecycle: signals and foreground -------------------------------------------------------


def test_sigterm_to_the_daemon_unmounts_cleanly(
    dataset: tuple[Path, list[Path], str], mounted: Path, tmp_path: Path
) -> None:
    pid_path = pid_file(mounted)
    pid = int(pid_path.read_text())
    assert not process_gone(pid)
    assert sha256_tree(mounted) == sha256_tree(dataset[0])

    os.kill(pid, signal.SIGTERM)

    wait_for(lambda: process_gone(pid), "the daemon to exit after SIGTERM")
    assert not is_mounted(mounted)  # no dead mount left behind
    assert not pid_path.exists()
    assert list(mounted.iterdir()) == []
    # The daemon's log (its stderr) shows a clean stop, not an error.
    (log,) = (tmp_path / "cache" / "logs").iterdir()
    text = log.read_text()
    assert "unmounted" in text
    assert "error" not in text.lower()
    assert "Traceback" not in text


def test_foreground_mount_serves_until_sigint(
    dataset: tuple[Path, list[Path], str],
    env: dict[str, str],
    mountpoint: Path,
    tmp_path: Path,
) -> None:
    proc = spawn_shardfs(
        "mount", dataset[2], mountpoint, "--foreground", "--cache-dir", tmp_path / "c", env=env
    )
    try:
        wait_for(lambda: proc.poll() is not None or is_mounted(mountpoint), "the foreground mount")
        assert proc.poll() is None, proc.communicate()[1]
        assert sha256_tree(mountpoint) == sha256_tree(dataset[0])

        proc.send_signal(signal.SIGINT)
        _stdout, stderr = proc.communicate(timeout=30)
    finally:
        stop_process(proc)
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr
    assert not is_mounted(mountpoint)


# -- symlinks --------------------------------------------------------------------------------


def test_symlinks_inside_are_served_and_outside_left_out(
    s3_server: S3Server, env: dict[str, str], mountpoint: Path, tmp_path: Path
) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:

        def add(name: str, *, data: bytes | None = None, link: str | None = None) -> None:
            info = tarfile.TarInfo(name)
            info.mtime = 1_700_000_000
            if link is not None:
                info.type, info.linkname = tarfile.SYMTYPE, link
                tar.addfile(info)
            else:
                content = data or b""
                info.size = len(content)
                tar.addfile(info, io.BytesIO(content))

        add("top.txt", data=b"top")
        add("d/file.txt", data=b"inner")
        add("d/sibling", link="file.txt")
        add("d/up", link="../top.txt")
        add("d/e/deep", link="../../d/file.txt")
        add("to_dir", link="d")
        add("d/escape", link="../../outside.txt")
        add("d/e/escape2", link="../../../x")
        add("absolute", link="/etc/passwd")
    bucket = new_bucket(s3_server, "links")
    s3_server.filesystem().pipe_file(f"{bucket}/p/shard-000000.tar", buf.getvalue())

    result = mount(f"s3://{bucket}/p/", mountpoint, tmp_path / "c", env=env)
    assert "link" in result.stderr  # the left-out links are reported

    served = {"d/sibling": "file.txt", "d/up": "../top.txt", "d/e/deep": "../../d/file.txt"}
    for rel, target in served.items():
        path = mountpoint / rel
        assert stat.S_ISLNK(os.lstat(path).st_mode)
        assert os.readlink(path) == target
    assert (mountpoint / "d/sibling").read_bytes() == b"inner"
    assert (mountpoint / "d/up").read_bytes() == b"top"
    assert (mountpoint / "d/e/deep").read_bytes() == b"inner"
    assert (mountpoint / "to_dir" / "file.txt").read_bytes() == b"inner"
    for rel in ("d/escape", "d/e/escape2", "absolute"):
        assert not os.path.lexists(mountpoint / rel), rel
    assert sorted(os.listdir(mountpoint)) == ["d", "to_dir", "top.txt"]
    umount(mountpoint)


# -- a file larger than one read window --------------------------------------------------------


def test_file_larger_than_the_read_window_reads_back_exactly(
    s3_server: S3Server, env: dict[str, str], mountpoint: Path, tmp_path: Path
) -> None:
    # ReadConfig: files over 8 MiB are fetched in 8 MiB windows, not whole.
    payload = random.Random("big").randbytes((9 << 20) + 4097)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in (("small.bin", b"small"), ("big/blob.bin", payload)):
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 1_700_000_000
            tar.addfile(info, io.BytesIO(data))
    bucket = new_bucket(s3_server, "big")
    s3_server.filesystem().pipe_file(f"{bucket}/p/shard-000000.tar", buf.getvalue())

    mount(f"s3://{bucket}/p/", mountpoint, tmp_path / "c", env=env)
    path = mountpoint / "big" / "blob.bin"
    assert path.stat().st_size == len(payload)
    fd = os.open(path, os.O_RDONLY)
    try:
        # Seeks back and forth across the window boundary, before the page cache holds any.
        for offset, size in [
            (len(payload) - 100, 1000),
            ((8 << 20) - 10, 20),
            (5, 3),
            ((8 << 20) + 3, 70_000),
            (len(payload), 10),
        ]:
            assert os.pread(fd, size, offset) == payload[offset : offset + size], offset
    finally:
        os.close(fd)
    assert hashlib.sha256(path.read_bytes()).digest() == hashlib.sha256(payload).digest()
    assert (mountpoint / "small.bin").read_bytes() == b"small"
    umount(mountpoint)

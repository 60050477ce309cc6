"""Hostile symlinks through a real FUSE mount at a deep mountpoint: no walk the kernel makes
through the mount reaches the host's files, while benign links keep working."""

from __future__ import annotations

import errno
import io
import os
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.mounts import mount, umount
from support.processes import is_mounted, require_fuse, unmount

pytestmark = pytest.mark.integration

LADDER = 16  # folders k/k/.../k, each with 'up -> ..'
LADDER_DIR = "/".join(["k"] * LADDER)

# (member path, target): every one of these would leave the mount.
HOSTILE = {
    "h/up": "../../../../../../../..",  # the reported attack, exactly
    "h/passwd": "up/../../../../../../../../etc/passwd",
    # Each 'up' reads as one level down but climbs one: the text stays inside.
    f"{LADDER_DIR}/passwd": "up/" * LADDER + "../" * 2 * LADDER + "etc/passwd",
    "d/root_then_out": "to_root/../etc/passwd",
    "absolute": "/etc/passwd",
    "loop_a": "loop_b",
    "loop_b": "loop_a",
}
BENIGN = {
    "d/sibling": ("file.txt", b"inner"),
    "d/to_root": ("..", None),
    "d/via_root": ("to_root/top.txt", b"top"),
    "to_dir": ("d", None),
    "through": ("to_dir/sibling", b"inner"),
    f"{LADDER_DIR}/home": ("up/" * LADDER + "top.txt", b"top"),
}
FILES = {"top.txt": b"top", "d/file.txt": b"inner"}


@pytest.fixture
def deep_mountpoint(tmp_path: Path) -> Iterator[Path]:
    """An empty folder 12 levels below tmp_path; unmounted at teardown."""
    require_fuse()
    path = tmp_path.joinpath(*(f"l{i}" for i in range(12)), "mnt")
    path.mkdir(parents=True)
    try:
        yield path
    finally:
        if is_mounted(path):
            unmount(path)


def python_tar() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in FILES.items():
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 1_700_000_000
            tar.addfile(info, io.BytesIO(data))
        ups = [("/".join(["k"] * level + ["up"]), "..") for level in range(1, LADDER + 1)]
        benign = [(path, target) for path, (target, _) in BENIGN.items()]
        for name, target in [*HOSTILE.items(), *ups, *benign]:
            info = tarfile.TarInfo(name)
            info.type, info.linkname, info.mtime = tarfile.SYMTYPE, target, 1_700_000_000
            tar.addfile(info)
    return buf.getvalue()


def gnu_tar(staging: Path, out: Path) -> None:
    """The same tree made on disk with real symlinks, then archived by GNU tar."""
    for name, data in FILES.items():
        (staging / name).parent.mkdir(parents=True, exist_ok=True)
        (staging / name).write_bytes(data)
    ups = {"/".join(["k"] * level + ["up"]): ".." for level in range(1, LADDER + 1)}
    benign = {path: target for path, (target, _) in BENIGN.items()}
    for name, target in {**HOSTILE, **ups, **benign}.items():
        (staging / name).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(target, staging / name)
    subprocess.run(
        ["tar", "--format=gnu", "-cf", str(out), "-C", str(staging), "."],
        check=True,
        capture_output=True,
    )


def read_everything(root: Path) -> tuple[set[str], list[bytes]]:
    """Every path below ``root`` (not following links while listing), and the bytes of every
    regular file and of every symlink opened through the kernel."""
    paths: set[str] = set()
    contents: list[bytes] = []
    for folder, dirs, names in os.walk(root, followlinks=False):
        for name in [*dirs, *names]:
            full = Path(folder, name)
            paths.add(full.relative_to(root).as_posix())
            if full.is_dir():
                continue
            try:
                with open(full, "rb") as f:
                    contents.append(f.read())
            except OSError as error:
                assert error.errno in (errno.ENOENT, errno.EISDIR, errno.ELOOP), (full, error)
    return paths, contents


@pytest.mark.parametrize("maker", ["python", "gnu"])
def test_hostile_links_never_reach_the_host(
    maker: str, deep_mountpoint: Path, tmp_path: Path
) -> None:
    source = tmp_path / "shards"
    source.mkdir()
    if maker == "python":
        (source / "shard-000000.tar").write_bytes(python_tar())
    else:
        staging = tmp_path / "staging"
        staging.mkdir()
        gnu_tar(staging, source / "shard-000000.tar")
    host_passwd = Path("/etc/passwd").read_bytes()
    assert host_passwd

    result = mount(str(source), deep_mountpoint, tmp_path / "cache", env={})
    assert f"{len(HOSTILE)} link(s) left out" in result.stderr, result.stderr

    paths, contents = read_everything(deep_mountpoint)
    assert all(host_passwd not in data for data in contents)
    assert all(b"root:" not in data for data in contents)
    for hostile in HOSTILE:
        assert hostile not in paths
        assert not os.path.lexists(deep_mountpoint / hostile), hostile
        with pytest.raises(FileNotFoundError):
            (deep_mountpoint / hostile).read_bytes()
    for path, (target, data) in BENIGN.items():
        assert os.readlink(deep_mountpoint / path) == target
        if data is not None:
            assert (deep_mountpoint / path).read_bytes() == data
    assert (deep_mountpoint / "d/to_root").resolve() == deep_mountpoint.resolve()
    assert sorted(os.listdir(deep_mountpoint / "to_dir")) == [
        "file.txt",
        "sibling",
        "to_root",
        "via_root",
    ]
    assert sorted(contents) == sorted(
        [b"top", b"inner"] + [data for _, data in BENIGN.values() if data is not None]
    )
    umount(deep_mountpoint)

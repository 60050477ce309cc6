"""Bad input through the real CLI: one clear line on stderr and a non-zero exit code."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import tarfile
from pathlib import Path

import pytest
from support.datagen import make_imagefolder, pack_with_gnu_tar, sha256_tree
from support.mounts import assert_one_error_line, mount, new_bucket, umount
from support.processes import daemons_naming, is_mounted, run_shardfs
from support.s3 import S3Server

pytestmark = pytest.mark.integration

CLASS_SIZES = {"ant": 4, "bee": 4, "cow": 4}  # 12 files, 4 per shard -> 3 shards


@pytest.fixture
def env(s3_server: S3Server) -> dict[str, str]:
    return s3_server.env()


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    """A small tree and its three GNU tar shards, 4 files each."""
    base = tmp_path_factory.mktemp("good")
    make_imagefolder(base / "src", CLASS_SIZES)
    shards = pack_with_gnu_tar(base / "src", base / "shards", files_per_shard=4)
    assert len(shards) == 3
    return base / "src", shards


def upload_shards(server: S3Server, stem: str, shards: dict[str, bytes]) -> str:
    """Upload ``{name: bytes}`` to a fresh bucket under prefix ``p``; return the source URL."""
    bucket = new_bucket(server, stem)
    fs = server.filesystem()
    for name, data in shards.items():
        fs.pipe_file(f"{bucket}/p/{name}", data)
    return f"s3://{bucket}/p/"


def mount_fails(
    source: str, mountpoint: Path, tmp_path: Path, env: dict[str, str], *extra: str
) -> tuple[int, str]:
    result = run_shardfs(
        "mount", source, mountpoint, "--cache-dir", tmp_path / "c", *extra, env=env
    )
    line = assert_one_error_line(result)
    assert not is_mounted(mountpoint)
    # The daemon that reported the error has exited: a retry at once finds the mountpoint free.
    assert daemons_naming(mountpoint) == []
    return result.returncode, line


# -- the source ------------------------------------------------------------------------------


def test_missing_bucket(env: dict[str, str], mountpoint: Path, tmp_path: Path) -> None:
    code, line = mount_fails("s3://no-such-bucket-here/p/", mountpoint, tmp_path, env)
    assert code == 3
    assert "no-such-bucket-here" in line


def test_missing_prefix(
    s3_server: S3Server, env: dict[str, str], mountpoint: Path, tmp_path: Path
) -> None:
    bucket = new_bucket(s3_server, "noprefix")
    s3_server.filesystem().pipe_file(f"{bucket}/elsewhere/shard-0.tar", b"\0" * 1024)
    code, line = mount_fails(f"s3://{bucket}/missing/", mountpoint, tmp_path, env)
    assert code == 3
    assert "missing" in line


def test_prefix_without_shards(
    s3_server: S3Server, env: dict[str, str], mountpoint: Path, tmp_path: Path
) -> None:
    bucket = new_bucket(s3_server, "noshards")
    fs = s3_server.filesystem()
    fs.pipe_file(f"{bucket}/p/readme.txt", b"hello")
    fs.pipe_file(f"{bucket}/p/data.tar.xz", b"not a plain tar")
    code, line = mount_fails(f"s3://{bucket}/p/", mountpoint, tmp_path, env)
    assert code == 3
    assert ".tar" in line


# -- bad shards ------------------------------------------------------------------------------


def member_offsets(data: bytes) -> list[tuple[str, int, int]]:
    """(name, header offset, data offset) of every member, as Python's tarfile reads them."""
    with tarfile.open(fileobj=io.BytesIO(data), encoding="utf-8") as tar:
        return [(m.name, m.offset, m.offset_data) for m in tar.getmembers()]


@pytest.mark.parametrize("cut", ["in-data", "in-header"])
def test_truncated_shard_fails_naming_shard_and_offset_or_is_skipped(
    cut: str,
    good: tuple[Path, list[Path]],
    s3_server: S3Server,
    env: dict[str, str],
    mountpoint: Path,
    tmp_path: Path,
) -> None:
    src, shards = good
    data = {shard.name: shard.read_bytes() for shard in shards}
    bad = shards[1].name
    # Cut inside the data, or inside the header, of the shard's last file.
    _name, header, data_offset = member_offsets(data[bad])[-1]
    data[bad] = data[bad][: data_offset + 100 if cut == "in-data" else header + 100]
    source = upload_shards(s3_server, "truncated", data)

    code, line = mount_fails(source, mountpoint, tmp_path, env)
    assert code == 4
    assert bad in line
    assert re.search(r"offset \d+", line), line
    assert "--skip-bad-shards" in line

    result = mount(source, mountpoint, tmp_path / "c2", "--skip-bad-shards", env=env)
    assert bad in result.stderr  # the skip is reported as a warning
    expected = {
        rel: digest
        for rel, digest in sha256_tree(src).items()
        if rel not in {m for m, _, _ in member_offsets(shards[1].read_bytes())}
    }
    assert len(expected) == 8
    assert sha256_tree(mountpoint) == expected
    umount(mountpoint)


def test_corrupt_header_fails_naming_shard_and_offset(
    good: tuple[Path, list[Path]],
    s3_server: S3Server,
    env: dict[str, str],
    mountpoint: Path,
    tmp_path: Path,
) -> None:
    _src, shards = good
    data = {shard.name: shard.read_bytes() for shard in shards}
    bad = shards[2].name
    _name, header, _data = member_offsets(data[bad])[2]
    corrupt = bytearray(data[bad])
    for i in range(header + 10, header + 20):  # inside the name field
        corrupt[i] ^= 0x5A
    data[bad] = bytes(corrupt)
    source = upload_shards(s3_server, "corrupt", data)

    code, line = mount_fails(source, mountpoint, tmp_path, env)
    assert code == 4
    assert bad in line
    assert re.search(r"offset \d+", line), line


def tar_with(*members: tuple[str, bytes]) -> bytes:
    """A tar built by Python's tarfile, names written exactly as given."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, content in members:
            info = tarfile.TarInfo(name)
            info.size = len(content)
            info.mtime = 1_700_000_000
            tar.addfile(info, io.BytesIO(content))
    return buf.getvalue()


@pytest.mark.parametrize("evil", ["../x", "a/../../x", "/etc/x"])
def test_member_escaping_the_mount_is_refused(
    evil: str, s3_server: S3Server, env: dict[str, str], mountpoint: Path, tmp_path: Path
) -> None:
    shard = tar_with(("ok/fine.txt", b"fine"), (evil, b"evil"))
    assert evil in [name for name, _, _ in member_offsets(shard)]
    source = upload_shards(s3_server, "escape", {"shard-000000.tar": shard})

    code, line = mount_fails(source, mountpoint, tmp_path, env)
    assert code == 4
    assert "shard-000000.tar" in line
    assert evil in line


# -- the mountpoint --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def good_source(s3_server: S3Server, good: tuple[Path, list[Path]]) -> str:
    return upload_shards(s3_server, "goodsrc", {s.name: s.read_bytes() for s in good[1]})


def test_mountpoint_does_not_exist_nor_its_parent(
    good_source: str, env: dict[str, str], tmp_path: Path
) -> None:
    missing = tmp_path / "nowhere" / "mnt"
    result = run_shardfs("mount", good_source, missing, "--cache-dir", tmp_path / "c", env=env)
    line = assert_one_error_line(result)
    assert result.returncode == 5
    assert line == (
        f"shardfs: error: {missing}: mountpoint does not exist, nor does its parent folder "
        f"{missing.parent} (create it first, e.g. mkdir -p {missing})"
    )
    assert not missing.parent.exists()


def test_mountpoint_not_empty(
    good_source: str, env: dict[str, str], mountpoint: Path, tmp_path: Path
) -> None:
    (mountpoint / "something").write_text("x")
    code, line = mount_fails(good_source, mountpoint, tmp_path, env)
    assert code == 5
    assert "not empty" in line


def test_mountpoint_already_mounted(
    good_source: str, env: dict[str, str], mountpoint: Path, tmp_path: Path
) -> None:
    mount(good_source, mountpoint, tmp_path / "first", env=env)
    result = run_shardfs(
        "mount", good_source, mountpoint, "--cache-dir", tmp_path / "second", env=env
    )
    line = assert_one_error_line(result)
    assert result.returncode == 5
    assert "already mounted" in line
    # The first mount is untouched.
    assert sorted(p.name for p in mountpoint.iterdir()) == sorted(CLASS_SIZES)
    umount(mountpoint)


def test_umount_of_a_directory_that_is_not_mounted(tmp_path: Path) -> None:
    result = run_shardfs("umount", tmp_path)
    line = assert_one_error_line(result)
    assert "not mounted" in line


def test_stats_finds_the_mount_from_any_path_inside_it_and_umount_names_it(
    good: tuple[Path, list[Path]], mountpoint: Path, tmp_path: Path
) -> None:
    folder = good[1][0].parent
    mount(str(folder), mountpoint, tmp_path / "c", env={})
    try:
        whole = run_shardfs("stats", mountpoint, "--json")
        assert whole.returncode == 0, whole.stderr
        expected = json.loads(whole.stdout)
        sub = sorted(p for p in mountpoint.iterdir() if p.is_dir())[0]
        inside = [sub, sorted(sub.iterdir())[0]]  # a folder and a file of the mount
        for path in inside:
            result = run_shardfs("stats", path, "--json")
            assert result.returncode == 0, result.stderr
            values = json.loads(result.stdout)
            assert (values["source"], values["files"]) == (expected["source"], expected["files"])
        text = run_shardfs("stats", sub)
        assert text.returncode == 0, text.stderr
        assert text.stdout.splitlines()[0].split() == ["source", str(folder)]

        result = run_shardfs("umount", sub)
        line = assert_one_error_line(result)
        assert result.returncode == 5
        at = os.path.realpath(mountpoint)
        assert line == (
            f"shardfs: error: {sub}: not mounted; it lies inside the shardfs mount at {at} "
            f"(shardfs umount {at})"
        )
        assert is_mounted(mountpoint)
    finally:
        umount(mountpoint)


def test_a_mount_of_another_filesystem_is_neither_unmounted_nor_mounted_over(
    good_source: str, env: dict[str, str], mountpoint: Path, tmp_path: Path
) -> None:
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "other", mountpoint], check=True)
    try:
        result = run_shardfs("umount", mountpoint)
        line = assert_one_error_line(result)
        assert result.returncode == 5
        assert line == f"shardfs: error: {mountpoint} is not a shardfs mount (it is tmpfs)"
        assert is_mounted(mountpoint)
        result = run_shardfs("stats", mountpoint)
        assert assert_one_error_line(result) == line
        assert result.returncode == 5

        result = run_shardfs(
            "mount", good_source, mountpoint, "--cache-dir", tmp_path / "c", env=env
        )
        line = assert_one_error_line(result)
        assert result.returncode == 5
        assert "already mounted (tmpfs)" in line
    finally:
        subprocess.run(["umount", mountpoint], check=True)


def test_pack_to_a_missing_bucket_names_the_bucket(
    env: dict[str, str], tmp_path: Path, good: tuple[Path, list[Path]]
) -> None:
    src, _shards = good
    result = run_shardfs("pack", src, "s3://no-such-bucket-for-pack/p", env=env)
    line = assert_one_error_line(result)
    assert result.returncode == 3
    assert line.startswith("shardfs: error: s3://no-such-bucket-for-pack/p: destination not found")
    assert ".shardfs-pack.json" not in line

"""The mount table: the reader (mountinfo lines, the kernel's octal escapes, path spelling),
and what a shardfs mount puts there (its sources as the source, type ``fuse.shardfs``)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardfs.config import MountConfig
from shardfs.errors import MountError
from shardfs.fuse.session import mount_options
from shardfs.mount.table import (
    MountEntry,
    find_mount,
    is_disconnected,
    parse_mountinfo,
    table_path,
    unescape,
)
from shardfs.store.urls import MAX_TABLE_NAME, table_name

# Lines as Linux 6.x writes them: zero, one and two optional fields before the "-".
SAMPLE = (
    b"22 1 0:21 / / rw,relatime shared:1 - overlay overlay rw,lowerdir=/l\n"
    b"25 22 0:5 / /proc rw,nosuid,nodev,noexec,relatime - proc proc rw\n"
    b"42 27 0:39 / /tmp/my\\040mnt ro,nosuid,nodev,relatime shared:7 master:3 - "
    b"fuse.shardfs shardfs ro,user_id=0,group_id=0,default_permissions\n"
)


def kernel_escape(path: bytes) -> bytes:
    """What the kernel's seq_file mangling does to space, tab, newline and backslash."""
    return b"".join(b"\\%03o" % c if c in b" \t\n\\" else bytes([c]) for c in path)


def test_parses_mountpoint_fstype_and_source_past_optional_fields() -> None:
    assert parse_mountinfo(SAMPLE) == [
        MountEntry("/", "overlay", "overlay"),
        MountEntry("/proc", "proc", "proc"),
        MountEntry("/tmp/my mnt", "fuse.shardfs", "shardfs"),
    ]
    assert [e.is_shardfs for e in parse_mountinfo(SAMPLE)] == [False, False, True]


@pytest.mark.parametrize(
    ("field", "path"),
    [
        (b"/a\\040b", "/a b"),
        (b"/a\\011b", "/a\tb"),
        (b"/a\\012b", "/a\nb"),
        (b"/a\\134b", "/a\\b"),
        # A path that really holds the text "\040": its backslash is escaped, not the rest.
        (b"/a\\134040b", "/a\\040b"),
        (b"/caf\xc3\xa9", "/café"),
    ],
)
def test_unescape(field: bytes, path: str) -> None:
    assert unescape(field) == path


def test_bytes_that_are_not_utf8_survive_as_the_os_spells_them() -> None:
    assert os.fsencode(unescape(b"/data/\xff\\040x")) == b"/data/\xff x"


@given(st.binary(min_size=1, max_size=40).filter(lambda b: b"\0" not in b))
def test_escape_then_parse_gives_the_path_back(name: bytes) -> None:
    path = b"/mnt/" + name
    line = b"50 22 0:60 / " + kernel_escape(path) + b" rw shared:2 - fuse.shardfs shardfs ro\n"
    (entry,) = parse_mountinfo(line)
    assert os.fsencode(entry.mountpoint) == path


@pytest.mark.parametrize(
    "line",
    [
        b"",
        b"garbage",
        b"42 27 0:39 / /mnt ro,relatime fuse.shardfs shardfs ro",  # no separator
        b"42 27 0:39 / /mnt ro,relatime -",  # nothing after it
        b"42 27 0:39 / /mnt ro,relatime - fuse.shardfs",  # no source
    ],
)
def test_malformed_lines_are_skipped(line: bytes) -> None:
    assert parse_mountinfo(line + b"\n" + SAMPLE)[-1].mountpoint == "/tmp/my mnt"
    assert len(parse_mountinfo(line + b"\n" + SAMPLE)) == 3


def test_the_real_table_of_this_process() -> None:
    entries = parse_mountinfo(Path("/proc/self/mountinfo").read_bytes())
    by_point = {e.mountpoint: e for e in entries}
    assert by_point["/proc"].fstype == "proc"
    assert find_mount("/proc") == by_point["/proc"]
    assert find_mount("/proc/self") is None  # inside a mount is not a mountpoint


def write_table(tmp_path: Path, *lines: str) -> Path:
    table = tmp_path / "mountinfo"
    table.write_bytes(b"".join(line.encode() + b"\n" for line in lines))
    return table


def test_the_topmost_of_stacked_mounts_wins(tmp_path: Path) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    table = write_table(
        tmp_path,
        f"40 22 0:40 / {mnt} rw - tmpfs tmpfs rw",
        f"41 40 0:41 / {mnt} ro - fuse.shardfs shardfs ro",
    )
    assert find_mount(mnt, table) == MountEntry(str(mnt), "fuse.shardfs", "shardfs")


def test_a_folder_that_is_not_in_the_table_is_not_mounted(tmp_path: Path) -> None:
    table = write_table(tmp_path, f"40 22 0:40 / {tmp_path}/other rw - tmpfs tmpfs rw")
    assert find_mount(tmp_path / "mnt", table) is None
    assert find_mount(tmp_path, table) is None


def test_paths_are_matched_absolute_with_symlinks_resolved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = tmp_path.resolve() / "real"
    (real / "mnt").mkdir(parents=True)
    (tmp_path / "parent-link").symlink_to(real)
    (tmp_path / "mnt-link").symlink_to(real / "mnt")
    (tmp_path / "link-to-link").symlink_to("mnt-link")  # relative, and two hops
    expected = str(real / "mnt")
    monkeypatch.chdir(real)
    for spelling in (
        real / "mnt",
        Path("mnt"),
        Path("./mnt/"),
        tmp_path / "parent-link" / "mnt",
        tmp_path / "mnt-link",
        tmp_path / "link-to-link",
        real / "other" / ".." / "mnt",
    ):
        assert table_path(spelling) == expected, spelling
    table = write_table(tmp_path, f"40 22 0:40 / {expected} ro - fuse.shardfs shardfs ro")
    assert find_mount(Path("mnt"), table) is not None
    assert find_mount(tmp_path / "link-to-link", table) is not None


def test_a_path_that_does_not_exist_is_spelled_without_error(tmp_path: Path) -> None:
    assert table_path(tmp_path / "missing" / "mnt") == str(tmp_path / "missing" / "mnt")
    assert table_path("/") == "/"


def test_a_plain_folder_is_not_disconnected(tmp_path: Path) -> None:
    assert not is_disconnected(str(tmp_path))
    assert not is_disconnected(str(tmp_path / "missing"))


def test_an_unreadable_table_is_one_mount_error(tmp_path: Path) -> None:
    with pytest.raises(MountError, match="cannot read the mount table"):
        find_mount(tmp_path, tmp_path / "no-such-mountinfo")


# -- what a shardfs mount puts in the table --------------------------------------------------


def test_the_table_names_the_sources_absolute_and_without_passwords(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert table_name(["shards/a.tar"]) == f"{tmp_path}/shards/a.tar"
    assert table_name(["s3://b/p/", "file:///d/x.tar"]) == "s3://b/p/,file:///d/x.tar"
    assert table_name(["https://me:secret@host/p/"]) == "https://me@host/p/"
    assert table_name(["s3://b/train-{a,b}-?.tar"]) == "s3://b/train-{a,b}-?.tar"
    assert table_name(["/d/line\nbreak\tx"]) == "/d/line?break?x"
    long = table_name([f"s3://b/{'x' * 5000}"])
    assert len(long) == MAX_TABLE_NAME and long.endswith("...")


def test_libfuse_gets_the_source_with_commas_and_backslashes_escaped() -> None:
    config = MountConfig(Path("/mnt"), fsname="/d/a,b\\c")
    options = mount_options(config)
    assert "fsname=/d/a\\,b\\\\c" in options
    assert "subtype=shardfs" in options  # the type, fuse.shardfs, is how mounts are found


@pytest.fixture
def odd_source(tmp_path: Path) -> Path:
    """A local source whose path holds what mount options and mountinfo must escape."""
    from support.datagen import make_imagefolder, pack_with_gnu_tar

    source = tmp_path / "shards, v1\\x y"
    make_imagefolder(tmp_path / "src", {"ant": 2, "bee": 1})
    pack_with_gnu_tar(tmp_path / "src", source, files_per_shard=2)
    return source


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["local", "s3"])
def test_a_mount_shows_its_source_and_type_fuse_shardfs(
    kind: str, request: pytest.FixtureRequest, odd_source: Path, mountpoint: Path, tmp_path: Path
) -> None:
    """``findmnt``, ``df`` and ``mount`` show ``SOURCE on MNT type fuse.shardfs``, and
    shardfs still finds its mount (by type) to unmount it."""
    from support.mounts import mount, new_bucket, umount

    env: dict[str, str] = {}
    source = str(odd_source)
    if kind == "s3":
        server = request.getfixturevalue("s3_server")
        bucket = new_bucket(server, "table")
        fs = server.filesystem()
        for shard in sorted(odd_source.iterdir()):
            fs.pipe_file(f"{bucket}/p/{shard.name}", shard.read_bytes())
        source, env = f"s3://{bucket}/p/", server.env()
    mount(source, mountpoint, tmp_path / "cache", env=env)

    entry = find_mount(mountpoint)
    assert entry is not None and (entry.fstype, entry.source) == ("fuse.shardfs", source)
    found = subprocess.run(
        ["findmnt", "-J", str(mountpoint)], capture_output=True, text=True, check=True
    )
    (shown,) = json.loads(found.stdout)["filesystems"]
    assert (shown["source"], shown["fstype"]) == (source, "fuse.shardfs")
    df = subprocess.run(
        ["df", "--output=source,fstype", str(mountpoint)], capture_output=True, text=True
    )
    assert df.stdout.splitlines()[1].split() == [*source.split(), "fuse.shardfs"]
    table = subprocess.run(["mount"], capture_output=True, text=True, check=True).stdout
    assert f"{source} on {mountpoint} type fuse.shardfs (" in table
    umount(mountpoint, env)

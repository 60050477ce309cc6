"""A tar of tars (ImageNet's ``ILSVRC2012_img_train.tar``: one tar per class) is indexed in
the one streamed pass as ``CLASS/FILE``: every inner member is a direct byte range of the
outer shard, a tar inside an inner tar stays a file, and a bad inner tar makes the shard bad
at its offset in the outer shard."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest
from support.tarbuild import make_tar

from shardfs.config import SourceConfig
from shardfs.errors import CorruptShardError, UnsafeMemberError
from shardfs.formats.tar import MemberKind, iter_members
from shardfs.index.scan import scan_shard
from shardfs.store.remote import Store

needs_gnu_tar = pytest.mark.skipif(shutil.which("tar") is None, reason="GNU tar is not installed")


def gnu_tar_of_tars(root: Path, classes: dict[str, dict[str, bytes]]) -> Path:
    """``root/train.tar``: a GNU tar of ``CLASS.tar`` files, each a GNU tar of its files."""
    inner_dir = root / "inner"
    inner_dir.mkdir(parents=True)
    for name, files in classes.items():
        folder = root / "src" / name
        folder.mkdir(parents=True)
        for file_name, body in files.items():
            (folder / file_name).write_bytes(body)
        subprocess.run(
            ["tar", "-cf", str(inner_dir / f"{name}.tar"), "-C", str(folder), *sorted(files)],
            check=True,
        )
    outer = root / "shards" / "train.tar"
    outer.parent.mkdir()
    members = sorted(f"{name}.tar" for name in classes)
    subprocess.run(["tar", "-cf", str(outer), "-C", str(inner_dir), *members], check=True)
    return outer


def scan_local(shard: Path) -> list[tuple[str, int, int, int, int, int, str, int | None]]:
    store = Store(SourceConfig(str(shard.parent)))
    [info] = [s for s in store.list_shards() if s.name == shard.name]
    return scan_shard(store, info)


CLASSES = {
    "n01440764": {"n01440764_1.JPEG": os.urandom(1500), "n01440764_2.JPEG": os.urandom(3)},
    "n01443537": {"n01443537_1.JPEG": os.urandom(700)},
    "n99999999": {"inner.tar": b"not expanded again"},
}


@needs_gnu_tar
def test_gnu_tar_of_tars_is_indexed_as_class_folders(tmp_path: Path) -> None:
    # The third class holds a real tar named inner.tar: depth 1 only, it stays a file.
    nested = io.BytesIO()
    with tarfile.open(fileobj=nested, mode="w") as tar:
        info = tarfile.TarInfo("deep.jpg")
        info.size = 4
        tar.addfile(info, io.BytesIO(b"deep"))
    classes = {**CLASSES, "n99999999": {"inner.tar": nested.getvalue()}}
    outer = gnu_tar_of_tars(tmp_path, classes)
    data = outer.read_bytes()
    rows = scan_local(outer)
    files = {
        path: data[off : off + size] for path, off, size, *_, kind, _l, _b in rows if kind == 0
    }
    expected = {f"{c}/{f}": body for c, members in classes.items() for f, body in members.items()}
    assert files == expected
    folders = {path for path, *_rest in rows if _rest[4] == MemberKind.DIRECTORY}
    assert folders == set(classes)


def inner_tar(members: dict[str, bytes]) -> bytes:
    return make_tar([(name, body) for name, body in members.items()])


def test_a_member_named_tar_that_is_no_tar_stays_a_file() -> None:
    outer = make_tar([("notes.tar", b"x" * 1000), ("short.tar", b"tiny"), (".tar", bytes(600))])
    members = [m for m, _ in iter_members(io.BytesIO(outer), "s.tar")]
    assert [(m.path, m.kind, m.size) for m in members] == [
        ("notes.tar", MemberKind.FILE, 1000),
        ("short.tar", MemberKind.FILE, 4),
        (".tar", MemberKind.FILE, 600),
    ]


def test_inner_offsets_are_offsets_of_the_outer_shard_and_labels_are_read() -> None:
    inner = inner_tar({"k1.jpg": b"J" * 900, "k1.cls": b"7"})
    outer = make_tar([("a.jpg", b"A" * 10), ("cls7.tar", inner), ("z.jpg", b"Z")])
    found = {}
    for member, content in iter_members(io.BytesIO(outer), "o.tar", capture=lambda m: True):
        found[(member.folder, member.path)] = (member, content)
    jpg, _ = found[("cls7", "k1.jpg")]
    assert outer[jpg.data_offset : jpg.data_offset + jpg.size] == b"J" * 900
    assert found[("cls7", "k1.cls")][1] == b"7"
    assert found[("", "cls7")][0].kind is MemberKind.DIRECTORY
    z, _ = found[("", "z.jpg")]  # the outer stream continues after the inner tar
    assert outer[z.data_offset : z.data_offset + 1] == b"Z"


def test_a_corrupt_inner_tar_makes_the_shard_bad_at_its_outer_offset() -> None:
    inner = bytearray(inner_tar({"a.jpg": b"a" * 600, "b.jpg": b"b"}))
    second = 512 + 1024  # the second header of the inner tar
    inner[second + 148 : second + 156] = b"0000000\0"  # a wrong checksum
    outer = make_tar([("first.jpg", b"1" * 100), ("c.tar", bytes(inner))])
    inner_at = 512 * 3  # first.jpg's header and data block, then c.tar's header
    with pytest.raises(CorruptShardError) as caught:
        list(iter_members(io.BytesIO(outer), "bad.tar"))
    assert caught.value.offset == inner_at + second
    assert str(caught.value) == f"bad.tar: header checksum mismatch at offset {inner_at + second}"


def test_a_truncated_inner_tar_is_a_truncated_shard() -> None:
    inner = inner_tar({"a.jpg": b"a" * 5000})
    outer = make_tar([("c.tar", inner)])
    with pytest.raises(CorruptShardError, match="truncated"):
        list(iter_members(io.BytesIO(outer[: 512 + 2048]), "cut.tar"))


def test_an_inner_member_that_climbs_out_is_refused(tmp_path: Path) -> None:
    inner = inner_tar({"../../etc/passwd": b"root"})
    (tmp_path / "evil.tar").write_bytes(make_tar([("c.tar", inner)]))
    with pytest.raises(UnsafeMemberError, match="escapes the mount"):
        scan_local(tmp_path / "evil.tar")
    absolute = make_tar([("c.tar", inner_tar({"/etc/passwd": b"root"}))])
    (tmp_path / "abs.tar").write_bytes(absolute)
    with pytest.raises(UnsafeMemberError, match="is absolute"):
        scan_local(tmp_path / "abs.tar")

"""The zip scanner on archives written by real tools (Python's zipfile, the zip tool): every
stored member's row is a byte range holding exactly its bytes, zip64 included; what cannot
be served verbatim is refused with one line naming the member and the fix; and indexing
reads few, coalesced ranges."""

from __future__ import annotations

import io
import os
import random
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest
from PIL import Image
from support.datagen import noise_jpeg
from support.decoded import read_row

from shardfs.errors import CorruptShardError, UnsupportedMemberError
from shardfs.formats import zip as zipformat
from shardfs.formats.registry import scanner_for
from shardfs.formats.source import BytesShard
from shardfs.formats.tar import MemberKind
from shardfs.formats.units import DecodedScan, is_decoded
from shardfs.formats.zip import scan_zip
from shardfs.store.urls import is_shard_name

ZIP_TOOL = shutil.which("zip")
needs_zip_tool = pytest.mark.skipif(ZIP_TOOL is None, reason="the zip tool is not installed")


class CountingShard(BytesShard):
    """A BytesShard that also counts the bytes it hands out."""

    def __init__(self, name: str, data: bytes) -> None:
        super().__init__(name, data)
        self.bytes_read = 0

    def read_at(self, offset: int, length: int) -> bytes:
        data = super().read_at(offset, length)
        self.bytes_read += len(data)
        return data


def python_zip(members: dict[str, bytes], *, zip64: bool = False) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as archive:
        for name, data in members.items():
            if name.endswith("/"):
                archive.mkdir(name.rstrip("/"))
                continue
            info = zipfile.ZipInfo(name, (2024, 5, 6, 7, 8, 10))
            info.external_attr = 0o640 << 16
            with archive.open(info, "w", force_zip64=zip64) as handle:
                handle.write(data)
    return buf.getvalue()


def files_of(data: bytes, rows: list[tuple[str, int, int, int, int, int, str, int | None]]):  # type: ignore[no-untyped-def]
    return {
        path: data[offset : offset + size]
        for path, offset, size, _mode, _mtime, kind, _link, _label in rows
        if kind == MemberKind.FILE
    }


MEMBERS = {
    "cat/": b"",
    "cat/cat_0.jpg": os.urandom(3000),
    "cat/cat_0.cls": b"1\n",
    "dog/dog_0.jpg": os.urandom(10),
    "dog/dog_0.json": b'{"label": 2}',
    "empty.txt": b"",
    "caf\u00e9/\u00e9t\u00e9.jpg": b"utf-8 name",
}


@pytest.mark.parametrize("zip64", [False, True])
def test_python_zipfile_members_are_direct_byte_ranges(zip64: bool) -> None:
    data = python_zip(MEMBERS, zip64=zip64)
    rows = scan_zip(BytesShard("train.zip", data))
    expected = {name: body for name, body in MEMBERS.items() if not name.endswith("/")}
    assert files_of(data, rows) == expected
    by_path = {row[0]: row for row in rows}
    assert by_path["cat"][5] == MemberKind.DIRECTORY
    assert by_path["cat/cat_0.cls"][7] == 1 and by_path["dog/dog_0.json"][7] == 2
    assert by_path["cat/cat_0.jpg"][7] is None
    assert by_path["cat/cat_0.jpg"][3] == 0o640
    assert by_path["cat/cat_0.jpg"][4] == 1714979290  # 2024-05-06 07:08:10, taken as UTC


def test_a_zip64_archive_with_zip64_end_records(monkeypatch: pytest.MonkeyPatch) -> None:
    # zipfile writes the zip64 end records (and 0xFFFF counts) past these limits: lowering
    # them makes a small archive use every zip64 structure, as CPython's own tests do.
    monkeypatch.setattr(zipfile, "ZIP64_LIMIT", 100)
    monkeypatch.setattr(zipfile, "ZIP_FILECOUNT_LIMIT", 3)
    members = {f"c/{i}.jpg": os.urandom(150 + i) for i in range(6)}
    data = python_zip(members, zip64=True)
    assert b"PK\x06\x06" in data and b"PK\x06\x07" in data
    assert files_of(data, scan_zip(BytesShard("z.zip", data))) == members


@needs_zip_tool
def test_zip_tool_stored_archive_with_longer_local_extra_and_a_symlink(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "a" / "b").mkdir(parents=True)
    files = {"a/x.jpg": os.urandom(5000), "a/b/y.png": os.urandom(7), "a/b/z.cls": b"4"}
    for name, body in files.items():
        (src / name).write_bytes(body)
    (src / "a" / "link.jpg").symlink_to("x.jpg")
    out = tmp_path / "out.zip"
    subprocess.run(["zip", "-q", "-0", "-r", "-y", str(out), "a"], cwd=src, check=True)
    data = out.read_bytes()
    rows = scan_zip(BytesShard("out.zip", data))
    assert files_of(data, rows) == files
    by_path = {row[0]: row for row in rows}
    assert by_path["a/link.jpg"][5] == MemberKind.SYMLINK and by_path["a/link.jpg"][6] == "x.jpg"
    assert by_path["a/b"][5] == MemberKind.DIRECTORY
    assert by_path["a/b/z.cls"][7] == 4
    # The point of reading local headers: the zip tool's local extra field is longer than
    # the central directory's, so offsets from the directory alone would be wrong.
    with zipfile.ZipFile(out) as archive:
        info = archive.getinfo("a/x.jpg")
        local_extra = int.from_bytes(
            data[info.header_offset + 28 : info.header_offset + 30], "little"
        )
        assert local_extra != len(info.extra)


def gradient_png(side: int) -> bytes:
    """A real PNG: a smooth gradient, which deflate shrinks."""
    image = Image.new("RGB", (side, side))
    image.putdata([(x % 256, y % 256, (x + y) % 256) for y in range(side) for x in range(side)])
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


def deflated_and_stored_tree(root: Path) -> dict[str, bytes]:
    """Real JPEGs and PNGs of several sizes and a highly compressible text file, some to be
    added stored (``stored/``) and the rest deflated; returns their bytes by path."""
    rng = random.Random(5)
    files = {
        "cat/small.jpg": noise_jpeg(rng, image_bytes=900),
        "cat/large.jpg": noise_jpeg(rng, image_bytes=120_000),
        "dog/mid.png": gradient_png(90),
        "dog/big.png": gradient_png(400),
        "dog/notes.txt": b"the same line, over and over\n" * 20_000,
        "dog/empty.jpg": b"",
        "dog/d.cls": b"7\n" + b" " * 400,  # deflated too: the label is decoded while indexing
        "stored/s.jpg": noise_jpeg(rng, image_bytes=30_000),
        "stored/s.png": gradient_png(60),
    }
    for name, body in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(body)
    return files


@needs_zip_tool
def test_zip_tool_deflated_members_mixed_with_stored_ones_decode_to_the_files(
    tmp_path: Path,
) -> None:
    src = tmp_path / "src"
    files = deflated_and_stored_tree(src)
    out = tmp_path / "mixed.zip"
    subprocess.run(["zip", "-q", "-r", "-0", str(out), "stored"], cwd=src, check=True)
    subprocess.run(["zip", "-q", "-r", str(out), "cat", "dog"], cwd=src, check=True)
    data = out.read_bytes()
    with zipfile.ZipFile(out) as archive:
        methods = {info.filename: info.compress_type for info in archive.infolist()}
    assert methods["dog/notes.txt"] == methods["dog/d.cls"] == zipfile.ZIP_DEFLATED
    assert methods["stored/s.jpg"] == methods["stored/s.png"] == zipfile.ZIP_STORED
    scan = scan_zip(BytesShard("data/mixed.zip", data))
    assert isinstance(scan, DecodedScan)
    got = {
        row[0]: read_row(data, scan, row[1], row[2])
        for row in scan.rows
        if row[5] == MemberKind.FILE
    }
    assert got == files
    by_path = {row[0]: row for row in scan.rows}
    assert by_path["dog/d.cls"][7] == 7
    # A deflated member is a unit of its own, at its compressed extent; a stored one stays a
    # direct range of the shard.
    deflated = {name for name, method in methods.items() if method == zipfile.ZIP_DEFLATED}
    units = {
        name: scan.space.locate(row[1])[1] for name, row in by_path.items() if is_decoded(row[1])
    }
    assert set(units) == deflated - {"dog/empty.jpg"}  # an empty file needs no decoding
    assert all(unit.codec == "deflate" and unit.size == len(files[n]) for n, unit in units.items())
    assert [u.offset for u in scan.space.units] == sorted(u.offset for u in scan.space.units)
    assert units["dog/notes.txt"].length * 100 < len(files["dog/notes.txt"])
    assert not is_decoded(by_path["stored/s.jpg"][1])


def test_other_compression_methods_are_refused_with_the_member_and_the_fix() -> None:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_LZMA) as archive:
        archive.writestr("cat/a.jpg", b"compressible " * 500)
    with pytest.raises(UnsupportedMemberError) as caught:
        scan_zip(BytesShard("data/lzma.zip", buf.getvalue()))
    text = str(caught.value)
    assert text.startswith("data/lzma.zip: member 'cat/a.jpg' is compressed (lzma, method 14)")
    assert "zip -0 -r" in text and text.endswith("at offset 0")
    assert caught.value.exit_code == 4


@needs_zip_tool
def test_an_encrypted_member_is_refused(tmp_path: Path) -> None:
    (tmp_path / "a.jpg").write_bytes(b"secret")
    out = tmp_path / "enc.zip"
    subprocess.run(["zip", "-q", "-0", "-P", "pw", str(out), "a.jpg"], cwd=tmp_path, check=True)
    with pytest.raises(UnsupportedMemberError, match=r"'a\.jpg' is encrypted"):
        scan_zip(BytesShard("enc.zip", out.read_bytes()))


def test_zip_is_a_registered_shard_suffix() -> None:
    assert scanner_for("data/train-0001.zip") is scan_zip
    assert is_shard_name("data/train-0001.zip")


def test_an_empty_zip_has_no_rows() -> None:
    assert scan_zip(BytesShard("e.zip", python_zip({}))) == []


# -- what indexing costs ---------------------------------------------------------------------


def test_many_small_members_are_indexed_in_few_reads_of_at_most_the_shard() -> None:
    members = {f"c{i % 7}/{i:05d}.jpg": os.urandom(2000 + i % 300) for i in range(2000)}
    data = python_zip(members)
    shard = CountingShard("small.zip", data)
    assert files_of(data, scan_zip(shard)) == members
    # Tail, the directory (one window), the local headers (windows of MAX_WINDOW).
    assert shard.reads <= 2 + 1 + -(-len(data) // zipformat.MAX_WINDOW) + 1
    assert shard.bytes_read <= len(data) + 70_000


def test_large_members_cost_only_their_headers() -> None:
    members = {f"big/{i}.bin": bytes([i]) * (3 << 20) for i in range(6)}
    data = python_zip(members)
    shard = CountingShard("large.zip", data)
    assert files_of(data, scan_zip(shard)) == members
    assert shard.bytes_read < 0.01 * len(data)
    assert shard.reads <= 2 + len(members)


def test_a_corrupt_error_names_the_shard_and_an_offset() -> None:
    with pytest.raises(CorruptShardError, match=r"^x\.zip: not a zip archive .* at offset 9$"):
        scan_zip(BytesShard("x.zip", b"not a zip"))


def test_a_scan_through_the_cache_fetches_each_block_once_and_hands_each_over_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With a block sink, the zip scan reads whole blocks: a zip many blocks long is fetched
    about once (an earlier version fetched the block shared by two windows twice: 1.9x on a
    197 MB zip), every block reaches the cache once, and the rows are unchanged."""
    from shardfs.config import SourceConfig
    from shardfs.index.scan import scan_shard
    from shardfs.store.shards import ShardInfo

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_STORED) as archive:
        for i in range(120):
            archive.writestr(f"c{i % 3}/img{i:03d}.jpg", os.urandom(20_000 + i))
    data = buffer.getvalue()
    shard = ShardInfo("train.zip", len(data), "e")
    block = 64 << 10
    # Windows the size of a block, as the defaults are (8 MiB both), at a test's scale.
    monkeypatch.setattr(zipformat, "MAX_WINDOW", block)
    monkeypatch.setattr(zipformat, "MAX_GAP", block // 2)

    class _Store:
        config = SourceConfig("unused")
        fetched = 0

        def read_range(self, info: ShardInfo, start: int, end: int) -> bytes:
            assert info == shard and 0 <= start < end <= len(data)
            _Store.fetched += end - start
            return data[start:end]

    given: list[int] = []

    def sink(info: ShardInfo, index: int, body: bytes) -> None:
        assert body == data[index * block : (index + 1) * block]
        given.append(index)

    rows = scan_shard(_Store(), shard, sink, block)  # type: ignore[arg-type]
    assert rows == scan_zip(BytesShard("train.zip", data))
    assert sorted(given) == list(range(-(-len(data) // block)))
    assert _Store.fetched <= len(data) + 2 * block, (_Store.fetched, len(data))

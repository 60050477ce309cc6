"""The ``.tar.gz`` scanner on shards written by GNU tar and gzip: one gzip-seek unit covers
the shard, every row's bytes (decoded from the nearest seek point) equal the source file,
concatenated gzip members work, the scan reads each raw byte once through ``read_cached``;
and a hostile shard (truncated, corrupt, a bomb, ``../`` names) fails with
``CorruptShardError``, never a library error."""

from __future__ import annotations

import gzip
import io
import os
import random
import subprocess
import tarfile
import zlib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.datagen import make_imagefolder, relative_files
from support.decoded import read_row

from shardfs.errors import CorruptShardError, UnsafeMemberError, UsageError
from shardfs.formats import codecs
from shardfs.formats.registry import scanner_for
from shardfs.formats.source import BytesShard
from shardfs.formats.tar import MemberKind
from shardfs.formats.tar_gz import scan_tar_gz
from shardfs.formats.units import DECODED_BASE, MAX_EXPANSION, DecodedScan
from shardfs.store.urls import compressed_suffix, is_shard_name

# Several sizes, so that some files straddle the 4 MiB seek points.
CLASS_SIZES = {"n01440764": 12, "n01443537": 9, "nested/n01484850": 7}


class CachedReads(BytesShard):
    """A BytesShard that records which bytes went through ``read_cached``."""

    def __init__(self, name: str, data: bytes) -> None:
        super().__init__(name, data)
        self.cached = bytearray(len(data))
        self.plain_reads = 0

    def read_at(self, offset: int, length: int) -> bytes:
        self.plain_reads += 1
        return super().read_at(offset, length)

    def read_cached(self, offset: int, length: int) -> bytes:
        end = min(offset + length, self.size)
        for at in range(offset, end):
            self.cached[at] = min(self.cached[at] + 1, 255)
        return self._data[offset:end]  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("targz") / "src"
    make_imagefolder(root, CLASS_SIZES, image_bytes=300_000, long_names=False)
    rng = random.Random(3)
    for size in (0, 1, 511, 512, 9000):  # small files, and one compressible
        (root / "misc").mkdir(exist_ok=True)
        (root / "misc" / f"f{size}.bin").write_bytes(rng.randbytes(size))
    (root / "misc" / "text.txt").write_bytes(b"compressible line\n" * 50_000)
    return root


def tar_czf(src: Path, out: Path) -> bytes:
    subprocess.run(["tar", "-czf", str(out), "-C", str(src), "."], check=True)
    return out.read_bytes()


def tar_gzip_1(src: Path, out: Path) -> bytes:
    tar = subprocess.run(["tar", "-cf", "-", "-C", str(src), "."], check=True, capture_output=True)
    return subprocess.run(["gzip", "-1"], input=tar.stdout, check=True, capture_output=True).stdout


def files_through_rows(data: bytes, scan: DecodedScan) -> dict[str, bytes]:
    return {
        path.removeprefix("./"): read_row(data, scan, offset, size)
        for path, offset, size, _mode, _mtime, kind, _link, _label in scan.rows
        if kind == MemberKind.FILE
    }


def source_files(src: Path) -> dict[str, bytes]:
    return {rel: (src / rel).read_bytes() for rel in relative_files(src)}


@pytest.mark.parametrize(
    ("writer", "name"),
    [(tar_czf, "train.tar.gz"), (tar_gzip_1, "train.tar.gz"), (tar_czf, "train.tgz")],
)
def test_every_row_decodes_to_its_source_file(
    writer: object, name: str, src: Path, tmp_path: Path
) -> None:
    data = writer(src, tmp_path / name)  # type: ignore[operator]
    assert scanner_for(name) is scan_tar_gz and is_shard_name(name, "tar")
    assert compressed_suffix(name) is None
    shard = CachedReads(name, data)
    scan = scan_tar_gz(shard)
    assert isinstance(scan, DecodedScan)
    (unit,) = scan.space.units
    assert (unit.codec, unit.offset, unit.length) == (codecs.GZIP_SEEK, 0, len(data))
    assert unit.size == len(zlib.decompress(data, 31))
    points, _exported = codecs.gzip_points(unit.state)
    assert len(points) >= unit.size // codecs.GZIP_SPACING  # a point per 4 MiB at least
    assert files_through_rows(data, scan) == source_files(src)
    assert all(DECODED_BASE <= row[1] < DECODED_BASE + unit.size for row in scan.rows)
    # The whole shard went through read_cached (into the block cache at mount time), once.
    assert shard.plain_reads == 0 and set(shard.cached) == {1}


def test_a_random_read_decodes_from_the_nearest_seek_point(src: Path, tmp_path: Path) -> None:
    data = tar_czf(src, tmp_path / "s.tar.gz")
    scan = scan_tar_gz(BytesShard("s.tar.gz", data))
    (unit,) = scan.space.units
    decoded = zlib.decompress(data, 31)
    points, _ = codecs.gzip_points(unit.state)
    assert len(points) >= 3
    within = points[-2][1] + 1000  # just past a late seek point

    class Counting(io.BytesIO):
        lowest = len(data)  # the lowest raw offset read from

        def read(self, n: int | None = -1, /) -> bytes:
            Counting.lowest = min(Counting.lowest, self.tell())
            return super().read(n)

    reader = codecs.SEEKABLE[unit.codec](unit, Counting(data))
    Counting.lowest = len(data)  # opening reads the stream's header
    try:
        assert reader.read_at(within, 5000) == decoded[within : within + 5000]
        assert Counting.lowest >= points[-2][0] - 1  # from the point on, not the start
        assert reader.read_at(10, 100) == decoded[10:110]
    finally:
        reader.close()


def test_concatenated_gzip_members_are_one_stream(src: Path, tmp_path: Path) -> None:
    """``cat a.gz b.gz``: the tar's bytes split across two gzip members."""
    tar = subprocess.run(["tar", "-cf", "-", "-C", str(src), "."], check=True, capture_output=True)
    cut = len(tar.stdout) // 3
    (tmp_path / "a").write_bytes(tar.stdout[:cut])
    (tmp_path / "b").write_bytes(tar.stdout[cut:])
    subprocess.run(["gzip", "-k", str(tmp_path / "a"), str(tmp_path / "b")], check=True)
    joined = subprocess.run(
        ["cat", str(tmp_path / "a.gz"), str(tmp_path / "b.gz")], check=True, capture_output=True
    ).stdout
    scan = scan_tar_gz(BytesShard("cat.tar.gz", joined))
    assert scan.space.units[0].size == len(tar.stdout)
    assert files_through_rows(joined, scan) == source_files(src)


def small_tar_gz(*members: tuple[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, body in members:
            info = tarfile.TarInfo(name)
            info.size = len(body)
            archive.addfile(info, io.BytesIO(body))
    return buffer.getvalue()


SMALL = small_tar_gz(("a/x.jpg", os.urandom(200_000)), ("b/y.jpg", os.urandom(100_000)))


def _corrupt(data: bytes) -> bytes:
    patched = bytearray(data)
    patched[len(data) // 2 : len(data) // 2 + 64] = bytes(64)
    return bytes(patched)


def _bad_crc(data: bytes) -> bytes:
    patched = bytearray(data)
    patched[-8] ^= 0xFF
    return bytes(patched)


def _bomb() -> bytes:
    """A tar whose member is 1 GiB... of zeros: over MAX_EXPANSION times the raw bytes."""
    header = tarfile.TarInfo("zeros.bin")
    header.size = 64 << 20
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    parts = [packer.compress(header.tobuf(tarfile.GNU_FORMAT))]
    zeros = bytes(1 << 20)
    for _ in range(64):
        parts.append(packer.compress(zeros))
    parts.append(packer.compress(bytes(1024)) + packer.flush())
    return b"".join(parts)


@pytest.mark.parametrize(
    ("case", "make", "expect"),
    [
        ("cut-in-the-middle", lambda: SMALL[: len(SMALL) // 2], "truncated member data"),
        ("cut-at-a-member", None, "without its end block"),
        ("cut-trailer", lambda: SMALL[:-4], "not a valid gzip stream"),
        ("corrupt", lambda: _corrupt(SMALL), "not a valid gzip stream"),
        ("bad-crc", lambda: _bad_crc(SMALL), "not a valid gzip stream"),
        ("not-gzip", lambda: b"plain bytes, no gzip header" * 40, "not a valid gzip stream"),
        ("empty", lambda: b"", "not a valid gzip stream"),
        ("trailing-bytes", lambda: SMALL + b"junk" * 10, "not a valid gzip stream"),
        ("bomb", _bomb, "decompression bomb"),
    ],
)
def test_a_bad_gzip_stream_is_a_corrupt_shard(case: str, make: object, expect: str) -> None:
    if make is None:  # a gzip of a tar cut right after a member's data: no end block
        tar = io.BytesIO()
        with tarfile.open(fileobj=tar, mode="w") as archive:
            info = tarfile.TarInfo("a.jpg")
            info.size = 1024
            archive.addfile(info, io.BytesIO(bytes(range(256)) * 4))
        data = gzip.compress(tar.getvalue()[: 512 + 1024])
    else:
        data = make()  # type: ignore[operator]
    if case == "bomb":
        assert len(zlib.decompress(data, 31)) > MAX_EXPANSION * len(data)
    with pytest.raises(CorruptShardError) as caught:
        scan_tar_gz(BytesShard("bad.tar.gz", data))
    assert caught.value.shard == "bad.tar.gz"
    assert expect in str(caught.value), str(caught.value)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("name", ["../escape.jpg", "/etc/passwd", "a/../../b.jpg"])
def test_an_unsafe_member_name_is_refused(name: str) -> None:
    data = small_tar_gz(("ok.jpg", b"fine"), (name, b"evil"))
    with pytest.raises(UnsafeMemberError) as caught:
        scan_tar_gz(BytesShard("evil.tar.gz", data))
    assert caught.value.shard == "evil.tar.gz"


def test_a_reader_over_a_damaged_shard_raises_decode_error(src: Path, tmp_path: Path) -> None:
    """The index said the stream was good; the bytes under the reader now are not (a
    broken cache block, say): DecodeError, no library error."""
    data = tar_czf(src, tmp_path / "s.tar.gz")
    scan = scan_tar_gz(BytesShard("s.tar.gz", data))
    (unit,) = scan.space.units
    # Damage the deflate block header at a seek point past the first: its bits become
    # BTYPE 11, a reserved block type, so decoding from that point must fail. (Damage
    # inside a block's data can decode to other bytes unnoticed: a read from a seek point
    # reaches no CRC; the block cache's own checksums catch a broken block.)
    points, _ = codecs.gzip_points(unit.state)
    raw, decoded = [p for p in points if p[1] > 0][len(points) // 2 - 1]
    damaged = bytearray(data)
    damaged[raw : raw + 2] = b"\xff\xff"
    reader = codecs.SEEKABLE[unit.codec](unit, io.BytesIO(bytes(damaged)))
    try:
        with pytest.raises(codecs.DecodeError):
            reader.read_at(decoded, 4096)
    finally:
        reader.close()
    with pytest.raises(codecs.DecodeError):
        codecs.gzip_points(b"\x01")


def test_a_failing_raw_read_is_raised_as_itself() -> None:
    """A store error under the library comes out as that error, not as a gzip error."""

    class StoreDown(Exception):
        pass

    class Failing(BytesShard):
        def read_cached(self, offset: int, length: int) -> bytes:
            if offset > 1000:
                raise StoreDown("the store is down")
            return super().read_cached(offset, length)

    data = small_tar_gz(("big.jpg", os.urandom(3 << 20)))
    with pytest.raises(StoreDown):
        scan_tar_gz(Failing("x.tar.gz", data))


def test_a_files_raw_span_starts_at_its_seek_point(src: Path, tmp_path: Path) -> None:
    """Where the placement table and the order hint place a file: from the seek point at
    or before it to the one after it, inside the shard."""
    data = tar_czf(src, tmp_path / "s.tar.gz")
    scan = scan_tar_gz(BytesShard("s.tar.gz", data))
    (unit,) = scan.space.units
    points, _ = codecs.gzip_points(unit.state)
    assert [p[0] for p in points] == sorted(p[0] for p in points)
    for path, offset, size, *_ in scan.rows:
        within = offset - scan.space.starts[0]
        lo, hi = codecs.raw_span(unit, within, within + size)
        before = max(raw for raw, decoded in points if decoded <= within)
        assert lo == before and 0 <= lo < hi <= len(data), path
    assert codecs.raw_span(unit, 0, unit.size) == (points[0][0], len(data))


def test_without_rapidgzip_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(codecs, "_rapidgzip", None)
    with pytest.raises(UsageError) as caught:
        scan_tar_gz(BytesShard("x.tar.gz", SMALL))
    assert "shardfs[formats]" in str(caught.value) and "\n" not in str(caught.value)


def test_the_decoded_size_cap_refuses_a_shard(monkeypatch: pytest.MonkeyPatch) -> None:
    """``MAX_DECODED`` (64 GiB) as a smaller cap: refused as it is passed."""
    from shardfs.formats import tar_gz

    monkeypatch.setattr(tar_gz, "MAX_DECODED", 100_000)
    with pytest.raises(CorruptShardError, match="decompression bomb"):
        scan_tar_gz(BytesShard("big.tar.gz", SMALL))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, len(SMALL) - 1), st.integers(0, 255)), max_size=6))
def test_a_damaged_tar_gz_scans_or_is_a_corrupt_shard(edits: list[tuple[int, int]]) -> None:
    """Any bytes changed anywhere: the scan succeeds or raises CorruptShardError, never
    a library error; the rows of a scan that succeeds read back whole."""
    damaged = bytearray(SMALL)
    for at, value in edits:
        damaged[at] = value
    data = bytes(damaged)
    try:
        scan = scan_tar_gz(BytesShard("f.tar.gz", data))
    except CorruptShardError:
        return
    for _path, offset, size, *_ in scan.rows:
        assert len(read_row(data, scan, offset, size)) == size

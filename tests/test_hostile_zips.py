"""Hostile zip shards: the scanner returns rows that lie within the shard, or raises the
project's CorruptShardError naming the shard and an offset inside it; never another
exception, never a hang. Hand-made cases (truncations, bogus offsets and lengths, names
that climb out, unknown methods) and hypothesis (arbitrary bytes, mutated valid zips)."""

from __future__ import annotations

import io
import struct
import zipfile

import pytest
from fuzz_target import check_zip
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.decoded import read_row

from shardfs.errors import CorruptShardError, UnsafeMemberError, UnsupportedMemberError
from shardfs.formats import codecs
from shardfs.formats import zip as zipformat
from shardfs.formats.source import BytesShard
from shardfs.formats.units import DECODED_BASE, DecodedScan
from shardfs.formats.zip import scan_zip

SHARD = "data/hostile.zip"


def valid_zip() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as archive:
        archive.writestr("cat/a.jpg", b"A" * 300)
        archive.writestr("cat/a.cls", b"1")
        archive.writestr("dog/b.jpg", b"B" * 200)
    return buf.getvalue()


def central_entries(data: bytes) -> list[int]:
    """Offsets of the central directory entries."""
    found, at = [], data.find(b"PK\x01\x02")
    while at >= 0:
        found.append(at)
        at = data.find(b"PK\x01\x02", at + 1)
    return found


def patched(data: bytes, at: int, fmt: str, value: int) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, at, value)
    return bytes(out)


def deflated_zip() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("cat/a.jpg", b"A" * 3000)
        archive.writestr("cat/a.cls", b"1")
        archive.writestr("dog/b.jpg", bytes(range(256)) * 8)
    return buf.getvalue()


def data_extent(data: bytes, name: str) -> tuple[int, int]:
    """(offset, compressed size) of a member's data."""
    info = zipfile.ZipFile(io.BytesIO(data)).getinfo(name)
    name_len, extra_len = struct.unpack_from("<2H", data, info.header_offset + 26)
    return info.header_offset + 30 + name_len + extra_len, info.compress_size


def garbled(data: bytes, name: str) -> bytes:
    """The archive with a member's compressed data overwritten by an invalid deflate block."""
    at, length = data_extent(data, name)
    return data[:at] + b"\xff" * length + data[at + length :]


def named(name: str) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as archive:
        archive.writestr("ok.jpg", b"fine")
        archive.writestr(zipfile.ZipInfo(name), b"evil")
    return buf.getvalue()


def eocd(data: bytes) -> int:
    return data.rfind(b"PK\x05\x06")


GOOD = valid_zip()
FIRST, SECOND, THIRD = central_entries(GOOD)
DEFLATED = deflated_zip()
D_FIRST, D_SECOND, D_THIRD = central_entries(DEFLATED)
CASES = {
    "not a zip": b"\x89PNG\r\n\x1a\n" + bytes(100),
    "empty file": b"",
    "truncated in the directory": GOOD[: FIRST + 20],
    "truncated in the data": GOOD[:200] + GOOD[FIRST:],
    "cut after the first member": GOOD[:100],
    "local header offset beyond the shard": patched(GOOD, SECOND + 42, "<L", 10**9),
    "local header offset inside the directory": patched(GOOD, SECOND + 42, "<L", FIRST),
    "local header offset at another member's data": patched(GOOD, SECOND + 42, "<L", 40),
    "size far beyond the shard": patched(
        patched(GOOD, THIRD + 20, "<L", 2**31), THIRD + 24, "<L", 2**31
    ),
    "size into the directory": patched(patched(GOOD, THIRD + 20, "<L", 900), THIRD + 24, "<L", 900),
    "two sizes for a stored member": patched(GOOD, THIRD + 24, "<L", 10),
    "unknown method": patched(GOOD, SECOND + 10, "<H", 99),
    "directory offset beyond the shard": patched(GOOD, eocd(GOOD) + 16, "<L", 10**6),
    "directory size beyond the shard": patched(GOOD, eocd(GOOD) + 12, "<L", 10**6),
    "entry count beyond the directory": patched(GOOD, eocd(GOOD) + 10, "<H", 60000),
    "name length past the directory": patched(GOOD, THIRD + 28, "<H", 60000),
    "multi-disk archive": patched(GOOD, eocd(GOOD) + 4, "<H", 1),
    "zip64 counts without a locator": patched(GOOD, eocd(GOOD) + 10, "<H", 0xFFFF),
    "name climbing out": named("../../etc/passwd"),
    "name climbing out of a folder": named("cat/../../x.jpg"),
    "absolute name": named("/etc/passwd"),
    "NUL in a name": named("aXb.jpg").replace(b"aXb.jpg", b"a\0b.jpg"),
    # Deflated members: the declared sizes are checked while indexing.
    "deflate bomb": patched(DEFLATED, D_FIRST + 24, "<L", 2**31),
    "deflated data overlapping the next member": patched(DEFLATED, D_FIRST + 20, "<L", 200),
    "deflated data into the directory": patched(DEFLATED, D_THIRD + 20, "<L", D_FIRST - 60),
    "deflated data beyond the shard": patched(DEFLATED, D_THIRD + 20, "<L", 10**7),
    "deflated label that does not decode": garbled(DEFLATED, "cat/a.cls"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_hostile_zip_is_refused_naming_the_shard_and_an_offset(case: str) -> None:
    data = CASES[case]
    with pytest.raises(CorruptShardError) as caught:
        scan_zip(BytesShard(SHARD, data))
    error = caught.value
    assert str(error).startswith(f"{SHARD}: ") and str(error).endswith(f"at offset {error.offset}")
    assert 0 <= error.offset <= len(data)
    assert error.exit_code == 4
    if "name" in case and "length" not in case:
        assert isinstance(error, UnsafeMemberError)
    if "method" in case:
        assert isinstance(error, UnsupportedMemberError) and "unknown method" in str(error)


def test_the_valid_zip_the_cases_mutate_is_accepted() -> None:
    rows = scan_zip(BytesShard(SHARD, GOOD))
    assert {row[0]: GOOD[row[1] : row[1] + row[2]] for row in rows} == {
        "cat/a.jpg": b"A" * 300,
        "cat/a.cls": b"1",
        "dog/b.jpg": b"B" * 200,
    }


def test_the_deflated_zip_the_cases_mutate_is_accepted() -> None:
    scan = scan_zip(BytesShard(SHARD, DEFLATED))
    assert isinstance(scan, DecodedScan) and len(scan.space.units) == 3
    files = {row[0]: read_row(DEFLATED, scan, row[1], row[2]) for row in scan.rows}
    assert files == {
        "cat/a.jpg": b"A" * 3000,
        "cat/a.cls": b"1",
        "dog/b.jpg": bytes(range(256)) * 8,
    }
    assert {row[0]: row[7] for row in scan.rows}["cat/a.cls"] == 1


def test_truncated_or_corrupt_deflate_data_fails_when_the_member_is_read() -> None:
    """A deflated image's stream is decoded when it is read, not while indexing (that would
    decode every image at mount time): its declared sizes pass, its read fails with
    ``DecodeError``, which the read path reports as an I/O error of that file."""
    at, length = data_extent(DEFLATED, "cat/a.jpg")
    cut = patched(DEFLATED, D_FIRST + 20, "<L", length - 3)  # the stream ends early
    for case in (cut, garbled(DEFLATED, "cat/a.jpg")):
        scan = scan_zip(BytesShard(SHARD, case))
        assert isinstance(scan, DecodedScan)
        row = next(row for row in scan.rows if row[0] == "cat/a.jpg")
        with pytest.raises(codecs.DecodeError):
            read_row(case, scan, row[1], row[2])
    assert read_row(DEFLATED, scan_zip(BytesShard(SHARD, DEFLATED)), DECODED_BASE, 3) == b"AAA"
    assert at > 0


def test_a_zip_declaring_too_many_decoded_bytes_in_all_is_a_bomb(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(zipformat, "MAX_DECODED_TOTAL", 5000)
    with pytest.raises(CorruptShardError, match=f"declare {3000 + 1 + 2048} bytes in all"):
        scan_zip(BytesShard(SHARD, DEFLATED))


def test_a_tiny_deflated_member_may_decode_to_the_floor_but_not_past_it() -> None:
    """An empty file deflates to 2 bytes: under the 64 KiB floor any ratio is no bomb."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("empty.jpg", b"")
    (entry,) = central_entries(buf.getvalue())
    at_floor = patched(buf.getvalue(), entry + 24, "<L", zipformat.BOMB_FLOOR)
    scan = scan_zip(BytesShard(SHARD, at_floor))  # declared sizes pass (the read would fail)
    assert isinstance(scan, DecodedScan) and scan.space.units[0].length == 2
    past = patched(buf.getvalue(), entry + 24, "<L", zipformat.BOMB_FLOOR + 1)
    with pytest.raises(CorruptShardError, match="decompression bomb"):
        scan_zip(BytesShard(SHARD, past))


def seeds() -> list[bytes]:
    zip64 = io.BytesIO()
    with zipfile.ZipFile(zip64, "w") as archive:
        with archive.open("big.jpg", "w", force_zip64=True) as handle:
            handle.write(b"Z" * 100)
        archive.mkdir("folder")
    return [GOOD, zip64.getvalue(), DEFLATED]


@st.composite
def mutated_zips(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(st.sampled_from(seeds())))
    for _ in range(draw(st.integers(1, 8))):
        at = draw(st.integers(0, len(data) - 1))
        how = draw(st.sampled_from(["byte", "word", "cut", "insert"]))
        if how == "byte":
            data[at] = draw(st.integers(0, 255))
        elif how == "word" and at + 4 <= len(data):
            value = draw(st.sampled_from([0, 1, 0xFFFF, 0xFFFFFFFF, 2**31, len(data)]))
            struct.pack_into("<L", data, at, value)
        elif how == "cut":
            del data[at:]
            if not data:
                break
        else:
            data[at:at] = draw(st.binary(max_size=64))
    return bytes(data)


FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.binary(max_size=4096))
def test_arbitrary_bytes_give_rows_within_bounds_or_the_projects_error(data: bytes) -> None:
    check_zip(data)


@FUZZ
@given(mutated_zips())
def test_mutated_zips_give_rows_within_bounds_or_the_projects_error(data: bytes) -> None:
    check_zip(data)

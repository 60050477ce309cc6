"""Tests for the streaming tar parser, checked against Python's ``tarfile`` as the reference.

Archives are written at test time by GNU ``tar`` and by ``tarfile`` in every format, and the
odd cases (base-256 sizes, broken pax records, old sparse headers) are built block by block.
"""

from __future__ import annotations

import io
import math
import os
import shutil
import subprocess
import tarfile
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path

import pytest

from shardfs.errors import CorruptShardError
from shardfs.formats.tar import MemberKind, TarMember, iter_members

SHARD = "s3://bucket/shard-000000.tar"
UNICODE_NAME = "data/κατηγορία/ünïcödé_文件_0001.jpg"
# >100 bytes in total but splittable into a ustar prefix and name.
MEDIUM_NAME = "data/" + "m" * 70 + "/" + "n" * 60 + ".txt"
# >255 bytes in total with a single component >100 bytes: needs GNU 'L' or pax 'path'.
LONG_NAME = "data/" + "/".join(["p" * 80] * 3) + "/" + "q" * 120 + ".bin"
MTIME = 1_700_000_000


def parse(
    data: bytes, capture: Callable[[TarMember], bool] | None = None
) -> list[tuple[TarMember, bytes | None]]:
    return list(iter_members(io.BytesIO(data), SHARD, capture=capture))


def members(data: bytes) -> list[TarMember]:
    return [member for member, _ in parse(data)]


def normalised(member: TarMember) -> str:
    """tarfile strips the trailing slash of directories; we keep names as stored."""
    return member.path.rstrip("/") if member.kind is MemberKind.DIRECTORY else member.path


# --- archives made by real tools -------------------------------------------------------------


def make_tree(root: Path, *, medium: bool, long: bool) -> list[str]:
    """Write the source tree and return the member names every archive of it must hold."""
    files: dict[str, bytes] = {
        "data/short.txt": b"hello\n",
        "data/empty.bin": b"",
        "data/block512.bin": bytes(range(256)) * 2,
        "data/block1536.bin": os.urandom(1536),
        "data/odd.bin": os.urandom(1000),
        "data/KEY.cls": b"7\n",
        UNICODE_NAME: b"\xff\xd8\xff\xe0 not really a jpeg",
    }
    if medium:
        files[MEDIUM_NAME] = b"medium\n"
    if long:
        files[LONG_NAME] = os.urandom(700)
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
    (root / "data/dir_only").mkdir()
    os.symlink("short.txt", root / "data/link_to_short")
    os.link(root / "data/short.txt", root / "data/hard_short")
    names = [*files, "data/dir_only", "data/link_to_short", "data/hard_short"]
    if long:
        os.symlink(LONG_NAME, root / "data/long_target_link")
        names.append("data/long_target_link")
    for dirpath, dirnames, filenames in os.walk(root):
        for entry in [*dirnames, *filenames]:
            os.utime(Path(dirpath, entry), (MTIME, MTIME), follow_symlinks=False)
    os.utime(root / "data/short.txt", ns=(MTIME * 10**9 + 250_000_000,) * 2)
    return names


def gnu_tar(fmt: str, *extra: str) -> Callable[[Path, Path], None]:
    def build(src: Path, out: Path) -> None:
        if shutil.which("tar") is None:
            pytest.skip("GNU tar is not installed")
        subprocess.run(
            [
                "tar",
                f"--format={fmt}",
                *extra,
                "--sort=name",
                "--owner=0",
                "--group=0",
                "--numeric-owner",
                "-cf",
                str(out),
                "-C",
                str(src),
                "data",
            ],
            check=True,
            capture_output=True,
        )

    return build


def py_tar(fmt: int, **options: object) -> Callable[[Path, Path], None]:
    def build(src: Path, out: Path) -> None:
        with tarfile.open(out, "w", format=fmt, **options) as archive:  # type: ignore[call-overload]
            archive.add(src / "data", arcname="data")
            info = tarfile.TarInfo("data/added_by_hand.txt")
            info.size = 3
            info.mtime = MTIME + 0.999 if fmt == tarfile.PAX_FORMAT else MTIME
            info.mode = 0o4755
            archive.addfile(info, io.BytesIO(b"abc"))

    return build


# id -> (builder, ustar-style names allowed, long names allowed)
ARCHIVES: dict[str, tuple[Callable[[Path, Path], None], bool, bool]] = {
    "gnutar-gnu": (gnu_tar("gnu"), True, True),
    "gnutar-pax": (gnu_tar("pax"), True, True),
    "gnutar-ustar": (gnu_tar("ustar"), True, False),
    "gnutar-v7": (gnu_tar("v7"), False, False),
    "py-gnu": (py_tar(tarfile.GNU_FORMAT), True, True),
    "py-pax": (py_tar(tarfile.PAX_FORMAT), True, True),
    "py-pax-global": (
        py_tar(tarfile.PAX_FORMAT, pax_headers={"comment": "global ☃"}),
        True,
        True,
    ),
    "py-ustar": (py_tar(tarfile.USTAR_FORMAT), True, False),
}


@pytest.fixture(params=sorted(ARCHIVES))
def archive(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[bytes, list[str]]:
    build, medium, long = ARCHIVES[request.param]
    names = make_tree(tmp_path / "src", medium=medium, long=long)
    out = tmp_path / "out.tar"
    build(tmp_path / "src", out)
    return out.read_bytes(), names


def expected_kind(info: tarfile.TarInfo) -> MemberKind:
    if info.sparse is not None:
        return MemberKind.OTHER
    if info.type in (tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.CONTTYPE):
        return MemberKind.FILE
    return {
        tarfile.DIRTYPE: MemberKind.DIRECTORY,
        tarfile.SYMTYPE: MemberKind.SYMLINK,
        tarfile.LNKTYPE: MemberKind.HARDLINK,
    }.get(info.type, MemberKind.OTHER)


def expected_mtime(info: tarfile.TarInfo) -> int:
    if "mtime" in info.pax_headers:  # exact, where the float in info.mtime may round up
        return math.floor(Decimal(info.pax_headers["mtime"]))
    return math.floor(info.mtime)


def assert_matches_tarfile(data: bytes) -> list[TarMember]:
    """Every field of every member agrees with tarfile, and data_offset points at the data."""
    ours = members(data)
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        infos = archive.getmembers()
        assert len(ours) == len(infos)
        for member, info in zip(ours, infos, strict=True):
            assert normalised(member) == (info.name.rstrip("/") if info.isdir() else info.name)
            assert member.kind is expected_kind(info), member.path
            assert member.header_offset == info.offset, member.path
            assert member.mode == info.mode & 0o7777, member.path
            assert member.mtime == expected_mtime(info), member.path
            assert member.linkname == (info.linkname if info.issym() or info.islnk() else "")
            if info.sparse is not None:
                continue  # tarfile reports the expanded file; we only skip the stored bytes
            assert member.data_offset == info.offset_data, member.path
            assert member.size == info.size, member.path
            if member.kind is MemberKind.FILE:
                extracted = archive.extractfile(info)
                assert extracted is not None
                content = data[member.data_offset : member.data_offset + member.size]
                assert content == extracted.read(), member.path
    return ours


def test_members_match_tarfile(archive: tuple[bytes, list[str]]) -> None:
    data, names = archive
    ours = assert_matches_tarfile(data)
    assert set(names) <= {normalised(member) for member in ours}
    by_name = {normalised(member): member for member in ours}
    assert by_name["data/empty.bin"].size == 0
    assert by_name["data/block512.bin"].size == 512
    assert by_name["data/dir_only"].kind is MemberKind.DIRECTORY
    assert by_name["data/link_to_short"].kind is MemberKind.SYMLINK
    assert by_name["data/link_to_short"].linkname == "short.txt"
    # Whichever of the two hard-linked names comes first holds the data.
    pair = [by_name["data/hard_short"], by_name["data/short.txt"]]
    pair.sort(key=lambda member: member.header_offset)
    assert pair[0].kind is MemberKind.FILE
    assert (pair[1].kind, pair[1].linkname) == (MemberKind.HARDLINK, pair[0].path)
    if "data/long_target_link" in by_name:
        assert by_name["data/long_target_link"].linkname == LONG_NAME


def test_every_offset_is_block_aligned(archive: tuple[bytes, list[str]]) -> None:
    for member in members(archive[0]):
        assert member.header_offset % 512 == 0
        assert member.data_offset % 512 == 0
        assert member.data_offset > member.header_offset


class ShortReader:
    """A network-like stream: never more than a few bytes per read."""

    def __init__(self, data: bytes, most: int = 7) -> None:
        self._inner = io.BytesIO(data)
        self._most = most
        self.calls = 0

    def read(self, n: int = -1) -> bytes:
        self.calls += 1
        return self._inner.read(min(n, self._most) if n >= 0 else self._most)


def test_short_reads_give_the_same_members(archive: tuple[bytes, list[str]]) -> None:
    data = archive[0]
    stream = ShortReader(data)
    short = list(iter_members(stream, SHARD, capture=lambda m: m.kind is MemberKind.FILE))  # type: ignore[arg-type]
    assert short == parse(data, capture=lambda m: m.kind is MemberKind.FILE)
    assert stream.calls > len(data) // 7 // 2  # the short reads really happened


def test_capture_returns_content_only_for_selected_members(
    archive: tuple[bytes, list[str]],
) -> None:
    data = archive[0]
    seen: list[str] = []

    def wanted(member: TarMember) -> bool:
        seen.append(member.path)
        return member.path.endswith((".cls", ".jpg"))

    results = parse(data, capture=wanted)
    assert seen == [member.path for member, _ in results]
    captured = {member.path: content for member, content in results if content is not None}
    assert captured["data/KEY.cls"] == b"7\n"
    assert captured[UNICODE_NAME] == b"\xff\xd8\xff\xe0 not really a jpeg"
    assert len(captured) == 2
    for member, content in results:
        if member.path.endswith((".cls", ".jpg")):
            assert content == data[member.data_offset : member.data_offset + member.size]
        else:
            assert content is None


def test_no_end_marker_and_trailing_garbage(archive: tuple[bytes, list[str]]) -> None:
    data = archive[0]
    ours = members(data)
    last = ours[-1]
    end = last.data_offset + last.size + (-last.size % 512)
    assert members(data[:end]) == ours  # EOF at a block boundary is a clean end
    assert members(data + b"\xffgarbage" * 1000) == ours  # nothing after the marker is read


# --- archives built block by block ------------------------------------------------------------


def header(
    name: bytes,
    *,
    size: int = 0,
    typeflag: bytes = b"0",
    mode: int = 0o644,
    mtime: int = MTIME,
    linkname: bytes = b"",
    magic: bytes = b"ustar\x0000",
    size_field: bytes | None = None,
    mtime_field: bytes | None = None,
    extra: dict[int, bytes] | None = None,
) -> bytes:
    block = bytearray(512)
    block[0 : len(name)] = name
    block[100:108] = b"%07o\0" % mode
    block[108:124] = b"0000000\0" * 2
    block[124:136] = size_field if size_field is not None else b"%011o\0" % size
    block[136:148] = mtime_field if mtime_field is not None else b"%011o\0" % mtime
    block[156:157] = typeflag
    block[157 : 157 + len(linkname)] = linkname
    block[257 : 257 + len(magic)] = magic
    for offset, value in (extra or {}).items():
        block[offset : offset + len(value)] = value
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\0 " % sum(block)
    return bytes(block)


def padded(data: bytes) -> bytes:
    return data + bytes(-len(data) % 512)


def pax_record(key: str, value: str) -> bytes:
    body = f" {key}={value}\n".encode()
    length = len(body) + 1
    while len(str(length)) + len(body) != length:
        length += 1
    return str(length).encode() + body


def pax_member(records: bytes, name: bytes, content: bytes, **fields: object) -> bytes:
    return (
        header(b"PaxHeaders/x", size=len(records), typeflag=b"x")
        + padded(records)
        + header(name, size=len(content), **fields)  # type: ignore[arg-type]
        + padded(content)
    )


END = bytes(1024)


def test_pax_overrides_path_size_and_floors_mtime() -> None:
    records = (
        pax_record("path", "κατηγορία/" + "x" * 300)
        + pax_record("size", "5")
        + pax_record("mtime", "-1.5")
        + pax_record("comment", "a = b\nc")
    )
    data = pax_member(records, b"truncated-name", b"12345", size_field=b"%011o\0" % 999) + END
    (member,) = assert_matches_tarfile(data)
    assert member.path == "κατηγορία/" + "x" * 300
    assert member.size == 5
    assert member.mtime == -2
    assert member.header_offset == 0
    assert member.data_offset == 1024 + len(padded(records))


def test_pax_fractional_mtime_is_floored_exactly() -> None:
    records = pax_record("mtime", "1700000000.9999999999")
    (member,) = members(pax_member(records, b"f", b"") + END)
    assert member.mtime == 1_700_000_000


def test_pax_global_header_is_skipped() -> None:
    records = pax_record("comment", "global") + pax_record("path", "ignored")
    data = (
        header(b"global", size=len(records), typeflag=b"g")
        + padded(records)
        + header(b"file.txt", size=3)
        + padded(b"abc")
        + END
    )
    # Not compared with tarfile: it applies a global 'path' to the next member.
    (member,) = members(data)
    assert (member.path, member.header_offset, member.data_offset) == ("file.txt", 1024, 1536)


def test_base256_size_over_8_gib_parses() -> None:
    size = 9 * 2**30 + 123
    block = header(
        b"huge.bin",
        size_field=b"\x80" + size.to_bytes(11, "big"),
        mtime_field=b"\xff" * 12,  # base-256 -1: a negative timestamp
        magic=b"ustar  \0",
    )
    reference = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
    assert (reference.size, reference.mtime) == (size, -1)

    seen: list[TarMember] = []

    def record(member: TarMember) -> bool:
        seen.append(member)
        return False

    with pytest.raises(CorruptShardError) as excinfo:
        parse(block, capture=record)
    assert excinfo.value.reason == "truncated member data"
    assert excinfo.value.offset == 512
    assert excinfo.value.shard == SHARD
    (member,) = seen
    assert (member.size, member.mtime, member.data_offset) == (size, -1, 512)


class ZeroBackedStream:
    """Bytes, then a long run of zeros produced on demand, then more bytes."""

    def __init__(self, head: bytes, zeros: int, tail: bytes) -> None:
        self._parts: list[bytes | int] = [head, zeros, tail]
        self._chunk = bytes(4 * 1024 * 1024)

    def read(self, n: int) -> bytes:
        while self._parts:
            part = self._parts[0]
            if isinstance(part, int):
                if part == 0:
                    self._parts.pop(0)
                    continue
                take = min(n, part)
                self._parts[0] = part - take
                return self._chunk if take == len(self._chunk) else bytes(take)
            if not part:
                self._parts.pop(0)
                continue
            self._parts[0] = part[n:]
            return part[:n]
        return b""


def test_base256_member_is_skipped_and_the_next_one_found() -> None:
    size = 8 * 2**30 + 1
    head = header(b"huge.bin", size_field=b"\x80" + size.to_bytes(11, "big"), magic=b"ustar  \0")
    tail = header(b"after.txt", size=2) + padded(b"ok") + END
    stream = ZeroBackedStream(head, size + (-size % 512), tail)
    results = list(iter_members(stream, SHARD, capture=lambda m: m.path == "after.txt"))  # type: ignore[arg-type]
    assert [(m.path, m.size, m.data_offset) for m, _ in results] == [
        ("huge.bin", size, 512),
        ("after.txt", 2, 512 + size + (-size % 512) + 512),
    ]
    assert results[1][1] == b"ok"


def test_old_style_directory_and_other_kinds() -> None:
    data = (
        header(b"olddir/", typeflag=b"\0", magic=b"")
        + header(b"olddir/file", typeflag=b"\0", size=4, magic=b"")
        + padded(b"data")
        + header(b"contig", typeflag=b"7", size=1)
        + padded(b"c")
        + header(b"fifo", typeflag=b"6")
        + header(b"chardev", typeflag=b"3")
        + header(b"unknown", typeflag=b"Z", size=600)
        + padded(b"z" * 600)
        + header(b"last", size=0)
        + END
    )
    ours = assert_matches_tarfile(data)
    assert [(m.path, m.kind) for m in ours] == [
        ("olddir/", MemberKind.DIRECTORY),
        ("olddir/file", MemberKind.FILE),
        ("contig", MemberKind.FILE),
        ("fifo", MemberKind.OTHER),
        ("chardev", MemberKind.OTHER),
        ("unknown", MemberKind.OTHER),
        ("last", MemberKind.FILE),
    ]


def test_ustar_prefix_is_joined_only_for_posix_magic() -> None:
    prefix = {345: b"some/prefix"}
    data = (
        header(b"name", extra=prefix)
        + header(b"gnu", magic=b"ustar  \0", extra={345: b"\x00" * 12})
        + END
    )
    assert [m.path for m in members(data)] == ["some/prefix/name", "gnu"]


def test_old_gnu_sparse_with_extension_block() -> None:
    def number(value: int) -> bytes:
        return b"%011o\0" % value

    sparse_map = b"".join(number(i * 4096) + number(100) for i in range(4))
    sparse = header(
        b"sparse.bin",
        typeflag=b"S",
        size=512,
        magic=b"ustar  \0",
        extra={386: sparse_map, 482: b"\x01", 483: number(8 * 4096)},
    )
    extension = bytearray(512)
    extension[0:24] = number(5 * 4096) + number(112)
    data = (
        sparse
        + bytes(extension)
        + padded(b"s" * 512)
        + header(b"after.txt", size=2)
        + padded(b"ok")
        + END
    )
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        infos = archive.getmembers()
    ours = members(data)
    assert [m.kind for m in ours] == [MemberKind.OTHER, MemberKind.FILE]
    assert (ours[0].header_offset, ours[0].data_offset, ours[0].size) == (0, 1024, 512)
    assert (ours[1].header_offset, ours[1].data_offset) == (infos[1].offset, infos[1].offset_data)


def test_gnu_tar_sparse_files(tmp_path: Path) -> None:
    if shutil.which("tar") is None:
        pytest.skip("GNU tar is not installed")
    src = tmp_path / "src"
    src.mkdir()
    with open(src / "holes.bin", "wb") as out:
        for i in range(8):  # more fragments than an old GNU header holds
            out.seek(i * 1024 * 1024)
            out.write(b"x" * 100)
    (src / "after.txt").write_bytes(b"after")
    for fmt in ("gnu", "pax"):
        out_path = tmp_path / f"{fmt}.tar"
        subprocess.run(
            [
                "tar",
                f"--format={fmt}",
                "--sparse",
                "-cf",
                str(out_path),
                "-C",
                str(src),
                "holes.bin",
                "after.txt",
            ],
            check=True,
            capture_output=True,
        )
        ours = assert_matches_tarfile(out_path.read_bytes())
        assert [normalised(m) for m in ours] == ["holes.bin", "after.txt"]


# --- errors -----------------------------------------------------------------------------------


def sample(tmp_path: Path) -> bytes:
    out = tmp_path / "sample.tar"
    with tarfile.open(out, "w", format=tarfile.USTAR_FORMAT) as archive:
        for name, size in (("a.bin", 2000), ("b.bin", 10), ("c.bin", 0)):
            info = tarfile.TarInfo(name)
            info.size = size
            archive.addfile(info, io.BytesIO(b"\x01" * size))
    return out.read_bytes()


def raises(data: bytes) -> CorruptShardError:
    with pytest.raises(CorruptShardError) as excinfo:
        parse(data)
    assert excinfo.value.shard == SHARD
    return excinfo.value


def test_truncated_inside_data(tmp_path: Path) -> None:
    data = sample(tmp_path)
    first = members(data)[0]
    error = raises(data[: first.data_offset + 100])
    assert (error.reason, error.offset) == ("truncated member data", first.data_offset + 100)
    assert str(error) == f"{SHARD}: truncated member data at offset {first.data_offset + 100}"


def test_truncated_inside_padding(tmp_path: Path) -> None:
    data = sample(tmp_path)
    first = members(data)[0]
    cut = first.data_offset + first.size + 10
    error = raises(data[:cut])
    assert (error.reason, error.offset) == ("truncated member data", cut)


def test_truncated_inside_a_header(tmp_path: Path) -> None:
    data = sample(tmp_path)
    second = members(data)[1]
    error = raises(data[: second.header_offset + 100])
    assert (error.reason, error.offset) == ("truncated header", second.header_offset)


def test_truncated_member_is_not_yielded(tmp_path: Path) -> None:
    data = sample(tmp_path)
    first = members(data)[0]
    iterator = iter_members(io.BytesIO(data[: first.data_offset + 1]), SHARD)
    with pytest.raises(CorruptShardError):
        next(iterator)


@pytest.mark.parametrize("position", [0, 99, 100, 124, 147, 156, 257, 345, 511])
def test_flipped_byte_is_a_checksum_error(tmp_path: Path, position: int) -> None:
    data = bytearray(sample(tmp_path))
    second = members(bytes(data))[1]
    data[second.header_offset + position] ^= 0x04
    error = raises(bytes(data))
    assert (error.reason, error.offset) == ("header checksum mismatch", second.header_offset)


def test_flipped_checksum_field(tmp_path: Path) -> None:
    data = bytearray(sample(tmp_path))
    second = members(bytes(data))[1]
    data[second.header_offset + 150] ^= 0x01  # still an octal digit, now the wrong one
    error = raises(bytes(data))
    assert (error.reason, error.offset) == ("header checksum mismatch", second.header_offset)


def test_signed_checksum_is_accepted() -> None:
    block = bytearray(header(b"caf\xe9"))
    block[148:156] = b" " * 8
    signed = sum(b - 256 if b >= 128 else b for b in block)
    block[148:156] = b"%06o\0 " % signed
    (member,) = members(bytes(block) + END)
    assert member.path == "caf\udce9"  # undecodable bytes survive via surrogateescape


@pytest.mark.parametrize(
    "records",
    [
        b"garbage\n",
        b"30 path=short\n",
        b"12 pathnoeq\n",
        b"x1 path=a\n",
        b"10 path=a\0",
        b"0 path=\n",
        pax_record("size", "12x"),
        pax_record("mtime", "soon"),
    ],
)
def test_garbage_pax_record(records: bytes) -> None:
    data = header(b"first", size=3) + padded(b"abc") + pax_member(records, b"f", b"") + END
    error = raises(data)
    assert (error.reason, error.offset) == ("malformed pax header", 1024)


@pytest.mark.parametrize(
    ("field", "value"),
    [("size", b"0000000009z\0"), ("size", b"00000000089\0"), ("mtime", b"\x81" + bytes(11))],
)
def test_invalid_number(field: str, value: bytes) -> None:
    kwargs = {"size_field": value} if field == "size" else {"mtime_field": value}
    data = header(b"first") + header(b"bad", **kwargs) + END  # type: ignore[arg-type]
    error = raises(data)
    assert (error.reason, error.offset) == (f"invalid number in header field {field}", 512)


def test_extension_header_without_member() -> None:
    records = pax_record("path", "orphan")
    data = header(b"x", size=len(records), typeflag=b"x") + padded(records) + END
    error = raises(data)
    assert error.offset == 1024


# --- hostile numbers (issue 9) ----------------------------------------------------------------

INT64_MAX = 2**63 - 1


@pytest.mark.parametrize(
    ("field", "expected"),
    [
        (b"\x80" + (2**63).to_bytes(11, "big"), INT64_MAX),
        (b"\x80" + b"\xff" * 11, INT64_MAX),
        (b"\xff" + (-(2**80)).to_bytes(11, "big", signed=True), -(2**63)),
        (b"\x80" + (2**63 - 1).to_bytes(11, "big"), INT64_MAX),
    ],
)
def test_base256_mtime_beyond_int64_is_clamped(field: bytes, expected: int) -> None:
    (member,) = members(header(b"f", mtime_field=field) + END)
    assert member.mtime == expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (str(2**63), INT64_MAX),
        ("9" * 5000, INT64_MAX),  # int() of this would raise: more than 4,300 digits
        ("-" + "9" * 5000 + ".5", -(2**63)),
        ("0" * 5000 + "17.25", 17),  # leading zeros do not count
        (str(-(2**63)), -(2**63)),
    ],
)
def test_pax_mtime_beyond_int64_is_clamped(value: str, expected: int) -> None:
    (member,) = members(pax_member(pax_record("mtime", value), b"f", b"") + END)
    assert member.mtime == expected


@pytest.mark.parametrize("value", ["9" * 5000, str(2**63), "1" + "0" * 19])
def test_pax_size_beyond_int64_is_refused(value: str) -> None:
    data = (
        header(b"first", size=3) + padded(b"abc") + pax_member(pax_record("size", value), b"f", b"")
    )
    error = raises(data + END)
    assert (error.reason, error.offset, error.shard) == ("pax size too large", 1024, SHARD)


def test_pax_size_with_thousands_of_leading_zeros_parses() -> None:
    data = pax_member(pax_record("size", "0" * 5000 + "3"), b"f", b"abc") + END
    (member,) = members(data)
    assert member.size == 3


def test_base256_size_beyond_int64_is_refused() -> None:
    field = b"\x80" + (2**63).to_bytes(11, "big")
    error = raises(header(b"first") + header(b"huge", size_field=field) + END)
    assert (error.reason, error.offset) == ("invalid number in header field size", 512)


@pytest.mark.parametrize("mtime", [2.225073858507203e-309, 1e-05, 1.5e16, -2.5e-7])
def test_pax_mtime_in_exponent_notation_as_tarfile_writes_it(mtime: float) -> None:
    """tarfile writes a float mtime as ``str(mtime)``, which may carry an exponent."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("f")
        info.mtime = mtime
        tar.addfile(info)
    with tarfile.open(fileobj=io.BytesIO(buf.getvalue())) as tar:
        assert "e" in tar.getmember("f").pax_headers["mtime"]
    (member,) = members(buf.getvalue())
    assert member.mtime == math.floor(Decimal(repr(mtime)))


@pytest.mark.parametrize(
    ("value", "expected"), [("1e999999999", INT64_MAX), ("-1e-999999999", -1), (".5", 0)]
)
def test_pax_mtime_exponents_are_bounded(value: str, expected: int) -> None:
    (member,) = members(pax_member(pax_record("mtime", value), b"f", b"") + END)
    assert member.mtime == expected


@pytest.mark.parametrize("value", ["inf", "nan", "1e", "1e1234567890", "- 1", "0x10", "1_0"])
def test_pax_mtime_that_is_not_a_decimal_is_refused(value: str) -> None:
    error = raises(pax_member(pax_record("mtime", value), b"f", b"") + END)
    assert (error.reason, error.offset) == ("malformed pax header", 0)

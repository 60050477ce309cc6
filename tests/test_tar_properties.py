"""Property tests of the tar parser and the index's name and label rules (issue 9).

(a) Any bytes, and any mutation of a real archive, make the parser yield members or raise
a ShardfsError, nothing else. (b) Parsing stays fast and its memory is bounded by its input.
(c) Archives that ``tarfile`` writes in every format parse to exactly what ``tarfile`` lists.
"""

from __future__ import annotations

import contextlib
import io
import tarfile
import time
import tracemalloc

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from shardfs.errors import ShardfsError, UnsafeMemberError
from shardfs.formats.members import normalize_member_path, parse_label
from shardfs.formats.tar import MemberKind, iter_members

SHARD = "prop.tar"
COMMON = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def parse_all(data: bytes) -> list[tuple[object, bytes | None]]:
    """Parse ``data`` as the scan does (small label files captured); a ShardfsError is an
    accepted outcome, and the name and label rules are applied to every member."""
    found: list[tuple[object, bytes | None]] = []
    try:
        for member, content in iter_members(io.BytesIO(data), SHARD, capture=lambda m: True):
            found.append((member, content))
            with contextlib.suppress(UnsafeMemberError):
                normalize_member_path(member.path, SHARD, member.header_offset)
            if content is not None:
                parse_label("json", content)
                parse_label("cls", content)
    except ShardfsError:
        pass
    return found


# --- archives tarfile writes ------------------------------------------------------------------

component = st.text(alphabet=st.sampled_from("abcXYZ019_-. éü文κ"), min_size=1, max_size=40).filter(
    lambda c: c not in (".", "..")
)
names = st.lists(component, min_size=1, max_size=8).map("/".join)
formats = st.sampled_from([tarfile.GNU_FORMAT, tarfile.PAX_FORMAT, tarfile.USTAR_FORMAT])


@st.composite
def archives(draw: st.DrawFn) -> tuple[bytes, int]:
    """A tar written by tarfile: files of any size, folders, symlinks, hard links to
    earlier files, long names, big and fractional mtimes, extra pax records."""
    fmt = draw(formats)
    buf = io.BytesIO()
    written: list[str] = []
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for _ in range(draw(st.integers(1, 8))):
            name = draw(names)
            kind = draw(st.sampled_from("ffffdsh"))
            info = tarfile.TarInfo(name)
            info.mtime = draw(st.integers(0, 8**11 - 1))
            if fmt == tarfile.PAX_FORMAT:
                info.mtime = draw(st.one_of(st.integers(-(2**40), 2**40), st.floats(0, 2**34)))
                info.pax_headers = draw(
                    st.dictionaries(st.sampled_from(["comment", "x.note"]), component, max_size=2)
                )
            data = b""
            if kind == "f":
                data = draw(st.binary(max_size=2000))
                info.size = len(data)
            elif kind == "d":
                info.type = tarfile.DIRTYPE
            elif kind == "s":
                info.type = tarfile.SYMTYPE
                info.linkname = draw(names)
            elif written:
                info.type = tarfile.LNKTYPE
                info.linkname = draw(st.sampled_from(written))
            else:
                continue
            try:
                tar.addfile(info, io.BytesIO(data))
            except ValueError:  # too long for ustar
                continue
            if kind == "f":
                written.append(name)
    return buf.getvalue(), fmt


def expected_kind(info: tarfile.TarInfo) -> MemberKind:
    if info.isreg():
        return MemberKind.FILE
    if info.isdir():
        return MemberKind.DIRECTORY
    if info.issym():
        return MemberKind.SYMLINK
    return MemberKind.HARDLINK if info.islnk() else MemberKind.OTHER


@COMMON
@given(archives())
def test_tarfile_archives_parse_to_what_tarfile_lists(case: tuple[bytes, int]) -> None:
    data, _fmt = case
    ours = [member for member, _ in iter_members(io.BytesIO(data), SHARD)]
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        infos = tar.getmembers()
    assert len(ours) == len(infos)
    for member, info in zip(ours, infos, strict=True):
        kind = expected_kind(info)
        path = member.path.rstrip("/") if kind is MemberKind.DIRECTORY else member.path
        assert (path, member.kind) == (info.name, kind)
        assert (member.header_offset, member.data_offset) == (info.offset, info.offset_data)
        assert member.size == info.size
        assert member.linkname == (info.linkname if info.issym() or info.islnk() else "")


# --- hostile input ----------------------------------------------------------------------------


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """A real archive with bytes overwritten (header checksums optionally fixed so the
    parser reads on), maybe cut short."""
    data = bytearray(draw(archives())[0])
    for _ in range(draw(st.integers(1, 6))):
        at = draw(st.integers(0, len(data) - 1))
        chunk = draw(st.binary(min_size=1, max_size=12))
        data[at : at + len(chunk)] = chunk
        if draw(st.booleans()):
            block = at - at % 512
            header = data[block : block + 512]
            header[148:156] = b" " * 8
            data[block + 148 : block + 156] = b"%06o\0 " % sum(header)
    if draw(st.booleans()):
        data = data[: draw(st.integers(0, len(data)))]
    return bytes(data)


@COMMON
@given(st.binary(max_size=4096))
def test_any_bytes_raise_only_shardfs_errors(data: bytes) -> None:
    parse_all(data)


@COMMON
@given(mutated())
def test_mutated_archives_raise_only_shardfs_errors(data: bytes) -> None:
    parse_all(data)


@COMMON
@given(
    st.one_of(
        mutated(),
        st.binary(max_size=64 << 10),
        st.builds(lambda n, c: c * n, st.integers(1, 4000), st.sampled_from([b"[", b"9", b"\xff"])),
    )
)
def test_parsing_is_fast_and_memory_is_bounded_by_the_input(data: bytes) -> None:
    assume(len(data) <= 64 << 10)
    tracemalloc.start()
    try:
        start = time.perf_counter()
        parse_all(data)
        parse_label("json", data)
        parse_label("cls", data)
        elapsed = time.perf_counter() - start
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert elapsed < 2.0  # generous: a few milliseconds on a quiet machine
    assert peak < 16 * len(data) + (512 << 10)

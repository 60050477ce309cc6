"""Streaming tar header parser.

The index builder walks every shard once, front to back, over a network stream, so this
parser reads strictly sequentially and never seeks. It records where each member's data
lives; serving a member is then a ranged read of ``(data_offset, size)``.

``tarfile`` is not used: it wants a seekable file, builds a heavier object per member and
hides the offsets we need behind private attributes.

Shards are untrusted input, so the parser raises nothing but ``CorruptShardError``:
numbers are bounded before they are converted (a size must fit a signed 64-bit integer, a
pax number may have at most ``_MAX_PAX_DIGITS`` significant digits, and an mtime outside
the signed 64-bit range is clamped into it, since a timestamp is only shown). Names are
decoded with ``surrogateescape`` and never refused here; what may be presented as a path
is the index's decision (``shardfs.formats.members.normalize_member_path``).
"""

from __future__ import annotations

import dataclasses
import decimal
import enum
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from shardfs.errors import CorruptShardError

from ..store.shards import Readable

__all__ = ["MemberKind", "TarMember", "iter_members"]

BLOCK_SIZE = 512
_ZERO_BLOCK = bytes(BLOCK_SIZE)
# Skipped data is read and dropped in chunks this large: few calls, bounded memory.
_SKIP_CHUNK = 4 * 1024 * 1024
# A pax or GNU long-name header larger than this is corruption, not a name.
_MAX_EXTENSION_SIZE = 16 * 1024 * 1024
# Sizes and offsets are stored as SQLite integers (signed 64-bit); mtimes are clamped into it.
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
# Significant digits allowed in a pax number: enough for any signed 64-bit value, and far
# below the size at which int() of a decimal string becomes slow (or refuses: 4,300 digits).
_MAX_PAX_DIGITS = 19
# A pax time: a decimal with optional fraction and exponent (no "inf", "nan" or spaces).
_PAX_TIME = re.compile(rb"-?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]{1,9})?")
# Bytes with the high bit set, for the signed-checksum fallback.
_HIGH_BYTES = bytes(range(0x80, 0x100))
_USTAR_MAGIC = b"ustar\x00"


class MemberKind(enum.IntEnum):
    """What a member is; everything the filesystem cannot serve is ``OTHER``."""

    FILE = 0
    DIRECTORY = 1
    SYMLINK = 2
    HARDLINK = 3
    OTHER = 4


@dataclass(frozen=True, slots=True)
class TarMember:
    """One member as stored: its name, where its headers and data start, and its metadata."""

    path: str
    header_offset: int
    data_offset: int
    size: int
    mode: int
    mtime: int
    kind: MemberKind
    linkname: str
    # For a member of an inner tar: the outer member's path without ``.tar``, the folder it
    # is presented in (``path`` and a hard link's ``linkname`` are relative to it).
    folder: str = ""


_KINDS: dict[int, MemberKind] = {
    0: MemberKind.FILE,  # '\0', old regular file
    ord("0"): MemberKind.FILE,
    ord("7"): MemberKind.FILE,  # contiguous file: a regular file everywhere we care about
    ord("1"): MemberKind.HARDLINK,
    ord("2"): MemberKind.SYMLINK,
    ord("5"): MemberKind.DIRECTORY,
    ord("D"): MemberKind.DIRECTORY,  # GNU dumpdir: a directory whose data lists its entries
}
_OLD_REGULAR = (0, ord("0"))
_GNU_LONGNAME = ord("L")
_GNU_LONGLINK = ord("K")
_PAX_LOCAL = (ord("x"), ord("X"))  # 'X' is Solaris' name for the same thing
_PAX_GLOBAL = ord("g")
_GNU_SPARSE = ord("S")
_EXTENSIONS = frozenset((_GNU_LONGNAME, _GNU_LONGLINK, *_PAX_LOCAL))


class _Reader:
    """Sequential reads that survive short reads and keep the absolute offset."""

    __slots__ = ("_stream", "pos")

    def __init__(self, stream: Readable) -> None:
        self._stream = stream
        self.pos = 0

    def read(self, n: int) -> bytes:
        """Read exactly ``n`` bytes, or fewer only at end of stream."""
        data = self._stream.read(n)
        if len(data) == n or not data:
            self.pos += len(data)
            return data
        parts = [data]
        got = len(data)
        while got < n:
            chunk = self._stream.read(n - got)
            if not chunk:
                break
            parts.append(chunk)
            got += len(chunk)
        self.pos += got
        return b"".join(parts)

    def skip(self, n: int) -> bool:
        """Drop ``n`` bytes; False if the stream ended first."""
        stream = self._stream
        while n > 0:
            chunk = stream.read(n if n < _SKIP_CHUNK else _SKIP_CHUNK)
            if not chunk:
                return False
            self.pos += len(chunk)
            n -= len(chunk)
        return True


def _cstr(field: bytes) -> bytes:
    """A header string field ends at its first NUL (or fills the field)."""
    nul = field.find(0)
    return field if nul < 0 else field[:nul]


def _decode(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape")


def _number(field: bytes, name: str, shard: str, offset: int) -> int:
    """Parse a numeric header field: octal text, or GNU base-256 when the high bit is set."""
    first = field[0]
    if first & 0x80:
        if first == 0x80:
            return int.from_bytes(field[1:], "big")
        if first == 0xFF:
            return int.from_bytes(field, "big", signed=True)
        raise CorruptShardError(shard, offset, f"invalid number in header field {name}")
    text = _cstr(field).strip()
    if not text:
        return 0
    if not text.isdigit():
        raise CorruptShardError(shard, offset, f"invalid number in header field {name}")
    try:
        return int(text, 8)
    except ValueError:  # digits 8 and 9
        raise CorruptShardError(shard, offset, f"invalid number in header field {name}") from None


def _clamp_time(seconds: int) -> int:
    """A timestamp outside the signed 64-bit range is clamped: it is metadata, not data."""
    return INT64_MIN if seconds < INT64_MIN else INT64_MAX if seconds > INT64_MAX else seconds


def _check_checksum(block: bytes, shard: str, offset: int) -> None:
    """Accept the unsigned sum (POSIX) or the signed one (some old tars), as tarfile does."""
    stored = _number(block[148:156], "chksum", shard, offset)
    unsigned = sum(block) - sum(block[148:156]) + 256  # chksum field counts as 8 spaces
    if stored == unsigned:
        return
    rest = block[:148] + block[156:]
    high = len(rest) - len(rest.translate(None, _HIGH_BYTES))
    if stored != unsigned - 256 * high:
        raise CorruptShardError(shard, offset, "header checksum mismatch")


def _parse_pax(data: bytes, shard: str, offset: int) -> dict[bytes, bytes]:
    """Parse ``"%d %s=%s\\n"`` records, where the number is the record's length in bytes."""
    records: dict[bytes, bytes] = {}
    pos = 0
    end = len(data)
    while pos < end:
        if data[pos] == 0 and not data[pos:].strip(b"\0"):
            break  # NUL padding inside the declared size
        space = data.find(b" ", pos, pos + 20)
        digits = data[pos:space]
        if space < 0 or not digits.isdigit():
            raise CorruptShardError(shard, offset, "malformed pax header")
        record_end = pos + int(digits)
        equals = data.find(b"=", space + 1, record_end)
        if record_end > end or equals < 0 or data[record_end - 1] != 0x0A:
            raise CorruptShardError(shard, offset, "malformed pax header")
        records[data[space + 1 : equals]] = data[equals + 1 : record_end - 1]
        pos = record_end
    return records


def _pax_size(value: bytes, shard: str, offset: int) -> int:
    """A pax ``size``: ASCII digits whose value fits a signed 64-bit integer."""
    if not value.isdigit():
        raise CorruptShardError(shard, offset, "malformed pax header")
    significant = value.lstrip(b"0")
    if len(significant) > _MAX_PAX_DIGITS or (significant and int(significant) > INT64_MAX):
        raise CorruptShardError(shard, offset, "pax size too large")
    return int(significant or b"0")


def _pax_mtime(value: bytes, shard: str, offset: int) -> int:
    """Floor a decimal ``[-]seconds[.fraction][e[+-]exponent]`` exactly, without going
    through float; a value beyond the signed 64-bit range is clamped, and its digits are
    never all converted. (Python's tarfile writes ``str(float)``, so exponents occur.)"""
    if not _PAX_TIME.fullmatch(value):
        raise CorruptShardError(shard, offset, "malformed pax header")
    exact = decimal.Decimal(value.decode("ascii"))
    if exact.adjusted() > _MAX_PAX_DIGITS:
        return INT64_MIN if exact < 0 else INT64_MAX
    return _clamp_time(int(exact.to_integral_value(rounding=decimal.ROUND_FLOOR)))


class _Extensions:
    """Extension headers (GNU long name and link, pax) seen since the last member: they
    apply to the next real header, whose ``header_offset`` is the first of them."""

    __slots__ = ("first_offset", "long_link", "long_name", "pax")

    def __init__(self) -> None:
        self.first_offset = -1
        self.long_name: bytes | None = None
        self.long_link: bytes | None = None
        self.pax: dict[bytes, bytes] | None = None

    def read(self, reader: _Reader, typeflag: int, size: int, shard: str, offset: int) -> None:
        """Take the extension header at ``offset`` and its data."""
        if size > _MAX_EXTENSION_SIZE:
            raise CorruptShardError(shard, offset, "extension header too large")
        data = reader.read(size)
        if len(data) < size or not reader.skip(-size % BLOCK_SIZE):
            raise CorruptShardError(shard, reader.pos, "truncated member data")
        if self.first_offset < 0:
            self.first_offset = offset
        if typeflag == _GNU_LONGNAME:
            self.long_name = _cstr(data)
        elif typeflag == _GNU_LONGLINK:
            self.long_link = _cstr(data)
        else:
            parsed = _parse_pax(data, shard, offset)
            if self.pax is None:
                self.pax = parsed
            else:
                self.pax.update(parsed)


def iter_members(
    stream: Readable,
    shard: str,
    *,
    capture: Callable[[TarMember], bool] | None = None,
    inner_tars: bool = True,
) -> Iterator[tuple[TarMember, bytes | None]]:
    """Yield every member of the tar ``stream`` with its offsets, in archive order.

    ``stream`` is only ever ``read``; ``shard`` names it in errors. When ``capture`` returns
    True for a member, its data is returned alongside it instead of being skipped, which
    lets the caller pick up small label files in the same pass. A member is yielded only
    after its data has been read, so a truncated member raises instead of being listed.

    With ``inner_tars``, a member named ``NAME.tar`` whose data starts with a valid tar
    header is parsed as it streams past (no second read): it is yielded as the directory
    ``NAME``, followed by its own members with ``folder`` set to ``NAME`` and offsets in the
    outer stream. Nesting stops there: a tar inside an inner tar is a file. A corrupt inner
    tar makes the whole shard corrupt, at its offset in the outer stream.
    """
    yield from _iter(_Reader(stream), shard, capture, inner_tars)


def _iter(
    reader: _Reader,
    shard: str,
    capture: Callable[[TarMember], bool] | None,
    inner_tars: bool,
) -> Iterator[tuple[TarMember, bytes | None]]:
    pending = _Extensions()
    while True:
        offset = reader.pos
        block = reader.read(BLOCK_SIZE)
        if len(block) < BLOCK_SIZE or block == _ZERO_BLOCK:
            if block and len(block) < BLOCK_SIZE:
                raise CorruptShardError(shard, offset, "truncated header")
            if pending.first_offset >= 0:
                raise CorruptShardError(shard, offset, "extension header without a member")
            return  # end-of-archive marker, or a clean EOF from a writer that omits it
        _check_checksum(block, shard, offset)
        typeflag = block[156]
        size = _number(block[124:136], "size", shard, offset)
        if not 0 <= size <= INT64_MAX:
            raise CorruptShardError(shard, offset, "invalid number in header field size")
        if typeflag in _EXTENSIONS:
            pending.read(reader, typeflag, size, shard, offset)
            continue
        if typeflag == _PAX_GLOBAL:
            # Global defaults (comments, charset) never change where data lives; skip them.
            if not reader.skip(size + (-size % BLOCK_SIZE)):
                raise CorruptShardError(shard, reader.pos, "truncated member data")
            continue
        if typeflag == _GNU_SPARSE and block[482]:
            _skip_sparse_map(reader, shard)
        member = _member(block, typeflag, size, reader.pos, pending, shard, offset)
        if pending.first_offset >= 0:
            pending = _Extensions()  # used up by this member
        if inner_tars and _may_be_tar(member):
            head = reader.read(BLOCK_SIZE)
            if len(head) < BLOCK_SIZE:
                raise CorruptShardError(shard, reader.pos, "truncated member data")
            if _is_tar_header(head, shard):
                yield from _inner_tar(reader, member, head, shard, capture)
                continue
            yield member, _data(reader, member, capture, shard, head)
            continue
        yield member, _data(reader, member, capture, shard)


def _may_be_tar(member: TarMember) -> bool:
    """A file named ``NAME.tar`` (NAME not empty) that holds at least one header block."""
    base = member.path.rpartition("/")[2]
    return (
        member.kind is MemberKind.FILE
        and base.endswith(".tar")
        and len(base) > len(".tar")
        and member.size >= BLOCK_SIZE
    )


def _is_tar_header(block: bytes, shard: str) -> bool:
    """Whether a block is a tar header: not the end marker, and its checksum holds."""
    if block == _ZERO_BLOCK:
        return False
    try:
        _check_checksum(block, shard, 0)
    except CorruptShardError:
        return False
    return True


class _MemberData:
    """One member's data as a stream: its first block (already read), then the rest from
    the outer reader, never past the member's end."""

    __slots__ = ("_head", "_reader", "left")

    def __init__(self, reader: _Reader, head: bytes, left: int) -> None:
        self._reader = reader
        self._head = head
        self.left = left

    def read(self, n: int = -1, /) -> bytes:
        if self._head:
            taken, self._head = self._head[:n], self._head[n:]
            return taken
        n = min(n, self.left)
        if n <= 0:
            return b""
        data = self._reader.read(n)
        self.left -= len(data)
        return data


def _inner_tar(
    reader: _Reader,
    member: TarMember,
    head: bytes,
    shard: str,
    capture: Callable[[TarMember], bool] | None,
) -> Iterator[tuple[TarMember, bytes | None]]:
    """The directory an inner tar stands for, then its members (not expanded further)."""
    folder = member.path[: -len(".tar")]
    folder_member = dataclasses.replace(
        member, path=folder, size=0, mode=0o755, kind=MemberKind.DIRECTORY
    )
    yield folder_member, None
    data = _MemberData(reader, head, member.size - BLOCK_SIZE)
    inner = _Reader(data)
    inner.pos = member.data_offset  # offsets stay those of the outer stream
    for inner_member, content in _iter(inner, shard, capture, inner_tars=False):
        yield dataclasses.replace(inner_member, folder=folder), content
    # The inner tar's end marker and record padding, then the outer member's padding.
    if not reader.skip(data.left + (-member.size % BLOCK_SIZE)):
        raise CorruptShardError(shard, reader.pos, "truncated member data")


def _skip_sparse_map(reader: _Reader, shard: str) -> None:
    """Old GNU sparse: the sparse map continues in extra blocks before the data."""
    while True:
        ext_offset = reader.pos
        ext = reader.read(BLOCK_SIZE)
        if len(ext) < BLOCK_SIZE:
            raise CorruptShardError(shard, ext_offset, "truncated header")
        if not ext[504]:
            return


def _member(
    block: bytes,
    typeflag: int,
    size: int,
    data_offset: int,
    pending: _Extensions,
    shard: str,
    offset: int,
) -> TarMember:
    """The member a header block describes, with the extension headers before it applied."""
    header_offset = offset if pending.first_offset < 0 else pending.first_offset
    mode = _number(block[100:108], "mode", shard, offset) & 0o7777
    mtime = _clamp_time(_number(block[136:148], "mtime", shard, offset))
    if pending.long_name is not None:
        name = pending.long_name
    else:
        name = _cstr(block[0:100])
        if block[257:263] == _USTAR_MAGIC:
            prefix = _cstr(block[345:500])
            if prefix:
                name = prefix + b"/" + name
    kind = _KINDS.get(typeflag, MemberKind.OTHER)
    linkname = b""
    if kind is MemberKind.SYMLINK or kind is MemberKind.HARDLINK:
        linkname = pending.long_link if pending.long_link is not None else _cstr(block[157:257])
    pax = pending.pax
    if pax is not None:
        if value := pax.get(b"path"):
            name = value
        if value := pax.get(b"GNU.sparse.name"):
            name = value  # pax sparse 0.1/1.0 keep the real name here
        if value := pax.get(b"linkpath"):
            linkname = value
        if value := pax.get(b"size"):
            size = _pax_size(value, shard, header_offset)
        if value := pax.get(b"mtime"):
            mtime = _pax_mtime(value, shard, header_offset)
        if any(key.startswith(b"GNU.sparse.") for key in pax):
            # pax sparse: the data is a sparse map plus fragments, not the file.
            kind = MemberKind.OTHER
    if kind is MemberKind.FILE and typeflag in _OLD_REGULAR and name.endswith(b"/"):
        kind = MemberKind.DIRECTORY  # v7 had no directory type, only a trailing slash
    if kind is not MemberKind.SYMLINK and kind is not MemberKind.HARDLINK:
        linkname = b""
    return TarMember(
        path=_decode(name),
        header_offset=header_offset,
        data_offset=data_offset,
        size=size,
        mode=mode,
        mtime=mtime,
        kind=kind,
        linkname=_decode(linkname) if linkname else "",
    )


def _data(
    reader: _Reader,
    member: TarMember,
    capture: Callable[[TarMember], bool] | None,
    shard: str,
    head: bytes = b"",
) -> bytes | None:
    """Read past the member's data (and padding): returned if ``capture`` wants it.
    ``head`` is the start of the data, when it was read already."""
    size = member.size - len(head)
    padding = -member.size % BLOCK_SIZE
    if capture is not None and capture(member):
        content = reader.read(size)
        if len(content) < size or not reader.skip(padding):
            raise CorruptShardError(shard, reader.pos, "truncated member data")
        return head + content
    if not reader.skip(size + padding):
        raise CorruptShardError(shard, reader.pos, "truncated member data")
    return None

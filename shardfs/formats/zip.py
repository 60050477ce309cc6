"""zip shards read by range: the end of central directory record (and its zip64 record),
the central directory, then each member's local header, since only the local header's own
extra length says where the data starts (the ``zip`` tool writes a longer extra field
there than in the central directory).

Stored members become direct extents; deflated members (method 8, the ``zip`` tool's
default) become decode units (``units.Unit``), one per member, whose rows are their whole
decoded bytes: a zip holding one is scanned to a ``DecodedScan``. Directories become
folder rows; unix symlinks (mode ``S_IFLNK`` in the external attributes) become symlink
rows whose target is the member's data, as tar's are. Other methods (bzip2, lzma, zstd,
...) and encrypted members are refused with ``UnsupportedMemberError``. A deflated
member's declared sizes are checked here (its compressed extent lies in the shard and
before the next member, its decoded size at most ``MAX_EXPANSION`` times that, past a small
floor); its data is decoded when it is read, which is where a corrupt stream surfaces
(``codecs.DecodeError``), except for labels and symlinks, decoded here.

Local headers are read in few requests: neighbouring headers (less than ``MAX_GAP`` apart)
share one ``read_at`` of at most ``MAX_WINDOW`` bytes. Shards are untrusted input, so
every offset and length is checked against the shard and the central directory, members
may not overlap, and only ``CorruptShardError`` (or a subclass) is raised.
"""

from __future__ import annotations

import calendar
import itertools
import stat
import struct
import zlib
from dataclasses import dataclass

from ..errors import CorruptShardError, UnsupportedMemberError
from .codecs import DecodeError, decode
from .members import (
    MAX_LABEL_BYTES,
    MAX_PATH_BYTES,
    MemberRow,
    check_symlink_target,
    label_extension,
    normalize_member_path,
    parse_label,
)
from .source import ShardBytes
from .tar import MemberKind
from .units import MAX_EXPANSION, DecodedScan, DecodedSpace, Unit

__all__ = ["ZIP_MAGIC", "scan_zip"]

ZIP_MAGIC = b"PK\x03\x04"
_EOCD = struct.Struct("<4s4H2LH")  # end of central directory record
_EOCD_SIG = b"PK\x05\x06"
_LOCATOR = struct.Struct("<4sLQL")  # zip64 end of central directory locator
_LOCATOR_SIG = b"PK\x06\x07"
_EOCD64 = struct.Struct("<4sQ2H2L4Q")  # zip64 end of central directory record
_EOCD64_SIG = b"PK\x06\x06"
_CENTRAL = struct.Struct("<4s6H3L5H2L")  # central directory file header
_CENTRAL_SIG = b"PK\x01\x02"
_LOCAL = struct.Struct("<4s5H3L2H")  # local file header
_ZIP64_EXTRA = 0x0001
_UNIX_TIME_EXTRA = 0x5455  # "UT": extended timestamp, the mtime first
_UNICODE_PATH_EXTRA = 0x7075  # "up": the UTF-8 name, for a header name in another encoding
_FLAG_ENCRYPTED = 0x0001
_FLAG_UTF8 = 0x0800
_UNIX = 3  # "version made by" system: the external attributes hold a unix mode
_STORED = 0
_DEFLATED = 8
# A deflated member may decode to MAX_EXPANSION times its compressed bytes, or to this much
# whatever its compressed size: a tiny member (an empty file deflates to 2 bytes) is no bomb.
BOMB_FLOOR = 64 << 10
MAX_DECODED_TOTAL = 64 << 30  # the decoded bytes of all of a shard's members, at most
_METHODS = {8: "deflate", 9: "deflate64", 12: "bzip2", 14: "lzma", 93: "zstd", 95: "xz"}
_MAX_COMMENT = 0xFFFF
# Reads: the central directory in windows of this size; local headers less than MAX_GAP
# apart share one read of at most MAX_WINDOW bytes. Through the block cache the scan's
# reads are whole blocks, so the data between headers is not downloaded twice.
MAX_WINDOW = 8 << 20
MAX_GAP = 1 << 20
# A local header's extra field may be longer than the central directory's (the zip tool
# adds 4 bytes); read this much more per header so that one read nearly always suffices.
_EXTRA_SLACK = 64
_FIX = "repack the files stored or deflated (`zip -0 -r`, `zip -r`, or shardfs pack)"


@dataclass(slots=True)
class _Entry:
    """One central directory entry, checked."""

    name: str
    central_offset: int
    local_offset: int
    size: int
    central_extra: int
    kind: MemberKind
    mode: int
    mtime: int
    wants_data: bool  # a label or a symlink: its bytes are read while indexing
    stored_size: int  # its bytes in the shard: ``size``, or the compressed size if deflated
    deflated: bool
    data_offset: int = 0


class _Zip:
    def __init__(self, source: ShardBytes) -> None:
        self.source = source
        self.shard = source.name
        self.size = source.size

    def fail(self, offset: int, reason: str) -> CorruptShardError:
        return CorruptShardError(self.shard, offset, reason)

    def read(self, offset: int, length: int) -> bytes:
        """Exactly ``length`` bytes at ``offset``, or the shard is truncated."""
        data = self.source.read_at(offset, length) if length else b""
        if len(data) != length:
            raise self.fail(offset, "truncated zip archive")
        return data

    # -- the end of central directory ------------------------------------------------------

    def directory_extent(self) -> tuple[int, int, int]:
        """(central directory offset, its size, the number of entries), all checked."""
        tail_len = min(self.size, _EOCD.size + _MAX_COMMENT + _LOCATOR.size)
        tail_start = self.size - tail_len
        tail = self.read(tail_start, tail_len)
        at = len(tail) - _EOCD.size
        while True:
            at = tail.rfind(_EOCD_SIG, 0, at + len(_EOCD_SIG)) if at >= 0 else -1
            if at < 0:
                raise self.fail(self.size, "not a zip archive (no end of central directory)")
            comment_len = _EOCD.unpack_from(tail, at)[-1]
            if at + _EOCD.size + comment_len <= len(tail):
                break
            at -= 1
        eocd_at = tail_start + at
        _, disk, cd_disk, _on_disk, count, cd_size, cd_offset, _ = _EOCD.unpack_from(tail, at)
        if disk or cd_disk:
            raise self.fail(eocd_at, "split (multi-disk) zip archives are not supported")
        end = eocd_at
        if at >= _LOCATOR.size and tail[at - _LOCATOR.size : at - _LOCATOR.size + 4] == (
            _LOCATOR_SIG
        ):
            locator_at = eocd_at - _LOCATOR.size
            end = locator_at
            _, _, record_at, _ = _LOCATOR.unpack_from(tail, at - _LOCATOR.size)
            if not 0 <= record_at <= locator_at - _EOCD64.size:
                raise self.fail(locator_at, "zip64 end of central directory out of bounds")
            record = self.read(record_at, _EOCD64.size)
            fields = _EOCD64.unpack(record)
            if fields[0] != _EOCD64_SIG:
                raise self.fail(record_at, "bad zip64 end of central directory signature")
            if fields[4] or fields[5]:
                raise self.fail(record_at, "split (multi-disk) zip archives are not supported")
            count, cd_size, cd_offset = fields[7], fields[8], fields[9]
            end = record_at
        elif 0xFFFF in (count, _on_disk) or 0xFFFFFFFF in (cd_size, cd_offset):
            raise self.fail(eocd_at, "zip64 archive without a zip64 locator")
        if cd_offset + cd_size > end:
            raise self.fail(eocd_at, "central directory out of bounds")
        if count * _CENTRAL.size > cd_size:
            raise self.fail(eocd_at, f"{count} entries cannot fit a {cd_size}-byte directory")
        return cd_offset, cd_size, count

    # -- the central directory -------------------------------------------------------------

    def entries(self, cd_offset: int, cd_size: int, count: int) -> list[_Entry]:
        """Every entry of the central directory, read in windows of MAX_WINDOW."""
        found: list[_Entry] = []
        buffer, buffer_at = b"", cd_offset
        pos, cd_end = cd_offset, cd_offset + cd_size
        for _ in range(count):
            # An entry is at most 46 + 3 * 65535 bytes: make sure that the buffer holds its
            # fixed part, then all of it.
            buffer, buffer_at = self.buffered(buffer, buffer_at, pos, _CENTRAL.size, cd_end)
            head = _CENTRAL.unpack_from(buffer, pos - buffer_at)
            need = _CENTRAL.size + head[10] + head[11] + head[12]
            buffer, buffer_at = self.buffered(buffer, buffer_at, pos, need, cd_end)
            found.append(self.entry(buffer, pos - buffer_at, pos))
            pos += need
        return found

    def buffered(
        self, buffer: bytes, buffer_at: int, pos: int, need: int, cd_end: int
    ) -> tuple[bytes, int]:
        """A buffer of the directory holding ``need`` bytes at ``pos``: the one given, or
        the next window."""
        if pos + need > cd_end:
            raise self.fail(pos, "central directory entry runs past the directory")
        if pos + need <= buffer_at + len(buffer):
            return buffer, buffer_at
        return self.read(pos, min(max(need, MAX_WINDOW), cd_end - pos)), pos

    def entry(self, buffer: bytes, at: int, offset: int) -> _Entry:
        (sig, made_by, _, flags, method, dos_time, dos_date, _, compressed, size,
         name_len, extra_len, _comment, _, _, external, local_offset) = _CENTRAL.unpack_from(
            buffer, at
        )  # fmt: skip
        if sig != _CENTRAL_SIG:
            raise self.fail(offset, "bad central directory signature")
        name_at = at + _CENTRAL.size
        raw_name = buffer[name_at : name_at + name_len]
        extra = buffer[name_at + name_len : name_at + name_len + extra_len]
        mtime = _dos_time(dos_date, dos_time)
        unicode_name: bytes | None = None
        for tag, body in _extra_fields(extra):
            if tag == _ZIP64_EXTRA:
                values = [v for v in (size, compressed, local_offset) if v == 0xFFFFFFFF]
                if len(body) < 8 * len(values):
                    raise self.fail(offset, "zip64 extra field too short")
                wide = list(struct.unpack_from(f"<{len(values)}Q", body))
                if size == 0xFFFFFFFF:
                    size = wide.pop(0)
                if compressed == 0xFFFFFFFF:
                    compressed = wide.pop(0)
                if local_offset == 0xFFFFFFFF:
                    local_offset = wide.pop(0)
            elif tag == _UNIX_TIME_EXTRA and len(body) >= 5 and body[0] & 1:
                mtime = struct.unpack_from("<l", body, 1)[0]
            elif tag == _UNICODE_PATH_EXTRA and _names_this(body, raw_name):
                unicode_name = body[5:]
        name = _decode_name(unicode_name or raw_name, bool(unicode_name or flags & _FLAG_UTF8))
        path = normalize_member_path(name, self.shard, offset)
        unix_mode = external >> 16 if made_by >> 8 == _UNIX else 0
        if name.endswith("/") or stat.S_ISDIR(unix_mode):
            kind, mode = MemberKind.DIRECTORY, (unix_mode & 0o7777) or 0o755
        elif stat.S_ISLNK(unix_mode):
            kind, mode = MemberKind.SYMLINK, 0o777
        else:
            kind, mode = MemberKind.FILE, (unix_mode & 0o7777) or 0o644
        shown = repr(name) if len(name) <= 200 else repr(name[:200]) + "..."
        if flags & _FLAG_ENCRYPTED:
            raise UnsupportedMemberError(
                self.shard, local_offset, f"member {shown} is encrypted; {_FIX}"
            )
        deflated = method == _DEFLATED and kind is not MemberKind.DIRECTORY
        if method not in (_STORED, _DEFLATED) and kind is not MemberKind.DIRECTORY:
            what = _METHODS.get(method, "an unknown method")
            raise UnsupportedMemberError(
                self.shard,
                local_offset,
                f"member {shown} is compressed ({what}, method {method}) and shardfs serves "
                f"only stored and deflated zip members; {_FIX}",
            )
        if kind is MemberKind.DIRECTORY:
            size = compressed = 0  # a folder presents no data, whatever its entry says
        elif deflated:
            if size > max(MAX_EXPANSION * compressed, BOMB_FLOOR):
                raise self.fail(
                    offset,
                    f"deflated member {shown} declares {size} bytes from {compressed}: more "
                    f"than {MAX_EXPANSION} times its data (a decompression bomb)",
                )
        elif compressed != size:
            raise self.fail(offset, f"stored member {shown} has two different sizes")
        if compressed > self.size:
            raise self.fail(offset, f"member {shown} is larger than the archive")
        if kind is MemberKind.SYMLINK and size > MAX_PATH_BYTES:
            raise self.fail(offset, f"symlink {shown} has a target over {MAX_PATH_BYTES} bytes")
        wants = kind is MemberKind.SYMLINK or (
            kind is MemberKind.FILE
            and size <= MAX_LABEL_BYTES
            and label_extension(path) is not None
        )
        return _Entry(
            path,
            offset,
            local_offset,
            size,
            extra_len,
            kind,
            mode,
            mtime,
            wants,
            compressed,
            deflated,
        )

    # -- the local headers ------------------------------------------------------------------

    def locate(self, entries: list[_Entry], cd_offset: int) -> dict[int, bytes]:
        """Set each entry's data offset from its local header, and return the data of the
        entries that want it, by their central directory offset. Members must lie before
        the central directory and must not overlap."""
        ordered = sorted(entries, key=lambda e: e.local_offset)
        for entry in ordered:
            if entry.local_offset + _LOCAL.size > cd_offset:
                raise self.fail(entry.central_offset, "local header offset beyond the data")
        wanted: dict[int, bytes] = {}
        start = 0
        while start < len(ordered):
            first = ordered[start]
            window_end = stop = start
            limit = min(first.local_offset + MAX_WINDOW, cd_offset)
            end = _header_end(first, cd_offset)
            while True:
                stop += 1
                window_end = end
                if stop == len(ordered):
                    break
                following = ordered[stop]
                following_end = _header_end(following, cd_offset)
                if following.local_offset - end > MAX_GAP or following_end > limit:
                    break
                end = max(end, following_end)
            window = self.read(first.local_offset, window_end - first.local_offset)
            for entry in ordered[start:stop]:
                data = self.local_header(entry, window, first.local_offset)
                if data is not None:
                    wanted[entry.central_offset] = data
            start = stop
        for entry, after in itertools.pairwise(ordered):
            if entry.data_offset + entry.stored_size > after.local_offset:
                raise self.fail(entry.local_offset, f"member {entry.name!r} overlaps the next")
        for entry in ordered:
            if entry.data_offset + entry.stored_size > cd_offset:
                raise self.fail(entry.local_offset, f"member {entry.name!r} overlaps the directory")
        return wanted

    def local_header(self, entry: _Entry, window: bytes, window_at: int) -> bytes | None:
        """Read one local header out of ``window`` (or by itself where it runs past it)."""
        at = entry.local_offset - window_at
        head = window[at : at + _LOCAL.size]
        if len(head) < _LOCAL.size:
            head = self.read(entry.local_offset, _LOCAL.size)
        fields = _LOCAL.unpack(head)
        if fields[0] != ZIP_MAGIC:
            raise self.fail(entry.local_offset, f"no local header for member {entry.name!r}")
        entry.data_offset = entry.local_offset + _LOCAL.size + fields[9] + fields[10]
        if not entry.wants_data:
            return None
        data_at = entry.data_offset - window_at
        data = window[data_at : data_at + entry.stored_size]
        if len(data) < entry.stored_size:
            data = self.read(entry.data_offset, entry.stored_size)
        if entry.deflated:
            try:
                data = bytes(decode(self.unit(entry), data))  # a label or a link: small
            except DecodeError as exc:
                raise self.fail(
                    entry.data_offset, f"deflated member {entry.name!r}: {exc}"
                ) from None
        return data

    @staticmethod
    def unit(entry: _Entry) -> Unit:
        """The decode unit of a deflated member."""
        return Unit("deflate", entry.data_offset, entry.stored_size, entry.size)


def _header_end(entry: _Entry, cd_offset: int) -> int:
    """Where a read covering the entry's local header (and wanted data) should end."""
    end = entry.local_offset + _LOCAL.size + len(entry.name.encode("utf-8", "surrogateescape"))
    end += entry.central_extra + _EXTRA_SLACK + (entry.stored_size if entry.wants_data else 0)
    return min(end, cd_offset)


def _names_this(body: bytes, raw_name: bytes) -> bool:
    """Whether a unicode path extra field (version 1) is about this header name: it holds
    the CRC-32 of the name it translates, so a renamed entry's stale field is ignored."""
    return (
        len(body) > 5 and body[0] == 1 and body[1:5] == zlib.crc32(raw_name).to_bytes(4, "little")
    )


def _decode_name(raw: bytes, utf8: bool) -> str:
    """A member name: UTF-8 where the archive says so; otherwise UTF-8 where it decodes as
    UTF-8 (what unix tools write, the zip tool without the flag included), else cp437 (the
    zip format's default encoding)."""
    if not utf8:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw.decode("cp437")
    return raw.decode("utf-8", "surrogateescape")  # invalid bytes: refused as a path


def _extra_fields(extra: bytes) -> list[tuple[int, bytes]]:
    """The (tag, body) records of an extra field; a truncated last record is ignored, as
    every zip reader does."""
    fields, pos = [], 0
    while pos + 4 <= len(extra):
        tag, length = struct.unpack_from("<2H", extra, pos)
        fields.append((tag, extra[pos + 4 : pos + 4 + length]))
        pos += 4 + length
    return fields


def _dos_time(date: int, time: int) -> int:
    """An MS-DOS date and time (local time of the writer, taken as UTC) in seconds."""
    year, month, day = 1980 + (date >> 9), (date >> 5) & 0xF, date & 0x1F
    hours, minutes, seconds = time >> 11, (time >> 5) & 0x3F, (time & 0x1F) * 2
    try:
        return calendar.timegm((year, month, day, hours, minutes, seconds, 0, 0, 0))
    except (ValueError, OverflowError):
        return 0


def scan_zip(source: ShardBytes) -> list[MemberRow] | DecodedScan:
    """The index rows of a zip shard, in central directory order: a list where every
    member is stored, else a ``DecodedScan`` with a unit per deflated member."""
    archive = _Zip(source)
    cd_offset, cd_size, count = archive.directory_extent()
    entries = archive.entries(cd_offset, cd_size, count)
    data = archive.locate(entries, cd_offset)
    space = DecodedSpace()
    starts: dict[int, int] = {}  # a deflated file's decoded offset, by its central offset
    for entry in sorted(entries, key=lambda e: e.local_offset):  # units in raw order
        if entry.deflated and entry.kind is MemberKind.FILE and entry.size and entry.name:
            starts[entry.central_offset] = space.add(archive.unit(entry))
    decoded = sum(unit.size for unit in space.units)
    if decoded > MAX_DECODED_TOTAL:
        raise archive.fail(
            0, f"the deflated members declare {decoded} bytes in all (a decompression bomb)"
        )
    rows: list[MemberRow] = []
    for entry in entries:
        if not entry.name:
            continue  # a "./" entry
        link, label = "", None
        content = data.get(entry.central_offset)
        if entry.kind is MemberKind.SYMLINK and content is not None:
            target = content.decode("utf-8", "surrogateescape")
            link = check_symlink_target(target, archive.shard, entry.local_offset)
        elif content is not None:
            ext = label_extension(entry.name)
            label = parse_label(ext, content) if ext is not None else None
        size = entry.size if entry.kind is MemberKind.FILE else 0
        offset = entry.data_offset if entry.kind is MemberKind.FILE else 0
        offset = starts.get(entry.central_offset, offset)
        rows.append(
            (entry.name, offset, size, entry.mode, entry.mtime, int(entry.kind), link, label)
        )
    return DecodedScan(rows, space) if space.units else rows

"""Where every file of a mount lives, in bulk, and the order hint back to the mount.

Two magic files sit at the root of every mount; a LOOKUP finds them, READDIR never lists
them, so ``ImageFolder``, ``os.walk`` and ``ls`` never see them:

- ``.shardfs-table`` (read-only): the placement table, every regular file of the view in
  (shard, offset) order. One read of it replaces a ``getxattr`` per file.
- ``.shardfs-hint``: takes the order in which this node's readers will read table rows.
  A read-only mount refuses every ``write(2)`` in the kernel (EROFS) before the daemon sees
  it, so the hint travels in ``ioctl(2)`` calls on the open file instead, which a read-only
  mount still passes on. A FUSE ioctl carries at most 16 KiB, so a hint is sent in chunks.

Both wire formats are private to this module (the daemon's encoder and the client's
decoder live here). All integers are little-endian.

Table::

    b"SHFSTAB1"  u32 header length  header (UTF-8 JSON: fingerprint, shards, rows, paths)
    paths      NUL-separated UTF-8 (surrogateescape) relative paths, ``paths`` bytes
    padding    zero bytes up to a multiple of 8
    shards     int32 x rows     shard id of each row
    offsets    int64 x rows     data offset of each row in its shard
    sizes      int64 x rows     file size of each row

The fingerprint is a hash of everything after the header but the padding, plus the shard
names: two mounts of the same data with the same view on two nodes agree on it.

Hint (the payload, before chunking)::

    b"SHFSHNT1"  u32 fingerprint length  fingerprint (ASCII)  i64 epoch  u32 count
    rows       int32 x count   table rows in the order this node will read them

Each chunk is one ioctl ``HINT_IOCTL`` whose argument is ``HINT_CHUNK`` bytes::

    8 bytes hint id (random per hint)  u32 payload length  u32 chunk offset  u16 chunk length
    chunk bytes, zero padding to HINT_CHUNK

The daemon answers the chunk at offset 0 with EINVAL when the fingerprint is not its own,
and the last chunk with EINVAL when the payload does not decode.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import secrets
import struct
import sys
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from .mount.table import MOUNTINFO, parse_mountinfo

__all__ = [
    "HINT_NAME",
    "TABLE_NAME",
    "Hint",
    "Placement",
    "decode_hint",
    "decode_table",
    "encode_hint",
    "encode_table",
    "hint_chunks",
    "mount_root_of",
    "read_placement",
    "send_hint",
]

TABLE_NAME = ".shardfs-table"
HINT_NAME = ".shardfs-hint"

_TABLE_MAGIC = b"SHFSTAB1"
_HINT_MAGIC = b"SHFSHNT1"
_LITTLE = sys.byteorder == "little"

# _IOW('S', 0x11, HINT_CHUNK): the kernel copies _IOC_SIZE bytes (14 bits: at most 16383)
# from the caller into the FUSE request.
HINT_CHUNK = 16383
_IOC_WRITE = 1
HINT_IOCTL = (_IOC_WRITE << 30) | (HINT_CHUNK << 16) | (ord("S") << 8) | 0x11
_CHUNK_HEADER = struct.Struct("<8sIIH")
_CHUNK_DATA = HINT_CHUNK - _CHUNK_HEADER.size


@dataclass(frozen=True)
class Placement:
    """The placement table of a mount: row i is ``paths[i]`` in shard ``shards[i]``."""

    fingerprint: str
    shard_names: list[str]
    paths: list[str]
    shards: array[int]  # 'i'
    offsets: array[int]  # 'q'
    sizes: array[int]  # 'q'
    _rows: dict[str, int] = field(default_factory=dict, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.paths)

    def rows_of(self, relative_paths: Sequence[str]) -> list[int]:
        """The row of each path (relative to the mount root); KeyError if one is absent."""
        rows = self._rows
        if not rows and self.paths:
            rows.update(zip(self.paths, range(len(self.paths)), strict=True))
        return [rows[path] for path in relative_paths]


def _little(values: array[int]) -> bytes:
    if not _LITTLE:
        values = array(values.typecode, values)
        values.byteswap()
    return values.tobytes()


def _from_little(typecode: str, data: bytes | memoryview) -> array[int]:
    values = array(typecode)
    values.frombytes(data)
    if not _LITTLE:
        values.byteswap()
    return values


def _fingerprint(shard_names: Sequence[str], body: Sequence[bytes]) -> str:
    digest = hashlib.sha256()
    digest.update("\0".join(shard_names).encode("utf-8", "surrogateescape") + b"\0\0")
    for part in body:
        digest.update(part)
    return digest.hexdigest()[:24]


def encode_table(
    shard_names: Sequence[str], rows: Iterable[tuple[str, int, int, int]]
) -> tuple[str, bytes]:
    """(fingerprint, table bytes) of rows ``(path, shard id, offset, size)`` given in
    (shard, offset) order."""
    paths: list[str] = []
    shards, offsets, sizes = array("i"), array("q"), array("q")
    for path, shard, offset, size in rows:
        paths.append(path)
        shards.append(shard)
        offsets.append(offset)
        sizes.append(size)
    blob = "\0".join(paths).encode("utf-8", "surrogateescape")
    body = [blob, _little(shards), _little(offsets), _little(sizes)]
    fingerprint = _fingerprint(shard_names, body)
    header = json.dumps(
        {
            "fingerprint": fingerprint,
            "shards": list(shard_names),
            "rows": len(paths),
            "paths": len(blob),
        }
    ).encode()
    head = _TABLE_MAGIC + struct.pack("<I", len(header)) + header
    padding = b"\0" * (-(len(head) + len(blob)) % 8)
    return fingerprint, b"".join([head, blob, padding, *body[1:]])


def decode_table(data: bytes) -> Placement:
    """The Placement encoded by ``encode_table``; ValueError when ``data`` is not one."""
    if data[:8] != _TABLE_MAGIC or len(data) < 12:
        raise ValueError("not a shardfs placement table")
    (header_len,) = struct.unpack_from("<I", data, 8)
    header = json.loads(data[12 : 12 + header_len])
    rows, blob_len = int(header["rows"]), int(header["paths"])
    start = 12 + header_len
    view = memoryview(data)
    blob = bytes(view[start : start + blob_len])
    position = start + blob_len
    position += -position % 8
    if len(data) != position + rows * 20:
        raise ValueError("placement table has the wrong length")
    shards = _from_little("i", view[position : position + 4 * rows])
    position += 4 * rows
    offsets = _from_little("q", view[position : position + 8 * rows])
    position += 8 * rows
    sizes = _from_little("q", view[position : position + 8 * rows])
    paths = blob.decode("utf-8", "surrogateescape").split("\0") if rows else []
    if len(paths) != rows:
        raise ValueError("placement table paths do not match its rows")
    return Placement(header["fingerprint"], list(header["shards"]), paths, shards, offsets, sizes)


@dataclass(frozen=True)
class Hint:
    """An order hint: table rows of ``fingerprint`` in the order this node reads them."""

    fingerprint: str
    epoch: int
    rows: array[int]  # 'i'


def encode_hint(fingerprint: str, epoch: int, rows: Sequence[int]) -> bytes:
    fp = fingerprint.encode("ascii")
    values = rows if isinstance(rows, array) and rows.typecode == "i" else array("i", rows)
    return b"".join(
        [
            _HINT_MAGIC,
            struct.pack("<I", len(fp)),
            fp,
            struct.pack("<qI", epoch, len(values)),
            _little(values),
        ]
    )


def hint_fingerprint(payload: bytes) -> str | None:
    """The fingerprint at the head of a hint payload (or of its first chunk), or None."""
    if payload[:8] != _HINT_MAGIC or len(payload) < 12:
        return None
    (length,) = struct.unpack_from("<I", payload, 8)
    if len(payload) < 12 + length:
        return None
    return payload[12 : 12 + length].decode("ascii", "replace")


def decode_hint(payload: bytes) -> Hint:
    """The Hint encoded by ``encode_hint``; ValueError when ``payload`` is not one."""
    fingerprint = hint_fingerprint(payload)
    if fingerprint is None:
        raise ValueError("not a shardfs order hint")
    position = 12 + len(fingerprint)
    if len(payload) < position + 12:
        raise ValueError("order hint is truncated")
    epoch, count = struct.unpack_from("<qI", payload, position)
    position += 12
    if len(payload) != position + 4 * count:
        raise ValueError("order hint has the wrong length")
    return Hint(fingerprint, epoch, _from_little("i", payload[position:]))


def hint_chunks(payload: bytes) -> list[bytearray]:
    """The ioctl arguments that carry ``payload``, each exactly ``HINT_CHUNK`` bytes."""
    hint_id = secrets.token_bytes(8)
    chunks = []
    for offset in range(0, max(len(payload), 1), _CHUNK_DATA):
        piece = payload[offset : offset + _CHUNK_DATA]
        chunk = bytearray(HINT_CHUNK)
        _CHUNK_HEADER.pack_into(chunk, 0, hint_id, len(payload), offset, len(piece))
        chunk[_CHUNK_HEADER.size : _CHUNK_HEADER.size + len(piece)] = piece
        chunks.append(chunk)
    return chunks


def parse_chunk(chunk: bytes) -> tuple[bytes, int, int, bytes]:
    """(hint id, payload length, offset, bytes) of one chunk; ValueError if malformed."""
    if len(chunk) < _CHUNK_HEADER.size:
        raise ValueError("order hint chunk is too short")
    hint_id, total, offset, length = _CHUNK_HEADER.unpack_from(chunk)
    data = bytes(chunk[_CHUNK_HEADER.size : _CHUNK_HEADER.size + length])
    if len(data) != length or offset + length > total:
        raise ValueError("order hint chunk is malformed")
    return hint_id, total, offset, data


def mount_root_of(path: str) -> str | None:
    """The root of the shardfs mount (fstype fuse.shardfs in /proc/self/mountinfo) that holds
    ``path``, or None.

    The path is made absolute without touching the filesystem; only when that is on no
    shardfs mount are symlinks resolved (a link from outside into a mount)."""
    try:
        entries = parse_mountinfo(MOUNTINFO.read_bytes())
    except OSError:
        return None
    for candidate in (os.path.abspath(path), None):
        if candidate is None:
            resolved = os.path.realpath(path)
            if resolved == os.path.abspath(path):
                return None
            candidate = resolved
        best = None
        for entry in entries:  # the last entry on a mountpoint is the one on top
            point = entry.mountpoint
            inside = candidate == point or candidate.startswith(point.rstrip("/") + "/")
            if inside and (best is None or len(point) >= len(best.mountpoint)):
                best = entry
        if best is not None and best.is_shardfs:
            return best.mountpoint
    return None


def read_placement(mount_root: str) -> Placement:
    """One read of MOUNT/.shardfs-table (bulk: 1.28M rows in well under 2 s). OSError
    (ENOENT) from a mount too old to have it."""
    with open(os.path.join(mount_root, TABLE_NAME), "rb", buffering=0) as table:
        data = table.read()
    try:
        return decode_table(data)
    except (ValueError, KeyError) as exc:
        raise OSError(errno.EIO, f"{mount_root}: unreadable placement table ({exc})") from exc


def send_hint(mount_root: str, placement: Placement, rows: Sequence[int], *, epoch: int) -> None:
    """Tell the mount the order this node's ranks will read (table rows, in order): one
    open of MOUNT/.shardfs-hint and its ioctls. OSError if the mount cannot take it
    (EINVAL: not this mount's table; ENOENT or ENOTTY: a mount too old)."""
    values = rows if isinstance(rows, array) and rows.typecode == "i" else array("i", rows)
    if values and not 0 <= min(values) <= max(values) < len(placement.paths):
        raise ValueError("hint rows must be rows of the placement table")
    payload = encode_hint(placement.fingerprint, epoch, values)
    fd = os.open(os.path.join(mount_root, HINT_NAME), os.O_RDONLY | os.O_CLOEXEC)
    try:
        for chunk in hint_chunks(payload):
            fcntl.ioctl(fd, HINT_IOCTL, chunk, True)
    finally:
        os.close(fd)

"""MosaicML streaming's MDS shards (``shard.NNNNN.mds``, written by ``MDSWriter``) as index
rows: each sample's image a direct byte range of the shard, carrying its own label.

A plain shard describes itself, so ``index.json`` is not needed: a uint32 sample count, a
table of count + 1 uint32 sample offsets, the writer's config as JSON (``column_names``,
``column_encodings``, ``column_sizes``), then the samples. A sample is one uint32 size per
variable-size column, then the columns in ``column_names`` order. What is read: the front
(count, offsets, config) in one read, then per sample the few bytes of its label (and its
sizes when more than one column is variable), never the image bytes.

Rows: ``{stem}-{index}.{ext}`` per sample, placed under the shard's folder (the split, as
MDSWriter lays out one folder per split), with the ``int`` label column's value as its own
label (a negative value is no label).

zstd shards (``.mds.zstd``, ``MDSWriter(compression='zstd')``) are a plain shard in zstd
frames (one, as the writer makes them; concatenated frames are read too): the whole shard
is one decode unit. The scan reads it all (``read_cached``: at mount time these bytes go
to the block cache), takes the decoded size from the frames' headers (their
Frame_Content_Size fields; a frame without one is decoded with a cap and measured),
decodes it, and scans the decoded bytes as a plain shard, its rows' offsets in the unit's
decoded space. A bomb (a decoded size over ``MAX_EXPANSION`` times the shard), a shard
that is not zstd, a truncated frame and bytes that do not decode are refused."""

from __future__ import annotations

import json
import posixpath
from collections.abc import Callable
from typing import NoReturn

from ..errors import CorruptShardError
from . import codecs
from .classes import image_extension
from .members import MAX_LABEL, MemberRow, normalize_member_path
from .parquet import FILE_MODE, SNIFF
from .source import BytesShard, CheckedReads, ShardBytes
from .tar import MemberKind
from .units import MAX_EXPANSION, DecodedScan, DecodedSpace, Unit

SUFFIX = ".mds"
ZSTD_SUFFIX = ".mds.zstd"
FRONT_READ = 4 << 10  # the count, offsets and config of a typical shard
MERGE_GAP = 64  # two small ranges of a sample this close are read as one
_INTS = {"int": (8, True)} | {
    f"{sign}int{bits}": (bits // 8, sign == "") for sign in ("", "u") for bits in (8, 16, 32, 64)
}
_VERBATIM = {"jpeg": "jpg", "png": "png", "bytes": ""}
_IMAGE_NAMES = ("image", "img", "jpg", "jpeg", "png", "webp")
_LABEL_NAMES = ("label", "cls", "class", "target", "labels")


def _u32s(data: bytes, start: int, count: int) -> list[int]:
    view = memoryview(data)[start : start + 4 * count]
    return [int.from_bytes(view[i : i + 4], "little") for i in range(0, 4 * count, 4)]


def _config(
    shard: CheckedReads, text: bytes, at: int
) -> tuple[list[str], list[str], list[int | None]]:
    try:
        config = json.loads(text)
        names, encodings, sizes = (
            config["column_names"],
            config["column_encodings"],
            config["column_sizes"],
        )
    except (ValueError, RecursionError, KeyError, TypeError):
        shard.fail(at, "the config is not MDSWriter's JSON (column_names, _encodings, _sizes)")
    ok = (
        isinstance(names, list)
        and isinstance(encodings, list)
        and isinstance(sizes, list)
        and len(names) == len(encodings) == len(sizes)
        and all(isinstance(n, str) for n in names)
        and all(isinstance(e, str) for e in encodings)
        and all(s is None or (isinstance(s, int) and 0 <= s < 1 << 31) for s in sizes)
    )
    if not ok:
        shard.fail(at, "the config's columns are malformed")
    return names, encodings, sizes


def _pick(
    shard: CheckedReads, names: list[str], encodings: list[str], at: int
) -> tuple[int, int | None]:
    """The image column's index and the label column's (None when there is none)."""
    images = [i for i, e in enumerate(encodings) if e in ("jpeg", "png")]
    images += [i for i, e in enumerate(encodings) if e == "bytes" and names[i] in _IMAGE_NAMES]
    if not images:
        if "pil" in encodings:
            shard.fail(
                at, "the images are a 'pil' column (raw pixels): write them as 'jpeg' or 'png'"
            )
        shard.fail(at, "no image column (encoding jpeg, png, or bytes named image)")
    ints = [i for i, e in enumerate(encodings) if e in _INTS]
    named = [i for i in ints if names[i] in _LABEL_NAMES]
    label = named[0] if named else (ints[0] if len(ints) == 1 else None)
    return images[0], label


def scan_mds(source: ShardBytes) -> list[MemberRow]:
    """The index rows of one plain MDS shard (module docstring)."""
    return _scan_plain(source, posixpath.basename(source.name).removesuffix(SUFFIX))


def _scan_plain(source: ShardBytes, stem: str) -> list[MemberRow]:
    """The rows of the plain MDS shard ``source`` holds, named ``{stem}-{index}.{ext}``."""
    shard = CheckedReads(source)
    size = source.size
    if size < 8:
        shard.fail(0, "too short for an MDS shard")
    front = shard.read(0, min(size, FRONT_READ), "the sample table")
    count = int.from_bytes(front[:4], "little")
    table_end = 4 + 4 * (count + 1)
    first = int.from_bytes(front[4:8], "little")
    if table_end > size or not table_end <= first <= size:
        shard.fail(0, f"{count} samples need an offsets table past the end of the shard")
    if first > len(front):
        front = shard.read(0, first, "the sample table and config")
    offsets = _u32s(front, 4, count + 1)
    for index in range(count):
        if not offsets[index] <= offsets[index + 1] <= size:
            shard.fail(8 + 4 * index, f"sample {index}'s offsets lie past the end of the shard")
    names, encodings, sizes = _config(shard, front[table_end:first], table_end)
    image, label = _pick(shard, names, encodings, table_end)
    variable = [i for i, s in enumerate(sizes) if s is None]
    width = max(6, len(str(max(count - 1, 0))))
    rows: list[MemberRow] = []
    for index in range(count):
        start, end = offsets[index], offsets[index + 1]
        spans = _spans(shard, start, end, sizes, variable)
        image_at, image_size = spans[image]
        wanted = []
        if label is not None:
            wanted.append(spans[label])
        ext = _VERBATIM[encodings[image]]
        if not ext:
            wanted.append((image_at, min(image_size, SNIFF)))
        got = _read_spans(shard, wanted)
        own = None
        if label is not None:
            nbytes, signed = _INTS[encodings[label]]
            if spans[label][1] != nbytes:
                shard.fail(start, f"sample {index}'s label is not {nbytes} bytes")
            value = int.from_bytes(got[0], "little", signed=signed)
            own = value if 0 <= value <= MAX_LABEL else None
        if not ext:
            ext = image_extension(got[-1])
        name = normalize_member_path(f"{stem}-{index:0{width}d}.{ext}", source.name, start)
        rows.append((name, image_at, image_size, FILE_MODE, 0, int(MemberKind.FILE), "", own))
    return rows


def _spans(
    shard: CheckedReads, start: int, end: int, sizes: list[int | None], variable: list[int]
) -> list[tuple[int, int]]:
    """(offset, size) of each column of the sample at ``[start, end)``."""
    head = 4 * len(variable)
    fixed = sum(s for s in sizes if s is not None)
    if len(variable) == 1:  # the one variable column's size follows from the offsets
        var_sizes = [end - start - head - fixed]
    else:
        var_sizes = _u32s(shard.read(start, head, "a sample's sizes"), 0, len(variable))
    if head + fixed + sum(var_sizes) != end - start or min(var_sizes, default=0) < 0:
        shard.fail(start, "a sample's column sizes do not add up to its offsets")
    sized = iter(var_sizes)
    spans = []
    cursor = start + head
    for column_size in sizes:
        length = next(sized) if column_size is None else column_size
        spans.append((cursor, length))
        cursor += length
    return spans


def _read_spans(shard: CheckedReads, spans: list[tuple[int, int]]) -> list[bytes]:
    """The bytes of a sample's few small spans, neighbouring ones in one read."""
    if len(spans) == 2:
        (a, an), (b, bn) = sorted(spans)
        if b - (a + an) <= MERGE_GAP:
            data = shard.read(a, max(a + an, b + bn) - a, "a sample")
            return [data[offset - a : offset - a + length] for offset, length in spans]
    return [shard.read(offset, length, "a sample") for offset, length in spans]


# zstd frames (RFC 8878): a frame's magic, a skippable frame's magics, the largest block.
_ZSTD_MAGIC = 0xFD2FB528
_SKIPPABLE = 0x184D2A50  # to 0x184D2A5F: the low 4 bits are free
_MAX_BLOCK = 128 << 10
_FCS_BYTES = (0, 2, 4, 8)  # Frame_Content_Size field size by its flag (0: 1 if single segment)
MAX_DECODED = (1 << 32) - 1  # a plain shard's offsets are uint32: it is at most this large


def _zstd_extent(data: bytes, fail: Callable[[int, str], NoReturn]) -> tuple[int, bool]:
    """The decoded size of the zstd frames ``data`` holds: (size, exact). Exact when every
    frame declares its content size; else an upper bound from the blocks (a raw or RLE
    block's own size, 128 KiB for a compressed one). Walks every frame and block, so a
    truncated frame or bytes after the last frame are found here."""
    total, exact, pos = 0, True, 0
    if len(data) < 4:
        fail(0, "too short for a zstd frame")
    while pos < len(data):
        if pos + 4 > len(data):
            fail(pos, "truncated zstd frame")
        magic = int.from_bytes(data[pos : pos + 4], "little")
        if magic & 0xFFFFFFF0 == _SKIPPABLE:
            if pos + 8 > len(data):
                fail(pos, "truncated zstd skippable frame")
            pos += 8 + int.from_bytes(data[pos + 4 : pos + 8], "little")
            if pos > len(data):
                fail(len(data), "truncated zstd skippable frame")
            continue
        if magic != _ZSTD_MAGIC:
            what = "not zstd (no zstd frame magic)" if pos == 0 else "bytes after the zstd frames"
            fail(pos, what)
        content, bound, pos = _zstd_frame(data, pos, fail)
        if content is None:
            exact = False
            total += bound
        else:
            total += content
    return total, exact


def _zstd_frame(
    data: bytes, at: int, fail: Callable[[int, str], NoReturn]
) -> tuple[int | None, int, int]:
    """(declared content size or None, decoded size bound, end) of the frame at ``at``."""
    if at + 5 > len(data):
        fail(at, "truncated zstd frame header")
    descriptor = data[at + 4]
    if descriptor & 0x08:
        fail(at + 4, "a zstd frame header with its reserved bit set")
    single = bool(descriptor & 0x20)
    fcs_bytes = _FCS_BYTES[descriptor >> 6] or (1 if single else 0)
    dict_bytes = (0, 1, 2, 4)[descriptor & 0x03]
    pos = at + 5 + (0 if single else 1) + dict_bytes
    if pos + fcs_bytes > len(data):
        fail(at, "truncated zstd frame header")
    content = None
    if fcs_bytes:
        content = int.from_bytes(data[pos : pos + fcs_bytes], "little")
        content += 256 if fcs_bytes == 2 else 0
    pos += fcs_bytes
    bound = 0
    while True:
        if pos + 3 > len(data):
            fail(pos, "truncated zstd frame (a block header past the end)")
        header = int.from_bytes(data[pos : pos + 3], "little")
        last, kind, size = header & 1, (header >> 1) & 3, header >> 3
        if kind == 3:
            fail(pos, "a zstd block of the reserved type")
        pos += 3 + (1 if kind == 1 else size)
        bound += _MAX_BLOCK if kind == 2 else size
        if pos > len(data):
            fail(len(data), "truncated zstd frame (a block runs past the end)")
        if last:
            break
    pos += 4 if descriptor & 0x04 else 0  # the content checksum
    if pos > len(data):
        fail(len(data), "truncated zstd frame (no content checksum)")
    return content, bound, pos


def scan_mds_zstd(source: ShardBytes) -> DecodedScan:
    """The index rows of one zstd MDS shard (module docstring): one decode unit."""
    shard = CheckedReads(source)
    size = source.size
    raw = source.read_cached(0, size) if size else b""
    if len(raw) != size:
        shard.fail(0, "the zstd shard is truncated")
    declared, exact = _zstd_extent(raw, shard.fail)
    cap = min(MAX_EXPANSION * size, MAX_DECODED)
    if declared > cap:
        what = "declares" if exact else "may decode to (it declares no size)"
        shard.fail(
            0,
            f"the zstd shard {what} {declared} bytes from {size}: over {cap} (a decompression "
            "bomb, or no MDS shard)",
        )
    try:  # exactly the declared size, or at most the bound
        decode = codecs.decode if exact else _at_most
        decoded = decode(Unit("zstd", 0, size, declared), raw)
    except codecs.DecodeError as exc:
        shard.fail(0, f"the zstd shard does not decode: {exc}")
    unit = Unit("zstd", 0, size, len(decoded))
    space = DecodedSpace()
    start = space.add(unit)
    stem = posixpath.basename(source.name).removesuffix(ZSTD_SUFFIX)
    try:
        rows = _scan_plain(BytesShard(source.name, decoded), stem)
    except CorruptShardError as exc:  # an offset of the decoded bytes: say so
        raise type(exc)(
            source.name, 0, f"{exc.reason} (at offset {exc.offset} of the decoded shard)"
        ) from None
    shifted = [
        (path, start + offset, length, mode, mtime, kind, link, label)
        for path, offset, length, mode, mtime, kind, link, label in rows
    ]
    return DecodedScan(shifted, space)


def _at_most(unit: Unit, raw: bytes) -> codecs.Decoded:
    """A unit's decoded bytes, at most ``unit.size`` of them (frames without a size)."""
    return codecs.WHOLE[unit.codec](raw, unit.size)

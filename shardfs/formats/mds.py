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
label (a negative value is no label). zstd shards (``.mds.zstd``) are refused in one line
this release: the fix is to write them with ``compression=None``."""

from __future__ import annotations

import json
import posixpath

from ..errors import CorruptShardError
from .classes import image_extension
from .members import MAX_LABEL, MemberRow, normalize_member_path
from .parquet import FILE_MODE, SNIFF
from .source import CheckedReads, ShardBytes
from .tar import MemberKind

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
    base = posixpath.basename(source.name)
    stem = base.removesuffix(SUFFIX)
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


def refuse_zstd(source: ShardBytes) -> list[MemberRow]:
    """A zstd MDS shard: not served this release, in one line that says how to fix it."""
    raise CorruptShardError(
        source.name,
        0,
        "a zstd-compressed MDS shard, which shardfs does not decode yet (write the dataset "
        "with MDSWriter(compression=None) for shards served as byte ranges)",
    )

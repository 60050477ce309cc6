"""Hugging Face parquet shards (``datasets``' ``Image`` and ``ClassLabel`` features) as
index rows: each image a byte range of the file, or of a decoded page, with its own label.

What is read: the footer (``FileMetaData``, thrift compact) once; the label and
``image.path`` columns whole (they are small; any codec and dictionary encoding); and of
the image column, page by page:
- an uncompressed PLAIN page (``datasets`` >= 4.6): its header and level section (one
  read) and each value's 4-byte length (one small read), never the image bytes: each
  image is a direct byte range of the file;
- a compressed page (snappy, gzip, zstd; v1 whole, v2 its values after the stored levels)
  of PLAIN images: a decode unit (``units.Unit``), read through the block cache
  (``read_cached``) and decoded once at index time to find each value in the decoded page;
- a dictionary page holds the images (compressed: a unit; uncompressed: direct ranges),
  and the data pages the indices into it (read and decoded, not served), so that a row's
  bytes are its dictionary value's, shared by rows that repeat an image.
A page that declares over ``MAX_EXPANSION`` times its stored size (past a small floor),
pages that decode to other sizes than declared, truncated or corrupt bodies, and codecs
shardfs does not read (LZO, BROTLI, LZ4) make the shard bad, in one line.

Rows: ``[SPLIT/]FILE`` per image (SPLIT from ``{split}-NNNNN-of-NNNNN.parquet``; FILE the
basename of ``image.path``, else ``{stem}-{row}.{ext}``), label -1 or missing as no label;
and, when the footer names the classes, a directory row ``[SPLIT/]CLASS`` per class that
carries its label id, so that the view makes every class's folder, also an empty one."""

from __future__ import annotations

import json
import posixpath
import re
from bisect import bisect_right
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..errors import CorruptShardError, UnsafeMemberError
from . import codecs
from .classes import class_folders, image_extension
from .members import MAX_LABEL, MemberRow, is_image_name, normalize_member_path
from .pages import (
    DICTIONARY_ENCODINGS,
    Leaf,
    PageError,
    check_count,
    chunk_span,
    dictionary_indices,
    levels_of,
    page_header,
    page_locations,
    plain_extents,
    read_footer,
    schema_leaves,
    small_column,
    snappy_pieces,
)
from .source import CheckedReads, ShardBytes
from .tar import MemberKind
from .thrift import Struct, Value
from .thrift import field_of as _get
from .thrift import int_field as _int
from .thrift import list_field as _list
from .thrift import struct_field as _struct
from .units import MAX_EXPANSION, DecodedScan, DecodedSpace, Unit

SNIFF = 12  # bytes of an image read with its length, to name its type
# After an image under SMALL_IMAGE bytes, its page is read by stretches of SMALL_WINDOW
# bytes (tiny images are then most of what is read, and go to the block cache); larger
# ones by their length and first bytes alone (16 bytes: under 2 % of a 1 KiB image).
SMALL_IMAGE = 1 << 10
SMALL_WINDOW = 256 << 10
PAGE_THREADS = 8  # stored image pages whose small reads are in flight at once
BOMB_FLOOR = 64 << 10  # a page may decode to this much, whatever its stored size
MAX_DECODED = 64 << 30  # a shard's pages may decode to this much in all (bombs)
FILE_MODE, DIR_MODE = 0o644, 0o755
_SPLIT_NAME = re.compile(r"^(?P<split>.+)-\d{5}-of-\d{5}\.parquet$")
_CODECS = {1: "snappy", 2: "gzip", 6: "zstd"}  # parquet's codec ids, in ``codecs.WHOLE``
_REFUSED = {3: "LZO", 4: "BROTLI", 5: "LZ4", 7: "LZ4_RAW"}
_ENCODINGS = {2: "PLAIN_DICTIONARY", 8: "RLE_DICTIONARY", 6: "DELTA_LENGTH_BYTE_ARRAY"}


def _hf_features(meta: Struct) -> dict[str, object]:
    """The ``datasets`` features in the footer's ``huggingface`` key, or {}."""
    for pair in _list(meta, 5, "key-value metadata"):
        if isinstance(pair, dict) and pair.get(1) == b"huggingface":
            try:
                doc = json.loads(pair.get(2, b"") or b"{}")  # type: ignore[arg-type]
            except (ValueError, RecursionError, TypeError):
                return {}
            info = doc.get("info", doc) if isinstance(doc, dict) else {}
            features = info.get("features") if isinstance(info, dict) else None
            return features if isinstance(features, dict) else {}
    return {}


def _columns(
    features: dict[str, object], leaves: list[Leaf]
) -> tuple[str, Leaf | None, Leaf | None, list[str] | None]:
    """The image column's name, its path and label leaves, and the ClassLabel names."""
    by_path = {leaf.path: leaf for leaf in leaves}
    typed = {k: v.get("_type") for k, v in features.items() if isinstance(v, dict)}
    images = [k for k, t in typed.items() if t == "Image"]
    candidates = images or [p[0] for p in by_path if len(p) == 2 and p[1] == "bytes"]
    image = next((c for c in candidates if (c, "bytes") in by_path), None)
    if image is None:
        raise ValueError("no image column (a struct of bytes and path, as datasets' Image)")
    labels = [k for k, t in typed.items() if t == "ClassLabel"]
    label_name = labels[0] if labels else "label"
    label = by_path.get((label_name,))
    if label is not None and (label.physical not in (1, 2) or label.max_rep):
        label = None
    names = None
    feature = features.get(label_name)
    if labels and isinstance(feature, dict):
        raw = feature.get("names")
        if isinstance(raw, list) and all(isinstance(n, str) for n in raw):
            names = list(raw)
    return image, by_path.get((image, "path")), label, names


def _clear(codec: int, raw: bytes, size: int) -> bytes:
    """A page part's stored bytes in the clear, exactly ``size`` of them (``pages.Clear``)."""
    if codec == 0:
        if len(raw) != size:
            raise PageError(f"an uncompressed page of {len(raw)} bytes declares {size}")
        return raw
    return bytes(codecs.decode(_unit(codec, 0, len(raw), size), raw))  # small: values as bytes


def _unit(codec: int, offset: int, length: int, size: int) -> Unit:
    """The decode unit of a compressed page part; refuses unknown codecs and bombs."""
    name = _CODECS.get(codec)
    if name is None:
        known = _REFUSED.get(codec, f"codec {codec}")
        raise PageError(f"the page is {known}-compressed, a codec shardfs does not read")
    if size > max(MAX_EXPANSION * length, BOMB_FLOOR) or size < 0:
        raise PageError(f"a page of {length} bytes declares {size} decoded: a decompression bomb")
    return Unit(name, offset, length, size)


# Where an image's bytes lie: (unit, offset, size, first bytes). Unit -1: ``offset`` is a
# real offset of the shard (a direct extent); else the index of its decode unit, and
# ``offset`` is within the unit's decoded bytes.
ImageValue = tuple[int, int, int, bytes]


@dataclass
class _Chunk:
    """The state of one image column chunk's scan: its codec, the shard's decode units so
    far (shared by all chunks) and the chunk's dictionary, once its page was read."""

    reader: CheckedReads
    codec: int
    leaf: Leaf
    units: list[Unit]
    dictionary: list[ImageValue] | None = None


class _Part:
    """A part of a page (its levels, its values): stored bytes read lazily by small ranges
    (``start`` real), or bytes in memory (``data``: read whole or decoded), whose values are
    in decode unit ``unit`` (-1: the part is stored verbatim at ``start``)."""

    def __init__(self, reader: CheckedReads, start: int, end: int, head: tuple[int, bytes]):
        self.reader, self.start, self.end, self.head = reader, start, end, head
        self.data: bytes | bytearray | None = None
        self.unit = -1
        self.literals: list[tuple[int, int, int]] = []  # of a pieces unit: (decoded, raw, n)

    def at(self, offset: int, size: int) -> bytes:
        """Up to ``size`` bytes at ``offset`` of the part (fewer at its end)."""
        size = max(min(size, self.end - self.start - offset), 0)
        if self.data is not None:
            return bytes(self.data[offset : offset + size])  # a level section or a length
        real = self.start + offset
        pos, buf = self.head
        if pos <= real and real + size <= pos + len(buf):
            return buf[real - pos : real - pos + size]
        return self.reader.read(real, size, "an image page")

    def whole(self) -> bytes | bytearray:
        if self.data is None:
            self.data = self.reader.read(self.start, self.end - self.start, "an image page")
        return self.data

    def values(self, pos: int, count: int) -> list[ImageValue]:
        """``count`` PLAIN byte arrays from ``pos``: where each lies, and its first bytes."""
        if self.data is not None:
            data = self.data
            return [
                (*self._place(o, n), n, bytes(data[o : o + min(n, SNIFF)]))
                for o, n in plain_extents(data, pos, count)
            ]
        out: list[ImageValue] = []
        small = False
        for _ in range(count):  # the image bytes are never read: a length and a sniff each
            if small and not self._held(pos, 4 + SNIFF):
                # Small images (thumbnails, MNIST-sized): one read of the next stretch of
                # the page, through the block cache, instead of one per image.
                real, length = self.start + pos, min(SMALL_WINDOW, self.end - self.start - pos)
                self.head = (real, self.reader.read(real, length, "an image page", cached=True))
            head = self.at(pos, 4 + SNIFF)
            if len(head) < 4:
                raise PageError("an image's length runs past the page")
            size = int.from_bytes(head[:4], "little")
            if pos + 4 + size > self.end - self.start:
                raise PageError(f"an image of {size} bytes runs past the page")
            out.append((-1, self.start + pos + 4, size, head[4 : 4 + min(size, SNIFF)]))
            pos += 4 + size
            small = size < SMALL_IMAGE
        return out

    def _place(self, offset: int, size: int) -> tuple[int, int]:
        """(unit, offset) of a value in memory: a value inside one literal run of a pieces
        unit is a direct extent of the shard (unit -1: pushed and served as any)."""
        if self.unit < 0:
            return -1, self.start + offset
        index = bisect_right(self.literals, (offset, 1 << 63)) - 1
        if index >= 0:
            start, raw, length = self.literals[index]
            if offset + size <= start + length:
                return -1, raw + offset - start
        return self.unit, offset

    def _held(self, offset: int, size: int) -> bool:
        """Whether bytes ``[offset, offset + size)`` of the part (cut at its end) are in
        the bytes last read."""
        real, size = self.start + offset, max(min(size, self.end - self.start - offset), 0)
        pos, buf = self.head
        return pos <= real and real + size <= pos + len(buf)

    def decode(self, chunk: _Chunk, size: int, serves: bool) -> None:
        """Decode the part (``size`` bytes in the clear). A part whose values are images
        (``serves``) becomes a decode unit. A compressed chunk is read through the block
        cache (its units are served from it, its other pages share their blocks)."""
        length = self.end - self.start
        unit = _unit(chunk.codec, self.start, length, size)
        raw = chunk.reader.read(self.start, length, "an image page", cached=True)
        if serves and unit.codec == "snappy":  # read from its literal runs where it can be
            self.data, unit, self.literals = snappy_pieces(unit, raw)
        if self.data is None:
            try:
                self.data = codecs.decode(unit, raw)
            except codecs.DecodeError as exc:
                raise PageError(f"{unit.codec} page: {exc}") from None
        self.start, self.end = 0, size
        if serves:
            self.unit = len(chunk.units)
            chunk.units.append(unit)


def _image_column(
    reader: CheckedReads, column: Value, leaf: Leaf, rows: int, units: list[Unit]
) -> list[ImageValue | None]:
    """Where each row's image bytes lie, None for a null image."""
    what = f"column {leaf.dotted}"
    start, end, codec = chunk_span(reader, _struct(column, 3, "column chunk"), what)
    chunk = _Chunk(reader, codec, leaf, units)
    if not codec:  # stored pages: each a chain of small reads, the chains side by side
        pages = page_locations(reader, column, start, end, rows)
        found = _pages_at_once(chunk, pages, end, what) if pages and len(pages) > 1 else None
        if found is not None:
            return found
    out: list[ImageValue | None] = []
    pos = start
    while pos < end and len(out) < rows:
        header, length, buf = page_header(reader, pos, end, what, cached=codec != 0)
        try:
            out += _image_page(chunk, header, pos, length, buf, end, rows - len(out))
        except (PageError, ValueError) as exc:
            reader.fail(pos, f"{what}: {exc}")
        pos += length + _int(header, 3, "page header")
    if len(out) != rows:
        reader.fail(start, f"{what} holds {len(out)} values for {rows} rows")
    return out


def _pages_at_once(
    chunk: _Chunk, pages: list[tuple[int, int, int]], end: int, what: str
) -> list[ImageValue | None] | None:
    """The values of a stored chunk's data pages, read by ``PAGE_THREADS`` at once (the
    latency of a store's small reads, not its bandwidth, is what an index of PLAIN images
    waits on); None when a page is not what the offset index says (then the pages are
    walked one by one, which names the fault)."""

    def one(page: tuple[int, int, int]) -> list[ImageValue | None] | None:
        offset, size, count = page
        try:
            header, length, buf = page_header(chunk.reader, offset, end, what)
            if _int(header, 1, "page") not in (0, 3) or length + _int(header, 3, "") != size:
                return None
            values = _image_page(chunk, header, offset, length, buf, end, count)
        except (CorruptShardError, ValueError):
            return None
        return values if len(values) == count else None

    with ThreadPoolExecutor(min(PAGE_THREADS, len(pages))) as pool:
        found = list(pool.map(one, pages))
    out: list[ImageValue | None] = []
    for values in found:
        if values is None:
            return None
        out += values
    return out


def _image_page(
    chunk: _Chunk, header: Struct, pos: int, length: int, buf: bytes, end: int, room: int
) -> list[ImageValue | None]:
    """The values of one page of the image column: a dictionary page fills the chunk's
    dictionary; a data page gives a value per row (PLAIN, or indices into the dictionary)."""
    kind = _int(header, 1, "page header")
    size = _int(header, 2, "page header")
    body = pos + length
    body_end = body + _int(header, 3, "page header")
    if body_end > end or body_end < body:
        raise PageError("a page runs past its column chunk")
    whole = _Part(chunk.reader, body, body_end, (pos, buf))
    leaf = chunk.leaf
    if kind == 2:
        count = _int(_struct(header, 7, "page header"), 1, "dictionary page")
        if not 0 <= count <= body_end - body:
            raise PageError(f"a dictionary of {count} values cannot fit its page")
        if chunk.codec:
            whole.decode(chunk, size, serves=True)
        chunk.dictionary = whole.values(0, count)
        return []
    if kind not in (0, 3):
        return []  # index pages hold nothing we need
    if leaf.max_rep:
        raise PageError("repeated image columns are not read")
    v2 = kind == 3
    page_header = _struct(header, 8 if v2 else 5, "page header")
    count = _int(page_header, 1, "data page")
    encoding = _int(page_header, 4 if v2 else 2, "data page")
    check_count(count, room)
    plain = encoding == 0
    if not plain and encoding not in DICTIONARY_ENCODINGS:
        name = _ENCODINGS.get(encoding, f"encoding {encoding}")
        raise PageError(f"the image page is {name} encoded, which shardfs does not read")
    if v2:  # the levels stored as they are, then the values, compressed or not
        rep_len, def_len = _int(page_header, 6, "data page"), _int(page_header, 5, "data page")
        if rep_len < 0 or def_len < 0 or body + rep_len + def_len > body_end:
            raise PageError("the level sections run past the page")
        levels = levels_of(whole.at(rep_len, def_len), 0, def_len, leaf, count)
        values = _Part(chunk.reader, body + rep_len + def_len, body_end, (pos, buf))
        if chunk.codec and _get(page_header, 7, bool, "data page", True):
            values.decode(chunk, size - rep_len - def_len, serves=plain)
        at = 0
    else:  # v1: the levels are inside the compressed page
        if chunk.codec:
            whole.decode(chunk, size, serves=plain)
        def_len = int.from_bytes(whole.at(0, 4), "little") if leaf.max_def else 0
        levels_at = 4 if leaf.max_def else 0
        at = levels_at + def_len
        if def_len < 0 or at > whole.end - whole.start:
            raise PageError("the level section runs past the page")
        levels = levels_of(whole.at(levels_at, def_len), 0, def_len, leaf, count)
        values = whole
    present = sum(1 for level in levels if level == leaf.max_def)
    if plain:
        found = values.values(at, present)
    else:
        if chunk.dictionary is None:
            raise PageError("a dictionary encoded page before any dictionary page")
        table = chunk.dictionary
        page = values.whole()
        found = [table[i] for i in dictionary_indices(page, at, present, len(table))]
    found_iter = iter(found)
    return [next(found_iter) if level == leaf.max_def else None for level in levels]


def split_of(name: str) -> str:
    """The split a hub file name gives (``data/train-00000-of-00002.parquet`` -> ``train``),
    or '' (``refs/convert/parquet/{config}/{split}/0000.parquet``: its folder is the split)."""
    match = _SPLIT_NAME.match(posixpath.basename(name))
    return match.group("split") if match else ""


def _file_names(stem: str, paths: list[str | None], heads: list[bytes | None]) -> list[str]:
    """Each row's file name: ``image.path``'s basename where it is a usable image name
    that no other row of the shard has, else ``{stem}-{row:06d}.{ext}``."""
    width = max(6, len(str(len(paths) - 1)))
    bases = [posixpath.basename(p) if p else "" for p in paths]
    seen = Counter(bases)
    names = []
    for row, (base, head) in enumerate(zip(bases, heads, strict=True)):
        usable = bool(base) and seen[base] == 1 and is_image_name(base)
        if usable:
            try:
                normalize_member_path(base, stem, 0)
            except UnsafeMemberError:
                usable = False
        names.append(base if usable else f"{stem}-{row:0{width}d}.{image_extension(head or b'')}")
    return names


def _chunks(group: Value) -> tuple[int, dict[tuple[str, ...], Value]]:
    """A row group's row count and its column chunks by column path."""
    chunks: dict[tuple[str, ...], Value] = {}
    for chunk in _list(group, 1, "row group"):
        if _get(chunk, 1, bytes, "column chunk", b""):
            raise ValueError("a column chunk in another file is not read")
        meta_data = _get(chunk, 3, dict, "column chunk")
        assert isinstance(meta_data, dict)
        parts = _list(meta_data, 3, "column metadata")
        chunks[tuple(p.decode("utf-8", "replace") for p in parts if isinstance(p, bytes))] = chunk
    return _int(group, 3, "row group"), chunks


def scan_parquet(shard: ShardBytes) -> list[MemberRow] | DecodedScan:
    """The index rows of one parquet shard (module docstring)."""
    try:
        return _scan(CheckedReads(shard))
    except ValueError as exc:  # a field check outside a page's own guard
        raise CorruptShardError(shard.name, 0, f"malformed metadata: {exc}") from None


def _scan(reader: CheckedReads) -> list[MemberRow] | DecodedScan:
    shard = reader.shard
    meta, footer_at = read_footer(reader)
    try:
        leaves = schema_leaves(meta)
        image, path_leaf, label_leaf, names = _columns(_hf_features(meta), leaves)
        image_leaf = next(leaf for leaf in leaves if leaf.path == (image, "bytes"))
        groups = [_chunks(group) for group in _list(meta, 4, "row groups")]
    except ValueError as exc:
        reader.fail(footer_at, f"footer: {exc}")
    values: list[ImageValue | None] = []
    labels: list[int | bytes | None] = []
    paths: list[int | bytes | None] = []
    units: list[Unit] = []
    for number, (rows, chunks) in enumerate(groups):
        image_chunk = chunks.get(image_leaf.path)
        if image_chunk is None or not 0 <= rows <= shard.size:
            reader.fail(footer_at, f"footer: row group {number} has no image column or bad rows")
        values += _image_column(reader, image_chunk, image_leaf, rows, units)
        for leaf, into in ((label_leaf, labels), (path_leaf, paths)):
            chunk_meta = chunks.get(leaf.path) if leaf is not None else None
            if leaf is None or chunk_meta is None:
                into += [None] * rows
            else:
                meta_data = _struct(chunk_meta, 3, "column chunk")
                into += small_column(reader, meta_data, leaf, rows, _clear)
    if sum(unit.size for unit in units) > MAX_DECODED:
        reader.fail(0, f"its pages decode to over {MAX_DECODED >> 30} GiB: a decompression bomb")
    space, placed = _placed(units, values)
    members = _rows(shard.name, placed, labels, paths, names)
    return DecodedScan(members, space) if units else members


Placed = tuple[int, int, bytes, int]  # (offset, real or decoded; size; first bytes; raw offset)


def _placed(
    units: list[Unit], values: list[ImageValue | None]
) -> tuple[DecodedSpace, list[Placed | None]]:
    """The shard's decoded space (its units in raw-offset order) and where each value lies."""
    space = DecodedSpace()
    starts = [0] * len(units)
    for index in sorted(range(len(units)), key=lambda i: units[i].offset):
        starts[index] = space.add(units[index])
    placed: list[Placed | None] = []
    for value in values:
        if value is None:
            placed.append(None)
        elif value[0] < 0:
            placed.append((value[1], value[2], value[3], value[1]))
        else:
            unit = value[0]
            placed.append((starts[unit] + value[1], value[2], value[3], units[unit].offset))
    return space, placed


def _rows(
    name: str,
    values: list[Placed | None],
    labels: list[int | bytes | None],
    paths: list[int | bytes | None],
    names: list[str] | None,
) -> list[MemberRow]:
    split = split_of(name)
    stem = posixpath.basename(name).removesuffix(".parquet")
    texts = [p.decode("utf-8", "replace") if isinstance(p, bytes) else None for p in paths]
    files = _file_names(stem, texts, [v[2] if v else None for v in values])
    folders = class_folders(names) if names else []
    rows: list[MemberRow] = []
    for class_id, folder in enumerate(folders):
        path = normalize_member_path(posixpath.join(split, folder), name, 0)
        rows.append((path, 0, 0, DIR_MODE, 0, int(MemberKind.DIRECTORY), "", class_id))
    for value, label, file in zip(values, labels, files, strict=True):
        if value is None:
            continue  # a null image: nothing to serve
        own = label if isinstance(label, int) and 0 <= label <= MAX_LABEL else None
        if own is not None and names is not None and own >= len(names):
            own = None  # a label the ClassLabel does not name: left unlabelled
        path = normalize_member_path(posixpath.join(split, file), name, value[3])
        rows.append((path, value[0], value[1], FILE_MODE, 0, int(MemberKind.FILE), "", own))
    return rows

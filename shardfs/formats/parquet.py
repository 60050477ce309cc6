"""Hugging Face parquet shards (``datasets``' ``Image`` and ``ClassLabel`` features) as
index rows: each image a direct byte range of the file, carrying its own label.

What is read: the footer (``FileMetaData``, thrift compact) once; the label and
``image.path`` columns whole (they are small, and may be snappy and dictionary encoded);
and of the image column only each page's header and level section (one read) and each
value's 4-byte length (one small read), never the image bytes. Images must be stored
PLAIN and uncompressed, as ``datasets`` >= 4.6 writes them; a page that is compressed or
dictionary encoded is refused with one line naming the page and the fix.

Rows: ``[SPLIT/]FILE`` per image (SPLIT from ``{split}-NNNNN-of-NNNNN.parquet``; FILE the
basename of ``image.path``, else ``{stem}-{row}.{ext}``), label -1 or missing as no label;
and, when the footer names the classes, a directory row ``[SPLIT/]CLASS`` per class that
carries its label id, so that the view makes every class's folder, also an empty one."""

from __future__ import annotations

import json
import posixpath
import re
from collections import Counter
from dataclasses import dataclass

from ..errors import CorruptShardError, UnsafeMemberError
from .classes import class_folders, image_extension
from .members import MAX_LABEL, MemberRow, is_image_name, normalize_member_path
from .pages import PageError, decompress, hybrid, plain_values
from .source import CheckedReads, ShardBytes
from .tar import MemberKind
from .thrift import Struct, ThriftError, Value, read_struct
from .thrift import field_of as _get
from .thrift import int_field as _int
from .thrift import list_field as _list
from .thrift import struct_field as _struct
from .thrift import text_field as _text

MAGIC = b"PAR1"
TAIL_READ = 8 << 10  # one read at the end holds a typical footer (datasets: ~7 KB)
HEADER_READ = 1 << 10  # a page header, its level section and its first value's length
MAX_HEADER = 1 << 20
SNIFF = 12  # bytes of an image read with its length, to name its type
MAX_SMALL_COLUMN = 256 << 20  # the label and path columns are read whole
FILE_MODE, DIR_MODE = 0o644, 0o755
_SPLIT_NAME = re.compile(r"^(?P<split>.+)-\d{5}-of-\d{5}\.parquet$")
_FIX = (
    "shardfs serves parquet images stored PLAIN and uncompressed only: write the file with "
    "datasets >= 4.6 (to_parquet), or with pyarrow's compression='none' and use_dictionary=False"
)
_CODECS = {1: "SNAPPY", 2: "GZIP", 3: "LZO", 4: "BROTLI", 5: "LZ4", 6: "ZSTD", 7: "LZ4_RAW"}
_ENCODINGS = {2: "PLAIN_DICTIONARY", 8: "RLE_DICTIONARY", 6: "DELTA_LENGTH_BYTE_ARRAY"}


@dataclass(frozen=True)
class Leaf:
    """A leaf column of the schema: its dotted path, physical type and level maxima."""

    path: tuple[str, ...]
    physical: int
    max_def: int
    max_rep: int

    @property
    def dotted(self) -> str:
        return ".".join(self.path)


def _footer(reader: CheckedReads) -> tuple[Struct, int]:
    size = reader.shard.size
    if size < 12:
        reader.fail(0, "too short for a parquet file")
    tail_len = min(size, TAIL_READ)
    tail = reader.read(size - tail_len, tail_len, "the footer")
    if tail[-4:] != MAGIC:
        reader.fail(size - 4, "no PAR1 magic at the end: not a parquet file, or truncated")
    meta_len = int.from_bytes(tail[-8:-4], "little")
    start = size - 8 - meta_len
    if start < 4:
        reader.fail(size - 8, f"footer length {meta_len} is larger than the file")
    if meta_len + 8 <= tail_len:
        data = tail[tail_len - 8 - meta_len : tail_len - 8]
    else:
        data = reader.read(start, meta_len, "the footer")
    try:
        meta, _ = read_struct(data)
    except ThriftError as exc:
        reader.fail(start + exc.offset, f"footer: {exc.reason}")
    return meta, start


def _leaves(meta: Struct) -> list[Leaf]:
    schema = _list(meta, 2, "schema")
    if not schema:
        raise ValueError("schema: empty")
    leaves: list[Leaf] = []
    stack: list[list[object]] = [[_int(schema[0], 5, "schema root", 0), (), 0, 0]]
    index = 1
    while stack:
        top = stack[-1]
        if top[0] == 0:
            stack.pop()
            continue
        top[0] = int(top[0]) - 1  # type: ignore[call-overload]
        if index >= len(schema):
            raise ValueError("schema: fewer elements than its folders declare")
        element = schema[index]
        index += 1
        name = _text(element, 4, "schema element")
        repetition = _int(element, 3, "schema element", 0)
        path = (*top[1], name)  # type: ignore[misc]
        max_def = int(top[2]) + (repetition in (1, 2))  # type: ignore[call-overload]
        max_rep = int(top[3]) + (repetition == 2)  # type: ignore[call-overload]
        children = _int(element, 5, "schema element", 0)
        if children:
            stack.append([children, path, max_def, max_rep])
        else:
            physical = _int(element, 1, "schema element", -1)
            leaves.append(Leaf(path, physical, max_def, max_rep))
    return leaves


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


def _levels(page: bytes, pos: int, end: int, leaf: Leaf, count: int) -> list[int]:
    if leaf.max_def == 0:
        return [0] * count
    return hybrid(page, pos, end, leaf.max_def.bit_length(), count)


def _page_header(reader: CheckedReads, pos: int, end: int, what: str) -> tuple[Struct, int, bytes]:
    """The page header at ``pos``, its length, and the bytes read from ``pos``."""
    want = HEADER_READ
    while True:
        buf = reader.read(pos, min(want, end - pos), what)
        try:
            header, length = read_struct(buf)
            return header, length, buf
        except ThriftError as exc:
            if len(buf) >= end - pos or want >= MAX_HEADER:
                reader.fail(pos + exc.offset, f"{what}: page header: {exc.reason}")
            want *= 4


def _chunk_span(reader: CheckedReads, meta: Value, what: str) -> tuple[int, int, int]:
    """(start, end, codec) of a column chunk, checked against the file."""
    data_off = _int(meta, 9, what)
    dict_off = _int(meta, 11, what, 0)
    start = dict_off if 4 <= dict_off < data_off else data_off
    end = start + _int(meta, 7, what)
    if start < 4 or end > reader.shard.size - 8 or end < start:
        reader.fail(max(start, 0), f"{what} lies outside the file")
    return start, end, _int(meta, 4, what, 0)


def _small_column(
    reader: CheckedReads, meta: Value, leaf: Leaf, rows: int
) -> list[int | bytes | None]:
    """Every value of a small column chunk, None where null: read whole, then decoded."""
    what = f"column {leaf.dotted}"
    start, end, codec = _chunk_span(reader, meta, what)
    if end - start > MAX_SMALL_COLUMN:
        reader.fail(start, f"{what} is over {MAX_SMALL_COLUMN >> 20} MiB")
    data = reader.read(start, end - start, what)
    pos = 0
    dictionary: list[int | bytes] = []
    out: list[int | bytes | None] = []
    while pos < len(data) and len(out) < rows:
        try:
            header, body = read_struct(data, pos)
        except ThriftError as exc:
            reader.fail(start + exc.offset, f"{what}: page header: {exc.reason}")
        try:
            pos = _decode_page(header, data, body, codec, leaf, dictionary, out, rows - len(out))
        except (PageError, ValueError) as exc:
            reader.fail(start + pos, f"{what}: {exc}")
    if len(out) != rows:
        reader.fail(start, f"{what} holds {len(out)} values for {rows} rows")
    return out


def _decode_page(
    header: Struct,
    data: bytes,
    body: int,
    codec: int,
    leaf: Leaf,
    dictionary: list[int | bytes],
    out: list[int | bytes | None],
    rows: int,
) -> int:
    """Decode one page of a small column into ``out`` (which ``rows`` values fill);
    returns the offset past it."""
    kind = _int(header, 1, "page header")
    size = _int(header, 2, "page header")
    stored = _int(header, 3, "page header")
    end = body + stored
    if stored < 0 or end > len(data) or not 0 <= size <= MAX_SMALL_COLUMN:
        raise PageError("a page runs past its column chunk")
    raw = data[body:end]
    if kind == 2:  # the dictionary
        count = _int(_struct(header, 7, "page header"), 1, "dictionary page")
        dictionary[:] = plain_values(leaf.physical, decompress(codec, raw, size), 0, count)
        return end
    if kind not in (0, 3):
        return end  # index pages hold nothing we need
    if leaf.max_rep:
        raise PageError("repeated columns are not read")
    if kind == 0:
        page_header = _struct(header, 5, "page header")
        count, encoding = _int(page_header, 1, "data page"), _int(page_header, 2, "data page")
        _check_count(count, rows)
        page = decompress(codec, raw, size)
        pos = 0
        if leaf.max_def:
            length = int.from_bytes(page[:4], "little")
            levels, pos = _levels(page, 4, 4 + length, leaf, count), 4 + length
        else:
            levels = [0] * count
    else:
        page_header = _struct(header, 8, "page header")
        count, encoding = _int(page_header, 1, "data page"), _int(page_header, 4, "data page")
        _check_count(count, rows)
        def_len, rep_len = _int(page_header, 5, "data page"), _int(page_header, 6, "data page")
        if def_len < 0 or rep_len < 0 or rep_len + def_len > len(raw):
            raise PageError("level sections run past the page")
        levels = _levels(raw, rep_len, rep_len + def_len, leaf, count)
        values = raw[rep_len + def_len :]
        if _get(page_header, 7, bool, "data page", True):
            values = decompress(codec, values, size)
        page, pos = values, 0
    present = sum(1 for level in levels if level == leaf.max_def)
    if encoding == 0:
        found = plain_values(leaf.physical, page, pos, present)
    elif encoding in (2, 8):
        if pos >= len(page) and present:
            raise PageError("dictionary indices missing")
        width = page[pos] if present else 0
        indices = hybrid(page, pos + 1, len(page), width, present) if present else []
        if any(i >= len(dictionary) for i in indices):
            raise PageError("a dictionary index past the dictionary")
        found = [dictionary[i] for i in indices]
    else:
        raise PageError(f"encoding {encoding} is not read by shardfs")
    values_iter = iter(found)
    out += [next(values_iter) if level == leaf.max_def else None for level in levels]
    return end


def _check_count(count: int, room: int) -> None:
    """A page's value count fits the rows its row group has left (levels are expanded)."""
    if not 0 <= count <= room:
        raise PageError(f"a page of {count} values where {room} rows are left")


ImageValue = tuple[int, int, bytes]  # (data offset, size, first bytes)


def _image_column(
    reader: CheckedReads, meta: Value, leaf: Leaf, rows: int
) -> list[ImageValue | None]:
    """Where each row's image bytes lie, None for a null image; refuses decoded pages."""
    what = f"column {leaf.dotted}"
    start, end, codec = _chunk_span(reader, meta, what)
    out: list[ImageValue | None] = []
    pos = start
    while pos < end and len(out) < rows:
        header, length, buf = _page_header(reader, pos, end, what)
        try:
            out += _image_page(reader, header, pos, length, buf, end, codec, leaf)
        except (PageError, ValueError) as exc:
            reader.fail(pos, f"{what}: {exc}")
        pos += length + _int(header, 3, "page header")
    if len(out) != rows:
        reader.fail(start, f"{what} holds {len(out)} values for {rows} rows")
    return out


def _image_page(
    reader: CheckedReads,
    header: Struct,
    pos: int,
    length: int,
    buf: bytes,
    end: int,
    codec: int,
    leaf: Leaf,
) -> list[ImageValue | None]:
    kind = _int(header, 1, "page header")
    body = pos + length
    body_end = body + _int(header, 3, "page header")
    if body_end > end or body_end < body:
        raise PageError("a page runs past its column chunk")
    if kind == 2:
        raise PageError(f"the images are dictionary encoded (a dictionary page); {_FIX}")
    if kind not in (0, 3):
        return []
    if leaf.max_rep:
        raise PageError("repeated image columns are not read")
    v2 = kind == 3
    page_header = _struct(header, 8 if v2 else 5, "page header")
    count = _int(page_header, 1, "data page")
    encoding = _int(page_header, 4 if v2 else 2, "data page")
    compressed = codec != 0 and (not v2 or _get(page_header, 7, bool, "data page", True))
    if compressed:
        raise PageError(f"the image page is {_CODECS.get(codec, codec)}-compressed; {_FIX}")
    if encoding != 0:
        raise PageError(f"the image page is {_ENCODINGS.get(encoding, encoding)} encoded; {_FIX}")
    if not 0 <= count <= body_end - body + 1:
        raise PageError(f"{count} values cannot fit the page")

    def at(offset: int, size: int) -> bytes:
        size = min(size, body_end - offset)
        if pos <= offset and offset + size <= pos + len(buf):
            return buf[offset - pos : offset - pos + size]
        return reader.read(offset, size, "an image page")

    if v2:
        rep_len, def_len = _int(page_header, 6, "data page"), _int(page_header, 5, "data page")
        levels_at, values_at = body + rep_len, body + rep_len + def_len
    else:
        def_len = int.from_bytes(at(body, 4), "little") if leaf.max_def else 0
        levels_at = body + 4 if leaf.max_def else body
        values_at = levels_at + def_len
    if def_len < 0 or values_at > body_end:
        raise PageError("the level section runs past the page")
    levels = _levels(at(levels_at, def_len), 0, def_len, leaf, count)
    out: list[ImageValue | None] = []
    cursor = values_at
    for level in levels:
        if level != leaf.max_def:
            out.append(None)
            continue
        head = at(cursor, 4 + SNIFF)
        if len(head) < 4:
            raise PageError("an image's length runs past the page")
        size = int.from_bytes(head[:4], "little")
        if cursor + 4 + size > body_end:
            raise PageError(f"an image of {size} bytes runs past the page")
        out.append((cursor + 4, size, head[4 : 4 + min(size, SNIFF)]))
        cursor += 4 + size
    return out


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
    """A row group's row count and its column chunks' metadata by column path."""
    chunks: dict[tuple[str, ...], Value] = {}
    for chunk in _list(group, 1, "row group"):
        if _get(chunk, 1, bytes, "column chunk", b""):
            raise ValueError("a column chunk in another file is not read")
        meta_data = _get(chunk, 3, dict, "column chunk")
        assert isinstance(meta_data, dict)
        parts = _list(meta_data, 3, "column metadata")
        chunks[tuple(p.decode("utf-8", "replace") for p in parts if isinstance(p, bytes))] = (
            meta_data
        )
    return _int(group, 3, "row group"), chunks


def scan_parquet(shard: ShardBytes) -> list[MemberRow]:
    """The index rows of one parquet shard (module docstring)."""
    try:
        return _scan(CheckedReads(shard))
    except ValueError as exc:  # a field check outside a page's own guard
        raise CorruptShardError(shard.name, 0, f"malformed metadata: {exc}") from None


def _scan(reader: CheckedReads) -> list[MemberRow]:
    shard = reader.shard
    meta, footer_at = _footer(reader)
    try:
        leaves = _leaves(meta)
        image, path_leaf, label_leaf, names = _columns(_hf_features(meta), leaves)
        image_leaf = next(leaf for leaf in leaves if leaf.path == (image, "bytes"))
        groups = [_chunks(group) for group in _list(meta, 4, "row groups")]
    except ValueError as exc:
        reader.fail(footer_at, f"footer: {exc}")
    values: list[ImageValue | None] = []
    labels: list[int | bytes | None] = []
    paths: list[int | bytes | None] = []
    for number, (rows, chunks) in enumerate(groups):
        image_chunk = chunks.get(image_leaf.path)
        if image_chunk is None or not 0 <= rows <= shard.size:
            reader.fail(footer_at, f"footer: row group {number} has no image column or bad rows")
        values += _image_column(reader, image_chunk, image_leaf, rows)
        for leaf, into in ((label_leaf, labels), (path_leaf, paths)):
            chunk_meta = chunks.get(leaf.path) if leaf is not None else None
            if leaf is None or chunk_meta is None:
                into += [None] * rows
            else:
                into += _small_column(reader, chunk_meta, leaf, rows)
    return _rows(shard.name, values, labels, paths, names)


def _rows(
    name: str,
    values: list[ImageValue | None],
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
        path = normalize_member_path(posixpath.join(split, file), name, value[0])
        rows.append((path, value[0], value[1], FILE_MODE, 0, int(MemberKind.FILE), "", own))
    return rows

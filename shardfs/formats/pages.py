"""Parquet's metadata and pages, below the Hugging Face layer of ``parquet``: the footer
and the schema's leaf columns; the reads of a column chunk and its page headers; and the
decoding of pages in memory: the RLE/bit-packed hybrid (definition levels, dictionary
indices), PLAIN values, a pure-Python snappy decoder, and the whole decoding of a page of
a small column (labels, image paths), whose bytes are read whole. Decompression itself is
the caller's (``Clear``: parquet's codecs through ``formats.codecs``). Every length is
checked; malformed input raises ``PageError`` (or the reader's ``CorruptShardError``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .source import CheckedReads
from .thrift import CompactReader, Struct, ThriftError, Value, read_struct
from .thrift import field_of as _get
from .thrift import int_field as _int
from .thrift import list_field as _list
from .thrift import struct_field as _struct
from .thrift import text_field as _text
from .units import PIECES, Unit, pieces_state

MAX_SMALL_COLUMN = 256 << 20  # the label and path columns are read whole
HEADER_READ = 1 << 10  # a page header, its level section and its first value's length
MAX_HEADER = 1 << 20

Clear = Callable[[int, bytes, int], bytes]
"""(codec, stored bytes, decoded size) -> the decoded bytes, exactly that many."""


MAGIC = b"PAR1"
TAIL_READ = 8 << 10  # one read at the end holds a typical footer (datasets: ~7 KB)


class PageError(ValueError):
    """Malformed page data."""


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


def read_footer(reader: CheckedReads) -> tuple[Struct, int]:
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


def schema_leaves(meta: Struct) -> list[Leaf]:
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


def snappy_decompress(
    data: bytes, limit: int, ops: list[tuple[int, int, int, bool]] | None = None
) -> bytes:
    """A raw snappy block (parquet's SNAPPY codec), refused if it expands past ``limit``.
    With ``ops``, each literal run and copy is noted there, as ``units.Op``: (decoded
    offset, length, offset in ``data`` or the copy's decoded source, is a copy)."""
    reader = CompactReader(data)
    try:
        length = reader.varint()
    except ThriftError as exc:
        raise PageError(f"snappy length: {exc.reason}") from None
    if length > limit:
        raise PageError(f"snappy block declares {length} bytes, over the page's {limit}")
    out = bytearray()
    pos = reader.pos
    end = len(data)
    while pos < end:
        tag = data[pos]
        pos += 1
        kind = tag & 3
        if kind == 0:  # literal
            n = tag >> 2
            if n >= 60:
                extra = n - 59
                if pos + extra > end:
                    raise PageError("snappy literal length truncated")
                n = int.from_bytes(data[pos : pos + extra], "little")
                pos += extra
            n += 1
            if pos + n > end or len(out) + n > length:
                raise PageError("snappy literal runs past the block")
            if ops is not None:
                ops.append((len(out), n, pos, False))
            out += data[pos : pos + n]
            pos += n
            continue
        if kind == 1:
            if pos + 1 > end:
                raise PageError("snappy copy truncated")
            n, offset = ((tag >> 2) & 7) + 4, ((tag >> 5) << 8) | data[pos]
            pos += 1
        else:
            width = 2 if kind == 2 else 4
            if pos + width > end:
                raise PageError("snappy copy truncated")
            n, offset = (tag >> 2) + 1, int.from_bytes(data[pos : pos + width], "little")
            pos += width
        if offset == 0 or offset > len(out) or len(out) + n > length:
            raise PageError("snappy copy out of range")
        start = len(out) - offset
        if ops is not None:
            ops.append((len(out), n, start, True))
        while n > 0:  # an overlapping copy repeats the last ``offset`` bytes
            chunk = out[start : start + min(n, offset)]
            out += chunk
            start += len(chunk)
            n -= len(chunk)
    if len(out) != length:
        raise PageError(f"snappy block holds {len(out)} bytes, not the {length} it declares")
    return bytes(out)


def snappy_pieces(unit: Unit, raw: bytes) -> tuple[bytes, Unit, list[tuple[int, int, int]]]:
    """A snappy ``unit`` of images (its ``raw`` bytes) decoded, as a ``pieces`` unit read
    from its literal runs, and those runs (decoded offset, shard offset, length); the unit
    itself, and no runs, when too much of it is copies."""
    ops: list[tuple[int, int, int, bool]] = []
    data = snappy_decompress(raw, unit.size, ops)
    if len(data) != unit.size:
        raise PageError(f"snappy page holds {len(data)} bytes, not {unit.size}")
    state = pieces_state(data, ops)
    if state is None:
        return data, unit, []
    literals = [(at, unit.offset + pos, n) for at, n, pos, copy in ops if not copy]
    return data, Unit(PIECES, unit.offset, unit.length, unit.size, state), literals


def hybrid(data: bytes | bytearray, pos: int, end: int, bit_width: int, count: int) -> list[int]:
    """``count`` values of the RLE/bit-packed hybrid encoding in ``data[pos:end]``."""
    if not 0 <= bit_width <= 32:
        raise PageError(f"bit width {bit_width}")
    reader = CompactReader(bytes(data[:end]), pos)
    values: list[int] = []
    byte_width = (bit_width + 7) // 8
    mask = (1 << bit_width) - 1
    while len(values) < count:
        try:
            header = reader.varint()
        except ThriftError:
            raise PageError("levels or indices run past their section") from None
        if header & 1:  # bit-packed: groups of 8 values in bit_width bytes each
            groups = header >> 1
            size = groups * bit_width
            if reader.pos + size > end or groups == 0:
                raise PageError("a bit-packed run runs past its section")
            packed = int.from_bytes(data[reader.pos : reader.pos + size], "little")
            reader.pos += size
            take = min(groups * 8, count - len(values))
            values += [(packed >> (i * bit_width)) & mask for i in range(take)]
        else:
            run = header >> 1
            if reader.pos + byte_width > end or run == 0:
                raise PageError("an RLE run runs past its section")
            value = int.from_bytes(data[reader.pos : reader.pos + byte_width], "little")
            reader.pos += byte_width
            values += [value] * min(run, count - len(values))
    return values


def plain_values(physical: int, data: bytes, pos: int, count: int) -> list[int | bytes]:
    """``count`` PLAIN values of INT32 (1), INT64 (2) or BYTE_ARRAY (6) from ``pos``."""
    out: list[int | bytes] = []
    if physical in (1, 2):
        width = 4 if physical == 1 else 8
        if pos + width * count > len(data):
            raise PageError(f"{count} PLAIN values run past the page")
        for i in range(count):
            start = pos + i * width
            out.append(int.from_bytes(data[start : start + width], "little", signed=True))
        return out
    if physical == 6:
        for _ in range(count):
            if pos + 4 > len(data):
                raise PageError("a PLAIN byte array's length runs past the page")
            length = int.from_bytes(data[pos : pos + 4], "little")
            pos += 4
            if pos + length > len(data):
                raise PageError("a PLAIN byte array runs past the page")
            out.append(data[pos : pos + length])
            pos += length
        return out
    raise PageError(f"physical type {physical} is not read by shardfs")


def levels_of(page: bytes | bytearray, pos: int, end: int, leaf: Leaf, count: int) -> list[int]:
    if leaf.max_def == 0:
        return [0] * count
    return hybrid(page, pos, end, leaf.max_def.bit_length(), count)


def decode_small_page(
    header: Struct,
    data: bytes,
    body: int,
    codec: int,
    leaf: Leaf,
    dictionary: list[int | bytes],
    out: list[int | bytes | None],
    rows: int,
    clear: Clear,
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
        dictionary[:] = plain_values(leaf.physical, clear(codec, raw, size), 0, count)
        return end
    if kind not in (0, 3):
        return end  # index pages hold nothing we need
    if leaf.max_rep:
        raise PageError("repeated columns are not read")
    if kind == 0:
        page_header = _struct(header, 5, "page header")
        count, encoding = _int(page_header, 1, "data page"), _int(page_header, 2, "data page")
        check_count(count, rows)
        page = clear(codec, raw, size)
        pos = 0
        if leaf.max_def:
            length = int.from_bytes(page[:4], "little")
            levels, pos = levels_of(page, 4, 4 + length, leaf, count), 4 + length
        else:
            levels = [0] * count
    else:
        page_header = _struct(header, 8, "page header")
        count, encoding = _int(page_header, 1, "data page"), _int(page_header, 4, "data page")
        check_count(count, rows)
        def_len, rep_len = _int(page_header, 5, "data page"), _int(page_header, 6, "data page")
        if def_len < 0 or rep_len < 0 or rep_len + def_len > len(raw):
            raise PageError("level sections run past the page")
        levels = levels_of(raw, rep_len, rep_len + def_len, leaf, count)
        values = raw[rep_len + def_len :]
        if _get(page_header, 7, bool, "data page", True):
            values = clear(codec, values, size - rep_len - def_len)
        page, pos = values, 0
    present = sum(1 for level in levels if level == leaf.max_def)
    if encoding == 0:
        found = plain_values(leaf.physical, page, pos, present)
    elif encoding in DICTIONARY_ENCODINGS:
        found = [dictionary[i] for i in dictionary_indices(page, pos, present, len(dictionary))]
    else:
        raise PageError(f"encoding {encoding} is not read by shardfs")
    values_iter = iter(found)
    out += [next(values_iter) if level == leaf.max_def else None for level in levels]
    return end


def check_count(count: int, room: int) -> None:
    """A page's value count fits the rows its row group has left (levels are expanded)."""
    if not 0 <= count <= room:
        raise PageError(f"a page of {count} values where {room} rows are left")


DICTIONARY_ENCODINGS = (2, 8)  # PLAIN_DICTIONARY (parquet 1.0 writers), RLE_DICTIONARY


def dictionary_indices(page: bytes | bytearray, pos: int, count: int, entries: int) -> list[int]:
    """``count`` dictionary indices at ``pos`` (a bit width byte, then the hybrid), each
    checked against the dictionary's ``entries``."""
    if not count:
        return []
    if pos >= len(page):
        raise PageError("dictionary indices missing")
    indices = hybrid(page, pos + 1, len(page), page[pos], count)
    if any(i >= entries for i in indices):
        raise PageError("a dictionary index past the dictionary")
    return indices


def plain_extents(page: bytes | bytearray, pos: int, count: int) -> list[tuple[int, int]]:
    """Where ``count`` PLAIN byte arrays from ``pos`` lie in ``page``: (offset, length)."""
    out = []
    for _ in range(count):
        if pos + 4 > len(page):
            raise PageError("an image's length runs past the page")
        length = int.from_bytes(page[pos : pos + 4], "little")
        if pos + 4 + length > len(page):
            raise PageError(f"an image of {length} bytes runs past the page")
        out.append((pos + 4, length))
        pos += 4 + length
    return out


def page_header(
    reader: CheckedReads, pos: int, end: int, what: str, cached: bool = False
) -> tuple[Struct, int, bytes]:
    """The page header at ``pos``, its length, and the bytes read from ``pos`` (through the
    block cache with ``cached``: a header between pages that are read so anyway)."""
    want = HEADER_READ
    while True:
        buf = reader.read(pos, min(want, end - pos), what, cached)
        try:
            header, length = read_struct(buf)
            return header, length, buf
        except ThriftError as exc:
            if len(buf) >= end - pos or want >= MAX_HEADER:
                reader.fail(pos + exc.offset, f"{what}: page header: {exc.reason}")
            want *= 4


def chunk_span(reader: CheckedReads, meta: Value, what: str) -> tuple[int, int, int]:
    """(start, end, codec) of a column chunk, checked against the file."""
    data_off = _int(meta, 9, what)
    dict_off = _int(meta, 11, what, 0)
    start = dict_off if 4 <= dict_off < data_off else data_off
    end = start + _int(meta, 7, what)
    if start < 4 or end > reader.shard.size - 8 or end < start:
        reader.fail(max(start, 0), f"{what} lies outside the file")
    return start, end, _int(meta, 4, what, 0)


def small_column(
    reader: CheckedReads, meta: Value, leaf: Leaf, rows: int, clear: Clear
) -> list[int | bytes | None]:
    """Every value of a small column chunk, None where null: read whole, then decoded."""
    what = f"column {leaf.dotted}"
    start, end, codec = chunk_span(reader, meta, what)
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
            left = rows - len(out)
            pos = decode_small_page(header, data, body, codec, leaf, dictionary, out, left, clear)
        except (PageError, ValueError) as exc:
            reader.fail(start + pos, f"{what}: {exc}")
    if len(out) != rows:
        reader.fail(start, f"{what} holds {len(out)} values for {rows} rows")
    return out


def page_locations(
    reader: CheckedReads, column: Value, start: int, end: int, rows: int
) -> list[tuple[int, int, int]] | None:
    """The data pages of a column chunk from its offset index (the page index), as
    (offset, size with header, rows), when the chunk has one that tiles ``[start, end)``
    exactly from its first page; else None (the pages are then walked one by one)."""
    try:
        at, length = _int(column, 4, "column chunk", -1), _int(column, 5, "column chunk", -1)
        if at < 4 or length <= 0 or at + length > reader.shard.size - 8 or length > MAX_HEADER:
            return None
        index, _ = read_struct(reader.read(at, length, "the offset index"))
        locations = _list(index, 1, "offset index")
        pages = [(_int(p, 1, "page"), _int(p, 2, "page"), _int(p, 3, "page")) for p in locations]
    except ValueError:  # ThriftError too: an offset index that does not parse is not used
        return None
    out: list[tuple[int, int, int]] = []
    pos = start
    for number, (offset, size, first) in enumerate(pages):
        last = pages[number + 1][2] if number + 1 < len(pages) else rows
        if offset != pos or size <= 0 or not 0 <= first < last <= rows:
            return None
        if number == 0 and first != 0:
            return None
        out.append((offset, size, last - first))
        pos += size
    return out if out and pos == end else None

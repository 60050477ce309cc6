"""Thrift's compact protocol, read only: parquet's footer (``FileMetaData``), its page
headers and its page index are thrift structs. A struct reads as a dict of field id to
value (int, bytes, list or a nested dict), so the parquet module names the fields it uses
and skips the rest. The bytes are untrusted: every length is checked against what is
left, nesting is bounded, and anything malformed raises ``ThriftError``."""

from __future__ import annotations

Struct = dict[int, "Value"]
Value = int | bytes | float | bool | list["Value"] | Struct

MAX_DEPTH = 32  # parquet's structs nest a handful deep; a bound keeps hostile input cheap

# Compact protocol type ids.
_TRUE, _FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE, _BINARY, _LIST, _SET, _MAP, _STRUCT = range(1, 13)


class ThriftError(ValueError):
    """Malformed thrift; ``offset`` is where in the buffer it was found."""

    def __init__(self, offset: int, reason: str) -> None:
        super().__init__(f"{reason} at byte {offset} of a thrift struct")
        self.offset = offset
        self.reason = reason


class CompactReader:
    """Reads compact-protocol values from ``data`` starting at ``pos``."""

    def __init__(self, data: bytes, pos: int = 0) -> None:
        self.data = data
        self.pos = pos

    def _byte(self) -> int:
        if self.pos >= len(self.data):
            raise ThriftError(self.pos, "truncated")
        value = self.data[self.pos]
        self.pos += 1
        return value

    def varint(self) -> int:
        result = shift = 0
        while True:
            byte = self._byte()
            result |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return result
            shift += 7
            if shift > 63:
                raise ThriftError(self.pos, "varint longer than 10 bytes")

    def zigzag(self) -> int:
        value = self.varint()
        return (value >> 1) ^ -(value & 1)

    def _take(self, length: int) -> bytes:
        if length < 0 or self.pos + length > len(self.data):
            raise ThriftError(self.pos, f"a {length}-byte value runs past the end")
        out = self.data[self.pos : self.pos + length]
        self.pos += length
        return out

    def _value(self, kind: int, depth: int) -> Value:
        if kind in (_TRUE, _FALSE):
            return kind == _TRUE
        if kind == _BYTE:
            return self._byte()
        if kind in (_I16, _I32, _I64):
            return self.zigzag()
        if kind == _DOUBLE:
            return float(int.from_bytes(self._take(8), "little"))  # no parquet field we read
        if kind == _BINARY:
            return self._take(self.varint())
        if kind in (_LIST, _SET):
            return self._list(depth)
        if kind == _MAP:
            return self._map(depth)
        if kind == _STRUCT:
            return self.struct(depth + 1)
        raise ThriftError(self.pos, f"unknown type {kind}")

    def _list(self, depth: int) -> list[Value]:
        header = self._byte()
        size, kind = header >> 4, header & 0x0F
        if size == 15:
            size = self.varint()
        if size > len(self.data) - self.pos:  # every element takes at least one byte
            raise ThriftError(self.pos, f"a list of {size} elements runs past the end")
        if kind in (_TRUE, _FALSE):  # list booleans are one byte each: 1 is true
            return [self._byte() == _TRUE for _ in range(size)]
        return [self._value(kind, depth + 1) for _ in range(size)]

    def _map(self, depth: int) -> list[Value]:
        size = self.varint()
        if not size:
            return []
        if 2 * size > len(self.data) - self.pos:
            raise ThriftError(self.pos, f"a map of {size} entries runs past the end")
        kinds = self._byte()
        pairs: list[Value] = []
        for _ in range(size):
            pairs.append([self._value(kinds >> 4, depth + 1), self._value(kinds & 15, depth + 1)])
        return pairs

    def struct(self, depth: int = 0) -> Struct:
        """One struct: its fields by id, up to its STOP byte."""
        if depth > MAX_DEPTH:
            raise ThriftError(self.pos, f"structs nested over {MAX_DEPTH} deep")
        fields: Struct = {}
        last = 0
        while True:
            header = self._byte()
            if header == 0:
                return fields
            delta, kind = header >> 4, header & 0x0F
            field = last + delta if delta else self.zigzag()
            fields[field] = self._value(kind, depth)
            last = field


def read_struct(data: bytes, pos: int = 0) -> tuple[Struct, int]:
    """The struct at ``pos`` of ``data`` and the offset just past it."""
    reader = CompactReader(data, pos)
    return reader.struct(), reader.pos


def field_of(struct: Value, field: int, kind: type, what: str, default: object = None) -> object:
    """A field of a struct, of the given type, or its default when absent; ValueError
    (named by ``what``) when it is missing or of another type."""
    if not isinstance(struct, dict):
        raise ValueError(f"{what}: not a struct")
    value = struct.get(field, default)
    if value is None and default is None:
        raise ValueError(f"{what}: field {field} is missing")
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"{what}: field {field} has the wrong type")
    return value


def int_field(struct: Value, field: int, what: str, default: int | None = None) -> int:
    value = field_of(struct, field, int, what, default)
    assert isinstance(value, int)
    return value


def list_field(struct: Value, field: int, what: str) -> list[Value]:
    value = field_of(struct, field, list, what, [])
    assert isinstance(value, list)
    return value


def text_field(struct: Value, field: int, what: str) -> str:
    value = field_of(struct, field, bytes, what)
    assert isinstance(value, bytes)
    return value.decode("utf-8", "replace")


def struct_field(struct: Value, field: int, what: str) -> Struct:
    value = field_of(struct, field, dict, what)
    assert isinstance(value, dict)
    return value

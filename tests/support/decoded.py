"""Reading a scanned row's bytes without a mount: a direct extent is a slice of the shard,
a slice of a decode unit is decoded from the shard's raw bytes (``formats.codecs``)."""

from __future__ import annotations

import io

from shardfs.formats import codecs
from shardfs.formats.units import DecodedScan, is_decoded


def read_row(data: bytes, scan: object, offset: int, size: int) -> bytes:
    """The bytes a row presents: ``data`` is the whole shard, ``scan`` what its scanner
    returned (a ``DecodedScan`` or a list of rows)."""
    if not is_decoded(offset):
        return data[offset : offset + size]
    assert isinstance(scan, DecodedScan)
    _, unit, within = scan.space.locate(offset)
    if unit.codec in codecs.SEEKABLE:
        opened = codecs.SEEKABLE[unit.codec](unit, io.BytesIO(data))
        try:
            return opened.read_at(within, size)
        finally:
            opened.close()
    return codecs.decode(unit, data[unit.offset : unit.end])[within : within + size]

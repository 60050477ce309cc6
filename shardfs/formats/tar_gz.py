"""Gzip-compressed tars (``.tar.gz``, ``.tgz``) as shards: the whole gzip stream is one
decode unit (``codecs.GZIP_SEEK``) whose decoded bytes are the tar.

The scan reads the shard front to back once (``read_cached``: at mount time those blocks
go to the block cache, so the first epoch downloads nothing again), decodes it through
rapidgzip, which records a seek point about every ``GZIP_SPACING`` raw bytes, and runs
the tar parser over the decoded stream. The unit's state is the exported seek points; a
file is then decoded from the nearest point before it. Concatenated gzip members (``cat
a.gz b.gz``) are one stream. Refused: a stream that does not decode or fails its CRC, one
that decodes to over ``MAX_EXPANSION`` times its size or ``MAX_DECODED`` bytes (a bomb), a
tar cut short (the decoder stops quietly where raw bytes end, so the tar must end in its
end-of-archive block) and every tar refusal (``../`` names, bad headers)."""

from __future__ import annotations

from typing import Any

from .codecs import (
    GZIP_SEEK,
    SCAN_PIECES,
    DecodeError,
    RawFile,
    close_gzip,
    export_gzip,
    gzip_errors,
    open_gzip,
)
from .members import tar_rows
from .source import CheckedReads, ShardBytes
from .tar import BLOCK_SIZE
from .units import MAX_EXPANSION, DecodedScan, DecodedSpace, Unit

MAX_DECODED = 64 << 30  # a shard decoding to more than 64 GiB is refused as a bomb
_READ = 1 << 20  # decoded bytes per read of the scan


class _DecodedTar:
    """The decoded stream the tar parser reads: counted, capped, and remembering whether
    the last block read was all zeros (the tar's end-of-archive marker)."""

    def __init__(self, gz: Any, raw: RawFile, checked: CheckedReads) -> None:
        self._gz = gz
        self._raw = raw
        self._checked = checked
        self._cap = min(MAX_EXPANSION * max(raw.size, 1), MAX_DECODED)
        self.pos = 0
        self.ended = False

    def read(self, n: int = -1, /) -> bytes:
        with gzip_errors(self._raw):
            data: bytes = self._gz.read(n)
        self.pos += len(data)
        if self.pos > self._cap:
            self._checked.fail(
                self._raw.pos,
                f"decodes to more than {self._cap} bytes: a decompression bomb",
            )
        tail = data[-BLOCK_SIZE:]
        self.ended = len(tail) == BLOCK_SIZE and not any(tail)
        return data


def scan_tar_gz(source: ShardBytes) -> DecodedScan:
    """A ``.tar.gz`` shard's rows, their data at decoded offsets of its one unit."""
    checked = CheckedReads(source)
    raw = RawFile(source.read_cached, source.size, keep=SCAN_PIECES)
    gz = open_gzip(raw)
    try:
        stream = _DecodedTar(gz, raw, checked)
        try:
            rows = tar_rows(stream, source.name)
            ended = stream.ended
            while stream.read(_READ):  # the padding after the tar: its CRC is checked too
                pass
            with gzip_errors(raw):
                state = export_gzip(gz)
        except DecodeError as exc:
            checked.fail(raw.pos, str(exc))
    finally:
        close_gzip(gz)
    if not ended:
        checked.fail(raw.pos, f"the tar ends at decoded byte {stream.pos} without its end block")
    space = DecodedSpace()
    start = space.add(Unit(GZIP_SEEK, 0, source.size, stream.pos, state))
    placed = [
        (path, start + at, size, mode, mtime, kind, link, label)
        for path, at, size, mode, mtime, kind, link, label in rows
    ]
    return DecodedScan(placed, space)

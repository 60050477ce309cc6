"""Decoded files through the index, the view and the filesystem core: a scanner that returns
decode units (``formats.units``), its rows stored and reused, each unit's raw bytes read
through the reader once while it stays in the decoded cache, placement at the raw bytes."""

from __future__ import annotations

import io
import zlib
from pathlib import Path

import pytest
from support.inodes import open_path
from support.tarbuild import store_with

from shardfs.config import IndexConfig, ReadConfig, ViewConfig
from shardfs.core.filesystem import XATTR_OFFSET, ShardFileSystem
from shardfs.errors import CorruptShardError
from shardfs.formats import codecs
from shardfs.formats.members import MemberRow
from shardfs.formats.source import ShardBytes
from shardfs.formats.tar import MemberKind
from shardfs.formats.units import DECODED_BASE, DecodedScan, DecodedSpace, Unit
from shardfs.index.db import IndexBuilder
from shardfs.placement import decode_table
from shardfs.read.decoded import DecodedReads
from shardfs.stats import Stats
from shardfs.store.shards import ShardInfo
from shardfs.views.view import View, build_view

DIRECT = b"stored as is " * 50
A, B = b"first file of the unit " * 40, b"second file " * 70
C = bytes(range(256)) * 30


def deflate(data: bytes) -> bytes:
    packer = zlib.compressobj(9, zlib.DEFLATED, -15)
    return packer.compress(data) + packer.flush()


UNIT1, UNIT2 = deflate(A + B), deflate(C)
SHARD = DIRECT + UNIT1 + UNIT2
FILES = {"direct.bin": DIRECT, "u/a.txt": A, "u/b.txt": B, "c.bin": C}


def row(path: str, offset: int, size: int) -> MemberRow:
    return (path, offset, size, 0o644, 0, int(MemberKind.FILE), "", None)


def units_scanner(source: ShardBytes) -> DecodedScan:
    """A made-up format: a direct file, then two deflated units (two files, then one)."""
    space = DecodedSpace()
    first = space.add(Unit("deflate", len(DIRECT), len(UNIT1), len(A) + len(B)))
    second = space.add(Unit("deflate", len(DIRECT) + len(UNIT1), len(UNIT2), len(C)))
    rows = [
        row("direct.bin", 0, len(DIRECT)),
        row("u/a.txt", first, len(A)),
        row("u/b.txt", first + len(A), len(B)),
        row("c.bin", second, len(C)),
    ]
    return DecodedScan(rows, space)


class CountingReader:
    def __init__(self, shards: dict[str, bytes]) -> None:
        self.shards = shards
        self.calls: list[tuple[int, int]] = []

    def read(self, shard: ShardInfo, start: int, end: int, extent_end: int | None = None) -> bytes:
        self.calls.append((start, end))
        return self.shards[shard.name][start:end]

    def read_local(self, shard: ShardInfo, start: int, end: int) -> bytes | None:
        return None


@pytest.fixture
def view(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> View:
    monkeypatch.setattr("shardfs.index.scan.scanner_for", lambda *_: units_scanner)
    store = store_with({"d.zip": SHARD})
    builder = IndexBuilder(store, IndexConfig(cache_dir=tmp_path))
    index = builder.build(store.list_shards())
    assert builder.scanned_shards == 1
    again = IndexBuilder(store, IndexConfig(cache_dir=tmp_path))
    assert again.build(store.list_shards()) == index and again.scanned_shards == 0
    out = tmp_path / "view.sqlite"
    build_view(index, out, ViewConfig(layout="raw"), lambda _folder: None)
    return View(out)


def read_file(fs: ShardFileSystem, path: str) -> bytes:
    handle = open_path(fs, path)
    try:
        return fs.read(handle, 0, 1 << 20)
    finally:
        fs.release(handle)


def test_every_file_reads_back_and_a_unit_is_fetched_once(view: View) -> None:
    reader = CountingReader({"d.zip": SHARD})
    fs = ShardFileSystem(view, reader, ReadConfig(), Stats())
    for path, data in FILES.items():
        assert read_file(fs, path) == data, path
    unit1 = (len(DIRECT), len(DIRECT) + len(UNIT1))
    assert reader.calls.count(unit1) == 1  # two files, one fetch and one decode
    assert fs.decoded.units_decoded == 2
    assert fs.read_node(view.lookup("u/b.txt"), 5, 10) == B[5:15]
    assert reader.calls.count(unit1) == 1


def test_read_local_answers_only_once_the_unit_is_decoded(view: View) -> None:
    fs = ShardFileSystem(view, CountingReader({"d.zip": SHARD}), ReadConfig(), Stats())
    node = view.lookup("c.bin")
    assert node.offset >= DECODED_BASE
    assert fs.read_node_local(node, 0, 100) is None
    assert fs.read_node(node, 0, 100) == C[:100]
    assert fs.read_node_local(node, 100, 50) == C[100:150]
    assert fs.file_bytes_local(node) == C


def test_the_placement_table_places_decoded_files_at_their_raw_bytes(view: View) -> None:
    fs = ShardFileSystem(view, CountingReader({"d.zip": SHARD}), ReadConfig(), Stats())
    table = decode_table(fs.hints.table().data)
    placed = {p: (o, s) for p, o, s in zip(table.paths, table.offsets, table.sizes, strict=True)}
    assert placed["direct.bin"] == (0, len(DIRECT))
    assert placed["u/a.txt"] == placed["u/b.txt"] == (len(DIRECT), len(UNIT1))
    assert placed["c.bin"] == (len(DIRECT) + len(UNIT1), len(UNIT2))
    node = view.lookup("u/b.txt")
    assert fs.node_xattr(node, XATTR_OFFSET) == str(len(DIRECT)).encode()


def test_the_decoded_cache_is_bounded(view: View) -> None:
    reader = CountingReader({"d.zip": SHARD})
    reads = DecodedReads(view, reader, budget=len(C))
    node_a, node_c = view.lookup("u/a.txt"), view.lookup("c.bin")
    shard = view.shards[node_a.shard]
    for node in (node_a, node_c, node_a):
        reads.read(node.shard, shard, node.offset, node.offset + node.size)
    assert reads.units_decoded == 3  # each unit pushed the other out
    assert reads.read_local(node_c.shard, node_c.offset, node_c.offset + 10) is None


def test_bytes_that_do_not_decode_are_a_corrupt_shard(view: View) -> None:
    broken = SHARD[: len(DIRECT)] + b"\xff" * len(UNIT1) + UNIT2
    fs = ShardFileSystem(view, CountingReader({"d.zip": broken}), ReadConfig(), Stats())
    with pytest.raises(CorruptShardError, match="deflate data"):
        read_file(fs, "u/a.txt")
    assert read_file(fs, "c.bin") == C


class _Seekable:
    """A stand-in seekable codec: the unit's raw bytes are its decoded bytes."""

    opened = 0

    def __init__(self, unit: Unit, raw: codecs.RawStream) -> None:
        assert unit.state == b"seek points"
        type(self).opened += 1
        self.unit, self.raw = unit, raw

    def read_at(self, offset: int, length: int) -> bytes:
        self.raw.seek(self.unit.offset + offset)
        return bytes(self.raw.read(length))

    def close(self) -> None:
        self.raw = io.BytesIO()


def test_a_seekable_unit_is_opened_once_and_read_where_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = b"0123456789" * 1000

    def scanner(source: ShardBytes) -> DecodedScan:
        space = DecodedSpace()
        start = space.add(Unit("fake-seek", 0, len(data), len(data), b"seek points"))
        return DecodedScan([row("x", start + 100, 50), row("y", start + 9000, 1000)], space)

    monkeypatch.setattr("shardfs.index.scan.scanner_for", lambda *_: scanner)
    monkeypatch.setitem(codecs.SEEKABLE, "fake-seek", _Seekable)
    monkeypatch.setitem(codecs.POINTS, "fake-seek", lambda unit: [4000])
    store = store_with({"s.zip": data})
    index = IndexBuilder(store, IndexConfig(cache_dir=tmp_path)).build(store.list_shards())
    build_view(index, tmp_path / "v.sqlite", ViewConfig(layout="raw"), lambda _folder: None)
    reader = CountingReader({"s.zip": data})
    fs = ShardFileSystem(View(tmp_path / "v.sqlite"), reader, ReadConfig(), Stats())
    assert read_file(fs, "x") == data[100:150]
    assert read_file(fs, "y") == data[9000:10000]
    assert read_file(fs, "x") == data[100:150]  # its chunk is kept: nothing read again
    assert _Seekable.opened == 1
    # Decoded a chunk at a time, from seek point to seek point (0 and 4000 here).
    assert reader.calls == [(0, 4000), (4000, 10000)]
    across = fs.decoded.read(1, fs.view.shards[1], DECODED_BASE + 3990, DECODED_BASE + 4010)
    assert across == data[3990:4010] and len(reader.calls) == 2  # two kept chunks
    # Without waiting: bytes of a kept chunk, never the first chunk's bytes for another's.
    node_y = fs.view.lookup("y")
    assert fs.read_node_local(node_y, 0, 1000) == data[9000:10000]
    assert fs.file_bytes_local(fs.view.lookup("x")) == data[100:150]
    assert fs.decoded.read_local(1, DECODED_BASE + 3990, DECODED_BASE + 4010) is None


def test_a_chunk_too_large_to_keep_is_read_where_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = bytes(range(256)) * 64

    def scanner(source: ShardBytes) -> DecodedScan:
        space = DecodedSpace()
        start = space.add(Unit("fake-seek", 0, len(data), len(data), b"seek points"))
        return DecodedScan([row("x", start + 100, 50)], space)

    monkeypatch.setattr("shardfs.index.scan.scanner_for", lambda *_: scanner)
    monkeypatch.setitem(codecs.SEEKABLE, "fake-seek", _Seekable)
    store = store_with({"s.zip": data})
    index = IndexBuilder(store, IndexConfig(cache_dir=tmp_path)).build(store.list_shards())
    build_view(index, tmp_path / "v.sqlite", ViewConfig(layout="raw"), lambda _folder: None)
    reader = CountingReader({"s.zip": data})
    view = View(tmp_path / "v.sqlite")
    reads = DecodedReads(view, reader, budget=8 * 1000)  # chunks over 1000 bytes: not kept
    node = view.lookup("x")
    shard = view.shards[node.shard]
    for _ in range(2):
        assert reads.read(node.shard, shard, node.offset, node.offset + 50) == data[100:150]
    assert reader.calls == [(100, 150), (100, 150)]

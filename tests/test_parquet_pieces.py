"""Snappy pages of images read from the bytes they store verbatim (``pieces`` units,
``formats.units``): a snappy block is mostly literal runs when its data is JPEG, so a file
in it is served from the raw bytes under it, with the few bytes snappy's copies make kept in
the unit's state. Checked on blocks compressed by cramjam (the snappy library), and on pages
written by pyarrow (snappy, PLAIN and dictionary, v1 and v2) and by ``datasets`` before 4.6:
every file reads back as its image from its raw span alone, a file inside one literal run
is a direct extent (pushed and served as any), and a block that is mostly copies, or a
damaged state, is not served wrong."""

from __future__ import annotations

import random
from pathlib import Path

import cramjam
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.columnar import Item, make_manifest, write

from shardfs.errors import CorruptShardError
from shardfs.formats import codecs, pages, units
from shardfs.formats.parquet import scan_parquet
from shardfs.formats.source import BytesShard
from shardfs.formats.tar import MemberKind
from shardfs.formats.units import DecodedScan, Unit, is_decoded


def _block(rng: random.Random) -> bytes:
    """Data like a page of JPEGs: each image the same header tables (copied from the image
    before), a short run of one byte (an overlapping copy) and an incompressible body."""
    header = rng.randbytes(600)
    parts = []
    for _ in range(6):
        parts += [header, bytes([rng.randrange(256)]) * 40, rng.randbytes(rng.randrange(1, 30_000))]
    return b"".join(parts)


def _pieces_unit(data: bytes, base: int) -> tuple[Unit, bytes, list[tuple[int, int, int, bool]]]:
    raw = bytes(cramjam.snappy.compress_raw(data))
    ops: list[tuple[int, int, int, bool]] = []
    assert pages.snappy_decompress(raw, len(data), ops) == data
    state = codecs.pieces_state(data, ops)
    assert state is not None
    return Unit(codecs.PIECES, base, len(raw), len(data), state), raw, ops


def _read_from(shard: bytes, log: list[tuple[int, int]]):  # type: ignore[no-untyped-def]
    def read(lo: int, hi: int) -> bytes:
        log.append((lo, hi))
        return shard[lo:hi]

    return read


@pytest.mark.parametrize("seed", range(6))
def test_every_slice_of_a_snappy_block_reads_from_its_raw_span(seed: int) -> None:
    rng = random.Random(seed)
    data = _block(rng)
    base = rng.randrange(0, 5000)
    unit, raw, ops = _pieces_unit(data, base)
    shard = rng.randbytes(base) + raw + rng.randbytes(100)
    assert {copy for *_, copy in ops} == {True, False}  # runs, and copies between them
    _, _, kept = units._segments(unit.state)
    assert len(kept) <= 6 * 40  # at most the byte runs are kept: copies of stored bytes are not
    assert codecs.decode(unit, raw) == data
    for _ in range(300):
        start = rng.randrange(len(data))
        end = rng.randrange(start, min(len(data), start + 200_000) + 1)
        lo, hi = codecs.raw_span(unit, start, end)
        assert base <= lo <= hi <= base + len(raw)
        log: list[tuple[int, int]] = []
        assert codecs.pieces_read(unit, start, end, _read_from(shard, log)) == data[start:end]
        assert all(lo <= a < b <= hi for a, b in log)
        # The bytes read: the slice's own, its copies' sources, tags and merged gaps.
        assert sum(b - a for a, b in log) <= end - start + 64 + len(log) * units.MERGE_GAP


def test_copies_of_stored_bytes_are_stored_pieces_and_overlapping_ones_are_kept() -> None:
    # raw: a 3-byte tag, a literal L, then copy tags; decoded: L, a copy of L's last two
    # bytes 50 times over (it overlaps what it writes: kept), a copy of L's start (stored).
    body = random.Random(3).randbytes(4000)
    raw = b"\x00\x00\x00" + body + b"\x00" * 6
    decoded = body + body[-2:] * 50 + body[:1000]
    # And a copy of bytes partly stored, partly kept: kept.
    decoded += body[3990:] + body[-2:] * 5
    ops = [
        (0, 4000, 3, False),
        (4000, 100, 3998, True),
        (4100, 1000, 0, True),
        (5100, 20, 3990, True),
    ]
    state = codecs.pieces_state(decoded, ops)
    assert state is not None
    _, segments, kept = units._segments(state)
    assert kept == body[-2:] * 50 + body[3990:] + body[-2:] * 5
    assert [(start, length) for start, _, length in segments] == [
        (0, 4000),
        (4000, 100),
        (4100, 1000),
        (5100, 20),
    ]
    assert segments[2][1] == 3  # the copy of L's start reads the literal's raw bytes
    unit = Unit(codecs.PIECES, 100, len(raw), len(decoded), state)
    shard = b"x" * 100 + raw
    cuts = [0, 1, 3999, 4000, 4001, 4099, 4100, 4101, 5099, 5100, 5101, 5119, 5120]
    for start in cuts:
        for end in [c for c in cuts if c >= start]:
            got = codecs.pieces_read(unit, start, end, _read_from(shard, []))
            assert got == decoded[start:end]
    with pytest.raises(codecs.DecodeError):
        codecs.pieces_state(decoded, ops[:2])  # the runs do not cover the block


def test_a_block_of_copies_stays_a_snappy_unit() -> None:
    data = b"\x00" * 50_000 + random.Random(0).randbytes(1000) + b"\x00" * 50_000
    raw = bytes(cramjam.snappy.compress_raw(data))
    ops: list[tuple[int, int, int, bool]] = []
    assert pages.snappy_decompress(raw, len(data), ops) == data
    assert codecs.pieces_state(data, ops) is None  # it would keep most of the page


def test_a_damaged_pieces_state_is_refused_not_served() -> None:
    rng = random.Random(7)
    data = _block(rng)
    unit, raw, _ = _pieces_unit(data, 0)
    for state in (b"", b"\x09\x00\x00\x00", unit.state[:40]):
        bad = Unit(codecs.PIECES, 0, unit.length, unit.size, state)
        with pytest.raises(codecs.DecodeError):
            codecs.decode(bad, raw)
    # Two segments swapped: they no longer lie end to end.
    count, size = 4, 24
    table = unit.state[count : count + 2 * size]
    swapped = unit.state[:count] + table[size:] + table[:size] + unit.state[count + 2 * size :]
    with pytest.raises(codecs.DecodeError):
        codecs.decode(Unit(codecs.PIECES, 0, unit.length, unit.size, swapped), raw)


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Item]]:
    root = tmp_path_factory.mktemp("pieces")
    items = make_manifest(root, {"train": 40, "validation": 5}, image_bytes=20_000)
    small = ["--data-page-size", "4000", "--write-batch-size", "2"]
    write("pyarrow_parquet.py", root, root / "snappy-dict", "--hf")
    write("pyarrow_parquet.py", root, root / "snappy-plain", "--hf", "--no-dictionary", *small)
    v2 = ["--data-page-version", "2.0", "--no-dictionary"]
    write("pyarrow_parquet.py", root, root / "snappy-v2", "--hf", *v2)
    write("hf_parquet.py", root, root / "datasets-legacy", "--legacy", "--shards", "1")
    return root, items


@pytest.mark.parametrize("name", ["snappy-dict", "snappy-plain", "snappy-v2", "datasets-legacy"])
def test_snappy_image_pages_are_served_from_their_literal_runs(
    written: tuple[Path, list[Item]], name: str
) -> None:
    root, items = written
    path = root / name / "data" / "train-00000-of-00001.parquet"
    data = path.read_bytes()
    scan = scan_parquet(BytesShard(path.name, data))
    assert isinstance(scan, DecodedScan)
    assert {u.codec for u in scan.space.units} == {codecs.PIECES}
    expected = {i.name: i.data() for i in items if i.split == "train"}
    files = [r for r in scan.rows if r[5] == MemberKind.FILE]
    assert sorted(r[0].rsplit("/", 1)[-1] for r in files) == sorted(expected)
    direct = 0
    for row in files:
        want = expected[row[0].rsplit("/", 1)[-1]]
        offset, size = row[1], row[2]
        if not is_decoded(offset):  # inside one literal run: a direct extent
            direct += 1
            assert data[offset : offset + size] == want
            continue
        _, unit, within = scan.space.locate(offset)
        log: list[tuple[int, int]] = []
        assert codecs.pieces_read(unit, within, within + size, _read_from(data, log)) == want
        assert sum(b - a for a, b in log) <= size + 64 + len(log) * units.MERGE_GAP
    # 20 KB noise JPEGs: a third to two thirds of them lie in one literal run (the others
    # cross a 64 KiB fragment of the compressor, or hold a copy of their own tables).
    assert direct >= len(files) // 4


def test_a_pieces_unit_whose_raw_bytes_changed_fails_as_corrupt(
    written: tuple[Path, list[Item]], tmp_path: Path
) -> None:
    """The reads of a pieces file check what they are given: a shard cut short under it
    gives CorruptShardError from the reader (never short or shifted bytes)."""
    from shardfs.read.decoded import DecodedReads

    root, _ = written
    path = root / "datasets-legacy" / "data" / "train-00000-of-00001.parquet"
    data = path.read_bytes()
    scan = scan_parquet(BytesShard(path.name, data))
    assert isinstance(scan, DecodedScan)
    row = next(r for r in scan.rows if r[5] == MemberKind.FILE and is_decoded(r[1]))
    index, unit, _ = scan.space.locate(row[1])
    start = scan.space.starts[index]

    class Units:
        def unit_at(self, shard: int, offset: int, *, state: bool = False) -> tuple[int, Unit]:
            return start, unit

    class ShortReader:
        def read(self, shard: object, lo: int, hi: int, end: int | None = None) -> bytes:
            return data[lo : hi - 1]  # one byte short

    class Shard:
        name = path.name

    reads = DecodedReads(Units(), ShortReader())  # type: ignore[arg-type]
    with pytest.raises(CorruptShardError, match="pieces"):
        reads.read(0, Shard(), row[1], row[1] + row[2])  # type: ignore[arg-type]


@settings(max_examples=150, deadline=None)
@given(
    parts=st.lists(
        st.one_of(st.binary(min_size=1, max_size=3000), st.sampled_from([b"\0" * 300, b"ab" * 90])),
        min_size=1,
        max_size=12,
    ),
    cut=st.integers(0, 1 << 16),
)
def test_any_snappy_block_either_reads_back_from_its_pieces_or_stays_decoded(
    parts: list[bytes], cut: int
) -> None:
    """Whatever the block holds: its pieces read every slice back, or (mostly copies)
    it stays a codec unit; a block cut short is refused by the decoder, never pieced."""
    data = b"".join(parts)
    raw = bytes(cramjam.snappy.compress_raw(data))
    ops: list[tuple[int, int, int, bool]] = []
    assert pages.snappy_decompress(raw, len(data), ops) == data
    state = codecs.pieces_state(data, ops)
    if state is not None:
        unit = Unit(codecs.PIECES, 0, len(raw), len(data), state)
        start = cut % (len(data) + 1)
        for end in (start, (start + len(data)) // 2 + 1, len(data)):
            end = min(max(end, start), len(data))
            assert codecs.pieces_read(unit, start, end, _read_from(raw, [])) == data[start:end]
    short = raw[: cut % len(raw)]
    with pytest.raises(pages.PageError):
        pages.snappy_decompress(short, len(data), [])


@pytest.mark.parametrize("holds", [True, False])
def test_pieces_files_are_read_by_range_under_a_small_cache_and_whole_under_a_full_one(
    written: tuple[Path, list[Item]], holds: bool
) -> None:
    """A cache that holds the dataset: the first file of a pieces unit reads the unit's raw
    bytes once, and the others are slices of memory (no read at all). A dataset far larger
    than the block cache and the decoded-unit budget: each file reads only the raw bytes
    under it, so a shuffled epoch does not fetch whole pages for single images."""
    from shardfs.read.decoded import DecodedReads

    root, items = written
    path = root / "datasets-legacy" / "data" / "train-00000-of-00001.parquet"
    data = path.read_bytes()
    scan = scan_parquet(BytesShard(path.name, data))
    assert isinstance(scan, DecodedScan)
    space = scan.space
    rows = [r for r in scan.rows if r[5] == MemberKind.FILE and is_decoded(r[1])]
    assert len(rows) > 4

    class Units:
        def unit_at(self, shard: int, offset: int, *, state: bool = False) -> tuple[int, Unit]:
            index, unit, _ = space.locate(offset)
            return space.starts[index], unit

    class Reader:
        def __init__(self) -> None:
            self.reads: list[tuple[int, int]] = []

        def cache_holds_dataset(self, beside: int = 0) -> bool:  # a CachedReader's question
            limit = 2 * len(data) if holds else len(data) // 2
            dataset = len(data) if holds else 1000 * len(data)  # beside the budget too
            return dataset <= limit + beside

        def read(self, shard: object, lo: int, hi: int, end: int | None = None) -> bytes:
            self.reads.append((lo, hi))
            return data[lo:hi]

        def read_local(self, shard: object, lo: int, hi: int) -> bytes | None:
            return None  # nothing is local: only kept units answer without a read

    class Shard:
        name = path.name

    reader = Reader()
    reads = DecodedReads(Units(), reader)  # type: ignore[arg-type]
    want = {i.name: i.data() for i in items if i.split == "train"}
    by_name = {r[0].rsplit("/", 1)[-1]: r for r in rows}
    first, *rest = by_name
    row = by_name[first]
    assert reads.read(0, Shard(), row[1], row[1] + row[2]) == want[first]  # type: ignore[arg-type]
    for name in rest:
        row = by_name[name]
        local = reads.read_local(0, row[1], row[1] + row[2], Shard())  # type: ignore[arg-type]
        if holds:
            assert local == want[name]
        else:
            assert local is None
            assert reads.read(0, Shard(), row[1], row[1] + row[2]) == want[name]  # type: ignore[arg-type]
    held = {space.locate(r[1])[1] for r in rows}
    fetched = sum(hi - lo for lo, hi in reader.reads)
    if holds:
        assert reader.reads == [(u.offset, u.end) for u in held] and reads.units_decoded == 1
    else:
        assert len(reader.reads) >= len(rows) and reads.units_decoded == 0
        assert fetched <= sum(r[2] for r in rows) + len(reader.reads) * units.MERGE_GAP

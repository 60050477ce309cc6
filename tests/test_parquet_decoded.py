"""Parquet whose image pages are compressed or dictionary encoded (pyarrow's defaults, and
``datasets`` before 4.6), written by the real tools (tests/support/columnar.py): every
image row decodes (through its page's decode unit, tests/support/decoded.py) to the source
image's bytes with its label; uncompressed pages stay direct extents; bombs, truncated and
corrupt pages and unknown codecs are refused in one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from support.columnar import Item, make_manifest, write
from support.decoded import read_row

from shardfs.errors import CorruptShardError
from shardfs.formats import pages, parquet
from shardfs.formats.members import MemberRow
from shardfs.formats.parquet import scan_parquet
from shardfs.formats.source import BytesShard
from shardfs.formats.tar import MemberKind
from shardfs.formats.thrift import CompactReader, read_struct
from shardfs.formats.units import MAX_EXPANSION, DecodedScan

SMALL_PAGES = ["--data-page-size", "4000", "--write-batch-size", "2"]
# name -> pyarrow_parquet.py options (all with the huggingface footer).
PYARROW = {
    "snappy-dict": [*SMALL_PAGES, "--row-group-size", "5"],
    "snappy-dict-fallback": [*SMALL_PAGES, "--dictionary-pagesize-limit", "8000"],
    "gzip-dict": ["--compression", "gzip"],
    "zstd-dict": ["--compression", "zstd"],
    "snappy-plain": ["--no-dictionary", *SMALL_PAGES],
    "snappy-dict-v2": ["--data-page-version", "2.0", *SMALL_PAGES],
    "zstd-plain-v2": ["--data-page-version", "2.0", "--compression", "zstd", "--no-dictionary"],
    "none-dict": ["--compression", "none"],
    "none-plain-index": ["--compression", "none", "--no-dictionary", "--page-index", *SMALL_PAGES],
}
STORED = ("none-dict", "none-plain-index")


class CountingShard(BytesShard):
    """A shard in memory that records the ranges read for the block cache."""

    def __init__(self, name: str, data: bytes) -> None:
        super().__init__(name, data)
        self.cached: list[tuple[int, int]] = []

    def read_cached(self, offset: int, length: int) -> bytes:
        self.cached.append((offset, length))
        return super().read_cached(offset, length)


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Item]]:
    root = tmp_path_factory.mktemp("decoded")
    items = make_manifest(root, {"train": 12, "validation": 5})
    for name, options in PYARROW.items():
        write("pyarrow_parquet.py", root, root / name, "--hf", *options)
    write("hf_parquet.py", root, root / "datasets-legacy", "--legacy", "--shards", "2")
    return root, items


def _scan(path: Path) -> tuple[list[MemberRow] | DecodedScan, CountingShard]:
    shard = CountingShard(path.name, path.read_bytes())
    return scan_parquet(shard), shard


def _files(scan: list[MemberRow] | DecodedScan) -> list[MemberRow]:
    rows = scan.rows if isinstance(scan, DecodedScan) else scan
    return [row for row in rows if row[5] == MemberKind.FILE]


def _check(path: Path, expected: list[Item]) -> list[MemberRow] | DecodedScan:
    """Every image row's bytes and label are the source's, in order; the class folders
    come from the footer; unit bytes are read through the block cache."""
    scan, shard = _scan(path)
    data = path.read_bytes()
    files = _files(scan)
    assert [read_row(data, scan, r[1], r[2]) for r in files] == [i.data() for i in expected]
    assert [r[7] for r in files] == [None if i.label < 0 else i.label for i in expected]
    assert [r[0].rsplit("/", 1)[-1] for r in files] == [i.name for i in expected]
    rows = scan.rows if isinstance(scan, DecodedScan) else scan
    split = expected[0].split
    folders = [(r[0], r[7]) for r in rows if r[5] == MemberKind.DIRECTORY]
    assert folders == [(f"{split}/0_zebra", 0), (f"{split}/1_apple", 1), (f"{split}/2_mango", 2)]
    if isinstance(scan, DecodedScan):
        units = scan.space.units
        assert {(u.offset, u.length) for u in units} <= set(shard.cached)
        assert [u.offset for u in units] == sorted(u.offset for u in units)
    else:
        assert not shard.cached  # stored pages: small exact reads, nothing for the cache
    return scan


@pytest.mark.parametrize("name", [n for n in PYARROW if n not in STORED])
def test_compressed_pages_decode_to_the_images(written: tuple[Path, list[Item]], name: str) -> None:
    root, items = written
    codec = name.split("-")[0]
    for split in ("train", "validation"):
        path = root / name / "data" / f"{split}-00000-of-00001.parquet"
        scan = _check(path, [i for i in items if i.split == split])
        assert isinstance(scan, DecodedScan)
        assert {u.codec for u in scan.space.units} == {codec}
    if name in ("snappy-dict", "snappy-plain", "snappy-dict-fallback"):
        # Several image pages per row group (small pages); each PLAIN page is its own unit.
        scan, _ = _scan(root / name / "data" / "train-00000-of-00001.parquet")
        assert isinstance(scan, DecodedScan) and len(scan.space.units) > 2


def test_datasets_before_4_6_decode(written: tuple[Path, list[Item]]) -> None:
    root, items = written
    for path in sorted((root / "datasets-legacy" / "data").glob("*.parquet")):
        split = path.name.split("-")[0]
        scan, _ = _scan(path)
        names = [r[0].rsplit("/", 1)[-1] for r in _files(scan)]
        expected = [next(i for i in items if i.name == n and i.split == split) for n in names]
        assert isinstance(_check(path, expected), DecodedScan)


def test_an_uncompressed_dictionary_is_served_as_extents(
    written: tuple[Path, list[Item]],
) -> None:
    root, items = written
    path = root / "none-dict" / "data" / "train-00000-of-00001.parquet"
    scan = _check(path, [i for i in items if i.split == "train"])
    assert isinstance(scan, list)  # no units: each image a range of the dictionary page


def test_stored_pages_listed_by_the_page_index_are_read_side_by_side(
    written: tuple[Path, list[Item]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With an offset index, the stored pages' small reads run in threads; the rows equal
    those of the page by page walk, which a bad offset index falls back to."""
    root, items = written
    path = root / "none-plain-index" / "data" / "train-00000-of-00001.parquet"
    calls: list[bool] = []
    at_once = parquet._pages_at_once

    def recorded(*args: Any) -> object:
        found = at_once(*args)
        calls.append(found is not None)
        return found

    monkeypatch.setattr(parquet, "_pages_at_once", recorded)
    scan = _check(path, [i for i in items if i.split == "train"])
    assert calls == [True]  # the first row group's pages at once (the second has one page)
    serial = scan_parquet(BytesShard(path.name, path.read_bytes()))
    calls.clear()
    monkeypatch.setattr(parquet, "page_locations", lambda *args: None)
    assert scan_parquet(BytesShard(path.name, path.read_bytes())) == serial == scan
    assert calls == []
    # An offset index whose first page's size is off: the pages at once disagree, so the
    # walk page by page decides (and finds the same rows).
    monkeypatch.undo()
    monkeypatch.setattr(parquet, "_pages_at_once", recorded)
    real = pages.page_locations

    def skewed(*args: Any) -> list[tuple[int, int, int]] | None:
        found = real(*args)
        if found is None or len(found) < 2:
            return found
        (offset, size, count), (offset2, size2, count2), *rest = found
        return [(offset, size + 1, count), (offset2 + 1, size2 - 1, count2), *rest]

    monkeypatch.setattr(parquet, "page_locations", skewed)
    assert scan_parquet(BytesShard(path.name, path.read_bytes())) == serial
    assert calls == [False]


def test_rows_that_share_a_dictionary_value(tmp_path: Path) -> None:
    items = make_manifest(tmp_path, {"train": 4})
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    first = dict(manifest["splits"]["train"][0], name="again.jpg")
    manifest["splits"]["train"].append(first)
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    for codec in ("snappy", "none"):
        write("pyarrow_parquet.py", tmp_path, tmp_path / codec, "--hf", "--compression", codec)
        path = tmp_path / codec / "data" / "train-00000-of-00001.parquet"
        again = Item(items[0].file, "again.jpg", "train", items[0].label)
        scan = _check(path, [*items, again])
        files = _files(scan)
        assert files[0][1:3] == files[-1][1:3]  # the same bytes, two files


def _page_sizes(data: bytes, pos: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Where a page header's uncompressed and compressed size varints lie (fields 2, 3)."""
    reader = CompactReader(data, pos)
    spans, field = {}, 0
    for _ in range(3):  # short-form field headers: the id's delta, then the type (i32)
        field += reader.data[reader.pos] >> 4
        reader.pos += 1
        start = reader.pos
        reader.varint()
        spans[field] = (start, reader.pos)
    return spans[2], spans[3]


def _set_varint(data: bytearray, span: tuple[int, int], value: int) -> None:
    """Overwrite a zigzag varint in place, padded to its old width (the reader takes
    non-minimal varints)."""
    zigzag, width = value << 1, span[1] - span[0]
    assert zigzag < 1 << (7 * width)
    for index in range(width):
        more = 0x80 if index < width - 1 else 0
        data[span[0] + index] = (zigzag >> (7 * index)) & 0x7F | more


def _first_image_page(path: Path) -> tuple[bytearray, int, int, int]:
    """A file's bytes, and the header offset, body offset and stored size of the page that
    holds its first decode unit: the pages are walked from the file's first page."""
    data = bytearray(path.read_bytes())
    scan = scan_parquet(BytesShard(path.name, bytes(data)))
    assert isinstance(scan, DecodedScan)
    unit = scan.space.units[0]
    pos = 4
    while pos < unit.offset:
        header, body = read_struct(bytes(data), pos)
        stored = header[3]
        assert isinstance(stored, int)
        if body <= unit.offset < body + stored:
            return data, pos, body, stored
        pos = body + stored
    raise AssertionError("no page holds the first unit")


def _refused(data: bytes, name: str = "x.parquet") -> str:
    with pytest.raises(CorruptShardError) as caught:
        scan_parquet(BytesShard(name, data))
    message = str(caught.value)
    assert "\n" not in message and "at offset" in message and name in message
    return message


@pytest.mark.parametrize("name", ["snappy-plain", "gzip-dict", "zstd-plain-v2"])
def test_bad_pages_are_refused_in_one_line(written: tuple[Path, list[Item]], name: str) -> None:
    root, _ = written
    path = root / name / "data" / "train-00000-of-00001.parquet"
    data, header, body, stored = _first_image_page(path)
    uncompressed, compressed = _page_sizes(bytes(data), header)
    # A declared size the body does not decode to.
    wrong = bytearray(data)
    old = CompactReader(bytes(data), uncompressed[0]).zigzag()
    _set_varint(wrong, uncompressed, old + 7)
    assert "column image.bytes" in _refused(bytes(wrong))
    # A truncated body: its stored size shortened (the page decodes to fewer bytes).
    cut = bytearray(data)
    _set_varint(cut, compressed, stored - 64)
    _refused(bytes(cut))
    # A corrupt body (its start: the codec's own header; inside a literal, neither snappy
    # nor parquet without page checksums can tell).
    bad = bytearray(data)
    bad[body : body + 64] = b"\xff" * 64
    _refused(bytes(bad))


def test_a_page_bomb_is_refused(tmp_path: Path) -> None:
    """A zstd page of zeros decodes to far more than MAX_EXPANSION times its bytes."""
    image = tmp_path / "zeros.jpg"
    image.write_bytes(b"\xff\xd8\xff" + bytes(8 << 20))
    manifest = {
        "classes": ["a"],
        "splits": {"train": [{"file": str(image), "name": "z.jpg", "label": 0}]},
    }
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    out = tmp_path / "bomb"
    write("pyarrow_parquet.py", tmp_path, out, "--compression", "zstd", "--no-dictionary")
    path = out / "data" / "train-00000-of-00001.parquet"
    assert path.stat().st_size * MAX_EXPANSION < image.stat().st_size  # really a bomb
    message = _refused(path.read_bytes())
    assert "decompression bomb" in message


@pytest.mark.parametrize(("codec", "named"), [("brotli", "BROTLI"), ("lz4", "LZ4")])
def test_unknown_codecs_are_refused_naming_them(
    written: tuple[Path, list[Item]], codec: str, named: str
) -> None:
    root, _ = written
    out = root / f"codec-{codec}"
    write("pyarrow_parquet.py", root, out, "--compression", codec)
    message = _refused((out / "data" / "train-00000-of-00001.parquet").read_bytes())
    assert f"{named}" in message and "column image.bytes" in message


def test_tiny_images_are_indexed_by_stretches_of_their_page_through_the_cache(
    tmp_path: Path,
) -> None:
    """Images under ``SMALL_IMAGE`` bytes (the 1.28M-entry scale bench writes 8-byte ones):
    their page is read by stretches through the block cache, a few reads a file, not one
    per image; every row still reads back as the image."""
    import subprocess

    from support.columnar import WRITERS, writers_python

    writer = [str(writers_python()), str(WRITERS / "hf_parquet_tiny.py")]
    subprocess.run([*writer, str(tmp_path), "10", "300", "1"], check=True, capture_output=True)
    path = tmp_path / "data" / "train-00000-of-00001.parquet"
    data = path.read_bytes()
    shard = CountingShard("data/train-00000-of-00001.parquet", data)
    scan = scan_parquet(shard)
    rows = scan.rows if isinstance(scan, DecodedScan) else scan
    files = [r for r in rows if r[5] == MemberKind.FILE]
    assert len(files) == 3000
    assert {read_row(data, scan, r[1], r[2]) for r in files} == {b"\xff\xd8tiny\xff\xd9"}
    assert sorted({r[7] for r in files}) == list(range(10))
    assert shard.reads < 100  # was one read per image
    assert shard.cached  # the stretches went to the block cache

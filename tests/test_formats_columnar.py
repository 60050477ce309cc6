"""The parquet and MDS parsers over files written by the real tools (``datasets``'
to_parquet, pyarrow, streaming's MDSWriter; tests/support/columnar.py): every image row is
the source image's exact byte range with its label, what cannot be served is refused in
one line, and arbitrary or mutated bytes give rows within the file or the project's error."""

from __future__ import annotations

from pathlib import Path

import cramjam
import pytest
from fuzz_target import check_decoded
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.columnar import CLASSES, Item, make_manifest, write
from support.decoded import read_row

from shardfs.errors import CorruptShardError
from shardfs.formats import codecs
from shardfs.formats.classes import class_folders
from shardfs.formats.mds import scan_mds, scan_mds_zstd
from shardfs.formats.members import MemberRow
from shardfs.formats.parquet import scan_parquet, split_of
from shardfs.formats.registry import scanner_for
from shardfs.formats.source import BytesShard
from shardfs.formats.tar import MemberKind
from shardfs.formats.units import MAX_EXPANSION, DecodedScan, is_decoded


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Item]]:
    root = tmp_path_factory.mktemp("columnar")
    items = make_manifest(root, {"train": 12, "validation": 5})
    write("hf_parquet.py", root, root / "hf", "--shards", "2")
    write("hf_parquet.py", root, root / "hf_nopath", "--no-paths")
    write("pyarrow_parquet.py", root, root / "pa")
    write("mds.py", root, root / "mds", "--size-limit", "20000")
    write("mds.py", root, root / "mds_bytes", "--encoding", "bytes")
    write("mds.py", root, root / "mdsz", "--compression", "zstd")
    return root, items


def _scan(path: Path, root: Path) -> tuple[list[MemberRow], BytesShard]:
    shard = BytesShard(path.relative_to(root).as_posix(), path.read_bytes())
    scanner = scanner_for(shard.name)
    assert scanner is not None
    rows = scanner(shard)
    assert isinstance(rows, list)  # these fixtures hold no decode units
    return rows, shard


def _files(rows: list[MemberRow]) -> list[MemberRow]:
    return [row for row in rows if row[5] == MemberKind.FILE]


def _check_images(rows: list[MemberRow], data: bytes, expected: list[Item]) -> None:
    """The rows' byte ranges are the expected images, in order, with their labels."""
    files = _files(rows)
    assert [data[r[1] : r[1] + r[2]] for r in files] == [i.data() for i in expected]
    assert [r[7] for r in files] == [None if i.label < 0 else i.label for i in expected]


def test_datasets_parquet_rows_are_the_images_and_labels(written: tuple[Path, list[Item]]) -> None:
    root, items = written
    shards = sorted((root / "hf" / "data").glob("*.parquet"))
    assert len(shards) == 4
    seen = []
    for path in shards:
        rows, shard = _scan(path, root / "hf")
        split = split_of(path.name)
        files = _files(rows)
        names = [r[0].split("/")[-1] for r in files]
        expected = [next(i for i in items if i.name == n and i.split == split) for n in names]
        _check_images(rows, path.read_bytes(), expected)
        assert all(r[0].startswith(f"{split}/") for r in rows)
        # Every class is declared (also one no image of this shard has), by label, with
        # folder names that sort in label order although the names do not.
        folders = [(r[0], r[7]) for r in rows if r[5] == MemberKind.DIRECTORY]
        assert folders == [
            (f"{split}/0_zebra", 0),
            (f"{split}/1_apple", 1),
            (f"{split}/2_mango", 2),
        ]
        # The footer, each page's header and each image's length: no image bytes read.
        assert shard.reads <= 4 + 2 * len(files)
        seen += expected
    assert sorted(i.name for i in seen) == sorted(i.name for i in items)


def test_row_index_names_without_image_path(written: tuple[Path, list[Item]]) -> None:
    root, items = written
    path = root / "hf_nopath" / "data" / "train-00000-of-00001.parquet"
    rows, _ = _scan(path, root / "hf_nopath")
    names = [r[0] for r in _files(rows)]
    assert names == [f"train/train-00000-of-00001-{row:06d}.jpg" for row in range(12)]
    _check_images(rows, path.read_bytes(), [i for i in items if i.split == "train"])


@pytest.mark.parametrize("folder", ["mds", "mds_bytes"])
def test_mds_rows_are_the_images_and_labels(written: tuple[Path, list[Item]], folder: str) -> None:
    root, items = written
    for split in ("train", "validation"):
        expected = [i for i in items if i.split == split]
        found: list[bytes] = []
        labels: list[int | None] = []
        for path in sorted((root / folder / split).glob("*.mds")):
            rows, shard = _scan(path, root / folder)
            data = path.read_bytes()
            found += [data[r[1] : r[1] + r[2]] for r in rows]
            labels += [r[7] for r in rows]
            assert all(r[0].endswith(".jpg") for r in rows)
            assert shard.reads <= 1 + 2 * len(rows)  # the front, then a few bytes a sample
        assert found == [i.data() for i in expected]
        assert labels == [None if i.label < 0 else i.label for i in expected]
    assert len(list((root / "mds" / "train").glob("*.mds"))) > 1


def test_zstd_mds_rows_decode_to_the_images_and_labels(written: tuple[Path, list[Item]]) -> None:
    """MDSWriter(compression='zstd'): one zstd frame of a plain shard per file, one decode
    unit whose size is the frame's declared content size; the rows are the images."""
    root, items = written
    for split in ("train", "validation"):
        expected = [i for i in items if i.split == split]
        paths = sorted((root / "mdsz" / split).glob("*.mds.zstd"))
        assert paths
        found: list[bytes] = []
        labels: list[int | None] = []
        for path in paths:
            data = path.read_bytes()
            shard = BytesShard(path.relative_to(root / "mdsz").as_posix(), data)
            scan = scanner_for(shard.name)(shard)  # type: ignore[misc]
            assert isinstance(scan, DecodedScan)
            (unit,) = scan.space.units
            plain = codecs.decode(unit, data)
            assert (unit.codec, unit.offset, unit.length) == ("zstd", 0, len(data))
            offsets = [r[1] - scan.space.starts[0] for r in scan.rows]
            assert offsets == [r[1] for r in scan_mds(BytesShard("plain.mds", plain))]
            files = _files(scan.rows)
            found += [read_row(data, scan, r[1], r[2]) for r in files]
            labels += [r[7] for r in files]
            stem = path.name.removesuffix(".mds.zstd")
            assert all(r[0].startswith(f"{stem}-") and r[0].endswith(".jpg") for r in files)
        assert found == [i.data() for i in expected]
        assert labels == [None if i.label < 0 else i.label for i in expected]


def _plain_mds(written: tuple[Path, list[Item]]) -> bytes:
    root, _ = written
    return (root / "mds_bytes" / "validation" / "shard.00000.mds").read_bytes()


def test_zstd_mds_without_content_sizes_or_in_several_frames(
    written: tuple[Path, list[Item]],
) -> None:
    """Frames that do not declare their size (a streaming compressor's) are decoded under
    the cap and measured; concatenated frames are one unit; rows equal the plain shard's."""
    plain = _plain_mds(written)
    stream = cramjam.zstd.Compressor()
    stream.compress(plain)
    no_size = bytes(stream.finish())
    assert no_size[4] >> 6 == 0 and not no_size[4] & 0x20  # no Frame_Content_Size
    half = len(plain) // 2
    two = bytes(cramjam.zstd.compress(plain[:half])) + bytes(cramjam.zstd.compress(plain[half:]))
    images = [plain[r[1] : r[1] + r[2]] for r in scan_mds(BytesShard("s.mds", plain))]
    for data in (no_size, two):
        scan = scan_mds_zstd(BytesShard("val/shard.00000.mds.zstd", data))
        assert scan.space.units[0].size == len(plain)
        assert [read_row(data, scan, r[1], r[2]) for r in scan.rows] == images


def _declaring(written: tuple[Path, list[Item]], content_size: int) -> bytes:
    """A real frame (of a plain shard and padding, so that its Frame_Content_Size field is
    4 bytes, right after the descriptor) that declares ``content_size``."""
    frame = bytearray(cramjam.zstd.compress(_plain_mds(written) + bytes(70_000)))
    assert frame[4] >> 6 == 2 and frame[4] & 0x20
    frame[5:9] = content_size.to_bytes(4, "little")
    return bytes(frame)


@pytest.mark.parametrize(
    ("case", "needle"),
    [
        ("not zstd", "not zstd"),
        ("truncated frame", "truncated zstd frame"),
        ("content size bomb", "decompression bomb"),
        ("wrong content size", "does not decode"),
        ("decodes to no MDS shard", "of the decoded shard"),
        ("empty", "too short for a zstd frame"),
    ],
)
def test_a_bad_zstd_mds_shard_is_refused_naming_it(
    written: tuple[Path, list[Item]], case: str, needle: str
) -> None:
    real = bytes(cramjam.zstd.compress(_plain_mds(written)))
    size = len(_plain_mds(written)) + 70_000
    data = {
        "not zstd": _plain_mds(written),
        "truncated frame": real[: len(real) // 2],
        "content size bomb": _declaring(written, MAX_EXPANSION * len(_declaring(written, 0)) + 1),
        "wrong content size": _declaring(written, size - 7),
        "decodes to no MDS shard": bytes(cramjam.zstd.compress(b"\xff" * 5000)),
        "empty": b"",
    }[case]
    name = "ds/train/shard.00000.mds.zstd"
    with pytest.raises(CorruptShardError) as caught:
        scan_mds_zstd(BytesShard(name, data))
    message = str(caught.value)
    assert message.startswith(f"{name}: ") and needle in message, message
    assert "\n" not in message and 0 <= caught.value.offset <= len(data)


def test_split_names_and_class_folders() -> None:
    assert split_of("data/train-00000-of-00002.parquet") == "train"
    assert split_of("default/validation/0000.parquet") == ""
    assert class_folders(["cat", "dog"]) == ["cat", "dog"]
    assert class_folders(CLASSES) == ["0_zebra", "1_apple", "2_mango"]
    assert class_folders(["a/b", "a"]) == ["0_a_b", "1_a"]
    names = [f"n{i}" for i in range(12)]  # n10 sorts before n2: prefixed, 2 digits
    assert class_folders(names)[2] == "02_n2" and sorted(class_folders(names)) == class_folders(
        names
    )


def _bounded(rows: list[MemberRow], size: int) -> None:
    for path, offset, length, *_ in rows:
        assert offset >= 0 and length >= 0 and offset + length <= size, (path, offset, length)
        assert path and not path.startswith("/") and ".." not in path.split("/")


def _mutations() -> st.SearchStrategy[list[tuple[int, int]]]:
    return st.lists(st.tuples(st.integers(0, 1 << 30), st.integers(0, 255)), max_size=8)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(mutations=_mutations(), cut=st.integers(0, 1 << 30), use_cut=st.booleans())
def test_mutated_files_give_bounded_rows_or_the_projects_error(
    written: tuple[Path, list[Item]], mutations: list[tuple[int, int]], cut: int, use_cut: bool
) -> None:
    root, _ = written
    plain = root / "mds" / "validation" / "shard.00000.mds"
    for path, scanner, zstd_after in (
        (root / "hf" / "data" / "validation-00000-of-00002.parquet", scan_parquet, False),
        (root / "pa" / "data" / "validation-00000-of-00001.parquet", scan_parquet, False),
        (plain, scan_mds, False),
        (root / "mdsz" / "validation" / "shard.00000.mds.zstd", scan_mds_zstd, False),
        (plain, scan_mds_zstd, True),  # a mutated plain shard in a valid frame
    ):
        data = bytearray(path.read_bytes())
        for position, value in mutations:
            data[position % len(data)] = value
        if use_cut:
            data = data[: cut % (len(data) + 1)]
        if zstd_after:
            data = bytearray(cramjam.zstd.compress(bytes(data)))
        try:
            scan = scanner(BytesShard(path.name, bytes(data)))
        except CorruptShardError:
            continue
        rows = check_decoded(bytes(data), scan)
        _bounded([r for r in rows if not is_decoded(r[1])], len(data))


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=400), tail=st.sampled_from([b"", b"PAR1"]))
def test_arbitrary_bytes_give_bounded_rows_or_the_projects_error(data: bytes, tail: bytes) -> None:
    for name, scanner in (("x.parquet", scan_parquet), ("x.mds", scan_mds)):
        blob = data + tail
        try:
            rows = scanner(BytesShard(name, blob))
        except CorruptShardError:
            continue
        _bounded(rows, len(blob))


def test_a_missing_writers_venv_fails_naming_make_writers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from support.columnar import writers_python

    monkeypatch.setenv("SHARDFS_WRITERS_VENV", str(tmp_path / "absent"))
    with pytest.raises(AssertionError, match=r"run `make writers`"):
        writers_python()

"""The index builder: scanning, persistence, incremental rebuilds, bad shards and sidecars."""

from __future__ import annotations

import io
import sqlite3
import sys
import tarfile
from pathlib import Path

import pytest
from support.tarbuild import (
    directory,
    hardlink,
    make_tar,
    memory_url,
    put,
    remove,
    store_with,
    symlink,
)

from shardfs.config import IndexConfig, SourceConfig, ViewConfig
from shardfs.errors import CorruptShardError, IndexFileError, UnsafeMemberError
from shardfs.formats.members import label_extension, normalize_member_path, parse_label, split_key
from shardfs.formats.tar import MemberKind
from shardfs.index.db import (
    SCHEMA_VERSION,
    SIDECAR_NAME,
    IndexBuilder,
    fingerprint,
    write_sidecar,
)
from shardfs.index.scan import scan_shard
from shardfs.store.remote import Store
from shardfs.views.view import build_view


def shard_bytes(tag: str, count: int = 3) -> bytes:
    return make_tar((f"{tag}/f{i}.txt", f"{tag}-{i}".encode() * (i + 1)) for i in range(count))


def members(index_path: Path) -> dict[str, tuple[str, int]]:
    """path -> (shard name, size) of every member of every good shard."""
    conn = sqlite3.connect(index_path)
    try:
        rows = conn.execute(
            "SELECT m.path, s.name, m.size FROM members m JOIN shards s ON s.id = m.shard "
            "WHERE s.error IS NULL"
        ).fetchall()
    finally:
        conn.close()
    return {path: (shard, size) for path, shard, size in rows}


def builder(store: Store, cache: Path, **options: object) -> IndexBuilder:
    return IndexBuilder(store, IndexConfig(cache_dir=cache, scan_workers=3, **options))  # type: ignore[arg-type]


def build(store: Store, cache: Path, **options: object) -> tuple[IndexBuilder, Path]:
    b = builder(store, cache, **options)
    return b, b.build(store.list_shards())


# --- paths and labels -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "clean"),
    [
        ("a/b", "a/b"),
        ("./a//b", "a/b"),
        ("a/./b/", "a/b"),
        ("./", ""),
        (".", ""),
        ("dir/", "dir"),
        ("a..b/c..", "a..b/c.."),
    ],
)
def test_normalize_member_path(raw: str, clean: str) -> None:
    assert normalize_member_path(raw, "s.tar", 0) == clean


@pytest.mark.parametrize("raw", ["../x", "/etc/x", "a/../../x", "a/..", "./../x", "//x"])
def test_normalize_member_path_refuses_escapes(raw: str) -> None:
    with pytest.raises(UnsafeMemberError) as info:
        normalize_member_path(raw, "s.tar", 1536)
    assert (info.value.shard, info.value.offset) == ("s.tar", 1536)
    assert repr(raw) in str(info.value)


@pytest.mark.parametrize(
    ("ext", "content", "label"),
    [
        ("cls", b"7", 7),
        ("cls", b" 12\n", 12),
        ("cls", b"dog", None),
        ("cls", b"1.5", None),
        ("cls", b"\xff\xfe", None),
        ("json", b"3", 3),
        ("json", b'{"label": 5}', 5),
        ("json", b'{"cls": 2, "other": 9}', 2),
        ("json", b'{"class": 1}', 1),
        ("json", b'{"target": 4}', 4),
        ("json", b'{"label": "dog"}', None),
        ("json", b'{"label": true}', None),
        ("json", b"true", None),
        ("json", b"[1]", None),
        ("json", b"{broken", None),
        ("json", b"", None),
        # hostile labels (issue 9): anything but 0 <= label < 2**31 is no label
        ("cls", b"-3", None),
        ("cls", b"+3", None),
        ("cls", b"2147483647", 2**31 - 1),
        ("cls", b"2147483648", None),
        ("cls", str(2**63).encode(), None),
        ("cls", b"9" * 5000, None),
        ("cls", b"0" * 5000 + b"7", 7),
        ("cls", "\u0663".encode(), None),  # ARABIC-INDIC DIGIT THREE: int() would say 3
        ("json", b"-3", None),
        ("json", str(2**63).encode(), None),
        ("json", b"9" * 5000, None),
        ("json", b'{"label": -1}', None),
        ("json", b'{"label": 18446744073709551616}', None),
        ("json", b'{"label": -1, "cls": 4}', 4),
        ("json", b"[" * 100_000 + b"]" * 100_000, None),  # RecursionError in json.loads
        ("json", b'{"a":' * 50_000 + b"1" + b"}" * 50_000, None),
        ("json", b"1e400", None),
    ],
)
def test_parse_label(ext: str, content: bytes, label: int | None) -> None:
    assert parse_label(ext, content) == label


def test_deeply_nested_json_label_is_no_label_even_near_the_recursion_limit() -> None:
    def nested(depth: int) -> int | None:
        if depth:
            return nested(depth - 1)
        return parse_label("json", b"[" * 60_000 + b"]" * 60_000)

    assert nested(sys.getrecursionlimit() - 100) is None


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        ("caf\udce9.jpg", "is not valid UTF-8"),
        ("a\0b", "contains a NUL byte"),
        ("a/" * 300 + "f", "is deeper than 256 folders"),
        ("d/" + "n" * 256, "has a name longer than 255 bytes"),
        ("d/" + "é" * 128, "has a name longer than 255 bytes"),  # 256 bytes of UTF-8
        ("/".join(["x" * 200] * 21), "is longer than 4095 bytes"),
    ],
)
def test_normalize_member_path_refuses_what_linux_cannot_name(raw: str, reason: str) -> None:
    with pytest.raises(UnsafeMemberError) as info:
        normalize_member_path(raw, "s.tar", 512)
    assert (info.value.shard, info.value.offset) == ("s.tar", 512)
    assert reason in str(info.value)
    assert len(str(info.value)) < 400  # a huge name is cut short in the message


def test_normalize_member_path_limits_are_inclusive() -> None:
    deep = "/".join(["d"] * 256)
    assert normalize_member_path(deep, "s.tar", 0) == deep
    long_name = "d/" + "n" * 255
    assert normalize_member_path(long_name, "s.tar", 0) == long_name
    full = "/".join(["x" * 255] * 15) + "/" + "y" * 255
    assert len(full) == 4095 and normalize_member_path(full, "s.tar", 0) == full


# Names a webdataset key rule must get right: folders (with dots), several dots in the
# basename, upper case, empty extensions, non-ASCII; and the names it cannot split.
KEY_NAMES = [
    "KEY.cls",
    "a/b/KEY.seg.png",
    "x/s1.png",
    "s3.v2.png",
    "s3.v2.cls",
    "a.b/c.png",
    "a.b/c.d/e.f.g.JPG",
    "k.",
    "k..png",
    "dir/ünï cøde.jpeg",
    "sp ace/k 1.tar.gz",
]
UNSPLIT_NAMES = ["noext", "a.b/noext", "dir/.hidden.png", ".png", "a/b.c/", "x/.cls"]


@pytest.mark.parametrize("name", KEY_NAMES)
def test_split_key_agrees_with_webdataset(name: str) -> None:
    """The key is the member path up to the first dot of its basename, as webdataset's
    own ``base_plus_ext`` says (``s3.v2.png`` is key ``s3``, extension ``v2.png``)."""
    from webdataset.tariterators import base_plus_ext

    assert split_key(name) == base_plus_ext(name)


def test_split_key_examples() -> None:
    assert split_key("x/s1.png") == ("x/s1", "png")
    assert split_key("s3.v2.png") == ("s3", "v2.png")
    assert split_key("a.b/c.png") == ("a.b/c", "png")
    assert label_extension("s3.v2.cls") == label_extension("k.CLS") == "cls"
    assert label_extension("m.meta.json") == "json"
    assert label_extension("cls") is label_extension("k.cls.txt") is None


@pytest.mark.parametrize("name", UNSPLIT_NAMES)
def test_split_key_refuses_what_has_no_key(name: str) -> None:
    """No dot in the basename, or a leading one: webdataset gives no key, or the folder's
    path (``dir/.hidden.png`` -> ``dir/``); the view counts such a name, never keys it."""
    from webdataset.tariterators import base_plus_ext

    assert split_key(name) is None
    key, _ = base_plus_ext(name)
    assert key is None or key.endswith("/")


# --- scanning one shard -----------------------------------------------------------------------


def _many_files_tar() -> bytes:
    return make_tar([(f"f{i}.bin", bytes([i]) * 3000) for i in range(8)])


def test_a_failing_cache_disk_leaves_the_scan_whole_and_stops_the_blocks(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The blocks a scan hands to the cache are an optimisation: a disk error there costs
    the blocks (one warning, no more calls for that shard), never the index."""
    archive = _many_files_tar()
    store = store_with({"s.tar": archive})
    (shard,) = store.list_shards()
    calls: list[int] = []

    def failing_disk(_shard: object, index: int, block: bytes) -> None:
        calls.append(index)
        raise OSError(28, "No space left on device")

    with caplog.at_level("WARNING", logger="shardfs.index.db"):
        rows = scan_shard(store, shard, failing_disk, 4096)
    assert sorted(row[0] for row in rows) == sorted(f"f{i}.bin" for i in range(8))
    assert calls == [0]
    assert [r.message for r in caplog.records if "not caching" in r.message]


def test_a_bug_in_the_block_sink_is_raised_not_swallowed() -> None:
    store = store_with({"s.tar": _many_files_tar()})
    (shard,) = store.list_shards()

    def buggy(_shard: object, index: int, block: bytes) -> None:
        raise TypeError("a programming error")

    with pytest.raises(TypeError, match="programming error"):
        scan_shard(store, shard, buggy, 4096)


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_scan_shard_rows(fmt: int) -> None:
    long_name = "d/" + "n" * 150 + ".jpg"
    archive = make_tar(
        [
            directory("./"),
            directory("d"),
            ("./d/a.jpg", b"jpeg"),
            ("d/a.cls", b"3\n"),
            (long_name, b"L"),
            symlink("d/s", "a.jpg"),
            hardlink("d/h", "./d/a.jpg"),
        ],
        fmt,
    )
    store = store_with({"s.tar": archive})
    (shard,) = store.list_shards()
    rows = scan_shard(store, shard)
    by_path = {row[0]: row for row in rows}
    assert list(by_path) == ["d", "d/a.jpg", "d/a.cls", long_name, "d/s", "d/h"]
    assert by_path["d"][5] == MemberKind.DIRECTORY
    _path, offset, size, _mode, _mtime, kind, _link, label = by_path["d/a.jpg"]
    assert archive[offset : offset + size] == b"jpeg"
    assert (kind, label) == (MemberKind.FILE, None)
    assert by_path["d/a.cls"][7] == 3
    assert by_path["d/s"][5:7] == (MemberKind.SYMLINK, "a.jpg")
    assert by_path["d/h"][5:7] == (MemberKind.HARDLINK, "d/a.jpg")


@pytest.mark.parametrize("bad", ["../x", "/etc/x", "a/../../x"])
def test_scan_shard_refuses_unsafe_member_paths(bad: str) -> None:
    archive = make_tar([("ok.txt", b"1"), (bad, b"2")])
    store = store_with({"s.tar": archive})
    (shard,) = store.list_shards()
    with pytest.raises(UnsafeMemberError) as info:
        scan_shard(store, shard)
    assert info.value.shard == "s.tar"
    assert info.value.offset == 1024  # second member's header: after one header + one block


def test_scan_shard_refuses_unsafe_hardlink_target() -> None:
    store = store_with({"s.tar": make_tar([("ok.txt", b"1"), hardlink("h", "../../etc/passwd")])})
    (shard,) = store.list_shards()
    with pytest.raises(UnsafeMemberError, match="etc/passwd"):
        scan_shard(store, shard)


# --- building and persistence -----------------------------------------------------------------


def test_build_indexes_every_shard_and_persists(tmp_path: Path) -> None:
    store = store_with({"a.tar": shard_bytes("a"), "b.tar": shard_bytes("b", 2)})
    progress: list[tuple[int, int, int, int]] = []
    b = IndexBuilder(store, IndexConfig(cache_dir=tmp_path), progress=lambda *p: progress.append(p))
    path = b.build(store.list_shards())
    assert path.is_file() and path.parent == tmp_path / "index"
    assert b.scanned_shards == 2
    assert members(path) == {
        "a/f0.txt": ("a.tar", 3),
        "a/f1.txt": ("a.tar", 6),
        "a/f2.txt": ("a.tar", 9),
        "b/f0.txt": ("b.tar", 3),
        "b/f1.txt": ("b.tar", 6),
    }
    total = sum(s.size for s in store.list_shards())
    assert progress[0] == (0, 2, 0, total)
    assert progress[-1] == (2, 2, total, total)
    assert b.bad_shards() == []
    leftovers = [p.name for p in path.parent.iterdir() if p.name.startswith(".")]
    assert leftovers == []


def test_second_build_scans_nothing(tmp_path: Path) -> None:
    store = store_with({"a.tar": shard_bytes("a"), "b.tar": shard_bytes("b")})
    first, path = build(store, tmp_path)
    before = members(path)
    again, path2 = build(Store(store.config), tmp_path)
    assert path2 == path
    assert (first.scanned_shards, again.scanned_shards) == (2, 0)
    assert members(path2) == before


def test_changed_shard_is_rescanned_alone(tmp_path: Path) -> None:
    store = store_with({n: shard_bytes(n[0]) for n in ("a.tar", "b.tar", "c.tar")})
    build(store, tmp_path)
    put(store.config.url, "b.tar", make_tar([("b/new.txt", b"fresh")]))
    b, path = build(store, tmp_path)
    assert b.scanned_shards == 1
    found = members(path)
    assert found["b/new.txt"] == ("b.tar", 5)
    assert "b/f0.txt" not in found
    assert found["a/f2.txt"] == ("a.tar", 9) and found["c/f0.txt"] == ("c.tar", 3)


def test_added_shard_is_scanned_alone(tmp_path: Path) -> None:
    store = store_with({"a.tar": shard_bytes("a")})
    build(store, tmp_path)
    put(store.config.url, "0.tar", shard_bytes("z"))  # sorts first: shard ids shift
    b, path = build(store, tmp_path)
    assert b.scanned_shards == 1
    found = members(path)
    assert found["a/f0.txt"] == ("a.tar", 3)
    assert found["z/f1.txt"] == ("0.tar", 6)


def test_removed_shard_drops_its_members(tmp_path: Path) -> None:
    store = store_with({"a.tar": shard_bytes("a"), "b.tar": shard_bytes("b")})
    build(store, tmp_path)
    remove(store.config.url, "a.tar")
    b, path = build(store, tmp_path)
    assert b.scanned_shards == 0
    assert sorted(members(path)) == ["b/f0.txt", "b/f1.txt", "b/f2.txt"]


def test_shards_in_subfolders_put_members_under_that_folder(tmp_path: Path) -> None:
    store = store_with(
        {
            "top.tar": make_tar([("x.txt", b"top")]),
            "train/s0.tar": make_tar([("./x.txt", b"train"), hardlink("y.txt", "x.txt")]),
            "val/deep/s0.tar": make_tar([directory("d"), ("d/x.txt", b"val")]),
        }
    )
    _, path = build(store, tmp_path)
    found = members(path)
    assert found["x.txt"] == ("top.tar", 3)
    assert found["train/x.txt"] == ("train/s0.tar", 5)
    assert found["val/deep/d"][0] == "val/deep/s0.tar"
    assert found["val/deep/d/x.txt"] == ("val/deep/s0.tar", 3)
    conn = sqlite3.connect(path)
    link = conn.execute("SELECT link FROM members WHERE path = 'train/y.txt'").fetchone()
    conn.close()
    assert link == ("train/x.txt",)


# --- bad shards -------------------------------------------------------------------------------


def truncated_store() -> tuple[Store, int]:
    """Three shards; b.tar is cut inside its second member's data. Returns the cut offset."""
    good = shard_bytes("b", 2)
    bad = make_tar([("b/one.bin", b"1" * 600), ("b/two.bin", b"2" * 3000)])
    cut = 512 + 1024 + 512 + 1000  # header, data of one.bin (2 blocks), header, part of two.bin
    store = store_with({"a.tar": shard_bytes("a"), "b.tar": bad[:cut], "c.tar": good})
    return store, cut


def test_corrupt_shard_fails_naming_shard_and_offset(tmp_path: Path) -> None:
    store, cut = truncated_store()
    with pytest.raises(CorruptShardError) as info:
        build(store, tmp_path)
    err = info.value
    assert (err.shard, err.offset) == ("b.tar", cut)
    assert f"b.tar: truncated member data at offset {cut}" in str(err)
    assert "--skip-bad-shards" in str(err)
    assert err.exit_code == 4


def test_corrupt_shard_fails_again_without_rescanning(tmp_path: Path) -> None:
    store, _ = truncated_store()
    with pytest.raises(CorruptShardError):
        build(store, tmp_path)
    b = builder(store, tmp_path)
    with pytest.raises(CorruptShardError, match=r"b\.tar"):
        b.build(store.list_shards())
    assert b.scanned_shards == 0


def test_skip_bad_shards_indexes_the_rest(tmp_path: Path) -> None:
    store, cut = truncated_store()
    b, path = build(store, tmp_path, skip_bad_shards=True)
    assert [(s.name, s.offset, s.reason) for s in b.bad_shards()] == [
        ("b.tar", cut, "truncated member data")
    ]
    found = members(path)
    assert sorted(found) == ["a/f0.txt", "a/f1.txt", "a/f2.txt", "b/f0.txt", "b/f1.txt"]
    assert {shard for shard, _ in found.values()} == {"a.tar", "c.tar"}

    again, _ = build(store, tmp_path, skip_bad_shards=True)
    assert again.scanned_shards == 0
    assert [s.name for s in again.bad_shards()] == ["b.tar"]


def test_fixed_bad_shard_is_rescanned(tmp_path: Path) -> None:
    store, _ = truncated_store()
    build(store, tmp_path, skip_bad_shards=True)
    put(store.config.url, "b.tar", make_tar([("b/fixed.txt", b"ok")]))
    b, path = build(store, tmp_path)
    assert b.scanned_shards == 1
    assert b.bad_shards() == []
    assert members(path)["b/fixed.txt"] == ("b.tar", 2)


def test_unsafe_member_fails_the_build_naming_the_path(tmp_path: Path) -> None:
    store = store_with({"a.tar": shard_bytes("a"), "evil.tar": make_tar([("../x", b"!")])})
    with pytest.raises(CorruptShardError, match=r"evil\.tar: member path '\.\./x' escapes"):
        build(store, tmp_path)
    b, path = build(store, tmp_path, skip_bad_shards=True)
    assert [s.name for s in b.bad_shards()] == ["evil.tar"]
    assert sorted(members(path)) == ["a/f0.txt", "a/f1.txt", "a/f2.txt"]


def test_two_bad_shards_are_both_reported(tmp_path: Path) -> None:
    store = store_with({"a.tar": b"\x01" * 512, "b.tar": b"\x02" * 512, "c.tar": shard_bytes("c")})
    with pytest.raises(CorruptShardError, match=r"a\.tar: .* offset 0.*and 1 more"):
        build(store, tmp_path)


def test_unwritable_cache_dir_is_index_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    store = store_with({"a.tar": shard_bytes("a")})
    with pytest.raises(IndexFileError, match="cannot create index folder"):
        build(store, blocker / "cache")


def test_unreadable_local_index_is_rebuilt(tmp_path: Path) -> None:
    store = store_with({"a.tar": shard_bytes("a")})
    _, path = build(store, tmp_path)
    path.write_bytes(b"garbage" * 100)
    again, path = build(store, tmp_path)
    assert again.scanned_shards == 1
    assert len(members(path)) == 3


def as_schema_1(path: Path) -> None:
    """Make an index look written by schema 1, which read no label from ``KEY.v2.cls``."""
    conn = sqlite3.connect(path)
    try:
        conn.execute("UPDATE meta SET value = '1' WHERE key = 'schema'")
        conn.execute("UPDATE members SET label = NULL WHERE path LIKE '%.v2.cls'")
        conn.commit()
    finally:
        conn.close()


def schema_of(path: Path) -> str:
    conn = sqlite3.connect(path)
    try:
        return str(conn.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()[0])
    finally:
        conn.close()


def test_a_schema_1_index_rescans_only_the_shards_with_labels_it_did_not_read(
    tmp_path: Path,
) -> None:
    """An index (or sidecar) from before ``KEY.v2.cls`` labels were read is reused for
    every other shard; the shards holding such a label are scanned again, once."""
    store = store_with(
        {
            "a.tar": make_tar([("k.jpg", b"k"), ("k.cls", b"0"), ("a.b/m.json", b"{}")]),
            "b.tar": make_tar([("s3.v2.png", b"s"), ("s3.v2.cls", b"2")]),
            "c.tar": make_tar([("j.jpg", b"j"), ("j.cls", b"1")]),
        }
    )
    _, path = build(store, tmp_path / "local")
    assert stored_row(path, "s3.v2.cls")[1] == 2
    as_schema_1(path)
    assert stored_row(path, "s3.v2.cls")[1] is None
    write_sidecar(store, path)

    again, path = build(store, tmp_path / "local")
    assert again.scanned_shards == 1  # b.tar alone
    assert stored_row(path, "s3.v2.cls")[1] == 2
    assert schema_of(path) == str(SCHEMA_VERSION)
    assert build(store, tmp_path / "local")[0].scanned_shards == 0

    fresh, fresh_path = build(Store(store.config), tmp_path / "fresh")  # from the sidecar
    assert fresh.scanned_shards == 1
    assert members(fresh_path) == members(path)
    assert stored_row(fresh_path, "s3.v2.cls")[1] == 2


def test_a_schema_1_index_without_such_labels_is_carried_over_without_a_scan(
    tmp_path: Path,
) -> None:
    store = store_with({"a.tar": make_tar([("k.jpg", b"k"), ("k.cls", b"0")])})
    _, path = build(store, tmp_path)
    as_schema_1(path)
    again, path = build(store, tmp_path)
    assert again.scanned_shards == 0
    assert schema_of(path) == str(SCHEMA_VERSION)
    assert stored_row(path, "k.cls")[1] == 0


def test_a_schema_2_index_rescans_only_the_shards_holding_a_tar(tmp_path: Path) -> None:
    """Schema 2 kept a tar inside a tar as one file; schema 3 presents it as a folder, so
    the shards holding a ``.tar`` member are scanned again and the others carried over."""
    inner = make_tar([("x.jpg", b"x" * 700)])
    store = store_with(
        {
            "a.tar": make_tar([("k.jpg", b"k"), ("k.cls", b"0")]),
            "b.tar": make_tar([("n01.tar", inner)]),
        }
    )
    _, path = build(store, tmp_path)
    assert stored_row(path, "n01/x.jpg") is not None
    conn = sqlite3.connect(path)
    try:  # what schema 2 wrote for b.tar: the inner tar as a file
        conn.execute("UPDATE meta SET value = '2' WHERE key = 'schema'")
        conn.execute("DELETE FROM members WHERE path LIKE 'n01/%' OR path = 'n01'")
        conn.execute(
            "INSERT INTO members (shard, path, offset, size, mode, mtime, kind, link, label) "
            "SELECT id, 'n01.tar', 512, ?, 420, 0, 0, '', NULL FROM shards WHERE name = 'b.tar'",
            (len(inner),),
        )
        conn.commit()
    finally:
        conn.close()
    again, path = build(store, tmp_path)
    assert again.scanned_shards == 1  # b.tar alone
    assert schema_of(path) == str(SCHEMA_VERSION)
    assert stored_row(path, "n01/x.jpg") is not None


# --- sidecars ---------------------------------------------------------------------------------


def test_sidecar_lets_a_fresh_cache_skip_scanning(tmp_path: Path) -> None:
    store = store_with({"a.tar": shard_bytes("a"), "sub/b.tar": shard_bytes("b")})
    _, path = build(store, tmp_path / "one")
    write_sidecar(store, path)
    assert store.read_object(SIDECAR_NAME) == path.read_bytes()

    second, path2 = build(Store(store.config), tmp_path / "two")
    assert second.scanned_shards == 0
    assert members(path2) == members(path)
    index_dir = tmp_path / "two" / "index"
    assert sorted(p.name for p in index_dir.iterdir()) == [path2.name]


def test_sidecars_in_shard_folders_serve_a_mount_of_their_parent(tmp_path: Path) -> None:
    """``shardfs pack`` writes its sidecar next to its shards (``train/``); mounting the
    parent folder uses it, with paths put under ``train/``."""
    root = store_with({"train/a.tar": shard_bytes("a"), "val/b.tar": shard_bytes("b")})
    train = Store(SourceConfig(root.config.url.rstrip("/") + "/train"))
    _, train_index = build(train, tmp_path / "train")
    write_sidecar(train, train_index)

    parent, path = build(root, tmp_path / "parent")
    assert parent.scanned_shards == 1  # val/b.tar had no sidecar
    scanned, _ = build(root, tmp_path / "scan", use_sidecar=False)
    assert members(path) == members(build(root, tmp_path / "scan")[1])
    assert sorted(members(path)) == sorted(
        [
            "train/a/f0.txt",
            "train/a/f1.txt",
            "train/a/f2.txt",
            "val/b/f0.txt",
            "val/b/f1.txt",
            "val/b/f2.txt",
        ]
    )
    assert scanned.scanned_shards == 2


def test_sidecar_covers_only_the_shards_it_knows(tmp_path: Path) -> None:
    store = store_with({"a.tar": shard_bytes("a"), "b.tar": shard_bytes("b")})
    _, path = build(store, tmp_path / "one")
    write_sidecar(store, path)
    put(store.config.url, "b.tar", shard_bytes("B"))
    put(store.config.url, "c.tar", shard_bytes("c"))
    b, path2 = build(store, tmp_path / "two")
    assert b.scanned_shards == 2
    assert {p.split("/")[0] for p in members(path2)} == {"a", "B", "c"}


def test_sidecar_is_ignored_when_disabled(tmp_path: Path) -> None:
    store = store_with({"a.tar": shard_bytes("a")})
    _, path = build(store, tmp_path / "one")
    write_sidecar(store, path)
    b, _ = build(store, tmp_path / "two", use_sidecar=False)
    assert b.scanned_shards == 1


@pytest.mark.parametrize("garbage", [b"", b"\x00" * 10, b"SQLite format 3\x00" + b"\xff" * 200])
def test_invalid_sidecar_is_ignored_with_a_rescan(tmp_path: Path, garbage: bytes) -> None:
    url = memory_url()
    store = store_with({"a.tar": shard_bytes("a"), "b.tar": shard_bytes("b")}, url)
    put(url, SIDECAR_NAME, garbage)
    b, path = build(store, tmp_path)
    assert b.scanned_shards == 2
    assert len(members(path)) == 6
    assert sorted(p.name for p in (tmp_path / "index").iterdir()) == [path.name]


def test_fingerprint_depends_on_identities_and_order() -> None:
    store = store_with({"a.tar": b"1" * 10, "b.tar": b"2" * 10})
    shards = store.list_shards()
    assert fingerprint(shards) == fingerprint(list(shards))
    assert fingerprint(shards) != fingerprint(shards[::-1])
    assert fingerprint(shards) != fingerprint(shards[:1])


def test_local_folder_source(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "s.tar").write_bytes(shard_bytes("s"))
    store = Store(SourceConfig(str(data)))
    b, path = build(store, tmp_path / "cache")
    assert b.scanned_shards == 1
    assert sorted(members(path)) == ["s/f0.txt", "s/f1.txt", "s/f2.txt"]


# --- hostile tars (issue 9): a bad shard or a per-member outcome, never a crash -------------


def raw_tar(
    name: str, *, fmt: int = tarfile.GNU_FORMAT, data: bytes = b"x", **fields: object
) -> bytes:
    """One member written by tarfile with names kept as bytes through surrogateescape, so a
    name that is not UTF-8 reaches the archive as it is."""
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 1_700_000_000
    for key, value in fields.items():
        setattr(info, key, value)
    buf = io.BytesIO()
    with tarfile.open(
        fileobj=buf, mode="w", format=fmt, encoding="utf-8", errors="surrogateescape"
    ) as tar:
        tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return buf.getvalue()


HOSTILE_SHARDS: dict[str, tuple[bytes, str]] = {
    "non-utf8-name-gnu": (raw_tar("caf\udce9.jpg"), "is not valid UTF-8"),
    "non-utf8-name-pax": (raw_tar("caf\udce9.jpg", fmt=tarfile.PAX_FORMAT), "is not valid UTF-8"),
    "non-utf8-symlink-target": (
        raw_tar("link", type=tarfile.SYMTYPE, linkname="t\udcff", data=b""),
        "symlink target 't\\udcff' is not valid UTF-8",
    ),
    "non-utf8-hardlink-target": (
        raw_tar("link", type=tarfile.LNKTYPE, linkname="t\udcff", data=b""),
        "is not valid UTF-8",
    ),
    "nul-in-pax-path": (
        raw_tar("a", fmt=tarfile.PAX_FORMAT, pax_headers={"path": "a\0/../../x"}),
        "contains a NUL byte",
    ),
    "nul-in-pax-linkpath": (
        raw_tar(
            "l",
            fmt=tarfile.PAX_FORMAT,
            type=tarfile.SYMTYPE,
            data=b"",
            pax_headers={"linkpath": "a\0b"},
        ),
        "contains a NUL byte",
    ),
    "1000-components": (raw_tar("a/" * 1000 + "f", fmt=tarfile.PAX_FORMAT), "deeper than 256"),
    "300-byte-component": (raw_tar("d/" + "n" * 300), "longer than 255 bytes"),
    "8k-path": (raw_tar("/".join(["x" * 100] * 80), fmt=tarfile.PAX_FORMAT), "than 4095 bytes"),
    "pax-size-5000-digits": (
        raw_tar("f", fmt=tarfile.PAX_FORMAT, pax_headers={"size": "9" * 5000}),
        "pax size too large",
    ),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_SHARDS))
def test_hostile_shard_is_a_bad_shard_naming_shard_and_offset(tmp_path: Path, case: str) -> None:
    """Fails the build with exit 4, naming shard and offset; --skip-bad-shards mounts the rest."""
    archive, reason = HOSTILE_SHARDS[case]
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.tar").write_bytes(shard_bytes("a"))
    (data / "evil.tar").write_bytes(shard_bytes("e", 1)[:1024] + archive)  # hostile 2nd
    store = Store(SourceConfig(str(data)))
    with pytest.raises(CorruptShardError) as info:
        build(store, tmp_path / "cache")
    assert info.value.shard == "evil.tar" and info.value.exit_code == 4
    assert info.value.offset == 1024  # the hostile member's first header
    assert reason in str(info.value) and "--skip-bad-shards" in str(info.value)

    b, path = build(store, tmp_path / "cache", skip_bad_shards=True)
    assert [(s.name, s.offset) for s in b.bad_shards()] == [("evil.tar", 1024)]
    assert sorted(members(path)) == ["a/f0.txt", "a/f1.txt", "a/f2.txt"]


def stored_row(path: Path, name: str) -> tuple[int, int | None]:
    conn = sqlite3.connect(path)
    try:
        row = conn.execute("SELECT mtime, label FROM members WHERE path = ?", (name,)).fetchone()
    finally:
        conn.close()
    return row  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("fmt", "mtime", "stored"),
    [
        (tarfile.GNU_FORMAT, 2**63, 2**63 - 1),  # base-256
        (tarfile.GNU_FORMAT, 2**80, 2**63 - 1),
        (tarfile.GNU_FORMAT, -(2**70), -(2**63)),
        (tarfile.PAX_FORMAT, 2**63, 2**63 - 1),  # pax mtime record
        (tarfile.PAX_FORMAT, 10**5000, 2**63 - 1),  # more than 4,300 digits
    ],
    ids=["base256-2^63", "base256-2^80", "base256-neg-2^70", "pax-2^63", "pax-10^5000"],
)
def test_huge_mtime_is_clamped_and_stored(
    tmp_path: Path, fmt: int, mtime: int, stored: int
) -> None:
    sys.set_int_max_str_digits(0)  # only to let tarfile write the 5,001-digit record
    try:
        archive = raw_tar("f.txt", fmt=fmt, mtime=mtime)
    finally:
        sys.set_int_max_str_digits(4300)
    store = store_with({"s.tar": archive})
    _, path = build(store, tmp_path)
    assert stored_row(path, "f.txt") == (stored, None)


@pytest.mark.parametrize(
    ("ext", "label"),
    [
        ("cls", str(2**63).encode()),
        ("cls", b"-3"),
        ("json", str(-(2**63) - 1).encode()),
        ("json", b'{"label": -3}'),
        ("json", b"[" * 50_000 + b"]" * 50_000),
    ],
)
def test_hostile_label_is_no_label_and_the_view_reports_it(
    tmp_path: Path, ext: str, label: bytes
) -> None:
    archive = make_tar(
        [("k1.jpg", b"one"), ("k1.cls", b"1"), ("k2.jpg", b"two"), (f"k2.{ext}", label)]
    )
    store = store_with({"s.tar": archive})
    _, path = build(store, tmp_path)
    assert stored_row(path, f"k2.{ext}")[1] is None
    out = tmp_path / "view.sqlite"
    report = build_view(path, out, ViewConfig(layout="imagefolder"), lambda _folder: None)
    assert (report.files, report.unlabeled) == (1, 1)
    assert report.examples["unlabelled"] == ["image k2.jpg in s.tar has no label"]

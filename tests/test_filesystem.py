"""The filesystem core over a real view, with a fake RangeReader that records every fetch."""

from __future__ import annotations

import errno
import os
import stat
from array import array
from pathlib import Path

import pytest
from support.inodes import names_in, open_path, resolve, stat_of
from support.tarbuild import MTIME, directory, make_tar, store_with, symlink

from shardfs.cache.block_format import BlockKey
from shardfs.config import IndexConfig, ReadConfig, ViewConfig
from shardfs.core.filesystem import XATTR_OFFSET, XATTR_SHARD, Owner, ShardFileSystem
from shardfs.core.order_hints import OrderHints
from shardfs.errors import (
    IsADirError,
    NoSuchAttributeError,
    NotADirError,
    NotFoundError,
    UsageError,
)
from shardfs.index.db import IndexBuilder
from shardfs.placement import (
    HINT_NAME,
    TABLE_NAME,
    Hint,
    decode_table,
    encode_hint,
    hint_chunks,
)
from shardfs.read.reader import CachedReader
from shardfs.stats import Stats
from shardfs.store.shards import ShardInfo
from shardfs.views.view import View, build_view

SMALL = bytes(range(256)) * 4  # 1024 bytes
BIG = bytes((i * 7 + i // 256) % 251 for i in range(10_000))


class RecordingReader:
    """Serves byte ranges from in-memory shards and records every request."""

    def __init__(self, shards: dict[str, bytes]) -> None:
        self.shards = shards
        self.calls: list[tuple[str, int, int]] = []

    def read(self, shard: ShardInfo, start: int, end: int, extent_end: int | None = None) -> bytes:
        assert extent_end is None or end <= extent_end <= shard.size
        self.calls.append((shard.name, start, end))
        return self.shards[shard.name][start:end]


SHARDS = {
    "a.tar": make_tar(
        [
            directory("d"),
            ("d/small.bin", SMALL),
            ("d/big.bin", BIG),
            ("empty", b""),
            symlink("d/link", "small.bin"),
        ]
    ),
    "b.tar": make_tar([("other.txt", b"from b")]),
}


@pytest.fixture
def view(tmp_path: Path) -> View:
    store = store_with(SHARDS)
    index = IndexBuilder(store, IndexConfig(cache_dir=tmp_path)).build(store.list_shards())
    out = tmp_path / "view.sqlite"
    build_view(index, out, ViewConfig(layout="raw"), lambda _folder: None)
    return View(out)


def make_fs(view: View, **limits: int) -> tuple[ShardFileSystem, RecordingReader]:
    reader = RecordingReader(SHARDS)
    return ShardFileSystem(view, reader, ReadConfig(**limits), Stats()), reader


def read_all(fs: ShardFileSystem, path: str, chunk: int) -> bytes:
    handle = open_path(fs, path)
    parts = []
    offset = 0
    while data := fs.read(handle, offset, chunk):
        parts.append(data)
        offset += len(data)
    fs.release(handle)
    return b"".join(parts)


def test_whole_file_read_is_one_fetch_for_many_chunks(view: View) -> None:
    fs, reader = make_fs(view)
    assert read_all(fs, "d/small.bin", 100) == SMALL
    node = view.lookup("d/small.bin")
    assert reader.calls == [("a.tar", node.offset, node.offset + len(SMALL))]


@pytest.mark.parametrize("chunk", [1000, 4096, 3333, 10_000, 20_000])
def test_windowed_reads_return_exact_bytes(view: View, chunk: int) -> None:
    fs, reader = make_fs(view, whole_file_limit=512, window=2048)
    assert read_all(fs, "d/big.bin", chunk) == BIG
    node = view.lookup("d/big.bin")
    for shard, start, end in reader.calls:
        assert shard == "a.tar"
        assert node.offset <= start < end <= node.offset + len(BIG)
        assert end - start >= min(2048, node.offset + len(BIG) - start)
    if chunk <= 2048:
        assert len(reader.calls) == -(-len(BIG) // 2048)  # one fetch per window


def test_random_access_reads(view: View) -> None:
    fs, reader = make_fs(view, whole_file_limit=512, window=1000)
    handle = open_path(fs, "d/big.bin")
    for offset, size in [(9000, 500), (5, 10), (9990, 100), (4321, 3000), (4400, 50), (0, 1)]:
        assert fs.read(handle, offset, size) == BIG[offset : offset + size]
    assert len(reader.calls) == 5  # (4400, 50) is inside the window fetched for (4321, 3000)


def test_reads_past_eof(view: View) -> None:
    fs, reader = make_fs(view, whole_file_limit=512, window=1000)
    for path, data in [("d/small.bin", SMALL), ("d/big.bin", BIG)]:
        handle = open_path(fs, path)
        assert fs.read(handle, len(data) - 10, 100) == data[-10:]
        assert fs.read(handle, len(data), 100) == b""
        assert fs.read(handle, len(data) + 5000, 1) == b""
    calls = len(reader.calls)
    handle = open_path(fs, "empty")
    assert fs.read(handle, 0, 4096) == b""
    assert len(reader.calls) == calls  # nothing fetched for an empty file


def test_handles_are_independent(view: View) -> None:
    fs, _ = make_fs(view)
    first = open_path(fs, "d/small.bin")
    second = open_path(fs, "other.txt")
    assert first != second
    assert fs.read(second, 0, 100) == b"from b"
    assert fs.read(first, 1020, 100) == SMALL[1020:]
    fs.release(first)
    with pytest.raises(NotFoundError):
        fs.read(first, 0, 1)
    assert fs.read(second, 5, 1) == b"b"


def test_open_errors(view: View) -> None:
    fs, _ = make_fs(view)
    with pytest.raises(IsADirError):
        open_path(fs, "d")
    with pytest.raises(IsADirError):
        open_path(fs, "/")
    with pytest.raises(NotFoundError):
        open_path(fs, "d/missing")
    with pytest.raises(NotADirError):
        open_path(fs, "d/small.bin/x")


def test_getattr_fields(view: View) -> None:
    fs, _ = make_fs(view)
    attrs = stat_of(fs, "/d/big.bin")
    node = view.lookup("d/big.bin")
    assert attrs["st_ino"] == node.ino
    assert attrs["st_mode"] == stat.S_IFREG | 0o444
    assert attrs["st_nlink"] == 1
    assert attrs["st_size"] == len(BIG)
    assert attrs["st_blocks"] == (len(BIG) + 511) // 512
    assert attrs["st_mtime"] == MTIME
    assert (attrs["st_uid"], attrs["st_gid"]) == (os.getuid(), os.getgid())

    root = stat_of(fs, "/")
    assert root["st_ino"] == 1
    assert stat.S_ISDIR(root["st_mode"]) and root["st_nlink"] == 2
    assert stat_of(fs, "/d")["st_mode"] == stat.S_IFDIR | 0o555
    link = stat_of(fs, "/d/link")
    assert stat.S_ISLNK(link["st_mode"]) and link["st_size"] == len("small.bin")
    assert resolve(fs, "/d/link").link == "small.bin"
    with pytest.raises(NotFoundError):
        stat_of(fs, "/nope")


def test_owner_and_mode_overrides_reach_stat_and_listings(view: View) -> None:
    owner = Owner(uid=1234, gid=5678, file_mode=0o440, dir_mode=0o550)
    fs = ShardFileSystem(view, RecordingReader(SHARDS), ReadConfig(), Stats(), owner=owner)
    assert (fs.uid, fs.gid) == (1234, 5678)
    for path, mode in [("/", stat.S_IFDIR | 0o550), ("/d", stat.S_IFDIR | 0o550),
                       ("/d/big.bin", stat.S_IFREG | 0o440), ("/empty", stat.S_IFREG | 0o440),
                       ("/d/link", stat.S_IFLNK | 0o777)]:  # fmt: skip
        attrs = stat_of(fs, path)
        assert attrs["st_mode"] == mode, path
        assert (attrs["st_uid"], attrs["st_gid"]) == (1234, 5678)
    entries = fs.listing(fs.node(stat_of(fs, "/d")["st_ino"]))
    assert [e.mode for e in entries] == [
        stat.S_IFDIR | 0o550, stat.S_IFDIR | 0o550,
        stat.S_IFREG | 0o440, stat.S_IFLNK | 0o777, stat.S_IFREG | 0o440,
    ]  # fmt: skip
    only_files = ShardFileSystem(
        view, RecordingReader(SHARDS), ReadConfig(), Stats(), owner=Owner(file_mode=0o400)
    )
    assert stat_of(only_files, "/d")["st_mode"] == stat.S_IFDIR | 0o555  # the default rule
    assert stat_of(only_files, "/d/small.bin")["st_mode"] == stat.S_IFREG | 0o400


def test_readdir(view: View) -> None:
    fs, _ = make_fs(view)
    assert names_in(fs, "/") == ["d", "empty", "other.txt"]
    assert sorted(names_in(fs, "/d")) == ["big.bin", "link", "small.bin"]
    with pytest.raises(NotADirError):
        names_in(fs, "/d/small.bin")
    with pytest.raises(NotFoundError):
        names_in(fs, "/missing")


def test_listing_shows_what_stat_shows(view: View) -> None:
    fs, _ = make_fs(view)
    folder = fs.node(stat_of(fs, "/d")["st_ino"])
    entries = fs.listing(folder, full_from=4096)
    assert [e.name for e in entries] == [b".", b"..", b"big.bin", b"link", b"small.bin"]
    assert entries[0].ino == folder.ino and entries[1].ino == stat_of(fs, "/")["st_ino"]
    assert [e.full for e in entries] == [False, False, True, False, False]  # 10 KB, link, 1 KB
    for entry in entries[2:]:
        shown = stat_of(fs, "/d/" + entry.name.decode())
        assert (entry.ino, entry.mode, entry.nlink, entry.size, entry.blocks, entry.mtime) == (
            shown["st_ino"], shown["st_mode"], shown["st_nlink"], shown["st_size"],
            shown["st_blocks"], shown["st_mtime"],
        )  # fmt: skip
    root = fs.listing(fs.node(stat_of(fs, "/")["st_ino"]))
    assert root[0].ino == root[1].ino == stat_of(fs, "/")["st_ino"]  # the root holds itself
    assert [e.full for e in root] == [False, False, True, True, True]  # full_from 0: all
    with pytest.raises(NotADirError):
        fs.listing(fs.node(stat_of(fs, "/other.txt")["st_ino"]))


def test_xattrs(view: View) -> None:
    fs, _ = make_fs(view)
    assert fs.node_xattrs(resolve(fs, "/other.txt")) == [XATTR_SHARD, XATTR_OFFSET]
    assert fs.node_xattr(resolve(fs, "/other.txt"), XATTR_SHARD) == b"b.tar"
    offset = int(fs.node_xattr(resolve(fs, "/d/big.bin"), XATTR_OFFSET))
    assert SHARDS["a.tar"][offset : offset + len(BIG)] == BIG
    with pytest.raises(NoSuchAttributeError) as info:
        fs.node_xattr(resolve(fs, "/other.txt"), "user.nothing")
    assert info.value.errno == 61  # ENODATA
    assert fs.node_xattrs(resolve(fs, "/d")) == []
    assert fs.node_xattrs(resolve(fs, "/d/link")) == []
    for name in (XATTR_SHARD, XATTR_OFFSET):
        with pytest.raises(NoSuchAttributeError):
            fs.node_xattr(resolve(fs, "/d"), name)


def test_statfs(view: View) -> None:
    fs, _ = make_fs(view)
    numbers = fs.statfs()
    total = len(SMALL) + len(BIG) + len("from b")
    assert numbers["f_bsize"] == numbers["f_frsize"] == 4096
    assert numbers["f_blocks"] == -(-total // 4096)
    # files: small, big, empty, link, other.txt; folders: root and d
    assert numbers["f_files"] == 7
    assert numbers["f_bfree"] == numbers["f_bavail"] == numbers["f_ffree"] == 0


# -- the placement table and the order hint -------------------------------------------------


def test_the_table_file_is_found_read_and_never_listed(view: View) -> None:
    fs, reader = make_fs(view)
    node = fs.child(fs.node(1), TABLE_NAME)
    assert resolve(fs, TABLE_NAME) == node == fs.node(node.ino)
    assert stat.S_ISREG(stat_of(fs, TABLE_NAME)["st_mode"])
    data = fs.read_node(node, 0, node.size)
    assert len(data) == node.size == stat_of(fs, TABLE_NAME)["st_size"]
    assert fs.read_node_local(node, 5, 10) == data[5:15]
    assert read_all(fs, TABLE_NAME, 7) == data
    assert reader.calls == []  # no shard bytes were read for it
    table = decode_table(data)
    expected = [(path, n.shard, n.offset, n.size) for path, n in view.files()]
    shard_ids = sorted(view.shards)
    assert [
        (path, shard_ids[table.shards[i]], table.offsets[i], table.sizes[i])
        for i, path in enumerate(table.paths)
    ] == expected
    assert table.paths == ["d/small.bin", "d/big.bin", "empty", "other.txt"]
    assert table.shard_names == ["a.tar", "b.tar"]
    assert fs.node_xattrs(node) == []
    for magic in (TABLE_NAME, HINT_NAME):
        assert magic not in names_in(fs, "")
        assert magic.encode() not in [entry.name for entry in fs.listing(fs.node(1))]
    with pytest.raises(NotFoundError):
        fs.child(resolve(fs, "d"), TABLE_NAME)  # only at the root


def hint_chunks_for(fs: ShardFileSystem, rows: list[int], *, fingerprint: str = "") -> None:
    table = decode_table(fs.read_node(resolve(fs, TABLE_NAME), 0, 1 << 30))
    payload = encode_hint(fingerprint or table.fingerprint, 1, rows)
    for chunk in hint_chunks(payload):
        fs.take_hint_chunk(bytes(chunk))


def test_a_hint_for_another_table_is_refused(view: View) -> None:
    fs, _ = make_fs(view)
    with pytest.raises(UsageError) as info:
        hint_chunks_for(fs, [0, 1], fingerprint="f" * 24)
    assert info.value.errno == errno.EINVAL
    with pytest.raises(UsageError):
        hint_chunks_for(fs, [0, 9])  # a row the table does not have
    assert fs.stats.hints_taken == 0


class _AheadReader(CachedReader):
    """What an order hint asks of the block cache's reader, recorded: no cache, no store."""

    block_size = 1 << 20

    def __init__(self) -> None:  # the real reader's state is not needed here
        self.follow_hint = self.streaming_hint = False
        self.files_ahead = False  # whether the cache is full (files are fetched as ranges)
        self.queued: list[tuple[ShardInfo, int, int]] = []
        self.opened: list[tuple[ShardInfo, int, int]] = []  # told by files_opened

    @property
    def holds_files_ahead(self) -> bool:
        return bool(self.queued)

    def files_opened(self, files: list[tuple[ShardInfo, int, int]]) -> None:
        self.opened += files

    def new_order(self) -> None:
        pass

    def cache_blocks(self) -> int:
        return 1

    def cache_holds_dataset(self) -> bool:
        return False

    def wants_files_ahead(self) -> bool:
        return self.files_ahead

    def prefetch_files(self, extents: list[tuple[ShardInfo, int, int]]) -> int:
        self.queued += extents
        return len(extents)

    def prefetch_blocks(self, blocks: list[tuple[ShardInfo, int]]) -> int:
        return len(blocks)


def test_a_file_read_before_its_turn_is_never_fetched_ahead_after(view: View) -> None:
    """A reader reached position 2 while the cache had room (nothing queued ahead); the
    cache then filled, and the open of position 0 was noted late (opens are taken in
    batches). Files are queued ahead from position 0, but not position 2's: its read
    fetched its own bytes, and a fetch ahead would pay for them twice."""
    reader = _AheadReader()
    hints = OrderHints(view, reader, Stats())
    table = hints.table()
    nodes = [view.lookup(path) for path in ("d/small.bin", "d/big.bin", "other.txt")]
    hints.follow(Hint(table.fingerprint, 0, array("i", [table.row_of_ino[n.ino] for n in nodes])))
    hints.note_read(nodes[2])
    assert reader.queued == []
    reader.files_ahead = True
    hints.note_opened([nodes[0].ino])
    assert [(shard.name, start, end) for shard, start, end in reader.queued] == [
        ("a.tar", nodes[1].offset, nodes[1].offset + nodes[1].size)
    ]


def test_opens_noted_in_one_batch_count_each_and_move_the_hint_once(view: View) -> None:
    """Opens are taken in batches, in any order: each opened file counts as reached (never
    fetched ahead, as the kernel holds it), the window moves from the batch's nearest
    position, and inodes outside the hint are passed over."""
    reader = _AheadReader()
    hints = OrderHints(view, reader, Stats())
    table = hints.table()
    nodes = [view.lookup(path) for path in ("d/small.bin", "d/big.bin", "other.txt")]
    rows = [table.row_of_ino[n.ino] for n in nodes]
    hints.follow(Hint(table.fingerprint, 0, array("i", rows)))
    reader.files_ahead = True
    hints.note_opened([nodes[2].ino, view.root.ino, 10**6, nodes[0].ino])
    active = hints._hint
    assert active is not None
    assert [active.reached[row] for row in rows] == [1, 0, 1]
    assert [(shard.name, start, end) for shard, start, end in reader.queued] == [
        ("a.tar", nodes[1].offset, nodes[1].offset + nodes[1].size)
    ]
    assert active.plan.furthest == 2  # the batch's furthest position
    assert reader.opened == []  # nothing was fetched ahead before this batch
    hints.note_opened([nodes[1].ino])  # fetched ahead, then opened from the page cache
    extent = ("a.tar", nodes[1].offset, nodes[1].offset + nodes[1].size)
    assert [(shard.name, start, end) for shard, start, end in reader.opened] == [extent]
    hints.note_opened([])  # nothing to note: nothing moves
    assert len(reader.queued) == 1


def test_hinted_reads_are_counted_once_a_hint_is_followed(view: View) -> None:
    fs, _ = make_fs(view)
    fs.read_node(resolve(fs, "d/small.bin"), 0, 100)
    assert fs.stats.hinted_reads == 0
    table = decode_table(fs.read_node(resolve(fs, TABLE_NAME), 0, 1 << 30))
    fs.follow_hint(Hint(table.fingerprint, 0, array("i", table.rows_of(["other.txt"]))))
    fs.read_node(resolve(fs, "d/small.bin"), 0, 100)
    assert fs.stats.hinted_reads == 0
    assert fs.read_node(resolve(fs, "other.txt"), 0, 100) == b"from b"
    assert fs.stats.hinted_reads == 1
    hint_chunks_for(fs, [3, 0])  # through the chunks, as the ioctls bring it
    assert fs.stats.hints_taken == 1


class _ComingReader(CachedReader):
    """The block cache's reader as ``wait_block`` sees it: which blocks are coming (a
    readahead GET) or in flight (another read's miss), and the waits asked of it."""

    block_size = 8192

    def __init__(self, coming: set[int], flying: set[int]) -> None:  # no cache, no store
        self.waited: list[tuple[str, int]] = []
        reader = self

        class Coming:
            timeout = 5.0

            def expected(self, _skey: str, index: int) -> bool:
                return index in coming

            def wait(self, _skey: str, index: int) -> None:
                reader.waited.append(("coming", index))

        class Cache:
            def wait_flight(self, key: BlockKey, _timeout: float) -> bool:
                reader.waited.append(("flight", key.index))
                return key.index in flying

        self.coming = Coming()  # type: ignore[assignment]
        self.cache = Cache()  # type: ignore[assignment]

    def shard_key(self, shard: ShardInfo) -> str:
        return shard.name


@pytest.mark.parametrize(
    ("coming", "flying", "waited"),
    [
        ({0, 1}, set(), True),  # both blocks fetched by readahead
        ({1}, set(), True),  # the first one cached already
        (set(), {0}, True),  # the first one another read's miss
        (set(), set(), False),  # both cached: nothing was being fetched
    ],
)
def test_a_read_of_a_file_across_two_blocks_waits_for_both(
    view: View, coming: set[int], flying: set[int], waited: bool
) -> None:
    reader = _ComingReader(coming, flying)
    fs = ShardFileSystem(view, reader, ReadConfig(), Stats())
    node = view.lookup("d/big.bin")  # 10,000 bytes: across the end of the first 8 KiB block
    first, last = node.offset // 8192, (node.offset + node.size - 1) // 8192
    assert (first, last) == (0, 1)
    assert fs.wait_block(node) is waited
    assert reader.waited == [
        ("coming" if index in coming else "flight", index) for index in (first, last)
    ]
    # A file in one block waits for that block alone.
    reader.waited.clear()
    small = view.lookup("d/small.bin")
    assert small.offset // 8192 == (small.offset + small.size - 1) // 8192
    fs.wait_block(small)
    assert [index for _, index in reader.waited] == [small.offset // 8192]

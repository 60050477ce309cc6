"""The compiled FUSE hot path (shardfs/fuse/_hot.c): built where a compiler is, and what a
reader receives through it is the source's bytes, damage on disk included."""

from __future__ import annotations

import ctypes
import os
import time
from array import array
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import test_mount_cache as cache_tests
import xxhash
from support.datagen import FIXED_MTIME, pack_with_gnu_tar
from support.mounts import umount, wait_for
from support.page_cache import drop_from_page_cache, resident_pages
from support.s3 import S3Server
from test_mount_cache import (
    BLOCK_FLAG,
    Dataset,
    block_files,
    drop_page_cache,
    header_length,
    mount,
    stats,
    wrong_files,
)

from shardfs.cache import block_format
from shardfs.cache.block_cache import BlockFile
from shardfs.cache.block_format import BlockKey, encode_block, read_header
from shardfs.fuse import hot_library, hot_path, hot_reports
from shardfs.fuse.binding import EntryParam
from shardfs.mount.control import pid_file
from shardfs.views.block_files import FileTable

# The block cache tests' dataset (80 files in 6 shards) and what it is built from.
bucket, sizes, dataset, env = (
    cache_tests.bucket,
    cache_tests.sizes,
    cache_tests.dataset,
    cache_tests.env,
)


def _thread_names(pid: int) -> list[str]:
    return [(task / "comm").read_text().strip() for task in Path(f"/proc/{pid}/task").iterdir()]


def test_the_hot_path_is_built() -> None:
    if os.environ.get("SHARDFS_HOT_PATH") == "0":
        pytest.skip("switched off by SHARDFS_HOT_PATH=0")
    # `make setup` builds it (pyproject's ext-modules): a broken build must fail here.
    assert hot_path.available()


def test_switched_off_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDFS_HOT_PATH", "0")
    assert not hot_path.available()


def _read_twice_through_reads(
    dataset: Dataset, env: dict[str, str], mountpoint: Path, cache: Path
) -> dict[str, int]:
    """A mount whose every read is a READ (no pushes): every file read, then read twice
    more from cache blocks with the page cache dropped; returns the statistics."""
    if not hot_path.available():
        pytest.skip("the hot path is not built")
    mount(dataset.url, mountpoint, cache, "--block-size", BLOCK_FLAG, "--no-kernel-push",
          env=env)  # fmt: skip
    assert wrong_files(mountpoint, dataset) == []
    for _ in range(2):
        drop_page_cache()
        assert wrong_files(mountpoint, dataset, threads=4) == []
    return stats(mountpoint)


@pytest.mark.integration
def test_reads_of_cached_blocks_are_answered_in_c_with_the_same_bytes(
    dataset: Dataset, env: dict[str, str], mountpoint: Path, tmp_path: Path
) -> None:
    after = _read_twice_through_reads(dataset, env, mountpoint, tmp_path / "cache")
    names = _thread_names(int(pid_file(mountpoint).read_text()))
    umount(mountpoint)
    # The daemon's threads carry their names (thread_names), C's disk readers theirs.
    assert names.count("shardfs-disk") == hot_path.DISK_READERS
    assert "shardfs-fuse" in names
    assert after["hot_path_reads"] > 0
    assert after["hot_path_reads"] <= after["cache_hits"]
    assert after["checksum_failures"] == after["hot_path_checksum_failures"] == 0
    # The page cache was dropped under published blocks: their READs waited on the disk in
    # C's disk readers, never in Python.
    assert 0 < after["hot_path_disk_reads"] <= after["hot_path_reads"]
    assert after["hot_path_not_in_memory"] == 0
    # Past the page cache where the cache folder takes O_DIRECT (as this one does)
    assert 0 < after["hot_path_direct_reads"] <= after["hot_path_disk_reads"]


@pytest.mark.integration
def test_a_published_block_damaged_on_disk_is_never_served(
    dataset: Dataset, s3_server: S3Server, env: dict[str, str], mountpoint: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    before = _read_twice_through_reads(dataset, env, mountpoint, cache)
    assert before["hot_path_reads"] > 0
    # Damage every cached block in place (a byte in each chunk's middle) while published.
    for path in block_files(cache):
        header, data_len = header_length(path)
        with open(path, "r+b") as f:
            for at in range(header + 100, header + data_len, 64 << 10):
                f.seek(at)
                byte = f.read(1)
                f.seek(at)
                f.write(bytes([byte[0] ^ 0xFF]))
    drop_page_cache()
    s3_server.reset_counts()
    assert wrong_files(mountpoint, dataset, threads=4) == []
    after = stats(mountpoint)
    umount(mountpoint)
    assert after["checksum_failures"] > before["checksum_failures"]
    # C met the damage first (the blocks were published), then Python, which counted it.
    assert after["hot_path_checksum_failures"] > before["hot_path_checksum_failures"]
    assert s3_server.counts()["get_object_requests"] > 0  # fetched again, not served damaged


@pytest.mark.integration
def test_files_across_two_blocks_are_answered_in_c_once_both_are_published(
    dataset: Dataset, env: dict[str, str], mountpoint: Path, tmp_path: Path
) -> None:
    """Blocks of 64 KiB, files of 50-100 KB: most files lie across two blocks, the rest
    across three, and some blocks hold no file wholly. Read back with the page cache
    dropped, every file across two blocks is answered in C; only those across three reach
    Python."""
    if not hot_path.available():
        pytest.skip("the hot path is not built")
    block = 64 << 10
    mount(dataset.url, mountpoint, tmp_path / "cache", "--block-size", "64K", env=env)
    assert wrong_files(mountpoint, dataset) == []  # cold: blocks fetched, files pushed
    spans = {}
    for name, content in dataset.files.items():
        offset = int(os.getxattr(mountpoint / name, "user.shardfs.offset"))
        spans[name] = (offset + len(content) - 1) // block - offset // block + 1
    cold = stats(mountpoint)
    drop_page_cache()
    assert wrong_files(mountpoint, dataset, threads=4) == []  # every file a READ again
    after = stats(mountpoint)
    umount(mountpoint)
    two, longer = sum(n == 2 for n in spans.values()), sum(n > 2 for n in spans.values())
    assert two > 0 and longer > 0
    assert after["hot_path_edge_reads"] - cold["hot_path_edge_reads"] == two
    assert after["python_reads"] - cold["python_reads"] == longer
    assert after["checksum_failures"] == after["hot_path_checksum_failures"] == 0


def test_a_read_only_slice_of_fetched_bytes_is_handed_to_c_in_place() -> None:
    fetched = bytes(range(256)) * 64
    block = memoryview(fetched)[4096:8192]  # a block cut from a larger GET
    address, held = hot_path._data_address(block)
    assert held is block  # no copy made
    base, _ = hot_path._data_address(fetched)
    assert address == base + 4096
    assert ctypes.string_at(address, len(block)) == fetched[4096:8192]


@pytest.mark.integration
def test_pushed_blocks_are_published_before_any_read_of_theirs_reaches_python(
    dataset: Dataset, env: dict[str, str], mountpoint: Path, tmp_path: Path
) -> None:
    if not hot_path.available():
        pytest.skip("the hot path is not built")
    mount(dataset.url, mountpoint, tmp_path / "cache", "--block-size", BLOCK_FLAG, env=env)
    assert wrong_files(mountpoint, dataset) == []  # cold: blocks fetched, files pushed
    cold = stats(mountpoint)
    drop_page_cache()
    assert wrong_files(mountpoint, dataset, threads=4) == []  # every file a READ again
    after = stats(mountpoint)
    umount(mountpoint)
    assert cold["files_published"] > 0
    # The second read found the blocks published already: none had to be published after
    # a READ in Python, and the READs of their files waited on the disk in C.
    assert after["publishes_after_reads"] == cold["publishes_after_reads"]
    assert after["hot_path_disk_reads"] > cold["hot_path_disk_reads"]
    assert after["checksum_failures"] == after["hot_path_checksum_failures"] == 0
    # Files across two blocks' edge (this dataset's files are all shorter than a block)
    # were published with both blocks: none of the second read's READs reached Python.
    assert after["hot_path_edge_reads"] > cold["hot_path_edge_reads"]
    assert after["python_reads"] == cold["python_reads"]


class _FakeFuse:
    """libfuse's reply functions as C callbacks that record what C answered, for driving
    the compiled READ handler without a kernel; its fallback records what reached Python."""

    _REPLY_BUF = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    _REPLY_ERR = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int)
    _REPLY_NONE = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
    _USERDATA = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)
    _READ = ctypes.CFUNCTYPE(
        None, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int64, ctypes.c_void_p
    )
    _IOCTL = ctypes.CFUNCTYPE(
        None, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_uint, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
    )  # fmt: skip
    _REPLY_ENTRY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
    _LOOKUP = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_char_p)
    _FORGET = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64)
    _FORGET_MULTI = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)

    def __init__(self) -> None:
        self.replies: list[bytes] = []
        self.to_python: list[tuple[int, int, int]] = []  # (ino, size, offset)
        self.ctx = 0
        self.fuse_reply_buf = self._REPLY_BUF(self._reply)
        self.fuse_reply_err = self._REPLY_ERR(lambda _req, _err: 0)
        self.fuse_reply_none = self._REPLY_NONE(self._reply_none)
        self.fuse_req_userdata = self._USERDATA(lambda _req: self.ctx)
        self.python_read = self._READ(self._python_read)
        self.python_ioctl = self._IOCTL(lambda *_: None)
        self.entries: list[EntryParam] = []
        self.entry_result = 0  # what fuse_reply_entry returns (-ENOENT: interrupted)
        self.nones = 0  # fuse_reply_none calls (FORGETs answered)
        self.lookups_to_python: list[tuple[int, bytes]] = []
        self.fuse_reply_entry = self._REPLY_ENTRY(self._reply_entry)
        self.python_lookup = self._LOOKUP(
            lambda _req, parent, name: self.lookups_to_python.append((parent, name))
        )

    def _reply_entry(self, _req: int, entry: int) -> int:
        self.entries.append(
            EntryParam.from_buffer_copy(ctypes.string_at(entry, ctypes.sizeof(EntryParam)))
        )
        return self.entry_result

    def _reply_none(self, _req: int) -> None:
        self.nones += 1

    def _reply(self, _req: int, data: int, size: int) -> int:
        self.replies.append(ctypes.string_at(data, size) if size else b"")
        return 0

    def _python_read(self, _req: int, ino: int, size: int, offset: int, _fi: int) -> None:
        self.to_python.append((ino, size, offset))


KNOWN = bytearray(8)  # the pusher's table the fixture's lookups share


@pytest.fixture
def compiled() -> Iterator[tuple[hot_path.HotPath, _FakeFuse, Callable[..., None]]]:
    """A hot path over ``_FakeFuse`` for 8 inodes, and its READ handler to call; its LOOKUP
    handler is ``hot.lookup(parent, name)``."""
    yield from _compiled(hot_path.MAX_ENTRIES)


def _compiled(
    max_entries: int, counts: array[int] | None = None, opened: list[int] | None = None
) -> Iterator[tuple[hot_path.HotPath, _FakeFuse, Callable[..., None]]]:
    if not hot_path.available():
        pytest.skip("the hot path is not built")
    fuse = _FakeFuse()
    in_kernel, watched, delivered = bytearray(8), bytearray(8), bytearray(1)
    KNOWN[:] = bytes(8)
    lookups = hot_path.Lookups(known=KNOWN, uid=1234, gid=5678, blksize=1 << 17,
                               timeout=86400.0, max_entries=max_entries,
                               counts=counts)  # fmt: skip
    hot = hot_path.create(
        fuse, hint_ino=7, hint_cmd=1, inodes=8, in_kernel=in_kernel, watched=watched,
        delivered=delivered, opened=opened.extend if opened is not None else lambda _inos: None,
        used=lambda _token: None,
        lookups=lookups,
    )  # fmt: skip
    assert hot is not None
    ops = SimpleNamespace(
        read=ctypes.cast(fuse.python_read, ctypes.c_void_p).value,
        ioctl=ctypes.cast(fuse.python_ioctl, ctypes.c_void_p).value,
        lookup=ctypes.cast(fuse.python_lookup, ctypes.c_void_p).value,
        forget=None, forget_multi=None,
    )  # fmt: skip
    fuse.ctx = hot.install(ops)
    handler = _FakeFuse._READ(ops.read)
    lookup_handler = _FakeFuse._LOOKUP(ops.lookup)
    hot.in_kernel = in_kernel  # type: ignore[attr-defined]
    hot.watched = watched  # type: ignore[attr-defined]
    hot.lookup = lambda parent, name: lookup_handler(1, parent, name)  # type: ignore[attr-defined]
    forget, forget_multi = _FakeFuse._FORGET(ops.forget), _FakeFuse._FORGET_MULTI(ops.forget_multi)
    hot.forget = lambda ino, n: forget(1, ino, n)  # type: ignore[attr-defined]

    def forget_many(pairs: list[tuple[int, int]]) -> None:
        flat = (ctypes.c_uint64 * (2 * len(pairs)))(*[v for pair in pairs for v in pair])
        forget_multi(1, len(pairs), ctypes.addressof(flat))

    hot.forget_many = forget_many  # type: ignore[attr-defined]

    def read(ino: int, size: int, offset: int) -> None:
        handler(1, ino, size, offset, None)

    try:
        yield hot, fuse, read
    finally:
        hot.close()


def test_a_fetched_block_is_answered_from_memory_until_it_is_dropped(
    compiled: tuple[hot_path.HotPath, _FakeFuse, Callable[..., None]],
) -> None:
    hot, fuse, read = compiled
    block = os.urandom(10_000)
    early = hot.publish_memory(block, FileTable.of([(3, 100, 5000), (4, 6000, 4000)]), token="b")
    assert early is not None
    read(3, 128 << 10, 0)  # the whole file in one READ
    read(4, 1000, 3500)  # its last 500 bytes
    read(4, 4096, 4000)  # at its end: nothing
    read(5, 4096, 0)  # not in the block: Python's
    assert fuse.replies == [block[100:5100], block[9500:10_000], b""]
    assert fuse.to_python == [(5, 4096, 0)]
    assert hot.in_kernel[3] == 1 and hot.in_kernel[4] == 0  # type: ignore[attr-defined]
    counts = hot.counters()
    assert counts["memory_reads"] == 3 and counts["reads"] == 3
    assert counts["delivered_bytes"] == 9000  # each file counted once
    hot.drop(early)
    assert early.held is None  # the bytes are the caller's again
    read(3, 4096, 0)
    assert fuse.to_python[-1] == (3, 4096, 0) and len(fuse.replies) == 3


def test_a_file_the_hint_follows_is_answered_in_c_and_its_end_told_to_the_hint() -> None:
    """C answers the files an order hint follows as any other; a READ that reaches such a
    file's end is queued for the hint's thread (as a TCGETS open is), the others are not,
    and ``watched_reads`` counts them all (the mount's ``hinted_reads``)."""
    opened: list[int] = []
    for hot, fuse, read in _compiled(hot_path.MAX_ENTRIES, opened=opened):
        block = os.urandom(10_000)
        hot.watched[3] = hot.watched[4] = 1  # type: ignore[attr-defined]
        table = FileTable.of([(3, 100, 5000), (4, 6000, 4000), (6, 0, 100)])
        assert hot.publish_memory(block, table, token="b") is not None
        read(3, 4096, 0)  # its start: not its end
        read(6, 4096, 0)  # whole, but no hint follows it
        time.sleep(2 * hot_reports.OPENED_BATCH_S)
        assert opened == []
        read(3, 4096, 4096)  # its end
        read(4, 128 << 10, 0)  # the whole file in one READ
        deadline = time.monotonic() + 5
        while len(opened) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted(opened) == [3, 4]
        assert fuse.replies == [block[100:4196], block[0:100], block[4196:5100], block[6000:]]
        assert fuse.to_python == []
        counts = hot.counters()
        assert counts["watched_reads"] == 3 and counts["reads"] == 4


def test_a_waited_read_of_a_file_the_hint_follows_is_answered_by_c_once_published() -> None:
    """A READ Python held while its block was fetched is handed to C (``answer``) whether
    or not a hint follows its file: C answers it from the block, counts it as the hint's,
    and queues the file's end for the hint; one of a file not published stays Python's."""
    opened: list[int] = []
    for hot, fuse, _read in _compiled(hot_path.MAX_ENTRIES, opened=opened):
        block = os.urandom(10_000)
        hot.watched[3] = hot.watched[5] = 1  # type: ignore[attr-defined]
        assert not hot.answer(1, 3, 128 << 10, 0)  # not published yet
        table = FileTable.of([(3, 100, 5000), (4, 6000, 4000)])
        assert hot.publish_memory(block, table, token="b") is not None
        assert hot.answer(1, 3, 128 << 10, 0)  # watched, whole
        assert hot.answer(1, 4, 1000, 0)  # not watched, its start
        assert not hot.answer(1, 5, 4096, 0)  # watched, never published
        deadline = time.monotonic() + 5
        while not opened and time.monotonic() < deadline:
            time.sleep(0.01)
        assert opened == [3]
        assert fuse.replies == [block[100:5100], block[6000:7000]]
        counts = hot.counters()
        assert counts["watched_reads"] == 1 and counts["reads"] == 2


def test_dropping_an_early_block_spares_the_block_that_took_its_slot(
    compiled: tuple[hot_path.HotPath, _FakeFuse, Callable[..., None]],
) -> None:
    hot, fuse, read = compiled
    hot._lib.hot_limit_blocks(hot.userdata, 1)  # every block into the one slot
    first = hot.publish_memory(b"a" * 100, FileTable.of([(1, 0, 100)]))
    second = hot.publish_memory(b"b" * 100, FileTable.of([(2, 0, 100)]))
    assert first is not None and second is not None
    assert (first.slot, second.slot) == (0, 0) and second.generation != first.generation
    read(1, 4096, 0)  # its block was replaced: Python's
    hot.drop(first)  # an old handle: the slot's new block stays
    read(2, 4096, 0)
    assert fuse.to_python == [(1, 4096, 0)]
    assert fuse.replies == [b"b" * 100]
    hot.drop(second)
    read(2, 4096, 0)
    assert fuse.to_python[-1] == (2, 4096, 0)


def test_lookups_of_a_published_folder_are_answered_in_c(
    compiled: tuple[hot_path.HotPath, _FakeFuse, Callable[..., None]],
) -> None:
    hot, fuse, _ = compiled
    lookup: Callable[[int, bytes], None] = hot.lookup  # type: ignore[attr-defined]
    lookup(1, b"a.jpg")  # nothing published yet: Python's
    assert fuse.lookups_to_python == [(1, b"a.jpg")] and fuse.entries == []
    folder = [
        (b"a.jpg", 3, 0o100444, 98_765, 1_700_000_000),
        (b"sub", 4, 0o40555, 0, 1_600_000_000),
        ("é.png".encode(), 5, 0o100555, 0, 42),
    ]
    assert hot.publish_folder(1, folder) == 3
    assert hot.publish_folder(1, folder[:1]) == 0  # published once
    assert hot.folder_published(1) and not hot.folder_published(2)
    for name, *_ in folder:
        lookup(1, name)
    lookup(1, b"a.jp")  # a prefix of a name
    lookup(1, b"missing")
    lookup(2, b"a.jpg")  # the same name in another folder
    assert fuse.lookups_to_python[1:] == [(1, b"a.jp"), (1, b"missing"), (2, b"a.jpg")]
    shown = [
        (e.ino, e.attr.st_ino, e.attr.st_mode, e.attr.st_nlink, e.attr.st_size, e.attr.st_blocks,
         e.attr.st_mtim.tv_sec, e.attr.st_ctim.tv_sec)
        for e in fuse.entries
    ]  # fmt: skip
    assert shown == [
        (3, 3, 0o100444, 1, 98_765, 193, 1_700_000_000, 1_700_000_000),
        (4, 4, 0o40555, 2, 0, 0, 1_600_000_000, 1_600_000_000),
        (5, 5, 0o100555, 1, 0, 0, 42, 42),
    ]
    assert {(e.attr.st_uid, e.attr.st_gid, e.attr.st_blksize) for e in fuse.entries} == {
        (1234, 5678, 1 << 17)
    }
    assert {(e.attr_timeout, e.entry_timeout, e.generation) for e in fuse.entries} == {
        (86400.0, 86400.0, 0)
    }
    assert list(KNOWN) == [0, 0, 0, 1, 1, 1, 0, 0]  # the kernel was given these inodes
    assert hot.counters()["lookups"] == 3
    assert hot.stats()["hot_path_lookups"] == 3


def test_c_counts_the_kernels_lookups_of_each_inode_until_it_forgets_them() -> None:
    counts = array("I", bytes(4 * 8))
    fixture = _compiled(hot_path.MAX_ENTRIES, counts)
    hot, fuse, _ = next(fixture)
    try:
        lookup: Callable[[int, bytes], None] = hot.lookup  # type: ignore[attr-defined]
        in_kernel: bytearray = hot.in_kernel  # type: ignore[attr-defined]
        folder = [(b"a.jpg", 3, 0o100444, 10, 0), (b"b.jpg", 4, 0o100444, 10, 0)]
        assert hot.publish_folder(1, folder) == 2
        lookup(1, b"a.jpg")
        lookup(1, b"a.jpg")
        hot.count_lookups([4, 5], 1)  # entries Python's replies handed over
        assert list(counts) == [0, 0, 0, 2, 1, 1, 0, 0]
        assert list(KNOWN) == [0, 0, 0, 1, 1, 1, 0, 0]
        fuse.entry_result = -2  # an interrupted LOOKUP: the kernel took nothing
        lookup(1, b"b.jpg")
        assert counts[4] == 1
        in_kernel[3] = in_kernel[4] = 1
        hot.forget(3, 1)  # type: ignore[attr-defined]
        assert (counts[3], KNOWN[3], in_kernel[3]) == (1, 1, 1)  # one lookup still held
        hot.forget_many([(3, 1), (4, 1), (5, 9), (6, 1)])  # type: ignore[attr-defined]
        assert list(counts) == [0] * 8
        assert list(KNOWN) == [0] * 8 and (in_kernel[3], in_kernel[4]) == (0, 0)
        assert fuse.nones == 2  # each FORGET answered
        hot.count_lookups([5], -1)  # a reply of Python's that failed: not counted below 0
        assert counts[5] == 0
        assert hot.counters()["forgotten"] == 3  # 3, 4 and 5; 6 was never held
        assert hot.stats()["inodes_forgotten"] == 3
    finally:
        fixture.close()


def test_a_folder_past_the_entries_bound_stays_with_python() -> None:
    made = _compiled(max_entries=10_000)
    hot, fuse, _ = next(made)
    try:
        lookup: Callable[[int, bytes], None] = hot.lookup  # type: ignore[attr-defined]
        many = [(f"f{i}".encode(), 2, 0o100444, i, 0) for i in range(9000)]
        assert hot.publish_folder(2, many) == 9000  # the table grew and was rehashed
        lookup(2, b"f0")
        lookup(2, b"f8999")
        assert [e.attr.st_size for e in fuse.entries] == [0, 8999]
        assert hot.publish_folder(3, [(b"x", 6, 0o100444, 1, 0)] * 1001) == -1  # 10,001
        lookup(3, b"x")
        assert fuse.lookups_to_python == [(3, b"x")] and not hot.folder_published(3)
        assert hot.publish_folder(3, [(b"x", 6, 0o100444, 1, 0)] * 1000) == 1000  # 10,000
        with pytest.raises(OSError):
            hot.publish_folder(8, [])  # not an inode of the mount
    finally:
        made.close()


def _stat_tree(root: Path) -> dict[str, tuple[object, ...]]:
    """Every path under ``root`` (its folders listed first), stat'ed after the kernel's
    dentries were dropped: each name a LOOKUP again. A time equal to the mount's own (the
    root's: a folder no shard names) shows as "mount time"."""
    paths = [Path(folder, name) for folder, dirs, files in os.walk(root) for name in dirs + files]
    drop_page_cache()
    mounted = root.stat().st_mtime_ns
    return {
        str(path.relative_to(root)): (st.st_ino, st.st_mode, st.st_nlink, st.st_uid, st.st_gid,
                                      st.st_size, st.st_blocks, st.st_blksize,
                                      "mount time" if st.st_mtime_ns == mounted else st.st_mtime_ns)
        for path in paths
        for st in [path.lstat()]
    }  # fmt: skip


@pytest.fixture
def nested_shards(tmp_path: Path) -> Path:
    """GNU tar shards of a tree two folders deep, in a local folder (the mount's source):
    60 labelled samples (``KEY.jpg``, ``KEY.cls``)."""
    src = tmp_path / "tree"
    for number in range(60):
        path = src / f"class_{number % 3}" / f"part_{number % 2}" / f"img_{number:03d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(3000 + 97 * number))
        path.with_suffix(".cls").write_text(str(number % 4))  # its label, for imagefolder
        for each in (path, path.with_suffix(".cls")):
            os.utime(each, (FIXED_MTIME + number, FIXED_MTIME + number))
    for folder in [src, *(p for p in src.rglob("*") if p.is_dir())]:
        os.utime(folder, (FIXED_MTIME, FIXED_MTIME))  # never the mount's own time
    return pack_with_gnu_tar(src, tmp_path / "shards", files_per_shard=[50, 70])[0].parent


@pytest.mark.integration
@pytest.mark.parametrize("layout", ["raw", "imagefolder"])
def test_lookups_answered_in_c_show_what_python_shows(
    nested_shards: Path, mountpoint: Path, tmp_path: Path, layout: str
) -> None:
    """The same tree through a mount whose LOOKUPs C answers and one without the compiled
    path: every name shows the same inode and attributes, and C answered the files'."""
    if not hot_path.available():
        pytest.skip("the hot path is not built")
    python_only = tmp_path / "python-only"
    python_only.mkdir()
    env = dict(os.environ)
    mount(str(nested_shards), mountpoint, tmp_path / "cache", "--layout", layout, env=env)
    mount(str(nested_shards), python_only, tmp_path / "cache2", "--layout", layout,
          env={**env, "SHARDFS_HOT_PATH": "0"})  # fmt: skip
    try:
        in_c, in_python = _stat_tree(mountpoint), _stat_tree(python_only)
        compiled, plain = stats(mountpoint), stats(python_only)
    finally:
        umount(mountpoint)
        umount(python_only)
    files = [path for path in in_c if path.endswith(".jpg")]
    assert len(files) == 60
    assert in_c == in_python
    assert compiled["folders_published"] == compiled["folders_listed"] > 1
    assert compiled["hot_path_lookups"] >= len(files)
    assert compiled["python_lookups"] == 0  # every folder was listed, so published, first
    assert plain["hot_path_lookups"] == 0 and plain["python_lookups"] >= len(files)


@pytest.mark.integration
def test_a_folder_looked_up_before_any_listing_is_published_after_its_first_lookup(
    nested_shards: Path, mountpoint: Path, tmp_path: Path
) -> None:
    if not hot_path.available():
        pytest.skip("the hot path is not built")
    mount(str(nested_shards), mountpoint, tmp_path / "cache", "--layout", "raw",
          env=dict(os.environ))  # fmt: skip
    try:
        folder = mountpoint / "class_1" / "part_0"
        first = folder / "img_004.jpg"
        assert first.stat().st_size == 3000 + 97 * 4  # LOOKUPs in Python: nothing listed
        wait_for(
            lambda: stats(mountpoint)["folders_published"] >= 3, "3 folders published"
        )  # root, class_1, part_0
        before = stats(mountpoint)
        names = os.listdir(folder)
        drop_page_cache()  # the dentries too: each name below is a LOOKUP again
        for name in names:
            assert (folder / name).stat().st_size > 0
        after = stats(mountpoint)
    finally:
        umount(mountpoint)
    assert before["python_lookups"] == 3  # class_1, part_0, img_004.jpg
    assert before["hot_path_lookups"] == 0
    assert len(names) == 20  # 10 samples, 2 files each
    # Each name, and the two folders above them once: all three folders were published.
    assert after["hot_path_lookups"] - before["hot_path_lookups"] >= len(names)
    assert after["python_lookups"] == before["python_lookups"]


@pytest.mark.parametrize("build", ["shardfs_xxh3_plain", "shardfs_xxh3_avx2"])
def test_c_sums_a_chunk_as_the_block_format_does(build: str) -> None:
    if not hot_path.available():
        pytest.skip("the hot path is not built")
    loaded = hot_library.load()
    assert loaded is not None
    lib = ctypes.CDLL(loaded._name)  # its own function objects, argtypes set here
    if build.endswith("avx2") and not lib.shardfs_has_avx2():
        pytest.skip("this CPU has no AVX2")
    xxh3 = getattr(lib, build)
    xxh3.restype, xxh3.argtypes = ctypes.c_uint64, [ctypes.c_char_p, ctypes.c_size_t]
    # every length class of xxh3's: empty, 1-3, 4-8, 9-16, 17-128, 129-240, long, long+tail
    for length in (0, 1, 3, 4, 8, 9, 16, 17, 128, 129, 240, 241, 1024, 4097, 65536, 65599):
        data = os.urandom(length)
        assert xxh3(data, length) == xxhash.xxh3_64_intdigest(data), length


def test_a_blocks_sums_are_the_same_from_c_and_from_xxhash(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # `make setup` builds the C sums (pyproject's ext-modules): a broken build fails here.
    assert block_format._chunk_sums is not None
    sizes = (0, 1, 65_535, 65_536, 65_537, 3 << 20)
    datas = [os.urandom(size) for size in sizes]
    compiled = [block_format.chunk_sums(memoryview(data), 65_536) for data in datas]
    monkeypatch.setattr(block_format, "_chunk_sums", None)  # the fallback: xxhash
    assert [block_format.chunk_sums(data, 65_536) for data in datas] == compiled
    assert [len(sums) for sums in compiled] == [0, 8, 8, 8, 16, 8 * 48]
    first = xxhash.xxh3_64_intdigest(datas[-1][:65_536])
    assert int.from_bytes(compiled[-1][:8], "little") == first


def _block_file(path: Path, data: bytes, chunk: int) -> BlockFile:
    key = BlockKey("ab" * 16, 0)
    path.write_bytes(encode_block(key, data, chunk))
    fd = os.open(path, os.O_RDONLY)
    header = read_header(fd, key, len(data))
    return BlockFile(fd, header.header_len, header.data_len, header.chunk, header.sums)


def test_a_published_block_file_is_served_checked_against_its_headers_sums(
    compiled: tuple[hot_path.HotPath, _FakeFuse, Callable[..., None]], tmp_path: Path
) -> None:
    hot, fuse, read = compiled
    data, chunk = os.urandom(40_000), 4096
    path = tmp_path / "block"
    block = _block_file(path, data, chunk)
    hot.publish(block, FileTable.of([(1, 100, 9000), (2, 9100, 30_000)]), token="b")
    read(1, 128 << 10, 0)  # whole, across three chunks
    read(2, 5000, 25_000)  # the last 5,000 bytes, in the block's last chunk
    assert fuse.replies == [data[100:9100], data[34_100:39_100]]
    assert fuse.to_python == [] and hot.counters()["checksum_failures"] == 0
    # One byte of chunk 2 changed on disk: a READ touching it is never served from C.
    with open(path, "r+b") as f:
        f.seek(block.data_at + 2 * chunk + 7)
        f.write(bytes([data[2 * chunk + 7] ^ 0xFF]))
    read(1, 128 << 10, 0)
    assert fuse.to_python == [(1, 128 << 10, 0)] and len(fuse.replies) == 2
    assert hot.counters()["checksum_failures"] == 1
    read(2, 4096, 0)  # the whole block was dropped with it: Python's too
    assert fuse.to_python[-1] == (2, 4096, 0)


@pytest.fixture(params=["direct", "buffered"])
def compiled_reads(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[hot_path.HotPath, _FakeFuse, Callable[..., None], bool]]:
    """``compiled``, its disk readers reading with O_DIRECT (the default) or, with
    ``SHARDFS_DIRECT_READS=0``, through the page cache; and which."""
    direct = request.param == "direct"
    if not direct:
        monkeypatch.setenv("SHARDFS_DIRECT_READS", "0")
    for hot, fuse, read in _compiled(hot_path.MAX_ENTRIES):
        yield hot, fuse, read, direct


def test_a_block_file_out_of_the_page_cache_is_read_and_checked_past_it_or_through_it(
    compiled_reads: tuple[hot_path.HotPath, _FakeFuse, Callable[..., None], bool],
    tmp_path: Path,
) -> None:
    hot, fuse, read, direct = compiled_reads
    data, chunk = os.urandom(300_000), 16384
    path = tmp_path / "block"
    block = _block_file(path, data, chunk)
    drop_from_page_cache(path)
    hot.publish(block, FileTable.of([(1, 1000, 150_000), (2, 151_000, 40_000)]), token="b")
    read(1, 128 << 10, 0)
    read(2, 40_000, 0)
    wait_for(lambda: len(fuse.replies) == 2, "the disk readers' replies")
    assert sorted(fuse.replies) == sorted([data[1000 : 1000 + (128 << 10)], data[151_000:191_000]])
    assert fuse.to_python == []
    counts = hot.counters()
    assert counts["disk_reads"] == 2 and counts["checksum_failures"] == 0
    if direct:  # this file system takes O_DIRECT: nothing of the block file was brought
        # into the page cache, not even by the kernel's readahead
        assert counts["direct_reads"] == 2
        assert resident_pages(path) == 0
    else:  # through the page cache, as before stop 55
        assert counts["direct_reads"] == 0
        assert resident_pages(path) > 0
    # One byte of the second file's first chunk changed on disk: never served.
    at = block.data_at + 151_000 // chunk * chunk + 5
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(bytes([data[at - block.data_at] ^ 0xFF]))
    drop_from_page_cache(path)
    read(2, 40_000, 0)
    wait_for(lambda: fuse.to_python == [(2, 40_000, 0)], "the damaged read handed to Python")
    assert len(fuse.replies) == 2 and hot.counters()["checksum_failures"] == 1


def test_a_block_file_whose_sums_do_not_fit_its_length_is_not_published(
    compiled: tuple[hot_path.HotPath, _FakeFuse, Callable[..., None]], tmp_path: Path
) -> None:
    hot, fuse, read = compiled
    block = _block_file(tmp_path / "block", os.urandom(10_000), 4096)  # 3 chunks
    short = BlockFile(block.fd, block.data_at, block.data_len, block.chunk, block.sums[:16])
    hot.publish(short, FileTable.of([(1, 0, 10_000)]))
    read(1, 4096, 0)
    assert fuse.to_python == [(1, 4096, 0)] and not hot.published(1)
    with pytest.raises(OSError):
        os.fstat(block.fd)  # taken over, and closed on the refusal


def _edge_blocks(
    hot: hot_path.HotPath, tmp_path: Path, *, on_disk: tuple[bool, bool], chunk: int = 4096
) -> tuple[bytes, bytes, list[hot_path.Placed], list[Path]]:
    """Two blocks published side by side (each in memory, or from a block file); file 3 lies
    across their edge: the last 7,000 bytes of the first and the first 5,000 of the second."""
    data = [os.urandom(40_000), os.urandom(30_000)]
    placed: list[hot_path.Placed] = []
    paths: list[Path] = []
    held: list[object] = []
    for i, (block, disk) in enumerate(zip(data, on_disk, strict=True)):
        files = FileTable.of([(1 + 3 * i, 0, 1000)])  # a file wholly in each, inodes 1 and 4
        if disk:
            path = tmp_path / f"block{i}"
            got = hot.publish(_block_file(path, block, chunk), files, token=i)
            drop_from_page_cache(path)
            paths.append(path)
        else:
            early = hot.publish_memory(block, files, token=i)
            got = hot_path.Placed(early.slot, early.generation) if early is not None else None
            held.append(early)
        assert got is not None
        placed.append(got)
    hot.held = held  # type: ignore[attr-defined]  # kept alive while published
    assert hot.publish_edge(3, 12_000, placed[0], 33_000, 7000, placed[1])
    return data[0], data[1], placed, paths


@pytest.mark.parametrize("on_disk", [(False, False), (True, True), (False, True), (True, False)])
def test_a_file_across_two_published_blocks_is_answered_from_both(
    compiled_reads: tuple[hot_path.HotPath, _FakeFuse, Callable[..., None], bool],
    tmp_path: Path,
    on_disk: tuple[bool, bool],
) -> None:
    hot, fuse, read, _direct = compiled_reads
    first, second, _placed, _paths = _edge_blocks(hot, tmp_path, on_disk=on_disk)
    whole = first[33_000:] + second[:5000]
    asked = [(128 << 10, 0), (3000, 1000), (3000, 8000), (4000, 5000), (500, 11_800),
             (4096, 12_000)]  # fmt: skip
    # whole, in the first block, in the second, across, at the end, past it
    for count, (size, offset) in enumerate(asked, 1):
        read(3, size, offset)  # one at a time: the disk readers' replies may overtake
        wait_for(lambda n=count: len(fuse.replies) + len(fuse.to_python) == n, "the reply")
    assert fuse.to_python == []
    assert fuse.replies == [whole[offset : offset + size] for size, offset in asked]
    counts = hot.counters()
    assert counts["edge_reads"] == len(asked) and counts["checksum_failures"] == 0
    assert hot.in_kernel[3] == 1  # type: ignore[attr-defined]  # read whole from offset 0
    assert counts["delivered_bytes"] == 12_000  # counted once
    assert hot.published(3)


def test_a_file_across_blocks_is_never_served_from_a_damaged_or_departed_block(
    compiled_reads: tuple[hot_path.HotPath, _FakeFuse, Callable[..., None], bool],
    tmp_path: Path,
) -> None:
    hot, fuse, read, _direct = compiled_reads
    first, second, placed, paths = _edge_blocks(hot, tmp_path, on_disk=(False, True))
    # One byte of the file's part in the second block changed on disk: never served.
    block = paths[0]
    at = block.stat().st_size - 30_000 + 2000  # the data ends the file; byte 2,000 of it
    with open(block, "r+b") as f:
        f.seek(at)
        f.write(bytes([second[2000] ^ 0xFF]))
    drop_from_page_cache(block)
    read(3, 128 << 10, 0)
    wait_for(lambda: fuse.to_python == [(3, 128 << 10, 0)], "the damaged read handed to Python")
    assert fuse.replies == [] and hot.counters()["checksum_failures"] == 1
    assert not hot.published(3)  # the damaged block was dropped, and the file with it
    # An edge given a block's old placement is refused; one whose block in memory is let go
    # of goes back to Python.
    assert not hot.publish_edge(3, 12_000, placed[0], 33_000, 7000, placed[1])
    again = hot.publish_memory(second, FileTable.of([(4, 0, 1000)]))
    assert again is not None
    assert hot.publish_edge(
        3, 12_000, placed[0], 33_000, 7000, hot_path.Placed(again.slot, again.generation)
    )
    read(3, 100, 6950)
    assert fuse.replies == [first[39_950:] + second[:50]]
    hot.drop(hot.held[0])  # type: ignore[attr-defined]
    read(3, 100, 6950)
    assert fuse.to_python[-1] == (3, 100, 6950) and len(fuse.replies) == 1
    assert not hot.published(3)


def test_an_edge_that_does_not_fit_its_blocks_is_refused(
    compiled: tuple[hot_path.HotPath, _FakeFuse, Callable[..., None]],
) -> None:
    hot, fuse, read = compiled
    a = hot.publish_memory(b"a" * 100, FileTable.of([(1, 0, 10)]))
    b = hot.publish_memory(b"b" * 100, FileTable.of([(2, 0, 10)]))
    assert a is not None and b is not None
    pa, pb = hot_path.Placed(a.slot, a.generation), hot_path.Placed(b.slot, b.generation)
    assert not hot.publish_edge(3, 50, pa, 70, 20, pb)  # does not reach a's end
    assert not hot.publish_edge(3, 150, pa, 80, 20, pb)  # runs past b's end
    assert not hot.publish_edge(3, 50, pa, 80, 20, pa)  # one block twice
    assert not hot.publish_edge(9, 50, pa, 80, 20, pb)  # no such inode
    read(3, 4096, 0)
    assert fuse.to_python == [(3, 4096, 0)] and fuse.replies == []
    assert hot.publish_edge(3, 50, pa, 80, 20, pb)
    read(3, 4096, 0)
    assert fuse.replies == [b"a" * 20 + b"b" * 30]

"""The FUSE adapter without FUSE: requests go to ``FuseOperations`` as the session loop would
send them, and a fake reply sink stands in for libfuse's ``fuse_reply_*`` functions. Each
test checks the reply the kernel would get: its kind, errno, entry, attributes or bytes."""

from __future__ import annotations

import ctypes
import errno
import os
import stat
from pathlib import Path
from typing import Any

import pytest
from support.tarbuild import make_tar, store_with, symlink

from shardfs.config import IndexConfig, MountConfig, ReadConfig, ViewConfig
from shardfs.core.filesystem import XATTR_SHARD, ShardFileSystem
from shardfs.errors import StoreReadError
from shardfs.fuse import binding
from shardfs.fuse.operations import FuseOperations
from shardfs.fuse.pushes import KernelPusher
from shardfs.index.db import IndexBuilder
from shardfs.read.direct import DirectReader
from shardfs.stats import Stats
from shardfs.store.shards import ShardInfo
from shardfs.views.view import ROOT_INO, View, build_view

DATA = bytes(range(256)) * 20


class FakeLib:
    """Records every reply as (request, kind, details)."""

    def __init__(self) -> None:
        self.replies: list[tuple[int, str, Any]] = []

    def fuse_reply_err(self, req: int, number: int) -> int:
        self.replies.append((req, "err", number))
        return 0

    def fuse_reply_entry(self, req: int, ref: Any) -> int:
        entry = ref._obj
        details = (entry.ino, entry.attr.st_mode, entry.attr.st_size, entry.entry_timeout)
        self.replies.append((req, "entry", details))
        return 0

    def fuse_reply_attr(self, req: int, ref: Any, timeout: float) -> int:
        attr = ref._obj
        self.replies.append((req, "attr", (attr.st_ino, attr.st_mode, attr.st_size)))
        return 0

    def fuse_reply_buf(self, req: int, data: bytes, size: int) -> int:
        self.replies.append((req, "buf", bytes(data[:size])))
        return 0

    def fuse_reply_readlink(self, req: int, link: bytes) -> int:
        self.replies.append((req, "readlink", link))
        return 0

    def fuse_reply_xattr(self, req: int, size: int) -> int:
        self.replies.append((req, "xattr-size", size))
        return 0

    def fuse_reply_none(self, req: int) -> None:
        self.replies.append((req, "none", None))

    def fuse_reply_open(self, req: int, fi: Any) -> int:
        self.replies.append((req, "open", fi.contents.fh))
        return 0

    def fuse_reply_statfs(self, req: int, ref: Any) -> int:
        self.replies.append((req, "statfs", ref._obj.f_files))
        return 0

    def only(self, req: int) -> tuple[str, Any]:
        """The one reply to ``req`` (a request is answered exactly once)."""
        answers = [(kind, details) for number, kind, details in self.replies if number == req]
        assert len(answers) == 1, answers
        return answers[0]


class FailingReader(DirectReader):
    def read(self, shard: ShardInfo, start: int, end: int, extent_end: int | None = None) -> bytes:
        raise StoreReadError("the store is down")


@pytest.fixture
def view(tmp_path: Path) -> View:
    store = store_with({"a.tar": make_tar([("d/f.bin", DATA), symlink("d/l", "f.bin")])})
    index = IndexBuilder(store, IndexConfig(cache_dir=tmp_path)).build(store.list_shards())
    build_view(index, tmp_path / "view.sqlite", ViewConfig(layout="raw"), lambda _f: None)
    return View(tmp_path / "view.sqlite")


def operations(view: View, *, reader: Any = None, **config: Any) -> tuple[FuseOperations, FakeLib]:
    store = store_with({"a.tar": make_tar([("d/f.bin", DATA), symlink("d/l", "f.bin")])})
    core = ShardFileSystem(view, reader or DirectReader(store, Stats()), ReadConfig(), Stats())
    lib = FakeLib()
    mount = MountConfig(mountpoint=Path("/unused"), threads=False, **config)
    return FuseOperations(core, mount, lib=lib), lib


def lookup_ino(ops: FuseOperations, lib: FakeLib, parent: int, name: bytes, req: int) -> int:
    ops.lookup(req, parent, name)
    kind, details = lib.only(req)
    assert kind == "entry"
    return int(details[0])


def test_lookup_answers_an_entry_or_a_negative_one(view: View) -> None:
    ops, lib = operations(view, kernel_timeout=77)
    folder = lookup_ino(ops, lib, ROOT_INO, b"d", 1)
    ops.lookup(2, folder, b"f.bin")
    kind, (ino, mode, size, timeout) = lib.only(2)
    assert (kind, stat.S_ISREG(mode), size, timeout) == ("entry", True, len(DATA), 77.0)
    assert ino == view.lookup("d/f.bin").ino
    ops.lookup(3, folder, b"missing")
    assert lib.only(3) == ("entry", (0, 0, 0, 77.0))  # inode 0: the kernel may cache "no"
    ops.lookup(4, ino, b"x")  # a name under a file
    assert lib.only(4) == ("err", errno.ENOTDIR)


def test_getattr_readlink_and_statfs(view: View) -> None:
    ops, lib = operations(view)
    node = view.lookup("d/f.bin")
    ops.getattr(1, node.ino, None)
    assert lib.only(1) == ("attr", (node.ino, stat.S_IFREG | 0o444, len(DATA)))
    link = view.lookup("d/l")
    ops.readlink(2, link.ino)
    assert lib.only(2) == ("readlink", b"f.bin")
    ops.readlink(3, node.ino)
    assert lib.only(3) == ("err", errno.EINVAL)
    ops.statfs(4, ROOT_INO)
    assert lib.only(4) == ("statfs", 4)  # root, d, f.bin, l


def test_read_answers_the_bytes_and_a_store_failure_with_its_errno(view: View) -> None:
    ops, lib = operations(view)
    node = view.lookup("d/f.bin")
    ops.read(1, node.ino, 100, 1000, None)
    assert lib.only(1) == ("buf", DATA[1000:1100])
    ops.read(2, node.ino, 4096, len(DATA) - 10, None)
    assert lib.only(2) == ("buf", DATA[-10:])
    store = store_with({"a.tar": b""})
    failing, failing_lib = operations(view, reader=FailingReader(store, Stats()))
    failing.read(3, node.ino, 100, 0, None)
    assert failing_lib.only(3) == ("err", errno.EIO)


def test_open_refuses_writes_and_folders_and_hands_files_to_the_kernel(view: View) -> None:
    ops, lib = operations(view)
    node = view.lookup("d/f.bin")
    for req, flags, ino, expected in [
        (1, os.O_WRONLY, node.ino, errno.EROFS),
        (2, os.O_RDONLY, view.lookup("d").ino, errno.EISDIR),
        (3, os.O_RDONLY, node.ino, errno.ENOSYS),  # zero-open: the kernel opens files itself
    ]:
        info = binding.FileInfo()
        info.flags = flags
        ops.open(req, ino, ctypes.pointer(info))
        assert lib.only(req) == ("err", expected)


def test_xattrs_answer_their_size_then_their_value(view: View) -> None:
    ops, lib = operations(view)
    node = view.lookup("d/f.bin")
    ops.getxattr(1, node.ino, XATTR_SHARD.encode(), 0)
    assert lib.only(1) == ("xattr-size", len(b"a.tar"))
    ops.getxattr(2, node.ino, XATTR_SHARD.encode(), 64)
    assert lib.only(2) == ("buf", b"a.tar")
    ops.getxattr(3, node.ino, XATTR_SHARD.encode(), 2)
    assert lib.only(3) == ("err", errno.ERANGE)
    ops.getxattr(4, node.ino, b"user.none", 64)
    assert lib.only(4) == ("err", errno.ENODATA)


def test_an_ioctl_that_is_not_the_hint_is_not_ours(view: View) -> None:
    ops, lib = operations(view)
    node = view.lookup("d/f.bin")
    ops.ioctl(1, node.ino, 0x5401, 0, None, 0, 0, 0, 0)
    assert lib.only(1) == ("err", errno.ENOTTY)


class _CompiledStub:
    """Stands in for the compiled path: records the READs handed to it, takes them or not."""

    def __init__(self, takes: bool) -> None:
        self.takes = takes
        self.asked: list[tuple[int, int, int, int]] = []

    def answer(self, req: int, ino: int, size: int, offset: int) -> bool:
        self.asked.append((req, ino, size, offset))
        return self.takes


@pytest.mark.parametrize("takes", [True, False])
def test_a_read_that_waited_for_its_blocks_fetch_goes_to_the_compiled_path_first(
    view: View, monkeypatch: pytest.MonkeyPatch, takes: bool
) -> None:
    ops, lib = operations(view)
    stub = _CompiledStub(takes)
    ops.hot = stub  # type: ignore[assignment]
    node = view.lookup("d/f.bin")
    monkeypatch.setattr(ops.core, "wait_block", lambda _node: True)  # its block was coming
    ops.read(1, node.ino, 100, 1000, None)
    assert stub.asked == [(1, node.ino, 100, 1000)]
    # Taken: C replied, Python must not; else Python answers it as before.
    assert [r for r in lib.replies if r[0] == 1] == ([] if takes else [(1, "buf", DATA[1000:1100])])
    assert ops.core.stats.snapshot()["python_reads"] == (0 if takes else 1)
    monkeypatch.setattr(ops.core, "wait_block", lambda _node: False)  # nothing was coming
    ops.read(2, node.ino, 100, 0, None)
    assert len(stub.asked) == 1  # not asked: C could not have it
    assert lib.only(2) == ("buf", DATA[:100])
    # A file an order hint follows: the hint hears of the read before the wait (uncounted:
    # C counts what it answers), then C is asked as for any other.
    steps: list[tuple[str, int, bool]] = []
    monkeypatch.setattr(
        ops.core.hints, "note_read", lambda n, count=True: steps.append(("hint", n.ino, count))
    )
    monkeypatch.setattr(
        ops.core, "wait_block", lambda n: steps.append(("wait", n.ino, True)) or True
    )
    ops.core.hints.watched[node.ino] = 1
    ops.read(3, node.ino, 100, 0, None)
    assert steps[:2] == [("hint", node.ino, False), ("wait", node.ino, True)]
    assert stub.asked[1:] == [(3, node.ino, 100, 0)]
    if takes:
        assert len(steps) == 2 and not [r for r in lib.replies if r[0] == 3]
    else:  # Python reads it, and counts it as the hint's then
        assert steps[2:] == [("hint", node.ino, True)]
        assert lib.only(3) == ("buf", DATA[:100])


def test_python_counts_the_kernels_lookups_of_each_inode_for_the_pusher(view: View) -> None:
    ops, lib = operations(view)
    pusher = KernelPusher(ops.core)  # not started: the counts need no thread
    ops.pusher = pusher
    folder = lookup_ino(ops, lib, ROOT_INO, b"d", 1)
    ino = lookup_ino(ops, lib, folder, b"f.bin", 2)
    lookup_ino(ops, lib, folder, b"f.bin", 3)
    assert (pusher.lookup_counts[folder], pusher.lookup_counts[ino], pusher.known[ino]) == (1, 2, 1)
    lib.fuse_reply_entry = lambda _req, _ref: -errno.ENOENT  # interrupted: not handed over
    ops.lookup(4, folder, b"f.bin")
    assert pusher.lookup_counts[ino] == 2
    pusher.in_kernel[ino] = 1
    ops.forget(5, ino, 1)
    assert (pusher.lookup_counts[ino], pusher.known[ino], pusher.in_kernel[ino]) == (1, 1, 1)
    pairs = (ctypes.c_uint64 * 4)(ino, 1, folder, 1)  # libfuse's fuse_forget_data, twice
    ops.forget_multi(6, 2, ctypes.addressof(pairs))
    assert (pusher.lookup_counts[ino], pusher.known[ino], pusher.in_kernel[ino]) == (0, 0, 0)
    assert pusher.lookup_counts[folder] == 0
    assert lib.only(5) == ("none", None) and lib.only(6) == ("none", None)
    assert ops.core.stats.snapshot()["inodes_forgotten"] == 2

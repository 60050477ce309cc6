"""The kernel pusher without FUSE: a fake session records each FUSE_NOTIFY_STORE."""

from __future__ import annotations

import errno
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from support.inodes import resolve
from tarbuild import make_tar, store_with

from shardfs.config import IndexConfig, ViewConfig
from shardfs.filesystem import ShardFileSystem
from shardfs.fuse.pushes import KernelPusher
from shardfs.index import IndexBuilder
from shardfs.reader import DirectReader
from shardfs.views import Node, View, build_view

FILES = {f"f{i}.bin": bytes([i]) * (1000 + i) for i in range(4)}
SHARD = make_tar(list(FILES.items()))


class FakeSession:
    """Answers ``notify_store`` from a script: the first ``refusals[ino]`` pushes of an inode
    get ENOENT (the kernel does not know it yet), later ones succeed."""

    def __init__(self, refusals: dict[int, int] | None = None) -> None:
        self.refusals = dict(refusals or {})
        self.stored: list[tuple[int, bytes]] = []
        self.calls = 0

    def notify_store(self, ino: int, offset: int, data: bytes) -> int:
        self.calls += 1
        if self.refusals.get(ino, 0) > 0:
            self.refusals[ino] -= 1
            return -errno.ENOENT
        self.stored.append((ino, bytes(data)))
        return 0


class AllLocal(ShardFileSystem):
    """Every file's bytes count as cached (what the pusher asks of the block cache)."""

    def file_bytes_local(self, node: Node) -> bytes | None:
        return SHARD[node.offset : node.offset + node.size]


@pytest.fixture
def core(tmp_path: Path) -> ShardFileSystem:
    store = store_with({"a.tar": SHARD})
    index = IndexBuilder(store, IndexConfig(cache_dir=tmp_path)).build(store.list_shards())
    out = tmp_path / "view.sqlite"
    build_view(index, out, ViewConfig(layout="raw"), lambda _folder: None)
    view = View(out)
    return AllLocal(view, DirectReader(store))


def _wait(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _pusher(core: ShardFileSystem, session: FakeSession) -> KernelPusher:
    pusher = KernelPusher(core)
    pusher.start(session)  # type: ignore[arg-type]
    return pusher


def _inodes(core: ShardFileSystem) -> dict[str, int]:
    return {name: resolve(core, name).ino for name in FILES}


def test_a_push_the_kernel_refuses_at_first_is_retried_then_stops_retrying(
    core: ShardFileSystem,
) -> None:
    inodes = _inodes(core)
    session = FakeSession({inodes["f1.bin"]: 2})
    pusher = _pusher(core, session)
    try:
        for ino in inodes.values():
            pusher.inode_known(ino)
        shard = next(iter(core.view.shards.values()))
        pusher.block_local(shard, 0, len(SHARD), SHARD)
        _wait(lambda: len(session.stored) == len(FILES), "every file pushed")
        assert sorted(session.stored) == sorted((inodes[n], d) for n, d in FILES.items())
        assert pusher.retrying == 0  # nothing left to poll for
        calls = session.calls
        time.sleep(0.3)  # several retry periods: an idle pusher makes no calls
        assert session.calls == calls == len(FILES) + 2
    finally:
        pusher.stop()


def test_a_retry_of_a_file_the_kernel_got_meanwhile_ends(core: ShardFileSystem) -> None:
    inodes = _inodes(core)
    target = inodes["f2.bin"]
    session = FakeSession({target: 1})
    pusher = _pusher(core, session)
    try:
        for ino in inodes.values():
            pusher.inode_known(ino)
        pusher.block_local(next(iter(core.view.shards.values())), 0, len(SHARD), SHARD)
        _wait(lambda: len(session.stored) == len(FILES) - 1, "the other files pushed")
        pusher.in_kernel[target] = 1  # a READ delivered the whole file meanwhile
        _wait(lambda: pusher.retrying == 0, "the retry dropped")
        assert target not in [ino for ino, _ in session.stored]
    finally:
        pusher.stop()


def test_files_waiting_for_their_inode_are_pushed_by_a_listing_not_by_a_lookup(
    core: ShardFileSystem,
) -> None:
    inodes = _inodes(core)
    session = FakeSession()
    pusher = _pusher(core, session)
    try:
        pusher.block_local(next(iter(core.view.shards.values())), 0, len(SHARD), SHARD)
        time.sleep(0.2)
        assert session.calls == 0  # no inode known: every file waits
        # A LOOKUP is followed at once by the READ of the same file: no push races it.
        pusher.inode_known(inodes["f0.bin"], push_waiting=False)
        # A listing hands inodes over long before their reads: those are pushed.
        pusher.inode_known(inodes["f3.bin"])
        _wait(lambda: len(session.stored) == 1, "the listed file pushed")
        time.sleep(0.2)
        assert session.stored == [(inodes["f3.bin"], FILES["f3.bin"])]
    finally:
        pusher.stop()

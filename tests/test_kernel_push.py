"""The kernel pusher without FUSE: a fake session records each FUSE_NOTIFY_STORE.

No test sleeps to let the pusher's thread get somewhere. A *fence* (an empty block queued
behind the work) shows that the thread finished everything queued before it, and the core
records which inodes a retry pass looked up, so a test knows a retry happened."""

from __future__ import annotations

import ctypes
import errno
import itertools
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.inodes import resolve
from support.mounts import wait_for
from support.tarbuild import make_tar, store_with

from shardfs.config import IndexConfig, ReadConfig, ViewConfig
from shardfs.core.filesystem import ShardFileSystem
from shardfs.formats.tar import MemberKind
from shardfs.fuse import hot_path
from shardfs.fuse.binding import BufVec
from shardfs.fuse.edges import EdgeFiles
from shardfs.fuse.pushes import _PUSH_RETRIES, KernelPusher
from shardfs.index.db import IndexBuilder
from shardfs.read.direct import DirectReader
from shardfs.stats import Stats
from shardfs.store.shards import ShardInfo
from shardfs.views.block_files import FileTable
from shardfs.views.view import Node, View, build_view

FILES = {f"f{i}.bin": bytes([i]) * (1000 + i) for i in range(4)}
SHARD = make_tar(list(FILES.items()))


class FakeSession:
    """Answers ``notify_store`` from a script: the first ``refusals[ino]`` pushes of an inode
    get ENOENT (the kernel does not know it yet), later ones succeed. ``on_refusal`` runs
    inside the refused call, i.e. at a known point of the pusher's thread."""

    def __init__(self, refusals: dict[int, int] | None = None) -> None:
        self.refusals = dict(refusals or {})
        self.stored: list[tuple[int, bytes]] = []
        self.calls: Counter[int] = Counter()
        self.on_refusal: Callable[[int], None] = lambda ino: None

    def notify_store(
        self, ino: int, offset: int, data: bytes, start: int = 0, length: int | None = None
    ) -> int:
        self.calls[ino] += 1
        if self.refusals.get(ino, 0) > 0:
            self.refusals[ino] -= 1
            self.on_refusal(ino)
            return -errno.ENOENT
        end = len(data) if length is None else start + length
        assert 0 <= start <= end <= len(data)
        self.stored.append((ino, bytes(data[start:end])))
        return 0

    def stored_inodes(self) -> list[int]:
        return [ino for ino, _ in self.stored]

    def compiled_target(self) -> tuple[int, int]:
        """As ``binding.Session.store_target``: a C function (here calling back into
        ``notify_store``), so that the pusher stores whole blocks through ``hot_push``."""

        def store(_session: int, ino: int, offset: int, vector: Any, _flags: int) -> int:
            piece = vector.contents.buf[0]
            return self.notify_store(ino, offset, ctypes.string_at(piece.mem, piece.size))

        self._callback = _STORE_TYPE(store)  # kept alive while C may call it
        return ctypes.cast(self._callback, ctypes.c_void_p).value or 0, 0


_STORE_TYPE = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int64, ctypes.POINTER(BufVec),
    ctypes.c_int,
)  # fmt: skip


@pytest.fixture(autouse=True, params=["per-file", "compiled"])
def push_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test twice: blocks pushed file by file in Python, and in one C call."""
    if request.param == "compiled":
        if not hot_path.available():
            pytest.skip("the compiled hot path is not built")
        monkeypatch.setattr(FakeSession, "store_target", FakeSession.compiled_target, raising=False)
    return str(request.param)


class AllLocal(ShardFileSystem):
    """Every file's bytes count as cached (what the pusher asks of the block cache). Counts
    the fences the pusher reached and the inodes it looked up (only a retry pass does)."""

    fences = 0
    let_go = 0
    looked_up: Counter[int]

    def blocks_let_go(self) -> None:
        self.let_go += 1

    def file_bytes_local(self, node: Node) -> bytes | None:
        return SHARD[node.offset : node.offset + node.size]

    def block_files(self, shard: ShardInfo, start: int, end: int) -> tuple[FileTable, list[Node]]:
        if start == end:
            self.fences += 1
        return super().block_files(shard, start, end)

    def node(self, ino: int) -> Node:
        self.looked_up[ino] += 1
        return super().node(ino)


@pytest.fixture
def core(tmp_path: Path) -> AllLocal:
    store = store_with({"a.tar": SHARD})
    index = IndexBuilder(store, IndexConfig(cache_dir=tmp_path)).build(store.list_shards())
    out = tmp_path / "view.sqlite"
    build_view(index, out, ViewConfig(layout="raw"), lambda _folder: None)
    view = View(out)
    core = AllLocal(view, DirectReader(store, Stats()), ReadConfig(), Stats())
    core.looked_up = Counter()
    return core


def _shard(core: ShardFileSystem) -> ShardInfo:
    return next(iter(core.view.shards.values()))


def _fence(pusher: KernelPusher, core: AllLocal) -> None:
    """Return once the pusher's thread has finished everything queued before this call
    (its one thread takes the queue in order; an empty block pushes nothing)."""
    seen = core.fences
    pusher.block_local(_shard(core), 0, 0, b"")
    wait_for(lambda: core.fences > seen, "the pusher to reach the fence")


def _pusher(core: ShardFileSystem, session: FakeSession) -> KernelPusher:
    pusher = KernelPusher(core)
    pusher.start(session)  # type: ignore[arg-type]
    return pusher


def _inodes(core: ShardFileSystem) -> dict[str, int]:
    return {name: resolve(core, name).ino for name in FILES}


def test_a_push_the_kernel_refuses_at_first_is_retried_until_it_succeeds(core: AllLocal) -> None:
    inodes = _inodes(core)
    refused = inodes["f1.bin"]
    session = FakeSession({refused: 2})
    pusher = _pusher(core, session)
    try:
        for ino in inodes.values():
            pusher.inode_known(ino)
        pusher.block_local(_shard(core), 0, len(SHARD), SHARD)
        wait_for(lambda: len(session.stored) == len(FILES), "every file pushed")
        assert sorted(session.stored) == sorted((inodes[n], d) for n, d in FILES.items())
        assert pusher.retrying == 0  # nothing left to poll for
        _fence(pusher, core)
        # Two refusals, two retry passes, then one success; every other file pushed once.
        assert core.looked_up[refused] == 2
        assert session.calls == Counter({**dict.fromkeys(inodes.values(), 1), refused: 3})
    finally:
        pusher.stop()


def test_files_of_a_block_that_starts_mid_shard_are_pushed_from_their_own_offsets(
    core: AllLocal,
) -> None:
    """A block's bytes are handed to the kernel in place: each file's slice of the block
    must be its own bytes, whatever the block's offset in the shard."""
    inodes = _inodes(core)
    first = min(resolve(core, name).offset for name in FILES if name != "f0.bin")
    session = FakeSession()
    pusher = _pusher(core, session)
    try:
        for ino in inodes.values():
            pusher.inode_known(ino)
        pusher.block_local(_shard(core), first, len(SHARD), SHARD[first:])
        _fence(pusher, core)
        expected = {(inodes[n], d) for n, d in FILES.items() if n != "f0.bin"}
        assert set(session.stored) == expected and len(session.stored) == len(expected)
    finally:
        pusher.stop()


def test_a_push_refused_every_time_waits_for_the_next_listing(core: AllLocal) -> None:
    inodes = _inodes(core)
    refused = inodes["f1.bin"]
    session = FakeSession({refused: 1 + _PUSH_RETRIES})
    pusher = _pusher(core, session)
    try:
        for ino in inodes.values():
            pusher.inode_known(ino)
        pusher.block_local(_shard(core), 0, len(SHARD), SHARD)
        wait_for(
            lambda: core.looked_up[refused] == _PUSH_RETRIES and pusher.retrying == 0,
            "the last retry",
        )
        _fence(pusher, core)
        assert session.calls[refused] == 1 + _PUSH_RETRIES
        assert refused not in session.stored_inodes()  # given up: no more retries
        # The kernel is handed the inode again (a listing): the file is pushed once more.
        pusher.inode_known(refused)
        wait_for(lambda: refused in session.stored_inodes(), "the push after the listing")
        _fence(pusher, core)
        assert session.calls[refused] == 2 + _PUSH_RETRIES
        assert sorted(session.stored) == sorted((inodes[n], d) for n, d in FILES.items())
    finally:
        pusher.stop()


def test_a_retry_of_a_file_the_kernel_got_meanwhile_ends(core: AllLocal) -> None:
    inodes = _inodes(core)
    target = inodes["f2.bin"]
    session = FakeSession({target: 1})
    pusher = _pusher(core, session)
    # A READ delivers the whole file between the refusal and the retry.
    session.on_refusal = lambda ino: pusher.in_kernel.__setitem__(ino, 1)
    try:
        for ino in inodes.values():
            pusher.inode_known(ino)
        pusher.block_local(_shard(core), 0, len(SHARD), SHARD)
        wait_for(lambda: pusher.retried == 1 and pusher.retrying == 0, "the retry dropped")
        _fence(pusher, core)
        assert session.calls[target] == 1  # the retry looked, saw the file there, pushed nothing
        assert target not in session.stored_inodes()
        assert len(session.stored) == len(FILES) - 1
    finally:
        pusher.stop()


def test_files_waiting_for_their_inode_are_pushed_by_a_listing_not_by_a_lookup(
    core: AllLocal,
) -> None:
    inodes = _inodes(core)
    session = FakeSession()
    pusher = _pusher(core, session)
    try:
        pusher.block_local(_shard(core), 0, len(SHARD), SHARD)
        _fence(pusher, core)
        assert sum(session.calls.values()) == 0  # no inode known: every file waits
        # A LOOKUP is followed at once by the READ of the same file: no push races it.
        pusher.inode_known(inodes["f0.bin"], push_waiting=False)
        # A listing hands inodes over long before their reads: those are pushed.
        pusher.inode_known(inodes["f3.bin"])
        wait_for(lambda: len(session.stored) == 1, "the listed file pushed")
        _fence(pusher, core)
        assert session.stored == [(inodes["f3.bin"], FILES["f3.bin"])]
        assert sum(session.calls.values()) == 1
    finally:
        pusher.stop()


def test_an_inode_the_kernel_forgot_is_not_pushed_until_it_is_listed_again(
    core: AllLocal,
) -> None:
    inodes = _inodes(core)
    f0, f1, f2, f3 = (inodes[f"f{i}.bin"] for i in range(4))
    session = FakeSession()
    pusher = _pusher(core, session)
    try:
        pusher.given([f0, f0, f1, f2, f3])  # f0 by two lookups, the others by one
        pusher.in_kernel[f0] = pusher.in_kernel[f1] = 1
        pusher.forgot([(f0, 1)])  # one of f0's two given back: the kernel still holds it
        assert (pusher.known[f0], pusher.in_kernel[f0], pusher.lookup_counts[f0]) == (1, 1, 1)
        pusher.forgot([(f0, 1), (f1, 1), (f2, 7)])  # more than given: none is held
        assert [pusher.known[i] for i in (f0, f1, f2, f3)] == [0, 0, 0, 1]
        assert (pusher.in_kernel[f0], pusher.in_kernel[f1]) == (0, 0)  # its pages went too
        assert [pusher.lookup_counts[i] for i in (f0, f1, f2, f3)] == [0, 0, 0, 1]
        pusher.forgot([(f2, 1)])  # an inode not held: nothing more is dropped
        assert core.stats.snapshot()["inodes_forgotten"] == 3
        pusher.given([f3])
        pusher.not_given([f3])  # that reply never reached the kernel
        assert pusher.lookup_counts[f3] == 1
        pusher.block_local(_shard(core), 0, len(SHARD), SHARD)
        _fence(pusher, core)
        # Only f3 is tried: a push to an inode the kernel dropped would be refused.
        assert session.calls == Counter({f3: 1})
        assert core.stats.snapshot()["pushes_refused"] == 0
        pusher.given([f1])  # a listing hands f1 over again: its file is pushed now
        pusher.inode_known(f1)
        wait_for(lambda: f1 in session.stored_inodes(), "the push after the listing")
        assert sorted(session.stored) == sorted([(f3, FILES["f3.bin"]), (f1, FILES["f1.bin"])])
    finally:
        pusher.stop()


def test_a_refused_push_is_counted(core: AllLocal) -> None:
    inodes = _inodes(core)
    session = FakeSession({inodes["f1.bin"]: 1})
    pusher = _pusher(core, session)
    try:
        pusher.given(list(inodes.values()))
        pusher.block_local(_shard(core), 0, len(SHARD), SHARD)
        wait_for(lambda: len(session.stored) == len(FILES), "the retried push")
        assert core.stats.snapshot()["pushes_refused"] == 1
    finally:
        pusher.stop()


def test_the_compiled_push_keeps_the_pushers_rules() -> None:
    """``hot_push`` on its own: a file the kernel holds is skipped, one whose inode it does
    not know is marked waiting, bytes outside the buffer or an inode past the tables are
    refused, the rest stored."""
    if not hot_path.available():
        pytest.skip("the compiled hot path is not built")
    session = FakeSession({4: 1})
    in_kernel, known, waiting = bytearray(8), bytearray(b"\1" * 8), bytearray(8)
    in_kernel[1], known[2] = 1, 0
    batch = hot_path.batch_push(session.compiled_target(), in_kernel, known, waiting)
    assert batch is not None
    data = bytes(range(100))
    files = [(0, 0, 10), (1, 10, 10), (2, 20, 10), (3, 95, 10), (4, 30, 10), (5, 40, 60),
             (8, 0, 10)]  # fmt: skip
    pushed, results = batch.push(data, FileTable.of(files))
    assert list(results) == [
        hot_path.PUSHED,
        hot_path.IN_KERNEL,
        hot_path.WAITING,
        -errno.EINVAL,
        -errno.ENOENT,
        hot_path.PUSHED,
        -errno.EINVAL,  # an inode past the tables
    ]
    assert pushed == 70
    assert session.stored == [(0, data[0:10]), (5, data[40:100])]
    assert list(in_kernel) == [1, 1, 0, 0, 0, 1, 0, 0]
    assert list(waiting) == [0, 0, 1, 0, 0, 0, 0, 0]


@pytest.mark.parametrize("order", ["in order", "reversed"])
def test_a_file_crossing_block_edges_is_pushed_whole_once_its_blocks_have_passed(
    core: AllLocal, order: str
) -> None:
    """Blocks cut inside f1 and twice inside f2 (its middle part a block of its own, sent
    last): the files crossing edges are pushed whole, with their own bytes, once their last
    block arrives, whatever the order the blocks come in; nothing is left held."""
    inodes = _inodes(core)
    f1, f2 = resolve(core, "f1.bin"), resolve(core, "f2.bin")
    cuts = [0, f1.offset + 10, f2.offset + 100, f2.offset + 900, len(SHARD)]
    blocks = list(itertools.pairwise(cuts))
    middle = blocks.pop(2)  # wholly inside f2: sent last
    if order == "reversed":
        blocks.reverse()
    session = FakeSession()
    pusher = _pusher(core, session)
    try:
        for ino in inodes.values():
            pusher.inode_known(ino)
        for start, end in blocks:
            pusher.block_local(_shard(core), start, end, SHARD[start:end])
        _fence(pusher, core)
        assert sorted(session.stored_inodes()) == sorted(
            inodes[n] for n in FILES if n != "f2.bin"
        )  # f1 whole once both its blocks passed; f2 still lacks its middle
        pusher.block_local(_shard(core), *middle, SHARD[middle[0] : middle[1]])
        _fence(pusher, core)
        assert sorted(session.stored) == sorted((inodes[n], d) for n, d in FILES.items())
        assert pusher._edges.held == 0
    finally:
        pusher.stop()


def test_edge_files_drop_the_oldest_incomplete_file_beyond_their_bound() -> None:
    """Held parts stay within the bound; a dropped file is simply never handed back."""

    def node(ino: int, offset: int, size: int) -> Node:
        return Node(ino, MemberKind.FILE, 0, offset, size, 0o100444, 0, "")

    edges = EdgeFiles(limit=100, max_file=1000)
    first, second, third = node(2, 50, 100), node(3, 250, 100), node(4, 380, 100)
    assert edges.add([first], 0, bytes(100)) == []  # 50 bytes of the first held
    assert edges.add([second], 200, bytes(100)) == []  # and 50 of the second
    assert edges.held == 100
    assert edges.add([third], 300, bytes(range(100))) == []  # 120: the first dropped
    assert edges.held == 70
    assert edges.add([first], 100, bytes(100)) == []  # its first part is gone: not whole
    whole = edges.add([third], 400, bytes(range(100, 200)))
    assert whole == [(third, bytes(range(80, 180)))]
    assert edges.held == 50  # the first's second part
    assert edges.add([node(6, 0, 2000)], 0, bytes(100)) == []  # larger than max_file
    assert edges.held == 50


def _record_early(pusher: KernelPusher, session: FakeSession) -> tuple[list[Any], list[Any]]:
    """Have ``pusher`` publish blocks early into lists: (start, inodes, pushes made so far)
    for each block published, and (token, pushes made so far) for each released."""
    early: list[Any] = []
    released: list[Any] = []

    def publish_early(
        _shard: ShardInfo, start: int, _block: Any, files: FileTable, _edges: Any
    ) -> Any:
        early.append((start, sorted(files.inos), len(session.stored)))
        return ("early", len(early))

    pusher.publish_early = publish_early
    pusher.release = lambda token: released.append((token, len(session.stored)))
    return early, released


def test_a_block_in_memory_is_published_before_its_pushes_and_released_after_them(
    core: AllLocal,
) -> None:
    inodes = _inodes(core)
    session = FakeSession()
    pusher = _pusher(core, session)
    early, released = _record_early(pusher, session)
    try:
        for ino in inodes.values():
            pusher.inode_known(ino)
        pusher.block_local(_shard(core), 0, len(SHARD), SHARD)
        pusher.block_local(_shard(core), 0, len(SHARD), None)  # not in memory: not early
        wait_for(lambda: len(released) == 1, "the early block released")
        assert early == [(0, sorted(inodes.values()), 0)]  # before any push
        assert released == [(("early", 1), len(FILES))]  # after all of them
        _fence(pusher, core)
        assert core.let_go == 1  # readahead told once: the block in memory, not the other
    finally:
        pusher.stop()
    assert len(early) == 1 and len(released) == 1


def test_blocks_published_early_are_released_when_the_pusher_stops_first(
    core: AllLocal,
) -> None:
    """Stopping drops the blocks still queued: each one published early is released all
    the same, so that nothing goes on answering from bytes no longer kept."""
    inodes = _inodes(core)
    blocked = inodes["f0.bin"]
    session = FakeSession({blocked: 1})
    gate = threading.Event()
    session.on_refusal = lambda _ino: gate.wait(10)  # the pusher waits inside a push
    pusher = _pusher(core, session)
    early, released = _record_early(pusher, session)
    for ino in inodes.values():
        pusher.inode_known(ino)
    for _ in range(3):
        pusher.block_local(_shard(core), 0, len(SHARD), SHARD)
    wait_for(lambda: session.calls[blocked] == 1, "the pusher inside its first push")
    stopping = threading.Thread(target=pusher.stop)
    stopping.start()
    wait_for(lambda: pusher._abort, "the stop under way")
    gate.set()
    stopping.join(10)
    assert not stopping.is_alive()
    assert len(early) == 3
    assert sorted(token for token, _ in released) == [("early", 1), ("early", 2), ("early", 3)]

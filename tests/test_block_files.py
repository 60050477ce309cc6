"""A block's files from loaded windows of a shard (``views.block_files``), checked against
a plain scan of every file, and through a real view against the nodes it holds."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from support.tarbuild import make_tar, store_with

from shardfs.config import IndexConfig, ViewConfig
from shardfs.index.db import IndexBuilder
from shardfs.views.block_files import FileTable, ShardWindows
from shardfs.views.view import View, build_view

Layout = list[tuple[int, int, int]]  # (offset, size, ino), in offset order


def _layout(seed: int, files: int, nested: bool = False) -> Layout:
    """Files one after another with gaps (headers), some far larger than a block; with
    ``nested``, some files also hold a smaller one inside their bytes (their ends then no
    longer rise with their offsets)."""
    rng = random.Random(seed)
    out, at = [], 0
    for ino in range(1, files + 1):
        at += rng.choice([0, 512, 1024])
        size = rng.choice([1, 300, 2000, 5000, 40_000])
        out.append((at, size, 100 + ino))
        if nested and size > 2 and rng.random() < 0.3:
            out.append((at + 1, rng.randrange(1, size - 1), 10_000 + ino))
        at += size
    return out


class _Queries:
    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.calls = 0

    def files_from(self, shard: int, start: int, end: int) -> Layout:
        assert shard == 7
        self.calls += 1
        return [row for row in self.layout if start <= row[0] < end]

    def files_before(self, shard: int, offset: int, count: int) -> Layout:
        assert shard == 7
        return [row for row in self.layout if row[0] < offset][-count:]


def _expected(layout: Layout, start: int, end: int) -> tuple[Layout, set[int]]:
    inside = [
        (ino, at - start, size) for at, size, ino in layout if start <= at and at + size <= end
    ]
    across = {ino for at, size, ino in layout if at < end and at + size > start}
    return inside, across - {ino for ino, _, _ in inside}


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("window", [3000, 10_000, 1 << 20])
@pytest.mark.parametrize("block", [1000, 4096, 16_384])
def test_every_blocks_files_match_a_scan_of_the_whole_shard(
    window: int, block: int, nested: bool
) -> None:
    layout = _layout(seed=window + block, files=300, nested=nested)
    queries = _Queries(layout)
    windows = ShardWindows(queries.files_from, queries.files_before, window=window)
    total = layout[-1][0] + layout[-1][1]
    crossing_seen = 0
    for start in range(0, total, block):
        end = min(start + block, total)
        files, across = windows.touching(7, start, end)
        inside, crossing = _expected(layout, start, end)
        assert list(files) == inside, (start, end)
        # a file crossing the start is looked for among the last few before it, as the
        # view's query did: every crossing file here is one of those
        assert set(across) == crossing, (start, end)
        crossing_seen += len(crossing)
    assert crossing_seen > 0  # the layouts do put files across block edges


def test_windows_are_loaded_once_and_the_oldest_dropped_past_the_bound() -> None:
    layout = _layout(seed=1, files=400)
    queries = _Queries(layout)
    windows = ShardWindows(queries.files_from, queries.files_before, window=50_000, max_files=60)
    windows.touching(7, 0, 4096)
    windows.touching(7, 4096, 8192)  # the same window
    assert queries.calls == 1
    total = layout[-1][0] + layout[-1][1]
    for start in range(0, total, 50_000):
        windows.touching(7, start, start + 4096)
    loaded = queries.calls
    windows.touching(7, 0, 4096)  # dropped meanwhile: loaded again
    assert queries.calls == loaded + 1


def test_a_file_table_holds_what_c_reads() -> None:
    table = FileTable.of([(5, 0, 10), (6, 10, 20)])
    assert (table.inos.typecode, table.positions.typecode, table.sizes.typecode) == ("Q", "q", "q")
    assert list(table) == [(5, 0, 10), (6, 10, 20)] and len(table) == 2
    with pytest.raises(ValueError, match="differ in length"):
        FileTable(table.inos, table.positions[:1], table.sizes)


def test_a_views_block_files_are_its_nodes(tmp_path: Path) -> None:
    """Through a real view: every file lying wholly in a block comes back once, with its
    bytes at its position; a file across a block's edge comes back as its node."""
    members = {f"d/{n:03d}.bin": bytes([n % 251]) * (700 + 37 * n) for n in range(60)}
    shard = make_tar(members.items())
    store = store_with({"a.tar": shard})
    index = IndexBuilder(store, IndexConfig(cache_dir=tmp_path)).build(store.list_shards())
    build_view(index, tmp_path / "view.sqlite", ViewConfig(layout="raw"), lambda _f: None)
    view = View(tmp_path / "view.sqlite")
    try:
        sid = next(iter(view.shards))
        paths = {node.ino: path for path, node in view.files()}
        nodes = {node.ino: node for _, node in view.files()}
        block, inside, across_seen = 8192, list[int](), set[int]()
        for start in range(0, len(shard), block):
            end = min(start + block, len(shard))
            files, across = view.block_files(sid, start, end)
            for ino, position, size in files:
                node = nodes[ino]
                assert (node.offset - start, node.size) == (position, size)
                data = shard[start + position : start + position + size]
                assert data == members[paths[ino].lstrip("/")]
            for node in across:
                assert node.offset < end and node.offset + node.size > start
                assert node.offset < start or node.offset + node.size > end
            inside += files.inos
            across_seen.update(node.ino for node in across)
        assert sorted(inside) == sorted(set(inside))  # each file inside one block at most
        assert set(inside) | across_seen == set(nodes)
        assert across_seen  # some files do cross the edges of 8 KiB blocks
    finally:
        view.close()


def test_many_small_windows_count_against_the_bound_too() -> None:
    """Shards of one file each (single-file shards): the windows themselves are bounded."""

    def files_from(shard: int, start: int, end: int) -> Layout:
        return [(0, 10, shard)] if start == 0 else []

    windows = ShardWindows(files_from, lambda _s, _o, _c: [], max_files=1000)
    for shard in range(5000):
        files, _ = windows.touching(shard, 0, 10)
        assert list(files) == [(shard, 0, 10)]
    assert len(windows._windows) <= 1000 // 17 + 1

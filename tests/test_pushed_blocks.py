"""The pusher's blocks handed to the compiled path (shardfs/fuse/pushed_blocks.py): a file
across two blocks is published once both are, with where C holds each of them now."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from shardfs.formats.tar import MemberKind
from shardfs.fuse.hot_path import InMemory, Placed
from shardfs.fuse.pushed_blocks import PushedBlocks
from shardfs.store.shards import ShardInfo
from shardfs.views.block_files import FileTable
from shardfs.views.view import Node

SHARD = ShardInfo("a.tar", 1000, "e")
BLOCK = 100


class _Hot:
    """The compiled path as PushedBlocks uses it: each publish takes the next placement it
    is given; the edges it is asked to publish are recorded."""

    def __init__(self, placements: list[tuple[int, int]]) -> None:
        self.placements = list(placements)
        self.edges: list[tuple[int, int, Placed, int, int, Placed]] = []

    def publish_memory(self, data: Any, files: FileTable, token: Any = None) -> InMemory:
        slot, generation = self.placements.pop(0)
        return InMemory(slot, generation, data)

    def publish_edge(
        self, ino: int, size: int, first: Placed, pos: int, head: int, second: Placed
    ) -> bool:
        self.edges.append((ino, size, first, pos, head, second))
        return True


def _node(ino: int, offset: int, size: int) -> Node:
    return Node(ino, MemberKind.FILE, 0, offset, size, 0o444, 0, "")


def _pushed(hot: _Hot) -> PushedBlocks:
    core = SimpleNamespace(
        block_size=BLOCK,
        view=SimpleNamespace(shard_ids={SHARD: 0}),
        hints=SimpleNamespace(watched=bytearray(16)),
    )
    return PushedBlocks(core, hot)  # type: ignore[arg-type]


def _early(pushed: PushedBlocks, index: int, edges: list[Node]) -> None:
    files = FileTable.of([(1 + index, 0, 10)])  # a file wholly inside each block
    assert pushed.publish_early(SHARD, index * BLOCK, b"x" * BLOCK, files, edges) is not None


def test_a_file_across_two_blocks_is_published_when_the_second_of_them_is() -> None:
    hot = _Hot([(0, 1), (1, 1), (2, 1)])
    pushed = _pushed(hot)
    across = _node(9, 90, 30)  # bytes 90-119: the last 10 of block 0, the first 20 of block 1
    long = _node(10, 195, 110)  # blocks 1, 2 and 3: left to Python
    _early(pushed, 0, [across])
    assert hot.edges == []  # block 1 is not published yet
    _early(pushed, 1, [across, long])
    assert hot.edges == [(9, 30, Placed(0, 1), 90, 10, Placed(1, 1))]
    _early(pushed, 2, [long])
    assert len(hot.edges) == 1


def test_a_placement_taken_over_meanwhile_is_not_linked() -> None:
    """Block 0's placement is recorded late, after block 5 took the same slot: block 5
    stays where C holds it, and block 0's edges are never linked to a slot not theirs."""
    hot = _Hot([(0, 2), (0, 1), (1, 1), (7, 1)])
    pushed = _pushed(hot)
    across_5 = _node(11, 590, 20)  # blocks 5 and 6
    _early(pushed, 5, [across_5])  # slot 0, generation 2
    _early(pushed, 0, [_node(9, 90, 30)])  # slot 0, generation 1: already gone
    _early(pushed, 1, [_node(9, 90, 30)])
    assert hot.edges == []  # block 0 is not held anywhere
    _early(pushed, 6, [across_5])
    assert hot.edges == [(11, 20, Placed(0, 2), 90, 10, Placed(7, 1))]


def test_a_block_of_edges_alone_is_published_for_the_files_across_them() -> None:
    """Files of most of a block's size leave some blocks with no file wholly inside: such a
    block is published all the same, so that the files across its ends are."""
    hot = _Hot([(0, 1), (1, 1), (2, 1)])
    pushed = _pushed(hot)
    first = _node(9, 50, 80)  # blocks 0 and 1
    second = _node(10, 130, 90)  # blocks 1 and 2
    _early(pushed, 0, [first])
    early = pushed.publish_early(SHARD, BLOCK, b"x" * BLOCK, FileTable.of([]), [first, second])
    assert early is not None
    _early(pushed, 2, [second])
    assert hot.edges == [
        (9, 80, Placed(0, 1), 50, 50, Placed(1, 1)),
        (10, 90, Placed(1, 1), 30, 70, Placed(2, 1)),
    ]

"""Elastic resume (issue 23) at the plan level: a world stops mid-epoch, and another world,
of more or fewer nodes and ranks, deals the rest of the same epoch order."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest
from test_sampler import uneven_table

from shardfs.sampling.plan import Segment, deal, draw_epoch, legacy_node_order, run_order
from shardfs.torch import World, per_rank_length, plan_node, plan_rank

# (nodes, ranks per node) before and after: world sizes 4->2, 4->8, 2->6, 8->3, and more.
CHANGES = [
    ((2, 2), (1, 2)),
    ((2, 2), (2, 1)),
    ((4, 1), (4, 2)),
    ((2, 2), (4, 2)),
    ((2, 1), (3, 2)),
    ((1, 2), (6, 1)),
    ((4, 2), (3, 1)),
    ((2, 4), (1, 3)),
]
SHARD_OF = uneven_table(7, 60, largest=40)


def ranks_of(
    nodes: int, local: int, done: tuple[Segment, ...] = (), **kwargs: object
) -> list[list[int]]:
    """Every rank's indices for the rest of the epoch, rank by rank."""
    out = []
    for node in range(nodes):
        plan = plan_node(
            SHARD_OF, num_samples=len(SHARD_OF), world=World(nodes, node, local, 0), done=done,
            seed=5, epoch=2, **kwargs,  # type: ignore[arg-type]
        )  # fmt: skip
        out += [plan_rank(plan, World(nodes, node, local, j)).tolist() for j in range(local)]
    return out


@pytest.mark.parametrize("mode", ["shard", "uniform"])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize(("before", "after"), CHANGES)
@pytest.mark.parametrize("stop", [0.0, 0.37, 1.0])
def test_the_rest_of_the_epoch_is_dealt_to_the_new_world(
    mode: str, drop_last: bool, before: tuple[int, int], after: tuple[int, int], stop: float
) -> None:
    n = len(SHARD_OF)
    old = ranks_of(*before, mode=mode, drop_last=drop_last)
    yielded = int(len(old[0]) * stop)
    seen = [i for r in old for i in r[:yielded]]
    done = ((*before, yielded),)
    new = ranks_of(*after, done, mode=mode, drop_last=drop_last)
    assert new == ranks_of(*after, done, mode=mode, drop_last=drop_last)  # resumed twice
    left = n - len(set(seen))
    size = after[0] * after[1]
    assert [len(r) for r in new] == [per_rank_length(left, size, drop_last)] * size
    counts = Counter(seen + [i for r in new for i in r])
    old_padding = len(seen) - len(set(seen))
    if drop_last:
        assert max(counts.values()) == 1, "a sample was repeated"
        assert n - len(counts) <= size - 1  # only the new deal drops
    else:
        assert set(counts) == set(range(n)), "a sample was never seen"
        assert old_padding <= before[0] * before[1] - 1
        assert sum(counts.values()) - n <= old_padding + size - 1


def test_chained_resumes_cover_the_epoch_once() -> None:
    n = len(SHARD_OF)
    first = ranks_of(2, 2)
    seen = [i for r in first for i in r[:40]]
    second = ranks_of(1, 2, ((2, 2, 40),))
    seen += [i for r in second for i in r[:55]]
    third = ranks_of(3, 2, ((2, 2, 40), (1, 2, 55)))
    seen += [i for r in third for i in r]
    counts = Counter(seen)
    assert set(counts) == set(range(n)) and sum(counts.values()) - n <= 5


def test_what_an_epoch_draws_does_not_depend_on_the_world() -> None:
    """One node reads the epoch order; the nodes of any world read their shares in the same
    shard order (a window too small to mix shards keeps each shard's run whole)."""
    n = len(SHARD_OF)
    drawn = draw_epoch(SHARD_OF, num_samples=n, seed=5, epoch=2)
    assert ranks_of(1, 1) == [deal(drawn, None, nodes=1, local=1, drop_last=False)[0][0].tolist()]
    alone = plan_node(SHARD_OF, num_samples=n, seed=5, epoch=2, window=0.01).order
    first_seen = list(dict.fromkeys(SHARD_OF[alone].tolist()))
    for nodes in (2, 3, 5):
        for node in range(nodes):
            world = World(nodes, node, 1, 0)
            plan = plan_node(SHARD_OF, num_samples=n, world=world, seed=5, epoch=2, window=0.01)
            runs = [int(s) for s, _ in itertools.groupby(SHARD_OF[plan.order].tolist())]
            mine = [s for s in first_seen if s in set(runs)]
            assert runs[: len(mine)] == mine, (nodes, node)  # then padding, from its head
    assert ranks_of(1, 1) != [plan_node(SHARD_OF, num_samples=n, seed=5, epoch=3).order.tolist()]


def shards(indices: list[int]) -> set[int]:
    return {int(SHARD_OF[i]) for i in indices}


@pytest.mark.parametrize(("before", "after"), CHANGES)
def test_after_a_world_change_nodes_fetch_only_their_new_share(
    before: tuple[int, int], after: tuple[int, int]
) -> None:
    """Each new node reads a contiguous share of what is left in the run order: its shards
    are that share's (at most one more), nodes share only boundary shards, and a node that
    keeps its number keeps its shards (at most one new) when the node count stays."""
    old = ranks_of(*before)
    yielded = len(old[0]) // 3
    done = ((*before, yielded),)
    new = ranks_of(*after, done)
    seen = {i for r in old for i in r[:yielded]}
    held = [shards([i for r in old[k * before[1] : (k + 1) * before[1]] for i in r])
            for k in range(before[0])]  # fmt: skip
    base = run_order(SHARD_OF, None, seed=5, shuffle=True)
    rest = [int(i) for i in base if int(i) not in seen]
    length = len(new[0]) * after[1]
    total = 0
    for k in range(after[0]):
        reads = shards([i for r in new[k * after[1] : (k + 1) * after[1]] for i in r])
        last = k == after[0] - 1
        share = shards(rest[k * length : None if last else (k + 1) * length])
        assert len(reads - share) <= 1, (k, reads - share)
        before_k = held[k] if k < before[0] else set()
        assert len(reads - before_k) <= len(share - before_k) + 1  # fetched: new share + 1
        if before[0] == after[0]:
            assert len(reads - before_k) <= 1, (k, reads - before_k)
        total += len(reads)
    assert total <= len(shards(rest)) + after[0] - 1


def test_the_legacy_order_is_the_one_old_states_were_saved_in() -> None:
    """Shard mode's node order before canonical parts, as shardfs planned it when a state
    held only (epoch, yielded, seed, length): pinned from that release's plan_node."""
    table = uneven_table(1, 10, largest=9)
    base = run_order(table, None, seed=3, shuffle=True)
    expected = [
        [5, 29, 9, 25, 0, 1, 21, 7, 24, 14, 4, 15, 43, 28, 17, 19, 42, 16, 51, 12, 20, 30, 45,
         50, 46, 27, 10, 33],
        [2, 40, 18, 3, 39, 23, 52, 38, 41, 6, 47, 48, 11, 36, 44, 26, 31, 37, 49, 13, 35, 22, 34,
         8, 53, 32, 2, 40],
    ]  # fmt: skip
    for node in (0, 1):
        order = legacy_node_order(
            base, table, seed=3, epoch=2, window=8, world=World(2, node, 2, 0), drop_last=False
        )
        assert order.tolist() == expected[node]


def classes_per_batch(order: list[int], labels: np.ndarray, batch: int = 256) -> float:
    full = len(order) // batch * batch
    return float(np.mean([len(set(b)) for b in labels[order[:full]].reshape(-1, batch).tolist()]))


def test_a_shuffled_pack_mixes_like_random_sampler_on_any_world_and_after_a_resume() -> None:
    """Classes per batch of 256 on each rank, within 2 % of a uniform shuffle (issue 23:
    shuffle quality unchanged), on 1 node, on 4 nodes x 2 ranks, and after 4 x 2 -> 3 x 1."""
    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(200), 160)  # ImageFolder order: by class
    n = len(labels)
    shard_of = (rng.permutation(n) // 100).astype(np.int64)  # a shuffled pack, 320 shards
    uniform = np.mean([classes_per_batch(rng.permutation(n).tolist(), labels) for _ in range(4)])

    def ranks(nodes: int, local: int, done: tuple[Segment, ...] = ()) -> list[list[int]]:
        out = []
        for node in range(nodes):
            plan = plan_node(
                shard_of, num_samples=n, world=World(nodes, node, local, 0), epoch=1, done=done
            )
            out += [plan_rank(plan, World(nodes, node, local, j)).tolist() for j in range(local)]
        return out

    for name, orders in (
        ("1 node", ranks(1, 1)),
        ("4 x 2", ranks(4, 2)),
        ("3 x 1 after 4 x 2", ranks(3, 1, ((4, 2, 1000),))),
    ):
        quality = np.mean([classes_per_batch(order, labels) for order in orders])
        assert quality >= 0.98 * uniform, (name, quality, uniform)

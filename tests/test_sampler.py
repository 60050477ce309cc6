"""The sampler's exactness rules (issue 11 item 3) on synthetic tables, and ShardSampler off a
mount. Each test plans every rank of a simulated world and checks what the ranks receive."""

from __future__ import annotations

import random
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from shardfs.torch import (
    DEFAULT_WINDOW,
    NodePlan,
    ShardSampler,
    World,
    _rows_by_hash,
    per_rank_length,
    plan_node,
    plan_rank,
)

# (num_nodes, ranks per node): world sizes 1, 2, 3, 4, 8 on 1, 2 and 4 nodes.
WORLDS = [(1, 1), (1, 2), (1, 3), (1, 4), (1, 8), (2, 1), (2, 2), (2, 4), (4, 1), (4, 2)]


def uneven_table(seed: int, num_shards: int, largest: int = 1000) -> np.ndarray:
    """Shard id per dataset index: shards of 1..largest samples, shuffled into index order."""
    rng = random.Random(seed)
    sizes = [rng.randint(1, largest) for _ in range(num_shards)]
    sizes[0], sizes[-1] = 1, largest  # always both extremes
    shard_of = np.repeat(np.arange(num_shards), sizes)
    return shard_of[np.random.default_rng(seed).permutation(len(shard_of))].astype(np.int64)


def plan_world(
    shard_of: np.ndarray | None, num_samples: int, nodes: int, local: int, **kwargs: object
) -> tuple[list[NodePlan], list[list[int]]]:
    """Each node's plan and each rank's indices, for the whole world."""
    plans, ranks = [], []
    for node in range(nodes):
        plan = plan_node(
            shard_of, num_samples=num_samples, world=World(nodes, node, local, 0), **kwargs
        )
        plans.append(plan)
        for local_rank in range(local):
            ranks.append(plan_rank(plan, World(nodes, node, local, local_rank)).tolist())
    return plans, ranks


TABLES = {
    "uneven": lambda: uneven_table(1, 40),
    "one-shard": lambda: np.zeros(5, dtype=np.int64),
    "fewer-shards-than-ranks": lambda: uneven_table(2, 3, largest=7),
    "single-sample": lambda: np.zeros(1, dtype=np.int64),
    "many-tiny": lambda: uneven_table(3, 300, largest=3),
}


@pytest.mark.parametrize("mode", ["shard", "uniform"])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("table", sorted(TABLES))
@pytest.mark.parametrize(("nodes", "local"), WORLDS)
def test_padding_covers_every_sample_with_equal_lengths(
    mode: str, shuffle: bool, table: str, nodes: int, local: int
) -> None:
    shard_of = TABLES[table]()
    n, size = len(shard_of), nodes * local
    plans, ranks = plan_world(shard_of, n, nodes, local, mode=mode, shuffle=shuffle, epoch=3)
    length = per_rank_length(n, size, drop_last=False)
    assert [len(r) for r in ranks] == [length] * size
    counts = Counter(i for r in ranks for i in r)
    assert set(counts) == set(range(n))
    repeats = sum(counts.values()) - n
    assert repeats == plans[0].num_padded <= size - 1
    assert all(p.num_padded == repeats and p.num_dropped == 0 for p in plans)
    if mode == "shard":
        # Padding repeats samples the node already reads, unless it has none of its own.
        for plan in plans:
            own = Counter(plan.order.tolist())
            if len(own) < len(plan.order):
                assert set(own) <= set(plan.order.tolist())
                distinct_first = list(dict.fromkeys(plan.order.tolist()))
                assert set(plan.order.tolist()) == set(distinct_first)


@pytest.mark.parametrize("mode", ["shard", "uniform"])
@pytest.mark.parametrize("table", sorted(TABLES))
@pytest.mark.parametrize(("nodes", "local"), WORLDS)
def test_drop_last_drops_fewer_than_world_size_and_repeats_none(
    mode: str, table: str, nodes: int, local: int
) -> None:
    shard_of = TABLES[table]()
    n, size = len(shard_of), nodes * local
    plans, ranks = plan_world(shard_of, n, nodes, local, mode=mode, epoch=1, drop_last=True)
    assert [len(r) for r in ranks] == [n // size] * size
    seen = [i for r in ranks for i in r]
    assert len(seen) == len(set(seen)), "a sample was repeated"
    dropped = n - len(seen)
    assert dropped == plans[0].num_dropped <= size - 1
    assert plans[0].num_padded == 0


def test_padding_prefers_the_nodes_own_samples() -> None:
    # 2 nodes x 4 ranks, 13 samples: the last node is short and pads from its own shards.
    shard_of = np.array([0] * 6 + [1] * 4 + [2] * 3, dtype=np.int64)
    plans, _ = plan_world(shard_of, 13, 2, 4, epoch=0)
    assert plans[1].num_padded == 3
    own = set(plans[1].order.tolist())
    assert not own & set(plans[0].order.tolist()), "the nodes share a sample"
    assert len(plans[1].order) == 8 and len(own) == 5


@pytest.mark.parametrize(("nodes", "local"), [(2, 2), (4, 1), (4, 2)])
def test_shards_stay_on_their_node_across_epochs(nodes: int, local: int) -> None:
    shard_of = uneven_table(4, 60)
    n = len(shard_of)
    homes = []
    for epoch in range(3):
        plans, _ = plan_world(shard_of, n, nodes, local, epoch=epoch, seed=9)
        homes.append([set(shard_of[p.order].tolist()) for p in plans])
        # Shards are split between nodes, only the boundary shards are shared.
        pairs = sum(len(h) for h in homes[-1])
        assert pairs <= len(set(shard_of.tolist())) + nodes - 1
    assert homes[0] == homes[1] == homes[2]


def test_order_is_a_pure_function_of_seed_epoch_table_and_world() -> None:
    shard_of = uneven_table(5, 30)
    n = len(shard_of)
    world = World(2, 1, 2, 1)

    def order(**kwargs: object) -> list[int]:
        return plan_rank(plan_node(shard_of, num_samples=n, world=world, **kwargs), world).tolist()  # type: ignore[arg-type]

    assert order(seed=3, epoch=2) == order(seed=3, epoch=2)
    assert order(seed=3, epoch=2) != order(seed=3, epoch=3)
    assert order(seed=3, epoch=2) != order(seed=4, epoch=2)
    assert order(seed=3, epoch=2, mode="uniform") == order(seed=3, epoch=2, mode="uniform")
    assert order(seed=3, epoch=2, mode="uniform") != order(seed=3, epoch=3, mode="uniform")
    # shuffle=False: the same order every epoch and for every seed, shard by shard.
    fixed = order(shuffle=False, epoch=0, seed=0)
    assert fixed == order(shuffle=False, epoch=5, seed=8)


def test_unshuffled_shard_mode_reads_shard_by_shard_in_table_order() -> None:
    shard_of = uneven_table(6, 12)
    n = len(shard_of)
    rows = np.argsort(np.argsort(shard_of, kind="stable"), kind="stable")  # table row per index
    plan = plan_node(shard_of, num_samples=n, shuffle=False, within=rows)
    assert rows[plan.order].tolist() == list(range(n))


def test_window_bounds_the_live_shards() -> None:
    shard_of = np.repeat(np.arange(200), 100).astype(np.int64)
    for window in (1, 4, DEFAULT_WINDOW):
        order = plan_node(shard_of, num_samples=len(shard_of), window=window, epoch=1).order
        live = [len(set(shard_of[order[i : i + 256]].tolist())) for i in range(0, 19_968, 256)]
        assert max(live) <= window + 4, (window, max(live))
        assert np.mean(live) >= window  # and it does mix that many


def test_a_window_under_one_shard_keeps_each_shard_read_within_a_short_span() -> None:
    """A fraction of a shard (for a cache that holds little more than one): every shard's
    samples are read within about (1 + window) shards' worth of positions, all of them."""
    shard_of = np.repeat(np.arange(50), 100).astype(np.int64)
    for window, span in ((0.25, 135), (0.5, 165), (1, 225)):
        order = plan_node(shard_of, num_samples=len(shard_of), window=window, epoch=1).order
        assert sorted(order.tolist()) == list(range(len(shard_of)))
        positions: dict[int, list[int]] = {}
        for position, index in enumerate(order.tolist()):
            positions.setdefault(int(shard_of[index]), []).append(position)
        widest = max(max(p) - min(p) + 1 for p in positions.values())
        assert 100 <= widest <= span, (window, widest)


def test_uniform_mode_mixes_every_shard() -> None:
    shard_of = np.repeat(np.arange(200), 100).astype(np.int64)
    order = plan_node(shard_of, num_samples=len(shard_of), mode="uniform", epoch=1).order
    assert len(set(shard_of[order[:256]].tolist())) > 100


def test_an_imagenet_sized_epoch_is_planned_whole() -> None:
    """Every one of 1.28M samples in the plan once (its time is measured by
    ``make bench-scale``, not here)."""
    n = 1_281_167
    shard_of = (np.random.default_rng(0).permutation(n) // 1251).astype(np.int64)
    orders = []
    for node in (0, 1):
        world = World(2, node, 4, 0)
        plan = plan_node(shard_of, num_samples=n, world=world, within=np.arange(n), epoch=1)
        assert len(plan_rank(plan, world)) == per_rank_length(n, 8, drop_last=False)
        orders.append(plan.order)
    assert np.array_equal(np.unique(np.concatenate(orders)), np.arange(n))


# ShardSampler itself, on a dataset that is not on a shardfs mount.


class Folder:
    """What ShardSampler reads from a torchvision folder dataset."""

    def __init__(self, root: Path, count: int, attribute: str = "samples") -> None:
        setattr(
            self, attribute, [(str(root / f"c{i % 3}" / f"{i}.jpg"), i % 3) for i in range(count)]
        )

    def __len__(self) -> int:
        return len(getattr(self, "samples", getattr(self, "imgs", [])))


def quiet_sampler(dataset: object, **kwargs: object) -> ShardSampler:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ShardSampler(dataset, **kwargs)  # type: ignore[arg-type]


def test_datasets_without_samples_get_one_type_error() -> None:
    with pytest.raises(TypeError, match=r"\.samples \(or \.imgs\)"):
        ShardSampler(list(range(10)))


def test_off_a_mount_it_warns_once_and_samples_like_distributed_sampler(tmp_path: Path) -> None:
    dataset = Folder(tmp_path, 23, attribute="imgs")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        samplers = [ShardSampler(dataset, num_replicas=4, rank=r, seed=1) for r in range(4)]
        for sampler in samplers:
            sampler.set_epoch(2)
        ranks = [list(sampler) for sampler in samplers]
    per_sampler = [w for w in caught if "not on a shardfs mount" in str(w.message)]
    assert len(per_sampler) == 4 and len(caught) == 4  # one each, and no hint warnings
    assert not samplers[0].on_mount
    assert [len(r) for r in ranks] == [6] * 4 == [len(s) for s in samplers]
    assert set().union(*map(set, ranks)) == set(range(23))
    assert samplers[0].num_padded == 1


def test_world_comes_from_local_world_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    sampler = quiet_sampler(Folder(tmp_path, 10), num_replicas=4, rank=3)
    assert sampler.world == World(num_nodes=2, node_rank=1, local_size=2, local_rank=1)
    override = quiet_sampler(Folder(tmp_path, 10), num_replicas=4, rank=3, num_nodes=4)
    assert override.world == World(num_nodes=4, node_rank=3, local_size=1, local_rank=0)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    alone = quiet_sampler(Folder(tmp_path, 10))
    assert alone.world == World() and len(alone) == 10


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_replicas": 4, "rank": 4}, "rank 4 is outside"),
        ({"num_replicas": 4, "rank": 0, "num_nodes": 3}, "do not split evenly"),
        ({"num_replicas": 4, "rank": 0, "node_rank": 1}, "node_rank needs num_nodes"),
        ({"mode": "random"}, "mode must be"),
        ({"window": 0}, "window must be"),
    ],
)
def test_bad_arguments_say_what_is_wrong(
    tmp_path: Path, kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        quiet_sampler(Folder(tmp_path, 10), **kwargs)


def test_state_from_another_run_is_refused(tmp_path: Path) -> None:
    sampler = quiet_sampler(Folder(tmp_path, 10), seed=1)
    state = quiet_sampler(Folder(tmp_path, 10), seed=2).state_dict()
    with pytest.raises(ValueError, match="another run"):
        sampler.load_state_dict(state)
    with pytest.raises(ValueError, match="not a ShardSampler state"):
        sampler.load_state_dict({"yielded": 3})


def test_rows_are_matched_by_hash_like_a_dict_of_the_table() -> None:
    rng = random.Random(3)
    table = [f"c{rng.randrange(50)}/f{n}.jpg" for n in range(5000)]
    wanted = rng.sample(table, 3000)  # a subset (train/ of a mount that also holds val/)
    rows = _rows_by_hash(table, wanted)
    assert rows is not None
    assert [table[row] for row in rows.tolist()] == wanted
    with pytest.raises(KeyError, match=r"c1/absent\.jpg"):
        _rows_by_hash(table, [*wanted[:10], "c1/absent.jpg"])
    with pytest.raises(KeyError):
        _rows_by_hash([], ["a.jpg"])
    assert _rows_by_hash([*table, table[7]], wanted) is None  # shared hash: the dict decides

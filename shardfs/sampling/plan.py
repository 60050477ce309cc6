"""An epoch's order, and how a world of nodes and ranks deals it.

The order of an epoch does not depend on the world. ``epoch_order`` is a pure numpy
function of (seed, epoch, table, ``canonical``): the run order (``run_order``, every
shard's samples together, shards in a per-run order) is cut into ``canonical`` parts of
whole shards, contiguous in the run order; each epoch the parts come in a fresh order, the
shards of a part in a fresh order, and every sample drifts forward over a window of
``window`` shards. A world then splits the run order between its nodes by sample count (a
node's share is a contiguous range of whole shards, only boundary shards shared), each node
reads the epoch order restricted to its share, and deals it to its ranks in turn.

A resume point is a list of segments ``(nodes, ranks per node, indices yielded per rank)``:
each segment dealt what the ones before left (``consumed``), so a state saved under one
world resumes under any other by dealing the rest of the same epoch order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

Mode = Literal["shard", "uniform"]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

DEFAULT_WINDOW = 8
"""Shards mixed at a time in shard mode (bench/shuffle_quality.py, 1,000 classes x 128 in
shards of 1,000). On a shuffled pack every window from 1 up matches RandomSampler (226
classes per batch of 256, lag-1 0.001, KS 0.075). On a class-sorted pack quality grows with
the window (classes per batch 36 at 4, 66 at 8, 110 at 16) while the live set of shards the
cache must hold grows with it (5, 9, 16 per batch); 8 is the middle: twice the mixing of 4
for a live set that stays under ten shards."""

DEFAULT_CANONICAL = 64
"""Canonical parts of an epoch (bench/shuffle_quality.py --canonical, docs/training.md).
Parts straddled by a node boundary mix fewer of a node's shards, so parts should be many
per node; every part boundary a node crosses starts its window afresh, so parts should hold
many windows. 64 keeps class-sorted mixing within a few percent of one part per node up to
16 nodes on 128 shards and more; on shuffled packs every choice matches RandomSampler."""

Segment = tuple[int, int, int]  # (nodes, ranks per node, indices yielded per rank)


@dataclass(frozen=True)
class World:
    """Who reads: ``num_nodes`` nodes of ``local_size`` ranks each; ranks on one node share
    one mount (and its cache). Global rank is ``node_rank * local_size + local_rank``, as
    torchrun numbers them."""

    num_nodes: int = 1
    node_rank: int = 0
    local_size: int = 1
    local_rank: int = 0

    def __post_init__(self) -> None:
        if self.num_nodes < 1 or self.local_size < 1:
            raise ValueError(f"a world needs at least one node and one rank per node: {self}")
        if not 0 <= self.node_rank < self.num_nodes:
            raise ValueError(f"node_rank {self.node_rank} is outside 0..{self.num_nodes - 1}")
        if not 0 <= self.local_rank < self.local_size:
            raise ValueError(f"local rank {self.local_rank} is outside 0..{self.local_size - 1}")

    @property
    def size(self) -> int:
        return self.num_nodes * self.local_size

    @property
    def rank(self) -> int:
        return self.node_rank * self.local_size + self.local_rank


@dataclass(frozen=True)
class NodePlan:
    """One node's epoch: ``order`` is what its ranks read, interleaved (rank ``j`` takes
    ``order[j::local_size]``); the counts are for the whole world."""

    order: IntArray
    per_rank: int
    num_padded: int
    num_dropped: int


def per_rank_length(num_samples: int, world_size: int, drop_last: bool) -> int:
    """Indices each rank yields: every rank the same, so DDP never waits on a short rank."""
    if drop_last:
        return num_samples // world_size
    return -(-num_samples // world_size)


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng([k & 0xFFFFFFFF for k in key])


def run_order(shard_of: IntArray, within: IntArray | None, *, seed: int, shuffle: bool) -> IntArray:
    """Every sample, grouped by shard: the shards in a per-run order (fixed across epochs, so
    the split between nodes and their caches stay valid), samples of a shard in ``within``
    order (table row, i.e. offset in the shard) or index order."""
    num_shards = int(shard_of.max()) + 1 if len(shard_of) else 0
    shard_rank = np.arange(num_shards, dtype=np.int64)
    if shuffle:
        shard_rank[_rng(seed, 0x5A4D).permutation(num_shards)] = np.arange(num_shards)
    secondary = within if within is not None else np.arange(len(shard_of), dtype=np.int64)
    return np.lexsort((secondary, shard_rank[shard_of])).astype(np.int64)


def _ranks_of(rng: np.random.Generator, count: int) -> IntArray:
    ranks = np.empty(count, dtype=np.int64)
    ranks[rng.permutation(count)] = np.arange(count)
    return ranks


def _spread(shard_of: IntArray, window: float) -> float:
    """The drift, in samples, that mixes about ``window`` shards."""
    num_shards = int(shard_of.max()) + 1 if len(shard_of) else 1
    return max(1.0, window * len(shard_of) / num_shards)


def epoch_order(
    shard_of: IntArray | None,
    *,
    num_samples: int,
    mode: Mode = "shard",
    shuffle: bool = True,
    seed: int = 0,
    epoch: int = 0,
    window: float = DEFAULT_WINDOW,
    canonical: int = DEFAULT_CANONICAL,
    base: IntArray | None = None,
    within: IntArray | None = None,
) -> IntArray:
    """Every sample once, in the epoch's order, whatever the world (see the module doc)."""
    if shard_of is None or mode == "uniform":
        if shuffle:
            return _rng(seed, epoch).permutation(num_samples).astype(np.int64)
        return np.arange(num_samples, dtype=np.int64)
    if len(shard_of) != num_samples:
        raise ValueError(f"{len(shard_of)} shard ids for {num_samples} samples")
    if base is None:
        base = run_order(shard_of, within, seed=seed, shuffle=shuffle)
    if not shuffle or num_samples == 0:
        return base
    shards = shard_of[base]
    starts = np.flatnonzero(np.r_[True, shards[1:] != shards[:-1]])
    lengths = np.diff(np.r_[starts, num_samples])
    part = starts * canonical // num_samples  # whole shards per part, contiguous in the run
    rng = _rng(seed, epoch, 0x43414E)
    order = np.lexsort((rng.random(len(starts)), _ranks_of(rng, canonical)[part]))
    # Shard runs of base, moved as blocks into their new order.
    shift = np.repeat(starts[order] - (np.cumsum(lengths[order]) - lengths[order]), lengths[order])
    regrouped = base[np.arange(num_samples) + shift]
    keys = np.arange(num_samples) + rng.random(num_samples) * _spread(shard_of, window)
    mixed: IntArray = regrouped[np.argsort(keys, kind="stable")]
    return mixed


def _fit(order: IntArray, length: int, fill: IntArray) -> IntArray:
    """``order`` cut or padded to ``length``; padding repeats the node's own samples from the
    head of its order (already cached locally), or ``fill`` when the node has none."""
    if len(order) >= length:
        return order[:length]
    source = order if len(order) else fill
    return np.concatenate([order, np.resize(source, length - len(order))])


def deal(
    order: IntArray, base: IntArray | None, *, nodes: int, local: int, drop_last: bool
) -> tuple[list[IntArray], int, int, int]:
    """Each node's share of ``order`` (the samples left, in epoch order), its per-rank length
    and the world's padding and drops. ``base``: the same samples in run order, split between
    the nodes by count; None deals ``order`` round robin over every rank, as
    DistributedSampler does."""
    size, count = nodes * local, len(order)
    per_rank = per_rank_length(count, size, drop_last)
    total = per_rank * size
    padded, dropped = max(total - count, 0), max(count - total, 0)
    length = per_rank * local
    if total == 0:
        return [order[:0]] * nodes, per_rank, padded, dropped
    if base is None:
        grid = np.resize(order, total).reshape(per_rank, size)
        return (
            [np.ascontiguousarray(grid[:, k * local : (k + 1) * local]).reshape(-1)
             for k in range(nodes)],
            per_rank, padded, dropped,
        )  # fmt: skip
    node_of = np.empty(int(order.max()) + 1, dtype=np.int64)
    node_of[base] = np.minimum(np.arange(count) // length, nodes - 1)
    by_node = order[np.argsort(node_of[order], kind="stable")]
    bounds = np.searchsorted(node_of[by_node], np.arange(nodes + 1))
    shares = [_fit(by_node[bounds[k] : bounds[k + 1]], length, order) for k in range(nodes)]
    return shares, per_rank, padded, dropped


def consumed(
    order: IntArray,
    base: IntArray | None,
    segments: Sequence[Segment],
    *,
    num_samples: int,
    drop_last: bool,
) -> BoolArray:
    """Which samples the ``segments`` yielded, each segment dealing what the ones before
    left: every rank of a segment yielded the same count, so each node read the head of
    its share."""
    done = np.zeros(num_samples, dtype=np.bool_)
    for nodes, local, yielded in segments:
        shares, per_rank, _, _ = deal(
            order[~done[order]],
            None if base is None else base[~done[base]],
            nodes=nodes,
            local=local,
            drop_last=drop_last,
        )
        if not 0 <= yielded <= per_rank:
            raise ValueError(
                f"a segment of {nodes} x {local} ranks yielded {yielded}, outside 0..{per_rank}"
            )
        for share in shares:
            done[share[: yielded * local]] = True
    return done


def plan_node(
    shard_of: IntArray | None,
    *,
    num_samples: int,
    mode: Mode = "shard",
    shuffle: bool = True,
    seed: int = 0,
    epoch: int = 0,
    window: float = DEFAULT_WINDOW,
    world: World = World(),
    drop_last: bool = False,
    within: IntArray | None = None,
    base: IntArray | None = None,
    canonical: int = DEFAULT_CANONICAL,
    done: Sequence[Segment] = (),
) -> NodePlan:
    """The order ``world``'s node reads this epoch, as dataset indices, after the
    segments ``done`` (a resume).

    ``shard_of[i]`` is the shard of sample ``i`` (None: no table, which plans like
    ``DistributedSampler``). ``base`` is ``run_order(...)``, passed in to reuse it across
    epochs; it is derived from the other arguments when absent.
    """
    by_shard = shard_of is not None and mode == "shard"
    if by_shard and base is None:
        assert shard_of is not None
        base = run_order(shard_of, within, seed=seed, shuffle=shuffle)
    order = epoch_order(
        shard_of, num_samples=num_samples, mode=mode, shuffle=shuffle, seed=seed,
        epoch=epoch, window=window, canonical=canonical, base=base,
    )  # fmt: skip
    split = base if by_shard else None
    if done:
        left = ~consumed(order, split, done, num_samples=num_samples, drop_last=drop_last)
        order = order[left[order]]
        split = None if split is None else split[left[split]]
    shares, per_rank, padded, dropped = deal(
        order, split, nodes=world.num_nodes, local=world.local_size, drop_last=drop_last
    )
    return NodePlan(shares[world.node_rank], per_rank, padded, dropped)


def plan_rank(plan: NodePlan, world: World) -> IntArray:
    """This rank's share of its node's order: dealt in turn, so a node's ranks read the same
    few shards at the same time and share the node's cache."""
    return plan.order[world.local_rank :: world.local_size]


def legacy_node_order(
    base: IntArray, shard_of: IntArray, *, seed: int, epoch: int, window: float, world: World,
    drop_last: bool,
) -> IntArray:  # fmt: skip
    """Shard mode's node order before the canonical parts (shardfs <= 0.x states): each node
    mixed its own share. Kept so an old state resumes the epoch it was saved in exactly."""
    num_samples = len(base)
    length = per_rank_length(num_samples, world.size, drop_last) * world.local_size
    start = min(world.node_rank * length, num_samples)
    last = world.node_rank == world.num_nodes - 1
    mine = base[start : num_samples if last else min(start + length, num_samples)]
    if len(mine):
        rng = _rng(seed, epoch, world.node_rank, 0x4E4F)
        shards = shard_of[mine]
        piece = np.cumsum(np.r_[True, shards[1:] != shards[:-1]]) - 1
        regrouped = mine[np.argsort(_ranks_of(rng, int(piece[-1]) + 1)[piece], kind="stable")]
        keys = np.arange(len(mine)) + rng.random(len(mine)) * _spread(shard_of, window)
        mine = regrouped[np.argsort(keys, kind="stable")]
    return _fit(mine, length, base)

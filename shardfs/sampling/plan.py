"""An epoch's order, and how a world of nodes and ranks deals it.

What an epoch draws does not depend on the world (``draw_epoch``, a pure numpy function of
seed, epoch and table): the order of the shards and each sample's drift. Shards keep a
per-run order (``run_order``) that a world splits between its nodes by sample count, so a
node's share is a contiguous range of whole shards (only boundary shards shared) and stays
the same every epoch. Each node reads its share in the epoch's shard order, each sample
moved forward by its own drift, so the node mixes about ``window`` of its shards at a time;
its ranks take that sequence in turn. One node reads the epoch order itself.

A resume point is a list of segments ``(nodes, ranks per node, indices yielded per rank)``:
each segment dealt what the ones before left (``consumed``), so a state saved under one
world resumes under any other by dealing the rest of the same epoch.
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
FloatArray = npt.NDArray[np.float64]

DEFAULT_WINDOW = 8
"""Shards mixed at a time in shard mode (bench/shuffle_quality.py, 1,000 classes x 128 in
shards of 1,000). On a shuffled pack every window from 1 up matches RandomSampler (226
classes per batch of 256, lag-1 0.001, KS 0.075). On a class-sorted pack quality grows with
the window (classes per batch 36 at 4, 66 at 8, 110 at 16) while the live set of shards the
cache must hold grows with it (5, 9, 16 per batch); 8 is the middle: twice the mixing of 4
for a live set that stays under ten shards."""

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


@dataclass(frozen=True)
class Epoch:
    """One epoch's draws for the whole dataset, whatever the world. Uniform mode: ``order``
    is the epoch's permutation, dealt round robin. Shard mode (``shard_of`` set): ``order``
    is the run order that nodes split; ``shard_rank`` places each shard in the epoch's
    shard order and ``drift`` moves each sample forward by its own draw (None: no mixing)."""

    order: IntArray
    shard_of: IntArray | None = None
    shard_rank: IntArray | None = None
    drift: FloatArray | None = None


def draw_epoch(
    shard_of: IntArray | None,
    *,
    num_samples: int,
    mode: Mode = "shard",
    shuffle: bool = True,
    seed: int = 0,
    epoch: int = 0,
    window: float = DEFAULT_WINDOW,
    base: IntArray | None = None,
    within: IntArray | None = None,
) -> Epoch:
    """What epoch ``epoch`` draws, for every world: see ``Epoch``."""
    if shard_of is None or mode == "uniform":
        if shuffle:
            return Epoch(_rng(seed, epoch).permutation(num_samples).astype(np.int64))
        return Epoch(np.arange(num_samples, dtype=np.int64))
    if len(shard_of) != num_samples:
        raise ValueError(f"{len(shard_of)} shard ids for {num_samples} samples")
    if base is None:
        base = run_order(shard_of, within, seed=seed, shuffle=shuffle)
    if not shuffle or num_samples == 0:
        return Epoch(base, shard_of)
    rng = _rng(seed, epoch, 0x45504F)
    shard_rank = _ranks_of(rng, int(shard_of.max()) + 1)
    drift = rng.random(num_samples) * _spread(shard_of, window)  # by sample, not by position
    return Epoch(base, shard_of, shard_rank, drift)


def _mix(share: IntArray, epoch: Epoch) -> IntArray:
    """A node's share (whole shards of the run order) in the epoch's shard order, each
    sample drifted forward by its own draw: about ``window`` of its shards at a time."""
    if epoch.shard_rank is None or epoch.drift is None or not len(share):
        return share
    assert epoch.shard_of is not None
    shards = epoch.shard_of[share]
    starts = np.flatnonzero(np.r_[True, shards[1:] != shards[:-1]])
    lengths = np.diff(np.r_[starts, len(share)])
    order = np.argsort(epoch.shard_rank[shards[starts]], kind="stable")
    # Each shard's run, moved as a block to its place in the epoch's shard order.
    shift = np.repeat(starts[order] - (np.cumsum(lengths[order]) - lengths[order]), lengths[order])
    regrouped = share[np.arange(len(share)) + shift]
    keys = np.arange(len(share)) + epoch.drift[regrouped]
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
    epoch: Epoch,
    left: BoolArray | None,
    *,
    nodes: int,
    local: int,
    drop_last: bool,
    which: Sequence[int] | None = None,
) -> tuple[dict[int, IntArray], int, int, int]:
    """The shares of the nodes ``which`` (None: all) of the samples ``left`` (None: all),
    each in the order its ranks read it; the per-rank length; the world's padding and
    drops. Shard mode: the nodes split the run order by count and each mixes its own
    share. Uniform mode: the epoch order dealt round robin, as DistributedSampler does."""
    order = epoch.order if left is None else epoch.order[left[epoch.order]]
    size, count = nodes * local, len(order)
    per_rank = per_rank_length(count, size, drop_last)
    total = per_rank * size
    padded, dropped = max(total - count, 0), max(count - total, 0)
    length = per_rank * local
    wanted = range(nodes) if which is None else which
    if total == 0:
        return {k: order[:0] for k in wanted}, per_rank, padded, dropped
    if epoch.shard_of is None:
        grid = np.resize(order, total).reshape(per_rank, size)
        shares = {
            k: np.ascontiguousarray(grid[:, k * local : (k + 1) * local]).reshape(-1)
            for k in wanted
        }
        return shares, per_rank, padded, dropped
    shares = {}
    for k in wanted:
        start = min(k * length, count)
        end = count if k == nodes - 1 else min(start + length, count)
        shares[k] = _fit(_mix(order[start:end], epoch), length, order)
    return shares, per_rank, padded, dropped


def consumed(
    epoch: Epoch, segments: Sequence[Segment], *, num_samples: int, drop_last: bool
) -> BoolArray:
    """Which samples the ``segments`` yielded, each segment dealing what the ones before
    left: every rank of a segment yielded the same count, so each node read the head of
    its share."""
    done = np.zeros(num_samples, dtype=np.bool_)
    for nodes, local, yielded in segments:
        shares, per_rank, _, _ = deal(epoch, ~done, nodes=nodes, local=local, drop_last=drop_last)
        if not 0 <= yielded <= per_rank:
            raise ValueError(
                f"a segment of {nodes} x {local} ranks yielded {yielded}, outside 0..{per_rank}"
            )
        for share in shares.values():
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
    done: Sequence[Segment] = (),
) -> NodePlan:
    """The order ``world``'s node reads this epoch, as dataset indices, after the
    segments ``done`` (a resume).

    ``shard_of[i]`` is the shard of sample ``i`` (None: no table, which plans like
    ``DistributedSampler``). ``base`` is ``run_order(...)``, passed in to reuse it across
    epochs; it is derived from the other arguments when absent.
    """
    drawn = draw_epoch(
        shard_of, num_samples=num_samples, mode=mode, shuffle=shuffle, seed=seed,
        epoch=epoch, window=window, base=base, within=within,
    )  # fmt: skip
    left = ~consumed(drawn, done, num_samples=num_samples, drop_last=drop_last) if done else None
    shares, per_rank, padded, dropped = deal(
        drawn, left, nodes=world.num_nodes, local=world.local_size, drop_last=drop_last,
        which=[world.node_rank],
    )  # fmt: skip
    return NodePlan(shares[world.node_rank], per_rank, padded, dropped)


def plan_rank(plan: NodePlan, world: World) -> IntArray:
    """This rank's share of its node's order: dealt in turn, so a node's ranks read the same
    few shards at the same time and share the node's cache."""
    return plan.order[world.local_rank :: world.local_size]


def legacy_node_order(
    base: IntArray, shard_of: IntArray, *, seed: int, epoch: int, window: float, world: World,
    drop_last: bool,
) -> IntArray:  # fmt: skip
    """Shard mode's node order before elastic resume (states without a version): each node
    drew its own shard order and drifts. Kept so that an old state resumes the epoch it was
    saved in exactly."""
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

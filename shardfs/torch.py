"""``ShardSampler``: the order in which a training loop asks a shardfs mount for samples.

A uniform shuffle makes every reader touch every shard all epoch long and makes every node
download the whole dataset. Here the shards are split between nodes once per run, and each
epoch a node walks its own shards in a fresh order, mixing the samples of a sliding window of
``window`` shards. The mount is told that order up front (the hint) so it reads ahead of the
readers instead of behind them.

The planning (``plan_node``) is a pure numpy function of (seed, epoch, table, world): every
rank and every restart computes the same order without talking to the others. This is the
only shardfs module that imports torch; ``import shardfs`` never loads it.
"""

from __future__ import annotations

import os
import warnings
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import torch.distributed as dist
from torch.utils.data import Sampler

__all__ = ["DEFAULT_WINDOW", "ShardSampler", "World", "plan_node", "plan_rank"]

Mode = Literal["shard", "uniform"]
IntArray = npt.NDArray[np.int64]

DEFAULT_WINDOW = 8
"""Shards mixed at a time in shard mode (bench/shuffle_quality.py, 1,000 classes x 128 in
shards of 1,000). On a shuffled pack every window from 1 up matches RandomSampler (226
classes per batch of 256, lag-1 0.001, KS 0.075). On a class-sorted pack quality grows with
the window (classes per batch 36 at 4, 66 at 8, 110 at 16) while the live set of shards the
cache must hold grows with it (5, 9, 16 per batch); 8 is the middle: twice the mixing of 4
for a live set that stays under ten shards."""

_STATE_KEYS = ("epoch", "yielded", "seed", "length")


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


def _window_mix(
    samples: IntArray, shard_of: IntArray, rng: np.random.Generator, spread: float
) -> IntArray:
    """Reorder the node's shards, then let each sample drift forward by up to ``spread``
    positions: at any point of the epoch the readers draw from about ``spread`` consecutive
    samples, i.e. a window of shards that slides one shard at a time."""
    if len(samples) == 0:
        return samples
    shards = shard_of[samples]
    starts = np.flatnonzero(np.r_[True, shards[1:] != shards[:-1]])
    piece = np.cumsum(np.r_[True, shards[1:] != shards[:-1]]) - 1
    new_rank = np.empty(len(starts), dtype=np.int64)
    new_rank[rng.permutation(len(starts))] = np.arange(len(starts))
    regrouped = samples[np.argsort(new_rank[piece], kind="stable")]
    keys = np.arange(len(regrouped), dtype=np.float64) + rng.random(len(regrouped)) * spread
    return regrouped[np.argsort(keys, kind="stable")]


def _fit(order: IntArray, length: int, fill: IntArray) -> IntArray:
    """``order`` cut or padded to ``length``; padding repeats the node's own samples from the
    head of its order (already cached locally), or ``fill`` when the node has none."""
    if len(order) >= length:
        return order[:length]
    source = order if len(order) else fill
    return np.concatenate([order, np.resize(source, length - len(order))])


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
) -> NodePlan:
    """The order ``world``'s node reads this epoch, as dataset indices.

    ``shard_of[i]`` is the shard of sample ``i`` (None: no table, which plans like
    ``DistributedSampler``). ``base`` is ``run_order(...)``, passed in to reuse it across
    epochs; it is derived from the other arguments when absent.
    """
    per_rank = per_rank_length(num_samples, world.size, drop_last)
    total = per_rank * world.size
    padded, dropped = max(total - num_samples, 0), max(num_samples - total, 0)
    node_length = per_rank * world.local_size
    if shard_of is None or mode == "uniform":
        if shuffle:
            perm = _rng(seed, epoch).permutation(num_samples).astype(np.int64)
        else:
            perm = np.arange(num_samples, dtype=np.int64)
        grid = np.resize(perm, total).reshape(per_rank, world.size)
        first = world.node_rank * world.local_size
        order = np.ascontiguousarray(grid[:, first : first + world.local_size]).reshape(-1)
        return NodePlan(order.astype(np.int64), per_rank, padded, dropped)

    if len(shard_of) != num_samples:
        raise ValueError(f"{len(shard_of)} shard ids for {num_samples} samples")
    if base is None:
        base = run_order(shard_of, within, seed=seed, shuffle=shuffle)
    start = min(world.node_rank * node_length, num_samples)
    last = world.node_rank == world.num_nodes - 1
    end = num_samples if last else min(start + node_length, num_samples)
    mine = base[start:end]
    if shuffle:
        rng = _rng(seed, epoch, world.node_rank, 0x4E4F)
        num_shards = int(shard_of.max()) + 1 if num_samples else 1
        spread = max(1.0, window * num_samples / num_shards)
        mine = _window_mix(mine, shard_of, rng, spread)
    return NodePlan(_fit(mine, node_length, base), per_rank, padded, dropped)


def plan_rank(plan: NodePlan, world: World) -> IntArray:
    """This rank's share of its node's order: dealt in turn, so a node's ranks read the same
    few shards at the same time and share the node's cache."""
    return plan.order[world.local_rank :: world.local_size]


def _samples_of(dataset: object) -> Sequence[tuple[str, int]]:
    for name in ("samples", "imgs"):
        samples = getattr(dataset, name, None)
        if isinstance(samples, Sequence) and all(
            isinstance(s, tuple) and s and isinstance(s[0], (str, os.PathLike)) for s in samples[:1]
        ):
            return samples
    raise TypeError(
        "ShardSampler needs a dataset with .samples (or .imgs) of (path, target) pairs, "
        f"as torchvision's ImageFolder and DatasetFolder have; {type(dataset).__name__} has neither"
    )


@dataclass(frozen=True)
class _Table:
    """What the mount says about the dataset's files."""

    mount_root: str
    placement: Any  # shardfs.placement.Placement
    rows: IntArray  # table row of each sample
    shard_of: IntArray  # shard id of each sample


def _relative_paths(paths: Sequence[str], root: str) -> list[str]:
    """Each path relative to the mount root. The common case is a string cut; folders that
    reach the mount through a symlink are resolved once per folder, never once per file."""
    prefix = root.rstrip("/") + "/"
    resolved: dict[str, str] = {}
    out = []
    for path in paths:
        if path.startswith(prefix):
            out.append(path[len(prefix) :])
            continue
        folder, name = os.path.split(path)
        real = resolved.get(folder)
        if real is None:
            real = resolved[folder] = os.path.relpath(os.path.realpath(folder), root)
        out.append(name if real == "." else f"{real}/{name}")
    return out


def _locate(paths: Sequence[str]) -> tuple[_Table | None, str | None]:
    """The mount's table for ``paths``, or None and why not."""
    from . import placement

    if not paths:
        return None, "the dataset is empty"
    root = placement.mount_root_of(paths[0])
    if root is None:
        return None, f"{paths[0]} is not on a shardfs mount"
    try:
        table = placement.read_placement(root)
    except OSError as exc:
        return None, f"the mount at {root} has no placement table ({exc.strerror or exc})"
    relative = _relative_paths(paths, root)
    try:
        rows = _rows_by_hash(table.paths, relative)
        if rows is None:  # two table paths share a hash: match them by name
            rows = np.asarray(table.rows_of(relative), dtype=np.int64)
    except (KeyError, ValueError) as exc:
        return None, f"a sample is not in the table of the mount at {root}: {exc}"
    shards = np.frombuffer(table.shards, dtype=np.intc).astype(np.int64)
    return _Table(root, table, rows, shards[rows]), None


def _rows_by_hash(table_paths: Sequence[str], wanted: Sequence[str]) -> IntArray | None:
    """The table row of each wanted path (KeyError if one is absent), matched by 64-bit
    string hash with two sorts. A dict of the table's paths takes about 1.5 s for 1.28M
    samples, nearly all of it lookups that miss the CPU cache (ImageFolder's order is not
    the table's); sorted hashes take about 0.4 s. None when two table paths share a hash.
    A wanted path that is absent but shares the hash of a table path (odds about 1e-7 at
    1.28M x 1.28M) would get that row: the sampler would read it with the wrong shard's
    locality, never yield a wrong or a missing sample."""
    have = np.fromiter(map(hash, table_paths), dtype=np.int64, count=len(table_paths))
    want = np.fromiter(map(hash, wanted), dtype=np.int64, count=len(wanted))
    by_have = np.argsort(have)
    have_sorted = have[by_have]
    if len(have_sorted) > 1 and bool((have_sorted[1:] == have_sorted[:-1]).any()):
        return None
    by_want = np.argsort(want)
    want_sorted = want[by_want]
    found = np.searchsorted(have_sorted, want_sorted)  # sorted queries: cache-friendly
    found[found == len(have_sorted)] = 0
    missing = np.flatnonzero(have_sorted[found] != want_sorted) if len(have_sorted) else by_want
    if len(missing):
        raise KeyError(wanted[int(by_want[missing[0]])])
    rows = np.empty(len(wanted), dtype=np.int64)
    rows[by_want] = by_have[found]
    return rows


def _detect_world(
    num_replicas: int | None, rank: int | None, num_nodes: int | None, node_rank: int | None
) -> World:
    """The world from the arguments, else torch.distributed and torchrun's LOCAL_WORLD_SIZE.
    Without a way to tell which ranks share a mount, each rank is its own node: disjoint
    shards per rank never download anything twice."""
    initialised = dist.is_available() and dist.is_initialized()
    if num_replicas is None:
        num_replicas = dist.get_world_size() if initialised else 1
    if rank is None:
        rank = dist.get_rank() if initialised else 0
    if not 0 <= rank < num_replicas:
        raise ValueError(f"rank {rank} is outside 0..{num_replicas - 1}")
    if num_nodes is None:
        if node_rank is not None:
            raise ValueError("node_rank needs num_nodes")
        local = os.environ.get("LOCAL_WORLD_SIZE", "")
        local_size = int(local) if local.isdigit() and int(local) > 0 else 1
        if num_replicas % local_size:
            local_size = 1
        num_nodes = num_replicas // local_size
    if num_nodes < 1 or num_replicas % num_nodes:
        raise ValueError(f"{num_replicas} replicas do not split evenly into {num_nodes} nodes")
    local_size = num_replicas // num_nodes
    if node_rank is None:
        node_rank = rank // local_size
    local_rank = rank - node_rank * local_size
    return World(num_nodes, node_rank, local_size, local_rank)


class ShardSampler(Sampler[int]):
    """Indices of a folder dataset on a shardfs mount, in an order the mount reads fast.

    Every rank yields ``len(self)`` indices. ``drop_last=False``: every sample at least once,
    at most ``world_size - 1`` repeated (``num_padded``). ``drop_last=True``: at most
    ``world_size - 1`` left out (``num_dropped``), none repeated. Off a shardfs mount it acts
    as ``DistributedSampler`` (one warning), so one script runs on local disk too.
    """

    def __init__(
        self,
        dataset: object,
        *,
        mode: Mode = "shard",
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int | None = None,
        rank: int | None = None,
        num_nodes: int | None = None,
        node_rank: int | None = None,
        drop_last: bool = False,
        hint: bool = True,
        window: float = DEFAULT_WINDOW,
    ) -> None:
        if mode not in ("shard", "uniform"):
            raise ValueError(f"mode must be 'shard' or 'uniform', not {mode!r}")
        if not window > 0:
            raise ValueError(f"window must be more than 0 shards, not {window}")
        samples = _samples_of(dataset)
        self.mode: Mode = mode
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.hint = hint
        self.window = window
        self.world = _detect_world(num_replicas, rank, num_nodes, node_rank)
        self.num_samples = len(samples)
        self.epoch = 0
        self._yielded = 0
        self._resume_at: int | None = None
        self._hint_warned = False
        self._table, reason = _locate([os.fspath(s[0]) for s in samples])
        if reason is not None:
            warnings.warn(
                f"ShardSampler: {reason}; sampling like DistributedSampler, without shard "
                "locality or read-ahead hints",
                stacklevel=2,
            )
        self._base: IntArray | None = None
        if self._table is not None and mode == "shard":
            self._base = run_order(
                self._table.shard_of, self._table.rows, seed=seed, shuffle=shuffle
            )
        first = self.plan()
        self.num_padded = first.num_padded
        """Indices repeated across the whole world each epoch to even out the ranks."""
        self.num_dropped = first.num_dropped
        """Samples left out across the whole world each epoch (``drop_last=True``)."""

    @property
    def on_mount(self) -> bool:
        """Whether the order comes from the mount's table (else DistributedSampler-like)."""
        return self._table is not None

    def set_epoch(self, epoch: int) -> None:
        """Pick the epoch's order; call it before each epoch, as with DistributedSampler."""
        self.epoch = epoch

    def plan(self) -> NodePlan:
        """This node's order for the current epoch."""
        table = self._table
        return plan_node(
            table.shard_of if table is not None else None,
            num_samples=self.num_samples,
            mode=self.mode,
            shuffle=self.shuffle,
            seed=self.seed,
            epoch=self.epoch,
            window=self.window,
            world=self.world,
            drop_last=self.drop_last,
            within=table.rows if table is not None else None,
            base=self._base,
        )

    def __len__(self) -> int:
        return per_rank_length(self.num_samples, self.world.size, self.drop_last)

    def __iter__(self) -> Iterator[int]:
        start = self._resume_at or 0
        self._resume_at = None
        self._yielded = start
        plan = self.plan()
        if self.hint and self.world.local_rank == 0:
            self._send_hint(plan.order[start * self.world.local_size :])
        return self._walk(plan_rank(plan, self.world), start)

    def _walk(self, indices: IntArray, start: int) -> Iterator[int]:
        for index in indices[start:].tolist():
            self._yielded += 1
            yield index

    def _send_hint(self, order: IntArray) -> None:
        table = self._table
        if table is None:
            return
        from . import placement

        try:
            rows = array("i", table.rows[order].astype(np.int32).tobytes())
            placement.send_hint(table.mount_root, table.placement, rows, epoch=self.epoch)
        except OSError as exc:
            if not self._hint_warned:
                self._hint_warned = True
                warnings.warn(
                    f"ShardSampler: the mount at {table.mount_root} did not take the read "
                    f"order ({exc.strerror or exc}); training goes on without read-ahead hints",
                    stacklevel=3,
                )

    def state_dict(self) -> dict[str, int]:
        """Where this rank is in the epoch; StatefulDataLoader saves it with its own state."""
        return {
            "epoch": self.epoch,
            "yielded": self._yielded,
            "seed": self.seed,
            "length": len(self),
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at the saved position: the next ``__iter__`` skips what was yielded."""
        missing = [key for key in _STATE_KEYS if key not in state]
        if missing:
            raise ValueError(f"not a ShardSampler state (missing {', '.join(missing)})")
        if state["seed"] != self.seed or state["length"] != len(self):
            raise ValueError(
                f"the state is from another run (seed {state['seed']}, {state['length']} "
                f"indices per rank); this sampler has seed {self.seed}, {len(self)} per rank"
            )
        if not 0 <= state["yielded"] <= state["length"]:
            raise ValueError(f"yielded {state['yielded']} is outside 0..{state['length']}")
        self.epoch = state["epoch"]
        self._resume_at = state["yielded"]
        self._yielded = state["yielded"]

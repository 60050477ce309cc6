"""``ShardSampler``: the order in which a training loop asks a shardfs mount for samples.

A uniform shuffle makes every reader touch every shard all epoch long and makes every node
download the whole dataset. Here the shards are split between nodes once per run, and each
epoch a node walks its own shards in a fresh order, mixing the samples of a sliding window of
``window`` shards. The mount is told that order up front (the hint) so it reads ahead of the
readers instead of behind them.

The planning (``shardfs.sampling``, numpy only) is a pure function of (seed, epoch, table,
world, and the segments a resumed epoch ran before): every rank and every restart computes
the same order without talking to the others, and a state saved on one world resumes on
any other. This is the only shardfs module that imports torch; ``import shardfs`` never
loads it.
"""

from __future__ import annotations

import os
import warnings
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch.distributed as dist
from torch.utils.data import Sampler

from .sampling import state as states
from .sampling.plan import (
    DEFAULT_WINDOW,
    IntArray,
    Mode,
    NodePlan,
    Segment,
    World,
    legacy_node_order,
    per_rank_length,
    plan_node,
    plan_rank,
    run_order,
)

__all__ = [
    "DEFAULT_WINDOW",
    "NodePlan",
    "ShardSampler",
    "World",
    "per_rank_length",
    "plan_node",
    "plan_rank",
]


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
    as ``DistributedSampler`` (one warning), so one script runs on local disk too. A state
    saved mid-epoch resumes on any world (docs/training.md, "Elastic resume").
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
        self._done: tuple[Segment, ...] = ()  # segments of this epoch before this world's
        self._resume: states.Resume | None = None
        self._hint_warned = False
        self._table, reason = _locate([os.fspath(s[0]) for s in samples])
        if reason is not None:
            warnings.warn(
                f"ShardSampler: {reason}; sampling like DistributedSampler, without shard "
                "locality or read-ahead hints",
                stacklevel=2,
            )
        self._base: IntArray | None = None
        table = self._table
        if table is not None and mode == "shard":
            self._base = run_order(table.shard_of, table.rows, seed=seed, shuffle=shuffle)
        self._run = {
            "seed": seed,
            "mode": mode,
            "shuffle": shuffle,
            "drop_last": drop_last,
            "window": window,
            "num_samples": self.num_samples,
            "table": states.fingerprint(*((table.shard_of, table.rows) if table else (None,))),
        }
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
        if self._resume is not None and self._resume.epoch != epoch:
            self._resume = None  # a loaded position holds only in its own epoch
        if epoch != self.epoch:
            self._done, self._yielded = (), 0
        self.epoch = epoch

    def plan(self, done: Sequence[Segment] = ()) -> NodePlan:
        """This node's order for the current epoch, after the segments ``done``."""
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
            done=done,
        )

    def __len__(self) -> int:
        """An epoch's indices per rank in this world (a resumed epoch yields the rest)."""
        return per_rank_length(self.num_samples, self.world.size, self.drop_last)

    def __iter__(self) -> Iterator[int]:
        resume, self._resume = self._resume, None
        self._done = resume.segments if resume is not None else ()
        start = resume.start if resume is not None else 0
        self._yielded = start
        if resume is not None and resume.legacy and self._base is not None and self.shuffle:
            assert self._table is not None
            order = legacy_node_order(
                self._base, self._table.shard_of, seed=self.seed, epoch=self.epoch,
                window=self.window, world=self.world, drop_last=self.drop_last,
            )  # fmt: skip
        else:
            order = self.plan(self._done).order
        if self.hint and self.world.local_rank == 0:
            self._send_hint(order[start * self.world.local_size :])
        return self._walk(order[self.world.local_rank :: self.world.local_size], start)

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

    def state_dict(self) -> dict[str, Any]:
        """Where the world is in the epoch (every rank the same); StatefulDataLoader saves it
        with its own state. It loads on any world (``load_state_dict``)."""
        world = self.world
        here = (world.num_nodes, world.local_size, self._yielded)
        return states.make_state(self._run, self.epoch, (*self._done, here))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the saved position: the next ``__iter__`` deals the rest of the epoch to
        this world (the same world carries on batch for batch)."""
        world = (self.world.num_nodes, self.world.local_size)
        resume = states.read_state(state, self._run, world, len(self))
        self.epoch = resume.epoch
        if not resume.legacy:  # check the position against the plan now, not mid-training
            per_rank = self.plan(resume.segments).per_rank
            if resume.start > per_rank:
                raise ValueError(f"yielded {resume.start} is outside 0..{per_rank}")
        self._resume = resume
        self._done = resume.segments
        self._yielded = resume.start

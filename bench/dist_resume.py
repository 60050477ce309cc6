"""bench/dist.py's elastic run: stop mid-epoch on 2 nodes x 2 ranks, resume on another world.

The ranks run in the bench process (as tests/test_sampler_dist.py simulates them), each a
``ShardSampler`` over an unmodified ``ImageFolder`` of its node's mount, reading every file
it is dealt; each simulated node is still its own mount, cache and counting proxy. The
ranks step together, as DDP does, and stop after ``stop`` of the epoch; rank 0's state then
resumes every rank of the new world (1 x 2, then 3 x 1 with one fresh node). Each world
change starts from fresh mounts, so both resume from the same point. A node's egress after
the resume is checked against what it lacked of the shards its new ranks read (bytes of
those shards it had not fetched before the stop) plus one shard.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from torchvision.datasets import ImageFolder

from shardfs.placement import read_placement
from shardfs.torch import ShardSampler

BEFORE = (2, 2)
AFTER = ((1, 2), (3, 1))
SEED = 0

Counts = Callable[[Sequence[Any]], dict[str, Any]]


def make_ranks(datasets: list[ImageFolder], world: tuple[int, int]) -> list[ShardSampler]:
    size = world[0] * world[1]
    return [
        ShardSampler(
            datasets[r // world[1]], seed=SEED, num_replicas=size, rank=r, num_nodes=world[0]
        )
        for r in range(size)
    ]


def read_in_step(
    ranks: list[ShardSampler], datasets: list[ImageFolder], steps: int | None
) -> list[list[int]]:
    """Every rank reads its next file in turn, ``steps`` times (None: to the end of the
    epoch); the indices each rank read."""
    iterators = [iter(sampler) for sampler in ranks]
    seen: list[list[int]] = [[] for _ in ranks]
    step = 0
    while steps is None or step < steps:
        got = [next(iterator, None) for iterator in iterators]
        if all(index is None for index in got):
            break
        for rank, index in enumerate(got):
            if index is not None:
                path = datasets[ranks[rank].world.node_rank].samples[index][0]
                with open(path, "rb") as handle:
                    handle.read()
                seen[rank].append(index)
        step += 1
    return seen


def shard_names(dataset: ImageFolder, root: str) -> list[str]:
    """The shard (object name) of each sample, from the mount's placement table."""
    table = read_placement(root)
    rows = table.rows_of([os.path.relpath(path, root) for path, _ in dataset.samples])
    return [os.path.basename(table.shard_names[table.shards[row]]) for row in rows]


def by_shard(bytes_by_key: dict[str, int]) -> Counter[str]:
    fetched: Counter[str] = Counter()
    for key, count in bytes_by_key.items():
        fetched[os.path.basename(key.split("?")[0])] += count
    return fetched


def world_change(
    nodes: Sequence[Any],
    source: str,
    after: tuple[int, int],
    stop: float,
    shard_bytes: dict[str, int],
    settle: Callable[[Sequence[Any]], None],
    counts: Counts,
    reset: Callable[[Sequence[Any]], None],
) -> dict[str, Any]:
    """One stop on ``BEFORE`` and resume on ``after``; ``nodes`` are the simulated nodes
    (Node of bench/dist.py), as many as the larger world has."""
    for node in nodes:
        node.mount(source)
    try:
        settle(nodes)
        reset(nodes)
        datasets = [ImageFolder(str(node.mnt)) for node in nodes]
        old = make_ranks(datasets, BEFORE)
        steps = int(len(old[0]) * stop)
        before = read_in_step(old, datasets, steps)
        state = old[0].state_dict()
        settle(nodes)
        stopped = counts(nodes)
        held = [by_shard(node.proxy.counts()["bytes_by_key"]) for node in nodes]
        reset(nodes)
        new = make_ranks(datasets, after)
        for sampler in new:
            sampler.load_state_dict(state)
        rest = read_in_step(new, datasets, None)
        settle(nodes)
        resumed = counts(nodes)
        shard_of = shard_names(datasets[0], str(nodes[0].mnt))
    finally:
        for node in nodes:
            node.unmount()
    largest = max(shard_bytes.values())
    bounds = []
    for k in range(after[0]):
        reads = {shard_of[i] for r in rest[k * after[1] : (k + 1) * after[1]] for i in r}
        lacking = sum(max(0, shard_bytes[s] - held[k][s]) for s in reads)
        bounds.append(lacking + largest)
    seen = [i for r in before for i in r] + [i for r in rest for i in r]
    counted = Counter(seen)
    size_before, size_after = BEFORE[0] * BEFORE[1], after[0] * after[1]
    egress = resumed["per_node_bytes"][: after[0]]
    return {
        "before": list(BEFORE),
        "after": list(after),
        "stopped_at": steps,
        "state_consumed": state["consumed"],
        "egress_to_stop": stopped,
        "egress_after_resume": resumed,
        "egress_bound_per_node": bounds,
        "rank_lengths_after": [len(r) for r in rest],
        "samples": len(datasets[0].samples),
        "distinct_seen": len(counted),
        "repeats": len(seen) - len(counted),
        "repeat_bound": size_before - 1 + size_after - 1,
        "checks": {
            "every sample seen": len(counted) == len(datasets[0].samples),
            "repeats within padding": len(seen) - len(counted) <= size_before + size_after - 2,
            "new ranks equal": len({len(r) for r in rest}) == 1,
            "egress per node within bound": all(
                e <= b for e, b in zip(egress, bounds, strict=True)
            ),
            "unused nodes fetched nothing": not any(resumed["per_node_bytes"][after[0] :]),
            "proxies add up to the server": sum(resumed["per_node_bytes"])
            == resumed["server_bytes"],
        },
    }


def markdown(runs: list[dict[str, Any]], dataset_bytes: int) -> list[str]:
    mb = 1e6
    lines = [
        "",
        f"Elastic resume: {BEFORE[0]} x {BEFORE[1]} ranks stop mid-epoch (rank 0's "
        "`ShardSampler` state), the new world resumes the same epoch; ranks simulated in one "
        "process, each node its own mount, cache and proxy.",
        "",
        "| world change | stopped at (per rank) | egress to the stop MB | egress after resume "
        "MB, per node | bound per node MB | new rank lengths | distinct seen | repeats (bound) "
        "| epoch egress / dataset | all checks |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    whole = dataset_bytes
    for run in runs:
        after = run["egress_after_resume"]
        lines.append(
            f"| {run['before'][0]} x {run['before'][1]} -> {run['after'][0]} x {run['after'][1]} "
            f"| {run['stopped_at']} | {run['egress_to_stop']['server_bytes'] / mb:.1f} "
            f"| {after['server_bytes'] / mb:.1f}: "
            + ", ".join(f"{b / mb:.1f}" for b in after["per_node_bytes"])
            + " | "
            + ", ".join(f"{b / mb:.1f}" for b in run["egress_bound_per_node"])
            + f" | {sorted(set(run['rank_lengths_after']))} | {run['distinct_seen']} of "
            f"{run['samples']} | {run['repeats']} ({run['repeat_bound']}) "
            f"| {(run['egress_to_stop']['server_bytes'] + after['server_bytes']) / whole:.3f}"
            f" | {'yes' if all(run['checks'].values()) else '**no**'} |"
        )
    return lines

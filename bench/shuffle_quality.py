"""How well does each sampler order shuffle, and how many shards does it keep live?

Synthetic tables, no mount: CLASSES classes of PER_CLASS samples packed into shards of
SHARD samples, once in shuffled order and once sorted by class (the worst case for shard
order). For one epoch of a single rank it reports, per sampler:

- classes/batch: mean distinct classes per batch of 256 (higher is better);
- lag-1: fraction of consecutive samples with the same label (lower is better);
- KS: mean over classes of the Kolmogorov-Smirnov distance between the class's positions in
  the epoch and a uniform spread (lower is better);
- shards/batch: mean distinct shards per batch of 256 (the locality cost: what the cache
  must hold live).

A second table plans worlds of ``--nodes`` nodes (one rank each, default window) and
reports the mean over the nodes of each node's order: every node mixes its own share, so a
node of many mixes as well as one node alone (KS grows with fewer samples per node; compare
it within a column of nodes).

Run: ``python bench/shuffle_quality.py [--classes 1000 --per-class 128 --shard 1000]``.
"""

from __future__ import annotations

import argparse

import numpy as np
import numpy.typing as npt
import torch

from shardfs.torch import DEFAULT_WINDOW, World, plan_node

BATCH = 256
WINDOWS = (1, 2, 4, 8, 16, 32)


def metrics(
    order: npt.NDArray[np.int64], labels: npt.NDArray[np.int64], shards: npt.NDArray[np.int64]
) -> tuple[float, float, float, float]:
    y = labels[order]
    full = len(y) // BATCH * BATCH
    batches = y[:full].reshape(-1, BATCH)
    classes = np.mean([len(np.unique(b)) for b in batches])
    shard_batches = shards[order][:full].reshape(-1, BATCH)
    live = np.mean([len(np.unique(b)) for b in shard_batches])
    lag1 = float(np.mean(y[1:] == y[:-1]))
    # KS per class: positions of the class in the epoch, scaled to (0, 1), against uniform.
    n = len(y)
    pos = (np.arange(n) + 0.5) / n
    by_class = np.lexsort((pos, y))
    ys, ps = y[by_class], pos[by_class]
    starts = np.r_[0, np.flatnonzero(ys[1:] != ys[:-1]) + 1]
    counts = np.diff(np.r_[starts, n])
    rank_in_class = np.arange(n) - np.repeat(starts, counts)
    size = np.repeat(counts, counts)
    gap = np.maximum((rank_in_class + 1) / size - ps, ps - rank_in_class / size)
    ks = float(np.maximum.reduceat(gap, starts).mean())
    return float(classes), lag1, ks, float(live)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--per-class", type=int, default=128)
    parser.add_argument("--shard", type=int, default=1000, help="samples per shard")
    parser.add_argument("--epochs", type=int, default=4, help="epochs averaged (lag-1 is noisy)")
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 4, 16])
    args = parser.parse_args()

    n = args.classes * args.per_class
    # Dataset index order is ImageFolder's: sorted by class.
    labels = np.repeat(np.arange(args.classes), args.per_class).astype(np.int64)
    packs = {
        "shuffled": np.random.default_rng(7).permutation(n),
        "class-sorted": np.arange(n),
    }
    print(
        f"{args.classes} classes x {args.per_class} samples, shards of {args.shard}, "
        f"batch {BATCH}, mean of {args.epochs} epochs, one rank"
    )
    header = f"| {'pack':<12} | {'sampler':<18} | classes/batch | lag-1   | KS     | shards/batch |"
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    tables = {}
    for pack, table_order in packs.items():
        # Row r of the table holds sample table_order[r]; shards cut the rows in runs.
        rows = np.empty(n, dtype=np.int64)
        rows[table_order] = np.arange(n)
        shard_of = rows // args.shard
        results: dict[str, list[tuple[float, float, float, float]]] = {}
        for epoch in range(args.epochs):
            generator = torch.Generator().manual_seed(epoch)
            contenders = {
                "RandomSampler": torch.randperm(n, generator=generator).numpy().astype(np.int64),
                "uniform": plan_node(shard_of, num_samples=n, mode="uniform", epoch=epoch).order,
            }
            for window in WINDOWS:
                contenders[f"shard W={window}"] = plan_node(
                    shard_of, num_samples=n, epoch=epoch, window=window, within=rows, world=World()
                ).order
            for name, order in contenders.items():
                assert np.array_equal(np.sort(order), np.arange(n)), name
                results.setdefault(name, []).append(metrics(order, labels, shard_of))
        for name, runs in results.items():
            classes, lag1, ks, live = np.mean(runs, axis=0)
            print(
                f"| {pack:<12} | {name:<18} | {classes:13.1f} | {lag1:.5f} | {ks:.4f} "
                f"| {live:12.1f} |"
            )
        tables[pack] = shard_of
    print(f"\nshard mode at window {DEFAULT_WINDOW} per node of a world (mean over its nodes)")
    print(f"| {'pack':<12} | nodes | classes/batch | KS     | shards/batch |")
    print("|---|---|---|---|---|")
    for pack, shard_of in tables.items():
        for nodes in args.nodes:
            runs = []
            for epoch in range(args.epochs):
                for node in range(nodes):
                    world = World(nodes, node, 1, 0)
                    order = plan_node(shard_of, num_samples=n, epoch=epoch, world=world).order
                    runs.append(metrics(order, labels, shard_of))
            classes, _, ks, live = np.mean(runs, axis=0)
            print(f"| {pack:<12} | {nodes:5} | {classes:13.1f} | {ks:.4f} | {live:12.1f} |")


if __name__ == "__main__":
    main()

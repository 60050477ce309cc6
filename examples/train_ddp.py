"""Train a tiny CNN with DDP over an unmodified ImageFolder on a shardfs mount.

Start it with torchrun on every node, each node with its own mount of the same dataset::

    torchrun --nnodes 2 --node-rank K --nproc-per-node 2 \\
        --master-addr HOST --master-port PORT examples/train_ddp.py /mnt/data/train

The only shardfs line is the sampler: ``ShardSampler`` gives each node a fixed share of the
shards (so each node downloads and caches only its share) and tells the mount the order its
ranks will read. ``--sampler distributed`` runs torch's ``DistributedSampler`` instead, for
contrast. Each rank prints one ``EPOCH {json}`` line per epoch: its sampler length, the
samples it saw, the epoch's wall time and its last loss.

``--sync-dir`` is for benchmarks (bench/dist.py): after each epoch global rank 0 writes
``epoch-N.done`` there and waits for ``epoch-N.go``, so an observer can read counters
between epochs while no rank reads.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, Sampler
from torchvision import datasets, transforms

from shardfs.torch import ShardSampler


def tiny_cnn(classes: int) -> nn.Module:
    """Two convolutions and a linear head: enough work per batch to be a training loop."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, classes),
    )


def wait_for_go(sync_dir: Path, epoch: int, timeout: float = 600.0) -> None:
    """Tell the observer this epoch is over and wait until it has read its counters."""
    (sync_dir / f"epoch-{epoch}.done").write_text("")
    go = sync_dir / f"epoch-{epoch}.go"
    deadline = time.monotonic() + timeout
    delay = 0.02
    while not go.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {go} after {timeout:.0f} s")
        time.sleep(delay)
        delay = min(delay * 2, 0.25)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", help="the ImageFolder root, on a shardfs mount")
    parser.add_argument("--sampler", choices=["shard", "distributed"], default="shard")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=0, help="DataLoader workers per rank")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sync-dir", type=Path, help="benchmarks: pause between epochs")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)

    tf = transforms.Compose([transforms.Resize((32, 32)), transforms.ToTensor()])
    dataset = datasets.ImageFolder(args.root, transform=tf)
    sampler: Sampler[int]
    if args.sampler == "shard":
        sampler = ShardSampler(dataset, seed=args.seed)  # the one shardfs line
    else:
        sampler = DistributedSampler(dataset, seed=args.seed)
    loader = DataLoader(
        dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers
    )
    model = DistributedDataParallel(tiny_cnn(len(dataset.classes)))
    optimiser = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        dist.barrier()
        started = time.perf_counter()
        seen, loss = 0, torch.tensor(0.0)
        for images, labels in loader:
            optimiser.zero_grad()
            loss = loss_fn(model(images), labels)
            loss.backward()
            optimiser.step()
            seen += int(labels.shape[0])
        dist.barrier()
        seconds = time.perf_counter() - started
        report = {
            "rank": rank,
            "world": world,
            "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
            "epoch": epoch,
            "sampler": args.sampler,
            "len_sampler": len(sampler),  # type: ignore[arg-type]
            "samples_seen": seen,
            "num_padded": getattr(sampler, "num_padded", None),
            "seconds": seconds,
            "loss": float(loss),
        }
        sys.stdout.write("EPOCH " + json.dumps(report) + "\n")  # one write: ranks share a log
        sys.stdout.flush()
        if args.sync_dir is not None and rank == 0:
            wait_for_go(args.sync_dir, epoch)
        dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

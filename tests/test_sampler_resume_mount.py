"""Resume mid-epoch on a real FUSE mount, where the order comes from the mount's placement
table (issue 11 item 3): a ``StatefulDataLoader`` stopped inside an epoch and restored into a
new loader and sampler yields the same batches, one for one, as one that never stopped.

``test_sampler_resume.py`` covers the same property off a mount (DistributedSampler-like
order); here the samples are read through the mount, so every batch also carries a digest
of the bytes the reader received."""

from __future__ import annotations

import os
import warnings
import zlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from support.datagen import make_imagefolder
from support.mounts import mount, umount
from support.processes import run_shardfs
from torchdata.stateful_dataloader import StatefulDataLoader
from torchvision.datasets import ImageFolder

from shardfs.mount.control import query
from shardfs.placement import read_placement
from shardfs.sampling.plan import legacy_node_order
from shardfs.torch import ShardSampler

pytestmark = pytest.mark.integration

# 46 images in uneven classes, packed 5 to a shard in shuffled order: 10 shards, the last short.
CLASS_SIZES = {"ant": 9, "bee": 14, "cat": 6, "dog": 12, "eel": 5}
NUM_IMAGES = sum(CLASS_SIZES.values())
BATCH = 4
SEED = 7
WORLD = {"num_replicas": 2, "rank": 1}  # rank 1 of 2 on one node: half the node's order


@pytest.fixture(scope="module")
def mounted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    base = tmp_path_factory.mktemp("resume-mount")
    source, packed, mnt = base / "src", base / "packed", base / "mnt"
    make_imagefolder(source, CLASS_SIZES, image_bytes=1500)
    result = run_shardfs(
        "pack", source, packed, "--format", "webdataset", "--max-count", "5",
        "--shuffle-seed", "5",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    mnt.mkdir()
    mount(str(packed), mnt, base / "cache", env={})
    try:
        yield mnt
    finally:
        umount(mnt)


class DigestFolder(torch.utils.data.Dataset[tuple[int, int]]):
    """ImageFolder's samples over the mount; an item is (its index, CRC-32 of its bytes)."""

    def __init__(self, root: Path) -> None:
        self.samples = ImageFolder(str(root)).samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[int, int]:
        with open(self.samples[index][0], "rb") as handle:
            return index, zlib.crc32(handle.read())


def make_loader(
    dataset: DigestFolder, mode: str, workers: int
) -> tuple[ShardSampler, StatefulDataLoader]:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # on the mount: no fallback warning, the hint is taken
        sampler = ShardSampler(dataset, mode=mode, seed=SEED, **WORLD)  # type: ignore[arg-type]
    loader = StatefulDataLoader(dataset, batch_size=BATCH, sampler=sampler, num_workers=workers)
    return sampler, loader


def as_lists(batch: list[torch.Tensor]) -> list[tuple[int, int]]:
    indices, digests = batch
    return list(zip(indices.tolist(), digests.tolist(), strict=True))


def run_epochs(
    sampler: ShardSampler, loader: StatefulDataLoader, epochs: range
) -> list[list[tuple[int, int]]]:
    batches = []
    for epoch in epochs:
        sampler.set_epoch(epoch)
        batches += [as_lists(batch) for batch in loader]
    return batches


def off_mount_order(dataset: DigestFolder, mode: str, root: Path, epoch: int) -> list[int]:
    """The order the same sampler gives for the same samples away from the mount."""
    elsewhere = DigestFolder.__new__(DigestFolder)
    elsewhere.samples = [
        (os.path.join("/nonexistent-shardfs-test", os.path.relpath(path, root)), target)
        for path, target in dataset.samples
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sampler = ShardSampler(elsewhere, mode=mode, seed=SEED, **WORLD)  # type: ignore[arg-type]
    assert not sampler.on_mount
    sampler.set_epoch(epoch)
    return list(sampler)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("mode", ["shard", "uniform"])
def test_resume_on_the_mount_matches_the_uninterrupted_run(
    mounted: Path, mode: str, workers: int
) -> None:
    dataset = DigestFolder(mounted)
    truth = {i: zlib.crc32(Path(path).read_bytes()) for i, (path, _) in enumerate(dataset.samples)}
    before_stats = query(mounted)
    reference = run_epochs(*make_loader(dataset, mode, workers), range(3))
    after_stats = query(mounted)
    per_epoch = len(reference) // 3
    assert per_epoch == 6  # 23 indices per rank, in batches of 4
    assert all(digest == truth[index] for batch in reference for index, digest in batch)

    # The table was used: the mount took an order hint each epoch. In shard mode the order
    # also differs from the off-mount one and (a window of one shard) each shard's samples
    # are read close together, not spread over the epoch. (Uniform mode is the same global
    # permutation on and off a mount; there the table feeds only the hint.)
    assert after_stats["hints_taken"] - before_stats["hints_taken"] >= 3
    sampler, _ = make_loader(dataset, mode, workers)
    assert sampler.on_mount
    sampler.set_epoch(1)
    on_mount = list(sampler)
    assert on_mount == [i for batch in reference[per_epoch : 2 * per_epoch] for i, _ in batch]
    if mode == "shard":
        assert on_mount != off_mount_order(dataset, mode, mounted, 1)
        table = read_placement(str(mounted))
        rows = table.rows_of([os.path.relpath(path, mounted) for path, _ in dataset.samples])
        runs = ShardSampler(dataset, mode="shard", seed=SEED, window=1, num_replicas=1, rank=0)
        positions: dict[int, list[int]] = {}
        for position, index in enumerate(runs.plan().order.tolist()):
            positions.setdefault(table.shards[rows[index]], []).append(position)
        assert len(positions) == len(table.shard_names) == 10
        assert max(p[-1] - p[0] for p in positions.values()) <= 3 * 5  # uniform: ~40

    for stop_after in (1, 4):
        # Stop inside epoch 1 after `stop_after` batches; keep only the loader's state.
        sampler, loader = make_loader(dataset, mode, workers)
        before = run_epochs(sampler, loader, range(1))
        sampler.set_epoch(1)
        iterator = iter(loader)
        before += [as_lists(next(iterator)) for _ in range(stop_after)]
        state = loader.state_dict()
        del iterator, loader, sampler

        sampler, loader = make_loader(dataset, mode, workers)
        loader.load_state_dict(state)
        after = [as_lists(batch) for batch in loader]  # the rest of epoch 1
        after += run_epochs(sampler, loader, range(2, 3))
        assert len(after) == 3 * per_epoch - per_epoch - stop_after
        assert before + after == reference
    assert reference[per_epoch : 2 * per_epoch] != reference[:per_epoch]  # epochs differ


def world_loader(
    dataset: DigestFolder, mode: str, workers: int, nodes: int, local: int, rank: int
) -> StatefulDataLoader:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sampler = ShardSampler(
            dataset, mode=mode, seed=SEED, num_replicas=nodes * local, rank=rank,  # type: ignore[arg-type]
            num_nodes=nodes,
        )  # fmt: skip
    return StatefulDataLoader(dataset, batch_size=BATCH, sampler=sampler, num_workers=workers)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("mode", ["shard", "uniform"])
@pytest.mark.parametrize("after", [(1, 2), (3, 1)])
def test_a_checkpoint_on_the_mount_resumes_on_another_world(
    mounted: Path, mode: str, workers: int, after: tuple[int, int]
) -> None:
    """2 nodes x 2 ranks stop after 2 batches each; rank 0's state resumes 1 x 2 and 3 x 1:
    every image once but for padding, each byte right, every new rank the same count."""
    dataset = DigestFolder(mounted)
    truth = {i: zlib.crc32(Path(path).read_bytes()) for i, (path, _) in enumerate(dataset.samples)}
    seen, state = [], None
    for rank in range(4):
        loader = world_loader(dataset, mode, workers, 2, 2, rank)
        loader.sampler.set_epoch(1)  # type: ignore[attr-defined]
        iterator = iter(loader)
        seen += [pair for _ in range(2) for pair in as_lists(next(iterator))]
        state = loader.state_dict() if rank == 0 else state
        del iterator
    rest = []
    for rank in range(after[0] * after[1]):
        loader = world_loader(dataset, mode, workers, *after, rank)
        loader.load_state_dict(state)
        rest.append([pair for batch in loader for pair in as_lists(batch)])
    every = seen + [pair for r in rest for pair in r]
    assert all(digest == truth[index] for index, digest in every)
    assert len({len(r) for r in rest}) == 1
    counts = Counter(index for index, _ in every)
    assert set(counts) == set(range(NUM_IMAGES))
    assert sum(counts.values()) - NUM_IMAGES <= after[0] * after[1] - 1


def test_a_state_from_before_elastic_resume_finishes_its_epoch_in_the_old_order(
    mounted: Path,
) -> None:
    """Shard mode on the mount: a state without a version resumes its epoch in the order
    it was planned in then (each node drew its own), and the next epoch is planned anew."""
    dataset = DigestFolder(mounted)
    sampler, _ = make_loader(dataset, "shard", 0)
    assert sampler._base is not None and sampler._table is not None
    old = legacy_node_order(
        sampler._base, sampler._table.shard_of, seed=SEED, epoch=1, window=sampler.window,
        world=sampler.world, drop_last=False,
    )[sampler.world.local_rank :: sampler.world.local_size].tolist()  # fmt: skip
    sampler.load_state_dict({"epoch": 1, "yielded": 5, "seed": SEED, "length": len(sampler)})
    assert list(sampler) == old[5:]
    fresh, _ = make_loader(dataset, "shard", 0)
    fresh.set_epoch(1)
    assert list(fresh) != old  # the order did change with elastic resume
    sampler.set_epoch(2)
    fresh.set_epoch(2)
    assert list(sampler) == list(fresh)

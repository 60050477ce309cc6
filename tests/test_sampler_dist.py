"""ShardSampler over a real FUSE mount of a packed ImageFolder: simulated ranks and nodes in
one process, then two real processes joined by torch.distributed (gloo)."""

from __future__ import annotations

import json
import os
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from support.datagen import make_imagefolder
from support.mounts import mount
from support.processes import run_shardfs
from torchvision.datasets import ImageFolder

from shardfs.placement import read_placement
from shardfs.torch import ShardSampler

pytestmark = pytest.mark.integration

# 39 images in uneven classes, packed 4 to a shard in shuffled order: 10 shards, the last short.
CLASS_SIZES = {"ant": 7, "bee": 13, "cat": 5, "dog": 11, "eel": 3}
NUM_IMAGES = sum(CLASS_SIZES.values())


@pytest.fixture
def mounted(tmp_path: Path, mountpoint: Path) -> Iterator[Path]:
    source, packed = tmp_path / "src", tmp_path / "packed"
    make_imagefolder(source, CLASS_SIZES, image_bytes=1500)
    result = run_shardfs(
        "pack", source, packed, "--format", "webdataset", "--max-count", "4",
        "--shuffle-seed", "3",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    mount(str(packed), mountpoint, tmp_path / "cache", env={})
    yield mountpoint


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize(("nodes", "local"), [(1, 1), (1, 3), (2, 2), (4, 2)])
def test_every_image_once_per_epoch_across_simulated_ranks(
    mounted: Path, nodes: int, local: int, drop_last: bool
) -> None:
    dataset = ImageFolder(str(mounted))
    assert len(dataset) == NUM_IMAGES
    size = nodes * local
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # on a mount: no fallback, and the hint is taken
        samplers = [
            ShardSampler(dataset, num_replicas=size, rank=r, num_nodes=nodes, drop_last=drop_last)
            for r in range(size)
        ]
        for sampler in samplers:
            sampler.set_epoch(1)
        ranks = [list(sampler) for sampler in samplers]
    assert all(sampler.on_mount for sampler in samplers)
    length = NUM_IMAGES // size if drop_last else -(-NUM_IMAGES // size)
    assert [len(r) for r in ranks] == [length] * size == [len(s) for s in samplers]
    counts = Counter(i for r in ranks for i in r)
    if drop_last:
        assert max(counts.values()) == 1
        assert NUM_IMAGES - len(counts) == samplers[0].num_dropped <= size - 1
    else:
        assert set(counts) == set(range(NUM_IMAGES))
        assert sum(counts.values()) - NUM_IMAGES == samplers[0].num_padded <= size - 1

    # Nodes split the shards: only a boundary shard is read by two nodes.
    table = read_placement(str(mounted))
    rows = table.rows_of([os.path.relpath(path, mounted) for path, _ in dataset.samples])
    node_shards = [
        {table.shards[rows[i]] for r in ranks[n * local : (n + 1) * local] for i in r}
        for n in range(nodes)
    ]
    assert sum(map(len, node_shards)) <= len(table.shard_names) + nodes - 1

    # What the rank yields is what the reader receives: decode one rank's images.
    loader = torch.utils.data.DataLoader(
        ImageFolder(str(mounted), transform=lambda image: image.size[0]),
        batch_size=4,
        sampler=samplers[-1],
    )
    assert sum(len(batch[0]) for batch in loader) == length


def _rank_main(rank: int, init_file: str, out_dir: str, mounted: str, local_world: str) -> None:
    if local_world:
        os.environ["LOCAL_WORLD_SIZE"] = local_world
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        sampler = ShardSampler(ImageFolder(mounted), seed=4)
        sampler.set_epoch(2)
        indices = list(sampler)
        lengths: list[object] = [None, None]
        dist.all_gather_object(lengths, len(indices))
        report = {
            "indices": indices,
            "lengths": lengths,
            "world": [sampler.world.num_nodes, sampler.world.node_rank, sampler.world.local_size],
            "on_mount": sampler.on_mount,
        }
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("local_world", ["", "2"])
def test_two_gloo_processes_get_equal_lengths_and_every_image(
    mounted: Path, tmp_path: Path, local_world: str
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    mp.spawn(
        _rank_main,
        args=(str(tmp_path / "store"), str(out), str(mounted), local_world),
        nprocs=2,
        join=True,
    )
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(report["on_mount"] for report in reports)
    assert reports[0]["lengths"] == reports[1]["lengths"] == [20, 20]
    # Without LOCAL_WORLD_SIZE each rank is its own node; with it, both share one.
    nodes = 1 if local_world else 2
    assert [report["world"][:1] for report in reports] == [[nodes], [nodes]]
    union = set(reports[0]["indices"]) | set(reports[1]["indices"])
    assert union == set(range(NUM_IMAGES))

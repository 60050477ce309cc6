"""Resume mid-epoch under torchdata's StatefulDataLoader: the resumed run yields the same
batches, one for one, as a run that never stopped (issue 11 item 3)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from shardfs.torch import ShardSampler

BATCH = 5


class IndexFolder(torch.utils.data.Dataset[int]):
    """A folder dataset whose items are their own indices, so batches show the order."""

    def __init__(self, root: Path, count: int) -> None:
        self.samples = [(str(root / f"c{i % 4}" / f"{i:04}.jpg"), i % 4) for i in range(count)]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> int:
        return index


def make_loader(
    dataset: IndexFolder, workers: int, **kwargs: object
) -> tuple[ShardSampler, StatefulDataLoader]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # off a mount: the DistributedSampler-like warning
        sampler = ShardSampler(dataset, seed=11, **kwargs)  # type: ignore[arg-type]
    loader = StatefulDataLoader(dataset, batch_size=BATCH, sampler=sampler, num_workers=workers)
    return sampler, loader


def run_epochs(sampler: ShardSampler, loader: StatefulDataLoader, epochs: range) -> list[list[int]]:
    batches = []
    for epoch in epochs:
        sampler.set_epoch(epoch)
        batches += [batch.tolist() for batch in loader]
    return batches


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("stop_after", [0, 3, 7, 10])
@pytest.mark.parametrize("drop_last", [False, True])
def test_resumed_run_matches_the_uninterrupted_one(
    tmp_path: Path, workers: int, stop_after: int, drop_last: bool
) -> None:
    dataset = IndexFolder(tmp_path, 103)
    world = {"num_replicas": 2, "rank": 1, "drop_last": drop_last}
    reference = run_epochs(*make_loader(dataset, workers, **world), range(3))
    per_epoch = len(reference) // 3

    # Stop inside epoch 1 after `stop_after` batches; keep only the loader's state.
    sampler, loader = make_loader(dataset, workers, **world)
    before = run_epochs(sampler, loader, range(1))
    sampler.set_epoch(1)
    iterator = iter(loader)
    before += [next(iterator).tolist() for _ in range(stop_after)]
    state = loader.state_dict()
    del iterator, loader, sampler

    sampler, loader = make_loader(dataset, workers, **world)
    loader.load_state_dict(state)
    after = [batch.tolist() for batch in loader]  # the rest of epoch 1
    after += run_epochs(sampler, loader, range(2, 3))
    assert before + after == reference
    assert reference[per_epoch : 2 * per_epoch] != reference[:per_epoch]  # epochs differ

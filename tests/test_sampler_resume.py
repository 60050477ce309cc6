"""Resume mid-epoch under torchdata's StatefulDataLoader: the resumed run yields the same
batches, one for one, as a run that never stopped (issue 11 item 3)."""

from __future__ import annotations

import warnings
from collections import Counter
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


def batches_of(loader: StatefulDataLoader, count: int | None = None) -> list[int]:
    iterator = iter(loader)
    if count is None:
        return [i for batch in iterator for i in batch.tolist()]
    return [i for _ in range(count) for i in next(iterator).tolist()]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize(("before", "after"), [((2, 2), (1, 2)), ((2, 2), (4, 2)),
                                                ((1, 2), (3, 2)), ((4, 2), (3, 1))])  # fmt: skip
def test_a_checkpoint_resumes_sample_exact_on_another_world(
    tmp_path: Path, workers: int, before: tuple[int, int], after: tuple[int, int]
) -> None:
    """Every rank of world W stops after 2 batches; rank 0's loader state resumes every
    rank of W': each sample seen once, but for padding, and every new rank the same count."""
    dataset = IndexFolder(tmp_path, 203)
    seen, state = [], None
    for rank in range(before[0] * before[1]):
        world = {"num_replicas": before[0] * before[1], "rank": rank, "num_nodes": before[0]}
        sampler, loader = make_loader(dataset, workers, **world)
        sampler.set_epoch(1)
        seen += batches_of(loader, 2)
        state = loader.state_dict() if rank == 0 else state
    assert state is not None
    size = after[0] * after[1]
    resumed = []
    for _ in range(2):
        rest = []
        for rank in range(size):
            sampler, loader = make_loader(
                dataset, workers, num_replicas=size, rank=rank, num_nodes=after[0]
            )
            loader.load_state_dict(state)
            rest.append(batches_of(loader))
        resumed.append(rest)
    assert resumed[0] == resumed[1]  # the same state resumes the same way
    lengths = {len(r) for r in resumed[0]}
    assert lengths == {-(-(203 - len(set(seen))) // size)}
    counts = Counter(seen + [i for r in resumed[0] for i in r])
    assert set(counts) == set(range(203))
    assert sum(counts.values()) - 203 <= size - 1


def test_a_state_from_before_elastic_resume_loads_on_its_own_world_only(tmp_path: Path) -> None:
    dataset = IndexFolder(tmp_path, 103)
    sampler, _ = make_loader(dataset, 0, num_replicas=2, rank=1)
    sampler.set_epoch(3)
    reference = list(sampler)
    legacy = {"epoch": 3, "yielded": 20, "seed": 11, "length": 52}  # what 0.x saved
    sampler, _ = make_loader(dataset, 0, num_replicas=2, rank=1)
    sampler.load_state_dict(legacy)
    assert list(sampler) == reference[20:]
    other, _ = make_loader(dataset, 0, num_replicas=3, rank=1)
    with pytest.raises(ValueError, match=r"^the state predates elastic resume[^\n]*52[^\n]*35$"):
        other.load_state_dict(legacy)


def test_a_state_from_another_run_or_past_its_epoch_is_refused_in_one_line(tmp_path: Path) -> None:
    dataset = IndexFolder(tmp_path, 103)
    sampler, _ = make_loader(dataset, 0, num_replicas=2, rank=0)
    state = sampler.state_dict()
    for change, word in (({"drop_last": True}, "drop_last"), ({"window": 4}, "window")):
        other, _ = make_loader(dataset, 0, num_replicas=2, rank=0, **change)
        with pytest.raises(ValueError, match=rf"^the state is from another run \({word} [^\n]*\)$"):
            other.load_state_dict(state)
    with pytest.raises(ValueError, match=r"^a ShardSampler state of version 9; this is 2$"):
        sampler.load_state_dict({**state, "version": 9})
    with pytest.raises(ValueError, match=r"^yielded 53 is outside 0\.\.52$"):
        sampler.load_state_dict({**state, "segments": [[2, 1, 53]]})  # this world
    with pytest.raises(ValueError, match=r"^a segment of 1 x 3 ranks yielded 40, outside 0\.\.35$"):
        sampler.load_state_dict({**state, "segments": [[1, 3, 40], [1, 2, 0]]})

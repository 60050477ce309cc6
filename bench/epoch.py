"""One epoch of a torch DataLoader over one contender; the only bench module importing torch.

``bench/run.py`` starts this file once as a long-lived subprocess (``python bench/epoch.py``)
and sends it one JSON request per line on stdin; each answer is one ``RESULT {json}`` line on
stdout. Keeping torch out of the orchestrating process means the DataLoader forks its
workers from a process with no S3 client threads, and torch is imported only once.

Every contender yields the same item, ``(payload, nbytes, label)``, through the same
``read_sample`` and ``collate``: in ``raw`` mode the payload is nothing (the loader only
reads the file's bytes), in ``decode`` mode it is PIL open + RGB + RandomResizedCrop(224) +
ToTensor.

An ImageFolder request may name a ``sampler``: ``"random"`` (the default, DataLoader's
``shuffle=True``) or a ``shardfs.torch.ShardSampler`` mode (``"shard"``, ``"uniform"``) with
``sampler_epoch`` passed to ``set_epoch``. The sampler is built in this process, where the
DataLoader iterates it, so its order hint reaches the mount as it would in training.
"""

from __future__ import annotations

import io
import json
import resource
import sys
import time
from typing import Any

import torch
from PIL import Image
from torch.utils.data import DataLoader
from torchvision import datasets, transforms

BATCH_SIZE = 32
SHUFFLE_BUFFER = 1000
_TRANSFORM = transforms.Compose([transforms.RandomResizedCrop(224), transforms.ToTensor()])


def read_sample(data: bytes, mode: str) -> tuple[torch.Tensor | None, int]:
    if mode == "raw":
        return None, len(data)
    image = Image.open(io.BytesIO(data)).convert("RGB")
    return _TRANSFORM(image), len(data)


def collate(batch: list[tuple[tuple[torch.Tensor | None, int], int]]) -> dict[str, Any]:
    """The one collate every contender uses: stacked images (decode), byte counts, labels."""
    payloads = [sample[0] for sample, _ in batch]
    return {
        "images": torch.stack(payloads) if payloads[0] is not None else None,  # type: ignore[arg-type]
        "nbytes": torch.tensor([sample[1] for sample, _ in batch], dtype=torch.int64),
        "labels": torch.tensor([label for _, label in batch], dtype=torch.int64),
    }


class _FileLoader:
    """ImageFolder's loader: read the whole file, then (decode mode) decode it."""

    def __init__(self, mode: str) -> None:
        self.mode = mode

    def __call__(self, path: str) -> tuple[torch.Tensor | None, int]:
        with open(path, "rb") as handle:
            data = handle.read()
        return read_sample(data, self.mode)


class _WdsSample:
    def __init__(self, mode: str) -> None:
        self.mode = mode

    def __call__(self, sample: dict[str, Any]) -> tuple[tuple[torch.Tensor | None, int], int]:
        return read_sample(sample["jpg"], self.mode), int(sample["cls"])


def imagefolder_loader(request: dict[str, Any]) -> tuple[DataLoader[Any], float]:
    started = time.perf_counter()
    dataset = datasets.ImageFolder(request["root"], loader=_FileLoader(request["mode"]))
    scan = time.perf_counter() - started
    kind = request.get("sampler", "random")
    if kind == "random":
        return DataLoader(
            dataset,
            batch_size=BATCH_SIZE,
            shuffle=True,
            num_workers=request["workers"],
            collate_fn=collate,
        ), scan
    from shardfs.torch import ShardSampler

    window = {"window": request["window"]} if request.get("window") is not None else {}
    sampler = ShardSampler(
        dataset, mode=kind, seed=request.get("seed", 0), num_replicas=1, rank=0, **window
    )
    sampler.set_epoch(request.get("sampler_epoch", 0))
    loader = DataLoader(
        dataset,
        batch_size=BATCH_SIZE,
        sampler=sampler,
        num_workers=request["workers"],
        collate_fn=collate,
    )
    return loader, scan


def webdataset_loader(request: dict[str, Any]) -> tuple[DataLoader[Any], float]:
    import webdataset as wds

    dataset = (
        wds.WebDataset(
            request["urls"],
            shardshuffle=len(request["urls"]),
            cache_dir=request.get("cache_dir"),
            workersplitter=wds.split_by_worker,
            empty_check=False,
        )
        .shuffle(SHUFFLE_BUFFER)
        .map(_WdsSample(request["mode"]))
    )
    loader = DataLoader(
        dataset, batch_size=BATCH_SIZE, num_workers=request["workers"], collate_fn=collate
    )
    return loader, 0.0


def readers_cpu() -> tuple[float, float, float]:
    """(user, system) CPU seconds and minor page faults of this process and its reaped
    children (the DataLoader workers of finished epochs) so far."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    workers = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (
        me.ru_utime + workers.ru_utime,
        me.ru_stime + workers.ru_stime,
        float(me.ru_minflt + workers.ru_minflt),
    )


def run_epoch(request: dict[str, Any]) -> dict[str, Any]:
    cpu_before = readers_cpu()
    torch.manual_seed(request.get("seed", 0))
    make = webdataset_loader if request["kind"] == "webdataset" else imagefolder_loader
    loader, scan = make(request)
    images = nbytes = 0
    started = time.perf_counter()
    first_batch = None
    for batch in loader:
        images += int(batch["labels"].shape[0])
        nbytes += int(batch["nbytes"].sum())
        if first_batch is None:
            first_batch = time.perf_counter() - started
    seconds = time.perf_counter() - started
    del loader  # its workers are joined, and so counted among the children
    user, system, faults = (
        after - was for was, after in zip(cpu_before, readers_cpu(), strict=True)
    )
    return {
        "readers_user_s": user,
        "readers_sys_s": system,
        "readers_minor_faults": int(faults),
        "images": images,
        "bytes": nbytes,
        "seconds": seconds,
        "scan_seconds": scan,
        "first_batch_seconds": first_batch,
    }


def main() -> int:
    torch.set_num_threads(1)
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        try:
            reply = run_epoch(request)
        except Exception as exc:  # reported to the orchestrator, which decides
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write("RESULT " + json.dumps(reply) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())

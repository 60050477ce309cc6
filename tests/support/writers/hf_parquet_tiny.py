"""Writes an ImageNet-sized Hugging Face parquet dataset of tiny images with ``datasets``'
own ``to_parquet``, for ``make bench-scale``: CLASSES x PER_CLASS rows of the same tiny
JPEG, in SHARDS files ``data/train-{i:05d}-of-{n:05d}.parquet``, each row's ``image.path``
``nCLASS_I.JPEG`` and its ClassLabel the class. Run under the writers venv (``make
writers``), never imported by the suite.

Usage: hf_parquet_tiny.py OUT CLASSES PER_CLASS SHARDS"""

from __future__ import annotations

import sys
from pathlib import Path

import datasets

PAYLOAD = b"\xff\xd8tiny\xff\xd9"  # the tar shards' payload in bench/scale.py


def main() -> None:
    out, classes, per_class, shards = Path(sys.argv[1]), *map(int, sys.argv[2:5])
    names = [f"n{c:08d}" for c in range(classes)]
    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=names)}
    )
    total = classes * per_class
    per_shard = -(-total // shards)
    datasets.disable_progress_bars()
    for index in range(shards):
        rows = range(index * per_shard, min(total, (index + 1) * per_shard))
        columns = {
            "image": [
                {"bytes": PAYLOAD, "path": f"{names[r // per_class]}_{r % per_class}.JPEG"}
                for r in rows
            ],
            "label": [r // per_class for r in rows],
        }
        name = out / f"data/train-{index:05d}-of-{shards:05d}.parquet"
        name.parent.mkdir(parents=True, exist_ok=True)
        datasets.Dataset.from_dict(columns, features=features).to_parquet(str(name))
    print(datasets.__version__)


if __name__ == "__main__":
    main()

"""Writes a manifest's images as Hugging Face parquet with ``datasets``' own ``to_parquet``
(an ``Image`` feature and a ``ClassLabel``), as the hub lays it out: one
``data/{split}-{i:05d}-of-{n:05d}.parquet`` per shard. Run under the writers venv
(``make writers``), never imported by the suite.

With ``--legacy``, the layout ``datasets`` wrote before 4.6: its own to_parquet, but with
pyarrow's defaults for every column (snappy, dictionary pages), not PLAIN uncompressed
images.

Usage: hf_parquet.py MANIFEST OUT [--shards N] [--no-paths] [--legacy]"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import datasets
import datasets.io.parquet


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("manifest", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--shards", type=int, default=1)
    parser.add_argument("--no-paths", action="store_true", help="store image.path as None")
    parser.add_argument("--legacy", action="store_true", help="pyarrow's defaults")
    args = parser.parse_args()
    if args.legacy:  # datasets < 4.6 passed no per-column options to pyarrow
        datasets.io.parquet.get_parquet_column_options = lambda features, schema: {}
    manifest = json.loads(args.manifest.read_text())
    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=manifest["classes"])}
    )
    for split, items in manifest["splits"].items():
        columns = {
            "image": [
                {
                    "bytes": Path(item["file"]).read_bytes(),
                    "path": None if args.no_paths else item["name"],
                }
                for item in items
            ],
            "label": [item["label"] for item in items],
        }
        dataset = datasets.Dataset.from_dict(columns, features=features)
        for index in range(args.shards):
            name = f"data/{split}-{index:05d}-of-{args.shards:05d}.parquet"
            (args.out / name).parent.mkdir(parents=True, exist_ok=True)
            part = dataset.shard(args.shards, index, contiguous=True)
            part.to_parquet(str(args.out / name))
    print(datasets.__version__)


if __name__ == "__main__":
    main()

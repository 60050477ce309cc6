"""Writes a manifest's images with pyarrow's defaults (snappy, dictionary pages) and small
row groups: the layout older ``datasets`` wrote, whose image pages must be decoded. Run
under the writers venv (``make writers``).

Usage: pyarrow_parquet.py MANIFEST OUT [--row-group-size N]"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("manifest", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--row-group-size", type=int, default=10)
    args = parser.parse_args()
    manifest = json.loads(args.manifest.read_text())
    for split, items in manifest["splits"].items():
        images = [{"bytes": Path(i["file"]).read_bytes(), "path": i["name"]} for i in items]
        table = pa.table({"image": images, "label": [item["label"] for item in items]})
        name = args.out / f"data/{split}-00000-of-00001.parquet"
        name.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, name, compression="snappy", row_group_size=args.row_group_size)
    print(pa.__version__)


if __name__ == "__main__":
    main()

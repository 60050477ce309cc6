"""Writes a manifest's images with pyarrow's ``write_table``: by default its own defaults
(snappy, dictionary pages) and small row groups, the layout older ``datasets`` wrote,
whose image pages must be decoded; the options choose another codec, no dictionary, a
data page version and small pages. With ``--hf`` the footer carries ``datasets``'
``huggingface`` features (an Image and the manifest's ClassLabel). Run under the writers
venv (``make writers``).

Usage: pyarrow_parquet.py MANIFEST OUT [--row-group-size N] [--compression C]
       [--no-dictionary] [--data-page-version 1.0|2.0] [--data-page-size BYTES]
       [--dictionary-pagesize-limit BYTES] [--write-batch-size ROWS] [--page-index] [--hf]"""

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
    parser.add_argument("--compression", default="snappy")
    parser.add_argument("--no-dictionary", action="store_true")
    parser.add_argument("--data-page-version", default="1.0")
    parser.add_argument("--data-page-size", type=int, default=None)
    parser.add_argument("--dictionary-pagesize-limit", type=int, default=None)
    parser.add_argument("--write-batch-size", type=int, default=None, help="rows a page check")
    parser.add_argument("--hf", action="store_true", help="write the huggingface features")
    parser.add_argument("--page-index", action="store_true", help="write the page index")
    args = parser.parse_args()
    manifest = json.loads(args.manifest.read_text())
    features = {
        "image": {"_type": "Image"},
        "label": {"names": manifest["classes"], "_type": "ClassLabel"},
    }
    metadata = {"huggingface": json.dumps({"info": {"features": features}})} if args.hf else {}
    for split, items in manifest["splits"].items():
        images = [{"bytes": Path(i["file"]).read_bytes(), "path": i["name"]} for i in items]
        table = pa.table({"image": images, "label": [item["label"] for item in items]})
        table = table.replace_schema_metadata(metadata)
        name = args.out / f"data/{split}-00000-of-00001.parquet"
        name.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(
            table,
            name,
            compression=args.compression,
            use_dictionary=not args.no_dictionary,
            row_group_size=args.row_group_size,
            data_page_version=args.data_page_version,
            data_page_size=args.data_page_size,
            dictionary_pagesize_limit=args.dictionary_pagesize_limit,
            write_batch_size=args.write_batch_size,
            write_page_index=args.page_index,
        )
    print(pa.__version__)


if __name__ == "__main__":
    main()

"""Writes a manifest's images with mosaicml-streaming's own ``MDSWriter``: a ``jpeg``
column (the source files' bytes, which the encoder stores as they are) and an ``int``
label, one folder per split, plain or zstd. Run under the writers venv (``make writers``).

Usage: mds.py MANIFEST OUT [--compression zstd] [--size-limit BYTES] [--encoding jpeg|bytes]"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from PIL import Image
from streaming import MDSWriter


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("manifest", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--compression", default=None)
    parser.add_argument("--size-limit", type=int, default=1 << 20)
    parser.add_argument("--encoding", default="jpeg", choices=["jpeg", "bytes"])
    args = parser.parse_args()
    manifest = json.loads(args.manifest.read_text())
    columns = {"image": args.encoding, "label": "int"}
    for split, items in manifest["splits"].items():
        out = str(args.out / split)
        with MDSWriter(
            out=out, columns=columns, compression=args.compression, size_limit=args.size_limit
        ) as writer:
            for item in items:
                if args.encoding == "jpeg":
                    image: object = Image.open(item["file"])  # JPEG reads the file verbatim
                else:
                    image = Path(item["file"]).read_bytes()
                writer.write({"image": image, "label": item["label"]})


if __name__ == "__main__":
    main()

"""Measure ranged-GET latency and throughput per block size against a local moto S3 server.

Used to choose the default cache block size (docs/design.md records the result).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from support.s3 import S3Server


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--object-mb", type=int, default=256)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument(
        "--sizes-kb", type=int, nargs="+", default=[256, 1024, 2048, 4096, 8192, 16384]
    )
    args = parser.parse_args()
    results = []
    with S3Server() as server:
        server.create_bucket("bench")
        fs = server.filesystem()
        size = args.object_mb << 20
        fs.pipe_file("bench/object.tar", os.urandom(size))
        for streams in args.streams:
            for block_kb in args.sizes_kb:
                block = block_kb << 10
                offsets = list(range(0, size - block + 1, block))[
                    : max(8, 64 // max(1, block_kb // 1024))
                ]
                latencies: list[float] = []

                def get(offset: int, block: int = block, latencies: list[float] = latencies) -> int:
                    started = time.perf_counter()
                    data = fs.cat_file("bench/object.tar", start=offset, end=offset + block)
                    latencies.append(time.perf_counter() - started)
                    return len(data)

                started = time.perf_counter()
                with ThreadPoolExecutor(streams) as pool:
                    total = sum(pool.map(get, offsets))
                seconds = time.perf_counter() - started
                row = {
                    "streams": streams,
                    "block_kib": block_kb,
                    "median_get_ms": 1000 * statistics.median(latencies),
                    "mb_per_s": total / seconds / 1e6,
                }
                results.append(row)
                print(json.dumps(row), flush=True)
    print("| streams | block | median GET | MB/s |\n|---|---|---|---|")
    for row in results:
        print(
            f"| {row['streams']} | {row['block_kib']} KiB | {row['median_get_ms']:.0f} ms "
            f"| {row['mb_per_s']:.0f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""CPU per ranged GET of one file: the daemon's range path against the least a client does.

A file fetched ahead as a range (uniform mode through a small cache) or read as one (plain
``shuffle=True`` there) costs the daemon one GET. This measures, on one thread, the CPU of
``Store.fetch`` for such a GET (presigned URL, the lean HTTP client, the answer's checks,
the counters) and of the same GETs sent over one kept-alive socket by a dozen lines of
Python that check nothing (the floor: the bytes received and the request's one round trip).
moto runs on the store's core (``bench/pinning.py``), this process on the others; the two
alternate per round, and each figure is the median over rounds of CPU (``thread_time``,
and user / system from ``RUSAGE_THREAD``) per GET.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import socket
import statistics
import sys
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from pinning import Pinning  # noqa: E402
from procs import start_store  # noqa: E402
from support.s3 import S3Server  # noqa: E402

from shardfs.config import SourceConfig  # noqa: E402
from shardfs.stats import Stats  # noqa: E402
from shardfs.store.remote import Store  # noqa: E402

BUCKET = "getcost"
OBJECT_BYTES = 8 << 20


def _cpu() -> tuple[float, float, float]:
    usage = resource.getrusage(resource.RUSAGE_THREAD)
    return time.thread_time(), usage.ru_utime, usage.ru_stime


def _per_get(run: Callable[[], None], gets: int) -> dict[str, float]:
    before, started = _cpu(), time.perf_counter()
    run()
    after, wall = _cpu(), time.perf_counter() - started
    cpu, user, system = ((b - a) / gets * 1e6 for a, b in zip(before, after, strict=True))
    return {"cpu_us": cpu, "user_us": user, "sys_us": system, "wall_us": wall / gets * 1e6}


def _raw_gets(url: str, ranges: list[tuple[int, int]]) -> Callable[[], None]:
    """The same GETs over one kept-alive socket: send, read the head a line at a time, the
    body into a buffer."""
    split = urllib.parse.urlsplit(url)
    host, port = split.hostname or "127.0.0.1", split.port or 80
    target = f"{split.path}?{split.query}"
    buffer = bytearray(max(end - start for start, end in ranges))

    def run() -> None:
        with socket.create_connection((host, port)) as sock, sock.makefile("rb") as file:
            for start, end in ranges:
                request = f"GET {target} HTTP/1.1\r\nHost: {host}:{port}\r\n"
                sock.sendall(f"{request}Range: bytes={start}-{end - 1}\r\n\r\n".encode())
                length = 0
                while (line := file.readline()) != b"\r\n":
                    if line[:15].lower() == b"content-length:":
                        length = int(line[15:])
                file.readinto(memoryview(buffer)[:length])

    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gets", type=int, default=1500, help="GETs per round (1500)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (5)")
    parser.add_argument("--file-bytes", type=int, default=100_000, help="bytes per GET")
    parser.add_argument("--out", type=Path, default=ROOT / "results")
    args = parser.parse_args(argv)
    server, pinning = S3Server(), Pinning.split()
    pinning.pin_self_to_readers()
    start_store(server, pinning)
    try:
        server.create_bucket(BUCKET)
        data = random.Random(0).randbytes(OBJECT_BYTES)
        server.filesystem().pipe_file(f"{BUCKET}/p/a.tar", data)
        options = {"key": "testing", "secret": "testing"}
        store = Store(
            SourceConfig(f"s3://{BUCKET}/p", storage_options=options, endpoint_url=server.endpoint),
            Stats(),
        )
        (shard,) = store.list_shards()
        url = str(store.fs.url(f"{BUCKET}/p/a.tar", expires=3600))
        rng = random.Random(1)
        size = args.file_bytes
        ranges = [
            (at, at + size) for at in (rng.randrange(OBJECT_BYTES - size) for _ in range(args.gets))
        ]
        for start, end in ranges[:20]:  # connections, the presigned URL, the imports
            got = store.fetch(shard, start, end, end - start)
            assert bytes(got.pieces[0]) == data[start:end], "Store.fetch gave other bytes"

        def fetches() -> None:
            for start, end in ranges:
                store.fetch(shard, start, end, end - start)

        rounds: list[dict[str, dict[str, float]]] = []
        for number in range(args.rounds):
            rounds.append({
                "store_fetch": _per_get(fetches, len(ranges)),
                "floor": _per_get(_raw_gets(url, ranges), len(ranges)),
            })  # fmt: skip
            print(f"get-cost: round {number}: {json.dumps(rounds[-1])}", flush=True)
    finally:
        server.stop()
    medians = {
        way: {key: statistics.median(r[way][key] for r in rounds) for key in rounds[0][way]}
        for way in rounds[0]
    }
    extra = medians["store_fetch"]["cpu_us"] - medians["floor"]["cpu_us"]
    lines = [
        f"CPU per ranged GET of {size:,} bytes on one thread ({pinning.label()}), medians "
        f"of {args.rounds} rounds of {args.gets} GETs, us:",
        "",
        "| client | CPU | user | system | wall |",
        "|---|---|---|---|---|",
        *(
            f"| {way} | {m['cpu_us']:.0f} | {m['user_us']:.0f} | {m['sys_us']:.0f} "
            f"| {m['wall_us']:.0f} |"
            for way, m in medians.items()
        ),
        "",
        f"`Store.fetch` costs {extra:.0f} us of CPU per GET beyond the floor.",
        "",
        f"Command: `bench/get_cost.py {' '.join(sys.argv[1:] if argv is None else argv)}`",
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "get_cost.json").write_text(json.dumps({"rounds": rounds, "medians": medians}))
    (args.out / "get_cost.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

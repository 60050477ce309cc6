"""`make bench-figures`: the README's figures that `make bench` does not produce.

On the bench's JPEG tree (bench/data.py, 5,000 images by default, page-cached first) and
moto's S3 server behind the counting middleware, each measured ``--rounds`` times:

- ``shardfs pack`` of the tree into a local folder and into S3 (webdataset format, about
  12 shards), against ``tar -cf`` of the tree into one file and ``cp -r`` of it;
- a cold read of every file in a shuffled order by 2 threads through a fresh mount (tree
  listed first, raw bytes), with ``--miss-fetch block`` and ``--miss-fetch range``: seconds
  and GETs counted at the server; the first block round also samples bytes fetched (the
  daemon's counter) and files read every 0.2 s, the cold-read timeline;
- the ioctl every Python ``open()`` sends (``isatty``): microseconds per call on a file of
  the mount and on the same file on local disk;
- the HEAD check of a brace pattern over HTTP: ``HEAD_SHARDS`` one-member tars served by
  ``python -m http.server`` on loopback, named by ``{000..999}``, listed by ``Store``.

The paired warm ratio is not here: ``make bench`` measures it (bench/run.py, paired
targets). Writes results/figures.json and results/figures.md (``--out``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from data import ensure_tree  # noqa: E402
from procs import force_unmount, run_to_the_end  # noqa: E402
from procs import shardfs_cli as shardfs  # noqa: E402
from support.s3 import S3Server, settled_counts  # noqa: E402

BUCKET = "figures"
PREFIX = "data/train"
READERS = 2  # threads of the cold read, as in docs/design.md
TIMELINE_EVERY = 0.2  # seconds between samples of the cold-read timeline
ISATTY_CALLS = 20_000
HEAD_SHARDS = 1000


def log(text: str) -> None:
    print(f"bench-figures: {text}", file=sys.stderr, flush=True)


def timed(command: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True)
    return time.perf_counter() - started


def read_all(paths: list[Path]) -> int:
    """Read every file once (puts a local tree in the page cache); the bytes read."""
    total = 0
    for path in paths:
        total += len(path.read_bytes())
    return total


def isatty_us(path: Path, calls: int = ISATTY_CALLS) -> float:
    """Microseconds per ``isatty`` (a TCGETS ioctl) on an open file of ``path``."""
    fd = os.open(path, os.O_RDONLY)
    try:
        started = time.perf_counter()
        for _ in range(calls):
            os.isatty(fd)
        return (time.perf_counter() - started) / calls * 1e6
    finally:
        os.close(fd)


class Timeline:
    """Bytes the daemon fetched and files read, sampled every ``TIMELINE_EVERY`` s."""

    def __init__(self, mountpoint: Path, files_read: list[int]) -> None:
        self.mountpoint, self.files_read = mountpoint, files_read
        self.samples: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="timeline", daemon=True)

    def _sample(self) -> None:
        from shardfs.mount.control import query

        fetched = query(self.mountpoint)["bytes_fetched"] - self._base
        self.samples.append(
            {
                "s": time.perf_counter() - self._started,
                "fetched_mb": fetched / 1e6,
                "files_read": self.files_read[0],
            }
        )

    def _poll(self) -> None:
        while not self._stop.wait(TIMELINE_EVERY):
            self._sample()

    def __enter__(self) -> Timeline:
        from shardfs.mount.control import query

        self._base = query(self.mountpoint)["bytes_fetched"]
        self._started = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()  # the end of the read


class Figures:
    """Holds the server and whatever is mounted, so cleanup can find them."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.run_dir = args.work.absolute() / "figures-run"
        self.server = S3Server()
        self.mounts: set[Path] = set()

    def cleanup(self) -> None:
        for mountpoint in list(self.mounts):
            force_unmount(mountpoint)
        self.server.stop()

    def setup(self) -> None:
        shutil.rmtree(self.run_dir, ignore_errors=True)
        self.run_dir.mkdir(parents=True)
        self.tree = ensure_tree(self.args.work.absolute(), self.args.images, 12, log)
        self.files = sorted(p for p in self.tree.root.rglob("*") if p.is_file())
        self.server.start()
        os.environ.update(self.server.env())
        self.server.create_bucket(BUCKET)
        self.shard_size = str(max(1 << 20, self.tree.image_bytes // 12))

    # -- packing -----------------------------------------------------------------

    def pack_round(self, number: int) -> dict[str, float]:
        read_all(self.files)  # page-cached, as the README states
        out = self.run_dir / "packed"
        shutil.rmtree(out, ignore_errors=True)
        pack = [sys.executable, "-m", "shardfs", "pack", str(self.tree.root)]
        options = ["--format", "webdataset", "--shard-size", self.shard_size]
        options += ["--shuffle-seed", "0", "--cache-dir", str(self.run_dir / "pack-cache")]
        local_s = timed([*pack, str(out), *options])
        shutil.rmtree(out, ignore_errors=True)
        target = f"s3://{BUCKET}/{PREFIX}" if number == 0 else f"s3://{BUCKET}/again{number}"
        s3_s = timed([*pack, target, *options])
        tar_file = self.run_dir / "tree.tar"
        tar_s = timed(["tar", "-cf", str(tar_file), "-C", str(self.tree.root), "."])
        tar_file.unlink()
        copy = self.run_dir / "copy"
        cp_s = timed(["cp", "-r", str(self.tree.root), str(copy)])
        shutil.rmtree(copy)
        return {"pack_local_s": local_s, "pack_s3_s": s3_s, "tar_s": tar_s, "cp_s": cp_s}

    # -- a cold read through a mount ---------------------------------------------------

    @contextmanager
    def mount(self, *options: str) -> Iterator[Path]:
        mnt, cache = self.run_dir / "mnt", self.run_dir / "cache"
        shutil.rmtree(cache, ignore_errors=True)
        mnt.mkdir(exist_ok=True)
        self.mounts.add(mnt)
        shardfs("mount", f"s3://{BUCKET}/{PREFIX}", str(mnt), "--cache-dir", str(cache),
                *options)  # fmt: skip
        try:
            yield mnt
        finally:
            shardfs("umount", str(mnt))
            self.mounts.discard(mnt)
            shutil.rmtree(cache, ignore_errors=True)

    def cold_read(self, miss_fetch: str, seed: int, timeline: bool) -> dict[str, Any]:
        """Every file once, shuffled, by ``READERS`` threads, on a fresh cache; the tree is
        listed first (as ImageFolder does), so kernel pushes apply."""
        with self.mount("--miss-fetch", miss_fetch) as mnt:
            paths = sorted(
                Path(folder) / name for folder, _, names in os.walk(mnt) for name in names
            )
            random.Random(seed).shuffle(paths)
            files_read = [0]
            lock = threading.Lock()

            def read(path: Path) -> int:
                size = len(path.read_bytes())
                with lock:
                    files_read[0] += 1
                return size

            settled_counts(self.server)
            self.server.reset_counts()
            sampler = Timeline(mnt, files_read) if timeline else None
            started = time.perf_counter()
            with sampler or contextlib.nullcontext():
                with ThreadPoolExecutor(READERS) as pool:
                    got = sum(pool.map(read, paths))
                seconds = time.perf_counter() - started
            counts = settled_counts(self.server)
            record: dict[str, Any] = {
                "miss_fetch": miss_fetch,
                "files": len(paths),
                "bytes": got,
                "seconds": seconds,
                "gets": counts["get_object_requests"],
                "egress_bytes": counts["get_object_bytes"],
            }
            if sampler is not None:
                record["timeline"] = sampler.samples
            if timeline:
                # The warm mount: the ioctl Python's open() sends, against local disk.
                record["isatty_mount_us"] = isatty_us(paths[0])
                record["isatty_local_us"] = isatty_us(self.files[0])
            return record

    # -- a brace pattern over HTTP ------------------------------------------------------

    def head_check(self) -> float:
        """Seconds for ``Store.list_shards`` of ``HEAD_SHARDS`` shards named by a brace
        pattern over HTTP (one HEAD per shard, no listing)."""
        import socket
        import tarfile
        import urllib.request

        from shardfs.config import SourceConfig
        from shardfs.store.remote import Store

        folder = self.run_dir / "http-shards"
        if not folder.exists():
            folder.mkdir()
            for number in range(HEAD_SHARDS):
                with tarfile.open(folder / f"s-{number:03d}.tar", "w") as tar:
                    tar.addfile(tarfile.TarInfo(f"{number}.txt"))
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        server = subprocess.Popen(
            [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port),
             "--directory", str(folder)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            url = f"http://127.0.0.1:{port}/s-000.tar"
            deadline = time.monotonic() + 30
            while True:
                try:
                    urllib.request.urlopen(url, timeout=1).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            last = HEAD_SHARDS - 1
            pattern = f"http://127.0.0.1:{port}/s-{{000..{last:03d}}}.tar"
            started = time.perf_counter()
            shards = Store(SourceConfig(url=pattern)).list_shards()
            seconds = time.perf_counter() - started
            if len(shards) != HEAD_SHARDS:
                raise RuntimeError(f"listed {len(shards)} shards, expected {HEAD_SHARDS}")
            return seconds
        finally:
            server.terminate()
            server.wait()

    # -- the whole run -----------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        started = time.perf_counter()
        self.setup()
        packs, reads = [], []
        for number in range(self.args.rounds):
            packs.append(self.pack_round(number))
            log("pack: " + ", ".join(f"{k} {v:.2f}" for k, v in packs[-1].items()))
            for miss_fetch in ("block", "range") if number % 2 == 0 else ("range", "block"):
                first = number == 0 and miss_fetch == "block"
                reads.append(self.cold_read(miss_fetch, number, timeline=first))
                log(
                    f"cold read, --miss-fetch {miss_fetch}: {reads[-1]['seconds']:.2f} s, "
                    f"{reads[-1]['gets']} GETs"
                )
        heads = [self.head_check() for _ in range(self.args.rounds)]
        log(f"HEAD check of {HEAD_SHARDS} shards: " + ", ".join(f"{h:.2f} s" for h in heads))
        return {
            "head_check_s": heads,
            "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            "dataset": {
                "images": self.tree.images,
                "image_bytes": self.tree.image_bytes,
                "files_bytes": sum(p.stat().st_size for p in self.files),
            },
            "packs": packs,
            "cold_reads": reads,
            "total_s": time.perf_counter() - started,
        }


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """Medians over rounds of every figure the README states."""
    tree_bytes = result["dataset"]["image_bytes"]
    packs = result["packs"]

    def med(key: str) -> float:
        return float(statistics.median(p[key] for p in packs))

    figures: dict[str, Any] = {
        "pack_local_s": med("pack_local_s"),
        "pack_local_mb_per_s": tree_bytes / med("pack_local_s") / 1e6,
        "pack_s3_s": med("pack_s3_s"),
        "pack_s3_mb_per_s": tree_bytes / med("pack_s3_s") / 1e6,
        "tar_cf_s": med("tar_s"),
        "cp_r_s": med("cp_s"),
    }
    for policy in ("block", "range"):
        runs = [r for r in result["cold_reads"] if r["miss_fetch"] == policy]
        figures[f"cold_read_{policy}_s"] = [r["seconds"] for r in runs]
        figures[f"cold_read_{policy}_gets"] = statistics.median(r["gets"] for r in runs)
    block = statistics.median(figures["cold_read_block_s"])
    figures["range_over_block"] = statistics.median(figures["cold_read_range_s"]) / block
    figures["head_check_s"] = statistics.median(result["head_check_s"])
    first = next(r for r in result["cold_reads"] if "timeline" in r)
    figures["timeline"] = first["timeline"]
    figures["isatty_mount_us"] = first["isatty_mount_us"]
    figures["isatty_local_us"] = first["isatty_local_us"]
    return figures


def markdown(result: dict[str, Any], figures: dict[str, Any]) -> str:
    data = result["dataset"]
    files = data["images"]
    lines = [
        f"Figures (`make bench-figures`): {files} JPEGs, {data['image_bytes'] / 2**20:.0f} "
        f"MiB, page-cached; moto S3 on loopback; medians of {len(result['packs'])} rounds.",
        "",
        "| figure | measured |",
        "|---|---|",
        f"| `shardfs pack` into a local folder | {figures['pack_local_s']:.2f} s "
        f"({figures['pack_local_mb_per_s']:.0f} MB/s) |",
        f"| `shardfs pack` into S3 (moto) | {figures['pack_s3_s']:.2f} s "
        f"({figures['pack_s3_mb_per_s']:.0f} MB/s) |",
        f"| `tar -cf` of the tree | {figures['tar_cf_s']:.2f} s |",
        f"| `cp -r` of the tree | {figures['cp_r_s']:.2f} s |",
    ]
    for policy in ("block", "range"):
        seconds = ", ".join(f"{s:.1f} s" for s in figures[f"cold_read_{policy}_s"])
        lines.append(
            f"| cold read of all files, shuffled, {READERS} threads, `--miss-fetch {policy}` "
            f"| {seconds}; {figures[f'cold_read_{policy}_gets']:.0f} GETs |"
        )
    lines += [
        f"| `range` / `block` cold read time | {figures['range_over_block']:.2f} |",
        f"| `isatty` on the mount / on local disk | {figures['isatty_mount_us']:.1f} µs / "
        f"{figures['isatty_local_us']:.2f} µs |",
        f"| HEAD check of {HEAD_SHARDS:,} shards named by a brace pattern over HTTP "
        f"(`python -m http.server`) | {figures['head_check_s']:.2f} s |",
        "",
        "Cold-read timeline (`--miss-fetch block`, first round; bytes the daemon fetched and "
        f"files read, every {TIMELINE_EVERY} s):",
        "",
    ]
    timeline = figures["timeline"]
    lines += [
        "| time | " + " | ".join(f"{s['s']:.1f} s" for s in timeline) + " |",
        "|---|" + "---|" * len(timeline),
        "| fetched | " + " | ".join(f"{s['fetched_mb']:.0f} MB" for s in timeline) + " |",
        "| files read | "
        + " | ".join(f"{s['files_read']:,.0f}" for s in timeline)
        + f" (of {files:,}) |",
        "",
        "The paired warm ratio is measured by `make bench` (results/bench.md, paired targets).",
        "",
        f"Command: `{result['command']}` ({result['total_s'] / 60:.1f} min).",
    ]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=5000, help="images (5000)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every figure (3)")
    parser.add_argument(
        "--work", type=Path, default=ROOT / "results" / "tmp", help="work folder (results/tmp)"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "results")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run_to_the_end(Figures(args), log)
    if result is None:
        return 130
    figures = summary(result)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "figures.json").write_text(
        json.dumps({**result, "figures": figures}, indent=2) + "\n"
    )
    table = markdown(result, figures)
    (args.out / "figures.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())

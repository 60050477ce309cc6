"""``make soak``: one mount read for many epochs through a store that keeps misbehaving.

A moto S3 server holds a generated dataset; shardfs mounts it through the fault proxy
(tests/support/fault_proxy.py), which injects random transient faults (5xx, 429, resets,
truncated bodies, short/long/shifted 206s, stalls) at ``--fault-rate`` per GET from the
index scan on. Each epoch reads every file in a random order from several threads and
checks its SHA-256; some epochs first run ``shardfs cache clear`` while mounted, so the
reads go back to the store. Files are opened with O_DIRECT, so every read reaches the
daemon rather than the kernel's page cache.

Per epoch it records the daemon's RSS, open fds and threads (/proc/PID), wrong files and
errors; writes results/soak.json and prints a table. Exits 1 if any file was read with
wrong bytes, or if RSS or open fds grew more than 10% over the last half of the epochs
(median of its first three epochs against median of the last three; fds need a growth of
more than 2 as well, since pooled connections come and go).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from procs import force_unmount  # noqa: E402
from support.datagen import FIXED_MTIME, pack_with_gnu_tar  # noqa: E402
from support.fault_proxy import FaultProxy  # noqa: E402
from support.s3 import S3Server  # noqa: E402

from shardfs.mount.control import pid_file  # noqa: E402

BUCKET = "soak"
PREFIX = "train"
GROWTH_LIMIT = 0.10
FD_SLACK = 2
EPOCH_DEADLINE_S = 300.0
# Transient faults and their share of the fault rate; each is a rule with its own seed.
FAULT_MIX: list[tuple[str, dict[str, Any]]] = [
    ("status", {"status": 503}),
    ("status", {"status": 500}),
    ("status", {"status": 429}),
    ("reset", {"fraction": 0.5}),
    ("truncate", {"fraction": 0.5}),
    ("short_206", {"fraction": 0.5}),
    ("long_206", {"shift": 4096}),
    ("shifted_range", {"shift": 4096}),
    ("wrong_content_range", {"shift": 4096}),
    ("stall", {"seconds": 0.3, "where": "body"}),
]


def log(text: str) -> None:
    print(f"soak: {text}", file=sys.stderr, flush=True)


def shardfs(
    *args: str | Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shardfs", *map(str, args)],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, **(env or {})},
        timeout=600,
    )


def make_dataset(work: Path, files: int, seed: int) -> dict[str, str]:
    """Random files of 20-80 KB in shards of 50; returns {path: sha256}."""
    src = work / "src"
    rng = random.Random(seed)
    sha = {}
    for number in range(files):
        rel = f"class_{number % 10}/file_{number:05d}.bin"
        path = src / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        data = rng.randbytes(rng.randrange(20_000, 80_000))
        path.write_bytes(data)
        os.utime(path, (FIXED_MTIME, FIXED_MTIME))
        sha[rel] = hashlib.sha256(data).hexdigest()
    pack_with_gnu_tar(src, work / "shards", files_per_shard=50)
    return sha


def daemon_stats(mountpoint: Path) -> dict[str, int]:
    """The mount's own counters (``shardfs stats --json``); empty if it cannot say."""
    result = shardfs("stats", mountpoint, "--json")
    if result.returncode != 0:
        return {}
    with contextlib.suppress(ValueError):
        values = json.loads(result.stdout)
        return {k: int(v) for k, v in values.items() if isinstance(v, int)}
    return {}


def proc_numbers(pid: int) -> dict[str, float]:
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    fields = dict(line.split(":", 1) for line in status if ":" in line)
    return {
        "rss_mb": round(int(fields["VmRSS"].split()[0]) / 1024, 1),
        "threads": int(fields["Threads"]),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
    }


def read_epoch(
    mountpoint: Path, sha: dict[str, str], threads: int, seed: int
) -> tuple[int, dict[str, int], int]:
    """(wrong files, {errno name: count}, bytes read) for one pass over every file."""
    order = sorted(sha)
    random.Random(seed).shuffle(order)

    def one(rel: str) -> tuple[str, str | int, int]:
        path = mountpoint / rel
        try:
            # O_DIRECT: FUSE then sends every read to the daemon, past the page cache.
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            try:
                chunks = []
                while chunk := os.read(fd, 1 << 20):
                    chunks.append(chunk)
            finally:
                os.close(fd)
        except OSError as exc:
            return rel, exc.errno or -1, 0
        data = b"".join(chunks)
        return rel, hashlib.sha256(data).hexdigest(), len(data)

    pool = ThreadPoolExecutor(threads)
    futures = [pool.submit(one, rel) for rel in order]
    _, pending = wait_futures(futures, timeout=EPOCH_DEADLINE_S)
    pool.shutdown(wait=False, cancel_futures=True)
    if pending:
        raise RuntimeError(f"{len(pending)} reads still hang after {EPOCH_DEADLINE_S:.0f} s")
    wrong, errors, total = 0, {}, 0
    for future in futures:
        rel, got, size = future.result()
        total += size
        if isinstance(got, int):
            name = errno.errorcode.get(got, str(got))
            errors[name] = errors.get(name, 0) + 1
        elif got != sha[rel]:
            wrong += 1
    return wrong, errors, total


def growth(values: list[float]) -> float:
    """Growth over the last half: median of its first three epochs against its last three."""
    half = values[len(values) // 2 :]
    if len(half) < 2:
        return 0.0
    head = statistics.median(half[:3])
    tail = statistics.median(half[-3:])
    return (tail - head) / head if head else 0.0


def print_table(rows: list[dict[str, Any]]) -> None:
    header = (
        f"{'epoch':>5} {'clear':>5} {'sec':>6} {'MB/s':>6} {'rss_mb':>7} {'fds':>4} "
        f"{'thr':>4} {'GETs':>5} {'faults':>6} {'wrong':>5}  errors"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        errors = ", ".join(f"{k}={v}" for k, v in sorted(row["errors"].items())) or "-"
        print(
            f"{row['epoch']:>5} {'yes' if row['cache_cleared'] else '':>5} "
            f"{row['seconds']:>6.1f} {row['mb_per_s']:>6.1f} {row['rss_mb']:>7.1f} "
            f"{row['fds']:>4} {row['threads']:>4} {row['daemon_store_requests']:>5} "
            f"{row['faults_injected']:>6} "
            f"{row['wrong_files']:>5}  {errors}"
        )


def run(args: argparse.Namespace) -> int:
    work = Path(tempfile.mkdtemp(prefix="shardfs-soak-"))
    mountpoint = work / "mnt"
    mountpoint.mkdir()
    cache_dir = work / "cache"
    rows: list[dict[str, Any]] = []
    with S3Server() as server, FaultProxy(server) as proxy:
        sha = make_dataset(work, args.files, args.seed)
        server.create_bucket(BUCKET)
        server.upload_dir(work / "shards", f"{BUCKET}/{PREFIX}")
        dataset_mb = sum(p.stat().st_size for p in (work / "shards").iterdir()) / 1e6
        log(f"{len(sha)} files, {dataset_mb:.1f} MB in shards; fault rate {args.fault_rate}")
        for number, (fault, fields) in enumerate(FAULT_MIX):
            proxy.add(
                fault,
                key=".tar",
                times=None,
                probability=args.fault_rate / len(FAULT_MIX),
                seed=args.seed * 100 + number,
                **fields,
            )
        proxy.set_phase("scan")
        began = time.monotonic()
        mounted = shardfs(
            "mount",
            f"s3://{BUCKET}/{PREFIX}/",
            mountpoint,
            "--cache-dir",
            cache_dir,
            "--endpoint-url",
            proxy.endpoint,
            "--block-size",
            args.block_size,
            "--cache-size",
            args.cache_size,
            env=proxy.env(),
        )
        proxy.set_phase("read")
        if mounted.returncode != 0:
            log(f"mount failed: {mounted.stderr.strip()}")
            summary = {"mount_error": mounted.stderr.strip(), "epochs": []}
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
            return 1
        log(f"mounted through the fault proxy in {time.monotonic() - began:.1f} s")
        pid = int(pid_file(mountpoint).read_text().split()[0])
        try:
            for epoch in range(args.epochs):
                cleared = args.clear_every > 0 and epoch % args.clear_every == args.clear_every - 1
                if cleared:
                    result = shardfs("cache", "clear", "--cache-dir", cache_dir)
                    if result.returncode != 0:
                        raise RuntimeError(f"cache clear failed: {result.stderr.strip()}")
                stats_before = daemon_stats(mountpoint)
                before = proxy.counts()["injected_total"]
                began = time.monotonic()
                wrong, errors, total = read_epoch(
                    mountpoint, sha, args.threads, args.seed * 1000 + epoch
                )
                seconds = time.monotonic() - began
                row = {
                    "epoch": epoch,
                    "cache_cleared": cleared,
                    "seconds": round(seconds, 2),
                    "mb_per_s": round(total / 1e6 / seconds, 1) if seconds else 0.0,
                    "wrong_files": wrong,
                    "errors": errors,
                    "faults_injected": proxy.counts()["injected_total"] - before,
                    **{
                        f"daemon_{name}": daemon_stats(mountpoint).get(name, 0)
                        - stats_before.get(name, 0)
                        for name in ("bytes_served", "store_requests", "bytes_fetched")
                    },
                    **proc_numbers(pid),
                }
                rows.append(row)
                log(
                    f"epoch {epoch}: {seconds:.1f} s, rss {row['rss_mb']} MB, fds {row['fds']}, "
                    f"threads {row['threads']}, wrong {wrong}, errors {errors or 0}"
                )
        finally:
            result = shardfs("umount", mountpoint)
            if result.returncode != 0:
                force_unmount(mountpoint)
            counts = proxy.counts()
    rss_growth = growth([r["rss_mb"] for r in rows])
    fd_values = [float(r["fds"]) for r in rows]
    fd_growth = growth(fd_values)
    half = fd_values[len(fd_values) // 2 :]
    fd_delta = statistics.median(half[-3:]) - statistics.median(half[:3]) if half else 0.0
    wrong_total = sum(r["wrong_files"] for r in rows)
    error_total = sum(sum(r["errors"].values()) for r in rows)
    problems = []
    if wrong_total:
        problems.append(f"{wrong_total} file reads returned wrong bytes")
    if rss_growth > GROWTH_LIMIT:
        problems.append(f"daemon RSS grew {rss_growth:.0%} over the last half")
    if fd_growth > GROWTH_LIMIT and fd_delta > FD_SLACK:
        problems.append(f"daemon open fds grew {fd_growth:.0%} over the last half")
    summary = {
        "epochs": rows,
        "files": len(sha),
        "dataset_mb": round(dataset_mb, 1),
        "fault_rate": args.fault_rate,
        "threads": args.threads,
        "block_size": args.block_size,
        "cache_size": args.cache_size,
        "faults_injected": counts["injected"],
        "requests_forwarded": counts["forwarded"],
        "wrong_files": wrong_total,
        "read_errors": error_total,
        "rss_growth_last_half": round(rss_growth, 3),
        "fd_growth_last_half": round(fd_growth, 3),
        "problems": problems,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    print_table(rows)
    print(
        f"\n{len(rows)} epochs x {len(sha)} files; faults injected {counts['injected_total']} "
        f"of {counts['injected_total'] + counts['forwarded']} requests; wrong files "
        f"{wrong_total}; read errors {error_total}; RSS growth {rss_growth:+.1%}, fd growth "
        f"{fd_growth:+.1%} over the last half; written to {args.out}"
    )
    for problem in problems:
        print(f"FAIL: {problem}")
    with contextlib.suppress(OSError):
        import shutil

        shutil.rmtree(work)
    return 1 if problems else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--epochs",
        type=int,
        default=int(os.environ.get("SOAK_EPOCHS", "30")),
        help="passes over the dataset (default: $SOAK_EPOCHS or 30)",
    )
    parser.add_argument("--files", type=int, default=300, help="files in the dataset")
    parser.add_argument("--threads", type=int, default=8, help="concurrent readers")
    parser.add_argument(
        "--fault-rate", type=float, default=0.05, help="share of GETs that meet a fault"
    )
    parser.add_argument(
        "--clear-every", type=int, default=5, help="cache clear before every Nth epoch (0: never)"
    )
    parser.add_argument("--block-size", default="256K")
    parser.add_argument(
        "--cache-size",
        default="4M",
        help="block cache bound, below the dataset's size so that epochs evict and refetch",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default=str(ROOT / "results" / "soak.json"))
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(run(parse_args()))

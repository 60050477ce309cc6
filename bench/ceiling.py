"""`make bench-ceiling`: the daemon's ceiling in files/s, cold and warm, with many readers.

Issue 21's per-file question asked of a machine with more cores than readers need: how many
files a second one daemon serves when reader processes are not the bound. Nothing here needs
a store server, torch or PIL: ``--files`` files of about ``--size`` bytes (random bytes,
each with a unique prefix) are written once as ``--shards`` GNU-format tar shards into a
local folder, the mount's source, and as plain files into another folder, the local-disk
baseline. Each round, for each reader count in ``--readers`` (processes, forked, one
contiguous slice of the shard order each, as ShardSampler's shard mode hands them out):

- a fresh mount over an empty cache that holds everything, its tree listed (as ImageFolder
  does, so kernel pushes apply), the page cache dropped: the *cold* read, every file open,
  read, close once;
- the same files again, shuffled, page cache kept: *warm* (the kernel answers; the daemon
  should see nothing);
- the page cache dropped, the same files shuffled: *recached* (every READ answered from the
  cache's blocks by the daemon, nothing fetched);
- the local folder after ``drop_caches`` and then warm, with the same readers.

Per phase: files/s, the daemon's user and system CPU per file (/proc/PID/stat), and a
SHA-256 check of ``--verify`` files chosen at random against the bytes written. Variant
``nohot`` runs the mount with ``SHARDFS_HOT_PATH=0`` (every request answered in Python).
Writes ceiling.json and ceiling.md into ``--out``. Root is needed to drop the page cache.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from procs import CLOCK_TICKS, force_unmount  # noqa: E402

PHASES = ("cold", "warm", "recached", "local_dropped", "local_warm")
VARIANTS = {"hot": {}, "nohot": {"SHARDFS_HOT_PATH": "0"}}


DROP = "1"  # --drop: what drop_caches drops (1: the page cache; 3: dentries and inodes too)


def drop_page_cache() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text(f"{DROP}\n")


def log(text: str) -> None:
    print(f"[ceiling {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def make_data(work: Path, files: int, size: int, shards: int) -> tuple[list[str], dict[str, str]]:
    """Write the shards (work/src) and the same files (work/local); return the member paths
    in shard order and the SHA-256 of each. Reused when work/manifest.json matches."""
    manifest = work / "manifest.json"
    wanted = {"files": files, "size": size, "shards": shards}
    if manifest.exists():
        saved = json.loads(manifest.read_text())
        if saved["params"] == wanted:
            return saved["names"], saved["sums"]
    for folder in ("src", "local"):
        shutil.rmtree(work / folder, ignore_errors=True)
        (work / folder).mkdir(parents=True)
    rng = random.Random(0)
    pool = os.urandom(4 << 20)
    names: list[str] = []
    sums: dict[str, str] = {}
    per_shard = -(-files // shards)
    for shard in range(shards):
        shard_path = work / "src" / f"train-{shard:05d}.tar"
        with tarfile.open(shard_path, "w", format=tarfile.GNU_FORMAT) as tar:
            for index in range(shard * per_shard, min(files, (shard + 1) * per_shard)):
                name = f"c{index % 16:02d}/f{index:07d}.bin"
                length = size + rng.randrange(-size // 10, size // 10 + 1)
                start = rng.randrange(0, len(pool) - length)
                data = index.to_bytes(8, "little") + pool[start : start + length - 8]
                info = tarfile.TarInfo(name)
                info.size = len(data)
                info.mtime = 1_700_000_000
                local = work / "local" / name
                local.parent.mkdir(exist_ok=True)
                local.write_bytes(data)
                tar.addfile(info, io.BytesIO(data))
                names.append(name)
                sums[name] = hashlib.sha256(data).hexdigest()
    manifest.write_text(json.dumps({"params": wanted, "names": names, "sums": sums}))
    return names, sums


def read_with_processes(slices: list[list[str]]) -> tuple[float, int, int]:
    """Fork one reader per slice; each opens, reads and closes its files once it is told to
    go. Returns the seconds from go to the last reader's end, bytes and files read."""
    go_read, go_write = os.pipe()
    done_read, done_write = os.pipe()
    children = []
    for paths in slices:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            os.close(go_write)
            os.read(go_read, 1)
            got = 0
            for path in paths:
                with open(path, "rb") as handle:
                    got += len(handle.read())
            os.write(done_write, f"{got} {len(paths)}\n".encode())
            os._exit(0)
        children.append(pid)
    os.close(go_read)
    time.sleep(0.2)  # every child forked and waiting
    started = time.perf_counter()
    os.write(go_write, b"x" * len(slices))
    got = files = 0
    buffer = b""
    while buffer.count(b"\n") < len(slices):
        buffer += os.read(done_read, 4096)
    seconds = time.perf_counter() - started
    parts = buffer.decode().split()
    got = sum(int(value) for value in parts[0::2])
    files = sum(int(value) for value in parts[1::2])
    for pid in children:
        _, status = os.waitpid(pid, 0)
        if status != 0:
            raise RuntimeError(f"reader {pid} failed (status {status})")
    os.close(go_write)
    os.close(done_read)
    os.close(done_write)
    return seconds, got, files


def daemon_cpu(pid: int) -> tuple[float, float]:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return int(fields[11]) / CLOCK_TICKS, int(fields[12]) / CLOCK_TICKS


def split(paths: list[str], readers: int) -> list[list[str]]:
    """Contiguous slices, one per reader (shard mode's handing out)."""
    size = -(-len(paths) // readers)
    return [paths[i : i + size] for i in range(0, len(paths), size)]


def dealt(paths: list[str], readers: int, seed: int) -> list[list[str]]:
    shuffled = list(paths)
    random.Random(seed).shuffle(shuffled)
    return [shuffled[i::readers] for i in range(readers)]


def phase(slices: list[list[str]], pid: int | None, expected: int) -> dict[str, float]:
    before = daemon_cpu(pid) if pid else (0.0, 0.0)
    seconds, got, files = read_with_processes(slices)
    after = daemon_cpu(pid) if pid else (0.0, 0.0)
    if got != expected:
        raise RuntimeError(f"read {got} bytes, expected {expected}")
    user, system = (b - a for a, b in zip(before, after, strict=True))
    return {
        "files_per_s": files / seconds,
        "seconds": seconds,
        "daemon_user_us": user / files * 1e6,
        "daemon_sys_us": system / files * 1e6,
    }


def verify(root: Path, sums: dict[str, str], count: int, seed: int) -> int:
    names = random.Random(seed).sample(sorted(sums), min(count, len(sums)))
    for name in names:
        digest = hashlib.sha256((root / name).read_bytes()).hexdigest()
        if digest != sums[name]:
            raise RuntimeError(f"{name}: SHA-256 differs from the bytes written")
    return len(names)


def shardfs(*args: str, env: dict[str, str] | None = None) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "shardfs", *args], capture_output=True, text=True, check=False,
        env={**os.environ, **(env or {})},
    )  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(f"shardfs {' '.join(args)} failed: {result.stderr.strip()}")


def mount_round(args: argparse.Namespace, variant: str, readers: int, names: list[str],
                sums: dict[str, str], expected: int, seed: int) -> dict[str, Any]:  # fmt: skip
    from shardfs.mount.control import pid_file

    work: Path = args.work
    mnt, cache = work / "mnt", work / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    started = time.perf_counter()
    shardfs("mount", str(work / "src"), str(mnt), "--cache-dir", str(cache), "--layout", "raw",
            "--cache-size", str(expected * 2 + (256 << 20)), *args.shardfs_arg,
            env=VARIANTS[variant])  # fmt: skip
    row: dict[str, Any] = {"variant": variant, "readers": readers, "seed": seed,
                           "mount_s": time.perf_counter() - started}  # fmt: skip
    try:
        pid = int(pid_file(mnt).read_text())
        for _top, _dirs, _files in os.walk(mnt):  # listed, as ImageFolder does
            pass
        paths = [str(mnt / name) for name in names]
        drop_page_cache()
        row["cold"] = phase(split(paths, readers), pid, expected)
        row["warm"] = phase(dealt(paths, readers, seed), pid, expected)
        drop_page_cache()
        row["recached"] = phase(dealt(paths, readers, seed + 1), pid, expected)
        row["verified"] = verify(mnt, sums, args.verify, seed)
    finally:
        shardfs("umount", str(mnt))
        shutil.rmtree(cache, ignore_errors=True)
    return row


def local_round(args: argparse.Namespace, readers: int, names: list[str], expected: int,
                seed: int) -> dict[str, Any]:  # fmt: skip
    paths = [str(args.work / "local" / name) for name in names]
    drop_page_cache()
    row: dict[str, Any] = {"variant": "local", "readers": readers, "seed": seed}
    row["local_dropped"] = phase(split(paths, readers), None, expected)
    row["local_warm"] = phase(dealt(paths, readers, seed), None, expected)
    return row


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    keys = sorted({(row["variant"], row["readers"]) for row in rows})
    for variant, readers in keys:
        mine = [row for row in rows if (row["variant"], row["readers"]) == (variant, readers)]
        for name in PHASES:
            values = [row[name] for row in mine if name in row]
            if not values:
                continue
            entry: dict[str, Any] = {"variant": variant, "readers": readers, "phase": name}
            for key in ("files_per_s", "daemon_user_us", "daemon_sys_us"):
                series = [value[key] for value in values]
                entry[key] = statistics.median(series)
                entry[f"{key}_range"] = [min(series), max(series)]
            out.append(entry)
    return out


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"Daemon ceiling (bench/ceiling.py): {result['files']} files of about "
        f"{result['size']} B in {result['shards']} tar shards from a local folder, "
        f"{result['cpus']} CPUs ({result['machine']}), medians (min-max) of "
        f"{result['rounds']} rounds; daemon CPU per file from /proc/PID/stat.",
        "",
        "| mount | readers | phase | files/s | daemon user µs | daemon sys µs |",
        "|---|---|---|---|---|---|",
    ]
    for entry in result["summary"]:
        low, high = entry["files_per_s_range"]
        lines.append(
            f"| {entry['variant']} | {entry['readers']} | {entry['phase']} | "
            f"{entry['files_per_s']:,.0f} ({low:,.0f}-{high:,.0f}) | "
            f"{entry['daemon_user_us']:.1f} | {entry['daemon_sys_us']:.1f} |"
        )
    lines += ["", f"Command: `{result['command']}` ({result['minutes']:.1f} min)."]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=24000, help="files (24000)")
    parser.add_argument("--size", type=int, default=100_000, help="bytes per file, ±10%% (100000)")
    parser.add_argument("--shards", type=int, default=48, help="tar shards (48)")
    parser.add_argument("--readers", default="1,4,16", help="reader processes, comma-separated")
    parser.add_argument("--variants", default="hot,nohot", help="hot, nohot (SHARDFS_HOT_PATH=0)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds (2)")
    parser.add_argument("--verify", type=int, default=200, help="files SHA-256-checked per mount")
    parser.add_argument(
        "--drop", choices=("1", "3"), default="1",
        help="drop_caches value before cold, recached and local reads: 1 the page cache "
        "(default), 3 dentries and inodes too (every file looked up again)",
    )  # fmt: skip
    parser.add_argument("--shardfs-arg", action="append", default=[], help="extra mount option")
    parser.add_argument("--work", type=Path, default=ROOT / "results" / "tmp" / "ceiling")
    parser.add_argument("--out", type=Path, default=ROOT / "results")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    global DROP
    args = parse_args(argv)
    DROP = args.drop
    args.work = args.work.absolute()
    args.work.mkdir(parents=True, exist_ok=True)
    begun = time.perf_counter()
    names, sums = make_data(args.work, args.files, args.size, args.shards)
    expected = sum((args.work / "local" / name).stat().st_size for name in names)
    log(f"data ready: {len(names)} files, {expected / 1e6:.0f} MB")
    readers = [int(value) for value in args.readers.split(",")]
    variants = [value for value in args.variants.split(",") if value]
    rows: list[dict[str, Any]] = []
    try:
        for round_index in range(args.rounds):
            for count in readers:
                for variant in variants:
                    row = mount_round(args, variant, count, names, sums, expected, round_index)
                    rows.append(row)
                    log(f"round {round_index} {variant} x{count}: " + ", ".join(
                        f"{name} {row[name]['files_per_s']:,.0f}/s "
                        f"u{row[name]['daemon_user_us']:.0f} s{row[name]['daemon_sys_us']:.0f}"
                        for name in PHASES if name in row))  # fmt: skip
                row = local_round(args, count, names, expected, round_index)
                rows.append(row)
                log(f"round {round_index} local x{count}: " + ", ".join(
                    f"{name} {row[name]['files_per_s']:,.0f}/s"
                    for name in PHASES if name in row))  # fmt: skip
    finally:
        force_unmount(args.work / "mnt")
    result = {
        "files": len(names), "size": args.size, "shards": args.shards, "rounds": args.rounds,
        "cpus": os.cpu_count(), "machine": f"{platform.node()} {platform.release()}",
        "python": platform.python_version(), "rows": rows, "summary": summary(rows),
        "command": " ".join(["bench/ceiling.py", *(sys.argv[1:] if argv is None else argv)]),
        "minutes": (time.perf_counter() - begun) / 60,
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ceiling.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "ceiling.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`make bench-files`: what one file costs the daemon, against curl and this VM's page faults.

Issue 21's per-file section, also runnable alone. The bench's ~100 KB JPEGs (bench/data.py)
are packed in webdataset format onto moto's S3 server behind the counting middleware; the
server is pinned to the last core, this process, the daemon and the readers to the others
(bench/pinning.py). Each round, for each variant (``open(path, 'rb')`` with default
buffering, and with ``buffering=0``), a fresh cache is mounted, the tree listed (as
ImageFolder does, so kernel pushes apply), the page cache dropped, and every file read once
by ``--threads`` threads (open, read, close): the cold read. The same files read again on
the same mount, page cache kept, are the warm read; read once more after dropping the page
cache, the recached read (every file a READ answered from cache blocks, nothing fetched or
pushed). Over each read phase the daemon's user and system CPU and its minor page faults
come from /proc/PID/stat (utime, stime, minflt), divided by the files read. Last, the
TCGETS ioctl every default-buffered ``open()`` sends: ``--ioctl-calls`` ``isatty`` calls
on one file of the mount, wall time and the daemon's CPU per call.

In the same round, the baselines the issue's targets use:

- curl fetching every shard whole from the same server (presigned URLs, ``--threads`` at a
  time, to /dev/null): its user and system CPU from the reaped children's resource usage,
  per file;
- this VM's page-fault cost, in a child process: the system CPU per 4 KiB page to touch
  fresh anonymous memory (first touch), the same after freeing and mapping it again
  (recycled pages), and a re-touch of pages already mapped;
- the page-cache fill of the same bytes: a tmpfs file written with them (page allocation
  and copy, the work a kernel push does), and a local file of the same size read after
  ``drop_caches`` (context: it adds the block device), system CPU per file.

Writes results/per_file.json and results/per_file.md (``--out``).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import random
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import time
from array import array
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from data import ensure_tree  # noqa: E402
from pinning import Pinning  # noqa: E402
from procs import (  # noqa: E402
    CLOCK_TICKS,
    force_unmount,
    minor_faults,
    pack_webdataset,
    page_cache_drops,
    run_to_the_end,
    start_store,
    thread_cpu,
)
from procs import shardfs_cli as shardfs  # noqa: E402
from support.mounts import drop_inodes, drop_page_cache  # noqa: E402
from support.s3 import REGION, S3Server, settled_counts  # noqa: E402

BUCKET = "perfile"
PREFIX = "data/train"
PAGE = 4096
VARIANTS = {"default": -1, "unbuffered": 0}  # open()'s buffering argument
PHASES = ("cold", "warm", "recached")
PHASE_KEYS = ("files_per_s", "daemon_user_us", "daemon_sys_us", "daemon_total_us",
              "daemon_faults_per_file")  # fmt: skip
VM_KEYS = ("first_touch_us", "recycled_touch_us", "retouch_mapped_us",
           "first_touch_per_file_us", "tmpfs_fill_us", "disk_fill_us")  # fmt: skip
USER_TARGET_US = 15.0  # daemon user CPU per cold file
TOTAL_TARGET = 2.0  # daemon user + system <= 2x (curl + page-cache fill)


def log(text: str) -> None:
    print(f"bench-files: {text}", file=sys.stderr, flush=True)


def process_cpu(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of ``pid``, all its threads, from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return int(fields[11]) / CLOCK_TICKS, int(fields[12]) / CLOCK_TICKS


def per_file_us(before: tuple[float, float], after: tuple[float, float], files: int) -> list[float]:
    return [(now - was) / files * 1e6 for was, now in zip(before, after, strict=True)]


def children_cpu() -> tuple[float, float]:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime, usage.ru_stime


def read_files(paths: list[Path], threads: int, buffering: int) -> tuple[float, int]:
    """Seconds and bytes to open, read and close every file, ``threads`` at a time."""

    def read(path: Path) -> int:
        with open(path, "rb", buffering=buffering) as handle:
            return len(handle.read())

    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        got = sum(pool.map(read, paths, chunksize=16))
    return time.perf_counter() - started, got


# -- the VM's own costs, each measured in a child process of its own ----------------------


def _self_cpu() -> tuple[float, float]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime


def probe_faults(nbytes: int) -> dict[str, float]:
    """System CPU (us) per 4 KiB page: first touch of fresh anonymous memory, the same after
    an unmap and a new map (pages the kernel recycles), and a re-touch of mapped pages."""
    pages = nbytes // PAGE
    result: dict[str, float] = {"pages": pages}

    def touch(area: mmap.mmap) -> float:
        before = _self_cpu()[1]
        for offset in range(0, pages * PAGE, PAGE):
            area[offset] = 1
        return (_self_cpu()[1] - before) / pages * 1e6

    area = mmap.mmap(-1, pages * PAGE)
    result["first_touch_us"] = touch(area)
    result["retouch_mapped_us"] = touch(area)
    area.close()
    area = mmap.mmap(-1, pages * PAGE)
    result["recycled_touch_us"] = touch(area)
    area.close()
    return result


def probe_tmpfs_fill(nbytes: int, folder: str) -> dict[str, float]:
    """System CPU (s) to write ``nbytes`` into a fresh tmpfs file (page cache pages
    allocated and filled), then to read them back; the file is removed."""
    chunk = os.urandom(1 << 20)
    path = Path(folder) / f"per-file-fill-{os.getpid()}"
    try:
        before = _self_cpu()[1]
        with open(path, "wb", buffering=0) as out:
            for start in range(0, nbytes, len(chunk)):
                out.write(chunk[: nbytes - start])
        written = _self_cpu()[1]
        buffer = bytearray(len(chunk))
        with open(path, "rb", buffering=0) as source:
            while source.readinto(buffer):
                pass
        return {"write_sys_s": written - before, "read_sys_s": _self_cpu()[1] - written}
    finally:
        path.unlink(missing_ok=True)


def probe_disk_fill(path: str) -> dict[str, float]:
    """System CPU (s) to read a local file whose pages were dropped (page cache filled
    from the block device), into one reused buffer."""
    buffer = bytearray(1 << 20)
    before = _self_cpu()[1]
    with open(path, "rb", buffering=0) as source:
        while source.readinto(buffer):
            pass
    return {"read_sys_s": _self_cpu()[1] - before}


def run_probe(kind: str, *args: str) -> dict[str, float]:
    """One probe in a fresh child (``--probe KIND``): its own, clean resource usage."""
    command = [sys.executable, str(Path(__file__).resolve()), "--probe", kind, *args]
    output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    reply: dict[str, float] = json.loads(output)
    return reply


# -- the orchestrator ---------------------------------------------------------------------


class PerFileBench:
    """Holds the server and the mount, so cleanup can find them."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.run_dir = args.work.absolute() / "per-file-run"
        self.mnt = self.run_dir / "mnt"
        self.server = S3Server()
        self.pinning = Pinning.split()
        self.mounted = False

    def cleanup(self) -> None:
        if self.mounted:
            force_unmount(self.mnt)
        self.server.stop()
        shutil.rmtree(self.run_dir / "fill", ignore_errors=True)

    def setup(self) -> None:
        shutil.rmtree(self.run_dir, ignore_errors=True)
        self.run_dir.mkdir(parents=True)
        self.mnt.mkdir()
        tree = ensure_tree(self.args.work.absolute(), self.args.images, self.args.classes, log)
        self.local_files = sorted(p for p in tree.root.rglob("*.jpg"))
        self.pinning.pin_self_to_readers()
        start_store(self.server, self.pinning)
        os.environ.update(self.server.env())
        self.server.create_bucket(BUCKET)
        self.source = f"s3://{BUCKET}/{PREFIX}"
        pack_webdataset(tree, self.source, self.args.shards, self.run_dir / "pack-cache")
        fs = self.server.filesystem()
        self.shards = sorted(fs.glob(f"{BUCKET}/{PREFIX}/*.tar"))
        self.shard_bytes = sum(fs.size(p) for p in self.shards)
        self.file_bytes = sum(p.stat().st_size for p in self.local_files)
        pages = sum(-(-p.stat().st_size // PAGE) for p in self.local_files)
        self.pages_per_file = pages / len(self.local_files)
        self.meta = {
            "files": len(self.local_files),
            "file_bytes": self.file_bytes,
            "pages_per_file": self.pages_per_file,
            "shards": len(self.shards),
            "shard_bytes": self.shard_bytes,
        }
        log(f"{len(self.local_files)} files in {len(self.shards)} shards, {self.pinning.label()}")

    @contextmanager
    def mount(self) -> Iterator[int]:
        from shardfs.mount.control import pid_file

        cache = self.run_dir / "cache"
        shutil.rmtree(cache, ignore_errors=True)
        self.mounted = True
        shardfs("mount", self.source, str(self.mnt), "--cache-dir", str(cache),
                *self.args.shardfs_arg)  # fmt: skip
        try:
            yield int(pid_file(self.mnt).read_text())
        finally:
            shardfs("umount", str(self.mnt))
            self.mounted = False
            shutil.rmtree(cache, ignore_errors=True)

    @contextmanager
    def profiled(self, pid: int, name: str) -> Iterator[None]:
        """With ``--profile DIR``, the daemon recorded over the block into DIR: ``py-spy
        record --nonblocking`` (plain py-spy stops the daemon to sample it, which can
        deadlock a mount), collapsed stacks per thread in NAME.txt; or ``perf record -g``
        (``--profiler perf``), user and kernel stacks in NAME.perf. Not for timing."""
        if self.args.profile is None:
            yield
            return
        folder = self.args.profile.absolute()
        folder.mkdir(parents=True, exist_ok=True)
        if self.args.profiler == "perf":
            out = folder / f"{name}.perf"
            command = ["perf", "record", "-g", "-F", str(self.args.profile_rate),
                       "-p", str(pid), "-o", str(out)]  # fmt: skip
        else:
            out = folder / f"{name}.txt"
            command = [str(_profiler_tool("py-spy")), "record", "--nonblocking", "--threads",
                       "--format", "raw", "--rate", str(self.args.profile_rate), "--pid", str(pid),
                       "--output", str(out)]  # fmt: skip
        recorder = subprocess.Popen(
            [*command, *self.args.profiler_arg],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        time.sleep(1.0)  # the recorder attaches
        try:
            yield
        finally:
            recorder.send_signal(signal.SIGINT)
            _, error = recorder.communicate(timeout=120)
            log(f"profile {out}: {error.strip().splitlines()[-1:] if error else ''}")

    def phase(self, pid: int, paths: list[Path], buffering: int) -> dict[str, Any]:
        """One read phase: files/s, and the daemon's user and system CPU per file (us)."""
        drops, faults = page_cache_drops(), minor_faults(pid)
        before, threads_before = process_cpu(pid), thread_cpu(pid)
        seconds, got = read_files(paths, self.args.threads, buffering)
        after, threads_after = process_cpu(pid), thread_cpu(pid)
        faults = minor_faults(pid) - faults
        drops = page_cache_drops() - drops
        user, system = (b - a for a, b in zip(before, after, strict=True))
        if got != self.file_bytes:
            raise RuntimeError(f"read {got} bytes through the mount, expected {self.file_bytes}")
        files = len(paths)
        return {
            "files_per_s": files / seconds,
            "seconds": seconds,
            "daemon_user_us": user / files * 1e6,
            "daemon_sys_us": system / files * 1e6,
            "daemon_total_us": (user + system) / files * 1e6,
            "daemon_faults_per_file": faults / files,
            "page_cache_drops_by_others": drops,
            # by thread family, (CPU, of which user) us per file; threads that ended
            # meanwhile are in the process's figures only
            "threads_us": {
                family: per_file_us(threads_before.get(family, (0.0, 0.0)), spent, files)
                for family, spent in sorted(threads_after.items())
            },
        }

    def mount_round(self, variant: str, seed: int) -> dict[str, Any]:
        from shardfs.mount.control import query

        buffering = VARIANTS[variant]
        with self.mount() as pid:
            paths = sorted(
                Path(folder) / name
                for folder, _, names in os.walk(self.mnt)
                for name in names
                if name.endswith(".jpg")
            )
            if self.args.order == "shuffled":
                random.Random(seed).shuffle(paths)
            hint = None
            if self.args.order in ("shard", "uniform"):
                paths, hint = self.sampler_order(paths, seed, self.args.order)
            settled_counts(self.server)
            self.server.reset_counts()
            drop_page_cache()
            if self.args.cold_drop == "inodes":
                drop_inodes()  # the kernel FORGETs the listed inodes, pages and all
            stats_before = query(self.mnt)
            if hint is not None:
                hint()  # as ShardSampler does when an epoch's iteration starts
            with self.profiled(pid, f"{variant}-cold-{seed}"):
                cold = self.phase(pid, paths, buffering)
            stats = query(self.mnt)
            tail_before = process_cpu(pid)
            counts = settled_counts(self.server)
            tail = sum(process_cpu(pid)) - sum(tail_before)
            cold["daemon_after_reads_us"] = tail / len(paths) * 1e6
            cold["egress_ratio"] = counts["get_object_bytes"] / self.shard_bytes
            cold["store_gets"] = counts["get_object_requests"]
            for key in ("bytes_pushed", "bytes_served", "reads_waited_on_network",
                        "files_published", "hot_path_reads", "publishes_after_reads",
                        "hot_path_disk_reads", "hot_path_direct_reads", "hot_path_memory_reads",
                        "hot_path_edge_reads", "python_reads", "python_reads_later",
                        "cache_misses", "prefetched_blocks", "hot_path_lookups",
                        "python_lookups", "landing_mapped_bytes",
                        "inodes_forgotten", "pushes_refused", "landing_room_timeouts",
                        "blocks_kept_unstored"):  # fmt: skip
                cold[key] = stats.get(key, 0) - stats_before.get(key, 0)
            warm = self.phase(pid, paths, buffering)
            # Blocks cached, page cache dropped: every file is a READ answered from cache
            # blocks (no network, no push: the daemon already pushed them once).
            drop_page_cache()
            before_recached = query(self.mnt)
            with self.profiled(pid, f"{variant}-recached-{seed}"):
                recached = self.phase(pid, paths, buffering)
            after_recached = query(self.mnt)
            for key in ("bytes_served", "hot_path_reads", "publishes_after_reads",
                        "hot_path_disk_reads", "hot_path_direct_reads",
                        "hot_path_memory_reads", "hot_path_edge_reads",
                        "python_reads"):  # fmt: skip
                recached[key] = after_recached.get(key, 0) - before_recached.get(key, 0)
            ioctl = self.ioctl_phase(pid, paths[0])
        return {"variant": variant, "cold": cold, "warm": warm, "recached": recached,
                "ioctl": ioctl}  # fmt: skip

    def sampler_order(
        self, paths: list[Path], seed: int, mode: Literal["shard", "uniform"]
    ) -> tuple[list[Path], Callable[[], None]]:
        """``--order shard`` or ``uniform``: the files in the order ``ShardSampler(mode=mode)``
        reads them in epoch 0 with seed ``seed`` (one node, one rank; the same planner,
        without torch), and a call that sends that order to the mount as its hint."""
        import numpy as np

        from shardfs import placement
        from shardfs.sampling.plan import plan_node

        table = placement.read_placement(str(self.mnt))
        rows = np.array(table.rows_of([str(p.relative_to(self.mnt)) for p in paths]))
        shard_of = np.array(table.shards, dtype=np.int64)[rows]
        order = plan_node(shard_of, num_samples=len(paths), mode=mode, seed=seed, within=rows).order
        hinted = array("i", rows[order].tolist())

        def send() -> None:
            placement.send_hint(str(self.mnt), table, hinted, epoch=0)

        return [paths[i] for i in order.tolist()], send

    def ioctl_phase(self, pid: int, path: Path) -> dict[str, float]:
        """The TCGETS ioctl every default-buffered ``open()`` sends (``isatty``): wall time
        and the daemon's user and system CPU per call, on one file of the mount."""
        calls = self.args.ioctl_calls
        fd = os.open(path, os.O_RDONLY)
        try:
            before = process_cpu(pid)
            started = time.perf_counter()
            for _ in range(calls):
                os.isatty(fd)
            seconds = time.perf_counter() - started
            after = process_cpu(pid)
        finally:
            os.close(fd)
        user, system = (b - a for a, b in zip(before, after, strict=True))
        return {"wall_us": seconds / calls * 1e6, "daemon_user_us": user / calls * 1e6,
                "daemon_sys_us": system / calls * 1e6}  # fmt: skip

    def presigned_urls(self) -> list[str]:
        import boto3

        client = boto3.client("s3", endpoint_url=self.server.endpoint, region_name=REGION)
        return [
            client.generate_presigned_url(
                "get_object",
                Params={"Bucket": BUCKET, "Key": path.split("/", 1)[1]},
                ExpiresIn=24 * 3600,
            )
            for path in self.shards
        ]

    def curl_round(self) -> dict[str, float]:
        """Every shard once with curl, ``--threads`` at a time, to /dev/null."""
        command = ["curl", "--silent", "--show-error", "--fail", "--parallel",
                   "--parallel-max", str(self.args.threads)]  # fmt: skip
        for url in self.presigned_urls():
            command += ["--output", os.devnull, url]
        settled_counts(self.server)
        self.server.reset_counts()
        before = children_cpu()
        started = time.perf_counter()
        subprocess.run(command, check=True, capture_output=True)
        seconds = time.perf_counter() - started
        user, system = (b - a for a, b in zip(before, children_cpu(), strict=True))
        got = settled_counts(self.server)["get_object_bytes"]
        if got != self.shard_bytes:
            raise RuntimeError(f"curl fetched {got} bytes, expected {self.shard_bytes}")
        files = len(self.local_files)
        return {
            "seconds": seconds,
            "user_us": user / files * 1e6,
            "sys_us": system / files * 1e6,
            "total_us": (user + system) / files * 1e6,
        }

    def vm_round(self) -> dict[str, Any]:
        """Page faults and page-cache fills of this VM, now, per file of the dataset."""
        files = len(self.local_files)
        faults = run_probe("faults", str(self.args.fault_bytes))
        tmpfs = run_probe("tmpfs", str(self.file_bytes), self.args.tmpfs)
        fill = self.run_dir / "fill"
        fill.mkdir(exist_ok=True)
        local = fill / "bytes"
        with open(local, "wb") as out:
            chunk = os.urandom(1 << 20)
            for start in range(0, self.file_bytes, len(chunk)):
                out.write(chunk[: self.file_bytes - start])
            out.flush()
            os.fsync(out.fileno())
        drop_page_cache()
        disk = run_probe("disk", str(local))
        local.unlink()
        return {
            **faults,
            "first_touch_per_file_us": faults["first_touch_us"] * self.pages_per_file,
            "tmpfs_fill_us": tmpfs["write_sys_s"] / files * 1e6,
            "tmpfs_reread_us": tmpfs["read_sys_s"] / files * 1e6,
            "disk_fill_us": disk["read_sys_s"] / files * 1e6,
        }

    def local_round(self) -> dict[str, float]:
        """Files/s of the same files on local disk, page cache warm (context)."""
        read_files(self.local_files, self.args.threads, -1)
        seconds, _ = read_files(self.local_files, self.args.threads, -1)
        return {"files_per_s": len(self.local_files) / seconds}

    def run(self) -> dict[str, Any]:
        started = time.perf_counter()
        self.setup()
        rounds = []
        for number in range(self.args.rounds):
            order = list(self.args.variants)
            if number % 2:
                order.reverse()  # neither variant always runs first
            record: dict[str, Any] = {"round": number, "vm": self.vm_round()}
            record["curl"] = self.curl_round()
            record["local"] = self.local_round()
            for variant in order:
                record[variant] = self.mount_round(variant, number)
                cold, warm = record[variant]["cold"], record[variant]["warm"]
                log(
                    f"round {number} {variant}: cold {cold['files_per_s']:.0f} files/s, "
                    f"daemon user {cold['daemon_user_us']:.1f} sys {cold['daemon_sys_us']:.1f} "
                    f"us/file; warm {warm['files_per_s']:.0f} files/s, "
                    f"{warm['daemon_total_us']:.1f} us/file"
                )
            vm, curl = record["vm"], record["curl"]
            log(
                f"round {number}: curl {curl['total_us']:.1f} us/file, first touch "
                f"{vm['first_touch_us']:.2f} us/page, tmpfs fill {vm['tmpfs_fill_us']:.1f} "
                "us/file"
            )
            rounds.append(record)
        return {
            "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            "pinning": {**self.pinning.as_dict(), "label": self.pinning.label()},
            "dataset": self.meta,
            "threads": self.args.threads,
            "order": self.args.order,
            "mount_args": self.args.shardfs_arg,
            "rounds": rounds,
            "total_s": time.perf_counter() - started,
        }


# -- targets and report -------------------------------------------------------------------


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """Medians (min, max) over rounds, and the issue's per-file targets per round."""
    rounds = result["rounds"]
    out: dict[str, Any] = {}
    for variant in VARIANTS:
        if variant not in rounds[0]:
            continue
        for phase in PHASES:
            for key in PHASE_KEYS:
                values = [r[variant][phase][key] for r in rounds]
                out[f"{variant}.{phase}.{key}"] = _spread(values)
        for key in ("wall_us", "daemon_user_us", "daemon_sys_us"):
            out[f"{variant}.ioctl.{key}"] = _spread([r[variant]["ioctl"][key] for r in rounds])
        baseline = [r["curl"]["total_us"] + r["vm"]["tmpfs_fill_us"] for r in rounds]
        ratios = [
            r[variant]["cold"]["daemon_total_us"] / base
            for r, base in zip(rounds, baseline, strict=True)
        ]
        out[f"{variant}.cold.total_over_baseline"] = _spread(ratios)
    for section, keys in (
        ("curl", ("user_us", "sys_us", "total_us")),
        ("vm", VM_KEYS),
        ("local", ("files_per_s",)),
    ):
        for key in keys:
            out[f"{section}.{key}"] = _spread([r[section][key] for r in rounds])
    return out


def targets(result: dict[str, Any], figures: dict[str, Any]) -> list[dict[str, Any]]:
    checks = []
    for variant in VARIANTS:
        key = f"{variant}.cold.daemon_user_us"
        if key not in figures:
            continue
        user = figures[key]["median"]
        checks.append({"target": f"{variant}: daemon user CPU per cold file (us)",
                       "value": user, "goal": f"<= {USER_TARGET_US:g}",
                       "met": user <= USER_TARGET_US})  # fmt: skip
        ratio = figures[f"{variant}.cold.total_over_baseline"]["median"]
        checks.append({"target": f"{variant}: daemon user+sys / (curl + tmpfs page-cache fill)",
                       "value": ratio, "goal": f"<= {TOTAL_TARGET:g}",
                       "met": ratio <= TOTAL_TARGET})  # fmt: skip
    return checks


def markdown(result: dict[str, Any]) -> str:
    figures, data = result["summary"], result["dataset"]

    def cell(key: str, digits: int = 1) -> str:
        value = figures[key]
        return f"{value['median']:.{digits}f} ({value['min']:.{digits}f}-{value['max']:.{digits}f})"

    lines = [
        f"Per-file cost (issue 21): {data['files']} files of "
        f"{data['file_bytes'] / data['files'] / 1e3:.0f} KB in {data['shards']} shards, "
        f"{result['threads']} reader threads, {result['order']} order, "
        f"{result['pinning']['label']}; medians (min-max) of {len(result['rounds'])} rounds. "
        "Daemon CPU (us) and minor page faults from /proc/PID/stat over the read phase, "
        "per file.",
        "",
        "| open() | phase | files/s | daemon user | daemon sys | daemon total "
        "| daemon page faults |",
        "|---|---|---|---|---|---|---|",
    ]
    for variant in VARIANTS:
        for phase in PHASES:
            prefix = f"{variant}.{phase}"
            if f"{prefix}.files_per_s" not in figures:
                continue
            lines.append(
                f"| {variant} | {phase} | {cell(prefix + '.files_per_s', 0)} "
                f"| {cell(prefix + '.daemon_user_us')} | {cell(prefix + '.daemon_sys_us')} "
                f"| {cell(prefix + '.daemon_total_us')} "
                f"| {cell(prefix + '.daemon_faults_per_file')} |"
            )
    lines += [
        "",
        "cold: fresh cache, page cache dropped; warm: the same files again; recached: blocks "
        "cached, page cache dropped (every file a READ answered from cache blocks).",
        *thread_table(result),
        "",
        "| the ioctl of isatty() on a mount file, per call (us) | wall | daemon user "
        "| daemon sys |",
        "|---|---|---|---|",
    ]
    for variant in VARIANTS:
        if f"{variant}.ioctl.wall_us" in figures:
            lines.append(
                f"| mount of the {variant} round | {cell(variant + '.ioctl.wall_us')} "
                f"| {cell(variant + '.ioctl.daemon_user_us')} "
                f"| {cell(variant + '.ioctl.daemon_sys_us')} |"
            )
    lines += [
        "",
        "| baseline, same run | per file (us) |",
        "|---|---|",
        f"| curl, whole shards: user | {cell('curl.user_us')} |",
        f"| curl: system | {cell('curl.sys_us')} |",
        f"| page-cache fill, tmpfs write of the same bytes (system) | {cell('vm.tmpfs_fill_us')} |",
        f"| page-cache fill, local file read after drop_caches (system, context) "
        f"| {cell('vm.disk_fill_us')} |",
        f"| first touch of anonymous memory, per 4 KiB page | {cell('vm.first_touch_us', 2)} |",
        f"| touch after unmap and map again, per page | {cell('vm.recycled_touch_us', 2)} |",
        f"| re-touch of mapped pages, per page | {cell('vm.retouch_mapped_us', 2)} |",
        f"| first touch x {data['pages_per_file']:.1f} pages per file "
        f"| {cell('vm.first_touch_per_file_us')} |",
        f"| local disk, page cache warm: files/s | {cell('local.files_per_s', 0)} |",
        "",
        "| target | measured | goal | met |",
        "|---|---|---|---|",
    ]
    for check in result["targets"]:
        met = "yes" if check["met"] else "**no**"
        lines.append(f"| {check['target']} | {check['value']:.2f} | {check['goal']} | {met} |")
    lines += ["", f"Command: `{result['command']}` ({result['total_s'] / 60:.1f} min)."]
    return "\n".join(lines) + "\n"


def thread_table(result: dict[str, Any]) -> list[str]:
    """Where the daemon's CPU per file went, by thread family: medians over rounds of the
    cold and recached phases of each variant (user / system us per file)."""
    rounds = result["rounds"]
    columns = [(variant, phase) for variant in VARIANTS if variant in rounds[0]
               for phase in ("cold", "recached")]  # fmt: skip
    families = sorted({family for r in rounds for variant, phase in columns
                       for family in r[variant][phase].get("threads_us", {})})  # fmt: skip
    if not families:
        return []
    lines = [
        "",
        "The daemon's CPU per file by thread, medians, us: user and system (the scheduler's "
        "ns) / of which user (clock ticks, which lose up to a tick per thread). "
        "`shardfs-fuse` answers requests, `shardfs-push` pushes into the kernel, `prefetch` "
        "fetches and stores blocks, `shardfs-read` answers the READs Python waits on, "
        "`shardfs-disk` those C waits on, `shardfs-hot` sweeps:",
        "",
        "| thread | " + " | ".join(f"{v} {p}" for v, p in columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    for family in families:
        cells = []
        for variant, phase in columns:
            pairs = [r[variant][phase].get("threads_us", {}).get(family) for r in rounds]
            pairs = [pair for pair in pairs if pair is not None]
            if not pairs:
                cells.append("-")
                continue
            total = statistics.median(pair[0] for pair in pairs)
            user = statistics.median(pair[1] for pair in pairs)
            cells.append(f"{total:.1f} / {user:.1f}")
        if any(cell not in ("-", "0.0 / 0.0") for cell in cells):
            lines.append(f"| {family} | " + " | ".join(cells) + " |")
    return lines


def write_reports(result: dict[str, Any], out: Path) -> dict[str, Any]:
    """per_file.json and per_file.md under ``out``; returns the result with its summary."""
    figures = summary(result)
    result = {**result, "summary": figures, "targets": targets(result, figures)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "per_file.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "per_file.md").write_text(markdown(result))
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--probe", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--images", type=int, default=3000, help="files, ~100 KB each (3000)")
    parser.add_argument("--classes", type=int, default=10, help="classes (10)")
    parser.add_argument("--shards", type=int, default=12, help="about this many shards (12)")
    parser.add_argument("--threads", type=int, default=4, help="reader threads (4)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (5)")
    parser.add_argument(
        "--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
        help="open() buffering: default, unbuffered (both)",
    )  # fmt: skip
    parser.add_argument(
        "--order", choices=("shuffled", "sorted", "shard", "uniform"), default="shuffled",
        help="the order files are read in: shuffled (a seed per round), sorted, shard or "
        "uniform (ShardSampler's mode of that name, its order sent to the mount as the hint)",
    )  # fmt: skip
    parser.add_argument(
        "--fault-bytes", type=int, default=256 << 20,
        help="anonymous memory the page-fault probe touches (256 MiB)",
    )  # fmt: skip
    parser.add_argument(
        "--profile", type=Path, default=None,
        help="record the daemon over cold and recached reads into this folder (not timed)",
    )  # fmt: skip
    parser.add_argument("--profiler", choices=("py-spy", "perf"), default="py-spy")
    parser.add_argument("--profile-rate", type=int, default=1000, help="samples/s (1000)")
    parser.add_argument(
        "--profiler-arg", action="append", default=[],
        help="extra argument to the profiler, e.g. --profiler-arg=--native (repeatable)",
    )  # fmt: skip
    parser.add_argument(
        "--ioctl-calls", type=int, default=20_000, help="isatty calls of the ioctl phase"
    )
    parser.add_argument(
        "--cold-drop", choices=("pages", "inodes"), default="pages",
        help="what is dropped between the listing and the cold phase: the page cache "
        "(pages: the kernel keeps the inodes the listing gave it), or the dentries and "
        "inodes too (inodes: it FORGETs them, as memory pressure on a node whose dataset "
        "exceeds its RAM does; files are then looked up again as they are opened)",
    )  # fmt: skip
    parser.add_argument("--tmpfs", default="/dev/shm", help="a tmpfs folder (/dev/shm)")
    parser.add_argument(
        "--shardfs-arg", action="append", default=[], help="extra mount argument (repeatable)"
    )
    parser.add_argument("--work", type=Path, default=ROOT / "results" / "tmp")
    parser.add_argument("--out", type=Path, default=ROOT / "results")
    args = parser.parse_args(argv)
    if args.profile is not None and _profiler_tool(args.profiler) is None:
        where = "`make bench-deps` installs py-spy" if args.profiler == "py-spy" else "the system's"
        parser.error(f"--profile needs {args.profiler} ({where})")
    return args


def _profiler_tool(profiler: str) -> str | None:
    """The profiler's executable: on PATH, or py-spy beside this Python (the venv's)."""
    beside = Path(sys.executable).with_name(profiler)
    return shutil.which(profiler) or (str(beside) if beside.exists() else None)


def run_section(args: argparse.Namespace) -> dict[str, Any] | None:
    """Run the section and write its reports; the result with its summary and targets, None
    if interrupted. bench/run.py may call this as a section of ``make bench``."""
    result = run_to_the_end(PerFileBench(args), log)
    if result is None:
        return None
    return write_reports(result, args.out)


def probe_main(kind: str, args: list[str]) -> int:
    probes = {
        "faults": lambda: probe_faults(int(args[0])),
        "tmpfs": lambda: probe_tmpfs_fill(int(args[0]), args[1]),
        "disk": lambda: probe_disk_fill(args[0]),
    }
    print(json.dumps(probes[kind]()))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.probe:
        return probe_main(args.probe[0], args.probe[1:])
    result = run_section(args)
    if result is None:
        return 130
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

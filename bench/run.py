"""`make bench`: ImageFolder on local disk vs shardfs vs webdataset vs ratarmount, one machine.

One run generates (or reuses) an ImageFolder tree of ~100 KB JPEGs, starts moto's S3 server
on loopback behind the counting middleware (tests/support/s3.py), packs the tree twice with
``shardfs pack`` (webdataset format for shardfs and webdataset, tree format for ratarmount),
measures the server's peak ranged-GET throughput and ``shardfs warm``, then runs epochs of a
shuffled DataLoader (batch 32, the same collate for all) for every contender, mode
(raw bytes / decode) and worker count, interleaving contenders and repeating rounds because
the machine is noisy. The server runs on the last core and everything else (this process,
the epoch runner and its workers, the daemons, curl) on the others, as a training node
sees S3 (bench/pinning.py; ``--shared-cores`` runs all on all, for context). At the first
worker count the shardfs contenders and webdataset run in pairs: each of their epochs
comes right after a local epoch with the same seed, each cold one after a local epoch
right after ``drop_caches`` and then that warm one (and a raw cold one after a fresh
measurement of the server's peak), so every target is checked on per-pair ratios of
neighbours in time (bench/report.py); rows kept for context run fewer rounds. A pinned
run ends with ``--shared-context-rounds`` paired decode rounds on shared cores, reported
apart as context. shardfs also runs with ``shardfs.torch.ShardSampler`` in place of
``shuffle=True`` (contenders ``shardfs-shard``, cold and warm, and ``shardfs-uniform``, cold),
with the mount's hint counters sampled through the epoch. Each epoch record carries
``cpu_s``: CPU seconds of the S3 server, the daemon, the epoch's main process, its workers
(and curl or ``shardfs warm``) with the wall time, so a gap to local disk can be split by
process; and ``affinity``: the cores the server, the epoch runner and the daemon may run
on. ``local+dl`` and ``local+warm`` are local epochs while curl or ``shardfs warm``
downloads the dataset: the ceilings for a loader that downloads, and for one that
downloads through shardfs's own fetch path (decode only: a raw local epoch is over long
before the download). Each record also carries ``page_cache_drops``, since a drop by
another process on the machine makes warm epochs and kernel pushes pay twice. Writes
results/bench.json, results/bench.md and results/bench.png and prints the markdown
table. Everything it mounts or starts is stopped on exit, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from data import ensure_tree  # noqa: E402
from pinning import Pinning, pin_process  # noqa: E402
from procs import (  # noqa: E402
    CLOCK_TICKS,
    DaemonProbe,
    EpochRunner,
    cpu_seconds,
    drop_page_cache,
    force_unmount,
    run_to_the_end,
    start_store,
    wait_until,
)
from report import write_reports  # noqa: E402
from small_cache import parse_args as small_cache_args  # noqa: E402
from small_cache import run_section as run_small_cache  # noqa: E402
from support.s3 import REGION, S3Server, settled_counts  # noqa: E402

BUCKET = "bench"
WDS_PREFIX = "data"  # webdataset-format shards: s3://bench/data/train/*.tar
TREE_PREFIX = "tree"  # tree-format shards (CLASS/FILE members): s3://bench/tree/train/*.tar
SKIPPED_MOSAIC = (
    "mosaic streaming skipped: mosaicml-streaming 0.13 does install from PyPI here, but it "
    "pulls transformers, azure/gcs/oci SDKs and downgrades numpy 2.4.6 -> 2.1.3 in the "
    "project venv; not worth it for an optional contender"
)


def log(text: str) -> None:
    print(f"bench: {text}", file=sys.stderr, flush=True)


def shardfs(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, "-m", "shardfs", *args], capture_output=True, text=True, check=False
    )
    if check and result.returncode != 0:
        raise RuntimeError(f"shardfs {' '.join(args)} failed: {result.stderr.strip()}")
    return result


# The contenders whose ratios come from paired runs (report.py's targets), and those whose raw
# cold epoch is also paired with a fresh measurement of the server's peak.
PAIRED = ("shardfs", "shardfs-shard", "shardfs-uniform", "webdataset")
PEAK_PAIRED = ("shardfs", "shardfs-shard")
# HintCounters' sampling: every SAMPLE_DENSE_S for the first DENSE_S of an epoch (where the
# first shard's READs end), every SAMPLE_SPARSE_S after.
DENSE_S, SAMPLE_DENSE_S, SAMPLE_SPARSE_S = 3.0, 0.05, 0.25


@dataclass(frozen=True)
class Slot:
    """One contender run: mode, worker count and round. ``paired``: every epoch of the run
    comes right after a local epoch with the same seed (and a raw cold one after a fresh
    peak measurement), so each ratio compares neighbours in time. ``context``: rows kept
    only for context (remount) run this round too."""

    mode: str
    workers: int
    repeat: int
    paired: bool = False
    context: bool = True


class HintCounters:
    """The mount's hint counters sampled through one epoch (control socket), from a thread
    on ``cores`` (the store's, when pinned): every 50 ms for the first ``DENSE_S`` (where
    the first shard's READs end), then every 250 ms. Sampling every 20 ms from the readers'
    core cost that core about 0.1 s per 600-image epoch, the daemon's answers (50-64 ms)
    and this process's own, in every shard and uniform epoch (stop 43); and the daemon
    answers on the readers' core wherever this thread runs: every 50 ms through a
    5,000-image epoch, its control thread took 0.10 s per 10 s of a warm epoch there
    (perf, stop 44).

    Most files never reach the daemon as READs: it pushes each file into the kernel's page
    cache once its block is local (``bytes_pushed``), and a pushed file cannot wait on the
    network. So the daemon's ``hinted_reads`` are only the READs the kernel did not have
    yet. Two shares are kept: waited / images read in the epoch over the whole epoch (an
    upper bound for the share after the first shard), and waited / hinted READs after the
    first 1/shards of the hinted READs (the counters' own axis; small denominators)."""

    def __init__(self, mountpoint: Path, cores: frozenset[int] | None = None) -> None:
        self.mountpoint = mountpoint
        self.cores = cores
        self.samples: list[tuple[int, int]] = []  # (hinted_reads, reads_waited_on_network)
        self.hints = [0, 0]  # hints_taken before and after
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="hint-counters", daemon=True)

    def _sample(self) -> None:
        from shardfs.mount.control import query

        stats = query(self.mountpoint)
        self.hints = [self.hints[0] if self.samples else stats["hints_taken"], stats["hints_taken"]]
        self.samples.append((int(stats["hinted_reads"]), int(stats["reads_waited_on_network"])))

    def _poll(self) -> None:
        if self.cores:
            os.sched_setaffinity(0, self.cores)  # this thread only
        dense_until = time.monotonic() + DENSE_S
        while not self._stop.wait(
            SAMPLE_DENSE_S if time.monotonic() < dense_until else SAMPLE_SPARSE_S
        ):
            self._sample()

    def __enter__(self) -> HintCounters:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def summary(self, shards: int, images: int) -> dict[str, Any]:
        (hinted0, waited0), (hinted1, waited1) = self.samples[0], self.samples[-1]
        hinted, waited = hinted1 - hinted0, waited1 - waited0
        first = hinted0 + hinted / max(shards, 1)
        after = next(((h, w) for h, w in self.samples if h >= first), self.samples[-1])
        hinted_after, waited_after = hinted1 - after[0], waited1 - after[1]
        return {
            "hints_taken": self.hints[1] - self.hints[0],
            "waited_share_of_images": waited / images if images else None,
            "hinted_reads": hinted,
            "reads_waited_on_network": waited,
            "hinted_reads_after_first_shard": hinted_after,
            "reads_waited_after_first_shard": waited_after,
            "waited_share_after_first_shard": (
                waited_after / hinted_after if hinted_after else None
            ),
        }


def cpu_with_children(pid: int) -> tuple[float, float]:
    """(own, reaped children's) user + system CPU seconds of ``pid``: for the epoch runner,
    the main process and its DataLoader workers (reaped when the epoch's iterator ends)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    own = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    children = (int(fields[13]) + int(fields[14])) / CLOCK_TICKS
    return own, children


def page_cache_drops() -> int:
    """Writes to /proc/sys/vm/drop_caches so far, by anyone on this machine: a drop during a
    warm epoch or during kernel pushes makes the daemon serve the bytes again, so the bench
    records how many fell inside each epoch."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/vmstat").read_text().splitlines():
            if line.startswith("drop_pagecache "):
                return int(line.split()[1])
    return 0


class CpuAccount:
    """CPU seconds per process over one epoch: the S3 server, the shardfs daemon, the
    epoch's main process, its workers, and this process's reaped children (curl)."""

    def __init__(self, server_pid: int, runner_pid: int, daemon_pid: int | None) -> None:
        self.server_pid, self.runner_pid, self.daemon_pid = server_pid, runner_pid, daemon_pid

    def _sample(self) -> dict[str, float]:
        main, workers = cpu_with_children(self.runner_pid)
        own = os.times()
        sample = {
            "server": cpu_seconds(self.server_pid),
            "main": main,
            "workers": workers,
            "bench_children": own.children_user + own.children_system,
            "bench": own.user + own.system,
            "wall": time.perf_counter(),
        }
        if self.daemon_pid is not None:
            sample["daemon"] = cpu_seconds(self.daemon_pid)
        return sample

    def start(self) -> None:
        self._before = self._sample()

    def stop(self) -> dict[str, float]:
        after = self._sample()
        return {key: after[key] - self._before[key] for key in after}


class Bench:
    """Holds the server, the runner and whatever is mounted, so cleanup can find them all."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        # The run's setting; ``self.cores`` is the one the epochs run under now (the
        # shared-core context rounds switch it at the end of a pinned run).
        self.pinning = Pinning.shared() if args.shared_cores else Pinning.split()
        self.cores = self.pinning
        self.work: Path = args.work.absolute()
        self.run_dir = self.work / "run"
        self.server = S3Server()
        self.runner: EpochRunner | None = None
        self.mounts: set[Path] = set()
        self.daemons: list[subprocess.Popen[bytes]] = []
        # The pack destination itself: its sidecar sits there, so a fresh mount scans nothing.
        self.shardfs_source = f"s3://{BUCKET}/{WDS_PREFIX}/train"
        self.records: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self.meta: dict[str, Any] = {}

    # -- setup -------------------------------------------------------------

    def setup(self) -> None:
        # First of all, this process on the readers' cores: all it starts inherits them
        # (the epoch runner, its workers, the daemons, curl); the server then moves to
        # the store's.
        self.pinning.pin_self_to_readers()
        shutil.rmtree(self.run_dir, ignore_errors=True)
        self.run_dir.mkdir(parents=True)
        self.tree = ensure_tree(self.work, self.args.images, self.args.classes, log)
        self.server_pid = start_store(self.server, self.pinning)
        log(f"cores: {self.pinning.label()}")
        os.environ.update(self.server.env())
        self.server.create_bucket(BUCKET)
        shard_size = max(1 << 20, self.tree.image_bytes // self.args.shards)
        for prefix, fmt in ((WDS_PREFIX, "webdataset"), (TREE_PREFIX, "tree")):
            started = time.perf_counter()
            shardfs(
                "pack",
                str(self.tree.root),
                f"s3://{BUCKET}/{prefix}/train",
                "--format",
                fmt,
                "--shard-size",
                str(shard_size),
                "--shuffle-seed",
                "0",
                "--cache-dir",
                str(self.run_dir / "pack-cache"),
            )
            log(
                f"packed {fmt} shards into s3://{BUCKET}/{prefix}/train in "
                f"{time.perf_counter() - started:.1f} s"
            )
        fs = self.server.filesystem()
        self.wds_shards = sorted(fs.glob(f"{BUCKET}/{WDS_PREFIX}/train/*.tar"))
        self.tree_shards = sorted(fs.glob(f"{BUCKET}/{TREE_PREFIX}/train/*.tar"))
        self.wds_sizes = [fs.size(p) for p in self.wds_shards]
        self.shard_bytes = sum(self.wds_sizes)
        self.tree_shard_bytes = sum(fs.size(p) for p in self.tree_shards)
        self.meta.update(
            images=self.tree.images,
            classes=self.tree.classes,
            image_bytes=self.tree.image_bytes,
            mean_image_bytes=self.tree.image_bytes / self.tree.images,
            jpeg_quality=self.tree.quality,
            shards=len(self.wds_shards),
            shard_bytes=self.shard_bytes,
            tree_shards=len(self.tree_shards),
            tree_shard_bytes=self.tree_shard_bytes,
            shard_size=shard_size,
        )
        log(
            f"{len(self.wds_shards)} webdataset shards ({self.shard_bytes / 1e6:.0f} MB), "
            f"{len(self.tree_shards)} tree shards"
        )
        self.runner = EpochRunner()

    # -- cleanup -----------------------------------------------------------

    def cleanup(self) -> None:
        for mountpoint in list(self.mounts):
            force_unmount(mountpoint)
        for proc in self.daemons:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
        if self.runner is not None:
            self.runner.close()
        self.server.stop()

    # -- server measurements ------------------------------------------------

    def peak_throughput(self) -> dict[str, Any]:
        """Many concurrent 8 MiB ranged GETs over the shards; MB/s per thread count."""
        fs = self.server.filesystem()
        block = 8 << 20
        ranges = [
            (path, start, min(start + block, fs.size(path)))
            for path in self.wds_shards
            for start in range(0, fs.size(path), block)
        ]
        budget = self.args.peak_mb << 20
        chosen, total = [], 0
        for item in ranges:
            if total >= budget:
                break
            chosen.append(item)
            total += item[2] - item[1]
        rows = {}
        for threads in (1, 4, 8):

            def get(item: tuple[str, int, int]) -> int:
                return len(fs.cat_file(item[0], start=item[1], end=item[2]))

            started = time.perf_counter()
            with ThreadPoolExecutor(threads) as pool:
                got = sum(pool.map(get, chosen))
            rows[str(threads)] = got / (time.perf_counter() - started) / 1e6
        return {"mb_per_s_by_threads": rows, "peak_mb_per_s": max(rows.values())}

    def warm_all(self) -> dict[str, Any]:
        cache = self.run_dir / "cache-warm"
        shutil.rmtree(cache, ignore_errors=True)
        self.server.reset_counts()
        started = time.perf_counter()
        out = shardfs("warm", self.shardfs_source, "--cache-dir", str(cache))
        seconds = time.perf_counter() - started
        counts = settled_counts(self.server)
        shutil.rmtree(cache, ignore_errors=True)
        return {
            "seconds": seconds,
            "egress_bytes": counts["get_object_bytes"],
            "summary": out.stdout.strip(),
        }

    def prefetch_all_fill(self) -> dict[str, Any]:
        """Mount with ``--prefetch all`` on an empty cache and time how long the whole dataset
        takes to reach the cache: from the mount command's return (the daemon starts
        prefetching when it is ready) and from its start, until the daemon has fetched
        every shard byte and written every block (polled over its control socket every
        20 ms)."""
        from shardfs.mount.control import query

        cache = self.run_dir / "cache-prefetch-all"
        shutil.rmtree(cache, ignore_errors=True)
        mnt = self.run_dir / "mnt-prefetch-all"
        mnt.mkdir(exist_ok=True)
        self.server.reset_counts()
        started = time.perf_counter()
        self.mounts.add(mnt)
        shardfs("mount", self.shardfs_source, str(mnt), "--cache-dir", str(cache),
                "--prefetch", "all", *self.args.shardfs_arg)  # fmt: skip
        ready = time.perf_counter()
        try:
            while not self._cache_full(query(mnt)):
                if time.perf_counter() - ready > 600:
                    raise RuntimeError("--prefetch all did not fill the cache in 10 minutes")
                time.sleep(0.02)
            done = time.perf_counter()
        finally:
            shardfs("umount", str(mnt))
            self.mounts.discard(mnt)
        counts = settled_counts(self.server)
        shutil.rmtree(cache, ignore_errors=True)
        return {
            "fill_s": done - ready,
            "with_mount_s": done - started,
            "egress_bytes": counts["get_object_bytes"],
        }

    def _cache_full(self, stats: dict[str, Any]) -> bool:
        """Every shard byte fetched and every block written to the cache."""
        block = int(stats["block_size"])
        blocks = sum(-(-size // block) for size in self.wds_sizes)
        return bool(
            stats["bytes_fetched"] >= self.shard_bytes and stats["blocks_written"] >= blocks
        )

    # -- epochs --------------------------------------------------------------

    def epoch(
        self,
        contender: str,
        epoch: str,
        request: dict[str, Any],
        pid: int | None,
        extra: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        assert self.runner is not None
        probe = DaemonProbe(pid)
        cpu = CpuAccount(self.server_pid, self.runner.proc.pid, pid)
        self.server.reset_counts()
        probe.start()
        drops = page_cache_drops()
        cpu.start()
        result = self.runner.run(request)
        cpu_s = cpu.stop()
        drops = page_cache_drops() - drops
        counts = settled_counts(self.server)
        record = {
            "contender": contender,
            "mode": request["mode"],
            "workers": request["workers"],
            "epoch": epoch,
            **result,
            "images_per_s": result["images"] / result["seconds"],
            "mb_per_s": result["bytes"] / result["seconds"] / 1e6,
            "egress_bytes": counts["get_object_bytes"],
            "egress_requests": counts["get_object_requests"],
            **probe.stop(),
            "cpu_s": cpu_s,
            "page_cache_drops": drops,
            "cores": "pinned" if self.cores.pinned else "shared",
            **self.placement(pid),
            **(extra or {}),
        }
        if drops:
            self.notes.append(
                f"{contender} {request['mode']} w{request['workers']} {epoch}: the page cache "
                f"was dropped {drops} times during the epoch (another process on the machine)"
            )
        if result["images"] != self.tree.images:
            self.notes.append(
                f"{contender} {request['mode']} w{request['workers']} {epoch}: read "
                f"{result['images']} images, expected {self.tree.images}"
            )
        self.records.append(record)
        log(
            f"{contender:<10} {request['mode']:<6} w{request['workers']} {epoch:<7} "
            f"{record['images_per_s']:7.0f} img/s {record['mb_per_s']:6.1f} MB/s "
            f"egress {record['egress_bytes'] / 1e6:6.1f} MB"
            + (f" daemon {record['daemon_cpu_s']:.1f} s CPU" if pid else "")
            + " cpu "
            + " ".join(f"{key}={value:.2f}" for key, value in cpu_s.items())
        )
        return record

    def placement(self, daemon_pid: int | None) -> dict[str, Any]:
        """The cores the server, the epoch runner (its workers fork from it) and the daemon
        may run on at the end of an epoch, and which of them are not where ``self.cores``
        puts them (a note each)."""
        assert self.runner is not None
        readers = {"runner": self.runner.proc.pid, "daemon": daemon_pid}
        placement = self.cores.placement({"server": self.server_pid}, readers)
        if placement["misplaced"]:
            self.notes.append("misplaced: " + "; ".join(placement["misplaced"]))
        return placement

    def use_cores(self, cores: Pinning) -> None:
        """Move this process, the epoch runner and the server to ``cores`` (daemons started
        from now on follow this process)."""
        assert self.runner is not None
        cores.pin_self_to_readers()
        pin_process(self.runner.proc.pid, cores.readers, children=True)
        cores.pin_store(self.server_pid)
        self.cores = cores
        log(f"cores: {cores.label()}")

    def local_request(self, mode: str, workers: int, repeat: int) -> dict[str, Any]:
        return {
            "kind": "imagefolder",
            "root": str(self.tree.root),
            "mode": mode,
            "workers": workers,
            "seed": repeat,
        }

    def run_local(self, slot: Slot) -> None:
        request = self.local_request(slot.mode, slot.workers, slot.repeat)
        self.epoch("local", "-", request, None, {"repeat": slot.repeat})

    def pair_before(
        self, slot: Slot, contender: str, epoch: str, request: dict[str, Any]
    ) -> dict[str, Any]:
        """In a paired slot, the local epoch (same mode, workers and seed) run right before
        ``contender``'s ``epoch``; before a cold epoch, first a local one right after
        ``drop_caches`` (epoch "dropped"), then the warm one; for a raw cold epoch of
        ``PEAK_PAIRED`` a fresh peak measurement last: the fields that tie the
        contender's record to them."""
        if not slot.paired:
            return {}
        local_request = self.local_request(slot.mode, slot.workers, slot.repeat)
        extra = {"repeat": slot.repeat, "pair_for": f"{contender} {epoch}"}
        dropped = None
        if epoch in ("cold", "recached"):
            drop_page_cache()
            dropped = self.epoch("local", "dropped", local_request, None, dict(extra))
        local = self.epoch("local", "-", local_request, None, dict(extra))
        fields: dict[str, Any] = {"pair_local_images_per_s": local["images_per_s"]}
        if dropped is not None:
            # The dropped epoch's own pair: the warm local epoch right after it.
            dropped["pair_local_images_per_s"] = local["images_per_s"]
            fields["pair_local_dropped_images_per_s"] = dropped["images_per_s"]
        if slot.mode == "raw" and epoch == "cold" and contender in PEAK_PAIRED:
            peak = self.peak_throughput()
            log(f"pair peak: {peak['peak_mb_per_s']:.0f} MB/s")
            fields.update(
                pair_peak_mb_per_s=peak["peak_mb_per_s"],
                pair_peak_by_threads=peak["mb_per_s_by_threads"],
            )
        return fields

    def run_local_download(self, slot: Slot) -> None:
        """The ceiling for any loader that downloads: ImageFolder on the local tree while curl
        fetches every shard from the server once (two at a time, to /dev/null) in the same
        run. The server's and the client's CPU for the download is then taken from the same
        two cores as the epoch, as it is for every streaming contender."""
        command = ["curl", "--silent", "--show-error", "--fail", "--parallel",
                   "--parallel-max", "2"]  # fmt: skip
        for url in self.presigned_urls():
            command += ["--output", os.devnull, url]
        self._local_while_downloading("local+dl", "curl", command, slot)

    def run_local_warm(self, slot: Slot) -> None:
        """The ceiling for shardfs's own download path: ImageFolder on the local tree while
        ``shardfs warm`` fetches every block into a fresh cache (the daemon's ranged GETs,
        checks and block writes, without FUSE or readers). The gap between this and
        ``local+dl`` is the CPU that path costs on these two cores, server's included."""
        if slot.mode != "decode":
            return
        cache = self.run_dir / "cache-local-warm"
        shutil.rmtree(cache, ignore_errors=True)
        command = [sys.executable, "-m", "shardfs", "warm", self.shardfs_source,
                   "--cache-dir", str(cache)]  # fmt: skip
        try:
            self._local_while_downloading("local+warm", "warm", command, slot)
        finally:
            shutil.rmtree(cache, ignore_errors=True)

    def _local_while_downloading(
        self, contender: str, tool: str, command: list[str], slot: Slot
    ) -> None:
        """A local epoch while ``command`` downloads the dataset; its CPU and time recorded."""
        mode, workers, repeat = slot.mode, slot.workers, slot.repeat
        request = self.local_request(mode, workers, repeat)
        started = time.perf_counter()
        children_before = os.times()
        download = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        try:
            record = self.epoch(contender, "-", request, None, {"repeat": repeat})
            _, error = download.communicate(timeout=600)
        finally:
            if download.poll() is None:
                download.kill()
                download.wait()
        if download.returncode != 0:
            raise RuntimeError(f"{tool} download failed: {error.strip()}")
        record["download_s"] = time.perf_counter() - started
        children_after = os.times()
        record["cpu_s"][tool] = sum(
            after - before
            for after, before in zip(children_after[2:4], children_before[2:4], strict=True)
        )
        if record["egress_bytes"] < self.shard_bytes:
            self.notes.append(
                f"{contender} {mode} w{workers}: downloaded {record['egress_bytes']} bytes, "
                f"expected {self.shard_bytes}"
            )

    @contextmanager
    def shardfs_mount(self, cache: Path) -> Iterator[tuple[int, float]]:
        from shardfs.mount.control import pid_file

        mnt = self.run_dir / "mnt-shardfs"
        mnt.mkdir(exist_ok=True)
        started = time.perf_counter()
        self.mounts.add(mnt)
        shardfs(
            "mount",
            self.shardfs_source,
            str(mnt),
            "--cache-dir",
            str(cache),
            *self.args.shardfs_arg,
        )
        seconds = time.perf_counter() - started
        pid = int(pid_file(mnt).read_text())
        try:
            yield pid, seconds
        finally:
            shardfs("umount", str(mnt))
            self.mounts.discard(mnt)

    def run_shardfs(self, slot: Slot) -> None:
        """A cold epoch on an empty cache, a warm one on the same mount, and (context) an
        epoch after a remount; a paired slot puts a local epoch before the cold and the
        warm one (the mount sits idle meanwhile)."""
        repeat = slot.repeat
        cache = self.run_dir / "cache-shardfs"
        shutil.rmtree(cache, ignore_errors=True)
        request = {
            "kind": "imagefolder",
            "root": str(self.run_dir / "mnt-shardfs"),
            "mode": slot.mode,
            "workers": slot.workers,
            "seed": repeat,
        }
        self.server.reset_counts()
        with self.shardfs_mount(cache) as (pid, seconds):
            mount_bytes = self.server.counts()["get_object_bytes"]
            extra = {"repeat": repeat, "mount_s": seconds, "mount_egress_bytes": mount_bytes}
            extra.update(self.pair_before(slot, "shardfs", "cold", request))
            self.epoch("shardfs", "cold", request, pid, extra)
            extra = {"repeat": repeat, **self.pair_before(slot, "shardfs", "warm", request)}
            self.epoch("shardfs", "warm", request, pid, extra)
        if not slot.context:
            shutil.rmtree(cache, ignore_errors=True)
            return
        self.server.reset_counts()
        with self.shardfs_mount(cache) as (pid, seconds):
            mount_bytes = self.server.counts()["get_object_bytes"]
            self.epoch(
                "shardfs",
                "remount",
                request,
                pid,
                {"repeat": repeat, "mount_s": seconds, "mount_egress_bytes": mount_bytes},
            )
        shutil.rmtree(cache, ignore_errors=True)

    def run_shardfs_sampler(self, sampler: str, slot: Slot) -> None:
        """shardfs read through ``ShardSampler(mode=sampler)``: a cold epoch on an empty
        cache, and (shard mode) a warm one on the same mount, the next epoch of the order,
        then a *recached* one, the epoch after, with the page cache dropped first: every
        file read back from the cache's blocks, as each epoch of a dataset larger than RAM
        is. In a paired slot each after a local epoch (the cold and recached ones after a
        local one right after ``drop_caches`` too)."""
        mode, workers, repeat = slot.mode, slot.workers, slot.repeat
        contender = f"shardfs-{sampler}"
        cache = self.run_dir / f"cache-{contender}"
        shutil.rmtree(cache, ignore_errors=True)
        request = {
            "kind": "imagefolder",
            "root": str(self.run_dir / "mnt-shardfs"),
            "mode": mode,
            "workers": workers,
            "seed": repeat,
            "sampler": sampler,
        }
        epochs = ("cold", "warm", "recached") if sampler == "shard" else ("cold",)
        self.server.reset_counts()
        with self.shardfs_mount(cache) as (pid, seconds):
            mount_bytes = self.server.counts()["get_object_bytes"]
            for number, epoch in enumerate(epochs):
                extra: dict[str, Any] = {"repeat": repeat}
                if epoch == "cold":
                    extra.update(mount_s=seconds, mount_egress_bytes=mount_bytes)
                extra.update(self.pair_before(slot, contender, epoch, request))
                if epoch == "recached":
                    drop_page_cache()  # the pair's local epochs came after the warm one
                away = self.pinning.store if self.pinning.pinned else None
                with HintCounters(self.run_dir / "mnt-shardfs", away) as counters:
                    record = self.epoch(
                        contender, epoch, {**request, "sampler_epoch": number}, pid, extra
                    )
                record.update(counters.summary(self.meta["shards"], record["images"]))
        shutil.rmtree(cache, ignore_errors=True)

    def presigned_urls(self) -> list[str]:
        import boto3

        client = boto3.client("s3", endpoint_url=self.server.endpoint, region_name=REGION)
        return [
            client.generate_presigned_url(
                "get_object",
                Params={"Bucket": BUCKET, "Key": path.split("/", 1)[1]},
                ExpiresIn=7 * 24 * 3600,
            )
            for path in self.wds_shards
        ]

    def run_webdataset(self, slot: Slot) -> None:
        mode, workers, repeat = slot.mode, slot.workers, slot.repeat
        cache = self.run_dir / "cache-wds"
        shutil.rmtree(cache, ignore_errors=True)
        cache.mkdir()
        request = {
            "kind": "webdataset",
            "urls": self.presigned_urls(),
            "cache_dir": str(cache),
            "mode": mode,
            "workers": workers,
            "seed": repeat,
        }
        for epoch in ("cold", "warm"):
            extra = {"repeat": repeat, **self.pair_before(slot, "webdataset", epoch, request)}
            self.epoch("webdataset", epoch, request, None, extra)
        shutil.rmtree(cache, ignore_errors=True)

    @contextmanager
    def ratarmount_mount(self, index_dir: Path) -> Iterator[tuple[int, float]]:
        mnt = self.run_dir / "mnt-ratarmount"
        mnt.mkdir(exist_ok=True)
        urls = [f"s3://{path}" for path in self.tree_shards]
        log_file = open(self.run_dir / "ratarmount.log", "ab")  # noqa: SIM115
        started = time.perf_counter()
        proc = subprocess.Popen(
            [
                str(Path(sys.executable).with_name("ratarmount")),
                "-f",
                "--index-folders",
                str(index_dir),
                "--index-minimum-file-count",
                "0",
                *urls,
                str(mnt),
            ],
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=log_file,
        )
        self.daemons.append(proc)
        self.mounts.add(mnt)
        try:

            def ready() -> bool:
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"ratarmount exited with {proc.returncode}; see {log_file.name}"
                    )
                return os.path.ismount(mnt)

            wait_until(ready, "the ratarmount mount", timeout=600)
            yield proc.pid, time.perf_counter() - started
        finally:
            force_unmount(mnt)
            self.mounts.discard(mnt)
            try:
                proc.wait(10)  # it exits by itself once unmounted
            except subprocess.TimeoutExpired:
                proc.terminate()  # e.g. interrupted while it was still indexing
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
            force_unmount(mnt)  # it may have finished mounting after the first attempt
            log_file.close()

    def run_ratarmount(self, slot: Slot) -> None:
        mode, workers, repeat = slot.mode, slot.workers, slot.repeat
        index_dir = self.run_dir / "ratarmount-index"
        shutil.rmtree(index_dir, ignore_errors=True)
        index_dir.mkdir()
        request = {
            "kind": "imagefolder",
            "root": str(self.run_dir / "mnt-ratarmount"),
            "mode": mode,
            "workers": workers,
            "seed": repeat,
        }
        self.server.reset_counts()
        with self.ratarmount_mount(index_dir) as (pid, seconds):
            mount_bytes = settled_counts(self.server)["get_object_bytes"]
            self.epoch(
                "ratarmount",
                "cold",
                request,
                pid,
                {"repeat": repeat, "mount_s": seconds, "mount_egress_bytes": mount_bytes},
            )
            self.epoch("ratarmount", "warm", request, pid, {"repeat": repeat})
        self.server.reset_counts()
        with self.ratarmount_mount(index_dir) as (pid, seconds):
            mount_bytes = settled_counts(self.server)["get_object_bytes"]
            self.epoch(
                "ratarmount",
                "remount",
                request,
                pid,
                {"repeat": repeat, "mount_s": seconds, "mount_egress_bytes": mount_bytes},
            )
        shutil.rmtree(index_dir, ignore_errors=True)

    # -- the whole run -----------------------------------------------------------

    def contenders(self) -> dict[str, Callable[[Slot], None]]:
        everyone: dict[str, Callable[[Slot], None]] = {
            "local": self.run_local,
            "local+dl": self.run_local_download,
            "local+warm": self.run_local_warm,
            "shardfs": self.run_shardfs,
            "shardfs-shard": lambda slot: self.run_shardfs_sampler("shard", slot),
            "shardfs-uniform": lambda slot: self.run_shardfs_sampler("uniform", slot),
            "webdataset": self.run_webdataset,
            "ratarmount": self.run_ratarmount,
        }
        return {name: run for name, run in everyone.items() if name in self.args.contenders}

    def slot(self, name: str, mode: str, workers: int, repeat: int) -> Slot | None:
        """Whether ``name`` runs in this round, and how. At the first worker count (the one
        the targets name) the ``PAIRED`` contenders run ``--pairs`` paired rounds and the
        others, context only, ``--repeats``; other worker counts run
        ``--secondary-repeats`` unpaired rounds of everyone."""
        if workers != self.args.workers[0]:
            if repeat >= self.args.secondary_repeats:
                return None
            return Slot(mode, workers, repeat)
        context = repeat < self.args.repeats
        if name in PAIRED:
            if repeat >= self.args.pairs:
                return None
            return Slot(mode, workers, repeat, paired=True, context=context)
        return Slot(mode, workers, repeat) if context else None

    def shared_context(
        self, contenders: list[tuple[str, Callable[[Slot], None]]], failed: set[str]
    ) -> None:
        """After a pinned run, ``--shared-context-rounds`` paired decode rounds of the paired
        contenders at the first worker count with every process on every core, as the
        bench ran before it pinned: rows kept as context, labelled "shared cores"."""
        rounds = self.args.shared_context_rounds
        if not self.pinning.pinned or rounds == 0 or "decode" not in self.args.modes:
            return
        self.use_cores(Pinning.shared())
        try:
            for repeat in range(rounds):
                for name, run in contenders:
                    if name in PAIRED and name not in failed:
                        run(Slot("decode", self.args.workers[0], repeat, True, context=False))
        finally:
            self.use_cores(self.pinning)

    def run(self) -> dict[str, Any]:
        started = time.perf_counter()
        self.setup()
        peaks = [self.peak_throughput()]
        log(f"server peak: {peaks[0]['mb_per_s_by_threads']} MB/s by threads")
        warms = []
        contenders = list(self.contenders().items())
        failed: set[str] = set()
        fills = []
        for repeat in range(max(self.args.pairs, self.args.repeats)):
            warms.append(self.warm_all())
            log(f"shardfs warm: {warms[-1]['seconds']:.1f} s")
            fills.append(self.prefetch_all_fill())
            log(
                f"--prefetch all: cache full {fills[-1]['fill_s']:.1f} s after the mount was "
                f"ready ({fills[-1]['with_mount_s']:.1f} s with the mount)"
            )
            for workers in self.args.workers:
                for mode in self.args.modes:
                    shift = repeat % len(contenders)
                    for name, run in contenders[shift:] + contenders[:shift]:
                        slot = self.slot(name, mode, workers, repeat)
                        if name in failed or slot is None:
                            continue
                        try:
                            run(slot)
                        except (RuntimeError, OSError) as exc:  # e.g. ratarmount missing
                            failed.add(name)
                            self.notes.append(f"{name} failed and was dropped: {exc}")
                            log(f"{name} failed and is dropped from the run: {exc}")
        self.shared_context(contenders, failed)
        peaks.append(self.peak_throughput())
        peak = max(p["peak_mb_per_s"] for p in peaks)
        warm_seconds = statistics.median(w["seconds"] for w in warms)
        ideal = self.shard_bytes / (peak * 1e6)
        self.notes.append(SKIPPED_MOSAIC)
        return {
            "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
            "machine": {
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "kernel": platform.release(),
            },
            "pinning": {**self.pinning.as_dict(), "label": self.pinning.label()},
            "shared_context_rounds": (
                self.args.shared_context_rounds if self.pinning.pinned else 0
            ),
            "dataset": self.meta,
            "server": {"peak_runs": peaks, "peak_mb_per_s": peak},
            "warm_all": {
                "runs": warms,
                "median_s": warm_seconds,
                "ideal_s": ideal,
                "ratio_to_ideal": warm_seconds / ideal,
            },
            "prefetch_all": {
                "runs": fills,
                "median_fill_s": statistics.median(f["fill_s"] for f in fills),
                "median_with_mount_s": statistics.median(f["with_mount_s"] for f in fills),
                "ideal_s": ideal,
                "ratio_to_ideal": statistics.median(f["fill_s"] for f in fills) / ideal,
            },
            "epochs": self.records,
            "notes": self.notes,
            "total_s": time.perf_counter() - started,
        }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, help="images (5000; --quick: 600)")
    parser.add_argument("--classes", type=int, default=12, help="classes (12)")
    parser.add_argument("--shards", type=int, default=12, help="about this many shards (12)")
    parser.add_argument(
        "--pairs",
        type=int,
        help="paired rounds of the shardfs contenders and webdataset at the first worker "
        "count: each epoch right after a local one (a cold one also after a local one "
        "right after drop_caches); the targets need 5 (5; --quick: 2)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        help="rounds of the context rows at the first worker count: local alone, local+dl, "
        "local+warm, ratarmount, shardfs remount (2; --quick: 1)",
    )
    parser.add_argument(
        "--secondary-repeats", type=int, default=1, help="rounds for the other worker counts (1)"
    )
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--modes", nargs="+", default=["decode", "raw"], choices=["decode", "raw"])
    parser.add_argument(
        "--contenders",
        nargs="+",
        default=[
            "local",
            "local+dl",
            "local+warm",
            "shardfs",
            "shardfs-shard",
            "shardfs-uniform",
            "webdataset",
            "ratarmount",
        ],
    )
    parser.add_argument(
        "--peak-mb",
        type=int,
        help="MiB read per thread count when measuring server peak (512; --quick: 64)",
    )
    parser.add_argument(
        "--shardfs-arg",
        action="append",
        default=[],
        help="extra argument for shardfs mount (repeatable)",
    )
    parser.add_argument(
        "--shared-cores",
        action="store_true",
        help="run every process on every core, the server among the readers, as the bench "
        "did before it pinned (figures for context only); by default the server runs on "
        "the last core and everything else on the others (bench/pinning.py)",
    )
    parser.add_argument(
        "--shared-context-rounds",
        type=int,
        default=1,
        help="after a pinned run, paired decode rounds of the paired contenders on shared "
        "cores, reported apart as context (1; 0: none)",
    )
    parser.add_argument(
        "--no-small-cache",
        action="store_true",
        help="skip the small-cache section (bench/small_cache.py, `make bench-small`)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: smaller defaults (600 images, 2 pairs)"
    )
    parser.add_argument(
        "--work",
        type=Path,
        default=ROOT / "results" / "tmp",
        help="work folder; the generated tree is cached here (results/tmp)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "results")
    args = parser.parse_args(argv)
    # --quick changes the defaults only: an option given on the command line wins.
    defaults = {"images": (5000, 600), "pairs": (5, 2), "repeats": (2, 1), "peak_mb": (512, 64)}
    for name, (full, quick) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run_to_the_end(Bench(args), log)
    if result is None:
        return 130
    if not args.no_small_cache:
        # Its own server, dataset and mounts; quick: 600 images in blocks of 2 MiB.
        extra = ["--images", "600", "--block-size", "2M"] if args.quick else []
        extra += [f"--shardfs-arg={arg}" for arg in args.shardfs_arg]
        extra += ["--shared-cores"] if args.shared_cores else []
        small = run_small_cache(
            small_cache_args([*extra, "--work", str(args.work), "--out", str(args.out)])
        )
        if small is None:
            return 130
        result["small_cache"] = small
    table = write_reports(result, args.out)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())

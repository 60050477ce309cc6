"""`make bench-stream`: cold epochs through a cache far smaller than the dataset (issue 21).

An ImageFolder of ~100 KB JPEGs (bench/data.py; 3,000 by default, ~300 MB) is packed into
about 12 webdataset shards on moto's S3 server behind the counting middleware. The server
runs on the last core, this process, the epoch runner (bench/epoch.py: DataLoader, decode =
RandomResizedCrop + ToTensor, 2 workers, batch 32) and every mount's daemon on the others
(bench/pinning.py). The page cache is dropped before every epoch but the warm local one.

Each round runs, in this order:

- local disk after ``drop_caches``, then warm (the ceilings);
- per sampler (``ShardSampler`` shard and uniform mode, plain ``shuffle=True``), a pair of
  cold epochs with the same seed, each on a fresh mount over an empty cache: ``--small``
  (0.15x the shard bytes) and ``--full`` (3x, a cache that holds everything), the order
  swapped every round;
- after the 0.15x epochs of uniform mode and of ``shuffle=True``, the store's ceiling for
  that epoch's own GETs, replayed by curl (8 at a time for uniform mode, like the mount's
  fetch streams; one per worker for ``shuffle=True``, which gives the mount no order);
- webdataset (curl pipes, shard shuffle, shuffle buffer; no cache);
- then, unless ``--no-shaped``, the same pairs and webdataset with the server shaped
  (``--latency-ms`` 20, ``--bandwidth-mb`` 100 per response: tests/support/moto_counting.py).

Per epoch: images/s, egress at the server over the shard bytes (mount's own fetches apart),
the bytes the server sent twice (offsets within a shard already sent that epoch), the
daemon's CPU and the mount's counters (``shardfs stats``) that tell why a read waited.
Per round: ratios small / full, full / local, webdataset / local, and each shaped ratio's
difference to the unshaped one of the same round; the targets are checked on their median
(and min-max) over the rounds. Writes streaming.json and streaming.md to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from data import ensure_tree  # noqa: E402
from kernel_profile import RATE, CoreProfile, annotate, profile_lines, reported_kib  # noqa: E402
from pinning import Pinning  # noqa: E402
from procs import (  # noqa: E402
    DaemonProbe,
    EpochRunner,
    core_seconds,
    cpu_seconds,
    drop_page_cache,
    force_unmount,
    pack_webdataset,
    run_to_the_end,
    start_store,
)
from procs import shardfs_cli as shardfs  # noqa: E402
from report import MIN_PAIRS, paired_verdict, target_table, write_section  # noqa: E402  # noqa: E402
from report import num as _num  # noqa: E402
from report import spread_of as _spread  # noqa: E402
from report import summary_lines as target_summary  # noqa: E402
from report import target_row as _check  # noqa: E402
from support.s3 import REGION, S3Server, repeats, settled_counts  # noqa: E402

from shardfs.config import ReadaheadConfig  # noqa: E402

BUCKET = "stream"
PREFIX = "data/train"
SAMPLERS = ("shard", "uniform", "random")  # random: DataLoader(shuffle=True)
MIN_BLOCKS = 4  # the mount refuses a cache under 4 blocks
# Samplers whose small-cache epochs are replayed to find the store's ceiling (one GET per
# file: the store's cost per request, not its bandwidth, bounds them), and how many of
# those GETs run at once: uniform mode fetches files ahead on the mount's fetch streams;
# a plain shuffle=True epoch gives the mount no order, so each file is fetched when its
# reader asks, one per DataLoader worker at a time (None: ``--workers``).
STREAMS = ReadaheadConfig().streams  # the mount's concurrent fetches, by default
CEILING_FOR: dict[str, int | None] = {"uniform": STREAMS, "random": None}
# The mount's counters kept per epoch (differences over the epoch): why a read waited.
COUNTERS = ("reads_waited_on_network", "files_fetched_ahead", "files_ahead_read",
            "blocks_evicted", "evicted_unread_bytes", "range_reads", "blocks_not_admitted",
            "bytes_fetched", "store_requests", "cache_misses", "bytes_pushed",
            "bytes_served", "blocks_kept_unstored", "blocks_paid_in_part", "python_reads",
            "hot_path_reads")  # fmt: skip
SHAPED_GOAL = 0.03  # every cold ratio under shaping within this of its unshaped value


def log(text: str) -> None:
    print(f"bench-stream: {text}", file=sys.stderr, flush=True)


def presigned_urls(server: S3Server, keys: list[str]) -> list[str]:
    """GET URLs for ``bucket/key`` paths, for curl (webdataset's http pipes)."""
    import boto3

    client = boto3.client("s3", endpoint_url=server.endpoint, region_name=REGION)
    return [
        client.generate_presigned_url(
            "get_object",
            Params={"Bucket": key.split("/", 1)[0], "Key": key.split("/", 1)[1]},
            ExpiresIn=7 * 24 * 3600,
        )
        for key in keys
    ]


class StreamingBench:
    """Holds the server, the epoch runner and the mount, so cleanup can find them."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.run_dir = args.work.absolute() / "streaming-run"
        self.mnt = self.run_dir / "mnt"
        self.server = S3Server()
        self.pinning = Pinning.split()
        self.runner: EpochRunner | None = None
        self.mounted = False
        self.records: list[dict[str, Any]] = []
        self.profile: CoreProfile | None = None

    def setup(self) -> None:
        shutil.rmtree(self.run_dir, ignore_errors=True)
        self.mnt.mkdir(parents=True)
        self.tree = ensure_tree(self.args.work.absolute(), self.args.images, self.args.classes, log)
        start_store(self.server, self.pinning)
        # From here on every process this one starts (runner, workers, daemons, curl)
        # runs on the readers' cores.
        self.pinning.pin_self_to_readers()
        os.environ.update(self.server.env())
        self.server.create_bucket(BUCKET)
        self.source = f"s3://{BUCKET}/{PREFIX}"
        pack_webdataset(self.tree, self.source, self.args.shards, self.run_dir / "pack-cache")
        fs = self.server.filesystem()
        keys = sorted(fs.glob(f"{BUCKET}/{PREFIX}/*.tar"))
        self.dataset_bytes = sum(fs.size(key) for key in keys)
        self.urls = presigned_urls(self.server, keys)
        self.url_of = dict(zip(keys, self.urls, strict=True))  # "bucket/key" -> its URL
        self.meta = {
            "images": self.tree.images,
            "classes": self.tree.classes,
            "image_bytes": self.tree.image_bytes,
            "shards": len(keys),
            "dataset_bytes": self.dataset_bytes,
            "block_size": self.args.block_size,
            "window": self.args.window,
        }
        block = self.args.block_size or 8 << 20
        if self.args.small * self.dataset_bytes < MIN_BLOCKS * block:
            raise RuntimeError(
                f"a cache of {self.args.small}x {self.dataset_bytes / 1e6:.0f} MB is under "
                f"{MIN_BLOCKS} blocks of {block >> 20} MiB, which the mount refuses; give "
                "more --images or a smaller --block-size"
            )
        log(f"{self.tree.images} JPEGs in {len(keys)} shards, {self.dataset_bytes / 1e6:.0f} MB")
        log(self.pinning.label())
        self.runner = EpochRunner()

    def cleanup(self) -> None:
        if self.profile is not None:
            self.profile.stop()
        if self.mounted:
            force_unmount(self.mnt)
        if self.runner is not None:
            self.runner.close()
        self.server.stop()

    @contextmanager
    def mount(self, cache_size: int) -> Iterator[int]:
        """A fresh mount over an empty cache; yields the daemon's pid."""
        from shardfs.mount.control import pid_file

        cache = self.run_dir / "cache"
        shutil.rmtree(cache, ignore_errors=True)
        block = ["--block-size", str(self.args.block_size)] if self.args.block_size else []
        self.mounted = True
        shardfs("mount", self.source, str(self.mnt), "--cache-dir", str(cache),
                "--cache-size", str(cache_size), *block, *self.args.shardfs_arg)  # fmt: skip
        try:
            yield int(pid_file(self.mnt).read_text())
        finally:
            shardfs("umount", str(self.mnt))
            self.mounted = False
            shutil.rmtree(cache, ignore_errors=True)

    def epoch(
        self, request: dict[str, Any], fields: dict[str, Any], pid: int | None = None
    ) -> dict[str, Any]:
        """One epoch, page cache dropped first unless ``fields`` say ``warm``."""
        from shardfs.mount.control import query

        assert self.runner is not None
        request = {"mode": "decode", "workers": self.args.workers, **request}
        settled_counts(self.server, timeout=120)  # the mount's own fetches are over
        if fields.get("epoch") != "warm":
            drop_page_cache()
        self.server.reset_counts()
        probe = DaemonProbe(pid)
        probe.start()
        store_pid = self.server.pid
        store_before = cpu_seconds(store_pid) if store_pid is not None else None
        before = query(self.mnt) if pid else {}
        cores_before = core_seconds(self.pinning.readers)
        handed_before = reported_kib()
        began = time.monotonic()
        reply = self.runner.run(request)
        ended = time.monotonic()
        handed_after = reported_kib()
        cores = core_seconds(self.pinning.readers)
        cores = {kind: cores[kind] - cores_before[kind] for kind in cores}
        after = query(self.mnt) if pid else {}
        store_cpu = None
        if store_pid is not None and store_before is not None:
            store_cpu = cpu_seconds(store_pid) - store_before
        counts = settled_counts(self.server, timeout=120)
        record = {
            **fields,
            **reply,
            "images_per_s": reply["images"] / reply["seconds"],
            "egress_bytes": counts["get_object_bytes"],
            "egress_requests": counts["get_object_requests"],
            "egress_ratio": counts["get_object_bytes"] / self.dataset_bytes,
            # Bytes whose offsets in their shard were already sent this epoch: paid twice.
            "refetched_bytes": counts.get("get_object_refetched_bytes"),
            # Which fetches those were, with the earlier ones they overlap (a few).
            "refetched": repeats(self.server.ranges_sent())[:10]
            if counts.get("get_object_refetched_bytes")
            else [],
            "counters": {key: after[key] - before[key] for key in COUNTERS} if pid else {},
            # The store's share of its core over the epoch: near 1.0, the store is the limit.
            "store_busy": None if store_cpu is None else store_cpu / reply["seconds"],
            # The readers' cores' time by kind (seconds); idle: nothing to run, readers
            # waiting on the store or the daemon.
            "readers_cores": cores,
            "monotonic": [began, ended],  # to line the epoch up with a profile
            "daemon_pid": pid,
            # Memory this VM handed back to its host meanwhile (bench/kernel_profile.py).
            "reported_mb": None
            if handed_before is None or handed_after is None
            else (handed_after - handed_before) / 1024,
            "readers_idle": cores["idle"] / (reply["seconds"] * len(self.pinning.readers)),
            **probe.stop(),
        }
        if reply["images"] != self.tree.images:
            raise RuntimeError(f"{fields}: read {reply['images']} of {self.tree.images} images")
        self.records.append(record)
        cpu = record["daemon_cpu_s"]
        log(
            f"round {fields['round']} {fields['contender']:<10} {fields['epoch']:<5} "
            f"{fields.get('cache', ''):<5} "
            f"{'shaped' if fields.get('shaped') else '':<6} {record['images_per_s']:5.0f} img/s"
            f" egress {record['egress_ratio']:.2f}x twice {record['refetched_bytes'] or 0} B"
            f" idle {record['readers_idle']:.2f}"
            f" cores {' '.join(f'{k} {v:.1f}' for k, v in cores.items())}"
            + (f" daemon {cpu:.1f} s CPU {record['counters']}" if cpu is not None else "")
        )
        return record

    def run_local(self, round_: int) -> None:
        request = {"kind": "imagefolder", "root": str(self.tree.root), "seed": round_}
        for epoch in ("dropped", "warm"):  # the dropped epoch leaves the tree page-cached
            self.epoch(request, {"contender": "local", "epoch": epoch, "round": round_})

    def run_floor(self, round_: int) -> None:
        """What any cold epoch must add on the readers' core, measured now: curl receiving
        every shard (webdataset's pipes; user + system CPU) and the page-cache fill of the
        same bytes (a tmpfs write, system CPU), both pinned where the readers run. A cold
        epoch's best is a warm epoch plus this: the limit its ratios are set against."""
        from per_file import children_cpu, run_probe

        command = ["curl", "--silent", "--show-error", "--fail", "--parallel",
                   "--parallel-max", "4"]  # fmt: skip
        for url in self.urls:
            command += ["--output", os.devnull, url]
        settled_counts(self.server, timeout=120)
        self.server.reset_counts()
        before = children_cpu()
        subprocess.run(command, check=True, capture_output=True)
        curl = sum(after - was for was, after in zip(before, children_cpu(), strict=True))
        got = settled_counts(self.server, timeout=120)["get_object_bytes"]
        if got != self.dataset_bytes:
            raise RuntimeError(f"curl fetched {got} bytes, expected {self.dataset_bytes}")
        fill = run_probe("tmpfs", str(self.tree.image_bytes), self.args.tmpfs)["write_sys_s"]
        record = {"contender": "floor", "epoch": "-", "round": round_, "curl_cpu_s": curl,
                  "fill_cpu_s": fill, "floor_s": curl + fill}  # fmt: skip
        self.records.append(record)
        log(f"round {round_} floor: curl {curl:.2f} s + page-cache fill {fill:.2f} s CPU")

    def run_pair(self, sampler: str, round_: int, shaped: bool) -> None:
        """Cold epochs at ``--small`` and ``--full``, same seed, the order swapped by round."""
        sizes = [("small", self.args.small), ("full", self.args.full)]
        for cache, fraction in sizes if round_ % 2 == 0 else sizes[::-1]:
            cache_size = int(fraction * self.dataset_bytes)
            self.server.reset_counts()
            with self.mount(cache_size) as pid:
                mount_egress = settled_counts(self.server)["get_object_bytes"]
                request = {"kind": "imagefolder", "root": str(self.mnt), "seed": round_,
                           "sampler": sampler, "sampler_epoch": 0,
                           "window": self.args.window}  # fmt: skip
                fields = {"contender": sampler, "epoch": "cold", "cache": cache,
                          "cache_fraction": fraction, "cache_size": cache_size,
                          "round": round_, "shaped": shaped,
                          "mount_egress_bytes": mount_egress}  # fmt: skip
                self.epoch(request, fields, pid)
                replay = cache == "small" and sampler in CEILING_FOR
                gets = self.server.ranges_sent() if replay else []
            if gets:
                streams = CEILING_FOR[sampler] or self.args.workers
                self.run_ceiling(gets, {**fields, "contender": f"{sampler} ceiling"}, streams)

    def run_ceiling(self, gets: list[list[Any]], fields: dict[str, Any], streams: int) -> None:
        """The store's ceiling for an epoch's own requests: the same ranged GETs, in the same
        order, replayed by curl (``streams`` at a time: the mount's fetch streams where it
        knows the order, the readers where it does not) with no reader, no decode and no
        daemon; images over its seconds is the best any reader could do against this
        store with those requests."""
        config = self.run_dir / "replay.curl"
        lines, expected = [], 0
        for key, start, end, _ in gets:
            lines += [f'url = "{self.url_of[key]}"', f'range = "{start}-{end - 1}"',
                      'output = "/dev/null"', "fail", "next"]  # fmt: skip
            expected += end - start
        config.write_text("\n".join(lines[:-1]) + "\n")
        settled_counts(self.server, timeout=120)
        self.server.reset_counts()
        store_pid = self.server.pid
        store_before = cpu_seconds(store_pid) if store_pid is not None else None
        began = time.monotonic()
        # --parallel-immediate: over HTTP/1.1, curl otherwise waits to multiplex and runs
        # the transfers one by one (200 GETs at 20 ms: 4.4 s, against 0.7 s with it).
        subprocess.run(["curl", "--silent", "--show-error", "--parallel", "--parallel-immediate",
                        "--parallel-max", str(streams), "--config", str(config)],
                       check=True, capture_output=True)  # fmt: skip
        seconds = time.monotonic() - began
        store_cpu = None
        if store_pid is not None and store_before is not None:
            store_cpu = cpu_seconds(store_pid) - store_before
        counts = settled_counts(self.server, timeout=120)
        if counts["get_object_bytes"] != expected:
            raise RuntimeError(f"replay fetched {counts['get_object_bytes']} of {expected} bytes")
        record = {
            **fields,
            "epoch": "replay",
            "images": self.tree.images,
            "seconds": seconds,
            "images_per_s": self.tree.images / seconds,
            "egress_bytes": counts["get_object_bytes"],
            "egress_requests": counts["get_object_requests"],
            "egress_ratio": counts["get_object_bytes"] / self.dataset_bytes,
            "refetched_bytes": counts["get_object_refetched_bytes"],
            "store_busy": None if store_cpu is None else store_cpu / seconds,
            "counters": {},
            "daemon_cpu_s": None,
            "streams": streams,
        }
        self.records.append(record)
        shaped = " shaped" if fields.get("shaped") else ""
        log(f"round {fields['round']} {fields['contender']}{shaped}: {len(gets)} GETs "
            f"replayed {streams} at a time in {seconds:.1f} s, {record['images_per_s']:.0f} img/s, "
            f"store core {record['store_busy'] or 0:.2f} busy")  # fmt: skip

    def run_webdataset(self, round_: int, shaped: bool) -> None:
        request = {"kind": "webdataset", "urls": self.urls, "cache_dir": None, "seed": round_}
        fields = {"contender": "webdataset", "epoch": "cold", "round": round_, "shaped": shaped}
        self.epoch(request, fields)

    def run(self) -> dict[str, Any]:
        started = time.perf_counter()
        self.setup()
        shaping = {"latency_ms": self.args.latency_ms, "bandwidth_mb": self.args.bandwidth_mb}
        phases = [False] if self.args.no_shaped else [False, True]
        if self.args.kernel_profile:
            self.profile = CoreProfile(self.pinning.readers, self.run_dir / "kernel.perf")
            self.profile.start()
        for round_ in range(self.args.rounds):
            self.run_local(round_)
            self.run_floor(round_)
            for shaped in phases:
                if shaped:
                    self.server.shape(**shaping)
                else:
                    self.server.shape()
                for sampler in self.args.samplers:
                    self.run_pair(sampler, round_, shaped)
                if "webdataset" not in self.args.skip:
                    self.run_webdataset(round_, shaped)
            self.server.shape()
        if self.profile is not None:
            annotate(self.records, self.profile.stop(), RATE)
            self.profile = None
        return {
            "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            "pinning": {**self.pinning.as_dict(), "label": self.pinning.label()},
            "dataset": self.meta,
            "workers": self.args.workers,
            "small": self.args.small,
            "full": self.args.full,
            "rounds": self.args.rounds,
            "shaping": None if self.args.no_shaped else shaping,
            "epochs": self.records,
            "total_s": time.perf_counter() - started,
        }


# -- ratios, targets and report ------------------------------------------------------------


def _find(epochs: list[dict[str, Any]], round_: int, **match: Any) -> dict[str, Any] | None:
    for record in epochs:
        if record["round"] == round_ and all(record.get(k) == v for k, v in match.items()):
            return record
    return None


def round_ratios(result: dict[str, Any]) -> dict[str, dict[int, float]]:
    """Per round, each cold ratio by name (``... shaped`` for the shaped phase): small /
    full per sampler, full / local (warm and after drop_caches), webdataset / local."""
    epochs = result["epochs"]
    ratios: dict[str, dict[int, float]] = {}

    def rate(round_: int, **match: Any) -> float | None:
        record = _find(epochs, round_, **match)
        return record["images_per_s"] if record else None

    def put(name: str, round_: int, top: float | None, bottom: float | None) -> None:
        if top is not None and bottom:
            ratios.setdefault(name, {})[round_] = top / bottom

    images = result["dataset"]["images"]
    for round_ in range(result["rounds"]):
        warm = rate(round_, contender="local", epoch="warm")
        dropped = rate(round_, contender="local", epoch="dropped")
        put("local dropped / warm", round_, dropped, warm)
        floor = _find(epochs, round_, contender="floor")
        limit = None
        if floor is not None and warm:
            # The best a cold epoch can do: the warm epoch's time plus the floor's CPU.
            limit = 1 / (1 + floor["floor_s"] * warm / images)
            put("limit: cold / local warm", round_, limit, 1.0)
        for shaped in (False, True):
            tag = " shaped" if shaped else ""
            for sampler in SAMPLERS:
                small = rate(round_, contender=sampler, cache="small", shaped=shaped)
                full = rate(round_, contender=sampler, cache="full", shaped=shaped)
                put(f"{sampler} small / full{tag}", round_, small, full)
                ceiling = rate(round_, contender=f"{sampler} ceiling", shaped=shaped)
                put(f"{sampler} small / store ceiling{tag}", round_, small, ceiling)
                put(f"{sampler} store ceiling / full{tag}", round_, ceiling, full)
                put(f"{sampler} full / local warm{tag}", round_, full, warm)
                if limit is not None and full is not None and warm:
                    put(f"{sampler} full / limit{tag}", round_, full / warm, limit)
                put(f"{sampler} full / local dropped{tag}", round_, full, dropped)
            wds = rate(round_, contender="webdataset", shaped=shaped)
            put(f"webdataset / local warm{tag}", round_, wds, warm)
    return ratios


# (target, the per-round ratio it is checked on, goal for the median) from issue 21.
RATIO_TARGETS = (
    ("shard mode, cache 0.15x, cold / same epoch full cache", "shard small / full", 0.95),
    ("uniform mode, cache 0.15x, cold / same epoch full cache", "uniform small / full", 0.85),
    ("shard mode, full cache, cold / local warm (per round)", "shard full / local warm", 0.95),
    ("shard mode, full cache, cold / local after drop_caches (per round)",
     "shard full / local dropped", 1.0),
    ("uniform mode, full cache, cold / local warm (per round)", "uniform full / local warm", 0.93),
    ("plain shuffle, full cache, cold / local warm (per round)", "random full / local warm", 0.90),
)  # fmt: skip


def targets(result: dict[str, Any], ratios: dict[str, dict[int, float]]) -> list[dict[str, Any]]:
    """Issue 21's targets that this section measures, each with its verdict."""
    checks = []
    for name, ratio, goal in RATIO_TARGETS:
        spread = _spread(list(ratios.get(ratio, {}).values()))
        met, verdict = paired_verdict(spread, goal)
        value = None if spread is None else spread["median"]
        checks.append(_check(name, value, spread, f">= {goal}", met, verdict))
    for sampler in ("shard", "uniform"):
        egress = [r["egress_ratio"] for r in result["epochs"]
                  if r["contender"] == sampler and r.get("cache") == "small"]  # fmt: skip
        worst = max(egress) if egress else None
        name = f"{sampler} mode, cache 0.15x: egress / dataset (worst epoch)"
        checks.append(_check(name, worst, None, "<= 1.0", None if worst is None else worst <= 1.0))
        again = [r["refetched_bytes"] for r in result["epochs"]
                 if r["contender"] == sampler and r.get("cache") == "small"
                 and r.get("refetched_bytes") is not None]  # fmt: skip
        most = max(again) if again else None
        name = f"{sampler} mode, cache 0.15x: bytes fetched twice (worst epoch)"
        checks.append(_check(name, most, None, "0", None if most is None else most == 0))
    for name in sorted(ratios):
        if not name.endswith(" shaped") or " / limit" in name or "ceiling" in name:
            continue  # a ratio over a limit moves as the one it is made of does
        unshaped = name.removesuffix(" shaped")
        base = ratios.get(unshaped, {})
        gap = _spread([ratio - base[r] for r, ratio in ratios[name].items() if r in base])
        if gap is None:
            continue
        met = gap["n"] >= MIN_PAIRS and abs(gap["median"]) <= SHAPED_GOAL
        verdict = (
            None if gap["n"] >= MIN_PAIRS else f"**no**: {gap['n']:.0f} rounds, {MIN_PAIRS} needed"
        )
        checks.append(_check(f"shaped - unshaped: {unshaped}", gap["median"], gap,
                             f"within ±{SHAPED_GOAL}", met, verdict))  # fmt: skip
    return checks


def _rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Medians per (contender, cache, shaped, epoch), in run order."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in result["epochs"]:
        if r["contender"] == "floor":
            continue
        key = (r["contender"], r.get("cache", "-"), bool(r.get("shaped")), r["epoch"])
        groups.setdefault(key, []).append(r)
    rows = []
    for (contender, cache, shaped, epoch), records in groups.items():

        def med(get: Any, records: list[dict[str, Any]] = records) -> float | None:
            values = [v for v in map(get, records) if v is not None]
            return statistics.median(values) if values else None

        row: dict[str, Any] = {
            "contender": contender, "cache": cache, "shaped": shaped, "epoch": epoch,
            "n": len(records),
            "images_per_s": med(lambda r: r["images_per_s"]),
            "egress_ratio": med(lambda r: r["egress_ratio"]),
            "refetched_bytes": med(lambda r: r.get("refetched_bytes")),
            "daemon_cpu_s": med(lambda r: r["daemon_cpu_s"]),
            "store_busy": med(lambda r: r.get("store_busy")),
            "readers_idle": med(lambda r: r.get("readers_idle")),
        }  # fmt: skip
        for counter in COUNTERS:
            row[counter] = med(lambda r, c=counter: r["counters"].get(c))
        rows.append(row)
    return rows


def markdown(result: dict[str, Any]) -> str:
    data, shaping = result["dataset"], result["shaping"]
    shaped = (f"; shaped: {shaping['latency_ms']:g} ms first-byte latency, "
              f"{shaping['bandwidth_mb']:g} MB/s per response") if shaping else ""  # fmt: skip
    lines = [
        f"Streaming (issue 21): {data['images']} JPEGs in {data['shards']} webdataset shards, "
        f"{data['dataset_bytes'] / 1e6:.0f} MB; {result['pinning']['label']}; ImageFolder + "
        f"decode, {result['workers']} workers, batch 32; page cache dropped before each epoch "
        f"(not the warm local one); a fresh mount over an empty cache per cold epoch, "
        f"--cache-size {result['small']}x (small) and {result['full']}x (full) of the shard "
        f"bytes{shaped}. Medians over {result['rounds']} rounds; egress at the server over "
        "the shard bytes; counters are `shardfs stats` differences over the epoch.",
        "",
        "| contender | cache | shaped | epoch | images/s | egress | fetched twice MB "
        "| daemon CPU s | store core busy "
        "| readers' core idle | waited on net | fetched ahead | range reads | blocks evicted "
        "| evicted unread MB | n |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in _rows(result):
        unread, twice = row["evicted_unread_bytes"], row["refetched_bytes"]
        lines.append(
            f"| {row['contender']} | {row['cache']} | {'yes' if row['shaped'] else 'no'} "
            f"| {row['epoch']} | {_num(row['images_per_s'], 0)} | {_num(row['egress_ratio'])}x "
            f"| {_num(None if twice is None else twice / 1e6, 2)} "
            f"| {_num(row['daemon_cpu_s'], 1)} | {_num(row['store_busy'])} "
            f"| {_num(row['readers_idle'])} "
            f"| {_num(row['reads_waited_on_network'], 0)} "
            f"| {_num(row['files_fetched_ahead'], 0)} | {_num(row['range_reads'], 0)} "
            f"| {_num(row['blocks_evicted'], 0)} "
            f"| {_num(None if unread is None else unread / 1e6, 1)} | {row['n']} |"
        )
    floors = [r for r in result["epochs"] if r["contender"] == "floor"]
    if floors:
        curl = statistics.median(r["curl_cpu_s"] for r in floors)
        fill = statistics.median(r["fill_cpu_s"] for r in floors)
        lines += [
            "",
            f"Floor, per round on the readers' core: curl receiving every shard {curl:.2f} s "
            f"CPU + the page-cache fill of the same bytes (tmpfs write) {fill:.2f} s "
            "(medians). A cold epoch cannot beat a warm one plus this; `limit: cold / local "
            "warm` is that bound, and `X full / limit` each full-cache ratio over it.",
        ]
    lines += thread_lines(result)
    lines += budget_lines(result)
    lines += profile_lines(result["epochs"], statistics.median)
    lines += ["", "| ratio (per round) | median | min-max | n |", "|---|---|---|---|"]
    for name, by_round in result["ratios"].items():
        s = _spread(list(by_round.values()))
        assert s is not None
        lines.append(f"| {name} | {s['median']:.2f} | {s['min']:.2f}-{s['max']:.2f} | {s['n']} |")
    lines += ["", *target_table(result["targets"])]
    lines += ["", f"Command: `{result['command']}` ({result['total_s'] / 60:.1f} min)."]
    return "\n".join(lines) + "\n"


def thread_lines(result: dict[str, Any]) -> list[str]:
    """Where each shardfs epoch's daemon CPU went, by thread family (medians over rounds)."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in result["epochs"]:
        if r.get("daemon_threads"):
            key = (r["contender"], r.get("cache", "-"), bool(r.get("shaped")))
            groups.setdefault(key, []).append(r)
    families = sorted(
        {family for records in groups.values() for r in records
         for family, (ran, _) in r["daemon_threads"].items() if ran >= 0.01}
    )  # fmt: skip
    if not families:
        return []
    lines = [
        "",
        "The daemon's CPU per epoch by thread, medians, s: user and system (the scheduler's "
        "ns), of which user in parentheses (clock ticks). `prefetch` fetches and stores "
        "blocks (and files ahead), `shardfs-push` pushes files into the kernel, `shardfs-fuse` "
        "answers requests, `shardfs-read` the READs Python waits on, `shardfs-opened` takes "
        "the opens C queued for the order hint. Faults: the daemon's minor page faults.",
        "",
        "| contender | cache | shaped | " + " | ".join(families) + " | faults |",
        "|---|---|---|" + "---|" * (len(families) + 1),
    ]
    for (contender, cache, shaped), records in groups.items():
        cells = []
        for family in families:
            pairs = [r["daemon_threads"].get(family, (0.0, 0.0)) for r in records]
            ran = statistics.median(pair[0] for pair in pairs)
            user = statistics.median(pair[1] for pair in pairs)
            cells.append(f"{ran:.2f} ({user:.2f})")
        faults = [r["daemon_minor_faults"] for r in records if "daemon_minor_faults" in r]
        fault_cell = f"{statistics.median(faults):,.0f}" if faults else "-"
        lines.append(
            f"| {contender} | {cache} | {'yes' if shaped else 'no'} | "
            + " | ".join(cells) + f" | {fault_cell} |"
        )  # fmt: skip
    return lines


def budget_lines(result: dict[str, Any]) -> list[str]:
    """Where a shardfs epoch's time beyond the local warm one of its round went, on the
    readers' core (medians over rounds, s): the daemon, the readers themselves (the epoch
    process and its DataLoader workers, user and system), and the rest (kernel threads,
    interrupts, the bench's own processes)."""
    epochs = result["epochs"]
    warm = {r["round"]: r for r in epochs if r["contender"] == "local" and r["epoch"] == "warm"}
    groups: dict[tuple[Any, ...], list[tuple[float, ...]]] = {}
    for r in epochs:
        base = warm.get(r["round"])
        if r.get("daemon_cpu_s") is None or base is None or "readers_user_s" not in base:
            continue

        def busy(record: dict[str, Any]) -> float:
            cores = record["readers_cores"]
            return float(cores["user"] + cores["system"] + cores["irq"])

        readers_user = r["readers_user_s"] - base["readers_user_s"]
        readers_sys = r["readers_sys_s"] - base["readers_sys_s"]
        extra = busy(r) - busy(base)
        rest = extra - r["daemon_cpu_s"] - readers_user - readers_sys
        key = (r["contender"], r.get("cache", "-"), bool(r.get("shaped")))
        groups.setdefault(key, []).append(
            (r["seconds"] - base["seconds"], extra, r["daemon_cpu_s"], readers_user,
             readers_sys, rest, r["readers_cores"]["idle"])
        )  # fmt: skip
    if not groups:
        return []
    lines = [
        "",
        "The readers' core, each shardfs epoch against the local warm epoch of its round "
        "(medians, s): how much longer the epoch ran, how much more of the core was busy, "
        "and by whom: the daemon, the readers (the epoch process and its DataLoader workers, "
        "user and system CPU beyond the local epoch's) and the rest (kernel threads, "
        "interrupts, other processes); idle: the core waiting (on the store).",
        "",
        "| contender | cache | shaped | longer | busier | daemon | readers user "
        "| readers system | rest | idle |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (contender, cache, shaped), rows in groups.items():
        cells = [statistics.median(row[i] for row in rows) for i in range(7)]
        lines.append(
            f"| {contender} | {cache} | {'yes' if shaped else 'no'} | "
            + " | ".join(f"{cell:.2f}" for cell in cells) + " |"
        )  # fmt: skip
    return lines


def summary_lines(result: dict[str, Any]) -> list[str]:
    """One PASS / FAIL (SKIP: not measured) line per target, for the terminal."""
    return target_summary(result["targets"])


def write_reports(result: dict[str, Any], out: Path) -> dict[str, Any]:
    """streaming.json and streaming.md in ``out``; the result with its ratios and targets."""
    return write_section(result, out, "streaming", round_ratios, targets, markdown)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from shardfs.config import parse_size

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=3000, help="images, ~100 KB each (3000)")
    parser.add_argument("--classes", type=int, default=12, help="classes (12)")
    parser.add_argument("--shards", type=int, default=12, help="about this many shards (12)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds; the targets need 5 (5)")
    parser.add_argument("--small", type=float, default=0.15, help="small cache / dataset (0.15)")
    parser.add_argument("--full", type=float, default=3.0, help="full cache / dataset (3)")
    parser.add_argument(
        "--samplers", nargs="*", default=list(SAMPLERS), choices=SAMPLERS,
        help="cold pairs to run: ShardSampler modes, random = shuffle=True (all)",
    )  # fmt: skip
    parser.add_argument("--skip", nargs="*", default=[], choices=["webdataset"])
    parser.add_argument("--no-shaped", action="store_true", help="skip the shaped phase")
    parser.add_argument(
        "--kernel-profile",
        action="store_true",
        help="perf on the readers' core: each epoch's kernel time and page zeroing, by the "
        "readers and by the daemon (bench/kernel_profile.py)",
    )
    parser.add_argument("--latency-ms", type=float, default=20.0, help="shaped: latency (20)")
    parser.add_argument(
        "--bandwidth-mb", type=float, default=100.0, help="shaped: MB/s per response (100)"
    )
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers (2)")
    parser.add_argument(
        "--block-size",
        type=parse_size,
        default=1 << 20,
        help="the mount's --block-size (1M: a 0.15x cache of 8 MiB blocks is 5 blocks, too "
        "few to hold the blocks being read and a window ahead)",
    )
    parser.add_argument(
        "--window",
        type=float,
        default=1.0,
        help="ShardSampler's window in shards (1: the shards being mixed fit a 0.15x cache; "
        "the default 8 mixes 9 shards at once, about 0.7x of this dataset)",
    )
    parser.add_argument(
        "--shardfs-arg", action="append", default=[], help="extra mount argument (repeatable)"
    )
    parser.add_argument(
        "--tmpfs", default="/dev/shm", help="a tmpfs folder for the page-cache fill (/dev/shm)"
    )
    parser.add_argument("--work", type=Path, default=ROOT / "results" / "tmp")
    parser.add_argument("--out", type=Path, default=ROOT / "results")
    return parser.parse_args(argv)


def run_section(args: argparse.Namespace) -> dict[str, Any] | None:
    """Run the section and write its reports; the result with its ratios and targets, None
    if interrupted. For `make bench` (bench/run.py) as for `make bench-stream`."""
    result = run_to_the_end(StreamingBench(args), log)
    if result is None:
        return None
    return write_reports(result, args.out)


def main(argv: list[str] | None = None) -> int:
    result = run_section(parse_args(argv))
    if result is None:
        return 130
    print(markdown(result))
    print("\n".join(summary_lines(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

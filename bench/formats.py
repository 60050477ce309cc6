"""`make bench-formats`: cold decode epochs over tar, parquet, MDS and zip shards of the same
images, in the same run (issue 22's speed and egress targets).

One ImageFolder of ~100 KB JPEGs (bench/data.py; 2,000 in 10 classes by default) is written
by each format's own tool: (a) about 12 GNU tar shards of ``CLASS/FILE``, (b)
parquet by ``datasets``' ``to_parquet`` (images PLAIN, the ClassLabel names are the class
folders), (c) ``MDSWriter(compression=None)`` with a ``classes.txt`` beside it, (d) one
stored zip (``zip -0 -r``); and the decoded kinds: (e) the same tar shards gzipped
(``.tar.gz``), (f) parquet by pyarrow with its defaults (snappy, dictionary pages) and the
``huggingface`` footer, (g) ``MDSWriter(compression='zstd')``, (h) one zip by the ``zip``
tool's default (deflate); and (i) the tar shards of (a) with an index sidecar (``shardfs
index --write-sidecar``), whose mount fetches only the sidecar. The parquet and MDS writers
run in the writers venv (``make writers``, tests/support/columnar.py). All of them go onto
moto's S3 server, pinned to the last core; this process, the epoch runner (bench/epoch.py:
decode = RandomResizedCrop + ToTensor, 2 workers, batch 32, ``shuffle=True``) and the daemons
run on the others (bench/pinning.py).

Each round runs, per format in an order rotated every round: a fresh mount over an empty
cache that holds everything (``--cache-size`` 3x the format's bytes), then one cold decode
epoch with ``ImageFolder`` over the class folders (the split folder for parquet and MDS),
page cache dropped first. Per epoch: images/s, mount time, index egress (what the mount
fetched before the epoch) and epoch egress over the format's bytes, daemon CPU; after it, the
class folders and their file counts and bytes are checked against the source tree, so the
targets match for every format. Per round: each format's images/s over tar's, and for the
decoded kinds the decode CPU per image (the daemon's CPU over tar's in the same round, per
image). Targets: parquet and MDS within 0.05 of tar (median of >= 5 rounds; over both tar
mounts: the plain one downloads the images while it scans, the sidecar one in the epoch, as
parquet and MDS do), first mount + epoch egress <= 1.05x the images' bytes, index egress
<= 2% for parquet and MDS. Writes formats.json and formats.md to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from data import Tree, ensure_tree  # noqa: E402
from pinning import Pinning  # noqa: E402
from procs import (  # noqa: E402
    DaemonProbe,
    EpochRunner,
    drop_page_cache,
    force_unmount,
    run_to_the_end,
    start_store,
)
from procs import shardfs_cli as shardfs  # noqa: E402
from report import (  # noqa: E402
    num,
    spread_of,
    summary_lines,
    target_row,
    target_table,
    within_verdict,
    write_section,
)
from support.s3 import S3Server, settled_counts  # noqa: E402

BUCKET = "formats"
FORMATS = (
    "tar",
    "parquet",
    "mds",
    "zip",
    "tar.gz",
    "parquet-snappy",
    "mds-zstd",
    "zip-deflate",
    "tar-sidecar",
)
DECODED = FORMATS[4:8]  # whose images are decoded: their decode CPU per image is reported
# The same tar shards with an index sidecar (`shardfs index --write-sidecar`, as `shardfs pack`
# writes one): the mount fetches the sidecar only, so the epoch downloads the images as a
# parquet or MDS epoch does. The speed targets compare against both tar mounts.
SIDECAR = "tar-sidecar"
SPEED_TOLERANCE = 0.05  # issue 22: parquet and MDS within 0.05 of tar
EGRESS_GOAL = 1.05  # first mount + one epoch over the images' bytes
INDEX_GOAL = 0.02  # the index's egress over the shards' bytes, parquet and MDS


def log(text: str) -> None:
    print(f"bench-formats: {text}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Layout:
    """Where a format's shards go on the store, what the mount reads and where its
    ImageFolder root is in the mount."""

    prefix: str  # under the bucket
    source: str  # the mount's source, relative to the bucket
    split: str  # the ImageFolder root relative to the mountpoint ("" = the mountpoint)


LAYOUTS = {
    "tar": Layout("tar/train", "tar/train/", ""),
    "parquet": Layout("parquet", "parquet/data/", "train"),
    "mds": Layout("mds", "mds/", "train"),
    "zip": Layout("zip", "zip/", ""),
    "tar.gz": Layout("tar.gz/train", "tar.gz/train/", ""),
    "parquet-snappy": Layout("parquet-snappy", "parquet-snappy/data/", "train"),
    "mds-zstd": Layout("mds-zstd", "mds-zstd/", "train"),
    "zip-deflate": Layout("zip-deflate", "zip-deflate/", ""),
    SIDECAR: Layout("tar-sidecar/train", "tar-sidecar/train/", ""),
}


def class_counts(root: Path) -> dict[str, tuple[int, int]]:
    """Per class folder of an ImageFolder root: (files, bytes)."""
    counts = {}
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        sizes = [entry.stat().st_size for entry in os.scandir(folder) if entry.is_file()]
        counts[folder.name] = (len(sizes), sum(sizes))
    return counts


def write_columnar(tree: Tree, out: Path, parquet_shards: int, mds_shard_bytes: int) -> None:
    """parquet/ (``to_parquet``) and mds/ (``MDSWriter``) of ``tree`` under ``out``, written
    by the real tools in the writers venv, with a manifest naming the tree's files."""
    from support.columnar import write

    classes = sorted(p.name for p in tree.root.iterdir() if p.is_dir())
    items = [
        {"file": str(path), "name": path.name, "label": label}
        for label, name in enumerate(classes)
        for path in sorted((tree.root / name).iterdir())
    ]
    (out / "manifest.json").write_text(json.dumps({"classes": classes, "splits": {"train": items}}))
    write("hf_parquet.py", out, out / "parquet", "--shards", str(parquet_shards))
    write("pyarrow_parquet.py", out, out / "parquet-snappy", "--hf", "--row-group-size", "100")
    for name, extra in (("mds", []), ("mds-zstd", ["--compression", "zstd"])):
        write("mds.py", out, out / name, "--size-limit", str(mds_shard_bytes), *extra)
        # MDS keeps only the int label: the class names for the folders come from classes.txt.
        (out / name / "classes.txt").write_text("\n".join(classes) + "\n")


def write_zips(tree: Tree, out: Path) -> None:
    """One zip of the tree's class folders stored (``zip -0 -r``), one deflated (``zip -r``)."""
    for name, level in (("zip", ["-0"]), ("zip-deflate", [])):
        (out / name).mkdir(parents=True, exist_ok=True)
        archive = str(out / name / "train.zip")
        subprocess.run(["zip", *level, "-r", "-q", archive, "."], cwd=tree.root, check=True)


def write_tars(tree: Tree, out: Path, shards: int) -> None:
    """About ``shards`` GNU tar shards of ``CLASS/FILE`` members, the sorted files cut into
    runs of equal count (`shardfs pack` would do, but fails on this commit: see the report)."""
    files = sorted(p.relative_to(tree.root).as_posix() for p in tree.root.rglob("*.jpg"))
    (out / "tar").mkdir(parents=True, exist_ok=True)
    per_shard = -(-len(files) // shards)
    for index, start in enumerate(range(0, len(files), per_shard)):
        names = "\n".join(files[start : start + per_shard]) + "\n"
        subprocess.run(
            ["tar", "-cf", str(out / "tar" / f"train-{index:05d}.tar"), "-T", "-"],
            cwd=tree.root, input=names.encode(), check=True,
        )  # fmt: skip
    # The same shards gzipped, as `tar -czf` writes them.
    (out / "tar.gz").mkdir(parents=True, exist_ok=True)
    for shard in sorted((out / "tar").glob("*.tar")):
        with open(out / "tar.gz" / f"{shard.name}.gz", "wb") as gz:
            subprocess.run(["gzip", "-c", str(shard)], stdout=gz, check=True)


def ensure_shards(work: Path, tree: Tree, args: argparse.Namespace) -> Path:
    """The tar, parquet, MDS and zip copies of ``tree``, written once per tree and settings."""
    key = f"{tree.root.parent.name}-p{args.parquet_shards}-m{args.shards}-decoded"
    out = work / f"formats-{key}"
    if (out / ".complete").exists():
        return out
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    started = time.perf_counter()
    write_columnar(tree, out, args.parquet_shards, max(1 << 20, tree.image_bytes // args.shards))
    write_zips(tree, out)
    write_tars(tree, out, args.shards)
    (out / ".complete").write_text("")
    log(f"wrote every format's shards in {time.perf_counter() - started:.0f} s: {out}")
    return out


class FormatsBench:
    """Holds the server, the epoch runner and the mount, so cleanup can find them."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.run_dir = args.work.absolute() / "formats-run"
        self.mnt = self.run_dir / "mnt"
        self.server = S3Server()
        self.pinning = Pinning.split()
        self.runner: EpochRunner | None = None
        self.mounted = False
        self.records: list[dict[str, Any]] = []
        self.checks: dict[str, dict[str, Any]] = {}

    def setup(self) -> None:
        from shardfs.config import plural
        from shardfs.index.db import SIDECAR_NAME

        shutil.rmtree(self.run_dir, ignore_errors=True)
        self.mnt.mkdir(parents=True)
        work = self.args.work.absolute()
        self.tree = ensure_tree(work, self.args.images, self.args.classes, log)
        shards = ensure_shards(work, self.tree, self.args)
        self.expected = class_counts(self.tree.root)
        start_store(self.server, self.pinning)
        self.pinning.pin_self_to_readers()  # runner, workers and daemons on the readers' cores
        os.environ.update(self.server.env())
        self.server.create_bucket(BUCKET)
        for name in FORMATS:
            local = shards / ("tar" if name == SIDECAR else name)
            self.server.upload_dir(local, f"{BUCKET}/{LAYOUTS[name].prefix}")
        scratch = self.run_dir / "sidecar-cache"
        shardfs(
            "index", f"s3://{BUCKET}/{LAYOUTS[SIDECAR].source}", "--write-sidecar",
            "--cache-dir", str(scratch),
        )  # fmt: skip
        shutil.rmtree(scratch, ignore_errors=True)
        fs = self.server.filesystem()
        self.shards: dict[str, dict[str, int]] = {}
        for name, layout in LAYOUTS.items():
            found = fs.find(f"{BUCKET}/{layout.prefix}", detail=True)
            data = {
                k: v for k, v in found.items() if not k.endswith((".json", ".txt", SIDECAR_NAME))
            }
            self.shards[name] = {
                "shards": len(data),
                "bytes": sum(int(v["size"]) for v in data.values()),
            }
        log(
            f"{self.tree.images} JPEGs, {self.tree.image_bytes / 1e6:.0f} MB; "
            + ", ".join(
                f"{k} {plural(v['shards'], 'shard')} {v['bytes'] / 1e6:.0f} MB"
                for k, v in self.shards.items()
            )
        )
        log(self.pinning.label())
        self.runner = EpochRunner()

    def cleanup(self) -> None:
        if self.mounted:
            force_unmount(self.mnt)
        if self.runner is not None:
            self.runner.close()
        self.server.stop()

    def cold_epoch(self, fmt: str, round_: int) -> None:
        """A fresh mount over an empty cache, then one cold decode epoch through it."""
        from shardfs.mount.control import pid_file

        assert self.runner is not None
        layout, shard_bytes = LAYOUTS[fmt], self.shards[fmt]["bytes"]
        cache = self.run_dir / "cache"
        shutil.rmtree(cache, ignore_errors=True)
        settled_counts(self.server, timeout=120)
        drop_page_cache()
        self.server.reset_counts()
        started = time.perf_counter()
        self.mounted = True
        shardfs(
            "mount",
            f"s3://{BUCKET}/{layout.source}",
            str(self.mnt),
            "--cache-dir",
            str(cache),
            "--cache-size",
            str(int(self.args.full * shard_bytes)),
            *self.args.shardfs_arg,
        )
        try:
            mount_s = time.perf_counter() - started
            pid = int(pid_file(self.mnt).read_text())
            index = settled_counts(self.server, timeout=120)
            drop_page_cache()
            self.server.reset_counts()
            probe = DaemonProbe(pid)
            probe.start()
            root = self.mnt / layout.split
            reply = self.runner.run(
                {
                    "kind": "imagefolder",
                    "root": str(root),
                    "mode": "decode",
                    "workers": self.args.workers,
                    "seed": round_,
                }
            )
            daemon = probe.stop()
            counts = settled_counts(self.server, timeout=120)
            found = class_counts(root)
        finally:
            shardfs("umount", str(self.mnt))
            self.mounted = False
            shutil.rmtree(cache, ignore_errors=True)
        self.check_tree(fmt, reply["images"], found)
        record = {
            "format": fmt,
            "round": round_,
            **reply,
            **daemon,
            "mount_s": mount_s,
            "images_per_s": reply["images"] / reply["seconds"],
            "shard_bytes": shard_bytes,
            "index_egress_bytes": index["get_object_bytes"],
            "index_requests": index["get_object_requests"],
            "index_ratio": index["get_object_bytes"] / shard_bytes,
            "egress_bytes": counts["get_object_bytes"],
            "egress_requests": counts["get_object_requests"],
            "egress_ratio": counts["get_object_bytes"] / shard_bytes,
            "first_epoch_over_images": (index["get_object_bytes"] + counts["get_object_bytes"])
            / self.tree.image_bytes,
        }
        self.records.append(record)
        log(
            f"round {round_} {fmt:<8} {record['images_per_s']:5.0f} img/s, mount "
            f"{mount_s:.1f} s, index {record['index_ratio']:.3%}, epoch egress "
            f"{record['egress_ratio']:.3f}x, mount+epoch / images "
            f"{record['first_epoch_over_images']:.3f}x, daemon {daemon['daemon_cpu_s']:.1f} s CPU"
        )

    def check_tree(self, fmt: str, images: int, found: dict[str, tuple[int, int]]) -> None:
        """The epoch read every image, and the mount shows the source's class folders with
        their files and bytes: ImageFolder's targets (sorted folders) are then the same."""
        if images != self.tree.images or found != self.expected:
            diff = {
                k: (self.expected.get(k), found.get(k))
                for k in sorted(set(found) | set(self.expected))
                if found.get(k) != self.expected.get(k)
            }
            raise RuntimeError(
                f"{fmt}: read {images} of {self.tree.images} images; class folders "
                f"(expected, found): {diff}"
            )
        self.checks[fmt] = {"images": images, "classes": len(found), "same_as_source": True}

    def run(self) -> dict[str, Any]:
        started = time.perf_counter()
        self.setup()
        rounds, first = 0, time.perf_counter()
        while rounds < self.args.rounds:
            shift = rounds % len(self.args.formats)
            for fmt in self.args.formats[shift:] + self.args.formats[:shift]:
                self.cold_epoch(fmt, rounds)
            rounds += 1
            spent = time.perf_counter() - first
            # Stop before a round that would run past --max-minutes (rounds so far: the mean).
            if self.args.max_minutes and spent * (rounds + 1) / rounds > 60 * self.args.max_minutes:
                if rounds < self.args.rounds:
                    log(f"stopping after {rounds} rounds: another would pass --max-minutes")
                break
        return {
            "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            "pinning": {**self.pinning.as_dict(), "label": self.pinning.label()},
            "dataset": {
                "images": self.tree.images,
                "classes": self.tree.classes,
                "image_bytes": self.tree.image_bytes,
                "formats": self.shards,
            },
            "tree_checks": self.checks,
            "workers": self.args.workers,
            "full": self.args.full,
            "rounds": rounds,
            "rounds_asked": self.args.rounds,
            "epochs": self.records,
            "total_s": time.perf_counter() - started,
        }


# -- ratios, targets and report ------------------------------------------------------------


def round_ratios(result: dict[str, Any]) -> dict[str, dict[int, float]]:
    """Per round, each format's images/s over tar's in that round: of the epoch (the
    targets), and as context of mount + epoch (a tar mount downloads its shards while it
    scans them, a parquet or MDS one only their indexes). Parquet and MDS also over the tar
    mounted from its sidecar, whose epoch downloads the images as theirs do."""
    ratios: dict[str, dict[int, float]] = {}
    pairs = [(fmt, "tar") for fmt in FORMATS[1:]]
    pairs += [(fmt, SIDECAR) for fmt in ("parquet", "mds")]
    for tag, seconds in (("", lambda r: r["seconds"]),
                         (", mount + epoch", lambda r: r["mount_s"] + r["seconds"])):  # fmt: skip
        rate = {(r["format"], r["round"]): r["images"] / seconds(r) for r in result["epochs"]}
        for fmt, base in pairs:
            for round_ in range(result["rounds"]):
                top, bottom = rate.get((fmt, round_)), rate.get((base, round_))
                if top is not None and bottom:
                    ratios.setdefault(f"{fmt} / {base}{tag}", {})[round_] = top / bottom
    return ratios


def decode_cpu(result: dict[str, Any]) -> dict[str, dict[int, float]]:
    """Per round, each decoded kind's daemon CPU over tar's in that round, per image (µs):
    what decoding costs the daemon beyond serving the same images verbatim."""
    cpu = {(r["format"], r["round"]): r["daemon_cpu_s"] for r in result["epochs"]}
    extra: dict[str, dict[int, float]] = {}
    images = result["dataset"]["images"]
    for fmt in DECODED:
        for round_ in range(result["rounds"]):
            top, bottom = cpu.get((fmt, round_)), cpu.get(("tar", round_))
            if top is not None and bottom is not None:
                extra.setdefault(fmt, {})[round_] = (top - bottom) / images * 1e6
    return extra


def targets(result: dict[str, Any], ratios: dict[str, dict[int, float]]) -> list[dict[str, Any]]:
    """Issue 22's speed and egress targets that this section measures, with verdicts."""
    checks = []
    for fmt, base, what in (
        ("parquet", "tar", "the tar mount downloaded the images"),
        ("mds", "tar", "the tar mount downloaded the images"),
        ("parquet", SIDECAR, "both epochs download them"),
        ("mds", SIDECAR, "both epochs download them"),
    ):
        spread = spread_of(list(ratios.get(f"{fmt} / {base}", {}).values()))
        met, verdict = within_verdict(spread, 1.0, SPEED_TOLERANCE)
        checks.append(
            target_row(
                f"{fmt} / {base}, cold decode images/s (per round; {what})",
                None if spread is None else spread["median"],
                spread,
                f"within ±{SPEED_TOLERANCE} of 1",
                met,
                verdict,
            )
        )
    by_format: dict[str, list[dict[str, Any]]] = {}
    for record in result["epochs"]:
        by_format.setdefault(record["format"], []).append(record)
    for fmt, records in by_format.items():
        worst = max(r["first_epoch_over_images"] for r in records)
        checks.append(
            target_row(
                f"{fmt}: first mount + epoch egress / images' bytes (worst)",
                worst,
                None,
                f"<= {EGRESS_GOAL}",
                worst <= EGRESS_GOAL,
            )
        )
    for fmt in ("parquet", "mds"):
        if fmt in by_format:
            worst = max(r["index_ratio"] for r in by_format[fmt])
            checks.append(
                target_row(
                    f"{fmt}: index egress / shard bytes (worst)",
                    worst,
                    None,
                    f"<= {INDEX_GOAL}",
                    worst <= INDEX_GOAL,
                )
            )
    return checks


def _rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Medians per format, in FORMATS order."""
    rows = []
    for fmt in FORMATS:
        records = [r for r in result["epochs"] if r["format"] == fmt]
        if not records:
            continue
        row: dict[str, Any] = {"format": fmt, "n": len(records)}
        for key in (
            "images_per_s",
            "mount_s",
            "index_ratio",
            "egress_ratio",
            "first_epoch_over_images",
            "daemon_cpu_s",
            "scan_seconds",
        ):
            row[key] = spread_of([r[key] for r in records])
        rows.append(row)
    return rows


def markdown(result: dict[str, Any]) -> str:
    from shardfs.config import plural

    data = result["dataset"]
    shards = "; ".join(
        f"{fmt} {plural(v['shards'], 'shard')}, {v['bytes'] / 1e6:.0f} MB"
        for fmt, v in data["formats"].items()
    )
    asked = result.get("rounds_asked", result["rounds"])
    stopped = f" (of {asked} asked: --max-minutes)" if asked > result["rounds"] else ""
    lines = [
        f"Formats (issue 22): {data['images']} JPEGs in {data['classes']} classes "
        f"({data['image_bytes'] / 1e6:.0f} MB of images); {shards}. {result['pinning']['label']}; "
        f"ImageFolder + decode, {result['workers']} workers, batch 32, shuffle=True; per round "
        f"and format (order rotated each round) a fresh mount over an empty cache "
        f"(--cache-size {result['full']}x the format's bytes), then one cold epoch, page cache "
        f"dropped before the mount and before the epoch. Medians (min-max) over "
        f"{result['rounds']} rounds{stopped}. Index egress: bytes the mount fetched before the "
        "epoch, over the format's bytes; epoch egress likewise; mount + epoch over the images' "
        "bytes. Every format's mount showed the source's class folders with the same files and "
        "bytes.",
        "",
        "| format | images/s | mount s | index egress | epoch egress | mount + epoch / images "
        "| daemon CPU s | ImageFolder scan s | n |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def cell(s: dict[str, float] | None, digits: int = 2, scale: float = 1.0) -> str:
        if s is None:
            return "—"
        return (
            f"{num(s['median'] * scale, digits)} "
            f"({num(s['min'] * scale, digits)}-{num(s['max'] * scale, digits)})"
        )

    for row in _rows(result):
        lines.append(
            f"| {row['format']} | {cell(row['images_per_s'], 0)} | {cell(row['mount_s'], 1)} "
            f"| {cell(row['index_ratio'], 2, 100)} % | {cell(row['egress_ratio'], 3)}x "
            f"| {cell(row['first_epoch_over_images'], 3)}x | {cell(row['daemon_cpu_s'], 1)} "
            f"| {cell(row['scan_seconds'], 2)} | {row['n']} |"
        )
    lines += [
        "",
        "| ratio (per round) | median | min-max | per round | n |",
        "|---|---|---|---|---|",
    ]
    for name, by_round in result["ratios"].items():
        s = spread_of(list(by_round.values()))
        assert s is not None
        each = ", ".join(f"{v:.3f}" for _, v in sorted(by_round.items()))
        lines.append(
            f"| {name} | {s['median']:.3f} | {s['min']:.3f}-{s['max']:.3f} | {each} "
            f"| {s['n']:.0f} |"
        )
    extra = decode_cpu(result)
    if extra:
        lines += [
            "",
            "Decode CPU per image: the daemon's CPU over tar's in the same round, per image "
            "(µs; what decoding adds to serving the same images verbatim).",
            "",
            "| format | median µs | min-max | n |",
            "|---|---|---|---|",
        ]
        for fmt, by_round in extra.items():
            s = spread_of(list(by_round.values()))
            assert s is not None
            spread = f"{s['min']:.0f}-{s['max']:.0f}"
            lines.append(f"| {fmt} | {s['median']:.0f} | {spread} | {s['n']:.0f} |")
    lines += ["", *target_table(result["targets"], 3)]
    lines += ["", f"Command: `{result['command']}` ({result['total_s'] / 60:.1f} min)."]
    return "\n".join(lines) + "\n"


def write_reports(result: dict[str, Any], out: Path) -> dict[str, Any]:
    """formats.json and formats.md in ``out``; the result with its ratios and targets."""
    result = {**result, "decode_cpu_us": decode_cpu(result)}
    return write_section(result, out, "formats", round_ratios, targets, markdown)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=2000, help="images, ~100 KB each (2000)")
    parser.add_argument("--classes", type=int, default=10, help="classes (10)")
    parser.add_argument("--shards", type=int, default=12, help="tar and MDS shards, about (12)")
    parser.add_argument("--parquet-shards", type=int, default=4, help="parquet files (4)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds; targets need 5 (5)")
    parser.add_argument(
        "--max-minutes", type=float, default=None,
        help="start no round that would end the rounds past this many minutes (no limit)",
    )  # fmt: skip
    parser.add_argument("--full", type=float, default=3.0, help="cache / format's bytes (3)")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers (2)")
    parser.add_argument(
        "--formats",
        nargs="*",
        default=list(FORMATS),
        choices=FORMATS,
        help="formats to run (all; the ratios need tar)",
    )
    parser.add_argument(
        "--shardfs-arg", action="append", default=[], help="extra mount argument (repeatable)"
    )
    parser.add_argument("--work", type=Path, default=ROOT / "results" / "tmp")
    parser.add_argument("--out", type=Path, default=ROOT / "results")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run_to_the_end(FormatsBench(args), log)
    if result is None:
        return 130
    result = write_reports(result, args.out)
    print(markdown(result))
    print("\n".join(summary_lines(result["targets"], 3)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

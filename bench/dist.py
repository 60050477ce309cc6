"""`make bench-dist`: two simulated nodes train with DDP over their own shardfs mounts.

One moto S3 server (counting bytes per key, tests/support/moto_counting.py) holds one
packed ImageFolder. Each simulated node has its own mount and cache folder, reached through
its own pass-through proxy (tests/support/fault_proxy.py, no fault rules) so that the bytes
each node pulls are counted apart; the server's own count is the cluster total and must
equal their sum. Each node runs its own ``torchrun --nnodes 2 --node-rank K
--nproc-per-node 2`` (gloo, CPU) of examples/train_ddp.py for two epochs, once with
``ShardSampler`` (mode shard) and once with torch's ``DistributedSampler``. Between epochs
the ranks pause (``--sync-dir``) while the counters are read and zeroed, so each epoch's
egress is its own. Then the elastic run (bench/dist_resume.py): 2 nodes x 2 ranks stop
mid-epoch and resume on 1 x 2 and on 3 x 1. Writes results/dist.json and results/dist.md
and prints the table.
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
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

import dist_resume  # noqa: E402
from data import ensure_tree  # noqa: E402
from procs import force_unmount, run_to_the_end, wait_until  # noqa: E402
from support.fault_proxy import FaultProxy  # noqa: E402
from support.s3 import S3Server, free_port, until_quiet  # noqa: E402

BUCKET = "dist"
PREFIX = "data/train"
NODES = 2


def log(text: str) -> None:
    print(f"bench-dist: {text}", file=sys.stderr, flush=True)


def shardfs(*args: str, env: dict[str, str] | None = None) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "shardfs", *args],
        capture_output=True,
        text=True,
        check=False,
        env=env,
    )
    if result.returncode != 0:
        raise RuntimeError(f"shardfs {' '.join(args)} failed: {result.stderr.strip()}")


class Node:
    """One simulated node: its proxy, cache folder, mount and torchrun."""

    def __init__(self, rank: int, run_dir: Path, server: S3Server) -> None:
        self.rank = rank
        self.proxy = FaultProxy(server).start()
        self.cache = run_dir / f"cache-node{rank}"
        self.mnt = run_dir / f"mnt-node{rank}"
        self.log_path = run_dir / f"torchrun-node{rank}.log"
        self.proc: subprocess.Popen[str] | None = None
        self.mounted = False

    def env(self) -> dict[str, str]:
        return {**os.environ, **self.proxy.env()}

    def mount(self, source: str) -> None:
        shutil.rmtree(self.cache, ignore_errors=True)
        self.mnt.mkdir(parents=True, exist_ok=True)
        self.mounted = True
        shardfs("mount", source, str(self.mnt), "--cache-dir", str(self.cache), env=self.env())

    def unmount(self) -> None:
        if self.mounted:
            subprocess.run(
                [sys.executable, "-m", "shardfs", "umount", str(self.mnt)],
                capture_output=True,
                check=False,
            )
            force_unmount(self.mnt)
            self.mounted = False
        shutil.rmtree(self.cache, ignore_errors=True)

    def bytes(self) -> int:
        return sum(self.proxy.counts()["bytes_by_key"].values())

    def start_torchrun(self, args: argparse.Namespace, port: int, sampler: str, sync: Path) -> None:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            str(NODES),
            "--node-rank",
            str(self.rank),
            "--nproc-per-node",
            str(args.nproc),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            str(ROOT / "examples" / "train_ddp.py"),
            str(self.mnt),
            "--sampler",
            sampler,
            "--epochs",
            str(args.epochs),
            "--workers",
            str(args.workers),
            "--sync-dir",
            str(sync),
        ]
        env = {**self.env(), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        with self.log_path.open("w") as out:
            self.proc = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, text=True, env=env
            )

    def reports(self) -> list[dict[str, Any]]:
        """Every ``EPOCH {json}`` the node's ranks printed (their lines may interleave)."""
        text = self.log_path.read_text()
        decoder = json.JSONDecoder()
        found = []
        start = text.find("EPOCH {")
        while start >= 0:
            report, end = decoder.raw_decode(text, start + len("EPOCH "))
            found.append(report)
            start = text.find("EPOCH {", end)
        return found

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.unmount()
        self.proxy.stop()


class DistBench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.run_dir = args.work.absolute() / "dist-run"
        self.server = S3Server()
        self.nodes: list[Node] = []

    def setup(self) -> None:
        shutil.rmtree(self.run_dir, ignore_errors=True)
        self.run_dir.mkdir(parents=True)
        self.tree = ensure_tree(self.args.work.absolute(), self.args.images, self.args.classes, log)
        self.server.start()
        os.environ.update(self.server.env())
        self.server.create_bucket(BUCKET)
        shard_size = max(1 << 20, self.tree.image_bytes // self.args.shards)
        self.source = f"s3://{BUCKET}/{PREFIX}"
        shardfs("pack", str(self.tree.root), self.source, "--format", "webdataset",
                "--shard-size", str(shard_size), "--shuffle-seed", "0",
                "--cache-dir", str(self.run_dir / "pack-cache"))  # fmt: skip
        fs = self.server.filesystem()
        keys = sorted(fs.glob(f"{BUCKET}/{PREFIX}/*.tar"))
        self.shard_bytes = {os.path.basename(key): fs.size(key) for key in keys}
        self.shard_sizes = [self.shard_bytes[os.path.basename(key)] for key in keys]
        self.dataset_bytes = sum(self.shard_sizes)
        log(
            f"{self.tree.images} JPEGs in {len(self.shard_sizes)} shards "
            f"({self.dataset_bytes / 1e6:.1f} MB, largest {max(self.shard_sizes) / 1e6:.1f} MB)"
        )
        self.nodes = [Node(k, self.run_dir, self.server) for k in range(NODES)]
        wanted = max(after[0] for after in dist_resume.AFTER) if self.args.resume else 0
        self.spare = [Node(k, self.run_dir, self.server) for k in range(NODES, wanted)]

    def cleanup(self) -> None:
        for node in [*self.nodes, *getattr(self, "spare", [])]:
            node.stop()
        self.server.stop()

    def settle(self, nodes: list[Node] | None = None) -> None:
        """Wait until no node's proxy has counted a byte for 0.5 s (prefetches done)."""
        nodes = self.nodes if nodes is None else nodes
        until_quiet(lambda: [n.bytes() for n in nodes], what="the nodes' proxies")

    def counts(self, nodes: list[Node] | None = None) -> dict[str, Any]:
        per_node = [n.bytes() for n in (self.nodes if nodes is None else nodes)]
        return {
            "per_node_bytes": per_node,
            "server_bytes": self.server.counts()["get_object_bytes"],
        }

    def reset(self, nodes: list[Node] | None = None) -> None:
        for node in self.nodes if nodes is None else nodes:
            node.proxy.clear()
        self.server.reset_counts()

    def run_resume(self, after: tuple[int, int]) -> dict[str, Any]:
        nodes = [*self.nodes, *self.spare][: max(dist_resume.BEFORE[0], after[0])]
        log(f"elastic: {dist_resume.BEFORE} -> {after}, stopping at {self.args.stop:.0%}")
        result = dist_resume.world_change(
            nodes, self.source, after, self.args.stop, self.shard_bytes,
            settle=self.settle, counts=self.counts, reset=self.reset,
        )  # fmt: skip
        log(f"elastic: {after}: " + ", ".join(f"{k} {v}" for k, v in result["checks"].items()))
        return result

    def run_sampler(self, sampler: str) -> dict[str, Any]:
        log(f"{sampler}: mounting {NODES} nodes")
        for node in self.nodes:
            node.mount(self.source)
        self.settle()
        mount = self.counts()
        self.reset()
        sync = self.run_dir / f"sync-{sampler}"
        shutil.rmtree(sync, ignore_errors=True)
        sync.mkdir()
        port = free_port()
        started = time.perf_counter()
        for node in self.nodes:
            node.start_torchrun(self.args, port, sampler, sync)
        epochs = []
        for epoch in range(self.args.epochs):
            done = sync / f"epoch-{epoch}.done"

            def ready(done: Path = done, epoch: int = epoch) -> bool:
                for node in self.nodes:
                    assert node.proc is not None
                    if node.proc.poll() is not None:
                        raise RuntimeError(
                            f"torchrun on node {node.rank} exited with {node.proc.returncode} "
                            f"during epoch {epoch}; see {node.log_path}"
                        )
                return done.exists()

            wait_until(ready, f"epoch {epoch} of {sampler}", timeout=self.args.timeout)
            self.settle()
            counts = self.counts()
            epochs.append({"epoch": epoch, **counts})
            log(
                f"{sampler} epoch {epoch}: egress per node "
                + ", ".join(f"{b / 1e6:.1f} MB" for b in counts["per_node_bytes"])
                + f", server total {counts['server_bytes'] / 1e6:.1f} MB"
            )
            self.reset()
            (sync / f"epoch-{epoch}.go").write_text("")
        for node in self.nodes:
            assert node.proc is not None
            code = node.proc.wait(self.args.timeout)
            if code != 0:
                raise RuntimeError(f"torchrun on node {node.rank} exited with {code}")
        seconds = time.perf_counter() - started
        ranks = sorted(
            (r for node in self.nodes for r in node.reports()),
            key=lambda r: (r["epoch"], r["rank"]),
        )
        for node in self.nodes:
            node.unmount()
        return {
            "sampler": sampler,
            "mount": mount,
            "epochs": epochs,
            "ranks": ranks,
            "seconds": seconds,
        }

    def run(self) -> dict[str, Any]:
        started = time.perf_counter()
        self.setup()
        runs = [self.run_sampler(s) for s in self.args.samplers]
        resumes = [self.run_resume(a) for a in dist_resume.AFTER] if self.args.resume else []
        return {
            "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            "dataset": {
                "images": self.tree.images,
                "classes": self.tree.classes,
                "shards": len(self.shard_sizes),
                "dataset_bytes": self.dataset_bytes,
                "largest_shard_bytes": max(self.shard_sizes),
            },
            "nodes": NODES,
            "nproc_per_node": self.args.nproc,
            "workers_per_rank": self.args.workers,
            "runs": runs,
            "resumes": resumes,
            "total_s": time.perf_counter() - started,
        }


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 11's bench-dist targets, measured."""
    data = result["dataset"]
    bound = 1.05 * data["dataset_bytes"] + (result["nodes"] - 1) * data["largest_shard_bytes"]
    checks = []
    for run in result["runs"]:
        first = run["epochs"][0]["server_bytes"]
        checks.append(
            {
                "target": f"{run['sampler']}: epoch 0 cluster egress / dataset",
                "value": first / data["dataset_bytes"],
                "goal": f"<= {bound / data['dataset_bytes']:.3f} (1.05x + one shard per extra node)"
                if run["sampler"] == "shard"
                else "— (contrast, about 2x expected)",
                "met": first <= bound if run["sampler"] == "shard" else None,
            }
        )
        if len(run["epochs"]) > 1:
            later = max(e["server_bytes"] for e in run["epochs"][1:])
            checks.append(
                {
                    "target": f"{run['sampler']}: egress after epoch 0 (bytes, worst epoch)",
                    "value": later,
                    "goal": "== 0" if run["sampler"] == "shard" else "— (contrast)",
                    "met": later == 0 if run["sampler"] == "shard" else None,
                }
            )
        lengths = {r["len_sampler"] for r in run["ranks"]}
        seen = {r["samples_seen"] for r in run["ranks"]}
        checks.append(
            {
                "target": f"{run['sampler']}: every rank the same length and saw it",
                "value": None,
                "goal": f"len {sorted(lengths)}, seen {sorted(seen)}",
                "met": len(lengths) == 1 and seen == lengths,
            }
        )
        sums = all(sum(e["per_node_bytes"]) == e["server_bytes"] for e in run["epochs"])
        checks.append(
            {
                "target": f"{run['sampler']}: per-node proxy counts add up to the server's",
                "value": None,
                "goal": "equal",
                "met": sums,
            }
        )
    for resume in result["resumes"]:
        (n0, k0), (n1, k1) = resume["before"], resume["after"]
        change = f"{n0}x{k0} -> {n1}x{k1}"
        for name, met in resume["checks"].items():
            target = f"elastic {change}: {name}"
            checks.append({"target": target, "value": None, "goal": "yes", "met": met})
    return checks


def markdown(result: dict[str, Any], checks: list[dict[str, Any]]) -> str:
    data = result["dataset"]
    mb = 1e6
    lines = [
        f"Dataset: {data['images']} JPEGs, {data['classes']} classes, {data['shards']} shards, "
        f"{data['dataset_bytes'] / mb:.1f} MB (largest shard {data['largest_shard_bytes'] / mb:.1f}"
        f" MB); {result['nodes']} simulated nodes x {result['nproc_per_node']} ranks (gloo, "
        f"CPU, {result['workers_per_rank']} DataLoader workers per rank), each node with its own "
        "mount and cache; egress counted per node at a pass-through proxy and in total at the "
        "server.",
        "",
        "| sampler | epoch | node 0 MB | node 1 MB | cluster MB | cluster / dataset "
        "| epoch s (max over ranks) |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in result["runs"]:
        for epoch in run["epochs"]:
            ranks = [r for r in run["ranks"] if r["epoch"] == epoch["epoch"]]
            seconds = max((r["seconds"] for r in ranks), default=float("nan"))
            nodes = " | ".join(f"{b / mb:.1f}" for b in epoch["per_node_bytes"])
            total = epoch["server_bytes"]
            lines.append(
                f"| {run['sampler']} | {epoch['epoch']} | {nodes} | {total / mb:.1f}"
                f" | {total / data['dataset_bytes']:.3f} | {seconds:.1f} |"
            )
    lines += [
        "",
        "| sampler | epoch | rank | len(sampler) | samples seen | padded | epoch s | loss |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in result["runs"]:
        for r in run["ranks"]:
            lines.append(
                f"| {run['sampler']} | {r['epoch']} | {r['rank']} | {r['len_sampler']} "
                f"| {r['samples_seen']} | {r['num_padded'] if r['num_padded'] is not None else '—'}"
                f" | {r['seconds']:.1f} | {r['loss']:.3f} |"
            )
    if result["resumes"]:
        lines += dist_resume.markdown(result["resumes"], data["dataset_bytes"])
    lines += ["", "| target | measured | goal | met |", "|---|---|---|---|"]
    for check in checks:
        value = check["value"]
        shown = "—" if value is None else (f"{value:,.0f}" if value > 100 else f"{value:.3f}")
        met = {True: "yes", False: "**no**", None: "—"}[check["met"]]
        lines.append(f"| {check['target']} | {shown} | {check['goal']} | {met} |")
    lines.append("")
    for run in result["runs"]:
        mount = run["mount"]
        lines.append(
            f"- {run['sampler']}: mounting fetched "
            + ", ".join(f"{b / mb:.2f} MB" for b in mount["per_node_bytes"])
            + f" per node (not in epoch 0); run {run['seconds']:.0f} s"
        )
    lines += ["", f"Command: `{result['command']}` ({result['total_s'] / 60:.1f} min)."]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=800, help="images (800)")
    parser.add_argument("--classes", type=int, default=10, help="classes (10)")
    parser.add_argument("--shards", type=int, default=8, help="about this many shards (8)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--nproc", type=int, default=2, help="ranks per node (2)")
    parser.add_argument("--workers", type=int, default=0, help="DataLoader workers per rank")
    parser.add_argument(
        "--samplers", nargs="*", default=["shard", "distributed"], choices=["shard", "distributed"]
    )
    parser.add_argument(
        "--resume", action=argparse.BooleanOptionalAction, default=True,
        help="the elastic run: stop on 2 x 2 ranks, resume on 1 x 2 and 3 x 1 (on)",
    )  # fmt: skip
    parser.add_argument("--stop", type=float, default=0.5, help="where the elastic run stops")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per epoch")
    parser.add_argument("--work", type=Path, default=ROOT / "results" / "tmp")
    parser.add_argument("--out", type=Path, default=ROOT / "results")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run_to_the_end(DistBench(args), log)
    if result is None:
        return 130
    checks = targets(result)
    result["targets"] = checks
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "dist.json").write_text(json.dumps(result, indent=2) + "\n")
    table = markdown(result, checks)
    (args.out / "dist.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())

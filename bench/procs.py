"""Processes the bench starts and watches: daemons' CPU and peak RSS, mounts, the epoch runner,
the store's server (started on its own cores) and the page cache dropped for a cold baseline."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from pinning import Pinning

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
ROOT = Path(__file__).resolve().parents[1]
# moto keeps an object above this many bytes in a temporary file on disk (5 MiB by default),
# so dropping this node's page cache would also make the store read from disk. S3's own
# caches are not the node's: the bench keeps every object in the server's memory.
STORE_KEY_BUFFER = str(1 << 30)


def start_store(server: Any, pinning: Pinning) -> int:
    """Start ``server`` (tests/support/s3.py's ``S3Server``) with its objects in memory, move
    it (its threads and children) onto the store's cores, and return its pid."""
    os.environ.setdefault("MOTO_S3_DEFAULT_KEY_BUFFER_SIZE", STORE_KEY_BUFFER)
    server.start()
    pid: int = server.pid
    assert pid is not None, "the store did not start"
    pinning.pin_store(pid)
    return pid


def shardfs_cli(*args: str) -> None:
    """``python -m shardfs ARGS``; RuntimeError with its stderr when it fails."""
    result = subprocess.run(
        [sys.executable, "-m", "shardfs", *args], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        raise RuntimeError(f"shardfs {' '.join(args)} failed: {result.stderr.strip()}")


def pack_webdataset(tree: Any, source: str, shards: int, cache_dir: Path) -> None:
    """Pack ``tree`` (``data.ensure_tree``) into about ``shards`` webdataset shards at
    ``source``, shuffled with seed 0."""
    shard_size = max(1 << 20, tree.image_bytes // shards)
    shardfs_cli("pack", str(tree.root), source, "--format", "webdataset",
                "--shard-size", str(shard_size), "--shuffle-seed", "0",
                "--cache-dir", str(cache_dir))  # fmt: skip


def drop_page_cache() -> None:
    """``sync; echo 3 > /proc/sys/vm/drop_caches`` (root): the page cache, dentries and
    inodes, so the next local epoch reads the tree from disk."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def cpu_seconds(pid: int) -> float:
    """User + system CPU of ``pid`` (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def core_seconds(cpus: frozenset[int] | set[int]) -> dict[str, float]:
    """Time ``cpus`` spent so far (/proc/stat), summed, by kind: ``user`` (nice included),
    ``system``, ``irq`` (hard and soft interrupts), ``idle`` (iowait included: nothing to
    run, e.g. readers waiting on the network or on the daemon) and ``steal``."""
    total = {"user": 0, "system": 0, "irq": 0, "idle": 0, "steal": 0}
    for line in Path("/proc/stat").read_text().splitlines():
        name, _, rest = line.partition(" ")
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            user, nice, system, idle, iowait, irq, softirq, steal = map(int, rest.split()[:8])
            total["user"] += user + nice
            total["system"] += system
            total["irq"] += irq + softirq
            total["idle"] += idle + iowait
            total["steal"] += steal
    return {kind: ticks / CLOCK_TICKS for kind, ticks in total.items()}


def page_cache_drops() -> int:
    """Writes to /proc/sys/vm/drop_caches so far, by anyone on this machine (a drop by
    another process makes warm reads and kernel pushes pay twice)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/vmstat").read_text().splitlines():
            if line.startswith("drop_pagecache "):
                return int(line.split()[1])
    return 0


def reset_peak_rss(pid: int) -> None:
    """Zero VmHWM (Linux >= 4.0: writing 5 to clear_refs resets the peak RSS)."""
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/clear_refs").write_text("5")


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def minor_faults(pid: int) -> int:
    """Page faults of ``pid`` served without I/O (fresh anonymous pages among them)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[7])


def thread_cpu(pid: int) -> dict[str, tuple[float, float]]:
    """(CPU seconds, of which user) of ``pid``'s threads so far, summed by family: a
    thread's name without its number (``prefetch-3`` and ``prefetch-0`` are ``prefetch``).
    The CPU time is the scheduler's, in ns (/proc/PID/task/TID/schedstat): per-thread clock
    ticks would lose up to a tick per thread. The user share comes from the ticks."""
    out: dict[str, tuple[float, float]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            ran = int((task / "schedstat").read_text().split()[0]) / 1e9
            fields = (task / "stat").read_text().rpartition(")")[2].split()
        except (OSError, IndexError, ValueError):  # ended meanwhile
            continue
        family = name.rstrip("0123456789").rstrip("-_") or name
        total, user = out.get(family, (0.0, 0.0))
        out[family] = (total + ran, user + int(fields[11]) / CLOCK_TICKS)
    return out


class DaemonProbe:
    """CPU seconds and peak RSS of one daemon over one epoch."""

    def __init__(self, pid: int | None) -> None:
        self.pid = pid
        self._cpu = 0.0
        self._threads: dict[str, tuple[float, float]] = {}
        self._faults = 0

    def start(self) -> None:
        if self.pid is not None:
            reset_peak_rss(self.pid)
            self._cpu = cpu_seconds(self.pid)
            self._threads = thread_cpu(self.pid)
            self._faults = minor_faults(self.pid)

    def stop(self) -> dict[str, Any]:
        if self.pid is None:
            return {"daemon_cpu_s": None, "daemon_peak_rss_mb": None}
        threads = {}
        for name, (ran, user) in sorted(thread_cpu(self.pid).items()):
            ran_before, user_before = self._threads.get(name, (0.0, 0.0))
            threads[name] = [round(ran - ran_before, 4), round(user - user_before, 4)]
        return {
            "daemon_cpu_s": cpu_seconds(self.pid) - self._cpu,
            # By thread family: (CPU seconds, of which user) over the epoch.
            "daemon_threads": threads,
            "daemon_minor_faults": minor_faults(self.pid) - self._faults,
            "daemon_peak_rss_mb": peak_rss_mb(self.pid),
        }


def wait_until(condition: Any, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    delay = 0.02
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 2, 0.25)


def force_unmount(mountpoint: Path) -> None:
    """Best-effort unmount for cleanup paths (lazy if a normal unmount fails)."""
    tool = shutil.which("fusermount3") or shutil.which("fusermount") or "umount"
    if not os.path.ismount(mountpoint):
        return
    result = subprocess.run([tool, "-u", str(mountpoint)], capture_output=True, check=False)
    if result.returncode != 0:
        subprocess.run([tool, "-uz", str(mountpoint)], capture_output=True, check=False)


class EpochRunner:
    """A long-lived epoch subprocess (``bench/epoch.py`` unless ``command`` names another):
    one JSON request per stdin line in, one ``RESULT`` line out."""

    def __init__(self, command: list[str] | None = None) -> None:
        self.proc = subprocess.Popen(
            command or [sys.executable, str(ROOT / "bench" / "epoch.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )

    def run(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith("RESULT "):
                reply: dict[str, Any] = json.loads(line[len("RESULT ") :])
                if "error" in reply:
                    raise RuntimeError(f"epoch failed: {reply['error']}")
                return reply
        raise RuntimeError(f"the epoch runner exited (status {self.proc.wait()})")

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                assert self.proc.stdin is not None
                self.proc.stdin.close()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


class Runnable(Protocol):
    def run(self) -> dict[str, Any]: ...

    def cleanup(self) -> None: ...


def run_to_the_end(bench: Runnable, log: Callable[[str], None]) -> dict[str, Any] | None:
    """``bench.run()``, cleaned up whatever happens; None if SIGINT or SIGTERM stopped it."""

    def interrupted(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    # A shell starts background jobs with SIGINT ignored; Ctrl-C must still clean up.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return bench.run()
    except KeyboardInterrupt:
        log("interrupted; cleaning up")
        return None
    finally:
        bench.cleanup()

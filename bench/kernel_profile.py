"""The readers' core in the kernel, per epoch (`bench/streaming.py --kernel-profile`).

This VM hands free memory back to its host in 2 MiB blocks as soon as they are free (the
guest's free page reporting, ``/sys/module/page_reporting/parameters``: order 9, no delay).
A page later taken from such a block is backed by the host again at its first touch, so
the guest's zeroing of a fresh page (``clear_page_*``) costs far more than on a machine
that keeps its memory. Who gets such pages in an epoch is a matter of which blocks were
free when, so the readers' system time moves from epoch to epoch with it.

Two measurements, both per epoch:
- ``reported_mb``: memory the guest handed back to the host during the epoch (the
  module's ``reported_kib``), where the kernel has free page reporting; None elsewhere.
- with ``--kernel-profile``: ``perf record -a`` on the readers' cores over the whole run,
  its samples cut by each epoch's monotonic times and split by who ran: the daemon (its
  pid), kernel threads, and everything else on those cores (the readers: the epoch process
  and its DataLoader workers; the bench's own process is there too, mostly asleep). Each
  gets its samples in the kernel and, of those, in page zeroing, as seconds (samples over
  the sampling rate).
"""

from __future__ import annotations

import contextlib
import re
import shutil
import signal
import subprocess
from bisect import bisect_left, bisect_right
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPORTED_KIB = Path("/sys/module/page_reporting/parameters/reported_kib")
RATE = 499  # samples/s per core: off the timer's beat
# Kernel threads by name; anything else on the readers' cores that is not the daemon is
# taken for a reader.
_KERNEL_THREADS = re.compile(
    r"^(swapper|kworker|ksoftirqd|rcu|migration|kcompactd|khugepaged|kswapd|kdamond|"
    r"cpuhp|idle_inject|watchdog|perf|jbd2|kthreadd|oom_reaper|irq/)"
)
_ZEROING = ("clear_page", "clear_huge_page", "folio_zero_user")
# `perf script -F comm,pid,time,ip,sym,dso`: the command may hold spaces; the pid, the
# time (with a colon), the address, the symbol and the object in parentheses follow it.
_LINE = re.compile(
    r"^\s*(?P<comm>.*?)\s+(?P<pid>\d+)\s+(?P<time>\d+\.\d+):\s+[0-9a-f]+\s+"
    r"(?P<sym>.*?)\s+\((?P<dso>[^()]*)\)\s*$"
)


def reported_kib() -> int | None:
    """KiB this guest has handed back to its host since boot; None without reporting."""
    try:
        return int(REPORTED_KIB.read_text())
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class Sample:
    comm: str
    pid: int
    time: float
    sym: str
    kernel: bool

    @property
    def zeroing(self) -> bool:
        return self.kernel and self.sym.startswith(_ZEROING)


def parse(lines: Iterable[str]) -> list[Sample]:
    """The samples of ``perf script -F comm,pid,time,ip,sym,dso`` output (others skipped)."""
    samples = []
    for line in lines:
        match = _LINE.match(line)
        if match is None:
            continue
        symbol = match["sym"].split("+", 1)[0]
        kernel = match["dso"].startswith("[kernel")
        samples.append(
            Sample(match["comm"], int(match["pid"]), float(match["time"]), symbol, kernel)
        )
    return samples


def split_epoch(
    samples: Iterable[Sample], began: float, ended: float, daemon: int | None, rate: float
) -> dict[str, float]:
    """Seconds of one epoch's window by who ran (readers, daemon, kernel threads), each with
    its seconds in the kernel and in page zeroing."""
    seconds: dict[str, float] = {}
    for sample in samples:
        if not began <= sample.time <= ended or sample.pid == 0:
            continue
        if daemon is not None and sample.pid == daemon:
            who = "daemon"
        elif _KERNEL_THREADS.match(sample.comm):
            who = "kernel_threads"
        else:
            who = "readers"
        for part, counts in (("", True), ("_kernel", sample.kernel), ("_zeroing", sample.zeroing)):
            if counts:
                seconds[who + part] = seconds.get(who + part, 0.0) + 1 / rate
    return seconds


class CoreProfile:
    """``perf record -a`` of some cores, on CLOCK_MONOTONIC (so epochs' ``time.monotonic``
    windows cut it), until ``stop``."""

    def __init__(self, cpus: Iterable[int], out: Path, rate: float = RATE) -> None:
        self.cpus = sorted(cpus)
        self.out = out
        self.rate = rate
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        perf = shutil.which("perf")
        if perf is None:
            raise RuntimeError("--kernel-profile needs perf (Debian: linux-perf)")
        command = [perf, "record", "--all-cpus", "--cpu", ",".join(map(str, self.cpus)),
                   "--freq", str(int(self.rate)), "--clockid", "CLOCK_MONOTONIC",
                   "--quiet", "--output", str(self.out)]  # fmt: skip
        self._process = subprocess.Popen(command, stdout=subprocess.DEVNULL)

    def stop(self) -> list[Sample]:
        """End the recording; its samples."""
        process, self._process = self._process, None
        if process is None:
            return []
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if not self.out.exists():
            raise RuntimeError(f"perf recorded nothing into {self.out} (is perf allowed here?)")
        script = subprocess.run(
            ["perf", "script", "--input", str(self.out), "--fields", "comm,pid,time,ip,sym,dso"],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        return parse(script.stdout.splitlines())


def annotate(records: list[dict[str, Any]], samples: list[Sample], rate: float) -> None:
    """Put each epoch's split (``split_epoch``) into its record, as ``kernel_profile``. The
    samples are sorted once and each window cut by bisection, not scanned whole per epoch."""
    ordered = sorted(samples, key=lambda sample: sample.time)
    times = [sample.time for sample in ordered]
    for record in records:
        window = record.get("monotonic")
        if window:
            inside = ordered[bisect_left(times, window[0]) : bisect_right(times, window[1])]
            record["kernel_profile"] = split_epoch(
                inside, window[0], window[1], record.get("daemon_pid"), rate
            )


def profile_lines(records: list[dict[str, Any]], median: Any) -> list[str]:
    """The report's table of the readers' core in the kernel (medians per contender)."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for record in records:
        if "kernel_profile" in record or record.get("reported_mb") is not None:
            key = (record["contender"], record.get("cache", "-"), bool(record.get("shaped")),
                   record["epoch"])  # fmt: skip
            groups.setdefault(key, []).append(record)
    if not groups:
        return []
    columns = ["readers_kernel", "readers_zeroing", "daemon_kernel", "daemon_zeroing",
               "kernel_threads"]  # fmt: skip
    lines = [
        "",
        "The readers' core in the kernel (`--kernel-profile`: perf on that core, medians, s): "
        "the readers' (epoch process, DataLoader workers) kernel time and, of it, the zeroing "
        "of fresh pages; the same for the daemon; kernel threads. Handed back: memory the "
        "guest returned to its host during the epoch (free page reporting, MB); a page taken "
        "from it later is backed again by the host at its first touch, which is what makes "
        "zeroing slow in this VM.",
        "",
        "| contender | cache | shaped | epoch | readers kernel | readers zeroing "
        "| daemon kernel | daemon zeroing | kernel threads | handed back MB | n |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (contender, cache, shaped, epoch), rows in groups.items():
        profiled = [r["kernel_profile"] for r in rows if "kernel_profile" in r]
        cells = [
            f"{median([p.get(c, 0.0) for p in profiled]):.2f}" if profiled else "—" for c in columns
        ]
        handed = [r["reported_mb"] for r in rows if r.get("reported_mb") is not None]
        cells.append(f"{median(handed):,.0f}" if handed else "—")
        lines.append(
            f"| {contender} | {cache} | {'yes' if shaped else 'no'} | {epoch} | "
            + " | ".join(cells) + f" | {len(rows)} |"
        )  # fmt: skip
    return lines

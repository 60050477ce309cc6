"""bench/kernel_profile.py: perf samples of the readers' core cut by epoch and split by who
ran, and page zeroing told apart from the rest of the kernel."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from kernel_profile import annotate, parse, profile_lines, split_epoch

RATE = 100.0
# What `perf script -F comm,pid,time,ip,sym,dso` prints: the daemon is pid 500, a
# DataLoader worker 601 (a command with a space), a kernel thread, the idle task.
LINES = """\
         swapper     0 10.000000:  ffffffff82240ddb pv_native_safe_halt ([kernel.kallsyms])
  pt_data_worker   601 10.100000:  ffffffff81a0c2f0 clear_page_erms ([kernel.kallsyms])
  pt_data_worker   601 10.200000:  ffffffff81a0c2f0 clear_page_erms ([kernel.kallsyms])
  pt_data_worker   601 10.300000:  ffffffff8111aa00 filemap_read ([kernel.kallsyms])
  pt_data_worker   601 10.400000:      7f8a0078a7a4 PyLong_FromLong (/usr/lib/libpython3.11.so.1.0)
  my reader        602 10.500000:      7f8a00000000 [unknown] ([unknown])
   shardfs-push   500 10.600000:  ffffffff81b00000 folio_zero_user ([kernel.kallsyms])
       prefetch-0   500 10.700000:      7f8a11111111 _PyEval_EvalFrameDefault (/usr/lib/x.so)
    kworker/0:1    33 10.800000:  ffffffff81c00000 process_one_work ([kernel.kallsyms])
  pt_data_worker   601 12.500000:  ffffffff81a0c2f0 clear_page_erms ([kernel.kallsyms])
not a sample line
"""


def test_samples_are_split_by_who_ran_and_zeroing_is_counted_apart() -> None:
    samples = parse(LINES.splitlines())
    assert len(samples) == 10
    assert samples[5].comm == "my reader" and samples[5].pid == 602
    seconds = split_epoch(samples, 10.0, 11.0, daemon=500, rate=RATE)
    assert seconds == pytest.approx({
        "readers": 0.05, "readers_kernel": 0.03, "readers_zeroing": 0.02,
        "daemon": 0.02, "daemon_kernel": 0.01, "daemon_zeroing": 0.01,
        "kernel_threads": 0.01, "kernel_threads_kernel": 0.01,
    })  # fmt: skip
    # Outside the window (12.5 s) counts nowhere; without a daemon pid it is a reader.
    alone = split_epoch(samples, 10.55, 13.0, daemon=None, rate=RATE)
    assert alone == pytest.approx({
        "readers": 0.03, "readers_kernel": 0.02, "readers_zeroing": 0.02,
        "kernel_threads": 0.01, "kernel_threads_kernel": 0.01,
    })  # fmt: skip


def test_each_epoch_gets_its_split_and_the_report_summarizes_each_column() -> None:
    samples = parse(LINES.splitlines())
    records = [
        {"contender": "shard", "cache": "full", "shaped": False, "epoch": "cold",
         "monotonic": [10.0, 11.0], "daemon_pid": 500, "reported_mb": 40.0},
        {"contender": "shard", "cache": "full", "shaped": False, "epoch": "cold",
         "monotonic": [12.0, 13.0], "daemon_pid": 500, "reported_mb": 60.0},
        {"contender": "floor", "epoch": "-"},  # no window: left alone
    ]  # fmt: skip
    annotate(records, samples, RATE)
    assert records[0]["kernel_profile"]["readers_zeroing"] == pytest.approx(0.02)
    assert records[1]["kernel_profile"] == pytest.approx(
        {"readers": 0.01, "readers_kernel": 0.01, "readers_zeroing": 0.01}
    )
    assert "kernel_profile" not in records[2]
    # The report applies the summary it is given to each column (max here: no halves to
    # round): readers kernel, readers zeroing, daemon kernel, daemon zeroing, kernel
    # threads, handed back MB, then n.
    lines = profile_lines(records, max)
    row = next(line for line in lines if line.startswith("| shard "))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[4:] == ["0.03", "0.02", "0.01", "0.01", "0.01", "60", "2"]
    assert profile_lines([{"contender": "floor", "epoch": "-"}], statistics.median) == []

"""CPU pinning for benchmarks: the store's processes on the last core, everything else on the
others, as a training node sees S3 (the store's CPU is not the node's).

With two cores a server sharing the readers' cores measures the server: moto's CPU per
request is far above S3's cost to a client. ``Pinning.shared()`` keeps the old setting, for
figures labelled as shared-core context.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def _all_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


@dataclass(frozen=True)
class Pinning:
    """Which cores the store gets and which the readers, the workers and the daemon get."""

    store: frozenset[int]
    readers: frozenset[int]

    @classmethod
    def split(cls) -> Pinning:
        """The last core for the store, the others for the readers (one core: shared)."""
        cpus = _all_cpus()
        if len(cpus) < 2:
            return cls.shared()
        return cls(frozenset(cpus[-1:]), frozenset(cpus[:-1]))

    @classmethod
    def shared(cls) -> Pinning:
        cpus = frozenset(_all_cpus())
        return cls(cpus, cpus)

    @property
    def pinned(self) -> bool:
        return not self.store & self.readers

    def label(self) -> str:
        if not self.pinned:
            return f"shared cores {sorted(self.readers)} (context: the store competes with readers)"
        store, readers = sorted(self.store), sorted(self.readers)
        return f"store on CPU {store}, readers and daemon on CPU {readers}"

    def as_dict(self) -> dict[str, object]:
        return {"store": sorted(self.store), "readers": sorted(self.readers), "pinned": self.pinned}

    def pin_self_to_readers(self) -> None:
        """This process (and every process it starts from now on) on the readers' cores."""
        pin_process(os.getpid(), self.readers)

    def pin_store(self, pid: int) -> None:
        """A store process already running (all its threads, and its children)."""
        pin_process(pid, self.store, children=True)

    def placement(
        self, store: dict[str, int | None], readers: dict[str, int | None]
    ) -> dict[str, Any]:
        """Where the named processes may run now (``affinity``: their main threads' cores)
        and which are not where this pinning puts them (``misplaced``: one line each)."""
        found: dict[str, list[int] | None] = {}
        misplaced = []
        for cpus, processes in ((self.store, store), (self.readers, readers)):
            for name, pid in processes.items():
                if pid is None:
                    continue
                found[name] = affinity(pid)
                if found[name] is not None and set(found[name] or ()) != cpus:
                    misplaced.append(f"{name} on CPU {found[name]}, expected {sorted(cpus)}")
        return {"affinity": found, "misplaced": misplaced}


def affinity(pid: int) -> list[int] | None:
    """The cores ``pid`` (its main thread) may run on; None if it is gone."""
    try:
        return sorted(os.sched_getaffinity(pid))
    except OSError:
        return None


def pin_process(pid: int, cpus: frozenset[int], *, children: bool = False) -> None:
    """Set the affinity of every thread of ``pid`` (``taskset -a -p``), and of its children
    with ``children``; threads and processes started later inherit it."""
    tasks = Path(f"/proc/{pid}/task")
    tids = [int(name) for name in os.listdir(tasks)] if tasks.exists() else [pid]
    for tid in tids:
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(tid, cpus)
    if children:
        for tid in tids:
            with contextlib.suppress(OSError):
                for child in (tasks / str(tid) / "children").read_text().split():
                    pin_process(int(child), cpus, children=True)

"""What a ``ShardSampler`` resume point holds, and the checks that it belongs to this run.

A state (version 2) names the run (seed, mode, shuffle, drop_last, window, sample count,
a fingerprint of the table) and the epoch's position: ``segments``, one
``[nodes, ranks per node, yielded per rank]`` per world the epoch ran on so far, and
``consumed``, the indices the whole world yielded so far (the sum of nodes x ranks x
yielded). Every rank of a DDP world is at the same position, so any rank's state loads on
every rank of any world. A state from before version 2 (epoch, yielded, seed, length)
names no world: it loads only where the per-rank length is the one it was saved with.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from .plan import Segment

VERSION = 2
LEGACY_KEYS = ("epoch", "yielded", "seed", "length")
RUN_KEYS = ("seed", "mode", "shuffle", "drop_last", "window", "num_samples", "table")


def fingerprint(*arrays: npt.NDArray[np.int64] | None) -> int:
    """A 63-bit digest of the table as the sampler sees it (shard and row of each sample)."""
    digest = hashlib.blake2b(digest_size=8)
    for array in arrays:
        digest.update(b"-" if array is None else np.ascontiguousarray(array, np.int64).tobytes())
    return int.from_bytes(digest.digest(), "little") >> 1


@dataclass(frozen=True)
class Resume:
    """A loaded position: ``segments`` done before this world's, then ``start`` indices this
    rank already yielded in its own (a same-world resume continues its segment)."""

    epoch: int
    segments: tuple[Segment, ...]
    start: int
    legacy: bool = False


def make_state(run: Mapping[str, Any], epoch: int, segments: Sequence[Segment]) -> dict[str, Any]:
    return {
        "version": VERSION,
        **run,
        "epoch": epoch,
        "segments": [list(s) for s in segments],
        "consumed": sum(n * k * y for n, k, y in segments),
    }


def read_state(
    state: Mapping[str, Any], run: Mapping[str, Any], world: tuple[int, int], length: int
) -> Resume:
    """The position ``state`` holds for this ``run`` on ``world`` (nodes, ranks per node),
    or a one-line ValueError saying why it does not belong here."""
    if "version" not in state:
        return _read_legacy(state, run, length)
    if state["version"] != VERSION:
        raise ValueError(f"a ShardSampler state of version {state['version']}; this is {VERSION}")
    missing = [key for key in (*RUN_KEYS, "epoch", "segments") if key not in state]
    if missing:
        raise ValueError(f"not a ShardSampler state (missing {', '.join(missing)})")
    differ = [
        f"{key} {state[key]!r} here {run[key]!r}" for key in RUN_KEYS if state[key] != run[key]
    ]
    if differ:
        raise ValueError(f"the state is from another run ({'; '.join(differ)})")
    segments = [tuple(int(v) for v in s) for s in state["segments"]]
    if any(len(s) != 3 or s[0] < 1 or s[1] < 1 or s[2] < 0 for s in segments):
        raise ValueError(
            f"the state's segments {state['segments']!r} are not [nodes, ranks, yielded]"
        )
    done: tuple[Segment, ...] = tuple(segments)  # type: ignore[arg-type]
    if done and done[-1][:2] == world:  # the same world: carry on in its own segment
        return Resume(int(state["epoch"]), done[:-1], done[-1][2])
    return Resume(int(state["epoch"]), tuple(s for s in done if s[2]), 0)


def _read_legacy(state: Mapping[str, Any], run: Mapping[str, Any], length: int) -> Resume:
    missing = [key for key in LEGACY_KEYS if key not in state]
    if missing:
        raise ValueError(f"not a ShardSampler state (missing {', '.join(missing)})")
    if state["seed"] != run["seed"]:
        raise ValueError(
            f"the state is from another run (seed {state['seed']}, here {run['seed']})"
        )
    if state["length"] != length:
        raise ValueError(
            f"the state predates elastic resume and names no world: it resumes only a world of "
            f"{state['length']} indices per rank, not this one of {length}"
        )
    if not 0 <= state["yielded"] <= length:
        raise ValueError(f"yielded {state['yielded']} is outside 0..{length}")
    return Resume(int(state["epoch"]), (), int(state["yielded"]), legacy=True)

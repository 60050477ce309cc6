"""The bench's own checks: where its processes run (bench/pinning.py) and how its report pairs
each streaming epoch with the local ones next to it (bench/report.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from pinning import Pinning
from report import split_rows, targets


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning needs two cores")
def test_placement_finds_a_process_off_its_cores() -> None:
    pinning = Pinning.split()
    assert pinning.pinned and not pinning.store & pinning.readers
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        pinning.pin_store(child.pid)
        assert pinning.placement({"server": child.pid}, {})["misplaced"] == []
        # The same process where a reader should be: reported, with the cores it has.
        found = pinning.placement({}, {"daemon": child.pid, "gone": None})
        assert found["affinity"] == {"daemon": sorted(pinning.store)}
        assert found["misplaced"] == [
            f"daemon on CPU {sorted(pinning.store)}, expected {sorted(pinning.readers)}"
        ]
    finally:
        child.kill()
        child.wait()


def _epoch(contender: str, epoch: str, images_per_s: float, **extra: Any) -> dict[str, Any]:
    return {"contender": contender, "mode": "decode", "workers": 2, "epoch": epoch,
            "images_per_s": images_per_s, "mb_per_s": images_per_s / 10, **extra}  # fmt: skip


def _result(epochs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "pinning": {"store": [1], "readers": [0], "pinned": True, "label": "split"},
        "dataset": {"shard_bytes": 10**8, "images": 1000},
        "server": {"peak_mb_per_s": 100.0},
        "warm_all": {"ratio_to_ideal": 1.0},
        "epochs": epochs,
    }


def test_cold_epochs_are_paired_with_both_local_baselines_and_shared_rows_kept_apart() -> None:
    epochs = []
    for dropped, warm, cold in ((80.0, 100.0, 90.0), (70.0, 100.0, 77.0)):
        pair = {"pair_local_images_per_s": warm, "pair_local_dropped_images_per_s": dropped}
        epochs += [
            _epoch("local", "dropped", dropped, pair_local_images_per_s=warm, cores="pinned"),
            _epoch("local", "-", warm, cores="pinned"),
            _epoch("shardfs-shard", "cold", cold, cores="pinned", **pair),
        ]
    shared = {"pair_local_images_per_s": 200.0, "pair_local_dropped_images_per_s": 100.0}
    epochs.append(_epoch("shardfs-shard", "cold", 50.0, cores="shared", **shared))
    result = _result(epochs)
    rows, context = split_rows(result)

    cold = next(r for r in rows if r["contender"] == "shardfs-shard")
    assert cold["pair_vs_local"]["median"] == pytest.approx((0.90 + 0.77) / 2)
    assert cold["pair_vs_local_dropped"]["min"] == pytest.approx(77 / 70)
    assert cold["pair_vs_local_dropped"]["max"] == pytest.approx(90 / 80)
    dropped = next(r for r in rows if r["epoch"] == "dropped")
    assert dropped["pair_vs_local"]["median"] == pytest.approx(0.75)
    # The shared-core epoch is context: its own row, outside the targets' rows.
    assert [(r["contender"], r["cores"]) for r in context] == [("shardfs-shard", "shared")]
    assert cold["runs"] == 2 and cold["images_per_s"]["median"] == pytest.approx(83.5)

    checks = {c["target"]: c for c in targets({**result, "epochs": epochs}, rows)}
    name = "decode w2 shardfs-shard cold images/s / local after drop_caches (paired)"
    against_disk = checks[name]
    assert against_disk["value"] == pytest.approx((90 / 80 + 77 / 70) / 2)
    assert against_disk["goal"] == ">= 1.0" and against_disk["met"] is False  # 2 pairs of 5
    # Context rows for contenders that did not run are left out, not shown empty.
    assert not any(name.startswith("decode w2 webdataset") for name in checks)


def test_streaming_ratios_are_set_against_the_floor_measured_in_their_round() -> None:
    """bench/streaming.py: a round's floor (curl + page-cache fill CPU on the readers' core)
    bounds its cold ratios: a warm epoch of 10 s plus a 0.5 s floor allows at most 10/10.5,
    and a full-cache epoch at 0.9 of warm is 0.945 of that limit; a round without a floor
    gets neither ratio."""
    from streaming import round_ratios

    def epoch(round_: int, contender: str, rate: float, **fields: Any) -> dict[str, Any]:
        return {"round": round_, "contender": contender, "images_per_s": rate, **fields}

    epochs = [
        epoch(0, "local", 300.0, epoch="warm"),
        epoch(0, "local", 250.0, epoch="dropped"),
        {"round": 0, "contender": "floor", "epoch": "-", "floor_s": 0.5},
        epoch(0, "shard", 270.0, epoch="cold", cache="full", shaped=False),
        epoch(1, "local", 300.0, epoch="warm"),
        epoch(1, "shard", 240.0, epoch="cold", cache="full", shaped=False),
    ]
    result = {"rounds": 2, "epochs": epochs, "dataset": {"images": 3000}}
    ratios = round_ratios(result)
    assert ratios["limit: cold / local warm"] == {0: pytest.approx(10 / 10.5)}
    assert ratios["shard full / local warm"] == {0: 0.9, 1: 0.8}
    assert ratios["shard full / limit"] == {0: pytest.approx(0.9 * 10.5 / 10)}

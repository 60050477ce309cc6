"""The formats bench's report (bench/formats.py): per-round ratios to the tar epoch of the
same round, and issue 22's targets, "within 0.05 of tar" read as |ratio - 1| <= 0.05."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from formats import markdown, round_ratios, targets
from report import MIN_PAIRS, spread_of, within_verdict


def _epoch(fmt: str, round_: int, rate: float, **extra: Any) -> dict[str, Any]:
    record = {"format": fmt, "round": round_, "images": 100, "seconds": 100 / rate,
              "images_per_s": rate, "mount_s": 1.0, "index_ratio": 0.001,
              "egress_ratio": 1.0, "first_epoch_over_images": 1.01, "daemon_cpu_s": 1.0,
              "scan_seconds": 0.1}  # fmt: skip
    return {**record, **extra}


def test_within_verdict_needs_the_median_in_the_band_over_enough_pairs() -> None:
    inside = spread_of([0.97, 1.0, 1.02, 1.04, 0.99])
    assert within_verdict(inside, 1.0, 0.05) == (True, "yes")
    straddles = spread_of([0.90, 0.97, 1.0, 1.02, 1.04])
    assert within_verdict(straddles, 1.0, 0.05) == (True, "yes, within noise")
    slow = spread_of([0.80, 0.82, 0.85, 0.83, 0.81])
    assert within_verdict(slow, 1.0, 0.05) == (False, "**no**")
    fast = spread_of([1.06, 1.2, 1.3, 1.1, 1.08])  # too fast is outside the band too
    assert within_verdict(fast, 1.0, 0.05)[0] is False
    few = spread_of([1.0] * (MIN_PAIRS - 1))
    assert within_verdict(few, 1.0, 0.05) == (False, f"**no**: 4 pairs, {MIN_PAIRS} needed")
    assert within_verdict(None, 1.0, 0.05) == (None, "—")


def test_ratios_pair_each_format_with_the_tar_epoch_of_its_round() -> None:
    epochs = []
    for round_, (tar, parquet, mds) in enumerate([(100, 99, 80), (120, 126, 90)]):
        epochs += [_epoch("tar", round_, tar), _epoch("parquet", round_, parquet),
                   _epoch("mds", round_, mds, index_ratio=0.03,
                          first_epoch_over_images=1.06)]  # fmt: skip
    epochs.append(_epoch("zip", 0, 50))  # a zip epoch in round 0 only
    # The tar mounted from its sidecar, in both rounds: parquet and MDS are paired with it too.
    epochs += [_epoch("tar-sidecar", 0, 110), _epoch("tar-sidecar", 1, 100)]
    result = {"rounds": 2, "epochs": epochs}
    ratios = round_ratios(result)
    assert ratios["parquet / tar"] == pytest.approx({0: 0.99, 1: 1.05})
    assert ratios["mds / tar"] == pytest.approx({0: 0.8, 1: 0.75})
    assert ratios["zip / tar"] == pytest.approx({0: 0.5})
    assert ratios["parquet / tar-sidecar"] == pytest.approx({0: 0.9, 1: 1.26})
    assert ratios["mds / tar-sidecar"] == pytest.approx({0: 80 / 110, 1: 0.9})
    assert ratios["tar-sidecar / tar"] == pytest.approx({0: 1.1, 1: 100 / 120})
    assert "zip / tar-sidecar" not in ratios  # only parquet and MDS download in their epoch
    # mount + epoch: 1 s of mount each, so 100 images over (1 + 100 / rate) seconds.
    assert ratios["parquet / tar, mount + epoch"][0] == pytest.approx((1 + 1.0) / (1 + 100 / 99))

    checks = {c["target"]: c for c in targets(result, ratios)}
    plain = "the tar mount downloaded the images"
    speed = checks[f"parquet / tar, cold decode images/s (per round; {plain})"]
    assert speed["value"] == pytest.approx(1.02) and speed["met"] is False  # 2 rounds of 5
    both = "both epochs download them"
    sidecar = checks[f"parquet / tar-sidecar, cold decode images/s (per round; {both})"]
    assert sidecar["value"] == pytest.approx(1.08) and sidecar["met"] is False
    assert checks["mds: index egress / shard bytes (worst)"]["met"] is False
    assert checks["mds: first mount + epoch egress / images' bytes (worst)"]["met"] is False
    assert checks["parquet: index egress / shard bytes (worst)"]["met"] is True
    assert checks["zip: first mount + epoch egress / images' bytes (worst)"]["met"] is True

    report = {**result, "ratios": ratios, "targets": list(checks.values()), "workers": 2,
              "full": 3.0, "total_s": 60.0, "command": "bench/formats.py",
              "pinning": {"label": "store on CPU [1]"},
              "dataset": {"images": 100, "classes": 10, "image_bytes": 10**7,
                          "formats": {"tar": {"shards": 2, "bytes": 10**7}}}}  # fmt: skip
    text = markdown(report)
    assert "| parquet / tar | 1.020 | 0.990-1.050 | 0.990, 1.050 | 2 |" in text


def test_decode_cpu_is_the_daemon_cpu_over_tars_of_the_same_round_per_image() -> None:
    from formats import decode_cpu

    epochs = [
        _epoch("tar", 0, 100, daemon_cpu_s=2.0),
        _epoch("tar.gz", 0, 90, daemon_cpu_s=2.05),
        _epoch("tar", 1, 100, daemon_cpu_s=3.0),
        _epoch("tar.gz", 1, 90, daemon_cpu_s=3.2),
        _epoch("zip-deflate", 1, 90, daemon_cpu_s=3.1),
        _epoch("parquet", 1, 90, daemon_cpu_s=9.0),  # verbatim: not a decoded kind
    ]
    result = {"rounds": 2, "epochs": epochs, "dataset": {"images": 100}}
    extra = decode_cpu(result)
    assert extra["tar.gz"] == pytest.approx({0: 500.0, 1: 2000.0})  # µs per image
    assert extra["zip-deflate"] == pytest.approx({1: 1000.0})
    assert "parquet" not in extra

"""The test S3 server's shaping mode (a store with latency): first-byte latency and a
bandwidth cap per response, with the byte counters and the bytes themselves unchanged.

Timings are checked only from below (the shaping must have happened); nothing here is a
speed target."""

from __future__ import annotations

import hashlib
import time

import pytest
from support.moto_counting import PACE_BYTES, Shaping
from support.s3 import S3Server, S3ServerError

PAYLOAD = bytes(range(256)) * (12 << 10)  # 3 MiB, not a multiple of the pace's piece


def _timed_range(server: S3Server, path: str, start: int, end: int) -> tuple[bytes, float]:
    fs = server.filesystem()
    fs.info(path)  # connect (and sign) before the clock starts
    started = time.monotonic()
    data = fs.cat_file(path, start=start, end=end)
    return data, time.monotonic() - started


@pytest.mark.s3
def test_a_server_started_shaped_holds_and_caps_every_get(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Latency from the environment, the cap from the parameter: both ways in.
    monkeypatch.setenv("MOTO_COUNTING_LATENCY_MS", "80")
    with S3Server(bandwidth_mb=10) as server:
        server.create_bucket("shaped")
        server.filesystem().pipe_file("shaped/blob", PAYLOAD)
        server.reset_counts()
        start, end = 1000, 1000 + 2_000_000
        data, seconds = _timed_range(server, "shaped/blob", start, end)

        assert hashlib.sha256(data).digest() == hashlib.sha256(PAYLOAD[start:end]).digest()
        # 80 ms + 2 MB at 10 MB/s; unshaped, this GET takes a few ms.
        assert seconds >= 0.98 * (0.080 + 2_000_000 / 10e6)
        counts = server.counts()
        assert counts["get_object_bytes_by_key"] == {"shaped/blob": end - start}
        assert counts["get_object_requests"] == 1


@pytest.mark.s3
def test_shaping_changes_at_run_time_and_turns_off(s3_server: S3Server) -> None:
    s3_server.create_bucket("shape-runtime")
    fs = s3_server.filesystem()
    fs.pipe_file("shape-runtime/small", b"s" * 100)
    try:
        assert s3_server.shape(latency_ms=150) == {"latency_ms": 150.0, "bandwidth_mb": 0.0}
        s3_server.reset_counts()
        started = time.monotonic()
        assert fs.cat_file("shape-runtime/small") == b"s" * 100
        assert time.monotonic() - started >= 0.98 * 0.150
        started = time.monotonic()
        fs.invalidate_cache()
        assert fs.info("shape-runtime/small")["size"] == 100  # HEAD: held too
        assert time.monotonic() - started >= 0.98 * 0.150
        assert s3_server.counts()["get_object_bytes"] == 100
        with pytest.raises(S3ServerError, match="400"):
            s3_server._control("POST", "/_shape?latency_ms=-1")
    finally:
        assert s3_server.shape() == {"latency_ms": 0.0, "bandwidth_mb": 0.0}


def test_paced_body_keeps_every_byte_and_takes_its_time() -> None:
    chunks = [b"a" * 100_000, b"", b"b" * (PACE_BYTES * 3 + 7), b"c"]
    shaping = Shaping(bandwidth_mb=5)
    started = time.monotonic()
    pieces = list(shaping.paced(chunks))
    seconds = time.monotonic() - started

    assert b"".join(pieces) == b"".join(chunks)
    assert max(len(piece) for piece in pieces) == PACE_BYTES
    total = sum(len(chunk) for chunk in chunks)
    assert seconds >= 0.98 * total / 5e6
    assert list(Shaping().paced(chunks)) == chunks  # no cap: the chunks as they came

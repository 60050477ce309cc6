"""Reads while the block cache is paused (its disk filled up under a mount): correct bytes,
and egress near the bytes read rather than a whole block per read.

Unit tests drive ``MemoryReadahead`` with a counting fetcher; the integration test fills a
real tmpfs under a real FUSE mount over the moto S3 server and counts bytes at the server.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
from pathlib import Path

import pytest
from support.datagen import FIXED_MTIME, pack_with_gnu_tar
from support.mounts import mount, mount_tmpfs, new_bucket, umount
from support.processes import run_shardfs
from support.s3 import S3Server

from shardfs.read.readahead import MemoryReadahead

# -- MemoryReadahead ---------------------------------------------------------------------

SHARD = random.Random(5).randbytes(3 << 20)


class Fetcher:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def __call__(self, start: int, end: int) -> bytes:
        self.calls.append((start, end))
        return SHARD[start:end]

    @property
    def fetched(self) -> int:
        return sum(end - start for start, end in self.calls)


def files_of(sizes: list[int]) -> list[tuple[int, int]]:
    """(start, end) of files laid out like a tar: a 512-byte header before each, padded."""
    spans, offset = [], 0
    for size in sizes:
        offset += 512
        spans.append((offset, offset + size))
        offset += -(-size // 512) * 512
    return spans


def test_sequential_reads_fetch_about_what_they_read() -> None:
    rng = random.Random(1)
    spans = files_of([rng.randrange(20_000, 120_000) for _ in range(30)])
    assert spans[-1][1] < len(SHARD)
    ahead, fetch = MemoryReadahead(), Fetcher()
    for start, end in spans:
        assert ahead.read("s", start, end, len(SHARD), fetch) == SHARD[start:end]
    read = sum(end - start for start, end in spans)
    assert fetch.fetched < 1.15 * read + (512 << 10)  # at most one window past the end
    assert len(fetch.calls) < len(spans) / 2  # readahead served many reads from memory


def test_random_reads_fetch_exactly_what_they_read() -> None:
    rng = random.Random(2)
    spans = files_of([rng.randrange(20_000, 120_000) for _ in range(30)])
    rng.shuffle(spans)
    ahead, fetch = MemoryReadahead(), Fetcher()
    for start, end in spans:
        assert ahead.read("s", start, end, len(SHARD), fetch) == SHARD[start:end]
    assert fetch.fetched <= sum(end - start for start, end in spans) * 1.2


def test_memory_is_bounded_and_shards_are_apart() -> None:
    ahead, fetch = MemoryReadahead(memory=256 << 10), Fetcher()
    offset = 0
    for _ in range(200):
        assert (
            ahead.read("a", offset, offset + 10_000, len(SHARD), fetch)
            == SHARD[offset : offset + 10_000]
        )
        offset += 10_000
    assert ahead._bytes <= 256 << 10
    # Shard "b" shares no bytes with "a": its first read goes to the store.
    calls = len(fetch.calls)
    ahead.read("b", offset - 5000, offset - 4000, len(SHARD), fetch)
    assert len(fetch.calls) == calls + 1


def test_a_read_ahead_never_passes_the_shard_end() -> None:
    ahead, fetch = MemoryReadahead(), Fetcher()
    size = 100_000
    for start in range(0, size, 10_000):
        assert ahead.read("s", start, start + 10_000, size, fetch) == SHARD[start : start + 10_000]
    assert max(end for _, end in fetch.calls) == size


# -- a real mount whose cache disk fills up -----------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize("order", ["sequential", "shuffled"])
def test_degraded_epoch_egress_is_near_the_bytes_read(
    s3_server: S3Server, tmp_path: Path, mountpoint: Path, tmpfs: list[Path], order: str
) -> None:
    rng = random.Random(7)
    src = tmp_path / "src"
    src.mkdir()
    digests = {}
    for number in range(120):
        data = rng.randbytes(rng.randrange(50_000, 100_000))
        (src / f"img_{number:03d}.jpg").write_bytes(data)
        os.utime(src / f"img_{number:03d}.jpg", (FIXED_MTIME, FIXED_MTIME))
        digests[f"img_{number:03d}.jpg"] = hashlib.sha256(data).hexdigest()
    pack_with_gnu_tar(src, tmp_path / "shards", files_per_shard=40)
    bucket = new_bucket(s3_server, "degraded")
    s3_server.upload_dir(tmp_path / "shards", f"{bucket}/d")
    env = s3_server.env()
    cache = tmp_path / "cache"
    cache.mkdir()
    mount_tmpfs(tmpfs, cache, "4M")
    mount(f"s3://{bucket}/d/", mountpoint, cache, "--block-size", "1M", env=env)
    with open(cache / "filler", "wb") as f:  # the disk fills up under the mount
        try:
            while True:
                f.write(b"\0" * (64 << 10))
                f.flush()
        except OSError:
            pass
    assert shutil.disk_usage(cache).free < 64 << 10
    names = sorted(digests)
    if order == "shuffled":
        random.Random(3).shuffle(names)
    s3_server.reset_counts()
    for name in names:
        assert hashlib.sha256((mountpoint / name).read_bytes()).hexdigest() == digests[name]
    counts = s3_server.counts()["get_object_bytes_by_key"]
    fetched = sum(n for key, n in counts.items() if key.startswith(f"{bucket}/d/"))
    read = sum((src / name).stat().st_size for name in names)
    ratio = fetched / read
    print(f"\ndegraded {order} epoch: fetched {fetched} for {read} read: {ratio:.2f}x")
    stats = run_shardfs("stats", mountpoint, "--json")
    assert stats.returncode == 0
    umount(mountpoint)
    # The first miss (before the disk is known full) costs one whole block; then ranges.
    assert ratio < 1.0 + (1 << 20) / read + 0.1, ratio

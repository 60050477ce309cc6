"""The compiled FUSE hot path (shardfs/fuse/_hot.c): built where a compiler is, and what a
reader receives through it is the source's bytes, damage on disk included."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import test_mount_cache as cache_tests
from support.mounts import umount
from support.s3 import S3Server
from test_mount_cache import (
    BLOCK_FLAG,
    Dataset,
    block_files,
    drop_page_cache,
    header_length,
    mount,
    stats,
    wrong_files,
)

from shardfs.fuse import hot_path
from shardfs.mount.control import pid_file

# The block cache tests' dataset (80 files in 6 shards) and what it is built from.
bucket, sizes, dataset, env = (
    cache_tests.bucket,
    cache_tests.sizes,
    cache_tests.dataset,
    cache_tests.env,
)


def _thread_names(pid: int) -> list[str]:
    return [(task / "comm").read_text().strip() for task in Path(f"/proc/{pid}/task").iterdir()]


def test_the_hot_path_is_built() -> None:
    if os.environ.get("SHARDFS_HOT_PATH") == "0":
        pytest.skip("switched off by SHARDFS_HOT_PATH=0")
    # `make setup` builds it (pyproject's ext-modules): a broken build must fail here.
    assert hot_path.available()


def test_switched_off_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDFS_HOT_PATH", "0")
    assert not hot_path.available()


def _read_twice_through_reads(
    dataset: Dataset, env: dict[str, str], mountpoint: Path, cache: Path
) -> dict[str, int]:
    """A mount whose every read is a READ (no pushes): every file read, then read twice
    more from cache blocks with the page cache dropped; returns the statistics."""
    if not hot_path.available():
        pytest.skip("the hot path is not built")
    mount(dataset.url, mountpoint, cache, "--block-size", BLOCK_FLAG, "--no-kernel-push",
          env=env)  # fmt: skip
    assert wrong_files(mountpoint, dataset) == []
    for _ in range(2):
        drop_page_cache()
        assert wrong_files(mountpoint, dataset, threads=4) == []
    return stats(mountpoint)


@pytest.mark.integration
def test_reads_of_cached_blocks_are_answered_in_c_with_the_same_bytes(
    dataset: Dataset, env: dict[str, str], mountpoint: Path, tmp_path: Path
) -> None:
    after = _read_twice_through_reads(dataset, env, mountpoint, tmp_path / "cache")
    names = _thread_names(int(pid_file(mountpoint).read_text()))
    umount(mountpoint)
    # The daemon's threads carry their names (thread_names), C's disk readers theirs.
    assert names.count("shardfs-disk") == hot_path.DISK_READERS
    assert "shardfs-fuse" in names
    assert after["hot_path_reads"] > 0
    assert after["hot_path_reads"] <= after["cache_hits"]
    assert after["checksum_failures"] == 0
    # The page cache was dropped under published blocks: their READs waited on the disk in
    # C's disk readers, never in Python.
    assert 0 < after["hot_path_disk_reads"] <= after["hot_path_reads"]
    assert after["hot_path_not_in_memory"] == 0


@pytest.mark.integration
def test_a_published_block_damaged_on_disk_is_never_served(
    dataset: Dataset, s3_server: S3Server, env: dict[str, str], mountpoint: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    before = _read_twice_through_reads(dataset, env, mountpoint, cache)
    assert before["hot_path_reads"] > 0
    # Damage every cached block in place (a byte in each chunk's middle) while published.
    for path in block_files(cache):
        header, data_len = header_length(path)
        with open(path, "r+b") as f:
            for at in range(header + 100, header + data_len, 64 << 10):
                f.seek(at)
                byte = f.read(1)
                f.seek(at)
                f.write(bytes([byte[0] ^ 0xFF]))
    drop_page_cache()
    s3_server.reset_counts()
    assert wrong_files(mountpoint, dataset, threads=4) == []
    after = stats(mountpoint)
    umount(mountpoint)
    assert after["checksum_failures"] > before["checksum_failures"]
    assert s3_server.counts()["get_object_requests"] > 0  # fetched again, not served damaged


def test_a_read_only_slice_of_fetched_bytes_is_handed_to_c_in_place() -> None:
    import ctypes

    fetched = bytes(range(256)) * 64
    block = memoryview(fetched)[4096:8192]  # a block cut from a larger GET
    address, held = hot_path._data_address(block)
    assert held is block  # no copy made
    base, _ = hot_path._data_address(fetched)
    assert address == base + 4096
    assert ctypes.string_at(address, len(block)) == fetched[4096:8192]


@pytest.mark.integration
def test_blocks_pushed_from_memory_are_published_without_reading_them_back(
    dataset: Dataset, env: dict[str, str], mountpoint: Path, tmp_path: Path
) -> None:
    if not hot_path.available():
        pytest.skip("the hot path is not built")
    mount(dataset.url, mountpoint, tmp_path / "cache", "--block-size", BLOCK_FLAG, env=env)
    assert wrong_files(mountpoint, dataset) == []  # cold: blocks fetched, files pushed
    cold = stats(mountpoint)
    drop_page_cache()
    assert wrong_files(mountpoint, dataset, threads=4) == []  # every file a READ again
    after = stats(mountpoint)
    umount(mountpoint)
    assert cold["files_published"] > 0
    # The second read found the blocks published already: none was read back whole to
    # publish it, and the READs of their files waited on the disk in C.
    assert after["publish_read_backs"] == cold["publish_read_backs"]
    assert after["hot_path_disk_reads"] > cold["hot_path_disk_reads"]
    assert after["checksum_failures"] == 0

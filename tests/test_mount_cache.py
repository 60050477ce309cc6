"""The persistent block cache over real FUSE mounts and a real moto S3 server.

Every claim about egress is checked at the server (bytes per ``*.tar`` key), not only by
shardfs's own counters. The dataset is ~6 MB of 50-100 KB files in six GNU tar shards, read
with small blocks so that there are many of them.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import signal
import struct
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from support.datagen import FIXED_MTIME, pack_with_gnu_tar
from support.mounts import (
    assert_one_error_line,
    mount_tmpfs,
    new_bucket,
    process_gone,
    umount,
    wait_for,
)
from support.mounts import mount as _mount
from support.processes import is_mounted, run_shardfs, unmount
from support.s3 import S3Server

from shardfs.mount.control import pid_file

pytestmark = pytest.mark.integration


def mount(*args: Any, **kwargs: Any) -> Any:
    """These tests pin the block cache on its own: demand reads only, no readahead
    (tests/test_mount_readahead.py covers readahead)."""
    return _mount(*args, "--prefetch", "none", **kwargs)


N_FILES = 80
FILES_PER_SHARD = [14, 12, 16]
BLOCK = 256 << 10
BLOCK_FLAG = "256K"
HEADER_SLACK = 4096  # a block file is its data plus a header of well under this


@dataclass(frozen=True)
class Dataset:
    """Files (name -> bytes), their shards (name -> size), and where they were uploaded."""

    files: dict[str, bytes]
    shard_sizes: dict[str, int]
    bucket: str
    prefix: str

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}/"

    @property
    def key_prefix(self) -> str:
        return f"{self.bucket}/{self.prefix}/"

    @property
    def file_bytes(self) -> int:
        return sum(len(data) for data in self.files.values())

    @property
    def shard_bytes(self) -> int:
        return sum(self.shard_sizes.values())


def _make_dataset(
    server: S3Server, base: Path, bucket: str, prefix: str, sizes: list[int], seed: int
) -> Dataset:
    """Random-bytes ``img_NNN.jpg`` files of the given sizes, packed by GNU tar, uploaded."""
    rng = random.Random(seed)
    src = base / "src"
    src.mkdir(parents=True)
    files = {}
    for number, size in enumerate(sizes):
        name = f"img_{number:03d}.jpg"
        data = rng.randbytes(size)
        (src / name).write_bytes(data)
        os.utime(src / name, (FIXED_MTIME, FIXED_MTIME))
        files[name] = data
    shards = pack_with_gnu_tar(src, base / "shards", files_per_shard=FILES_PER_SHARD)
    server.upload_dir(base / "shards", f"{bucket}/{prefix}")
    # A sidecar: mounts then start with an index and a cold block cache (an index scan
    # would fill the cache as it streams, see tests/test_mount_readahead.py).
    result = run_shardfs(
        "index",
        f"s3://{bucket}/{prefix}/",
        "--write-sidecar",
        "--cache-dir",
        base / "index",
        env=server.env(),
    )
    assert result.returncode == 0, result.stderr
    return Dataset(files, {s.name: s.stat().st_size for s in shards}, bucket, prefix)


@pytest.fixture(scope="module")
def sizes() -> list[int]:
    rng = random.Random(20240601)
    return [rng.randrange(50_000, 100_000) for _ in range(N_FILES)]


@pytest.fixture(scope="module")
def bucket(s3_server: S3Server) -> str:
    return new_bucket(s3_server, "cache")


@pytest.fixture(scope="module")
def dataset(
    s3_server: S3Server, tmp_path_factory: pytest.TempPathFactory, bucket: str, sizes: list[int]
) -> Dataset:
    """~6 MB in 80 files and 6 shards."""
    data = _make_dataset(s3_server, tmp_path_factory.mktemp("data"), bucket, "a", sizes, 1)
    assert 5 << 20 < data.file_bytes < 10 << 20
    assert len(data.shard_sizes) == 6
    return data


@pytest.fixture(scope="module")
def twin(
    s3_server: S3Server, tmp_path_factory: pytest.TempPathFactory, bucket: str, sizes: list[int]
) -> Dataset:
    """The same names and sizes as ``dataset`` with other bytes: shards of equal size."""
    data = _make_dataset(s3_server, tmp_path_factory.mktemp("twin"), bucket, "b", sizes, 2)
    return data


@pytest.fixture
def env(s3_server: S3Server) -> dict[str, str]:
    return s3_server.env()


@pytest.fixture
def extra_mountpoints(tmp_path: Path) -> Iterator[list[Path]]:
    """Append folders to mount on; whatever is still mounted there is unmounted at teardown."""
    paths: list[Path] = []
    yield paths
    for path in paths:
        if is_mounted(path):
            unmount(path)


# -- helpers --------------------------------------------------------------------------------


def tar_traffic(server: S3Server, data: Dataset) -> tuple[int, int]:
    """(GetObject bytes, GetObject requests) on the dataset's ``*.tar`` keys since the reset."""
    counts = server.counts()
    by_bytes: dict[str, int] = counts["get_object_bytes_by_key"]
    by_requests: dict[str, int] = counts["get_object_requests_by_key"]

    def ours(key: str) -> bool:
        return key.startswith(data.key_prefix) and key.endswith(".tar")

    return (
        sum(n for key, n in by_bytes.items() if ours(key)),
        sum(n for key, n in by_requests.items() if ours(key)),
    )


def stats(mountpoint: Path) -> dict[str, Any]:
    result = run_shardfs("stats", mountpoint, "--json")
    assert result.returncode == 0, result.stderr
    values: dict[str, Any] = json.loads(result.stdout)
    return values


def drop_page_cache() -> None:
    """So that the next reads reach the daemon instead of the kernel's page cache."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def read_file(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def wrong_files(
    root: Path, data: Dataset, names: list[str] | None = None, threads: int = 1
) -> list[str]:
    """Names whose bytes through the mount differ from the originals (read in ``threads``)."""
    names = sorted(data.files) if names is None else names

    def check(name: str) -> str | None:
        return None if read_file(root / name) == data.files[name] else name

    with ThreadPoolExecutor(threads) as pool:
        return [name for name in pool.map(check, names) if name is not None]


def needed_blocks(root: Path, data: Dataset, block: int) -> dict[tuple[str, int], int]:
    """{(shard, block index): block length} for every block holding file bytes."""
    blocks = {}
    for name, content in data.files.items():
        shard = os.getxattr(root / name, "user.shardfs.shard").decode()
        offset = int(os.getxattr(root / name, "user.shardfs.offset"))
        for index in range(offset // block, (offset + len(content) - 1) // block + 1):
            blocks[(shard, index)] = min(block, data.shard_sizes[shard] - index * block)
    return blocks


def lookups(root: Path, data: Dataset, block: int) -> int:
    """Block lookups one full read makes: one per block each file's bytes touch."""
    total = 0
    for name, content in data.files.items():
        offset = int(os.getxattr(root / name, "user.shardfs.offset"))
        total += (offset + len(content) - 1) // block - offset // block + 1
    return total


def block_files(cache_dir: Path) -> list[Path]:
    return sorted(p for p in (cache_dir / "blocks").rglob("*") if p.is_file())


def blocks_on_disk(cache_dir: Path) -> int:
    """Bytes of the block files under ``blocks/``, tolerating files removed while walking."""
    total = 0
    for folder, _dirs, names in os.walk(cache_dir / "blocks"):
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                total += os.stat(os.path.join(folder, name)).st_size
    return total


def block_file_of(cache_dir: Path, index: int) -> Path:
    """A cached block file with that block index (any shard)."""
    for path in block_files(cache_dir):
        if path.name == str(index):
            return path
    raise AssertionError(f"no cached block {index} under {cache_dir}")


def header_length(path: Path) -> tuple[int, int]:
    """(header length, data length) of a block file."""
    with open(path, "rb") as f:
        head = f.read(24)
    _magic, header_len, _chunk, data_len = struct.unpack("<8sIIQ", head)
    return header_len, data_len


def cache_info(cache_dir: Path) -> dict[str, Any]:
    result = run_shardfs("cache", "info", "--cache-dir", cache_dir, "--json")
    assert result.returncode == 0, result.stderr
    info: dict[str, Any] = json.loads(result.stdout)
    return info


def daemon_pid(mountpoint: Path) -> int:
    return int(pid_file(mountpoint).read_text())


def tmp_pids(cache_dir: Path) -> set[int]:
    """Pids that own temp files under ``CACHE/tmp``."""
    folder = cache_dir / "tmp"
    names = os.listdir(folder) if folder.exists() else []
    return {int(name.split("-", 1)[0]) for name in names if name.split("-", 1)[0].isdigit()}


# -- 1 + 2. two epochs, then a remount: egress counted at the server -------------------------


def test_second_epoch_and_remount_fetch_nothing(
    dataset: Dataset,
    s3_server: S3Server,
    env: dict[str, str],
    mountpoint: Path,
    tmp_path: Path,
) -> None:
    cache = tmp_path / "cache"
    # Without kernel pushes every file byte goes through a READ, so the counters are exact.
    exact = ("--block-size", BLOCK_FLAG, "--no-kernel-push")
    mount(dataset.url, mountpoint, cache, *exact, env=env)
    s3_server.reset_counts()  # after the index scan

    assert wrong_files(mountpoint, dataset, threads=4) == []
    fetched, requests = tar_traffic(s3_server, dataset)
    blocks = needed_blocks(mountpoint, dataset, BLOCK)
    # Every block holding file bytes, each exactly once; nothing beyond the shards.
    assert fetched == sum(blocks.values())
    assert requests == len(blocks)
    assert dataset.file_bytes <= fetched <= dataset.shard_bytes
    ratio = fetched / dataset.file_bytes
    assert 1.0 <= ratio <= 1.05, f"epoch 1 fetched {ratio:.4f}x the file bytes"
    print(
        f"\nepoch 1: {fetched} tar bytes fetched for {dataset.file_bytes} file bytes "
        f"({ratio:.4f}x; shards {dataset.shard_bytes}, {fetched / dataset.shard_bytes:.4f}x) "
        f"in {requests} GETs"
    )

    first = stats(mountpoint)
    assert abs(first["bytes_fetched"] - fetched) <= 0.01 * fetched
    assert first["bytes_served"] == dataset.file_bytes
    assert first["dataset_bytes"] == dataset.file_bytes
    assert first["cache_misses"] == len(blocks) == first["store_requests"]
    assert first["cache_hits"] + first["cache_misses"] == lookups(mountpoint, dataset, BLOCK)
    assert first["blocks_written"] == len(blocks)
    assert first["checksum_failures"] == first["cache_write_errors"] == 0
    print(f"stats bytes_fetched {first['bytes_fetched']} vs server {fetched}")

    # Epoch 2, once from the kernel's page cache and once from the block cache.
    s3_server.reset_counts()
    assert wrong_files(mountpoint, dataset, threads=4) == []
    drop_page_cache()
    assert wrong_files(mountpoint, dataset, threads=4) == []
    assert tar_traffic(s3_server, dataset) == (0, 0)
    second = stats(mountpoint)
    assert second["bytes_fetched"] == first["bytes_fetched"]
    assert second["cache_misses"] == first["cache_misses"]
    served = second["bytes_served"] - first["bytes_served"]
    assert dataset.file_bytes <= served <= 2 * dataset.file_bytes  # the page cache may absorb one
    assert second["cache_hits"] > first["cache_hits"]
    umount(mountpoint)

    # 2. A remount over the same cache folder reads no shard byte at all.
    s3_server.reset_counts()
    mount(dataset.url, mountpoint, cache, *exact, env=env)
    assert wrong_files(mountpoint, dataset, threads=4) == []
    assert tar_traffic(s3_server, dataset) == (0, 0)
    third = stats(mountpoint)
    assert third["bytes_fetched"] == third["cache_misses"] == 0
    assert third["bytes_served"] == dataset.file_bytes
    umount(mountpoint)


# -- 3. SIGKILL in the middle of cold reads ------------------------------------------------


class CheckingReader(threading.Thread):
    """Reads files in order, comparing every chunk with the original; stops at an error."""

    def __init__(self, root: Path, data: Dataset, names: list[str]) -> None:
        super().__init__(daemon=True)
        self.root, self.data, self.names = root, data, names
        self.completed = 0
        self.wrong: list[str] = []
        self.error: OSError | None = None

    def run(self) -> None:
        for name in self.names:
            expected = self.data.files[name]
            try:
                with open(self.root / name, "rb", buffering=0) as f:
                    position = 0
                    while chunk := f.read(32 << 10):
                        if chunk != expected[position : position + len(chunk)]:
                            self.wrong.append(f"{name} at {position}")
                        position += len(chunk)
                if position != len(expected):
                    self.wrong.append(f"{name}: {position} of {len(expected)} bytes, no error")
            except OSError as exc:
                self.error = exc
                return
            self.completed += 1


def test_sigkill_during_cold_reads_never_serves_a_wrong_byte(
    dataset: Dataset, env: dict[str, str], mountpoint: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    flags = ["--block-size", "64K"]
    rng = random.Random(7)
    order = sorted(dataset.files)
    rng.shuffle(order)
    cursor = 0  # files before this were read completely by some earlier mount
    killed: list[int] = []
    stale_temp_files = 0
    errors: set[int] = set()
    for _round in range(12):
        mount(dataset.url, mountpoint, cache, *flags, env=env)
        pid = daemon_pid(mountpoint)
        reader = CheckingReader(mountpoint, dataset, order[cursor:])
        reader.start()
        # A random moment: after 0-2 whole files, plus up to 30 ms into the next.
        target = rng.randrange(3)
        wait_for(lambda r=reader, n=target: r.completed >= n or not r.is_alive(), "reads")
        time.sleep(rng.uniform(0, 0.03))
        assert reader.is_alive(), "the reader finished before the kill: not mid-read"
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)
        wait_for(lambda p=pid: process_gone(p), f"daemon {pid} to die")
        reader.join(30)
        assert not reader.is_alive(), "a read on the dead mount hangs"
        assert reader.wrong == [], f"wrong bytes served: {reader.wrong}"
        assert reader.error is not None, "the reader did not notice the dead daemon"
        errors.add(reader.error.errno or 0)
        cursor += reader.completed
        subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], check=True)
        wait_for(lambda: not is_mounted(mountpoint), "the dead mount to go")
        stale_temp_files += len(tmp_pids(cache) & set(killed))
    assert len(killed) >= 10
    assert cursor < len(order), "the kills did not all land in cold reads"

    # A temp file a killed daemon could have left (if no kill happened to leave one).
    (cache / "tmp" / f"{killed[-1]}-0-deadbeef.tmp").write_bytes(b"partial block")
    mount(dataset.url, mountpoint, cache, *flags, env=env)
    assert not tmp_pids(cache) & set(killed), "temp files of killed daemons survive a mount"
    assert tmp_pids(cache) <= {daemon_pid(mountpoint)}
    assert wrong_files(mountpoint, dataset) == []
    final = stats(mountpoint)
    assert final["checksum_failures"] == 0  # a kill leaves whole blocks or none
    assert final["cache_hits"] > 0
    umount(mountpoint)
    print(
        f"\n{len(killed)} kills after {cursor} whole files; errnos seen "
        f"{sorted(errno.errorcode.get(e, str(e)) for e in errors)}; "
        f"{stale_temp_files} temp file sightings of dead daemons before the final mount; "
        f"final mount fetched {final['bytes_fetched']} bytes, hit ratio {final['hit_ratio']:.2f}"
    )


# -- 4. corrupt cached blocks --------------------------------------------------------------


def test_corrupt_cached_blocks_are_refetched(
    dataset: Dataset,
    s3_server: S3Server,
    env: dict[str, str],
    mountpoint: Path,
    tmp_path: Path,
) -> None:
    cache = tmp_path / "cache"
    # No kernel pushes: their reads of the cache would meet the damage a second time.
    flags = ["--block-size", BLOCK_FLAG, "--no-kernel-push"]
    mount(dataset.url, mountpoint, cache, *flags, env=env)
    assert wrong_files(mountpoint, dataset) == []
    blocks = needed_blocks(mountpoint, dataset, BLOCK)
    umount(mountpoint)

    # While unmounted: flip a byte in the data of one block, truncate another.
    flipped, truncated = block_file_of(cache, 1), block_file_of(cache, 2)
    damaged_bytes = header_length(flipped)[1] + header_length(truncated)[1]
    header, data_len = header_length(flipped)
    with open(flipped, "r+b") as f:
        f.seek(header + data_len // 2)
        byte = f.read(1)
        f.seek(header + data_len // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    whole_size = truncated.stat().st_size
    os.truncate(truncated, whole_size // 2)

    mount(dataset.url, mountpoint, cache, *flags, env=env)
    s3_server.reset_counts()
    assert wrong_files(mountpoint, dataset) == []  # one reader: each failure is met once
    after = stats(mountpoint)
    assert after["checksum_failures"] == 2
    # Exactly those two blocks came from the store again, and were cached again.
    assert tar_traffic(s3_server, dataset) == (damaged_bytes, 2)
    assert after["cache_misses"] == 2 and after["bytes_fetched"] == damaged_bytes
    assert after["blocks_written"] == 2
    assert header_length(flipped)[1] == data_len
    assert truncated.stat().st_size == whole_size

    # While mounted: corrupt the block of a file not read yet in this mount, and the block
    # of a file already read (after dropping the page cache).
    umount(mountpoint)
    mount(dataset.url, mountpoint, cache, *flags, env=env)
    names = sorted(dataset.files)
    assert read_file(mountpoint / names[0]) == dataset.files[names[0]]
    for name in (names[0], names[-1]):
        shard = os.getxattr(mountpoint / name, "user.shardfs.shard").decode()
        offset = int(os.getxattr(mountpoint / name, "user.shardfs.offset"))
        size = len(dataset.files[name])
        index = (offset + size // 2) // BLOCK
        candidates = [p for p in block_files(cache) if p.name == str(index)]
        header, _ = header_length(candidates[0])
        for path in candidates:  # every shard's block of that index, so ours is among them
            with open(path, "r+b") as f:
                f.seek(header + (offset + size // 2) % BLOCK)
                byte = f.read(1)
                f.seek(header + (offset + size // 2) % BLOCK)
                f.write(bytes([byte[0] ^ 0x55]))
        assert shard in {s for s, _ in blocks}
    drop_page_cache()
    s3_server.reset_counts()
    for name in (names[0], names[-1]):
        assert read_file(mountpoint / name) == dataset.files[name], name
    live = stats(mountpoint)
    assert live["checksum_failures"] >= 2
    assert tar_traffic(s3_server, dataset)[1] >= 2
    assert wrong_files(mountpoint, dataset) == []
    umount(mountpoint)


# -- 5. the size bound ---------------------------------------------------------------------


def test_cache_stays_under_its_bound(
    dataset: Dataset, env: dict[str, str], mountpoint: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    bound = dataset.file_bytes // 4
    readers = 4
    mount(
        dataset.url,
        mountpoint,
        cache,
        "--block-size",
        BLOCK_FLAG,
        "--cache-size",
        str(bound),
        "--cache-min-free",
        "0",
        env=env,
    )
    peak = 0
    done = threading.Event()

    def watch() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, blocks_on_disk(cache))
            time.sleep(0.002)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        assert wrong_files(mountpoint, dataset, threads=readers) == []
        drop_page_cache()
        assert wrong_files(mountpoint, dataset, threads=readers) == []
    finally:
        done.set()
        watcher.join()
    allowed = bound + readers * (BLOCK + HEADER_SLACK)
    values = stats(mountpoint)
    info = cache_info(cache)
    on_disk = blocks_on_disk(cache)
    print(
        f"\nbound {bound}: peak on disk {peak} ({peak / bound:.2f}x), after {on_disk}, "
        f"stats used {values['cache_bytes_used']}, evicted {values['blocks_evicted']}, "
        f"range reads {values['range_reads']}"
    )
    assert peak <= allowed
    assert on_disk <= allowed
    assert values["cache_bytes_used"] <= allowed
    assert info["block_bytes"] == values["cache_bytes_used"]
    assert abs(info["block_bytes"] - on_disk) <= BLOCK + HEADER_SLACK
    assert values["cache_bytes_limit"] == bound
    # Under the bound something gave: blocks were evicted or reads fetched as ranges.
    assert values["blocks_evicted"] + values["range_reads"] > 0
    umount(mountpoint)


# -- 6. two mounts over one cache folder ---------------------------------------------------


def test_two_mounts_share_one_cache(
    dataset: Dataset,
    twin: Dataset,
    s3_server: S3Server,
    env: dict[str, str],
    mountpoint: Path,
    tmp_path: Path,
    extra_mountpoints: list[Path],
) -> None:
    # The twin's shards have the same names and sizes, other bytes: keys must not collide.
    assert twin.shard_sizes == dataset.shard_sizes
    cache = tmp_path / "cache"
    flags = ["--block-size", BLOCK_FLAG]
    second = tmp_path / "mnt2"
    second.mkdir()
    extra_mountpoints.append(second)

    def both(first_data: Dataset, second_data: Dataset) -> list[str]:
        with ThreadPoolExecutor(2) as pool:
            one = pool.submit(wrong_files, mountpoint, first_data, None, 2)
            two = pool.submit(wrong_files, second, second_data, None, 2)
            return one.result() + two.result()

    # Same source twice: every block is fetched once in total.
    mount(dataset.url, mountpoint, cache, *flags, env=env)
    mount(dataset.url, second, cache, *flags, env=env)
    s3_server.reset_counts()
    assert both(dataset, dataset) == []
    fetched, requests = tar_traffic(s3_server, dataset)
    blocks = needed_blocks(mountpoint, dataset, BLOCK)
    print(f"\ntwo mounts, one source: {fetched / dataset.file_bytes:.4f}x the file bytes")
    assert fetched == sum(blocks.values())
    assert requests == len(blocks)
    assert fetched <= 1.05 * dataset.file_bytes
    misses = stats(mountpoint)["cache_misses"] + stats(second)["cache_misses"]
    assert misses == len(blocks)
    umount(second)
    umount(mountpoint)

    # Two sources over one cache folder: each mount serves its own bytes.
    mount(dataset.url, mountpoint, cache, *flags, env=env)
    mount(twin.url, second, cache, *flags, env=env)
    s3_server.reset_counts()
    assert both(dataset, twin) == []
    assert tar_traffic(s3_server, dataset) == (0, 0)  # still cached from above
    assert tar_traffic(s3_server, twin)[0] == sum(needed_blocks(second, twin, BLOCK).values())
    umount(second)
    umount(mountpoint)


# -- 7. a cache disk that fills up ---------------------------------------------------------


def test_full_cache_disk_still_serves_correct_bytes(
    dataset: Dataset,
    env: dict[str, str],
    mountpoint: Path,
    tmp_path: Path,
    tmpfs: list[Path],
) -> None:
    disk = 3 << 20
    assert dataset.file_bytes > 1.5 * disk
    cache = tmp_path / "small"
    mount_tmpfs(tmpfs, cache, str(disk))
    mount(
        dataset.url,
        mountpoint,
        cache,
        "--block-size",
        BLOCK_FLAG,
        "--cache-size",
        "100%",
        "--cache-min-free",
        "0",
        env=env,
    )
    info = cache_info(cache)
    index_bytes = info["index_bytes"] + info["views_bytes"]
    assert 0 < index_bytes < disk // 4, info
    assert wrong_files(mountpoint, dataset, threads=4) == []
    drop_page_cache()
    assert wrong_files(mountpoint, dataset, threads=4) == []
    values = stats(mountpoint)
    print(
        f"\ntmpfs {disk}: index+views {index_bytes}, cache used {values['cache_bytes_used']}, "
        f"write errors {values['cache_write_errors']}, evicted {values['blocks_evicted']}"
    )
    assert values["cache_write_errors"] > 0 or values["blocks_evicted"] > 0
    assert values["blocks_written"] > 0
    umount(mountpoint)


# -- 8. an unwritable cache folder; clearing while reading ---------------------------------


def test_unwritable_cache_dir_fails_with_one_line(
    dataset: Dataset, env: dict[str, str], mountpoint: Path, tmp_path: Path, tmpfs: list[Path]
) -> None:
    regular = tmp_path / "a-file"
    regular.write_text("not a folder\n")
    readonly = tmp_path / "ro"
    mount_tmpfs(tmpfs, readonly, "1m")
    subprocess.run(["mount", "-o", "remount,ro", str(readonly)], check=True)
    for cache in (regular / "cache", readonly):
        result = run_shardfs("mount", dataset.url, mountpoint, "--cache-dir", cache, env=env)
        line = assert_one_error_line(result)
        assert result.returncode == 2
        assert "--cache-dir" in line and str(cache) in line, line
        assert not is_mounted(mountpoint)


def test_cache_clear_while_reading(
    dataset: Dataset,
    s3_server: S3Server,
    env: dict[str, str],
    mountpoint: Path,
    tmp_path: Path,
) -> None:
    cache = tmp_path / "cache"
    mount(dataset.url, mountpoint, cache, "--block-size", "64K", env=env)
    assert wrong_files(mountpoint, dataset) == []
    epoch_bytes = sum(needed_blocks(mountpoint, dataset, 64 << 10).values())
    s3_server.reset_counts()

    # Warm passes (page cache dropped, so they reach the block cache) run all through the clear.
    wrong: list[str] = []
    passes = 0
    stop = threading.Event()

    def read_passes() -> None:
        nonlocal passes
        while not stop.is_set():
            drop_page_cache()
            wrong.extend(wrong_files(mountpoint, dataset, threads=2))
            passes += 1

    reader = threading.Thread(target=read_passes, daemon=True)
    reader.start()
    wait_for(lambda: passes >= 1, "a first pass")
    cleared = run_shardfs("cache", "clear", "--cache-dir", cache)
    stop.set()
    reader.join(60)
    assert not reader.is_alive()
    assert cleared.returncode == 0, cleared.stderr
    assert wrong == []
    # After the clear, one more pass refetches every block exactly once; the next none.
    for _ in range(2):
        drop_page_cache()
        assert wrong_files(mountpoint, dataset, threads=2) == []
        assert tar_traffic(s3_server, dataset)[0] == epoch_bytes
    print(f"\n{passes} passes overlapped the clear; {epoch_bytes} bytes refetched once")
    assert stats(mountpoint)["cache_write_errors"] == 0
    umount(mountpoint)


# -- 9. --no-cache -------------------------------------------------------------------------


def test_no_cache_writes_no_block(
    dataset: Dataset,
    s3_server: S3Server,
    env: dict[str, str],
    mountpoint: Path,
    tmp_path: Path,
) -> None:
    cache = tmp_path / "cache"
    mount(dataset.url, mountpoint, cache, "--no-cache", env=env)
    s3_server.reset_counts()
    assert wrong_files(mountpoint, dataset, threads=4) == []
    assert block_files(cache) == []
    assert tar_traffic(s3_server, dataset)[0] == dataset.file_bytes
    values = stats(mountpoint)
    assert values["cache_enabled"] is False
    assert values["cache_hits"] == values["cache_misses"] == values["blocks_written"] == 0
    assert values["bytes_fetched"] == dataset.file_bytes
    umount(mountpoint)
    assert block_files(cache) == []


# -- 10. shardfs stats ---------------------------------------------------------------------


def test_stats_prints_its_lines_and_fails_on_a_plain_folder(
    dataset: Dataset, env: dict[str, str], mountpoint: Path, tmp_path: Path
) -> None:
    mount(dataset.url, mountpoint, tmp_path / "cache", "--block-size", BLOCK_FLAG, env=env)
    names = sorted(dataset.files)[:3]
    assert wrong_files(mountpoint, dataset, names) == []
    result = run_shardfs("stats", mountpoint)
    assert result.returncode == 0, result.stderr
    rows = dict(_row(line) for line in result.stdout.splitlines())
    assert list(rows) == [
        "source",
        "files",
        "bytes served",
        "bytes pushed",
        "  inodes let go",
        "bytes fetched",
        "  by the index scan",
        "cache hits / misses",
        "cache used / limit",
        "blocks evicted",
        "egress amplification",
        "whole-shard answers",
        "small-cache misses",
        "hinted reads",
        "reads waited on net",
        "prefetched unread",
        "checksum failures",
        "cache write errors",
    ]
    read = sum(len(dataset.files[n]) for n in names)
    assert rows["source"] == dataset.url
    assert rows["files"] == f"{len(dataset.files)} (raw layout)"
    values = stats(mountpoint)
    # Files pushed into the kernel's page cache are read without the daemon serving them.
    assert values["bytes_served"] <= read <= values["bytes_served"] + values["bytes_pushed"]
    assert rows["bytes served"] == f"{values['bytes_served'] / 1024:.1f} KiB"
    assert rows["cache hits / misses"].startswith(
        f"{values['cache_hits']} / {values['cache_misses']} (hit ratio"
    )
    assert rows["bytes fetched"].endswith(f"in {values['store_requests']} requests")
    assert rows["  by the index scan"] == "0 B in 0 requests"  # a sidecar: nothing scanned
    assert rows["whole-shard answers"].startswith("0 ")
    assert rows["checksum failures"] == "0"
    assert rows["hinted reads"] == "0 (0 hints)"  # no sampler told this mount its order
    assert rows["  inodes let go"] == (
        f"{values['inodes_forgotten']} by the kernel ({values['pushes_refused']} pushes refused)"
    )
    umount(mountpoint)

    plain = tmp_path / "plain"
    plain.mkdir()
    for target in (plain, mountpoint):
        result = run_shardfs("stats", target)
        line = assert_one_error_line(result)
        assert str(target) in line
        assert result.returncode == 5


def _row(line: str) -> tuple[str, str]:
    name, value = line[:20].rstrip(), line[21:]
    return name, value

"""Readahead over real FUSE mounts and the moto S3 server: a touched shard is fetched whole
and once, ``--prefetch all`` and ``shardfs warm`` fill the cache, and a shuffled epoch with
readahead still pays each byte once. Egress is counted at the server."""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from support.datagen import FIXED_MTIME, pack_with_gnu_tar
from support.mounts import drop_inodes, mount, new_bucket, process_gone, umount, wait_for
from support.processes import is_mounted, run_shardfs
from support.s3 import S3Server, repeats

pytestmark = pytest.mark.integration

BLOCK_FLAG = "256K"


@dataclass(frozen=True)
class Dataset:
    files: dict[str, bytes]
    shard_sizes: dict[str, int]
    members: dict[str, str]  # file name -> shard name
    url: str
    key_prefix: str

    @property
    def shard_bytes(self) -> int:
        return sum(self.shard_sizes.values())


@pytest.fixture(scope="module")
def dataset(s3_server: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Dataset:
    """~4 MB of random-bytes files of 40-80 KB in 5 shards."""
    base = tmp_path_factory.mktemp("readahead")
    rng = random.Random(7)
    src = base / "src"
    src.mkdir()
    files = {}
    for number in range(60):
        name = f"img_{number:03d}.jpg"
        files[name] = rng.randbytes(rng.randrange(40_000, 80_000))
        (src / name).write_bytes(files[name])
        os.utime(src / name, (FIXED_MTIME, FIXED_MTIME))
    counts = [12, 12, 12, 12, 12]
    shards = pack_with_gnu_tar(src, base / "shards", files_per_shard=counts)
    bucket = new_bucket(s3_server, "readahead")
    s3_server.upload_dir(base / "shards", f"{bucket}/data")
    names = sorted(files)
    members = {name: shards[i // 12].name for i, name in enumerate(names)}
    # A sidecar, so that mounts start with an index and an empty block cache.
    result = run_shardfs(
        "index",
        f"s3://{bucket}/data/",
        "--write-sidecar",
        "--cache-dir",
        base / "c",
        env=s3_server.env(),
    )
    assert result.returncode == 0, result.stderr
    return Dataset(
        files,
        {s.name: s.stat().st_size for s in shards},
        members,
        f"s3://{bucket}/data/",
        f"{bucket}/data/",
    )


@pytest.fixture
def env(s3_server: S3Server) -> dict[str, str]:
    return s3_server.env()


def shard_traffic(server: S3Server, data: Dataset) -> dict[str, int]:
    """GetObject bytes per shard name since the last reset."""
    by_key: dict[str, int] = server.counts()["get_object_bytes_by_key"]
    return {
        key[len(data.key_prefix) :]: n
        for key, n in by_key.items()
        if key.startswith(data.key_prefix) and key.endswith(".tar")
    }


def stats(mountpoint: Path) -> dict[str, Any]:
    result = run_shardfs("stats", mountpoint, "--json")
    assert result.returncode == 0, result.stderr
    values: dict[str, Any] = json.loads(result.stdout)
    return values


def wrong_files(root: Path, data: Dataset, names: list[str]) -> list[str]:
    def check(name: str) -> str | None:
        return None if (root / name).read_bytes() == data.files[name] else name

    with ThreadPoolExecutor(4) as pool:
        return [n for n in pool.map(check, names) if n is not None]


@pytest.fixture
def cache_dir(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "cache"


def test_a_touched_shard_is_fetched_whole_and_once(
    dataset: Dataset, s3_server: S3Server, env: dict[str, str], mountpoint: Path, cache_dir: Path
) -> None:
    mount(dataset.url, mountpoint, cache_dir, "--block-size", BLOCK_FLAG, env=env)
    s3_server.reset_counts()
    name = sorted(dataset.files)[30]  # in the third shard
    shard = dataset.members[name]
    assert (mountpoint / name).read_bytes() == dataset.files[name]
    wait_for(
        lambda: shard_traffic(s3_server, dataset).get(shard, 0) >= dataset.shard_sizes[shard],
        "the touched shard to be read ahead",
    )
    wait_for(lambda: stats(mountpoint)["prefetched_blocks"] > 0, "prefetch stats")
    traffic = shard_traffic(s3_server, dataset)
    assert traffic == {shard: dataset.shard_sizes[shard]}  # whole, once, and nothing else
    same_shard = [n for n, s in dataset.members.items() if s == shard]
    s3_server.reset_counts()
    assert wrong_files(mountpoint, dataset, same_shard) == []
    assert shard_traffic(s3_server, dataset) == {}
    umount(mountpoint)


def test_prefetch_all_fills_the_cache_before_anything_is_read(
    dataset: Dataset, s3_server: S3Server, env: dict[str, str], mountpoint: Path, cache_dir: Path
) -> None:
    mount(
        dataset.url,
        mountpoint,
        cache_dir,
        "--block-size",
        BLOCK_FLAG,
        "--prefetch",
        "all",
        env=env,
    )
    wait_for(
        lambda: stats(mountpoint)["bytes_fetched"] >= dataset.shard_bytes,
        "--prefetch all to fetch every shard",
    )
    assert stats(mountpoint)["bytes_fetched"] == dataset.shard_bytes
    s3_server.reset_counts()
    assert wrong_files(mountpoint, dataset, sorted(dataset.files)) == []
    assert shard_traffic(s3_server, dataset) == {}
    umount(mountpoint)


def test_shuffled_epoch_with_readahead_pays_each_byte_once(
    dataset: Dataset, s3_server: S3Server, env: dict[str, str], mountpoint: Path, cache_dir: Path
) -> None:
    mount(dataset.url, mountpoint, cache_dir, "--block-size", BLOCK_FLAG, env=env)
    s3_server.reset_counts()
    names = sorted(dataset.files)
    random.Random(3).shuffle(names)
    assert wrong_files(mountpoint, dataset, names) == []
    wait_for(
        lambda: sum(shard_traffic(s3_server, dataset).values()) >= dataset.shard_bytes,
        "readahead to finish",
    )
    traffic = shard_traffic(s3_server, dataset)
    for shard, size in dataset.shard_sizes.items():
        # Which GETs paid twice, and the mount's counters, in the message: a rare failure
        # in CI (one in about ten runs of the whole suite) was not reproduced locally.
        assert traffic[shard] == size, (
            f"{shard}: fetched {traffic[shard]} of {size} bytes; "
            f"{repeats(s3_server.ranges_sent())}; {stats(mountpoint)}"
        )
    file_bytes = sum(len(d) for d in dataset.files.values())
    assert sum(traffic.values()) <= 1.05 * file_bytes
    umount(mountpoint)
    s3_server.reset_counts()
    mount(dataset.url, mountpoint, cache_dir, "--block-size", BLOCK_FLAG, env=env)
    assert wrong_files(mountpoint, dataset, names) == []
    assert shard_traffic(s3_server, dataset) == {}
    umount(mountpoint)


def test_an_index_scan_fills_the_cache_so_reads_fetch_nothing_more(
    dataset: Dataset, s3_server: S3Server, env: dict[str, str], mountpoint: Path, cache_dir: Path
) -> None:
    s3_server.reset_counts()
    mount(
        dataset.url,
        mountpoint,
        cache_dir,
        "--block-size",
        BLOCK_FLAG,
        "--no-sidecar",
        env=env,
    )
    scanned = shard_traffic(s3_server, dataset)
    assert scanned == dataset.shard_sizes  # the scan streamed every shard once
    assert wrong_files(mountpoint, dataset, sorted(dataset.files)) == []
    assert shard_traffic(s3_server, dataset) == scanned  # and reading added nothing
    umount(mountpoint)


def test_warm_then_mount_reads_nothing_from_the_store(
    dataset: Dataset, s3_server: S3Server, env: dict[str, str], mountpoint: Path, cache_dir: Path
) -> None:
    result = run_shardfs(
        "warm", dataset.url, "--cache-dir", cache_dir, "--block-size", BLOCK_FLAG, env=env
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("warmed 5 shards")
    s3_server.reset_counts()
    again = run_shardfs(
        "warm", dataset.url, "--cache-dir", cache_dir, "--block-size", BLOCK_FLAG, env=env
    )
    assert again.returncode == 0, again.stderr
    assert shard_traffic(s3_server, dataset) == {}  # a second warm fetches nothing
    mount(dataset.url, mountpoint, cache_dir, "--block-size", BLOCK_FLAG, env=env)
    s3_server.reset_counts()
    assert wrong_files(mountpoint, dataset, sorted(dataset.files)) == []
    assert shard_traffic(s3_server, dataset) == {}
    umount(mountpoint)


def test_a_slow_get_stalls_only_the_reads_that_need_it(
    dataset: Dataset, s3_server: S3Server, env: dict[str, str], mountpoint: Path, cache_dir: Path
) -> None:
    """One GET that hangs (the store delays one shard by 20 s) must not block listings or
    reads of other shards: they finish while the slow read is still waiting."""
    mount(
        dataset.url,
        mountpoint,
        cache_dir,
        "--block-size",
        BLOCK_FLAG,
        "--prefetch",
        "none",
        env=env,
    )
    names = sorted(dataset.files)
    slow_shard = dataset.members[names[0]]
    others = [n for n in names if dataset.members[n] != slow_shard][:12]
    s3_server.delay_gets(slow_shard, 20.0)
    result: dict[str, bytes] = {}
    try:
        slow = threading.Thread(
            target=lambda: result.update(data=(mountpoint / names[0]).read_bytes())
        )
        slow.start()
        wait_for(
            lambda: any(
                k.endswith(slow_shard) for k in s3_server.counts()["get_object_requests_by_key"]
            ),
            "the slow GET to reach the server",
        )
        assert sorted(os.listdir(mountpoint)) == names
        assert wrong_files(mountpoint, dataset, others) == []
        assert slow.is_alive(), "the other reads should finish while the slow GET waits"
    finally:
        s3_server.delay_gets()
    slow.join(60)
    assert result["data"] == dataset.files[names[0]]
    umount(mountpoint)


def _split_by_block(root: Path, names: list[str], data: Dataset) -> tuple[list[str], list[str]]:
    """(files lying wholly inside one cache block, files straddling two) by their offsets."""
    block = 256 * 1024
    inside, straddling = [], []
    for name in names:
        start = int(os.getxattr(root / name, "user.shardfs.offset"))
        end = start + len(data.files[name])
        (inside if start // block == (end - 1) // block else straddling).append(name)
    return inside, straddling


@pytest.mark.parametrize("push", [True, False], ids=["push", "no-push"])
def test_listed_files_of_a_fetched_shard_are_pushed_into_the_kernel_cache(
    dataset: Dataset,
    env: dict[str, str],
    mountpoint: Path,
    cache_dir: Path,
    push: bool,
) -> None:
    flags = () if push else ("--no-kernel-push",)
    mount(dataset.url, mountpoint, cache_dir, "--block-size", BLOCK_FLAG, *flags, env=env)
    listed = os.listdir(mountpoint)  # READDIRPLUS: the kernel now knows every inode
    assert sorted(listed) == sorted(dataset.files)
    name = sorted(dataset.files)[30]
    shard = dataset.members[name]
    same_shard = sorted(n for n, s in dataset.members.items() if s == shard)
    inside, straddling = _split_by_block(mountpoint, same_shard, dataset)
    assert inside and straddling  # the split itself is exercised
    assert (mountpoint / name).read_bytes() == dataset.files[name]
    wait_for(lambda: stats(mountpoint)["prefetched_blocks"] > 0, "the shard's readahead")
    # The file just read went to the kernel whole already, so it need not be pushed.
    at_least = sum(len(dataset.files[n]) for n in inside + straddling if n != name)
    if push:
        wait_for(lambda: stats(mountpoint)["bytes_pushed"] >= at_least, "the pushes", timeout=30)
    before = stats(mountpoint)
    others = [n for n in same_shard if n != name]
    assert wrong_files(mountpoint, dataset, others) == []
    after = stats(mountpoint)
    served = after["bytes_served"] - before["bytes_served"]
    other_bytes = sum(len(dataset.files[n]) for n in others)
    if push:
        # Every file came from the kernel, those straddling two blocks too (``EdgeFiles``).
        assert at_least <= before["bytes_pushed"] <= at_least + len(dataset.files[name])
        assert served == 0
    else:
        assert after["bytes_pushed"] == 0
        assert served == other_bytes
    umount(mountpoint)


def test_files_fetched_before_the_kernel_knew_them_are_pushed_once_listed(
    dataset: Dataset, env: dict[str, str], mountpoint: Path, cache_dir: Path
) -> None:
    args = ("--block-size", BLOCK_FLAG, "--prefetch", "all")
    mount(dataset.url, mountpoint, cache_dir, *args, env=env)
    wait_for(
        lambda: stats(mountpoint)["bytes_fetched"] >= dataset.shard_bytes,
        "--prefetch all to fetch every shard",
    )
    assert stats(mountpoint)["bytes_pushed"] == 0  # no inode known yet: nothing to push to
    names = sorted(os.listdir(mountpoint))  # READDIRPLUS hands every inode to the kernel
    inside, straddling = _split_by_block(mountpoint, names, dataset)
    assert inside and straddling  # both kinds are exercised
    # The straddling files too: each is put together from its cached blocks.
    every = sum(len(data) for data in dataset.files.values())
    wait_for(lambda: stats(mountpoint)["bytes_pushed"] >= every, "the pushes")
    before = stats(mountpoint)
    assert before["bytes_pushed"] == every
    assert wrong_files(mountpoint, dataset, names) == []
    # All from the kernel, but for at most one file (one run in about 20 served one: a pushed
    # file the kernel read again); without pushes of straddling files, all of those are READs.
    served = stats(mountpoint)["bytes_served"] - before["bytes_served"]
    assert (
        served
        <= max(map(len, dataset.files.values()))
        < sum(len(dataset.files[n]) for n in straddling)
    )
    umount(mountpoint)


def test_files_whose_inodes_the_kernel_dropped_are_read_not_pushed_to_nowhere(
    dataset: Dataset, env: dict[str, str], mountpoint: Path, cache_dir: Path
) -> None:
    # A listing hands the kernel every inode; then it lets them all go, as under memory
    # pressure on a node whose dataset is larger than its RAM, and says so with FORGETs.
    # Pushing the files of the blocks fetched next into those inodes would be refused,
    # retried and read back from the cache, file after file: the daemon must know which
    # inodes the kernel still holds.
    mount(dataset.url, mountpoint, cache_dir, "--block-size", BLOCK_FLAG, env=env)
    names = sorted(os.listdir(mountpoint))  # READDIRPLUS: every inode handed over
    drop_inodes()
    wait_for(
        lambda: stats(mountpoint)["inodes_forgotten"] >= len(names) // 2, "the kernel's FORGETs"
    )
    # One file of each shard: readahead fetches the rest of it, none of it looked up again.
    firsts = sorted({dataset.members[n]: n for n in reversed(names)}.values())
    assert wrong_files(mountpoint, dataset, firsts) == []
    wait_for(lambda: stats(mountpoint)["bytes_fetched"] >= dataset.shard_bytes, "the readahead")
    assert wrong_files(mountpoint, dataset, names) == []
    after = stats(mountpoint)
    # Each file came by a READ after its reader's LOOKUP, or by a push once looked up; a
    # push may still meet an inode the kernel drops meanwhile, but not one per file.
    assert after["pushes_refused"] <= len(names) // 10, after["pushes_refused"]
    every = sum(len(data) for data in dataset.files.values())
    assert after["bytes_served"] + after["bytes_pushed"] >= every
    umount(mountpoint)


def test_sigterm_during_a_cold_epoch_with_pushes_stops_the_daemon(
    dataset: Dataset, s3_server: S3Server, env: dict[str, str], mountpoint: Path, cache_dir: Path
) -> None:
    """Readers, readahead, kernel pushes and a slow GET all in flight when SIGTERM comes: the
    daemon still unmounts and exits (no reply waits forever on a stopped session)."""
    from shardfs.mount.control import pid_file

    mount(dataset.url, mountpoint, cache_dir, "--block-size", BLOCK_FLAG, env=env)
    names = sorted(os.listdir(mountpoint))  # the kernel knows every inode: pushes happen
    pid = int(pid_file(mountpoint).read_text())
    slow_shard = dataset.members[names[-1]]
    s3_server.delay_gets(slow_shard, 3.0)
    outcomes: list[str] = []
    stopping = threading.Event()

    def read_all() -> None:
        for name in random.Random(3).sample(names, len(names)):
            try:
                ok = (mountpoint / name).read_bytes() == dataset.files[name]
                outcomes.append("ok" if ok else "wrong")
            except OSError as exc:
                # The mount going away is the only failure a reader may see: ENOTCONN from
                # the ended connection, ENOENT from the empty folder beneath once unmounted.
                when = "after" if stopping.is_set() else "before"
                outcomes.append(f"{errno.errorcode.get(exc.errno or 0, exc)} {when} SIGTERM")

    readers = [threading.Thread(target=read_all) for _ in range(3)]
    try:
        for reader in readers:
            reader.start()
        wait_for(lambda: len(outcomes) >= 10, "the readers to get going")
        wait_for(lambda: stats(mountpoint)["bytes_pushed"] > 0, "a kernel push")
        stopping.set()
        os.kill(pid, signal.SIGTERM)
        wait_for(lambda: process_gone(pid), "the daemon to exit after SIGTERM")
    finally:
        s3_server.delay_gets()
    for reader in readers:
        reader.join(30)
        assert not reader.is_alive(), "a reader hung after the daemon stopped"
    assert not is_mounted(mountpoint)
    assert "wrong" not in outcomes  # every byte served before the stop was right
    assert set(outcomes) <= {"ok", "ENOTCONN after SIGTERM", "ENOENT after SIGTERM"}, outcomes
    assert outcomes.count("ok") >= 10

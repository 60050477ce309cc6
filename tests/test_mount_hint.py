"""The placement table and the order hint over a real FUSE mount and the moto S3 server.

Requests reach moto through the fault proxy, whose log keeps their order and ranges."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from support.datagen import FIXED_MTIME, pack_with_gnu_tar
from support.fault_proxy import FaultProxy
from support.mounts import mount, new_bucket, umount, wait_for
from support.processes import run_shardfs
from support.s3 import S3Server

from shardfs.placement import (
    HINT_NAME,
    TABLE_NAME,
    Placement,
    mount_root_of,
    read_placement,
    send_hint,
)

pytestmark = pytest.mark.integration

BLOCK = 256 << 10


@dataclass(frozen=True)
class Dataset:
    files: dict[str, bytes]
    url: str
    key_prefix: str


@pytest.fixture(scope="module")
def dataset(s3_server: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Dataset:
    """~3.6 MB of random files of 40-80 KB in 5 shards, in two folders."""
    base = tmp_path_factory.mktemp("hint")
    rng = random.Random(11)
    src = base / "src"
    files = {}
    for number in range(60):
        name = f"{'ab'[number % 2]}/img_{number:03d}.jpg"
        files[name] = rng.randbytes(rng.randrange(40_000, 80_000))
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes(files[name])
        os.utime(src / name, (FIXED_MTIME, FIXED_MTIME))
    pack_with_gnu_tar(src, base / "shards", files_per_shard=[12] * 5)
    bucket = new_bucket(s3_server, "hint")
    s3_server.upload_dir(base / "shards", f"{bucket}/data")
    url = f"s3://{bucket}/data/"
    result = run_shardfs(
        "index", url, "--write-sidecar", "--cache-dir", base / "c", env=s3_server.env()
    )
    assert result.returncode == 0, result.stderr
    return Dataset(files, url, f"{bucket}/data/")


@pytest.fixture
def proxy(s3_server: S3Server) -> Iterator[FaultProxy]:
    with FaultProxy(s3_server) as running:
        yield running


@pytest.fixture
def mounted(
    dataset: Dataset, proxy: FaultProxy, mountpoint: Path, tmp_path: Path
) -> Iterator[Path]:
    mount(
        dataset.url,
        mountpoint,
        tmp_path / "cache",
        "--endpoint-url",
        proxy.endpoint,
        "--block-size",
        "256K",
        "--prefetch-streams",
        "1",
        env=proxy.env(),
    )
    proxy.clear()
    yield mountpoint
    umount(mountpoint)


def stats(mountpoint: Path) -> dict[str, Any]:
    result = run_shardfs("stats", mountpoint, "--json")
    assert result.returncode == 0, result.stderr
    values: dict[str, Any] = json.loads(result.stdout)
    return values


def shard_gets(proxy: FaultProxy, data: Dataset) -> list[tuple[str, int]]:
    """(shard name, first byte) of every ranged GET of a shard, in the order they came."""
    gets = []
    for entry in proxy.state.log:
        key = entry["key"] or ""
        if entry["method"] == "GET" and key.startswith(data.key_prefix) and entry["range"]:
            gets.append((key[len(data.key_prefix) :], entry["range"][0]))
    return gets


def test_the_table_agrees_with_the_xattrs_and_is_never_listed(
    dataset: Dataset, mounted: Path
) -> None:
    table = read_placement(str(mounted))
    assert sorted(table.paths) == sorted(dataset.files)
    assert [table.sizes[row] for row in table.rows_of(sorted(dataset.files))] == [
        len(dataset.files[name]) for name in sorted(dataset.files)
    ]
    keys = [(table.shard_names[table.shards[i]], table.offsets[i]) for i in range(len(table))]
    assert keys == sorted(keys)  # (shard, offset) order
    for name in sorted(dataset.files)[::7]:
        (row,) = table.rows_of([name])
        assert (
            os.getxattr(mounted / name, "user.shardfs.shard").decode()
            == (table.shard_names[table.shards[row]])
        )
        assert int(os.getxattr(mounted / name, "user.shardfs.offset")) == table.offsets[row]
    seen = {name for _, dirs, files in os.walk(mounted) for name in dirs + files}
    assert TABLE_NAME not in seen and HINT_NAME not in seen
    assert TABLE_NAME not in os.listdir(mounted)
    assert (mounted / TABLE_NAME).stat().st_size > 0
    assert read_placement(str(mounted)) == table  # the same bytes every time


def test_mount_root_of_finds_the_mount_and_nothing_else(mounted: Path, tmp_path: Path) -> None:
    assert mount_root_of(str(mounted / "a" / "img_000.jpg")) == str(mounted)
    assert mount_root_of(str(mounted)) == str(mounted)
    local = tmp_path / "local" / "deep"
    local.mkdir(parents=True)
    assert mount_root_of(str(local)) is None


def test_a_reversed_hint_fetches_blocks_in_reversed_order(
    dataset: Dataset, proxy: FaultProxy, mounted: Path
) -> None:
    table = read_placement(str(mounted))
    rows = list(reversed(range(len(table))))
    expected: list[tuple[str, int]] = []
    for row in rows:
        offset, size = table.offsets[row], table.sizes[row]
        for index in range(offset // BLOCK, (offset + size - 1) // BLOCK + 1):
            block = (table.shard_names[table.shards[row]], index * BLOCK)
            if block not in expected:
                expected.append(block)
    assert not shard_gets(proxy, dataset)
    send_hint(str(mounted), table, rows, epoch=3)
    wait_for(lambda: len(shard_gets(proxy, dataset)) >= len(expected), "hinted readahead")
    wait_for(lambda: stats(mounted)["prefetched_blocks"] == len(expected), "blocks stored")
    assert shard_gets(proxy, dataset) == expected  # first-use order, one GET per block
    before = stats(mounted)
    assert before["hints_taken"] == 1
    assert before["prefetched_unread_bytes"] > 0
    for row in rows:
        path = table.paths[row]
        assert (mounted / path).read_bytes() == dataset.files[path]
    after = stats(mounted)
    assert len(shard_gets(proxy, dataset)) == len(expected)  # nothing fetched twice
    assert after["hinted_reads"] - before["hinted_reads"] >= len(rows)
    assert after["reads_waited_on_network"] == 0
    # READs answered in C count their blocks as read at C's next sweep (about a second)
    wait_for(lambda: stats(mounted)["prefetched_unread_bytes"] == 0, "blocks counted read")
    text = run_shardfs("stats", mounted)
    assert text.returncode == 0, text.stderr
    assert f"hinted reads         {after['hinted_reads']} (1 hints)" in text.stdout


def test_a_hint_over_a_cache_that_holds_the_data_fetches_a_shards_blocks_in_one_get(
    dataset: Dataset, proxy: FaultProxy, mounted: Path
) -> None:
    """An order that needs each shard's first block, then its last, then the ones between
    (as uniform mode's orders do, one random block after another): the first block brings
    the shard's next ones along in its GET, since the cache keeps them all. Handed out one
    by one, the last block would be a GET of its own."""
    table = read_placement(str(mounted))

    def blocks_of(row: int) -> list[int]:
        offset, size = table.offsets[row], table.sizes[row]
        return list(range(offset // BLOCK, (offset + size - 1) // BLOCK + 1))

    by_shard: dict[int, list[int]] = {}
    for row in range(len(table)):
        by_shard.setdefault(table.shards[row], []).append(row)
    firsts, lasts, between = [], [], []
    for shard_rows in by_shard.values():
        shard_rows.sort(key=lambda row: table.offsets[row])
        first, last = shard_rows[0], shard_rows[-1]
        assert blocks_of(first) == [0] and blocks_of(last) in ([2], [3])  # the dataset's
        firsts.append(first)
        lasts.append(last)
        between += shard_rows[1:-1]
    random.Random(5).shuffle(between)
    rows = firsts + lasts + between
    needed = {(table.shard_names[table.shards[row]], i) for row in rows for i in blocks_of(row)}
    send_hint(str(mounted), table, rows, epoch=1)
    wait_for(lambda: stats(mounted)["prefetched_blocks"] == len(needed), "blocks stored")
    fetched = []
    for entry in proxy.state.log:
        key = entry["key"] or ""
        if entry["method"] == "GET" and key.startswith(dataset.key_prefix) and entry["range"]:
            first_byte, last_byte = entry["range"]  # inclusive
            shard = key[len(dataset.key_prefix) :]
            fetched += [(shard, i) for i in range(first_byte // BLOCK, last_byte // BLOCK + 1)]
    assert sorted(fetched) == sorted(needed)  # every block once
    gets = shard_gets(proxy, dataset)
    assert sorted(gets) == sorted((name, 0) for name in table.shard_names), gets
    for row in rows:
        path = table.paths[row]
        assert (mounted / path).read_bytes() == dataset.files[path]
    assert shard_gets(proxy, dataset) == gets  # nothing fetched again
    assert stats(mounted)["reads_waited_on_network"] == 0


def test_a_hint_for_another_table_is_refused_with_einval(
    dataset: Dataset, proxy: FaultProxy, mounted: Path
) -> None:
    table = read_placement(str(mounted))
    other: Placement = dataclasses.replace(table, fingerprint="0" * len(table.fingerprint))
    with pytest.raises(OSError) as info:
        send_hint(str(mounted), other, range(len(table)), epoch=0)
    assert info.value.errno == errno.EINVAL
    assert stats(mounted)["hints_taken"] == 0
    assert shard_gets(proxy, dataset) == []
    # The mount stays read-only everywhere else, hint file included.
    with pytest.raises(OSError) as info:
        os.open(mounted / HINT_NAME, os.O_WRONLY)
    assert info.value.errno == errno.EROFS

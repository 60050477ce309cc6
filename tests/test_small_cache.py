"""A block cache smaller than the dataset over a real mount and moto S3 (issue 12's targets).

The dataset (~19 MB in 6 GNU tar shards, files of 20-60 KB) is read twice through the mount
with ``--block-size 1M`` and ``--cache-size`` at a fraction of it, and the page cache is
dropped every 10 files (``echo 1 > /proc/sys/vm/drop_caches``) to stand in for a dataset
larger than RAM. Egress is counted at the server, per epoch, after background fetches stop.
Every byte read is checked against the source's SHA-256. The bounds are the issue's targets:
random order <= 1.0x the dataset, ``ShardSampler`` shard mode <= 1.05x, uniform mode with
the order hint <= 1.1 x (1 - cache / dataset) once the cache holds the previous epoch's tail.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from support.datagen import FIXED_MTIME, pack_with_gnu_tar
from support.mounts import drop_page_cache, mount, new_bucket, umount
from support.processes import run_shardfs
from support.s3 import S3Server, repeats, settled_counts, until_quiet

from shardfs.mount.control import query

pytestmark = pytest.mark.integration

BLOCK = 1 << 20
DROP_EVERY = 10  # files read between two drops of the page cache
LARGEST_FILE = 60_000
FILES = 480
SHARDS = 6
# The mount's counters a failure of the paid-once check shows, since the mount started.
WHY_TWICE = ("range_reads", "blocks_not_admitted", "blocks_kept_unstored", "blocks_paid_in_part",
             "blocks_evicted", "evicted_unread_bytes", "files_fetched_ahead",
             "files_ahead_read")  # fmt: skip


@dataclass(frozen=True)
class Dataset:
    digests: dict[str, str]  # relative path -> SHA-256 of the source file
    sizes: dict[str, int]  # relative path -> bytes
    url: str
    key_prefix: str  # "bucket/prefix/" of the shards at the server
    shard_bytes: int  # what a reader that streams every shard once pays
    shard_sizes: tuple[int, ...]

    @property
    def file_bytes(self) -> int:
        return sum(self.sizes.values())


@pytest.fixture(scope="module")
def dataset(s3_server: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Dataset:
    base = tmp_path_factory.mktemp("small-cache")
    src = base / "src"
    rng = random.Random(12)
    digests, sizes = {}, {}
    for number in range(FILES):
        name = f"class_{number % 4}/img_{number:04d}.jpg"
        data = rng.randbytes(rng.randrange(20_000, LARGEST_FILE))
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes(data)
        os.utime(src / name, (FIXED_MTIME, FIXED_MTIME))
        digests[name] = hashlib.sha256(data).hexdigest()
        sizes[name] = len(data)
    shards = pack_with_gnu_tar(src, base / "shards", files_per_shard=FILES // SHARDS)
    bucket = new_bucket(s3_server, "small-cache")
    s3_server.upload_dir(base / "shards", f"{bucket}/data")
    url = f"s3://{bucket}/data/"
    # The sidecar lets every mount start without reading the shards.
    result = run_shardfs(
        "index", url, "--write-sidecar", "--cache-dir", base / "index", env=s3_server.env()
    )
    assert result.returncode == 0, result.stderr
    shard_sizes = tuple(p.stat().st_size for p in shards)
    return Dataset(digests, sizes, url, f"{bucket}/data/", sum(shard_sizes), shard_sizes)


@dataclass(frozen=True)
class Epoch:
    egress: int  # GetObject body bytes of the shards at the server
    ratio: float  # egress / shard bytes
    refetched: int  # of those, bytes whose offsets the server had sent this epoch already
    twice: str = ""  # which fetches those were, and the earlier ones they repeated
    counters: str = ""  # the mount's counters that tell why, when any byte came twice


def through_daemon(mountpoint: Path) -> int:
    """Bytes the daemon has served to readers or pushed into the page cache so far."""
    stats = query(mountpoint)
    return int(stats["bytes_served"]) + int(stats["bytes_pushed"])


def read_epoch(
    server: S3Server,
    data: Dataset,
    mountpoint: Path,
    order: Iterable[str],
    drop_every: int = DROP_EVERY,
    check_drops: bool = True,
) -> Epoch:
    """Read every file of ``order`` once, dropping the page cache every ``drop_every``
    files; check each file's bytes; return the epoch's egress once background fetches
    stopped.

    With ``check_drops``, the first file read after each drop must reach the daemon (served,
    or pushed again): that proves the drop worked, so the page cache hid nothing from the
    mount. (Pages the pusher stored a moment before a drop may outlive it.)"""
    server.reset_counts()
    read = 0
    for number, name in enumerate(order):
        dropped = number % drop_every == 0
        if dropped:
            drop_page_cache()
            before = through_daemon(mountpoint)
        digest = hashlib.sha256((mountpoint / name).read_bytes()).hexdigest()
        assert digest == data.digests[name], f"wrong bytes in {name}"
        if dropped and check_drops:
            grew = through_daemon(mountpoint) - before
            assert grew >= data.sizes[name], (
                f"{name}, read right after a drop of the page cache, reached the daemon "
                f"for {grew} of its {data.sizes[name]} bytes"
            )
        read += 1
    assert read == len(data.digests)
    counts = settled_counts(server)
    egress = sum(
        n for key, n in counts["get_object_bytes_by_key"].items() if key.startswith(data.key_prefix)
    )
    refetched = counts["get_object_refetched_bytes"]
    twice = counters = ""
    if refetched:
        twice = "\n".join(repeats(server.ranges_sent())[:20])
        stats = query(mountpoint)
        counters = ", ".join(f"{name} {stats.get(name)}" for name in WHY_TWICE)
    return Epoch(egress, egress / data.shard_bytes, refetched, twice, counters)


def assert_paid_once(epoch: Epoch, number: int) -> None:
    """Within an epoch a byte is paid for once: never as a block and again as a file's
    range, nor as a block a GET brought that found no room. The way bytes still came twice
    before stop 46, a block fetched whole once room came back after part of it had come
    as a range (one file's part in about 1 run of 10; two files, 87 KB, in one CI run), is
    closed (``PaidInPart``, docs/design.md): 0 bytes twice in 144 epochs of 12 runs of this
    file, against 51 KB in 1 of 144 on the previous head. The bound of one file is a margin
    for a way not known yet; the message names the ranges sent twice."""
    assert epoch.refetched <= LARGEST_FILE, (
        f"epoch {number}: {epoch.refetched} bytes fetched twice ({epoch.counters}):\n{epoch.twice}"
    )


def shuffled(names: Iterable[str], seed: int) -> list[str]:
    order = sorted(names)
    random.Random(seed).shuffle(order)
    return order


@pytest.fixture
def mounted(
    s3_server: S3Server, dataset: Dataset, mountpoint: Path, tmp_path: Path, request: Any
) -> Iterator[tuple[Path, int]]:
    """The dataset mounted on an empty cache of ``request.param`` x its shard bytes."""
    cache_size = int(dataset.shard_bytes * request.param)
    mount(dataset.url, mountpoint, tmp_path / "cache", "--block-size", str(BLOCK),
          "--cache-size", str(cache_size), env=s3_server.env())  # fmt: skip
    yield mountpoint, cache_size
    umount(mountpoint)


def ratios(epochs: list[Epoch]) -> str:
    return ", ".join(f"epoch {n}: {e.ratio:.2f}x" for n, e in enumerate(epochs))


@pytest.mark.parametrize("mounted", [0.5, 0.25], indirect=True, ids=["cache-0.5x", "cache-0.25x"])
def test_a_random_order_pays_at_most_the_dataset_per_epoch(
    s3_server: S3Server, dataset: Dataset, mounted: tuple[Path, int]
) -> None:
    mountpoint, _ = mounted
    epochs = [
        read_epoch(s3_server, dataset, mountpoint, shuffled(dataset.digests, seed))
        for seed in (0, 1)
    ]
    for number, epoch in enumerate(epochs):
        assert epoch.ratio <= 1.0, (
            f"random order, epoch {number}: egress {epoch.egress} bytes is "
            f"{epoch.ratio:.2f}x the dataset's {dataset.shard_bytes} (target <= 1.0x; "
            f"{ratios(epochs)})"
        )


@pytest.mark.parametrize("mounted", [2.0], indirect=True, ids=["cache-2x"])
def test_a_cache_that_holds_the_dataset_pays_nothing_in_epoch_1(
    s3_server: S3Server, dataset: Dataset, mounted: tuple[Path, int]
) -> None:
    mountpoint, _ = mounted
    epochs = [
        read_epoch(s3_server, dataset, mountpoint, shuffled(dataset.digests, seed))
        for seed in (0, 1)
    ]
    assert epochs[0].ratio <= 1.0, ratios(epochs)
    assert epochs[1].egress == 0, ratios(epochs)


class _Folder:
    """What ShardSampler needs of a dataset: ``samples`` of (path, target)."""

    def __init__(self, root: Path, names: list[str]) -> None:
        self.samples = [(str(root / name), 0) for name in names]


def sampler_epochs(
    server: S3Server, data: Dataset, mountpoint: Path, mode: str, **reading: Any
) -> tuple[list[Epoch], bool]:
    """Two epochs in ``ShardSampler(mode=mode)`` order (hint on, the default); ``reading``
    goes to ``read_epoch``."""
    from shardfs.torch import ShardSampler

    names = sorted(data.digests)
    folder = _Folder(mountpoint, names)
    sampler = ShardSampler(folder, mode=mode, seed=0, num_replicas=1, rank=0)  # type: ignore[arg-type]
    epochs = []
    for number in (0, 1):
        sampler.set_epoch(number)
        order = [names[index] for index in sampler]
        assert sorted(order) == names
        epochs.append(read_epoch(server, data, mountpoint, order, **reading))
    return epochs, sampler.on_mount


@pytest.mark.parametrize("mounted", [0.5, 0.25], indirect=True, ids=["cache-0.5x", "cache-0.25x"])
def test_shard_mode_streams_each_shard_once_per_epoch(
    s3_server: S3Server, dataset: Dataset, mounted: tuple[Path, int]
) -> None:
    pytest.importorskip("torch")
    mountpoint, _ = mounted
    epochs, on_mount = sampler_epochs(s3_server, dataset, mountpoint, "shard")
    assert on_mount, "the sampler did not find the mount's placement table"
    for number, epoch in enumerate(epochs):
        assert epoch.ratio <= 1.05, (
            f"shard mode, epoch {number}: {epoch.ratio:.2f}x the dataset (target <= 1.05x; "
            f"{ratios(epochs)})"
        )
        assert_paid_once(epoch, number)


@pytest.mark.parametrize("mounted", [0.5, 0.25], indirect=True, ids=["cache-0.5x", "cache-0.25x"])
def test_uniform_mode_with_the_hint_keeps_what_is_needed_soonest(
    s3_server: S3Server, dataset: Dataset, mounted: tuple[Path, int]
) -> None:
    """Epoch 0 starts on an empty cache, so it pays every byte once (<= 1.0x); from epoch 1
    the cache's share of the dataset is the part that need not be fetched again."""
    pytest.importorskip("torch")
    mountpoint, cache_size = mounted
    epochs, on_mount = sampler_epochs(s3_server, dataset, mountpoint, "uniform")
    assert on_mount, "the sampler did not find the mount's placement table"
    assert epochs[0].ratio <= 1.0, f"uniform mode, cold epoch 0 (target <= 1.0x; {ratios(epochs)})"
    for number, epoch in enumerate(epochs):
        assert_paid_once(epoch, number)
    bound = 1.1 * (1 - cache_size / dataset.shard_bytes)
    assert epochs[1].ratio <= bound, (
        f"uniform mode, epoch 1: {epochs[1].ratio:.2f}x the dataset (target <= {bound:.3f}x "
        f"= 1.1 x (1 - cache / dataset); {ratios(epochs)})"
    )
    # Once the cache was full, the hint had the next files fetched ahead as ranges, and
    # the reads found them there (a read that waits for its own GET is not counted).
    stats = query(mountpoint)
    assert stats["files_fetched_ahead"] > 0
    assert stats["files_ahead_read"] >= 0.75 * stats["range_reads"], stats


@pytest.mark.parametrize("mounted", [0.25], indirect=True, ids=["cache-0.25x"])
@pytest.mark.parametrize("drop_every", [FILES, DROP_EVERY], ids=["no-drops", "drops"])
def test_uniform_mode_pushes_the_files_it_fetches_ahead_into_the_page_cache(
    s3_server: S3Server, dataset: Dataset, mounted: tuple[Path, int], drop_every: int
) -> None:
    """Once the kernel knows the files (a listing gave it their inodes), a file fetched
    ahead is pushed into the page cache: its reader opens it there, with no READ, and the
    hint then lets its bytes go. A file whose pages were dropped before its open (the page
    cache dropped every 10 files) is read from those bytes still. Every byte is paid for
    once either way."""
    pytest.importorskip("torch")
    mountpoint, _ = mounted
    listed = sum(len(files) for _, _, files in os.walk(mountpoint))
    assert listed >= len(dataset.digests)
    epochs, on_mount = sampler_epochs(
        s3_server, dataset, mountpoint, "uniform", drop_every=drop_every, check_drops=False
    )
    assert on_mount, "the sampler did not find the mount's placement table"
    assert epochs[0].ratio <= 1.0, f"uniform mode, cold epoch 0 ({ratios(epochs)})"
    for number, epoch in enumerate(epochs):
        assert_paid_once(epoch, number)
    stats = query(mountpoint)
    ahead, opened = stats["files_fetched_ahead"], stats["files_ahead_opened"]
    assert ahead > 0, stats
    if drop_every == FILES:
        # Files pushed in time were opened with no READ (here about 100 of 700: this
        # reader is quicker than the store, so most READs come while their fetch runs,
        # and those READs hand the bytes over themselves).
        assert opened > 0, stats
        assert stats["python_reads"] <= 2 * len(dataset.digests) - opened, stats
        assert stats["files_ahead_read"] + opened <= ahead, stats
    else:  # most pushes are dropped before their open: their READs take the bytes
        assert stats["files_ahead_read"] >= 0.5 * ahead, stats


def test_shard_mode_streams_whole_blocks_when_the_window_fits_the_cache(
    s3_server: S3Server, dataset: Dataset, mountpoint: Path, tmp_path: Path
) -> None:
    """With small blocks the blocks being read (one shard mixed at a time) and a window
    ahead fit a cache of half the data: whole blocks stream through it, each retired once
    its files were read and evicted for the next, with no file fetched as a range."""
    pytest.importorskip("torch")
    from shardfs.torch import ShardSampler

    cache_size = dataset.shard_bytes // 2
    mount(dataset.url, mountpoint, tmp_path / "cache", "--block-size", "256K",
          "--cache-size", str(cache_size), env=s3_server.env())  # fmt: skip
    try:
        names = sorted(dataset.digests)
        sampler = ShardSampler(_Folder(mountpoint, names), mode="shard", seed=0,  # type: ignore[arg-type]
                               num_replicas=1, rank=0, window=1)  # fmt: skip
        epochs = []
        for number in (0, 1):
            sampler.set_epoch(number)
            epochs.append(read_epoch(s3_server, dataset, mountpoint, [names[i] for i in sampler]))
        stats = query(mountpoint)
    finally:
        umount(mountpoint)
    for number, epoch in enumerate(epochs):
        assert epoch.ratio <= 1.0, f"epoch {number}: {ratios(epochs)}"
    # Two epochs of a dataset twice the cache: blocks had to be retired and evicted.
    blocks = -(-dataset.shard_bytes // (256 << 10))
    assert stats["blocks_retired"] >= blocks, stats
    assert stats["blocks_evicted"] > 0, stats
    assert stats["files_fetched_ahead"] == 0 and stats["range_reads"] == 0, stats


@contextmanager
def _half_cache_shard_epoch(
    server: S3Server, data: Dataset, mountpoint: Path, tmp_path: Path
) -> Iterator[Callable[[], Iterator[str]]]:
    """A mount with 256 KiB blocks and a cache of half the data, and a call that walks the
    first epoch of ``ShardSampler(mode="shard", window=1)`` over it (the hint is sent when
    the walk begins). Unmounted at the end."""
    pytest.importorskip("torch")
    from shardfs.torch import ShardSampler

    mount(data.url, mountpoint, tmp_path / "cache", "--block-size", "256K",
          "--cache-size", str(data.shard_bytes // 2), env=server.env())  # fmt: skip
    try:
        names = sorted(data.digests)
        sampler = ShardSampler(_Folder(mountpoint, names), mode="shard", seed=0,  # type: ignore[arg-type]
                               num_replicas=1, rank=0, window=1)  # fmt: skip
        sampler.set_epoch(0)
        yield lambda: (names[i] for i in sampler)
    finally:
        umount(mountpoint)


def _blocks_256k(data: Dataset) -> int:
    return sum(-(-size // (256 << 10)) for size in data.shard_sizes)


def test_files_read_from_the_page_cache_retire_their_blocks(
    s3_server: S3Server, dataset: Dataset, mountpoint: Path, tmp_path: Path
) -> None:
    """No drops of the page cache after the listing: most files are pushed whole into the
    kernel and read there, so the daemon sees only their opens (the TCGETS ioctl of a
    default-buffered ``open()``). Those opens alone must tell the hint that the files are
    done, or the blocks holding only such files are never retired (a shard's last block
    may hold only the tar's end and no file)."""
    with _half_cache_shard_epoch(s3_server, dataset, mountpoint, tmp_path) as order:
        drop_page_cache()
        for _ in os.walk(mountpoint):  # as ImageFolder does: the kernel learns every inode
            pass
        for name in order():
            with open(mountpoint / name, "rb") as file:  # default buffering: sends TCGETS
                digest = hashlib.sha256(file.read()).hexdigest()
            assert digest == dataset.digests[name], f"wrong bytes in {name}"
        stats = until_quiet(
            lambda: query(mountpoint), lambda s: s["blocks_retired"], what="the mount"
        )
    # Most files never reached the daemon as a READ: they came from the pushes.
    assert stats["bytes_served"] < dataset.file_bytes // 2, stats
    assert stats["bytes_pushed"] > dataset.file_bytes // 2, stats
    assert stats["blocks_retired"] >= _blocks_256k(dataset) - SHARDS, stats


def test_a_new_hint_leaves_retired_the_blocks_the_last_one_was_done_with(
    s3_server: S3Server, dataset: Dataset, mountpoint: Path, tmp_path: Path
) -> None:
    """The compiled path tells which published blocks answered READs once a second. An
    epoch's last reads, told after the next epoch's hint arrived, used to warm the blocks
    the hint before had retired: those then held the cache's room, and the next epoch's
    first blocks found none (its files came as ranges; test above, about 1 run in 2 here).
    The mount now hears what the compiled path saw before it takes a new hint. So right
    after an epoch read through the compiled path, and a hint over 5 files, the only blocks
    not retired are those the new hint fetched."""
    import sqlite3

    from shardfs.placement import read_placement, send_hint

    with _half_cache_shard_epoch(s3_server, dataset, mountpoint, tmp_path) as order:
        names = list(order())
        for name in names:
            with open(mountpoint / name, "rb", buffering=0) as file:  # no TCGETS: READs only
                os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                assert hashlib.sha256(file.read()).hexdigest() == dataset.digests[name]
        placement = read_placement(str(mountpoint))
        row_of = {path: row for row, path in enumerate(placement.paths)}
        first = names[:5]  # read 2 s ago or more: their blocks went long ago
        send_hint(str(mountpoint), placement, [row_of[name] for name in first], epoch=1)
        time.sleep(2.5)  # two of the compiled path's reports (SWEEP_S) and the new fetches
    # Unmounted: the last uses are in the ledger.
    with contextlib.closing(sqlite3.connect(tmp_path / "cache" / "cache.sqlite")) as db:
        warm = db.execute("SELECT COUNT(*) FROM blocks WHERE atime >= 1e6").fetchone()[0]
        cached = db.execute("SELECT COUNT(*) FROM blocks").fetchone()[0]
    needed = sum(dataset.sizes[name] for name in first) // (256 << 10) + 2
    assert cached > needed and warm <= needed, (warm, cached, needed)


def test_reads_the_compiled_path_answers_retire_their_blocks(
    s3_server: S3Server, dataset: Dataset, mountpoint: Path, tmp_path: Path
) -> None:
    """Every file's pages dropped before it is read, so each is a READ (an epoch of a
    dataset larger than RAM): the compiled path answers the files the hint follows from
    their cached blocks, and tells the hint of each READ reaching a file's end, which
    retires the blocks behind the readers so that the next ones find room."""
    from shardfs.fuse import hot_path

    with _half_cache_shard_epoch(s3_server, dataset, mountpoint, tmp_path) as order:
        settled_counts(s3_server)
        s3_server.reset_counts()
        for name in order():
            with open(mountpoint / name, "rb", buffering=0) as file:  # no TCGETS: READs only
                os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # pushed or not
                digest = hashlib.sha256(file.read()).hexdigest()
            assert digest == dataset.digests[name], f"wrong bytes in {name}"
        stats = until_quiet(
            lambda: query(mountpoint), lambda s: s["blocks_retired"], what="the mount"
        )
        egress = settled_counts(s3_server)["get_object_bytes"]
    assert egress <= dataset.shard_bytes, (egress, stats)
    assert stats["hinted_reads"] >= FILES, stats  # C's and Python's
    if hot_path.available():  # 474 of 480 here; 228 when C did not tell the hint
        assert stats["hot_path_reads"] >= 9 * FILES // 10, stats
    assert stats["blocks_retired"] >= _blocks_256k(dataset) - SHARDS, stats

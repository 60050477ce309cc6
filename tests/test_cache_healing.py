"""No single damaged file in the cache folder stops a mount, ``cache info`` or ``cache clear``,
and no valid cached block is lost; a cache disk full at mount time still mounts.

Real FUSE mounts over a real moto S3 server, GNU tar shards, real tmpfs disks; every file read
through the mount is checked by SHA-256, and "nothing lost" is counted at the server.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.blocks import encoded_bytes
from support.datagen import FIXED_MTIME, pack_with_gnu_tar
from support.mounts import mount, mount_tmpfs, new_bucket, umount
from support.processes import is_mounted, run_shardfs
from support.s3 import S3Server

pytestmark = pytest.mark.integration

BLOCK_FLAG = "256K"


@dataclass(frozen=True)
class Dataset:
    digests: dict[str, str]  # name -> SHA-256
    url: str
    key_prefix: str
    file_bytes: int


@pytest.fixture(scope="module")
def dataset(s3_server: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Dataset:
    """40 files of 20-60 KB in four GNU tar shards, no sidecar (a lost index is rescanned)."""
    base = tmp_path_factory.mktemp("heal")
    rng = random.Random(99)
    src = base / "src"
    src.mkdir()
    digests, total = {}, 0
    for number in range(40):
        data = rng.randbytes(rng.randrange(20_000, 60_000))
        (src / f"f{number:03d}.bin").write_bytes(data)
        os.utime(src / f"f{number:03d}.bin", (FIXED_MTIME, FIXED_MTIME))
        digests[f"f{number:03d}.bin"] = hashlib.sha256(data).hexdigest()
        total += len(data)
    pack_with_gnu_tar(src, base / "shards", files_per_shard=10)
    bucket = new_bucket(s3_server, "heal")
    s3_server.upload_dir(base / "shards", f"{bucket}/d")
    return Dataset(digests, f"s3://{bucket}/d/", f"{bucket}/d/", total)


@pytest.fixture
def env(s3_server: S3Server) -> dict[str, str]:
    return s3_server.env()


def fill_disk(folder: Path) -> None:
    """Write a file until the disk holding ``folder`` refuses more bytes."""
    with open(folder / "filler", "wb") as f:
        chunk = b"\0" * (64 << 10)
        try:
            while True:
                f.write(chunk)
                f.flush()
        except OSError:
            pass
    assert shutil.disk_usage(folder).free < (64 << 10)


def wrong_files(root: Path, data: Dataset) -> list[str]:
    return [
        name
        for name, digest in sorted(data.digests.items())
        if hashlib.sha256((root / name).read_bytes()).hexdigest() != digest
    ]


def tar_gets(server: S3Server, data: Dataset) -> tuple[int, int]:
    """(GetObject requests, bytes) on the dataset's shards since the last reset."""
    counts = server.counts()
    requests = counts["get_object_requests_by_key"]
    sizes = counts["get_object_bytes_by_key"]

    def ours(key: str) -> bool:
        return key.startswith(data.key_prefix) and key.endswith(".tar")

    return (
        sum(n for key, n in requests.items() if ours(key)),
        sum(n for key, n in sizes.items() if ours(key)),
    )


def warnings(result: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.strip()]


def drop_page_cache() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def cache_cmd(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return run_shardfs("cache", *args)


def warm_cache(data: Dataset, mountpoint: Path, cache: Path, env: dict[str, str]) -> int:
    """Mount, read everything (so every block is cached), unmount; returns block files."""
    mount(data.url, mountpoint, cache, "--block-size", BLOCK_FLAG, "--prefetch", "none", env=env)
    assert wrong_files(mountpoint, data) == []
    umount(mountpoint)
    blocks = [p for p in (cache / "blocks").rglob("*") if p.is_file()]
    assert blocks
    return len(blocks)


def one_sqlite(folder: Path) -> Path:
    files = sorted(folder.glob("*.sqlite"))
    assert len(files) == 1, files
    return files[0]


DAMAGES = {
    "garbage": lambda path: path.write_bytes(os.urandom(5000)),
    "truncated": lambda path: os.truncate(path, path.stat().st_size // 3),
    "empty": lambda path: path.write_bytes(b""),
    "folder": lambda path: (path.unlink(), path.mkdir(), (path / "x").write_text("x")),
}


@pytest.mark.parametrize("damage", ["garbage", "truncated", "folder"])
def test_damaged_ledger_is_rebuilt_and_no_block_is_refetched(
    dataset: Dataset,
    s3_server: S3Server,
    env: dict[str, str],
    mountpoint: Path,
    tmp_path: Path,
    damage: str,
) -> None:
    cache = tmp_path / "cache"
    blocks = warm_cache(dataset, mountpoint, cache, env)
    for suffix in ("-wal", "-shm"):
        (cache / f"cache.sqlite{suffix}").unlink(missing_ok=True)
    DAMAGES[damage](cache / "cache.sqlite")

    info = cache_cmd("info", "--cache-dir", cache, "--json")
    assert info.returncode == 0, info.stderr
    assert json.loads(info.stdout)["blocks"] == blocks  # rebuilt from the block files
    rebuilt = [line for line in warnings(info) if "rebuilt" in line]
    assert len(rebuilt) == 1, info.stderr

    DAMAGES[damage](cache / "cache.sqlite")  # and once more for the mount itself
    s3_server.reset_counts()
    mount(dataset.url, mountpoint, cache, "--block-size", BLOCK_FLAG, env=env)
    drop_page_cache()
    assert wrong_files(mountpoint, dataset) == []
    assert tar_gets(s3_server, dataset) == (0, 0)  # every block survived the rebuild
    umount(mountpoint)

    log = "".join(p.read_text() for p in (cache / "logs").glob("*.log"))
    assert log.count("rebuilt it from") == 1, log
    DAMAGES[damage](cache / "cache.sqlite")
    cleared = cache_cmd("clear", "--cache-dir", cache)
    assert cleared.returncode == 0, cleared.stderr
    assert [p for p in (cache / "blocks").rglob("*") if p.is_file()] == []


def test_invalid_block_files_are_dropped_when_the_ledger_is_rebuilt(
    dataset: Dataset, env: dict[str, str], mountpoint: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    blocks = warm_cache(dataset, mountpoint, cache, env)
    files = sorted(p for p in (cache / "blocks").rglob("*") if p.is_file())
    files[0].write_bytes(b"not a block")  # bad header
    # fewer bytes than announced (past the page of zeros an O_DIRECT write leaves)
    os.truncate(files[1], encoded_bytes(files[1]) - 10)
    shutil.copyfile(files[2], files[2].with_name("999"))  # a header naming another index
    (cache / "cache.sqlite").write_bytes(b"junk" * 1000)
    result = cache_cmd("info", "--cache-dir", cache, "--json")
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    left = sorted(p for p in (cache / "blocks").rglob("*") if p.is_file())
    assert info["blocks"] == blocks - 2 == len(left)
    assert info["block_bytes"] == sum(encoded_bytes(p) for p in left)
    assert files[0] not in left and files[1] not in left
    assert not files[2].with_name("999").exists()


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty", "folder"])
@pytest.mark.parametrize("which", ["views", "index"])
def test_damaged_view_or_index_is_rebuilt(
    dataset: Dataset,
    env: dict[str, str],
    mountpoint: Path,
    tmp_path: Path,
    which: str,
    damage: str,
) -> None:
    cache = tmp_path / "cache"
    mount(dataset.url, mountpoint, cache, "--prefetch", "none", env=env)
    umount(mountpoint)
    target = one_sqlite(cache / which)
    DAMAGES[damage](target)
    result = mount(dataset.url, mountpoint, cache, env=env)
    assert [line for line in warnings(result) if "damaged" in line], result.stderr
    assert wrong_files(mountpoint, dataset) == []
    umount(mountpoint)
    assert target.is_file()
    for args in (("info",), ("clear", "--all")):
        assert cache_cmd(*args, "--cache-dir", cache).returncode == 0


@pytest.mark.parametrize("damage", ["garbage", "folder", "fifo", "symlink", "unreadable"])
def test_bad_lock_file_is_recreated(
    dataset: Dataset,
    s3_server: S3Server,
    env: dict[str, str],
    mountpoint: Path,
    tmp_path: Path,
    damage: str,
) -> None:
    cache = tmp_path / "cache"
    warm_cache(dataset, mountpoint, cache, env)
    locks = cache / "locks"
    locks.unlink()
    if damage == "garbage":
        locks.write_bytes(os.urandom(100))
    elif damage == "folder":
        locks.mkdir()
        (locks / "inside").write_text("x")
    elif damage == "fifo":
        os.mkfifo(locks)
    elif damage == "symlink":
        locks.symlink_to(tmp_path / "elsewhere")
    else:
        locks.write_text("")
        locks.chmod(0)
    s3_server.reset_counts()
    mount(dataset.url, mountpoint, cache, "--block-size", BLOCK_FLAG, env=env)
    drop_page_cache()
    assert wrong_files(mountpoint, dataset) == []
    assert tar_gets(s3_server, dataset) == (0, 0)
    umount(mountpoint)
    assert locks.is_file() and not locks.is_symlink()
    assert not (tmp_path / "elsewhere").exists()
    for args in (("info",), ("clear",)):
        assert cache_cmd(*args, "--cache-dir", cache).returncode == 0


@pytest.mark.parametrize("prepared", [False, True], ids=["empty-cache", "index-and-view-kept"])
def test_cache_disk_full_at_mount_time_still_mounts(
    dataset: Dataset,
    s3_server: S3Server,
    env: dict[str, str],
    mountpoint: Path,
    tmp_path: Path,
    tmpfs: list[Path],
    prepared: bool,
) -> None:
    cache = tmp_path / "small"
    mount_tmpfs(tmpfs, cache, "2M")
    if prepared:  # an index and view from an earlier mount are used as they are
        mount(dataset.url, mountpoint, cache, "--prefetch", "none", env=env)
        umount(mountpoint)
        index_before = one_sqlite(cache / "index").stat().st_mtime_ns
    fill_disk(cache)
    s3_server.reset_counts()
    result = mount(
        dataset.url, mountpoint, cache, "--block-size", BLOCK_FLAG, "--cache-min-free", "0", env=env
    )
    scratch = [line for line in warnings(result) if "until unmount" in line]
    assert len(scratch) == (0 if prepared else 1), result.stderr
    assert wrong_files(mountpoint, dataset) == []
    values = json.loads(run_shardfs("stats", mountpoint, "--json").stdout)
    assert values["cache_write_errors"] >= 1
    umount(mountpoint)
    assert not is_mounted(mountpoint)
    if prepared:
        assert one_sqlite(cache / "index").stat().st_mtime_ns == index_before
    else:
        folder = scratch[0].split(" are kept in ")[1].split(" until")[0]
        assert not Path(folder).exists()  # the scratch folder went away with the mount
    requests, fetched = tar_gets(s3_server, dataset)
    print(
        f"\nfull cache disk ({'prepared' if prepared else 'empty'}): {requests} GETs, "
        f"{fetched} bytes for {dataset.file_bytes} bytes of files"
    )
    assert cache_cmd("info", "--cache-dir", cache).returncode == 0
    assert cache_cmd("clear", "--cache-dir", cache).returncode == 0

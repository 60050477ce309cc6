"""``shardfs pack`` end to end: pack to a local folder and to a moto S3 server, mount the
result with real FUSE, and compare what torchvision sees with the source tree."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import tarfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.datagen import (
    DEFAULT_CLASS_SIZES,
    make_imagefolder,
    relative_files,
    sha256_tree,
)
from support.mounts import imagefolder_view, mount, new_bucket, shard_keys, umount
from support.processes import run_shardfs, stop_process
from support.s3 import S3Server

from shardfs.index.db import SIDECAR_NAME

pytestmark = pytest.mark.integration

# Uneven classes, non-ASCII and long names; 4 KB images keep every pack fast.
CLASS_SIZES = {**DEFAULT_CLASS_SIZES, "zebra": 9}
FORMATS = ["tree", "webdataset"]
SIZINGS = {
    "count1": ["--max-count", "1"],
    "count5": ["--max-count", "5"],
    "size20K": ["--shard-size", "20K"],
    "default": [],
}
SEEDS = {"sorted": [], "seed7": ["--shuffle-seed", "7"]}


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("pack") / "src"
    make_imagefolder(src, CLASS_SIZES)
    return src


@pytest.fixture(scope="module")
def expected(source: Path) -> tuple[Any, dict[str, str]]:
    return imagefolder_view(source), sha256_tree(source)


@pytest.fixture
def env(s3_server: S3Server) -> dict[str, str]:
    return s3_server.env()


def pack(src: Path, dest: str, *extra: str, env: dict[str, str] | None = None) -> str:
    result = run_shardfs("pack", src, dest, *extra, env=env)
    assert result.returncode == 0, f"pack failed ({result.returncode}): {result.stderr}"
    return result.stdout


def tar_members(data_or_path: Path) -> list[str]:
    """Every file member, reading every byte (so a truncated shard fails here)."""
    names = []
    with tarfile.open(data_or_path, encoding="utf-8") as tar:
        for member in tar:
            if member.isfile():
                handle = tar.extractfile(member)
                assert handle is not None
                assert len(handle.read()) == member.size
                names.append(member.name)
    return names


# -- 1. every format x sizing x seed mounts back to the same ImageFolder ---------------------


def check_mount(
    source_url: str,
    mountpoint: Path,
    cache_dir: Path,
    expected: tuple[Any, dict[str, str]],
    fmt: str,
    env: dict[str, str],
) -> str:
    result = mount(source_url, mountpoint, cache_dir, env=env)
    try:
        layout = "imagefolder" if fmt == "webdataset" else "raw"
        assert f"{layout} layout" in result.stdout, result.stdout
        assert imagefolder_view(mountpoint) == expected[0]
        assert sha256_tree(mountpoint) == expected[1]
    finally:
        umount(mountpoint)
    return result.stdout


@pytest.mark.parametrize("seed", list(SEEDS))
@pytest.mark.parametrize("sizing", list(SIZINGS))
@pytest.mark.parametrize("fmt", FORMATS)
def test_pack_to_a_local_folder_mounts_back_identical(
    fmt: str,
    sizing: str,
    seed: str,
    source: Path,
    expected: tuple[Any, dict[str, str]],
    mountpoint: Path,
    tmp_path: Path,
) -> None:
    dest = tmp_path / "dest"
    pack(source, str(dest), "--format", fmt, *SIZINGS[sizing], *SEEDS[seed])
    check_mount(str(dest), mountpoint, tmp_path / "cache", expected, fmt, env={})


@pytest.mark.parametrize("seed", list(SEEDS))
@pytest.mark.parametrize("sizing", list(SIZINGS))
@pytest.mark.parametrize("fmt", FORMATS)
def test_pack_to_s3_mounts_back_identical_without_reading_a_shard(
    fmt: str,
    sizing: str,
    seed: str,
    source: Path,
    expected: tuple[Any, dict[str, str]],
    s3_server: S3Server,
    env: dict[str, str],
    mountpoint: Path,
    tmp_path: Path,
) -> None:
    bucket = new_bucket(s3_server, f"pack-{fmt}-{sizing}-{seed}")
    url = f"s3://{bucket}/train/"
    pack(source, url, "--format", fmt, *SIZINGS[sizing], *SEEDS[seed], env=env)
    s3_server.reset_counts()
    result = mount(url, mountpoint, tmp_path / "fresh-cache", env=env)
    try:
        # The sidecar written by pack is the index: the first mount reads no shard.
        read = shard_keys(s3_server.counts(), f"{bucket}/train/")
        assert read == {}, f"the first mount read shards: {read}"
        layout = "imagefolder" if fmt == "webdataset" else "raw"
        assert f"{layout} layout" in result.stdout, result.stdout
        assert imagefolder_view(mountpoint) == expected[0]
        assert sha256_tree(mountpoint) == expected[1]
    finally:
        umount(mountpoint)
    verified = run_shardfs("verify", source, url, "--cache-dir", tmp_path / "verify", env=env)
    assert verified.returncode == 0, verified.stderr


def test_seeded_shards_mix_classes_and_sorted_shards_do_not(source: Path, tmp_path: Path) -> None:
    def classes_per_shard(*extra: str) -> list[int]:
        dest = tmp_path / "-".join(extra or ("sorted",))
        pack(source, str(dest), "--max-count", "4", *extra)
        shards = sorted(dest.glob("*.tar"))
        return [len({n.split("/")[0] for n in tar_members(s)}) for s in shards]

    mixed = classes_per_shard("--shuffle-seed", "7")
    assert sum(n > 1 for n in mixed) > len(mixed) / 2, mixed
    plain = classes_per_shard()
    assert sum(n > 1 for n in plain) <= len(CLASS_SIZES) - 1, plain


def test_any_tree_packs_and_mounts_raw(tmp_path: Path, mountpoint: Path) -> None:
    src = tmp_path / "src"
    (src / "a" / "b").mkdir(parents=True)
    (src / "notes.txt").write_text("not an image\n")
    (src / "a" / "b" / "c.bin").write_bytes(random.Random(1).randbytes(30_000))
    (src / "a" / "d.tar.gz").write_bytes(b"\x1f\x8b")
    dest = tmp_path / "dest"
    pack(src, str(dest), "--max-count", "2", "--verify")
    mount(str(dest), mountpoint, tmp_path / "cache", env={})
    try:
        assert sha256_tree(mountpoint) == sha256_tree(src)
        assert sorted(os.listdir(mountpoint)) == ["a", "notes.txt"]
    finally:
        umount(mountpoint)


# -- 2. a pack killed with SIGKILL resumes into a clean dataset -------------------------------

BIG_CLASSES = {"ant": 110, "bee": 95, "cow": 95}  # 300 files
BIG_FILE = 200_000
BIG_MAX_COUNT = 4
BIG_SHARDS = 75


@pytest.fixture(scope="module")
def big_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("big") / "src"
    rng = random.Random(3)
    for name, count in BIG_CLASSES.items():
        (src / name).mkdir(parents=True)
        for i in range(count):
            (src / name / f"{name}_{i:04d}.jpg").write_bytes(rng.randbytes(BIG_FILE))
    return src


def kill_mid_pack(
    src: Path, dest: str, list_names: Callable[[], list[str]], env: dict[str, str]
) -> list[str]:
    """Start a pack, SIGKILL it once some but not all shards exist; return what was there."""
    command = ["pack", src, dest, "--max-count", str(BIG_MAX_COUNT), "--workers", "1"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardfs", *map(str, command)],
        env={**os.environ, **env},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            names = list_names()
            if any(n.endswith(".tar") for n in names):
                proc.send_signal(signal.SIGKILL)
                break
            assert proc.poll() is None, f"pack finished before it was killed: {proc.stderr}"
            assert time.monotonic() < deadline, "no shard appeared"
            time.sleep(0.001)
        proc.wait(30)
    finally:
        stop_process(proc)
    assert proc.returncode == -signal.SIGKILL
    names = list_names()
    shards = [n for n in names if n.endswith(".tar")]
    assert 1 <= len(shards) < BIG_SHARDS, f"killed too late: {len(shards)} shards"
    assert SIDECAR_NAME not in names
    return names


def check_shards(src: Path, shard_files: dict[str, Path]) -> None:
    """All planned shards, each a complete tar, every source file in exactly one."""
    assert sorted(shard_files) == [f"shard-{i:06d}.tar" for i in range(BIG_SHARDS)]
    members: Counter[str] = Counter()
    for path in shard_files.values():
        members.update(tar_members(path))
    assert [name for name, n in members.items() if n > 1] == []
    assert sorted(members) == relative_files(src)


def resume(src: Path, dest: str, env: dict[str, str]) -> None:
    out = pack(src, dest, "--max-count", str(BIG_MAX_COUNT), "--resume", env=env)
    assert "already there" in out, out


def test_sigkilled_local_pack_resumes_clean(big_source: Path, tmp_path: Path) -> None:
    dest = tmp_path / "dest"

    def list_names() -> list[str]:
        try:
            return os.listdir(dest)
        except FileNotFoundError:
            return []

    kill_mid_pack(big_source, str(dest), list_names, env={})
    resume(big_source, str(dest), env={})
    check_shards(big_source, {p.name: p for p in dest.glob("*.tar")})
    assert [n for n in os.listdir(dest) if ".tmp-" in n] == []
    verified = run_shardfs("verify", big_source, dest, "--cache-dir", tmp_path / "cache")
    assert verified.returncode == 0, verified.stderr
    assert verified.stdout.startswith("verified: 300 files")


def test_sigkilled_s3_pack_resumes_clean(
    big_source: Path, s3_server: S3Server, env: dict[str, str], tmp_path: Path
) -> None:
    bucket = new_bucket(s3_server, "resume")
    dest = f"s3://{bucket}/big"
    fs = s3_server.filesystem()

    def list_names() -> list[str]:
        fs.invalidate_cache()
        return [p.rsplit("/", 1)[1] for p in fs.find(f"{bucket}/big")]

    kill_mid_pack(big_source, dest, list_names, env=env)
    resume(big_source, dest, env=env)
    local = tmp_path / "downloaded"
    fs.invalidate_cache()
    fs.get(f"{bucket}/big/", str(local), recursive=True)
    check_shards(big_source, {p.name: p for p in local.glob("*.tar")})
    verified = run_shardfs("verify", big_source, dest, "--cache-dir", tmp_path / "c", env=env)
    assert verified.returncode == 0, verified.stderr


# -- 3. webdataset's own reader ---------------------------------------------------------------


def test_webdataset_reader_yields_every_sample_once(source: Path, tmp_path: Path) -> None:
    import webdataset

    dest = tmp_path / "dest"
    pack(source, str(dest), "--format", "webdataset", "--max-count", "5", "--shuffle-seed", "7")
    classes = (dest / "classes.txt").read_text(encoding="utf-8").splitlines()
    assert classes == sorted(CLASS_SIZES)
    urls = [str(p) for p in sorted(dest.glob("*.tar"))]
    seen: Counter[str] = Counter()
    for sample in webdataset.WebDataset(urls, shardshuffle=False):
        key = sample["__key__"]
        class_name = key.split("/")[0]
        assert int(sample["cls"]) == classes.index(class_name)
        rel = f"{key}.jpg"
        assert sample["jpg"] == (source / rel).read_bytes()
        seen[rel] += 1
    assert sorted(seen) == relative_files(source)
    assert set(seen.values()) == {1}


# -- 4. plain tars: GNU tar, Python tarfile, and a mount that ignores the sidecar -------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_shards_are_plain_tars_and_mount_without_the_sidecar(
    fmt: str,
    source: Path,
    expected: tuple[Any, dict[str, str]],
    mountpoint: Path,
    tmp_path: Path,
) -> None:
    dest = tmp_path / "dest"
    pack(source, str(dest), "--format", fmt, "--max-count", "6")
    for shard in sorted(dest.glob("*.tar")):
        listed = subprocess.run(
            ["tar", "-tf", str(shard)],
            env={**os.environ, "LC_ALL": "C.UTF-8"},
            capture_output=True,
            text=True,
            check=True,
        )
        with tarfile.open(shard, encoding="utf-8") as tar:
            names = tar.getnames()
        assert [n.rstrip("/") for n in listed.stdout.splitlines()] == names
        tar_members(shard)
    (dest / SIDECAR_NAME).write_bytes(b"garbage that no mount may read")  # must be ignored
    result = mount(str(dest), mountpoint, tmp_path / "cache", "--no-sidecar", env={})
    try:
        assert imagefolder_view(mountpoint) == expected[0]
        assert sha256_tree(mountpoint) == expected[1]
    finally:
        umount(mountpoint)
    assert "layout" in result.stdout

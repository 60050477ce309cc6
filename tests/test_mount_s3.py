"""Real FUSE mounts through the CLI over a moto S3 server, read by real torchvision.

Each test mounts with ``shardfs mount`` (which returns once the tree is ready) and
compares what torchvision sees through the mount with the tree the shards were made from.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import tarfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from support.datagen import (
    DEFAULT_CLASS_SIZES,
    make_imagefolder,
    noise_jpeg,
    pack_with_gnu_tar,
    pack_with_webdataset,
    relative_files,
    sha256_tree,
    split_sizes,
)
from support.mounts import imagefolder_view, mount, new_bucket, shard_keys, umount
from support.processes import run_shardfs
from support.s3 import S3Server

pytestmark = pytest.mark.integration


@dataclass(frozen=True)
class Dataset:
    """A source tree, its shards on disk, and where they were uploaded."""

    src: Path
    shard_dir: Path
    shards: list[Path]
    bucket: str
    prefix: str

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}/"

    @property
    def key_prefix(self) -> str:
        return f"{self.bucket}/{self.prefix}/"


def make_keyed_imagefolder(root: Path, class_sizes: dict[str, int], *, seed: int = 0) -> None:
    """An ImageFolder tree whose file stems are valid, unique webdataset keys."""
    make_imagefolder(root, class_sizes, seed=seed, long_names=False)
    for path in list(root.rglob("*.jpg")):
        path.rename(path.with_name(f"{path.parent.name}_{path.name}"))


def walk_files(root: Path) -> list[str]:
    """Every file under ``root`` as listed by readdir, duplicates kept, sorted."""
    found = []
    for folder, _dirs, files in os.walk(root):
        found += [(Path(folder) / name).relative_to(root).as_posix() for name in files]
    return sorted(found)


def shard_members(shard: Path) -> list[str]:
    with tarfile.open(shard, encoding="utf-8") as tar:
        return [m.name for m in tar.getmembers() if m.isfile()]


def upload(server: S3Server, directory: Path, bucket: str, prefix: str) -> None:
    server.upload_dir(directory, f"{bucket}/{prefix}")


@pytest.fixture(scope="module")
def gnu_dataset(s3_server: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Dataset:
    """19 images (long and non-ASCII names) in 5 uneven GNU tar (pax) shards."""
    base = tmp_path_factory.mktemp("gnu")
    src = base / "src"
    make_imagefolder(src, DEFAULT_CLASS_SIZES)
    shards = pack_with_gnu_tar(src, base / "shards", files_per_shard=[3, 7, 5])
    bucket = new_bucket(s3_server, "gnu")
    upload(s3_server, base / "shards", bucket, "imagenet/train")
    return Dataset(src, base / "shards", shards, bucket, "imagenet/train")


@pytest.fixture
def env(s3_server: S3Server) -> dict[str, str]:
    return s3_server.env()


# -- 1. GNU tar shards read by torchvision's ImageFolder ------------------------------------


@pytest.mark.parametrize("how", ["prefix", "brace-pattern", "endpoint-flag"])
def test_gnu_tar_shards_equal_the_original_imagefolder(
    how: str,
    gnu_dataset: Dataset,
    s3_server: S3Server,
    env: dict[str, str],
    mountpoint: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    source = gnu_dataset.url
    extra: list[str] = []
    if how == "brace-pattern":
        last = len(gnu_dataset.shards) - 1
        source = f"{gnu_dataset.url}shard-{{000000..{last:06d}}}.tar"
    elif how == "endpoint-flag":
        for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
            env.pop(name, None)
            monkeypatch.delenv(name, raising=False)
        extra = ["--endpoint-url", s3_server.endpoint]

    result = mount(source, mountpoint, tmp_path / "cache", *extra, env=env)

    files = relative_files(gnu_dataset.src)
    assert f"({len(files)} files, raw layout)" in result.stdout
    assert imagefolder_view(mountpoint) == imagefolder_view(gnu_dataset.src)
    assert sha256_tree(mountpoint) == sha256_tree(gnu_dataset.src)
    umount(mountpoint)


def test_brace_pattern_mounts_only_the_named_shards(
    gnu_dataset: Dataset, env: dict[str, str], mountpoint: Path, tmp_path: Path
) -> None:
    mount(f"{gnu_dataset.url}shard-{{000001..000002}}.tar", mountpoint, tmp_path / "c", env=env)
    expected = sorted(shard_members(gnu_dataset.shards[1]) + shard_members(gnu_dataset.shards[2]))
    assert walk_files(mountpoint) == expected
    umount(mountpoint)


# -- 2. webdataset shards presented as an ImageFolder ----------------------------------------

WDS_CLASS_SIZES = {"cat": 5, "dog": 4, "ελάφι": 3, "sea lion": 3}


@pytest.fixture(scope="module")
def wds_dataset(s3_server: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Dataset:
    """15 samples written by webdataset's ShardWriter (4 per shard) with classes.txt."""
    base = tmp_path_factory.mktemp("wds")
    src = base / "src"
    make_keyed_imagefolder(src, WDS_CLASS_SIZES)
    shards, classes = pack_with_webdataset(src, base / "shards", maxcount=4, key="stem")
    assert classes == sorted(WDS_CLASS_SIZES)
    assert len(shards) == 4
    bucket = new_bucket(s3_server, "wds")
    upload(s3_server, base / "shards", bucket, "wds")
    # The same shards beside a classes.txt that names the labels in the wrong order.
    decoy = base / "decoy"
    shutil.copytree(base / "shards", decoy)
    (decoy / "classes.txt").write_text("\n".join(reversed(classes)) + "\n", encoding="utf-8")
    upload(s3_server, decoy, bucket, "decoy")
    return Dataset(src, base / "shards", shards, bucket, "wds")


@pytest.mark.parametrize(
    ("layout", "classes_from"),
    [("imagefolder", "classes.txt"), ("auto", "classes.txt"), ("imagefolder", "--classes")],
)
def test_webdataset_shards_equal_the_tree_they_were_written_from(
    layout: str,
    classes_from: str,
    wds_dataset: Dataset,
    env: dict[str, str],
    mountpoint: Path,
    tmp_path: Path,
) -> None:
    source = wds_dataset.url
    extra = ["--layout", layout]
    if classes_from == "--classes":
        # The decoy classes.txt next to these shards must lose to --classes.
        source = f"s3://{wds_dataset.bucket}/decoy/"
        extra += ["--classes", wds_dataset.shard_dir / "classes.txt"]

    result = mount(source, mountpoint, tmp_path / "cache", *extra, env=env)

    assert "imagefolder layout" in result.stdout
    assert imagefolder_view(mountpoint) == imagefolder_view(wds_dataset.src)
    assert sha256_tree(mountpoint) == sha256_tree(wds_dataset.src)
    umount(mountpoint)


@pytest.mark.parametrize("n_classes", [3, 12])
def test_webdataset_without_classes_file_uses_zero_padded_labels(
    n_classes: int,
    s3_server: S3Server,
    env: dict[str, str],
    mountpoint: Path,
    tmp_path: Path,
) -> None:
    width = len(str(n_classes - 1))
    names = [f"{label:0{width}d}" for label in range(n_classes)]
    src = tmp_path / "src"
    make_keyed_imagefolder(src, {name: 1 + label % 2 for label, name in enumerate(names)})
    pack_with_webdataset(src, tmp_path / "shards", maxcount=5, key="stem", classes_file=False)
    bucket = new_bucket(s3_server, "padded")
    upload(s3_server, tmp_path / "shards", bucket, "p")

    mount(f"s3://{bucket}/p/", mountpoint, tmp_path / "cache", env=env)

    classes, class_to_idx, samples = imagefolder_view(mountpoint)
    assert classes == names
    assert class_to_idx == {name: int(name) for name in names}
    assert (classes, class_to_idx, samples) == imagefolder_view(src)
    assert sha256_tree(mountpoint) == sha256_tree(src)
    umount(mountpoint)


# -- 3. a DataLoader with worker processes reads every file ----------------------------------


def read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def as_list(batch: list[Any]) -> list[Any]:
    return batch


def test_dataloader_with_workers_reads_every_file(
    gnu_dataset: Dataset, env: dict[str, str], mountpoint: Path, tmp_path: Path
) -> None:
    from torch.utils.data import DataLoader
    from torchvision.datasets import ImageFolder

    mount(gnu_dataset.url, mountpoint, tmp_path / "cache", env=env)
    original = ImageFolder(str(gnu_dataset.src), loader=read_bytes)
    expected = Counter((read_bytes(path), target) for path, target in original.samples)

    dataset = ImageFolder(str(mountpoint), loader=read_bytes)
    loader = DataLoader(
        dataset, batch_size=4, shuffle=True, num_workers=2, collate_fn=as_list, timeout=60
    )
    seen: Counter[tuple[bytes, int]] = Counter()
    for batch in loader:
        seen.update((data, target) for data, target in batch)

    assert sum(seen.values()) == len(original.samples)
    assert seen == expected
    umount(mountpoint)


# -- 4. nothing dropped or duplicated, whatever the samples per shard -----------------------

SPLIT_CLASS_SIZES = {"a": 6, "b": 4, "c": 3}  # 13 files


@pytest.fixture(scope="module")
def split_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("split") / "src"
    make_keyed_imagefolder(src, SPLIT_CLASS_SIZES, seed=4)
    return src


@pytest.mark.parametrize(
    ("packer", "split"),
    [
        ("gnu", [1]),
        ("gnu", [1, 2, 3]),
        ("gnu", [7]),
        ("gnu", [13]),
        ("webdataset", [1]),
        ("webdataset", [3]),
        ("webdataset", [13]),
    ],
    ids=lambda value: "-".join(map(str, value)) if isinstance(value, list) else value,
)
def test_no_sample_dropped_or_duplicated(
    packer: str,
    split: Sequence[int],
    split_src: Path,
    s3_server: S3Server,
    env: dict[str, str],
    mountpoint: Path,
    tmp_path: Path,
) -> None:
    if packer == "gnu":
        shards = pack_with_gnu_tar(split_src, tmp_path / "shards", files_per_shard=split)
    else:
        shards, _ = pack_with_webdataset(
            split_src, tmp_path / "shards", maxcount=split[0], key="stem"
        )
    total = sum(SPLIT_CLASS_SIZES.values())
    assert len(shards) == len(split_sizes(total, split))
    bucket = new_bucket(s3_server, "split")
    upload(s3_server, tmp_path / "shards", bucket, "s")

    result = mount(f"s3://{bucket}/s/", mountpoint, tmp_path / "cache", env=env)

    assert f"({total} files," in result.stdout
    assert walk_files(mountpoint) == relative_files(split_src)
    assert sha256_tree(mountpoint) == sha256_tree(split_src)
    umount(mountpoint)


# -- 5. the persisted index, the sidecar, and changed shards ---------------------------------


def test_remount_from_persisted_index_reads_no_shard(
    gnu_dataset: Dataset,
    s3_server: S3Server,
    env: dict[str, str],
    mountpoint: Path,
    tmp_path: Path,
) -> None:
    cache = tmp_path / "cache"
    s3_server.reset_counts()
    mount(gnu_dataset.url, mountpoint, cache, env=env)
    first = shard_keys(s3_server.counts(), gnu_dataset.key_prefix)
    # The first mount scanned every shard: the counter sees shard reads.
    assert len(first) == len(gnu_dataset.shards)
    assert all(n > 0 for n in first.values())
    umount(mountpoint)

    s3_server.reset_counts()
    mount(gnu_dataset.url, mountpoint, cache, env=env)
    assert shard_keys(s3_server.counts(), gnu_dataset.key_prefix) == {}
    assert sha256_tree(mountpoint) == sha256_tree(gnu_dataset.src)
    umount(mountpoint)


def copy_dataset(server: S3Server, dataset: Dataset, stem: str) -> Dataset:
    """The dataset's shards in a fresh bucket, for tests that write next to them."""
    bucket = new_bucket(server, stem)
    upload(server, dataset.shard_dir, bucket, "data")
    return Dataset(dataset.src, dataset.shard_dir, dataset.shards, bucket, "data")


def test_sidecar_lets_a_fresh_cache_mount_without_reading_shards(
    gnu_dataset: Dataset,
    s3_server: S3Server,
    env: dict[str, str],
    mountpoint: Path,
    tmp_path: Path,
) -> None:
    dataset = copy_dataset(s3_server, gnu_dataset, "sidecar")
    result = run_shardfs(
        "index", dataset.url, "--write-sidecar", "--cache-dir", tmp_path / "indexer", env=env
    )
    assert result.returncode == 0, result.stderr
    sidecar = f"{dataset.key_prefix}.shardfs-index.sqlite"
    assert s3_server.filesystem().exists(sidecar)

    s3_server.reset_counts()
    mount(dataset.url, mountpoint, tmp_path / "fresh-cache", env=env)
    counts = s3_server.counts()
    assert shard_keys(counts, dataset.key_prefix) == {}
    assert counts["get_object_bytes_by_key"].get(sidecar, 0) > 0
    assert sha256_tree(mountpoint) == sha256_tree(dataset.src)
    umount(mountpoint)


def test_changed_shard_is_rescanned_and_served_with_new_bytes(
    gnu_dataset: Dataset,
    s3_server: S3Server,
    env: dict[str, str],
    mountpoint: Path,
    tmp_path: Path,
) -> None:
    dataset = copy_dataset(s3_server, gnu_dataset, "changed")
    cache = tmp_path / "cache"
    mount(dataset.url, mountpoint, cache, env=env)
    umount(mountpoint)

    # Give one file of shard 1 new bytes, repack with the same split, re-upload shard 1 only.
    changed_src = tmp_path / "changed-src"
    shutil.copytree(dataset.src, changed_src)
    victim = shard_members(dataset.shards[1])[-1]
    new_bytes = noise_jpeg(random.Random("changed"))
    (changed_src / victim).write_bytes(new_bytes)
    repacked = pack_with_gnu_tar(changed_src, tmp_path / "repacked", files_per_shard=[3, 7, 5])
    changed_key = f"{dataset.key_prefix}{repacked[1].name}"
    s3_server.filesystem().put_file(str(repacked[1]), changed_key)

    s3_server.reset_counts()
    mount(dataset.url, mountpoint, cache, env=env)
    assert set(shard_keys(s3_server.counts(), dataset.key_prefix)) == {changed_key}
    assert (mountpoint / victim).read_bytes() == new_bytes
    assert sha256_tree(mountpoint) == sha256_tree(changed_src)
    assert hashlib.sha256(new_bytes).hexdigest() != sha256_tree(dataset.src)[victim]
    umount(mountpoint)

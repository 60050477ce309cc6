"""The test infrastructure itself: if these fail, other failures mean little."""

from __future__ import annotations

import hashlib
import io
import tarfile
import threading
from pathlib import Path

import pytest
import support.processes
import webdataset
from PIL import Image
from support.datagen import (
    DEFAULT_CLASS_SIZES,
    make_imagefolder,
    pack_with_gnu_tar,
    pack_with_webdataset,
    relative_files,
    sha256_tree,
    split_sizes,
)
from support.processes import is_mounted
from support.s3 import S3Server, repeats

# -- moto server and its counters ---------------------------------------------


def _counters(server: S3Server) -> tuple[int, int, int]:
    c = server.counts()
    return c["get_object_requests"], c["get_object_bytes"], c["list_requests"]


def test_ranged_get_counts_only_bytes_sent(s3_server: S3Server) -> None:
    s3_server.create_bucket("support-ranged")
    fs = s3_server.filesystem()
    payload = bytes(range(256)) * 39 + bytes(16)
    assert len(payload) == 10000
    fs.pipe_file("support-ranged/dir/blob.bin", payload)

    s3_server.reset_counts()
    data = fs.cat_file("support-ranged/dir/blob.bin", start=2000, end=3000)
    assert data == payload[2000:3000]
    assert _counters(s3_server) == (1, 1000, 0)
    counts = s3_server.counts()
    assert counts["requests"] == {"GET": 1}
    assert counts["bytes"] == {"GET": 1000}

    # A listing is a GET too, but not a GetObject.
    assert fs.ls("support-ranged/dir", detail=False) == ["support-ranged/dir/blob.bin"]
    get_requests, get_bytes, lists = _counters(s3_server)
    assert (get_requests, get_bytes, lists) == (1, 1000, 1)
    assert s3_server.counts()["requests"]["GET"] == 2

    assert fs.cat_file("support-ranged/dir/blob.bin") == payload
    assert _counters(s3_server) == (2, 11000, 1)
    counts = s3_server.counts()
    assert counts["get_object_requests_by_key"] == {"support-ranged/dir/blob.bin": 2}
    assert counts["get_object_bytes_by_key"] == {"support-ranged/dir/blob.bin": 11000}


def test_refetched_bytes_are_the_offsets_sent_twice(s3_server: S3Server) -> None:
    s3_server.create_bucket("support-refetch")
    fs = s3_server.filesystem()
    fs.pipe_file("support-refetch/a", bytes(10_000))
    fs.pipe_file("support-refetch/b", bytes(10_000))
    s3_server.reset_counts()
    fs.cat_file("support-refetch/a", start=0, end=1000)
    fs.cat_file("support-refetch/a", start=1000, end=2000)  # touches, no overlap
    fs.cat_file("support-refetch/b", start=500, end=1500)  # another key: no overlap
    assert s3_server.counts()["get_object_refetched_bytes"] == 0
    fs.cat_file("support-refetch/a", start=1500, end=2500)  # 500 bytes again
    assert s3_server.counts()["get_object_refetched_bytes"] == 500
    sent = s3_server.ranges_sent()
    assert sent == [
        ["support-refetch/a", 0, 1000, 0],
        ["support-refetch/a", 1000, 2000, 0],
        ["support-refetch/b", 500, 1500, 0],
        ["support-refetch/a", 1500, 2500, 500],
    ]
    assert repeats(sent) == ["#3 support-refetch/a [1500, 2500): 500 again, of #1 [1000, 2000)"]
    fs.cat_file("support-refetch/a")  # the whole object: 2,500 of its bytes again
    assert s3_server.counts()["get_object_refetched_bytes"] == 3000
    s3_server.reset_counts()
    fs.cat_file("support-refetch/a", start=0, end=100)
    assert s3_server.counts()["get_object_refetched_bytes"] == 0


@pytest.mark.parametrize(
    ("runs", "expected"),
    [
        ([(0, 10), (20, 30), (5, 25)], 10),  # spans the hole between two runs
        ([(0, 10), (10, 20), (0, 20)], 20),  # touching runs merged, then covered
        ([(50, 60), (0, 10), (100, 110), (0, 200)], 30),
        ([(0, 10), (30, 40), (15, 20), (12, 28)], 5),
    ],
)
def test_counters_refetched_overlap(runs: list[tuple[int, int]], expected: int) -> None:
    from support.moto_counting import Counters

    counters = Counters()
    for start, end in runs:
        counters.add_bytes("GET", "get_object", end - start, "k", start)
    counters.add_bytes("GET", "get_object", 1000, "k", None)  # offset unknown: unchecked
    assert counters.snapshot()["get_object_refetched_bytes"] == expected


def test_body_offset_reads_status_and_content_range() -> None:
    from support.moto_counting import body_offset

    assert body_offset("200 OK", []) == 0
    assert body_offset("206 Partial Content", [("Content-Range", "bytes 42-99/1000")]) == 42
    assert body_offset("206 Partial Content", []) is None
    assert body_offset("404 Not Found", [("Content-Range", "bytes 1-2/3")]) is None


def test_presigned_get_is_counted_as_get_object(s3_server: S3Server) -> None:
    import urllib.request

    import boto3

    s3_server.create_bucket("support-presigned")
    s3_server.filesystem().pipe_file("support-presigned/a.tar", b"x" * 5000)
    client = boto3.client("s3", **_boto_kwargs(s3_server))
    url = client.generate_presigned_url(
        "get_object", Params={"Bucket": "support-presigned", "Key": "a.tar"}, ExpiresIn=600
    )
    s3_server.reset_counts()
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=10) as response:
        assert response.read() == b"x" * 5000
    counts = s3_server.counts()
    assert counts["get_object_bytes_by_key"] == {"support-presigned/a.tar": 5000}


def _boto_kwargs(server: S3Server) -> dict[str, str]:
    from support.s3 import ACCESS_KEY, REGION, SECRET_KEY

    return {
        "endpoint_url": server.endpoint,
        "region_name": REGION,
        "aws_access_key_id": ACCESS_KEY,
        "aws_secret_access_key": SECRET_KEY,
    }


def test_control_endpoint_is_not_counted_and_reset_zeroes(s3_server: S3Server) -> None:
    s3_server.create_bucket("support-reset")
    fs = s3_server.filesystem()
    fs.pipe_file("support-reset/k", b"x" * 10)
    assert s3_server.counts()["requests"]
    s3_server.reset_counts()
    zero = {
        "requests": {},
        "bytes": {},
        "get_object_requests": 0,
        "get_object_bytes": 0,
        "list_requests": 0,
        "get_object_requests_by_key": {},
        "get_object_bytes_by_key": {},
        "get_object_refetched_bytes": 0,
    }
    assert s3_server.counts() == zero
    assert s3_server.counts() == zero


def test_concurrent_ranged_gets_are_all_counted(s3_server: S3Server) -> None:
    s3_server.create_bucket("support-concurrent")
    fs = s3_server.filesystem()
    payload = bytes(range(256)) * 400
    fs.pipe_file("support-concurrent/blob", payload)
    s3_server.reset_counts()

    threads_n, reads_each, length = 8, 10, 777
    errors: list[BaseException] = []

    def reader(worker: int) -> None:
        local_fs = s3_server.filesystem()
        try:
            for i in range(reads_each):
                start = (worker * 1000 + i * 97) % (len(payload) - length)
                got = local_fs.cat_file("support-concurrent/blob", start=start, end=start + length)
                assert got == payload[start : start + length]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=reader, args=(w,)) for w in range(threads_n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    total = threads_n * reads_each
    assert _counters(s3_server) == (total, total * length, 0)


def test_upload_dir_uploads_every_file(s3_server: S3Server, tmp_path: Path) -> None:
    root = tmp_path / "tree"
    make_imagefolder(root, {"a": 2, "ελάφι": 3}, image_bytes=500)
    s3_server.create_bucket("support-upload")
    keys = s3_server.upload_dir(root, "support-upload/pre/fix/")
    expected = sha256_tree(root)
    assert sorted(keys) == sorted(f"support-upload/pre/fix/{rel}" for rel in expected)
    fs = s3_server.filesystem()
    for rel, digest in expected.items():
        data = fs.cat_file(f"support-upload/pre/fix/{rel}")
        assert hashlib.sha256(data).hexdigest() == digest


def test_env_points_clients_at_the_server(s3_server: S3Server) -> None:
    env = s3_server.env()
    assert env["AWS_ENDPOINT_URL"] == s3_server.endpoint
    assert env["AWS_ACCESS_KEY_ID"] == env["AWS_SECRET_ACCESS_KEY"] == "testing"
    assert env["AWS_DEFAULT_REGION"] == "us-east-1"
    assert env["AWS_EC2_METADATA_DISABLED"] == "true"


@pytest.mark.s3  # starts its own server, so no fixture marks it
def test_server_stops_on_exit() -> None:
    with S3Server() as server:
        assert server.counts()["list_requests"] == 0
        proc = server._proc
        assert proc is not None
        assert server.pid == proc.pid  # what the bench pins to the store's core
    assert proc.poll() is not None
    assert server.pid is None
    with pytest.raises(OSError):
        server.counts()


# -- generated data ----------------------------------------------------------------


def test_make_imagefolder_is_deterministic_and_awkward(tmp_path: Path) -> None:
    files = make_imagefolder(tmp_path / "a", DEFAULT_CLASS_SIZES, seed=3, image_bytes=3000)
    make_imagefolder(tmp_path / "b", DEFAULT_CLASS_SIZES, seed=3, image_bytes=3000)
    make_imagefolder(tmp_path / "c", DEFAULT_CLASS_SIZES, seed=4, image_bytes=3000)
    assert files == sorted(files)
    assert len(files) == sum(DEFAULT_CLASS_SIZES.values())
    assert sha256_tree(tmp_path / "a") == sha256_tree(tmp_path / "b")
    assert sha256_tree(tmp_path / "a").keys() == sha256_tree(tmp_path / "c").keys()
    assert sha256_tree(tmp_path / "a") != sha256_tree(tmp_path / "c")

    rel = [f.relative_to(tmp_path / "a").as_posix() for f in files]
    assert any(len(Path(r).name.encode()) > 100 for r in rel)
    assert any(len(r.encode()) > 255 for r in rel)
    assert all(len(Path(r).name.encode()) <= 255 for r in rel)
    assert any(not r.isascii() for r in rel)
    assert any(" " in r for r in rel)
    assert any(not Path(r).parent.name.isascii() for r in rel)

    for f in files:
        assert 2000 <= f.stat().st_size <= 4000, f
        with Image.open(f) as image:
            assert image.format == "JPEG"
            image.load()


def test_make_imagefolder_short_names(tmp_path: Path) -> None:
    files = make_imagefolder(tmp_path, {"x": 6}, long_names=False)
    assert all(len(f.name.encode()) <= 100 for f in files)
    assert any(not f.name.isascii() for f in files)


def test_split_sizes() -> None:
    assert split_sizes(19, [3, 7, 5]) == [3, 7, 5, 3, 1]
    assert split_sizes(10, 4) == [4, 4, 2]
    assert split_sizes(0, 4) == []
    with pytest.raises(ValueError):
        split_sizes(3, [0])


def test_gnu_tar_shards_hold_every_file_once(tmp_path: Path) -> None:
    root = tmp_path / "tree"
    make_imagefolder(root, DEFAULT_CLASS_SIZES, image_bytes=1500)
    sizes = [3, 7, 5]
    shards = pack_with_gnu_tar(root, tmp_path / "shards", files_per_shard=sizes)
    expected = sha256_tree(root)
    expected_sizes = split_sizes(len(expected), sizes)
    assert len(set(expected_sizes)) > 1
    assert [s.name for s in shards] == [f"shard-{i:06d}.tar" for i in range(len(expected_sizes))]

    seen: dict[str, str] = {}
    long_with_pax_path = 0
    for shard, size in zip(shards, expected_sizes, strict=True):
        with tarfile.open(shard) as tf:
            members = tf.getmembers()
            files = [m for m in members if m.isfile()]
            assert len(files) == size
            dirs = {m.name for m in members if m.isdir()}
            for index, member in enumerate(members):
                if member.isdir():
                    continue
                parent = member.name.rsplit("/", 1)[0]
                # The class directory entry comes before its files.
                assert parent in dirs
                assert parent in {m.name for m in members[:index] if m.isdir()}
                assert member.name not in seen, f"{member.name} in two shards"
                data = tf.extractfile(member).read()  # type: ignore[union-attr]
                seen[member.name] = hashlib.sha256(data).hexdigest()
                if len(member.name.encode()) > 100:
                    assert member.pax_headers.get("path") == member.name
                    long_with_pax_path += 1
    assert seen == expected
    assert long_with_pax_path > 0
    assert any(len(name.encode()) > 255 for name in seen)


def test_webdataset_shards_read_back(tmp_path: Path) -> None:
    root = tmp_path / "tree"
    make_imagefolder(root, DEFAULT_CLASS_SIZES, image_bytes=1500)
    out = tmp_path / "wds"
    shards, classes = pack_with_webdataset(root, out, maxcount=6)
    assert classes == sorted(DEFAULT_CLASS_SIZES)
    lines = (out / "classes.txt").read_text(encoding="utf-8").splitlines()
    assert lines == classes
    total = sum(DEFAULT_CLASS_SIZES.values())
    assert len(shards) == -(-total // 6)

    # Every image by (label, content hash); each must come back exactly once.
    expected = sorted(
        (classes.index(rel.split("/")[0]), digest) for rel, digest in sha256_tree(root).items()
    )
    dataset = webdataset.WebDataset([str(s) for s in shards], shardshuffle=False)
    got = []
    keys = set()
    for sample in dataset:
        key = sample["__key__"]
        assert "." not in key and "/" not in key
        assert key not in keys
        keys.add(key)
        label = int(sample["cls"])
        assert key.startswith(f"{label:03d}_")
        with Image.open(io.BytesIO(sample["jpg"])) as image:
            assert image.format == "JPEG"
        got.append((label, hashlib.sha256(sample["jpg"]).hexdigest()))
    assert sorted(got) == expected


def test_relative_files_sorted(tmp_path: Path) -> None:
    make_imagefolder(tmp_path, {"b": 2, "a": 2})
    rel = relative_files(tmp_path)
    assert rel == sorted(rel)
    assert rel[0].startswith("a/")


# -- fixtures ------------------------------------------------------------------


def test_mountpoint_is_an_empty_unmounted_dir(mountpoint: Path) -> None:
    assert mountpoint.is_dir()
    assert not any(mountpoint.iterdir())
    assert not is_mounted(mountpoint)


def test_missing_fuse_fails_rather_than_skips(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(support.processes, "FUSERMOUNT", "fusermount3-not-installed")
    with pytest.raises(pytest.fail.Exception, match="fusermount3-not-installed"):
        support.processes.require_fuse()

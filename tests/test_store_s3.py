"""The store against the real moto S3 server over HTTP: ranged GETs through presigned URLs
carry the indexed ETag, so a shard replaced in the store is refused, never served."""

from __future__ import annotations

import random

import pytest
from support.mounts import new_bucket
from support.s3 import S3Server

from shardfs.config import SourceConfig
from shardfs.errors import ShardChangedError
from shardfs.store.remote import Store

pytestmark = pytest.mark.s3  # moto only: no FUSE mount


def test_ranged_reads_are_exact_and_refuse_a_replaced_shard(s3_server: S3Server) -> None:
    bucket = new_bucket(s3_server, "store")
    fs = s3_server.filesystem()
    data = random.Random(1).randbytes(300_000)
    fs.pipe_file(f"{bucket}/p/a.tar", data)
    store = Store(
        SourceConfig(
            f"s3://{bucket}/p",
            storage_options={"key": "testing", "secret": "testing"},
            endpoint_url=s3_server.endpoint,
        )
    )
    (shard,) = store.list_shards()
    s3_server.reset_counts()
    for start, end in [(0, 1), (0, 300_000), (1000, 70_000), (299_999, 300_000)]:
        assert store.read_range(shard, start, end, retries=1) == data[start:end]
    counts = s3_server.counts()
    assert counts["get_object_requests"] == 4
    assert counts["get_object_bytes"] == 1 + 300_000 + 69_000 + 1

    fs.pipe_file(f"{bucket}/p/a.tar", random.Random(2).randbytes(300_000))  # same size
    with pytest.raises(ShardChangedError):
        store.read_range(shard, 0, 1000, retries=1)


class _BrokenPool:
    """A presigned path that fails every request with an error that is not the store's
    (not a timeout, reset or bad answer: those are transient), so each request must go
    through s3fs."""

    def __init__(self) -> None:
        self.calls = 0

    def request(self, *args: object, **kwargs: object) -> object:
        self.calls += 1
        raise RuntimeError("the presigned path is broken")


def _store(s3_server: S3Server, bucket: str) -> Store:
    return Store(
        SourceConfig(
            f"s3://{bucket}/p",
            storage_options={"key": "testing", "secret": "testing"},
            endpoint_url=s3_server.endpoint,
        )
    )


def test_fallback_reads_are_checked_and_never_switch_the_fast_path_off(
    s3_server: S3Server,
) -> None:
    """Requests the presigned path cannot answer go through s3fs, which sends If-Match too:
    a replaced shard is refused on the fallback as well, and the fast path is tried again."""
    bucket = new_bucket(s3_server, "fallback")
    fs = s3_server.filesystem()
    data = random.Random(3).randbytes(200_000)
    fs.pipe_file(f"{bucket}/p/a.tar", data)
    store = _store(s3_server, bucket)
    (shard,) = store.list_shards()
    fast = store._presigned
    assert fast is not None
    broken = _BrokenPool()
    real_pool = fast._pool
    fast._pool = broken  # type: ignore[assignment]
    assert store.read_range(shard, 10, 50_000, retries=1) == data[10:50_000]
    assert broken.calls == 1
    assert store._presigned is fast

    fast._pool = real_pool
    assert store.read_range(shard, 0, 100, retries=1) == data[:100]

    fs.pipe_file(f"{bucket}/p/a.tar", random.Random(4).randbytes(200_000))  # same size
    fast._pool = broken  # type: ignore[assignment]
    with pytest.raises(ShardChangedError):
        store.read_range(shard, 0, 1000, retries=1)
    fast._pool = real_pool
    with pytest.raises(ShardChangedError):
        store.read_range(shard, 0, 1000, retries=1)


def test_scan_stream_reads_the_shard_in_checked_ranges(s3_server: S3Server) -> None:
    bucket = new_bucket(s3_server, "stream")
    fs = s3_server.filesystem()
    data = random.Random(5).randbytes(1_000_003)
    fs.pipe_file(f"{bucket}/p/a.tar", data)
    store = _store(s3_server, bucket)
    (shard,) = store.list_shards()
    s3_server.reset_counts()
    got = bytearray()
    with store.open_stream(shard, block_size=256 << 10) as stream:
        while chunk := stream.read(100_000):
            got += chunk
    assert bytes(got) == data
    counts = s3_server.counts()
    assert counts["get_object_requests"] == 4  # ceil(1_000_003 / 262_144)
    assert counts["get_object_bytes"] == len(data)

    fs.pipe_file(f"{bucket}/p/a.tar", random.Random(6).randbytes(1_000_003))
    with pytest.raises(ShardChangedError), store.open_stream(shard, 256 << 10) as stream:
        stream.read(-1)


def test_a_shard_gone_from_the_store_never_pauses_the_fast_path(s3_server: S3Server) -> None:
    """A 404 is the store's answer for both paths: it is not asked again through s3fs, and
    however many shards are gone, presigned GETs go on for the others."""
    bucket = new_bucket(s3_server, "gone")
    fs = s3_server.filesystem()
    data = random.Random(5).randbytes(50_000)
    for name in ("a.tar", "b.tar"):
        fs.pipe_file(f"{bucket}/p/{name}", data)
    store = _store(s3_server, bucket)
    gone, kept = store.list_shards()
    fs.rm(f"{bucket}/p/{gone.name}")
    s3_server.reset_counts()
    for _ in range(5):
        with pytest.raises(ShardChangedError):
            store.read_range(gone, 0, 100, retries=1)
    assert s3_server.counts()["get_object_requests"] == 5  # one GET each, no fallback
    assert store._fast_failures == 0
    fast = store._presigned
    assert fast is not None
    calls = []
    real_get = fast.get
    fast.get = lambda *args: calls.append(args) or real_get(*args)  # type: ignore[method-assign]
    assert store.read_range(kept, 0, 100, retries=1) == data[:100]
    assert len(calls) == 1  # still presigned


def test_a_programming_error_is_raised_at_once_not_retried(
    s3_server: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    bucket = new_bucket(s3_server, "bug")
    s3_server.filesystem().pipe_file(f"{bucket}/p/a.tar", b"x" * 1000)
    store = _store(s3_server, bucket)
    (shard,) = store.list_shards()
    calls = []

    def buggy(*args: object) -> bytes:
        calls.append(args)
        raise TypeError("unsupported operand")

    monkeypatch.setattr(store, "_get_pieces", buggy)
    with pytest.raises(TypeError):
        store.read_range(shard, 0, 10, retries=4)
    assert len(calls) == 1


def test_pieces_of_a_ranged_get_are_received_into_the_memory_given(s3_server: S3Server) -> None:
    """With ``land``, each piece of a 206 is a view of memory ``land`` gave, holding exactly
    the range's bytes; without it, plain bytes as before."""
    bucket = new_bucket(s3_server, "landing")
    data = random.Random(3).randbytes(250_000)
    s3_server.filesystem().pipe_file(f"{bucket}/p/a.tar", data)
    store = _store(s3_server, bucket)
    (shard,) = store.list_shards()
    given: list[memoryview] = []

    def land(length: int) -> memoryview:
        given.append(memoryview(bytearray(length + 7))[7:])  # not aligned on purpose
        return given[-1]

    got = store.fetch(shard, 1000, 221_000, 65_536, retries=1, land=land)
    assert [len(piece) for piece in got.pieces] == [65_536] * 3 + [23_392]
    assert all(piece.obj is view.obj for piece, view in zip(got.pieces, given, strict=True))
    assert b"".join(got.pieces) == data[1000:221_000]
    plain = store.fetch(shard, 1000, 221_000, 65_536, retries=1)
    assert all(isinstance(piece, bytes) for piece in plain.pieces)
    assert b"".join(plain.pieces) == data[1000:221_000]

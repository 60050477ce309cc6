"""The store against the real moto S3 server over HTTP: ranged GETs through presigned URLs
carry the indexed ETag, so a shard replaced in the store is refused, never served."""

from __future__ import annotations

import random

import pytest
from support.mounts import new_bucket
from support.s3 import S3Server

from shardfs.config import SourceConfig
from shardfs.errors import ShardChangedError
from shardfs.store import Store

pytestmark = pytest.mark.integration


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

"""The fault proxy itself: each fault does what it says, seen by urllib3, requests and s3fs.

These run against the real moto server behind the real proxy; what is asserted is what the
client received (status, headers, bytes, errors) and what the proxy counted.
"""

from __future__ import annotations

import json
import random
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import requests
import s3fs
import urllib3
from support.fault_proxy import FaultProxy, Rule, delete_object, other_version, replace_object
from support.s3 import REGION, S3Server

SIZE = 1 << 20
DATA = random.Random(7).randbytes(SIZE)


@pytest.fixture(scope="module")
def bucket(s3_server: S3Server) -> str:
    name = f"proxy-unit-{time.monotonic_ns() % 10**9}"
    s3_server.create_bucket(name)
    s3_server.filesystem().pipe_file(f"{name}/obj.bin", DATA)
    return name


@pytest.fixture
def proxy(s3_server: S3Server) -> Iterator[FaultProxy]:
    with FaultProxy(s3_server) as running:
        yield running


def via_proxy(server: S3Server, proxy: FaultProxy, **kwargs: Any) -> s3fs.S3FileSystem:
    client_kwargs = {"endpoint_url": proxy.endpoint, "region_name": REGION}
    return server.filesystem(client_kwargs=client_kwargs, **kwargs)


@pytest.fixture
def url(s3_server: S3Server, proxy: FaultProxy, bucket: str) -> str:
    """A presigned URL for the object, through the proxy (shardfs's fast path)."""
    return str(via_proxy(s3_server, proxy).url(f"{bucket}/obj.bin", expires=600))


def pool() -> urllib3.PoolManager:
    return urllib3.PoolManager(retries=False, timeout=10)


def get(url: str, start: int, end: int, **kwargs: Any) -> urllib3.BaseHTTPResponse:
    return pool().request("GET", url, headers={"Range": f"bytes={start}-{end - 1}"}, **kwargs)


def test_forwards_untouched_and_keeps_connections_alive(url: str, proxy: FaultProxy) -> None:
    manager = pool()
    for start in (0, 4096, SIZE - 100):
        response = manager.request("GET", url, headers={"Range": f"bytes={start}-{start + 99}"})
        assert response.status == 206
        assert response.data == DATA[start : start + 100]
    connections = manager.connection_from_url(url).num_connections
    assert connections == 1, "keep-alive: three GETs should share one connection"
    counts = proxy.counts()
    assert counts["requests_by_kind"] == {"fast": 3}
    assert counts["forwarded"] == 3 and counts["injected_total"] == 0


def test_classifies_s3fs_reads_by_phase(
    s3_server: S3Server, proxy: FaultProxy, bucket: str
) -> None:
    fs = via_proxy(s3_server, proxy)
    assert fs.cat_file(f"{bucket}/obj.bin", start=10, end=20) == DATA[10:20]
    proxy.set_phase("scan")
    with fs.open(f"{bucket}/obj.bin", "rb", block_size=SIZE, cache_type="readahead") as f:
        assert f.read() == DATA
    kinds = [entry["kind"] for entry in proxy.log() if entry["method"] == "GET"]
    assert kinds[0] == "fallback" and "scan" in kinds[1:]
    assert set(kinds) == {"fallback", "scan"}


@pytest.mark.parametrize("status", [500, 503, 429, 404, 403])
def test_status_fault_answers_then_lets_through(url: str, proxy: FaultProxy, status: int) -> None:
    proxy.add("status", status=status, times=2, key="obj.bin", on="fast")
    assert get(url, 0, 10).status == status
    assert get(url, 0, 10).status == status
    third = get(url, 0, 10)
    assert (third.status, third.data) == (206, DATA[:10])
    assert proxy.counts()["injected"] == {"status": 2}


def test_skip_key_and_kind_scope_a_rule(
    url: str, proxy: FaultProxy, s3_server: S3Server, bucket: str
) -> None:
    proxy.add("status", status=500, skip=1, times=1, on="fast")
    proxy.add("status", status=500, key="no-such-object")
    assert get(url, 0, 10).status == 206  # skipped
    fs = via_proxy(s3_server, proxy)
    assert fs.cat_file(f"{bucket}/obj.bin", start=0, end=10) == DATA[:10]  # fallback: no rule
    assert get(url, 0, 10).status == 500
    assert get(url, 0, 10).status == 206  # spent


def test_per_range_hits_each_range_once(url: str, proxy: FaultProxy) -> None:
    proxy.add("status", status=500, times=None, per_range=True)
    statuses = [get(url, start, start + 10).status for start in (0, 0, 100, 0, 100, 200)]
    assert statuses == [500, 206, 500, 206, 206, 500]


def test_probability_is_seeded(url: str, proxy: FaultProxy) -> None:
    def pattern() -> list[int]:
        rule_id = proxy.add("status", status=503, times=None, probability=0.5, seed=42)
        statuses = [get(url, 0, 1).status for _ in range(20)]
        proxy.remove(rule_id)
        return statuses

    first, second = pattern(), pattern()
    assert first == second
    assert 0 < first.count(503) < 20


def test_reset_breaks_the_connection_mid_body(url: str, proxy: FaultProxy) -> None:
    proxy.add("reset", fraction=0.5, times=2)
    with pytest.raises(urllib3.exceptions.ProtocolError):
        get(url, 0, SIZE)
    with pytest.raises(requests.exceptions.RequestException):
        requests.get(url, headers={"Range": f"bytes=0-{SIZE - 1}"}, timeout=10)
    assert proxy.counts()["injected"] == {"reset": 2}
    assert get(url, 0, 10).data == DATA[:10]  # spent: the next GET is whole again


def test_truncate_promises_more_than_it_sends(url: str, proxy: FaultProxy) -> None:
    proxy.add("truncate", fraction=0.25)
    host, port = url.split("/")[2].split(":")
    path = "/" + url.split("/", 3)[3]
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        head_lines = f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
        sock.sendall(f"{head_lines}Range: bytes=0-{SIZE - 1}\r\n\r\n".encode())
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    assert f"content-length: {SIZE}".encode() in head.lower()
    assert body == DATA[: SIZE // 4]
    proxy.add("truncate", fraction=0.25)
    with pytest.raises(urllib3.exceptions.ProtocolError):
        get(url, 0, SIZE)


def test_short_206_is_consistent_but_short(url: str, proxy: FaultProxy) -> None:
    proxy.add("short_206", fraction=0.5)
    response = get(url, 1000, 3000)
    assert response.status == 206
    assert response.data == DATA[1000:2000]
    assert response.headers["Content-Range"] == f"bytes 1000-1999/{SIZE}"


def test_long_206_is_consistent_but_long(url: str, proxy: FaultProxy) -> None:
    proxy.add("long_206", shift=500, times=2)
    response = get(url, 1000, 3000)
    assert (response.status, response.data) == (206, DATA[1000:3500])
    assert response.headers["Content-Range"] == f"bytes 1000-3499/{SIZE}"
    at_end = get(url, SIZE - 100, SIZE)  # cannot grow past the end: grows backwards
    assert at_end.data == DATA[SIZE - 600 :]
    assert at_end.headers["Content-Range"] == f"bytes {SIZE - 600}-{SIZE - 1}/{SIZE}"


def test_shifted_range_sends_other_bytes_and_says_so(url: str, proxy: FaultProxy) -> None:
    proxy.add("shifted_range", shift=4096, times=2)
    response = get(url, 0, 1000)
    assert response.data == DATA[4096:5096]
    assert response.headers["Content-Range"] == f"bytes 4096-5095/{SIZE}"
    at_end = get(url, SIZE - 1000, SIZE)
    assert at_end.data == DATA[SIZE - 5096 : SIZE - 4096]


def test_wrong_content_range_keeps_the_bytes(url: str, proxy: FaultProxy) -> None:
    proxy.add("wrong_content_range", shift=10)
    response = get(url, 0, 100)
    assert response.data == DATA[:100]
    assert response.headers["Content-Range"] == f"bytes 10-109/{SIZE}"


def test_etag_fault_changes_only_the_header(url: str, proxy: FaultProxy) -> None:
    honest = get(url, 0, 100).headers["ETag"]
    proxy.add("etag")
    response = get(url, 0, 100)
    assert response.data == DATA[:100]
    assert response.headers["ETag"] != honest


@pytest.mark.parametrize("where", ["headers", "body"])
def test_stall_delays_but_delivers(url: str, proxy: FaultProxy, where: str) -> None:
    proxy.add("stall", seconds=1.0, where=where)
    began = time.monotonic()
    response = pool().request(
        "GET", url, headers={"Range": f"bytes=0-{SIZE - 1}"}, preload_content=False
    )
    headers_at = time.monotonic() - began
    data = response.read()
    total = time.monotonic() - began
    assert data == DATA
    assert total >= 1.0
    if where == "headers":
        assert headers_at >= 1.0
    else:
        assert headers_at < 0.9


def test_blackhole_holds_until_removed(url: str, proxy: FaultProxy) -> None:
    rule_id = proxy.add("blackhole", times=None)
    with pytest.raises(urllib3.exceptions.ReadTimeoutError):
        get(url, 0, 10, timeout=0.5)
    outcome: list[BaseException | int] = []

    def waiting_client() -> None:
        try:
            outcome.append(get(url, 0, 10, timeout=30).status)
        except Exception as exc:
            outcome.append(exc)

    thread = threading.Thread(target=waiting_client)
    thread.start()
    deadline = time.monotonic() + 10
    while proxy.counts()["injected"].get("blackhole", 0) < 2:
        assert time.monotonic() < deadline, "the second request never reached the proxy"
        time.sleep(0.02)
    assert thread.is_alive(), "a black hole answered"
    began = time.monotonic()
    proxy.remove(rule_id)
    thread.join(10)
    assert not thread.is_alive() and time.monotonic() - began < 2
    assert isinstance(outcome[0], urllib3.exceptions.HTTPError)
    assert get(url, 0, 10).data == DATA[:10]


def test_s3fs_rides_out_transient_faults(
    s3_server: S3Server, proxy: FaultProxy, bucket: str
) -> None:
    proxy.add("status", status=503, times=2, on="fallback")
    proxy.add("reset", times=1, on="fallback")
    fs = via_proxy(s3_server, proxy)
    assert fs.cat_file(f"{bucket}/obj.bin", start=100, end=200_000) == DATA[100:200_000]
    assert proxy.counts()["injected"] == {"status": 2, "reset": 1}


def test_control_api_over_http(proxy: FaultProxy, url: str) -> None:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def call(method: str, path: str, payload: Any = None) -> Any:
        data = json.dumps(payload).encode() if payload is not None else None
        request = urllib.request.Request(proxy.endpoint + path, data=data, method=method)
        with opener.open(request, timeout=10) as response:
            return json.loads(response.read())

    ids = call("POST", "/_faults", {"fault": "status", "status": 500, "times": 1})["ids"]
    assert [rule["id"] for rule in call("GET", "/_faults")["rules"]] == ids
    assert get(url, 0, 10).status == 500
    log = call("GET", "/_faults/log")["log"]
    assert [(e["kind"], e["fault"], e["range"]) for e in log] == [("fast", "status", [0, 9])]
    assert call("POST", "/_faults/phase", {"phase": "scan"}) == {"phase": "scan"}
    assert call("GET", "/_faults/counts")["phase"] == "scan"
    assert call("DELETE", "/_faults") == {"removed": 1}
    assert call("POST", "/_faults/reset") == {"reset": True}
    assert call("GET", "/_faults/counts")["forwarded"] == 0
    with pytest.raises(urllib.error.HTTPError) as bad:
        call("POST", "/_faults", {"fault": "no-such-fault"})
    assert bad.value.code == 400


def test_rule_rejects_unknown_fields() -> None:
    with pytest.raises(ValueError):
        Rule(fault="status", on="fast,bogus")
    with pytest.raises(ValueError):
        Rule(fault="stall", where="never")


def test_store_helpers_replace_and_delete(s3_server: S3Server, bucket: str) -> None:
    fs = s3_server.filesystem()
    fs.pipe_file(f"{bucket}/victim.bin", b"abcdef")
    old = str(fs.info(f"{bucket}/victim.bin")["ETag"]).strip('"')
    new = replace_object(s3_server, f"{bucket}/victim.bin", other_version(b"abcdef", [(1, 3)]))
    assert new != old
    assert s3_server.filesystem().cat_file(f"{bucket}/victim.bin") == b"a\x9d\x9cdef"
    delete_object(s3_server, f"{bucket}/victim.bin")
    assert not s3_server.filesystem().exists(f"{bucket}/victim.bin")

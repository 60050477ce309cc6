"""The store: brace patterns, listing, ranged reads and error translation, on the memory
filesystem and local folders."""

from __future__ import annotations

import datetime
import os
import re
import time
from pathlib import Path
from typing import Any

import fsspec
import pytest
from support.tarbuild import memory_url, put, remove, store_with

from shardfs.config import SourceConfig
from shardfs.errors import (
    ShardChangedError,
    ShardfsError,
    SourceError,
    SourceNotFoundError,
    StoreReadError,
    UsageError,
)
from shardfs.store.client import translate_errors
from shardfs.store.presigned import PresignedRanges
from shardfs.store.remote import Store
from shardfs.store.responses import PreconditionFailed, TransientError, WrongLengthError
from shardfs.store.shards import ShardInfo
from shardfs.store.urls import expand_braces, shard_patterns

# --- brace patterns ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        ("s3://b/a.tar", ["s3://b/a.tar"]),
        ("t-{0..3}.tar", ["t-0.tar", "t-1.tar", "t-2.tar", "t-3.tar"]),
        ("t-{000..002}.tar", ["t-000.tar", "t-001.tar", "t-002.tar"]),
        ("t-{008..011}.tar", ["t-008.tar", "t-009.tar", "t-010.tar", "t-011.tar"]),
        ("t-{98..101}.tar", ["t-98.tar", "t-99.tar", "t-100.tar", "t-101.tar"]),
        ("t-{7..7}.tar", ["t-7.tar"]),
        ("{train,val}.tar", ["train.tar", "val.tar"]),
        ("{a,b}-{1..2}.tar", ["a-1.tar", "a-2.tar", "b-1.tar", "b-2.tar"]),
        (
            "s3://b/{x,y}/s-{00..01}.tar",
            ["s3://b/x/s-00.tar", "s3://b/x/s-01.tar", "s3://b/y/s-00.tar", "s3://b/y/s-01.tar"],
        ),
        ("x{a,{b,c}}y", ["xay", "xby", "xcy"]),
        ("{a,b{1..2}}", ["a", "b1", "b2"]),
    ],
)
def test_expand_braces(pattern: str, expected: list[str]) -> None:
    assert expand_braces(pattern) == expected


def test_expand_braces_large_range_keeps_padding() -> None:
    names = expand_braces("s3://b/train-{000000..000146}.tar")
    assert len(names) == 147
    assert names[0] == "s3://b/train-000000.tar"
    assert names[-1] == "s3://b/train-000146.tar"


def test_expand_braces_empty_range_is_usage_error() -> None:
    with pytest.raises(UsageError, match="empty brace range"):
        expand_braces("t-{5..3}.tar")


# --- listing ----------------------------------------------------------------------------------


def test_list_shards_recursive_sorted_only_tar() -> None:
    url = memory_url()
    for name, size in [
        ("b.tar", 30),
        ("a.tar", 10),
        ("sub/deeper/c.tar", 20),
        ("sub/a.tar", 5),
        ("notes.txt", 3),
        ("x.tar.xz", 4),
        ("tar", 1),
        (".shardfs-index.sqlite", 7),
    ]:
        put(url, name, b"x" * size)
    shards = Store(SourceConfig(url)).list_shards()
    assert [(s.name, s.size) for s in shards] == [
        ("a.tar", 10),
        ("b.tar", 30),
        ("sub/a.tar", 5),
        ("sub/deeper/c.tar", 20),
    ]
    assert all(s.etag for s in shards)


def test_list_shards_trailing_slash_and_local_folder(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "one.tar").write_bytes(b"1" * 11)
    (tmp_path / "sub" / "two.tar").write_bytes(b"2" * 22)
    (tmp_path / "readme.md").write_text("hi")
    for url in (str(tmp_path), str(tmp_path) + "/", f"file://{tmp_path}"):
        shards = Store(SourceConfig(url)).list_shards()
        assert [(s.name, s.size) for s in shards] == [("one.tar", 11), ("sub/two.tar", 22)]


def test_brace_pattern_lists_only_the_named_shards() -> None:
    url = memory_url()
    for i in range(4):
        put(url, f"train-{i:03d}.tar", b"t" * (i + 1))
    put(url, "val-000.tar", b"v")
    shards = Store(SourceConfig(url + "/train-{000..002}.tar")).list_shards()
    assert [s.name for s in shards] == ["train-000.tar", "train-001.tar", "train-002.tar"]


def test_brace_pattern_with_a_missing_shard_names_it() -> None:
    url = memory_url()
    for i in (0, 1, 3):
        put(url, f"train-{i:03d}.tar", b"t")
    store = Store(SourceConfig(url + "/train-{000..003}.tar"))
    with pytest.raises(SourceNotFoundError, match=r"1 of 4 shard\(s\).*first: train-002\.tar$"):
        store.list_shards()


def test_empty_prefix_is_source_not_found() -> None:
    with pytest.raises(SourceNotFoundError, match="no such folder or prefix"):
        Store(SourceConfig(memory_url())).list_shards()


def test_prefix_without_tars_is_source_not_found() -> None:
    url = memory_url()
    put(url, "a.txt", b"x")
    with pytest.raises(SourceNotFoundError, match=f"no {re.escape(shard_patterns())} shards"):
        Store(SourceConfig(url)).list_shards()


def test_missing_local_folder_is_source_not_found(tmp_path: Path) -> None:
    with pytest.raises(SourceNotFoundError) as info:
        Store(SourceConfig(str(tmp_path / "nope"))).list_shards()
    assert info.value.exit_code == 3


def test_unknown_protocol_is_usage_error() -> None:
    with pytest.raises(UsageError, match="nosuchproto://"):
        Store(SourceConfig("nosuchproto://bucket/x"))


def test_identity_is_stable_and_distinguishes_sources() -> None:
    url = memory_url()
    assert Store(SourceConfig(url)).identity == Store(SourceConfig(url)).identity
    assert Store(SourceConfig(url)).identity != Store(SourceConfig(url + "/other")).identity
    with_endpoint = Store(SourceConfig(url, endpoint_url="http://e"))
    assert with_endpoint.identity != Store(SourceConfig(url)).identity


# --- reads ------------------------------------------------------------------------------------

PAYLOAD = bytes(range(256)) * 40  # 10240 bytes, every offset distinguishable


def _one_shard() -> tuple[Store, ShardInfo]:
    store = store_with({"s.tar": PAYLOAD})
    (shard,) = store.list_shards()
    return store, shard


@pytest.mark.parametrize(("start", "end"), [(0, 10240), (0, 1), (100, 612), (10239, 10240)])
def test_read_range_exact_bytes(start: int, end: int) -> None:
    store, shard = _one_shard()
    assert store.read_range(shard, start, end) == PAYLOAD[start:end]


@pytest.mark.parametrize(("start", "end", "piece"), [(0, 10240, 4096), (100, 612, 512), (5, 6, 9)])
def test_read_pieces_are_the_range_in_order(start: int, end: int, piece: int) -> None:
    store, shard = _one_shard()
    pieces = store.read_pieces(shard, start, end, piece)
    assert b"".join(pieces) == PAYLOAD[start:end]
    assert all(len(p) == piece for p in pieces[:-1]) and 0 < len(pieces[-1]) <= piece


def test_read_range_on_shortened_object_is_shard_changed() -> None:
    store, shard = _one_shard()
    put(store.config.url, "s.tar", PAYLOAD[:5000])
    with pytest.raises(ShardChangedError, match=r"s\.tar") as info:
        store.read_range(shard, 4000, 6000)
    assert info.value.exit_code == 4


def test_read_range_on_deleted_object_is_shard_changed() -> None:
    store, shard = _one_shard()
    remove(store.config.url, "s.tar")
    with pytest.raises(ShardChangedError, match="gone"):
        store.read_range(shard, 0, 10)


def test_read_range_retries_then_succeeds(monkeypatch: pytest.MonkeyPatch) -> None:
    store, shard = _one_shard()
    monkeypatch.setattr(time, "sleep", lambda _s: None)
    real = store.fs.cat_file
    calls: list[tuple[int, int]] = []

    def flaky(path: str, start: int, end: int) -> bytes:
        calls.append((start, end))
        if len(calls) < 3:
            raise TimeoutError("slow down")
        return bytes(real(path, start=start, end=end))

    monkeypatch.setattr(store.fs, "cat_file", flaky)
    assert store.read_range(shard, 5, 9, retries=4) == PAYLOAD[5:9]
    assert calls == [(5, 9)] * 3


def test_read_range_gives_up_after_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    store, shard = _one_shard()
    monkeypatch.setattr(time, "sleep", lambda _s: None)
    calls = 0

    def broken(path: str, start: int, end: int) -> bytes:
        nonlocal calls
        calls += 1
        raise ConnectionError("connection reset by peer")

    monkeypatch.setattr(store.fs, "cat_file", broken)
    with pytest.raises(StoreReadError, match=r"s\.tar \[0:4\].*cannot connect"):
        store.read_range(shard, 0, 4, retries=3)
    assert calls == 3


def test_open_stream_reads_the_whole_shard() -> None:
    store, shard = _one_shard()
    with store.open_stream(shard, block_size=1000) as stream:
        chunks = []
        while chunk := stream.read(777):
            chunks.append(chunk)
    assert b"".join(chunks) == PAYLOAD


def test_read_object_missing_is_none_and_write_round_trips() -> None:
    store, _ = _one_shard()
    assert store.read_object("classes.txt") is None
    assert store.read_object("sub/classes.txt") is None
    store.write_object("classes.txt", b"cat\ndog\n")
    assert store.read_object("classes.txt") == b"cat\ndog\n"


# --- versions (ETag or fallback) --------------------------------------------------------------


def test_etag_changes_when_same_size_content_changes_memory() -> None:
    store, before = _one_shard()
    put(store.config.url, "s.tar", bytes(reversed(PAYLOAD)))
    (after,) = store.list_shards()
    assert after.size == before.size
    assert after.etag != before.etag
    assert after.identity != before.identity


def test_etag_changes_when_same_size_content_changes_local(tmp_path: Path) -> None:
    path = tmp_path / "s.tar"
    path.write_bytes(b"a" * 100)
    os.utime(path, ns=(1_700_000_000_000_000_001, 1_700_000_000_000_000_001))
    store = Store(SourceConfig(str(tmp_path)))
    (before,) = store.list_shards()
    path.write_bytes(b"b" * 100)
    (after,) = store.list_shards()
    assert after.size == before.size
    assert after.etag != before.etag


@pytest.mark.parametrize("where", ["memory", "local"])
def test_check_current_accepts_unchanged_and_rejects_changed(where: str, tmp_path: Path) -> None:
    # The first version is dated an hour back, so the rewrite below is a new version however
    # coarse the clock, and no sleep is needed to let it tick.
    hour_ago = time.time() - 3600
    if where == "memory":
        url = memory_url()
        put(url, "s.tar", PAYLOAD)
        fs, root = fsspec.core.url_to_fs(url)
        memory_file = fs.store[fs._strip_protocol(f"{root}/s.tar")]
        memory_file.created -= datetime.timedelta(hours=1)
        store = Store(SourceConfig(url))
    else:
        (tmp_path / "s.tar").write_bytes(PAYLOAD)
        os.utime(tmp_path / "s.tar", (hour_ago, hour_ago))
        store = Store(SourceConfig(str(tmp_path)))
    (shard,) = store.list_shards()
    store.check_current(shard)  # listing and info must agree on the version
    store.check_current(shard)
    store.write_object("s.tar", bytes(reversed(PAYLOAD)))
    with pytest.raises(ShardChangedError, match=r"s\.tar"):
        store.check_current(shard)


# --- error translation ------------------------------------------------------------------------


class NoCredentialsError(Exception):
    pass


class EndpointConnectionError(Exception):
    pass


@pytest.mark.parametrize(
    ("exc", "kind", "text"),
    [
        (FileNotFoundError(2, "No such file", "b/k"), SourceNotFoundError, "not found"),
        (PermissionError(13, "Forbidden"), SourceError, "access denied"),
        (NoCredentialsError("Unable to locate credentials"), SourceError, "no credentials"),
        (EndpointConnectionError("http://x"), SourceError, "cannot connect"),
        (ConnectionRefusedError("refused"), SourceError, "cannot connect"),
        (RuntimeError("boom\nsecond line"), SourceError, "what: RuntimeError: boom"),
        (ValueError(""), SourceError, "what: ValueError: ValueError"),
    ],
)
def test_translate_errors(exc: Exception, kind: type[ShardfsError], text: str) -> None:
    err = translate_errors("what", exc)
    assert type(err) is kind
    assert str(err).startswith("what: ")
    assert text in str(err)
    assert "\n" not in str(err)


@pytest.mark.parametrize(
    ("method", "status", "line"),
    [
        ("GET", 403, "what: the server answered 403 Forbidden"),
        ("HEAD", 500, "what: the server answered 500 Internal Server Error"),
        ("GET", 599, "what: the server answered 599"),
        ("PUT", 501, "cannot write to http://h/p/x: HTTP stores are read-only (the server "
                     "answered 501 Not Implemented to PUT)"),
        ("put", 405, "cannot write to http://h/p/x: HTTP stores are read-only (the server "
                     "answered 405 Method Not Allowed to PUT)"),
    ],
)  # fmt: skip
def test_translate_errors_names_an_http_answer(method: str, status: int, line: str) -> None:
    """aiohttp's ClientResponseError, as fsspec's HTTP filesystem raises it."""
    import aiohttp
    from multidict import CIMultiDict, CIMultiDictProxy
    from yarl import URL

    url = URL("http://h/p/x")
    request = aiohttp.RequestInfo(url, method, CIMultiDictProxy(CIMultiDict()), url)
    exc = aiohttp.ClientResponseError(request, (), status=status, message="whatever")
    err = translate_errors("what", exc)
    assert type(err) is SourceError
    assert str(err) == line


def test_translate_errors_keeps_our_own_errors() -> None:
    ours = ShardChangedError("x")
    assert translate_errors("what", ours) is ours


def test_permission_error_is_not_source_not_found() -> None:
    err: Any = translate_errors("what", PermissionError("denied"))
    assert not isinstance(err, SourceNotFoundError)
    assert err.exit_code == 3


@pytest.mark.parametrize("pattern", ["a{b.tar", "a}b.tar", "a{b{c,d}.tar"])
def test_expand_braces_unbalanced_is_literal(pattern: str) -> None:
    assert expand_braces(pattern) == [pattern]


# --- presigned ranged GETs ------------------------------------------------------------------


class _FakeSigner:
    def __init__(self) -> None:
        self.signed = 0

    def url(self, path: str, expires: int) -> str:
        self.signed += 1
        return f"http://store/{path}?sig={self.signed}"


class _FakeResponse:
    def __init__(self, status: int, data: bytes, headers: dict[str, str]) -> None:
        self.status = status
        self._data = data
        self.headers = headers

    def read(self, n: int, decode_content: bool = True) -> bytes:
        data, self._data = self._data[:n], self._data[n:]
        return data

    def close(self) -> None:
        pass

    def release_conn(self) -> None:
        pass


class _FakePool:
    """Answers with the given statuses in turn; a 206 carries the asked range of ``body``."""

    def __init__(self, statuses: list[int], body: bytes) -> None:
        self.statuses = statuses
        self.body = body
        self.size = len(body)

    def request(self, method: str, url: str, headers: dict[str, str], **_: object) -> _FakeResponse:
        status = self.statuses.pop(0)
        if status not in (200, 206):
            return _FakeResponse(status, b"", {})
        first, last = (int(x) for x in headers["Range"].removeprefix("bytes=").split("-"))
        data = (
            self.body
            if status == 200 or len(self.body) != self.size
            else self.body[first : last + 1]
        )
        return _FakeResponse(
            status, data, {"Content-Range": f"bytes {first}-{last}/{self.size}", "ETag": '"etag-1"'}
        )


def _fast() -> PresignedRanges:
    return PresignedRanges(_FakeSigner(), connect_timeout=1.0, stall_timeout=1.0)


def test_presigned_refusal_after_resigning_is_still_a_changed_shard() -> None:
    """A 403 (expired URL) then 412 on the fresh URL means the ETag no longer matches; it
    must not look like a failure of the fast path (which would fall back to s3fs, whose GETs
    carry no If-Match and would serve the new bytes)."""
    fast = _fast()
    fast._pool = _FakePool([403, 412], b"")  # type: ignore[assignment]
    with pytest.raises(PreconditionFailed):
        fast.get("b/a.tar", 0, 10, 100, "etag-1", time.monotonic() + 5, 10)


def test_presigned_whole_object_answer_is_handed_over_whole() -> None:
    """A server that ignores Range sent the whole object: all of it comes back, in one
    piece, for the store to keep (it cuts the range out, see test_store_http_ranges)."""
    body = bytes(range(100))
    fast = _fast()
    fast._pool = _FakePool([200], body)  # type: ignore[assignment]
    assert fast.get("b/a.tar", 10, 20, 100, "etag-1", time.monotonic() + 5, 10) == [body]
    fast._pool = _FakePool([200], body[:90])  # type: ignore[assignment]
    with pytest.raises(WrongLengthError):  # a whole object of another length
        fast.get("b/a.tar", 10, 35, 100, "etag-1", time.monotonic() + 5, 10)


@pytest.mark.parametrize(("start", "end", "piece"), [(0, 100, 10), (5, 96, 30), (0, 7, 100)])
def test_presigned_pieces_are_the_range_cut_at_piece_boundaries(
    start: int, end: int, piece: int
) -> None:
    body = bytes(range(100))
    fast = _fast()
    fast._pool = _FakePool([206], body)  # type: ignore[assignment]
    got = fast.get("b/a.tar", start, end, 100, "etag-1", time.monotonic() + 5, piece)
    assert b"".join(got) == body[start:end]
    assert [len(p) for p in got[:-1]] == [piece] * (len(got) - 1)
    assert 0 < len(got[-1]) <= piece


def test_presigned_short_body_is_a_wrong_length() -> None:
    """A 206 whose body ends early (a connection closed mid-body) is retried, never kept."""
    body = bytes(range(100))
    fast = _fast()
    pool = _FakePool([206], body)
    fast._pool = pool  # type: ignore[assignment]
    real = pool.request

    def short(*args: Any, **kwargs: Any) -> _FakeResponse:
        response = real(*args, **kwargs)
        response._data = response._data[:-3]
        return response

    pool.request = short  # type: ignore[method-assign]
    with pytest.raises(WrongLengthError):
        fast.get("b/a.tar", 0, 40, 100, "etag-1", time.monotonic() + 5, 16)


def test_presigned_server_errors_are_transient_and_keep_the_fast_path() -> None:
    """A 5xx is retried by read_range on the same path; it must not switch presigned GETs
    (and their If-Match) off for the rest of the process."""
    fast = _fast()
    fast._pool = _FakePool([503], b"")  # type: ignore[assignment]
    with pytest.raises(TransientError):
        fast.get("b/a.tar", 0, 10, 100, "etag-1", time.monotonic() + 5, 10)


# --- single .tar URLs and globs on the memory filesystem --------------------------------------


def test_single_tar_url_lists_that_tar_only() -> None:
    url = memory_url()
    put(url, "a.tar", b"a" * 3)
    put(url, "b.tar", b"b" * 5)
    (shard,) = Store(SourceConfig(url + "/b.tar")).list_shards()
    assert (shard.name, shard.size) == ("b.tar", 5)


def test_missing_single_tar_url_is_not_found() -> None:
    url = memory_url()
    put(url, "a.tar", b"a")
    with pytest.raises(SourceNotFoundError, match=r"b\.tar: not found$"):
        Store(SourceConfig(url + "/b.tar")).list_shards()


def test_folder_whose_name_ends_in_tar_is_listed_as_a_folder() -> None:
    url = memory_url()
    put(url, "odd.tar/x.tar", b"x" * 2)
    put(url, "odd.tar/y.tar", b"y" * 4)
    shards = Store(SourceConfig(url + "/odd.tar")).list_shards()
    assert [(s.name, s.size) for s in shards] == [("x.tar", 2), ("y.tar", 4)]


def test_glob_names_are_relative_to_the_part_before_the_wildcard() -> None:
    url = memory_url()
    for name in ("train/s-0.tar", "train/s-1.tar", "train/s-12.tar", "val/s-0.tar", "s-9.tar"):
        put(url, name, b"t")
    store = Store(SourceConfig(url + "/*/s-?.tar"))
    names = [s.name for s in store.list_shards()]
    assert names == ["train/s-0.tar", "train/s-1.tar", "val/s-0.tar"]
    assert store.identity != Store(SourceConfig(url)).identity


def test_glob_that_matches_nothing_says_so() -> None:
    url = memory_url()
    put(url, "s-0.tar", b"t")
    with pytest.raises(
        SourceNotFoundError, match=f"no {re.escape(shard_patterns())} shards match the pattern"
    ):
        Store(SourceConfig(url + "/x-*.tar")).list_shards()


def test_core_modules_do_not_import_urllib3_for_non_s3_stores() -> None:
    """The core install has no urllib3: only the S3 fast path may import it."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['urllib3'] = None\n"
        "from shardfs.store.remote import Store; from shardfs.config import SourceConfig\n"
        "import shardfs.cli, shardfs.mount.lifecycle\n"
        "Store(SourceConfig('memory://x')); print('ok')"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=60
    )
    assert result.stdout.strip() == "ok", result.stderr

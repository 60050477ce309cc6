"""Every ranged answer is checked against the request and the indexed shard."""

from __future__ import annotations

import pytest

from shardfs.responses import (
    PreconditionFailed,
    TransientError,
    WrongLengthError,
    checked_body,
    parse_content_range,
)

OBJECT = bytes(range(256)) * 4  # 1024 bytes


def _check(status: int, content_range: str | None, data: bytes, etag: str | None = '"v1"'):
    return checked_body(
        what="a.tar",
        status=status,
        content_range=content_range,
        etag_header=etag,
        data=data,
        start=100,
        end=200,
        size=len(OBJECT),
        etag="v1",
    )


def test_exact_partial_answer_is_accepted() -> None:
    assert _check(206, "bytes 100-199/1024", OBJECT[100:200]) == OBJECT[100:200]
    assert _check(206, "bytes 100-199/1024", OBJECT[100:200], etag=None) == OBJECT[100:200]
    assert _check(206, "bytes 100-199/1024", OBJECT[100:200], etag='W/"v1"') == OBJECT[100:200]


def test_whole_object_answer_is_cut_to_the_range() -> None:
    assert _check(200, None, OBJECT) == OBJECT[100:200]


@pytest.mark.parametrize(
    ("content_range", "data"),
    [
        ("bytes 100-199/1024", OBJECT[100:150]),  # short body
        ("bytes 100-199/1024", OBJECT[100:300]),  # long body
        ("bytes 100-299/1024", OBJECT[100:300]),  # long range, consistent body
        ("bytes 0-99/1024", OBJECT[0:100]),  # another range
        ("bytes 100-199/2048", OBJECT[100:200]),  # another object length
        (None, OBJECT[100:200]),  # no Content-Range on a 206
        ("bytes */1024", OBJECT[100:200]),  # malformed
    ],
)
def test_wrong_length_or_range_is_retried(content_range: str | None, data: bytes) -> None:
    with pytest.raises(WrongLengthError):
        _check(206, content_range, data)


def test_whole_object_of_another_length_is_retried() -> None:
    with pytest.raises(WrongLengthError):
        _check(200, None, OBJECT[:1000])


def test_another_etag_is_another_version() -> None:
    with pytest.raises(PreconditionFailed):
        _check(206, "bytes 100-199/1024", OBJECT[100:200], etag='"v2"')
    with pytest.raises(PreconditionFailed):
        _check(412, None, b"")


@pytest.mark.parametrize("status", [429, 500, 502, 503])
def test_throttling_and_server_errors_are_transient(status: int) -> None:
    with pytest.raises(TransientError):
        _check(status, None, b"")


def test_missing_object_and_other_statuses() -> None:
    with pytest.raises(FileNotFoundError):
        _check(404, None, b"")
    with pytest.raises(OSError, match="HTTP 400"):
        _check(400, None, b"")


def test_parse_content_range() -> None:
    assert parse_content_range("bytes 0-9/10") == (0, 9, 10)
    assert parse_content_range(" bytes 5-5/6 ") == (5, 5, 6)
    assert parse_content_range("bytes 0-9/*") is None
    assert parse_content_range("items 0-9/10") is None
    assert parse_content_range(None) is None

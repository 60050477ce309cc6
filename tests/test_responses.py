"""Every ranged answer is checked against the request and the indexed shard."""

from __future__ import annotations

import pytest

from shardfs.store.http_ranges import version_of
from shardfs.store.responses import (
    LAST_MODIFIED_PREFIX,
    PreconditionFailed,
    TransientError,
    WrongLengthError,
    checked_body,
    checks_etag,
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


def test_whole_object_answer_is_handed_over_whole() -> None:
    """A server that ignores Range sent the whole object: the caller keeps all of it (the
    store cuts the range out and keeps the rest, see tests/test_store.py)."""
    assert _check(200, None, OBJECT) == OBJECT


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


# -- HTTP servers: weak ETags and Last-Modified dates ------------------------------------------

DATE = "Tue, 14 Nov 2023 22:13:20 GMT"


def _check_version(version: str, etag: str | None, last_modified: str | None) -> bytes:
    return checked_body(
        what="a.tar",
        status=206,
        content_range="bytes 100-199/1024",
        etag_header=etag,
        last_modified_header=last_modified,
        data=OBJECT[100:200],
        start=100,
        end=200,
        size=len(OBJECT),
        etag=version,
    )


def test_weak_etag_is_compared_without_its_prefix() -> None:
    assert _check_version("W/v1", 'W/"v1"', None) == OBJECT[100:200]
    assert _check_version("W/v1", '"v1"', None) == OBJECT[100:200]
    with pytest.raises(PreconditionFailed):
        _check_version("W/v1", 'W/"v2"', None)


def test_last_modified_version_is_compared_to_the_answers_date() -> None:
    version = LAST_MODIFIED_PREFIX + DATE
    assert not checks_etag(version)  # never sent as If-Match
    assert _check_version(version, '"some-etag"', DATE) == OBJECT[100:200]
    assert _check_version(version, None, None) == OBJECT[100:200]  # nothing to compare
    # An older file put back in place answers If-Unmodified-Since with 206: only the
    # comparison of the date catches it.
    with pytest.raises(PreconditionFailed, match="Last-Modified"):
        _check_version(version, None, "Mon, 13 Nov 2023 22:13:20 GMT")


def test_version_of_http_validators() -> None:
    assert version_of('"abc"', DATE) == "abc"
    assert version_of('W/"abc"', None) == "W/abc"
    assert version_of(None, DATE) == LAST_MODIFIED_PREFIX + DATE
    assert version_of(None, None) == ""

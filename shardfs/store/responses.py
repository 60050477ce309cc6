"""Checks every ranged GET's answer against the request and the indexed shard.

Every checked way of reading (presigned URLs and s3fs on S3, ``http_ranges`` on HTTP) hands
its response here, so one set of rules decides which bytes may be stored or served: the range
and the object's length must be the ones asked for, and the object's validator (ETag, or
Last-Modified on a server without ETags), where the answer carries one, the indexed one.
Only ``store.Store`` and the modules it drives use this module.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

Landing = Callable[[int], memoryview]  # memory to receive a piece of n bytes into
Piece = bytes | memoryview  # bytes, or a view of ``Landing`` memory
Pieces = list[Piece]  # a GET's body


class PreconditionFailed(Exception):
    """The object's ETag is no longer the indexed one (HTTP 412, or an ETag that differs)."""


class TransientError(Exception):
    """A failure worth retrying: a 5xx or 429 answer, a broken or stalled connection, or an
    answer whose length or range is not the one asked for."""


class WrongLengthError(TransientError):
    """An answer whose length or range is not the one asked for: retried, and if it stays
    wrong, the shard's listing tells whether the shard changed."""


# How a version taken from a Last-Modified date (a server without ETags) is written.
LAST_MODIFIED_PREFIX = "last-modified:"

_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+)")


def parse_content_range(header: str | None) -> tuple[int, int, int] | None:
    """``bytes FIRST-LAST/TOTAL`` as numbers, or None if absent or malformed."""
    if not header:
        return None
    match = _CONTENT_RANGE.fullmatch(header.strip())
    if match is None:
        return None
    first, last, total = (int(group) for group in match.groups())
    return first, last, total


def comparable_etag(etag: str) -> str:
    """An ETag without quotes or the weak-validator prefix, as listings give it."""
    etag = etag.strip()
    if etag.startswith("W/"):
        etag = etag[2:]
    return etag.strip('"')


def checks_etag(etag: str) -> bool:
    """Whether an indexed version string is an ETag a store can compare (not a local mtime
    or a Last-Modified date)."""
    return bool(etag) and not etag.startswith(("mtime:", LAST_MODIFIED_PREFIX))


def checked_body(
    *,
    what: str,
    status: int,
    content_range: str | None,
    etag_header: str | None,
    data: bytes,
    start: int,
    end: int,
    size: int,
    etag: str,
    last_modified_header: str | None = None,
) -> bytes:
    """The bytes ``[start, end)`` of an object of ``size`` bytes from one response, or, where
    the server ignored ``Range`` (a 200), the whole object: the caller keeps it rather than
    ask again (``store.Store``). Or an exception: PreconditionFailed when the object is
    another version, TransientError when the answer does not match the request, OSError for
    any other status."""
    check_answer(
        what=what,
        status=status,
        content_range=content_range,
        etag_header=etag_header,
        start=start,
        end=end,
        size=size,
        etag=etag,
        last_modified_header=last_modified_header,
    )
    check_length(what, status, len(data), start, end, size)
    return data


def check_answer(
    *,
    what: str,
    status: int,
    content_range: str | None,
    etag_header: str | None,
    start: int,
    end: int,
    size: int,
    etag: str,
    last_modified_header: str | None = None,
) -> None:
    """What can be checked before the body is read: the status, the version and, on a 206,
    the range. Returns for a 206 or a 200 (the whole object); raises as ``checked_body``."""
    if etag_header and checks_etag(etag) and comparable_etag(etag_header) != comparable_etag(etag):
        raise PreconditionFailed(f"{what}: ETag {etag_header} is not the indexed {etag}")
    if (
        last_modified_header
        and etag.startswith(LAST_MODIFIED_PREFIX)
        and last_modified_header.strip() != etag.removeprefix(LAST_MODIFIED_PREFIX)
    ):
        raise PreconditionFailed(
            f"{what}: Last-Modified {last_modified_header} is not the indexed "
            f"{etag.removeprefix(LAST_MODIFIED_PREFIX)}"
        )
    if status == 206:
        got = parse_content_range(content_range)
        if got != (start, end - 1, size):
            raise WrongLengthError(
                f"{what}: Content-Range {content_range!r} for bytes {start}-{end - 1}/{size}"
            )
        return
    if status == 200:  # a server that ignores Range sends the whole object
        return
    if status == 412:
        raise PreconditionFailed(f"{what}: HTTP 412")
    if status == 429 or status >= 500:
        raise TransientError(f"{what}: HTTP {status}")
    if status == 404:
        raise FileNotFoundError(f"{what}: HTTP 404")
    raise OSError(f"{what}: HTTP {status}")


def check_length(what: str, status: int, length: int, start: int, end: int, size: int) -> None:
    """The body's length against the request: the range on a 206, the object on a 200."""
    if status == 206 and length != end - start:
        raise WrongLengthError(f"{what}: {length} bytes for a range of {end - start}")
    if status == 200 and length != size:
        raise WrongLengthError(f"{what}: {length} bytes for an object of {size}")


def pieces_of(data: bytes, piece: int) -> Pieces:
    """``data`` as consecutive pieces of ``piece`` bytes (itself when it is one piece)."""
    if len(data) <= piece:
        return [data]
    return [data[i : i + piece] for i in range(0, len(data), piece)]


@dataclass(frozen=True, slots=True)
class Fetched:
    """What ``Store.fetch`` brought: the bytes asked for, as pieces, and the whole shard
    when the server sent all of it for this GET (it ignores ``Range``), for the caller to
    keep (the block cache stores all its blocks)."""

    pieces: Pieces  # views of ``Landing`` memory only where the caller gave it
    whole: bytes | None = None

"""HEADs and ranged GETs over plain HTTP(S), checked like S3's.

fsspec's HTTP filesystem reads a range without looking at the status, the Content-Range or
the validators, so a file replaced on the server would be served as a mix of two versions.
Here each request goes through fsspec's own aiohttp session (so storage options such as
``headers`` and ``client_kwargs.auth`` apply), follows redirects (the Hugging Face hub answers
302 to a CDN), asks for the indexed version (``If-Match`` with a strong ETag, else
``If-Unmodified-Since`` with the Last-Modified date) and hands the answer to
``responses.checked_body``, which also compares the answer's own validator.

Only ``store.Store`` uses this module.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from fsspec.asyn import sync

from .responses import (
    LAST_MODIFIED_PREFIX,
    PreconditionFailed,
    TransientError,
    checked_body,
    checks_etag,
    parse_content_range,
)

# HEADs in flight at once while a brace pattern or a listing is checked.
HEAD_CONCURRENCY = 32
_HEAD_ATTEMPTS = 3


@dataclass(frozen=True, slots=True)
class HttpObject:
    """What a HEAD tells of one URL: its size and version (see ``version_of``)."""

    size: int
    version: str


def version_of(etag: str | None, last_modified: str | None) -> str:
    """A shard's version from its validators: the ETag (``W/``-prefixed if weak), else
    ``last-modified:DATE``, else "" (the server gives nothing to check)."""
    if etag:
        etag = etag.strip()
        weak = etag.startswith("W/")
        bare = etag.removeprefix("W/").strip('"')
        return f"W/{bare}" if weak else bare
    if last_modified:
        return LAST_MODIFIED_PREFIX + last_modified.strip()
    return ""


def _request_options(fs: Any, extra_headers: dict[str, str], timeout: float) -> dict[str, Any]:
    """fsspec's request options (the user's headers, auth...) with ours laid over them."""
    options = dict(getattr(fs, "kwargs", {}) or {})
    headers = dict(options.pop("headers", {}) or {})
    # Byte ranges count bytes of the file as stored, never of a compressed encoding.
    headers["Accept-Encoding"] = "identity"
    headers.update(extra_headers)
    options["headers"] = headers
    options["allow_redirects"] = True
    import aiohttp  # here, not at the top: a mount of another store never loads it

    options.setdefault("timeout", aiohttp.ClientTimeout(total=timeout))
    return options


def _is_transient(exc: BaseException) -> bool:
    import aiohttp

    return isinstance(
        exc, (aiohttp.ClientError, asyncio.TimeoutError, TimeoutError, ConnectionError)
    )


async def _head_once(fs: Any, session: Any, url: str, timeout: float) -> HttpObject | None:
    options = _request_options(fs, {}, timeout)
    async with session.head(fs.encode_url(url), **options) as response:
        status = response.status
        headers = response.headers
        if _absent(url, status):
            return None
        length = headers.get("Content-Length")
        encoded = headers.get("Content-Encoding", "identity") not in ("", "identity")
        if status == 200 and length is not None and not encoded:
            return HttpObject(int(length), version_of(headers.get("ETag"), _lm(headers)))
    # No HEAD, or no length in its answer: ask for the first byte, whose Content-Range
    # carries the total.
    options = _request_options(fs, {"Range": "bytes=0-0"}, timeout)
    async with session.get(fs.encode_url(url), **options) as response:
        status = response.status
        if _absent(url, status):
            return None
        got = parse_content_range(response.headers.get("Content-Range"))
        if status == 206 and got is not None:
            return HttpObject(got[2], version_of(response.headers.get("ETag"), _lm(response)))
        raise OSError(f"{url}: HTTP {status} gives no size (no Content-Length or Content-Range)")


def _absent(url: str, status: int) -> bool:
    """Whether a HEAD-like answer says the file is not there; raises for refusals and for
    answers worth retrying."""
    if status in (401, 403):
        raise PermissionError(f"{url}: HTTP {status}")
    if status == 429 or status >= 500:
        raise TransientError(f"{url}: HTTP {status}")
    return status in (404, 410)


def _lm(response_or_headers: Any) -> str | None:
    headers = getattr(response_or_headers, "headers", response_or_headers)
    value = headers.get("Last-Modified")
    return str(value) if value else None


async def _head(fs: Any, url: str, timeout: float) -> HttpObject | None:
    session = await fs.set_session()
    delay = 0.1
    for attempt in range(1, _HEAD_ATTEMPTS + 1):
        try:
            return await _head_once(fs, session, url, timeout)
        except Exception as exc:
            if attempt == _HEAD_ATTEMPTS or not (
                isinstance(exc, TransientError) or _is_transient(exc)
            ):
                raise
            await asyncio.sleep(delay)
            delay *= 2
    raise AssertionError("unreachable")


async def _head_all(
    fs: Any, urls: list[str], timeout: float, concurrency: int
) -> list[HttpObject | None]:
    gate = asyncio.Semaphore(concurrency)

    async def one(url: str) -> HttpObject | None:
        async with gate:
            return await _head(fs, url, timeout)

    return list(await asyncio.gather(*(one(url) for url in urls)))


def head_many(
    fs: Any, urls: list[str], *, timeout: float, concurrency: int = HEAD_CONCURRENCY
) -> list[HttpObject | None]:
    """Size and version of each URL (None where the server answers 404), ``concurrency``
    requests at a time; each request gets ``timeout`` seconds."""
    if not urls:
        return []
    result: list[HttpObject | None] = sync(
        fs.loop, _head_all, fs, urls, timeout, concurrency, timeout=None
    )
    return result


async def _get(
    fs: Any, url: str, headers: dict[str, str], timeout: float
) -> tuple[int, Any, bytes]:
    session = await fs.set_session()
    options = _request_options(fs, headers, timeout)
    async with session.get(fs.encode_url(url), **options) as response:
        data = await response.read() if response.status in (200, 206) else b""
        # A case-insensitive copy: servers spell header names as they like.
        return response.status, response.headers.copy(), bytes(data)


def get_range(
    fs: Any, url: str, start: int, end: int, size: int, version: str, timeout: float
) -> bytes:
    """Bytes ``[start, end)`` of the file at ``url`` as indexed (``size``, ``version``),
    within ``timeout`` seconds; errors as ``checked_body`` raises them."""
    what = f"{url} [{start}:{end}]"
    headers = {"Range": f"bytes={start}-{end - 1}"}
    if checks_etag(version) and not version.startswith("W/"):
        # A weak ETag never passes If-Match's strong comparison; it is compared below.
        headers["If-Match"] = f'"{version}"'
    elif version.startswith(LAST_MODIFIED_PREFIX):
        headers["If-Unmodified-Since"] = version.removeprefix(LAST_MODIFIED_PREFIX)
    try:
        status, answer, data = sync(fs.loop, _get, fs, url, headers, timeout, timeout=timeout)
    except Exception as exc:
        if _is_transient(exc) or type(exc).__name__ == "FSTimeoutError":
            raise TransientError(f"{what}: {type(exc).__name__}: {exc}") from exc
        raise
    if status == 416:  # the range lies inside the indexed size: the file is shorter now
        raise PreconditionFailed(f"{what}: HTTP 416 (the file is shorter than indexed)")
    if status in (401, 403):
        raise PermissionError(f"{what}: HTTP {status}")
    return checked_body(
        what=what,
        status=status,
        content_range=answer.get("Content-Range"),
        etag_header=answer.get("ETag"),
        last_modified_header=answer.get("Last-Modified"),
        data=data,
        start=start,
        end=end,
        size=size,
        etag=version,
    )

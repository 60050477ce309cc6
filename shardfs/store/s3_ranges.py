"""Ranged GETs through s3fs's own client: the path every S3 request can take.

The presigned fast path (``presigned``) is tried first; a request it cannot answer comes
here. This path sends ``If-Match`` too and hands its answer to ``responses.checked_body``,
so falling back never switches a check off. Only ``store.Store`` uses this module.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fsspec.asyn import sync

from .responses import PreconditionFailed, TransientError, checked_body, checks_etag

# Error codes S3 answers that are worth retrying on the same path.
# Words in the names of botocore and aiohttp exceptions for broken or stalled connections.
_TRANSIENT_NAMES = ("Timeout", "Connection", "Payload", "Endpoint", "Read", "Streaming")
_TRANSIENT_CODES = frozenset(
    {"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "Throttling"}
)


async def _get_object(fs: Any, path: str, start: int, end: int, etag: str) -> tuple[Any, bytes]:
    bucket, key, version = fs.split_path(path)
    await fs.set_session()
    client = await fs.get_s3(bucket)
    kwargs: dict[str, Any] = {"Bucket": bucket, "Key": key, "Range": f"bytes={start}-{end - 1}"}
    if version:
        kwargs["VersionId"] = version
    if checks_etag(etag):
        kwargs["IfMatch"] = f'"{etag}"'
    kwargs = fs._get_s3_method_kwargs(client.get_object, **kwargs)
    response = await client.get_object(**kwargs)
    body = response["Body"]
    try:
        data = await body.read()
    finally:
        body.close()
    return response, bytes(data)


def get_range(
    fs: Any, path: str, start: int, end: int, size: int, etag: str, timeout: float
) -> bytes:
    """Bytes ``[start, end)`` of the S3 object at ``path`` as indexed, within ``timeout``
    seconds; errors as ``checked_body`` raises them."""
    what = f"{path} [{start}:{end}]"
    try:
        response, data = sync(fs.loop, _get_object, fs, path, start, end, etag, timeout=timeout)
    except Exception as exc:
        raise _translate(what, exc) from exc
    meta = response.get("ResponseMetadata", {})
    return checked_body(
        what=what,
        status=int(meta.get("HTTPStatusCode", 0)),
        content_range=response.get("ContentRange"),
        etag_header=response.get("ETag"),
        data=data,
        start=start,
        end=end,
        size=size,
        etag=etag,
    )


def _translate(what: str, exc: Exception) -> Exception:
    """botocore, aiohttp and asyncio failures as the kinds ``checked_body`` uses."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):  # botocore ClientError
        error = response.get("Error", {})
        code = str(error.get("Code", ""))
        status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        if code in ("PreconditionFailed", "412") or status == 412:
            return PreconditionFailed(f"{what}: {code or 'HTTP 412'}")
        if code in ("NoSuchKey", "404", "NotFound") or status == 404:
            return FileNotFoundError(f"{what}: {code or 'HTTP 404'}")
        if code in _TRANSIENT_CODES or status == 429 or status >= 500:
            return TransientError(f"{what}: {code or status}")
        return OSError(f"{what}: {code}: {error.get('Message', '')}".rstrip(": "))
    if isinstance(exc, (PermissionError, FileNotFoundError)):
        return exc
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError, ConnectionError, OSError)):
        return TransientError(f"{what}: {type(exc).__name__}: {exc}")
    name = type(exc).__name__
    if any(
        word in name
        for word in ("Timeout", "Connection", "Payload", "Endpoint", "Read", "Streaming")
    ):
        return TransientError(f"{what}: {name}: {exc}")
    return exc

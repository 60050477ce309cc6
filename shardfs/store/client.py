"""The fsspec filesystem behind a source: its options, its timeouts, the versions it
reports, and the one translation of its exceptions (botocore, aiohttp, OSError) into ours.
"""

from __future__ import annotations

import datetime
import http
import os
import socket
import urllib.parse
from typing import Any

import fsspec
from fsspec.core import url_to_fs

from ..config import SourceConfig
from ..errors import ShardfsError, SourceError, SourceNotFoundError, UsageError
from .urls import HTTP_PROTOCOLS

S3_PROTOCOLS = ("s3", "s3a")
# Storage options that s3fs expects to be mappings.
_MAPPING_OPTIONS = ("client_kwargs", "config_kwargs", "s3_additional_kwargs")


def open_filesystem(config: SourceConfig, root_url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem and the path in it of ``root_url`` (the part of ``config.url`` to
    list), with our timeouts and endpoint; a usage error for options it cannot take."""
    options = dict(config.storage_options)
    scheme = config.url.split("://", 1)[0]
    _check_options(options, config.endpoint_url)
    if scheme in S3_PROTOCOLS:
        options = _with_s3_timeouts(options, config)
    if config.endpoint_url:
        options.setdefault("client_kwargs", {})
        options["client_kwargs"] = {
            **options["client_kwargs"],
            "endpoint_url": config.endpoint_url,
        }
    if scheme in HTTP_PROTOCOLS:
        options = _with_http_timeouts(options, config)
    try:
        fs, root = url_to_fs(root_url, **options)
    except ImportError as exc:
        hint = "install the matching extra, e.g. shardfs[s3]"
        raise UsageError(f"{config.url}: {exc} ({hint})") from exc
    except (ValueError, TypeError) as exc:
        raise UsageError(f"{config.url}: {exc}") from exc
    if protocol_of(fs) in S3_PROTOCOLS:
        _start_s3_session(fs, config.url)
    return fs, root.rstrip("/")


def protocol_of(fs: fsspec.AbstractFileSystem) -> str:
    protocol = fs.protocol
    return protocol if isinstance(protocol, str) else str(protocol[0])


def _start_s3_session(fs: fsspec.AbstractFileSystem, url: str) -> None:
    """Build the S3 client now, so that options it rejects are a usage error (exit 2)
    rather than a failure of the first request."""
    try:
        fs.connect()
    except (TypeError, ValueError, AttributeError) as exc:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(f"{url}: the S3 client rejects the options: {text}") from exc
    except Exception as exc:
        raise translate_errors(url, exc) from exc


def version_of(info: dict[str, Any]) -> str:
    """A shard's version: ETag, else VersionId, else modification time (local files)."""
    for key in ("ETag", "etag", "VersionId", "version_id", "generation", "md5Hash"):
        if info.get(key):
            return str(info[key]).strip('"')
    lfs = info.get("lfs")  # Hugging Face: the content hash of a file kept in LFS, else git's
    if isinstance(lfs, dict) and lfs.get("sha256"):
        return f"sha256:{lfs['sha256']}"
    if info.get("blob_id"):
        return f"blob:{info['blob_id']}"
    for key in ("mtime", "LastModified", "last_modified", "updated", "created"):
        value = info.get(key)
        if value is not None:
            # Some backends give a datetime from info() but a float from ls()/find()
            # (memory); both must name the same version.
            if isinstance(value, datetime.datetime):
                value = value.timestamp()
            return f"mtime:{value}"
    return ""


def translate_errors(what: str, exc: BaseException) -> ShardfsError:
    """Turn a foreign exception into one of ours, with one clear line of text."""
    if isinstance(exc, ShardfsError):
        return exc
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, FileNotFoundError):
        return SourceNotFoundError(f"{what}: not found ({text})")
    if isinstance(exc, PermissionError):
        return SourceError(f"{what}: access denied ({text})")
    name = type(exc).__name__
    if "Credentials" in name:
        return SourceError(f"{what}: no credentials found (set AWS_* variables or -o key=/secret=)")
    status, request = getattr(exc, "status", None), getattr(exc, "request_info", None)
    if isinstance(status, int) and request is not None:  # aiohttp's ClientResponseError
        return _http_answer(what, status, str(request.method), str(request.real_url))
    if "Connect" in name or "Endpoint" in name or isinstance(exc, ConnectionError):
        return _cannot_connect(what, exc, text)
    return SourceError(f"{what}: {name}: {text}")


def _http_answer(what: str, status: int, method: str, url: str) -> ShardfsError:
    """An HTTP error status, named by code and phrase; a write (pack, a sidecar) refused by
    an HTTP server, whatever the code, is a write to a store that only serves files."""
    try:
        answer = f"{status} {http.HTTPStatus(status).phrase}"
    except ValueError:
        answer = str(status)
    if method.upper() in ("PUT", "POST", "PATCH", "DELETE"):
        return SourceError(
            f"cannot write to {url}: HTTP stores are read-only "
            f"(the server answered {answer} to {method.upper()})"
        )
    return SourceError(f"{what}: the server answered {answer}")


def _cannot_connect(what: str, exc: BaseException, text: str) -> ShardfsError:
    """``cannot connect to HOST:PORT (reason)`` where the exception names them (aiohttp's
    connector errors), else the exception's own first line."""
    host, port = getattr(exc, "host", None), getattr(exc, "port", None)
    if not host:
        return SourceError(f"{what}: cannot connect to the store ({text})")
    cause = getattr(exc, "os_error", None)
    reason = text
    if isinstance(cause, socket.gaierror) and cause.strerror:
        reason = cause.strerror.lower()  # "name or service not known"
    elif isinstance(cause, OSError) and cause.errno:
        reason = os.strerror(cause.errno).lower()  # asyncio's own text repeats the address
    return SourceError(f"{what}: cannot connect to {host}:{port} ({reason})")


def _check_options(options: dict[str, Any], endpoint_url: str | None) -> None:
    """Refuse option values that could only fail later, inside the store's client."""
    for name in _MAPPING_OPTIONS:
        if name in options and not isinstance(options[name], dict):
            raise UsageError(
                f"storage option {name} must be a mapping, e.g. -o {name}.KEY=VALUE "
                f"(got {options[name]!r})"
            )
    endpoints = [endpoint_url] if endpoint_url else []
    client_kwargs = options.get("client_kwargs")
    if isinstance(client_kwargs, dict) and client_kwargs.get("endpoint_url"):
        endpoints.append(client_kwargs["endpoint_url"])
    for endpoint in endpoints:
        parsed = urllib.parse.urlsplit(str(endpoint))
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise UsageError(f"endpoint URL {endpoint!r} is not an http:// or https:// URL")


def _with_http_timeouts(options: dict[str, Any], config: SourceConfig) -> dict[str, Any]:
    """Bound fsspec's own HTTP requests (folder listings) unless the user chose a timeout."""
    import aiohttp

    client_kwargs = dict(options.get("client_kwargs") or {})
    client_kwargs.setdefault(
        "timeout",
        aiohttp.ClientTimeout(
            total=None, sock_connect=config.connect_timeout, sock_read=config.stall_timeout
        ),
    )
    return {**options, "client_kwargs": client_kwargs}


def _with_s3_timeouts(options: dict[str, Any], config: SourceConfig) -> dict[str, Any]:
    """Bound every s3fs request by our timeouts unless the user chose their own."""
    config_kwargs = dict(options.get("config_kwargs") or {})
    config_kwargs.setdefault("connect_timeout", config.connect_timeout)
    config_kwargs.setdefault("read_timeout", config.stall_timeout)
    # botocore's own retries would multiply every timeout; read_range retries reads itself.
    config_kwargs.setdefault("retries", {"max_attempts": 3, "mode": "standard"})
    return {**options, "config_kwargs": config_kwargs}

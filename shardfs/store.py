"""The only module that talks to the store: listing, ranged reads, streams and small objects.

Everything goes through fsspec, so every backend it knows (s3, gcs, http, hf, file, memory)
works. A source URL names a folder (every ``*.tar`` under it), one ``.tar``, a brace pattern
(``shard-{000..009}.tar``) or a glob (``shard-*.tar``); shard names are relative to the part
of the URL before the first wildcard. Foreign exceptions (botocore, aiohttp, OSError) are
translated here, in one place.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import logging
import os
import posixpath
import re
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any, TypeVar, cast

import fsspec
from fsspec.core import url_to_fs

from . import http_ranges, s3_ranges
from .config import SourceConfig
from .errors import (
    ShardChangedError,
    ShardfsError,
    SourceError,
    SourceNotFoundError,
    StoreReadError,
    UsageError,
)
from .responses import PreconditionFailed, TransientError, WrongLengthError
from .tar import Readable

if TYPE_CHECKING:  # imported when used: only S3 needs urllib3
    from .presigned import PresignedRanges

log = logging.getLogger(__name__)

SHARD_SUFFIX = ".tar"
# put_file_atomic's temp names on a local folder: ``.NAME.tmp-PID-NS``.
_TEMP_NAME = re.compile(r"\..+\.tmp-\d+-\d+")
T = TypeVar("T")
# A brace pattern naming more shards than this is a typo, not a dataset.
MAX_PATTERN_SHARDS = 1_000_000
# Fast-path failures in a row (other than changed shards and transient faults) after which
# requests go straight to s3fs for a while; the fast path is then tried again.
_FAST_FAILURES_TO_PAUSE = 3
_FAST_PAUSE_S = 60.0
_LOCAL_PROTOCOLS = ("file", "local")
_HTTP_PROTOCOLS = ("http", "https")
# Characters that make a source URL a glob; ``{`` starts a brace pattern.
_GLOB_CHARS = "*?["
# Storage options that s3fs expects to be mappings.
_MAPPING_OPTIONS = ("client_kwargs", "config_kwargs", "s3_additional_kwargs")
# Errors that say the code is wrong, not the store: never retried.
_PROGRAMMING_ERRORS: tuple[type[Exception], ...] = (
    TypeError,
    AttributeError,
    NameError,
    AssertionError,
    NotImplementedError,
    RecursionError,
)


@dataclass(frozen=True, slots=True)
class ShardInfo:
    """A shard as listed in the store: ``name`` is relative to the source root."""

    name: str
    size: int
    etag: str

    @property
    def identity(self) -> tuple[str, int, str]:
        return (self.name, self.size, self.etag)


def _split_top_level(body: str) -> list[str]:
    """Split a brace body at the commas that are not inside nested braces."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(body):
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(body[start:i])
            start = i + 1
    parts.append(body[start:])
    return parts


def expand_braces(pattern: str) -> list[str]:
    """Expand webdataset-style ``{000..146}`` ranges and ``{a,b}`` lists (nestable), left
    to right."""
    open_at = pattern.find("{")
    close_at = depth = 0
    for close_at in range(max(open_at, 0), len(pattern)):
        depth += {"{": 1, "}": -1}.get(pattern[close_at], 0)
        if depth == 0:
            break
    if open_at < 0 or depth != 0:
        return [pattern]  # no braces, or an unbalanced one: taken literally
    head, body, tail = pattern[:open_at], pattern[open_at + 1 : close_at], pattern[close_at + 1 :]
    if range_match := re.fullmatch(r"(\d+)\.\.(\d+)", body):
        lo, hi = range_match.group(1), range_match.group(2)
        width = len(lo) if lo.startswith("0") or len(lo) == len(hi) else 0
        if int(hi) < int(lo):
            raise UsageError(f"empty brace range {{{body}}} in {pattern!r}")
        _check_pattern_size(int(hi) - int(lo) + 1, pattern)
        choices = [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
    else:
        choices = [c for part in _split_top_level(body) for c in expand_braces(part)]
        _check_pattern_size(len(choices), pattern)
    rests = expand_braces(tail)
    _check_pattern_size(len(choices) * len(rests), pattern)
    return [head + choice + rest for choice in choices for rest in rests]


def _check_pattern_size(count: int, pattern: str) -> None:
    if count > MAX_PATTERN_SHARDS:
        raise UsageError(f"brace pattern {pattern!r} names more than {MAX_PATTERN_SHARDS:,} shards")


def _etag_of(info: dict[str, Any]) -> str:
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


@dataclass(frozen=True, slots=True)
class _Selection:
    """Which shards a source URL names: ``root`` is the URL up to the last ``/`` before the
    first wildcard (the whole URL for a folder); ``names`` are exact shard names relative to
    it (a brace pattern or one ``.tar``); ``globs`` match names relative to it."""

    root: str
    names: tuple[str, ...] | None = None
    globs: tuple[str, ...] | None = None
    single: bool = False


def _path_start(url: str) -> int:
    """Where the path begins: after ``scheme://`` (and an http host), else 0."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return 0
    if scheme in _HTTP_PROTOCOLS:
        slash = rest.find("/")
        return len(scheme) + 3 + (slash if slash >= 0 else len(rest))
    return len(scheme) + 3


def select(url: str) -> _Selection:
    """Split a source URL into the folder to list or probe and the shards it names."""
    start = _path_start(url)
    expanded = expand_braces(url) if "{" in url[start:] else [url]
    braces = len(expanded) > 1 or expanded[0] != url
    magic = [i for i in (url.find(c, start) for c in _GLOB_CHARS + "{") if i >= 0]
    if braces:
        cut = url.rfind("/", 0, min(magic))
    else:
        magic = [i for i in magic if url[i] != "{"]  # an unbalanced brace is literal
        if not magic:
            if url.endswith(SHARD_SUFFIX):
                root, _, name = url.rpartition("/")
                return _Selection(root=root or ".", names=(name,), single=True)
            return _Selection(root=url.rstrip("/") or url)
        cut = url.rfind("/", 0, min(magic))
    if cut < start:
        if start:  # a wildcard in the bucket or host name
            raise UsageError(f"{url}: a pattern must not reach into the bucket or host name")
        root, cut = ".", -1  # a relative local pattern such as shard-*.tar
    else:
        root = url[:cut] or "/"
    relative = [e[cut + 1 :] for e in expanded]
    if any(c in e for e in relative for c in _GLOB_CHARS):
        return _Selection(root=root, globs=tuple(relative))
    return _Selection(root=root, names=tuple(relative))


def glob_regex(pattern: str) -> re.Pattern[str]:
    """A shell glob as a regex over ``/``-separated names: ``*`` and ``?`` stay within one
    folder level, ``**`` crosses levels, ``[...]`` is a class (``[!...]`` negated)."""
    out, i = [], 0
    while i < len(pattern):
        char = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
            continue
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if char == "*":
            out.append("[^/]*")
        elif char == "?":
            out.append("[^/]")
        elif char == "[" and (close := pattern.find("]", i + 2)) > 0:
            body = pattern[i + 1 : close]
            negate = body.startswith("!")
            body = body[1:] if negate else body
            out.append(f"[{'^' if negate else ''}{body.replace(chr(92), chr(92) * 2)}]")
            i = close + 1
            continue
        else:
            out.append(re.escape(char))
        i += 1
    return re.compile("".join(out))


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
    if "Connect" in name or "Endpoint" in name or isinstance(exc, ConnectionError):
        return SourceError(f"{what}: cannot connect to the store ({text})")
    return SourceError(f"{what}: {name}: {text}")


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


class Store:
    """A source of shards behind an fsspec filesystem."""

    def __init__(self, config: SourceConfig) -> None:
        self.config = config
        options = dict(config.storage_options)
        url = config.url
        _check_options(options, config.endpoint_url)
        if url.split("://", 1)[0] in ("s3", "s3a"):
            options = _with_s3_timeouts(options, config)
        if config.endpoint_url:
            options.setdefault("client_kwargs", {})
            options["client_kwargs"] = {
                **options["client_kwargs"],
                "endpoint_url": config.endpoint_url,
            }
        self._selection = select(url)
        if url.split("://", 1)[0] in _HTTP_PROTOCOLS:
            options = _with_http_timeouts(options, config)
        try:
            fs, root = url_to_fs(self._selection.root, **options)
        except ImportError as exc:
            hint = "install the matching extra, e.g. shardfs[s3]"
            raise UsageError(f"{config.url}: {exc} ({hint})") from exc
        except (ValueError, TypeError) as exc:
            raise UsageError(f"{config.url}: {exc}") from exc
        self.fs: fsspec.AbstractFileSystem = fs
        self.root: str = root.rstrip("/")
        self._presigned: PresignedRanges | None = None
        self._unversioned: list[str] | None = None  # shards with no version, once listed
        # Set by list_shards where reads cannot be checked against the indexed version.
        self.version_warning: str | None = None
        self._listed = 0  # paths the last folder listing gave
        self._fast_failures = 0
        self._fast_paused_until = 0.0
        self._fast_lock = threading.Lock()
        if self.protocol in ("s3", "s3a"):
            self._start_s3_session()
            if hasattr(fs, "url"):
                from .presigned import PresignedRanges

                self._presigned = PresignedRanges(
                    fs,
                    connect_timeout=config.connect_timeout,
                    stall_timeout=config.stall_timeout,
                )

    def _start_s3_session(self) -> None:
        """Build the S3 client now, so that options it rejects are a usage error (exit 2)
        rather than a failure of the first request."""
        try:
            self.fs.connect()
        except (TypeError, ValueError, AttributeError) as exc:
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UsageError(
                f"{self.config.url}: the S3 client rejects the options: {text}"
            ) from exc
        except Exception as exc:
            raise translate_errors(self.config.url, exc) from exc

    @property
    def protocol(self) -> str:
        protocol = self.fs.protocol
        return protocol if isinstance(protocol, str) else str(protocol[0])

    def _endpoint(self) -> str:
        endpoint = self.config.endpoint_url or ""
        if not endpoint:
            client_kwargs = self.config.storage_options.get("client_kwargs") or {}
            endpoint = str(client_kwargs.get("endpoint_url", ""))
        if not endpoint and self.protocol in ("s3", "s3a"):
            endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get(
                "AWS_ENDPOINT_URL", ""
            )
        return endpoint

    @property
    def is_http(self) -> bool:
        return self.protocol in _HTTP_PROTOCOLS

    @property
    def identity(self) -> str:
        """A stable id of this source, used to key the persisted index."""
        selection = self._selection
        named = selection.names or selection.globs or ()
        if selection.globs:
            named = ("glob", *named)
        text = f"{self.protocol}://{self.root}|{self._endpoint()}|{'|'.join(named)}"
        return hashlib.sha256(text.encode()).hexdigest()[:20]

    def location(self, shard: ShardInfo) -> str:
        """Where a shard's bytes live, whatever source URL named it (keys the block cache)."""
        path = self._path(shard.name)
        where = path if self.is_http else f"{self.protocol}://{path}"
        return f"{where}|{self._endpoint()}"

    def describe(self) -> str:
        return self.config.url

    def _path(self, name: str) -> str:
        """The store's path (on HTTP the URL) of a name relative to the root."""
        if self.is_http:
            name = urllib.parse.quote(name, safe="/:@!$&'()*+,;=~")
        return f"{self.root}/{name}" if self.root else name

    def _name(self, path: str) -> str:
        """A listed path relative to the root (on HTTP without URL escapes)."""
        prefix = self.root + "/" if self.root else ""
        name = path[len(prefix) :] if path.startswith(prefix) else path
        return urllib.parse.unquote(name) if self.is_http else name

    def _call(self, what: str, func: Callable[[], T]) -> T:
        try:
            return func()
        except ShardfsError:
            raise
        except Exception as exc:
            raise translate_errors(what, exc) from exc

    def list_shards(self) -> list[ShardInfo]:
        """The shards the source URL names, sorted by name: every ``*.tar`` under a folder
        (recursively), the ones a glob matches, or exactly those a brace pattern or a
        ``.tar`` URL names (each must exist)."""
        selection = self._selection
        if selection.names is not None:
            shards = self._named_shards(list(selection.names))
        else:
            shards = self._listed_shards(selection.globs)
        if not shards:
            self._raise_nothing_found()
        self._note_unchecked(shards)
        return sorted(shards, key=lambda s: s.name)

    def _named_shards(self, names: list[str]) -> list[ShardInfo]:
        """Exact names: one HEAD each over HTTP (no listing needed), one listing per folder
        elsewhere; a single ``.tar`` URL that is a folder is listed as one."""
        url = self.config.url
        if self.is_http:
            objects = self._call(url, lambda: self._head_many(names))
            found = {n: o for n, o in zip(names, objects, strict=True) if o is not None}
            shards = [ShardInfo(n, o.size, o.version) for n, o in found.items()]
        elif self._selection.single:
            info = self._call(url, lambda: self._info_or_none(self._path(names[0])))
            if info is not None and info.get("type") == "directory":
                self.root = self._path(names[0])
                self._selection = _Selection(root=url)
                return self._listed_shards(None)
            shards = [] if info is None else [self._shard_of(names[0], info)]
        else:
            shards = self._call(url, lambda: self._listed_folders(names))
        missing = sorted(set(names) - {s.name for s in shards})
        if missing and self._selection.single:
            raise SourceNotFoundError(f"{url}: not found")
        if missing:
            raise SourceNotFoundError(
                f"{url}: {len(missing)} of {len(names)} shard(s) of the pattern are missing, "
                f"first: {self._path(missing[0]) if self.is_http else missing[0]}"
            )
        return shards

    def _listed_folders(self, names: list[str]) -> list[ShardInfo]:
        wanted = set(names)
        shards = []
        for folder in sorted({posixpath.dirname(n) for n in names}):
            path = self._path(folder) if folder else self.root
            try:
                entries = self.fs.ls(path, detail=True)
            except FileNotFoundError:
                continue
            for entry in entries:
                name = self._name(str(entry["name"]).rstrip("/"))
                if name in wanted and entry.get("type", "file") == "file":
                    shards.append(self._shard_of(name, entry))
        return shards

    def _listed_shards(self, globs: tuple[str, ...] | None) -> list[ShardInfo]:
        """Every ``*.tar`` under the root that one of ``globs`` (if any) matches."""
        found = self._call(self.config.url, lambda: self._find())
        self._listed = len(found)
        matchers = [glob_regex(g) for g in globs or ()]
        picked: dict[str, dict[str, Any]] = {}
        for path, info in found.items():
            if info.get("type", "file") != "file" or not path.endswith(SHARD_SUFFIX):
                continue
            name = self._name(path)
            if matchers and not any(m.fullmatch(name) for m in matchers):
                continue
            picked[name] = info
        if self.is_http:  # an HTML listing gives no size or version
            names = sorted(picked)
            objects = self._call(self.config.url, lambda: self._head_many(names))
            return [
                ShardInfo(n, o.size, o.version)
                for n, o in zip(names, objects, strict=True)
                if o is not None
            ]
        return [self._shard_of(name, info) for name, info in picked.items()]

    def _shard_of(self, name: str, info: dict[str, Any]) -> ShardInfo:
        if info.get("size") is None:  # a listing without sizes: ask for this one
            info = self._call(name, lambda: self.fs.info(self._path(name)))
        return ShardInfo(name=name, size=int(info["size"]), etag=_etag_of(info))

    def _info_or_none(self, path: str) -> dict[str, Any] | None:
        try:
            return cast(dict[str, Any], self.fs.info(path))
        except FileNotFoundError:
            return None

    def _head_many(self, names: list[str]) -> list[http_ranges.HttpObject | None]:
        urls = [self._path(n) for n in names]
        return http_ranges.head_many(self.fs, urls, timeout=self.config.read_timeout)

    def _find(self) -> dict[str, dict[str, Any]]:
        try:
            return cast(dict[str, dict[str, Any]], self.fs.find(self.root, detail=True))
        except FileNotFoundError:
            return {}

    def _raise_nothing_found(self) -> None:
        url = self.config.url
        what = "match the pattern" if self._selection.globs else "found"
        if self.is_http:
            text = f"{url}: no *{SHARD_SUFFIX} links {what} in the server's folder listing"
            if not self._listed:
                text += (
                    " (where a server lists no folders, as the Hugging Face hub, name the "
                    "shards with a brace pattern: .../shard-{000000..000099}.tar)"
                )
            raise SourceNotFoundError(text)
        bucket = self.root.split("/", 1)[0]
        if self.protocol in ("s3", "s3a", "gs", "gcs") and bucket:
            exists = self._call(url, lambda: self.fs.exists(bucket))
            if not exists:
                raise SourceNotFoundError(f"{url}: bucket {bucket!r} does not exist")
        exists = self._call(url, lambda: self.fs.exists(self.root))
        if not exists:
            raise SourceNotFoundError(f"{url}: no such folder or prefix")
        raise SourceNotFoundError(f"{url}: no *{SHARD_SUFFIX} shards {what}")

    def _note_unchecked(self, shards: list[ShardInfo]) -> None:
        """Word, once, that reads cannot tell a replaced shard from the indexed one where the
        store gives nothing to check (``version_warning``; callers show it to the user)."""
        if self._unversioned is not None:
            return
        self._unversioned = [s.name for s in shards if not s.etag] if self.is_http else []
        if self._unversioned:
            self.version_warning = (
                f"{self.config.url}: the server gives no ETag or Last-Modified for "
                f"{len(self._unversioned)} shard(s) (first: {self._unversioned[0]}), so no "
                "version check: a shard changed in place may be served mixed"
            )
        elif not self.checks_identity:
            self.version_warning = (
                f"{self.config.url}: this store ({self.protocol}) offers no version check on "
                "reads, only a length check: a shard changed in place may be served mixed"
            )

    def _current(self, shard: ShardInfo) -> ShardInfo | None:
        """The shard as the store shows it now, or None if it is gone."""
        if self.is_http:
            (found,) = self._call(shard.name, lambda: self._head_many([shard.name]))
            return None if found is None else ShardInfo(shard.name, found.size, found.version)
        info = self._call(shard.name, lambda: self._info_or_none(self._path(shard.name)))
        return None if info is None else ShardInfo(shard.name, int(info["size"]), _etag_of(info))

    def check_current(self, shard: ShardInfo) -> None:
        """Raise ShardChangedError if the shard no longer matches what was indexed."""
        current = self._current(shard)
        if current is None:
            raise ShardChangedError(f"{shard.name}: gone from the store")
        if current.identity != shard.identity:
            raise ShardChangedError(f"{shard.name}: changed in the store since it was indexed")

    def read_range(self, shard: ShardInfo, start: int, end: int, *, retries: int = 4) -> bytes:
        """Bytes ``[start, end)`` of a shard as indexed.

        Every answer is checked against the request and the shard's identity. Transient
        failures (5xx, 429, resets, stalls, a wrong length or range) are retried with backoff,
        up to ``retries`` attempts and within ``read_timeout`` seconds; then StoreReadError.
        A shard that is another version or gone raises ShardChangedError at once.
        """
        path = self._path(shard.name)
        deadline = time.monotonic() + self.config.read_timeout
        delay = 0.1
        attempt = 0
        while True:
            attempt += 1
            try:
                return self._get_range(path, shard, start, end, deadline)
            except PreconditionFailed as exc:
                raise ShardChangedError(f"{shard.name}: changed in the store ({exc})") from exc
            except FileNotFoundError as exc:
                raise ShardChangedError(f"{shard.name}: gone from the store") from exc
            except ShardfsError:
                raise
            except _PROGRAMMING_ERRORS:
                raise  # a bug is not retried: it would fail the same way each time
            except Exception as exc:
                left = deadline - time.monotonic()
                if attempt >= retries or left <= delay:
                    if isinstance(exc, WrongLengthError):
                        self._raise_if_changed(shard)
                    err = translate_errors(f"{shard.name} [{start}:{end}]", exc)
                    raise StoreReadError(f"{err} (after {attempt} attempt(s))") from exc
                log.warning("read %s [%d:%d] failed (%s); retrying", shard.name, start, end, exc)
                time.sleep(delay)
                delay = min(delay * 2, 2.0)

    def _raise_if_changed(self, shard: ShardInfo) -> None:
        """ShardChangedError if the listing no longer shows the indexed shard; quiet if it
        does or if the store cannot say."""
        try:
            self.check_current(shard)
        except ShardChangedError:
            raise
        except ShardfsError as exc:
            log.debug("could not check %s against the store: %s", shard.name, exc)

    def _get_range(
        self, path: str, shard: ShardInfo, start: int, end: int, deadline: float
    ) -> bytes:
        """One checked ranged GET: a presigned URL on S3 when that path works, else s3fs;
        a local file directly; any other store through fsspec."""
        timeout = max(0.05, deadline - time.monotonic())
        if self.protocol in _LOCAL_PROTOCOLS:
            return _read_local_file(path, shard, start, end)
        if self.is_http:
            return http_ranges.get_range(self.fs, path, start, end, shard.size, shard.etag, timeout)
        if self.protocol not in ("s3", "s3a"):
            return self._get_range_fsspec(path, shard, start, end, timeout)
        fast = self._presigned
        if fast is not None and time.monotonic() >= self._fast_paused_until:
            try:
                data = fast.get(path, start, end, shard.size, shard.etag, deadline)
            except (PreconditionFailed, TransientError, FileNotFoundError):
                raise  # another version, a failure read_range retries, or gone for both paths
            except Exception as exc:
                timeout = max(0.05, deadline - time.monotonic())
                data = s3_ranges.get_range(
                    self.fs, path, start, end, shard.size, shard.etag, timeout
                )
                # Only a failure that s3fs does not share is the fast path's own (a 403 on
                # both, say, is the store's answer, not a reason to stop presigning).
                self._fast_path_failed(exc)
                return data
            else:
                self._fast_failures = 0
                return data
        return s3_ranges.get_range(self.fs, path, start, end, shard.size, shard.etag, timeout)

    def _fast_path_failed(self, exc: Exception) -> None:
        """This request goes through s3fs, which checks the same things; after several
        failures in a row, all requests do for a while."""
        with self._fast_lock:
            self._fast_failures += 1
            if self._fast_failures < _FAST_FAILURES_TO_PAUSE:
                log.info("presigned GET failed (%s); this request goes through s3fs", exc)
                return
            self._fast_failures = 0
            self._fast_paused_until = time.monotonic() + _FAST_PAUSE_S
        log.info(
            "presigned GETs failed %d times in a row (last: %s); using s3fs for %.0f s",
            _FAST_FAILURES_TO_PAUSE,
            exc,
            _FAST_PAUSE_S,
        )

    def _get_range_fsspec(
        self, path: str, shard: ShardInfo, start: int, end: int, timeout: float
    ) -> bytes:
        """A store without a checked path of ours: only the length can be checked."""
        loop = getattr(self.fs, "loop", None)
        cat = getattr(self.fs, "_cat_file", None)
        if getattr(self.fs, "async_impl", False) and loop is not None and cat is not None:
            from fsspec.asyn import sync

            data = bytes(sync(loop, cat, path, start=start, end=end, timeout=timeout))
        else:
            data = bytes(self.fs.cat_file(path, start=start, end=end))
        if len(data) != end - start:
            raise WrongLengthError(
                f"{shard.name}: store returned {len(data)} bytes for [{start}:{end}]"
            )
        return data

    @property
    def checks_identity(self) -> bool:
        """Whether every read is checked against the indexed version of its shard (over
        HTTP: once listed, whether every shard has an ETag or a Last-Modified date)."""
        if self.is_http:
            return self._unversioned is not None and not self._unversioned
        return self.protocol in ("s3", "s3a", *_LOCAL_PROTOCOLS)

    @contextlib.contextmanager
    def open_stream(self, shard: ShardInfo, block_size: int = 8 << 20) -> Iterator[Readable]:
        """A sequential reader over a whole shard, for index scans: checked ranged reads of
        ``block_size`` bytes, the next one fetched while the caller parses this one."""
        stream = _ShardStream(self, shard, block_size)
        try:
            yield stream
        finally:
            stream.close()

    def read_object(self, name: str) -> bytes | None:
        """A small object next to the shards (sidecar, classes.txt), or None if absent."""
        path = self._path(name)
        try:
            return bytes(self.fs.cat_file(path))
        except FileNotFoundError:
            return None
        except Exception as exc:
            raise translate_errors(name, exc) from exc

    def list_names(self) -> list[str]:
        """Names of every object under the root (empty if the root does not exist)."""
        prefix = self.root + "/" if self.root else ""
        try:
            found = self.fs.find(self.root, detail=False)
        except FileNotFoundError:
            return []
        except Exception as exc:
            raise translate_errors(self.config.url, exc) from exc
        return sorted(p[len(prefix) :] if p.startswith(prefix) else p for p in found)

    def put_file_atomic(self, local_path: str, name: str) -> None:
        """Upload a local file so that ``name`` appears complete or not at all.

        Object stores make a PUT (or a completed multipart upload) visible whole; on a
        local or mounted folder we write a hidden temp name and rename it.
        """
        path = self._path(name)
        try:
            if self.protocol in ("file", "local"):
                folder, base = posixpath.split(path)
                self.fs.makedirs(folder, exist_ok=True)
                tmp = posixpath.join(folder, f".{base}.tmp-{os.getpid()}-{time.monotonic_ns()}")
                self.fs.put_file(local_path, tmp)
                self.fs.mv(tmp, path)
            else:
                self.fs.put_file(local_path, path)
        except Exception as exc:
            raise translate_errors(name, exc) from exc
        self.fs.invalidate_cache(path)

    @contextlib.contextmanager
    def atomic_writer(self, name: str) -> Iterator[IO[bytes]]:
        """A file to write ``name`` into; it appears complete when the block exits cleanly,
        and not at all otherwise. A local destination is written in place under a hidden
        temp name (no second copy); other stores get a local temp file and one upload."""
        if self.protocol not in ("file", "local"):
            with tempfile.NamedTemporaryFile(prefix=".shardfs-pack-", suffix=".tar") as tmp:
                yield tmp
                tmp.flush()
                self.put_file_atomic(tmp.name, name)
            return
        path = self._path(name)
        folder, base = posixpath.split(path)
        tmp_path = posixpath.join(folder, f".{base}.tmp-{os.getpid()}-{time.monotonic_ns()}")
        try:
            os.makedirs(folder, exist_ok=True)
            handle = open(tmp_path, "wb")  # noqa: SIM115 - closed below, before the rename
        except OSError as exc:
            raise translate_errors(name, exc) from exc
        try:
            yield handle
            handle.close()
            os.replace(tmp_path, path)
        except BaseException:
            handle.close()
            with contextlib.suppress(OSError):
                os.unlink(tmp_path)
            raise
        self.fs.invalidate_cache(path)

    def remove_temp_files(self, names: list[str]) -> list[str]:
        """Delete the temp names a killed ``put_file_atomic`` left among ``names``."""
        left = [n for n in names if _TEMP_NAME.fullmatch(posixpath.basename(n))]
        for name in left:
            path = self._path(name)
            try:
                self.fs.rm_file(path)
            except FileNotFoundError:
                pass
            except Exception as exc:
                raise translate_errors(name, exc) from exc
            self.fs.invalidate_cache(path)
        return left

    def write_object(self, name: str, data: bytes) -> None:
        """Write a small object next to the shards in one PUT."""
        path = self._path(name)
        if self.protocol in ("file", "local"):
            self._call(name, lambda: self.fs.makedirs(posixpath.dirname(path), exist_ok=True))
        self._call(name, lambda: self.fs.pipe_file(path, data))
        self.fs.invalidate_cache(path)


def _read_local_file(path: str, shard: ShardInfo, start: int, end: int) -> bytes:
    """Bytes of a shard in a local folder, refused if the file is not the indexed version."""
    fd = os.open(path, os.O_RDONLY)
    try:
        status = os.fstat(fd)
        version = _etag_of({"mtime": status.st_mtime})
        if status.st_size != shard.size or (
            shard.etag.startswith("mtime:") and version != shard.etag
        ):
            raise PreconditionFailed(f"{path}: size or modification time differs from the index")
        data = os.pread(fd, end - start, start)
    finally:
        os.close(fd)
    if len(data) != end - start:
        raise WrongLengthError(f"{path}: read {len(data)} bytes of [{start}:{end}]")
    return data


class _ShardStream:
    """A shard read front to back in checked ranged reads, one chunk ahead of the reader."""

    def __init__(self, store: Store, shard: ShardInfo, chunk: int) -> None:
        self._store = store
        self._shard = shard
        self._chunk = max(1, chunk)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="scan-ahead")
        self._buffer = b""
        self._pos = 0  # within _buffer
        self._next_start = 0  # shard offset of the next chunk to request
        self._ahead: Future[bytes] | None = None
        self._request_next()

    def _request_next(self) -> None:
        start = self._next_start
        end = min(start + self._chunk, self._shard.size)
        if start >= end:
            self._ahead = None
            return
        self._next_start = end
        self._ahead = self._pool.submit(self._store.read_range, self._shard, start, end)

    def _refill(self) -> bool:
        ahead = self._ahead
        if ahead is None:
            return False
        self._buffer = ahead.result()
        self._pos = 0
        self._request_next()
        return True

    def read(self, n: int = -1, /) -> bytes:
        if n < 0:
            parts = [self._buffer[self._pos :]]
            while self._refill():
                parts.append(self._buffer)
            self._buffer, self._pos = b"", 0
            return b"".join(parts)
        if self._pos >= len(self._buffer) and not self._refill():
            return b""
        data = self._buffer[self._pos : self._pos + n]
        self._pos += len(data)
        return data

    def close(self) -> None:
        if self._ahead is not None:
            self._ahead.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)

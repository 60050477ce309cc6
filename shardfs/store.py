"""The only module that talks to the store: listing, ranged reads, streams and small objects.

Everything goes through fsspec, so every backend it knows (s3, gcs, http, file, memory)
works. Foreign exceptions (botocore, aiohttp, OSError) are translated here, in one place.
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
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO, Any, TypeVar, cast

import fsspec
from fsspec.core import url_to_fs

from .config import SourceConfig
from .errors import (
    ShardChangedError,
    ShardfsError,
    SourceError,
    SourceNotFoundError,
    StoreReadError,
    UsageError,
)
from .presigned import PreconditionFailed, PresignedRanges, TransientError
from .tar import Readable

log = logging.getLogger(__name__)

SHARD_SUFFIX = ".tar"
# put_file_atomic's temp names on a local folder: ``.NAME.tmp-PID-NS``.
_TEMP_NAME = re.compile(r"\..+\.tmp-\d+-\d+")
T = TypeVar("T")


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
        choices = [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
        if not choices:
            raise UsageError(f"empty brace range {{{body}}} in {pattern!r}")
    else:
        choices = [c for part in _split_top_level(body) for c in expand_braces(part)]
    return [head + choice + rest for choice in choices for rest in expand_braces(tail)]


def _etag_of(info: dict[str, Any]) -> str:
    """A shard's version: ETag, else VersionId, else modification time (local files)."""
    for key in ("ETag", "etag", "VersionId", "version_id", "generation", "md5Hash"):
        if info.get(key):
            return str(info[key]).strip('"')
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
    if "Connect" in name or "Endpoint" in name or isinstance(exc, ConnectionError):
        return SourceError(f"{what}: cannot connect to the store ({text})")
    return SourceError(f"{what}: {name}: {text}")


class Store:
    """A source of shards behind an fsspec filesystem."""

    def __init__(self, config: SourceConfig) -> None:
        self.config = config
        options = dict(config.storage_options)
        url = config.url
        if config.endpoint_url:
            options.setdefault("client_kwargs", {})
            if not isinstance(options["client_kwargs"], dict):
                raise UsageError("storage option client_kwargs must be a mapping")
            options["client_kwargs"] = {
                **options["client_kwargs"],
                "endpoint_url": config.endpoint_url,
            }
        self._pattern: list[str] | None = None
        if "{" in url:
            self._pattern = expand_braces(url)
            url = posixpath.dirname(self._pattern[0])
        try:
            fs, root = url_to_fs(url, **options)
        except ImportError as exc:
            hint = "install the matching extra, e.g. shardfs[s3]"
            raise UsageError(f"{config.url}: {exc} ({hint})") from exc
        except (ValueError, TypeError) as exc:
            raise UsageError(f"{config.url}: {exc}") from exc
        self.fs: fsspec.AbstractFileSystem = fs
        self.root: str = root.rstrip("/")
        self._presigned: PresignedRanges | None = None
        if self.protocol in ("s3", "s3a") and hasattr(fs, "url"):
            self._presigned = PresignedRanges(fs)

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
    def identity(self) -> str:
        """A stable id of this source, used to key the persisted index."""
        text = f"{self.protocol}://{self.root}|{self._endpoint()}|{'|'.join(self._pattern or [])}"
        return hashlib.sha256(text.encode()).hexdigest()[:20]

    def location(self, shard: ShardInfo) -> str:
        """Where a shard's bytes live, whatever source URL named it (keys the block cache)."""
        return f"{self.protocol}://{self._path(shard.name)}|{self._endpoint()}"

    def describe(self) -> str:
        return self.config.url

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}" if self.root else name

    def _call(self, what: str, func: Callable[[], T]) -> T:
        try:
            return func()
        except ShardfsError:
            raise
        except Exception as exc:
            raise translate_errors(what, exc) from exc

    def list_shards(self) -> list[ShardInfo]:
        """List ``*.tar`` shards under the root (recursively), sorted by name."""
        found = self._call(self.config.url, lambda: self._find())
        prefix = self.root + "/" if self.root else ""
        shards = []
        for path, info in found.items():
            if info.get("type", "file") != "file" or not path.endswith(SHARD_SUFFIX):
                continue
            name = path[len(prefix) :] if path.startswith(prefix) else path
            shards.append(ShardInfo(name=name, size=int(info["size"]), etag=_etag_of(info)))
        if self._pattern is not None:
            wanted = {posixpath.basename(p) for p in self._pattern}
            shards = [s for s in shards if s.name in wanted]
            missing = sorted(wanted - {s.name for s in shards})
            if missing:
                raise SourceNotFoundError(
                    f"{self.config.url}: {len(missing)} shard(s) of the pattern are missing, "
                    f"first: {missing[0]}"
                )
        if not shards:
            self._raise_nothing_found()
        return sorted(shards, key=lambda s: s.name)

    def _find(self) -> dict[str, dict[str, Any]]:
        if self._pattern is not None:
            entries = self.fs.ls(self.root, detail=True)
            return {str(e["name"]).rstrip("/"): e for e in entries}
        return cast(dict[str, dict[str, Any]], self.fs.find(self.root, detail=True))

    def _raise_nothing_found(self) -> None:
        url = self.config.url
        bucket = self.root.split("/", 1)[0]
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        if protocol in ("s3", "s3a", "gs", "gcs") and bucket:
            exists = self._call(url, lambda: self.fs.exists(bucket))
            if not exists:
                raise SourceNotFoundError(f"{url}: bucket {bucket!r} does not exist")
        exists = self._call(url, lambda: self.fs.exists(self.root))
        if not exists:
            raise SourceNotFoundError(f"{url}: no such folder or prefix")
        raise SourceNotFoundError(f"{url}: no *{SHARD_SUFFIX} shards found")

    def check_current(self, shard: ShardInfo) -> None:
        """Raise ShardChangedError if the shard no longer matches what was indexed."""
        info = self._call(shard.name, lambda: self.fs.info(self._path(shard.name)))
        current = ShardInfo(shard.name, int(info["size"]), _etag_of(info))
        if current.identity != shard.identity:
            raise ShardChangedError(f"{shard.name}: changed in the store since it was indexed")

    def read_range(self, shard: ShardInfo, start: int, end: int, *, retries: int = 4) -> bytes:
        """Bytes ``[start, end)`` of a shard, retried with backoff on transient failures."""
        path = self._path(shard.name)
        delay = 0.1
        for attempt in range(1, retries + 1):
            try:
                data = self._get_range(path, shard, start, end)
            except PreconditionFailed as exc:
                raise ShardChangedError(f"{shard.name}: changed in the store (ETag)") from exc
            except FileNotFoundError as exc:
                raise ShardChangedError(f"{shard.name}: gone from the store") from exc
            except Exception as exc:
                if attempt == retries:
                    err = translate_errors(f"{shard.name} [{start}:{end}]", exc)
                    raise StoreReadError(str(err)) from exc
                log.warning("read %s [%d:%d] failed (%s); retrying", shard.name, start, end, exc)
                time.sleep(delay)
                delay *= 2
                continue
            if len(data) != end - start:
                raise ShardChangedError(
                    f"{shard.name}: store returned {len(data)} bytes for [{start}:{end}]; "
                    "the shard changed or is shorter than indexed"
                )
            return bytes(data)
        raise AssertionError("unreachable")

    def _get_range(self, path: str, shard: ShardInfo, start: int, end: int) -> bytes:
        """One ranged GET: through a presigned URL on S3 when that works, else via fsspec."""
        fast = self._presigned
        if fast is not None:
            try:
                return fast.get(path, start, end, shard.etag)
            except (PreconditionFailed, TransientError):
                raise  # a changed shard, or a failure read_range retries on this same path
            except Exception as exc:
                log.info("presigned GET failed (%s); using s3fs for this source", exc)
                self._presigned = None
        return bytes(self.fs.cat_file(path, start=start, end=end))

    @contextlib.contextmanager
    def open_stream(self, shard: ShardInfo, block_size: int = 8 << 20) -> Iterator[Readable]:
        """A sequential reader over a whole shard, for index scans."""
        path = self._path(shard.name)
        try:
            handle = self.fs.open(path, "rb", block_size=block_size, cache_type="readahead")
        except Exception as exc:
            raise translate_errors(shard.name, exc) from exc
        try:
            yield _TranslatingReader(handle, shard.name)
        finally:
            with contextlib.suppress(Exception):
                handle.close()

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


class _TranslatingReader:
    """Wraps a store file so that read errors surface as ShardfsError."""

    def __init__(self, handle: IO[bytes], name: str) -> None:
        self._handle = handle
        self._name = name

    def read(self, n: int = -1) -> bytes:
        try:
            return self._handle.read(n)
        except Exception as exc:
            raise translate_errors(self._name, exc) from exc

"""Where a source's shards are and which they are: the store paths of shard names, and the
listing (or, for exact names, the probing) that finds the shards a source URL names.
"""

from __future__ import annotations

import posixpath
import urllib.parse
from collections.abc import Callable
from typing import Any, TypeVar, cast

import fsspec

from ..config import SourceConfig
from ..errors import ShardfsError, SourceNotFoundError
from . import http_ranges
from .client import translate_errors, version_of
from .shards import ShardInfo
from .urls import (
    HTTP_PROTOCOLS,
    Selection,
    compressed_advice,
    compressed_suffix,
    glob_regex,
    is_shard_name,
    shard_patterns,
)

T = TypeVar("T")


class ShardListing:
    """The shards of one source in its filesystem: ``root`` is the folder the selection's
    names are relative to (a single ``.tar`` URL that is a folder moves it there)."""

    def __init__(
        self,
        fs: fsspec.AbstractFileSystem,
        root: str,
        config: SourceConfig,
        selection: Selection,
        protocol: str,
    ) -> None:
        self.fs = fs
        self.root = root
        self.config = config
        self.selection = selection
        self.is_http = protocol in HTTP_PROTOCOLS
        self.protocol = protocol
        self._listed = 0  # paths the last folder listing gave
        self._compressed: list[str] = []  # compressed tars the last listing left out
        # Set by ``shards`` when compressed tars were left out beside the .tar shards.
        self.skipped_warning: str | None = None

    def path(self, name: str) -> str:
        """The store's path (on HTTP the URL) of a name relative to the root."""
        if self.is_http:
            name = urllib.parse.quote(name, safe="/:@!$&'()*+,;=~")
        return f"{self.root}/{name}" if self.root else name

    def name(self, path: str) -> str:
        """A listed path relative to the root (on HTTP without URL escapes)."""
        prefix = self.root + "/" if self.root else ""
        name = path[len(prefix) :] if path.startswith(prefix) else path
        return urllib.parse.unquote(name) if self.is_http else name

    def call(self, what: str, func: Callable[[], T]) -> T:
        """``func()``, its foreign exceptions translated to ours."""
        try:
            return func()
        except ShardfsError:
            raise
        except Exception as exc:
            raise translate_errors(what, exc) from exc

    def shards(self) -> list[ShardInfo]:
        """The shards the source URL names, sorted by name: every shard name (``*.tar``,
        ``*.zip``: ``SHARD_SUFFIXES``) under a folder
        (recursively), the ones a glob matches, or exactly those a brace pattern or a
        ``.tar`` URL names (each must exist)."""
        selection = self.selection
        if selection.names is not None:
            shards = self._named_shards(list(selection.names))
        else:
            shards = self._listed_shards(selection.globs)
        if not shards:
            self._raise_nothing_found()
        if self._compressed:
            self.skipped_warning = f"{self.config.url}: skipped {self._compressed_summary()}"
        return sorted(shards, key=lambda s: s.name)

    def _named_shards(self, names: list[str]) -> list[ShardInfo]:
        """Exact names: one HEAD each over HTTP (no listing needed), one listing per folder
        elsewhere; a single ``.tar`` URL that is a folder is listed as one."""
        url = self.config.url
        if self.is_http:
            objects = self.call(url, lambda: self.head_many(names))
            found = {n: o for n, o in zip(names, objects, strict=True) if o is not None}
            shards = [ShardInfo(n, o.size, o.version) for n, o in found.items()]
        elif self.selection.single:
            info = self.call(url, lambda: self.info_or_none(self.path(names[0])))
            if info is not None and info.get("type") == "directory":
                self.root = self.path(names[0])
                self.selection = Selection(root=url)
                return self._listed_shards(None)
            shards = [] if info is None else [self._shard_of(names[0], info)]
        else:
            shards = self.call(url, lambda: self._listed_folders(names))
        missing = sorted(set(names) - {s.name for s in shards})
        if missing and self.selection.single:
            raise SourceNotFoundError(f"{url}: not found")
        if missing:
            raise SourceNotFoundError(
                f"{url}: {len(missing)} of {len(names)} shard(s) of the pattern are missing, "
                f"first: {self.path(missing[0]) if self.is_http else missing[0]}"
            )
        return shards

    def _listed_folders(self, names: list[str]) -> list[ShardInfo]:
        wanted = set(names)
        shards = []
        for folder in sorted({posixpath.dirname(n) for n in names}):
            path = self.path(folder) if folder else self.root
            try:
                entries = self.fs.ls(path, detail=True)
            except FileNotFoundError:
                continue
            for entry in entries:
                name = self.name(str(entry["name"]).rstrip("/"))
                if name in wanted and entry.get("type", "file") == "file":
                    shards.append(self._shard_of(name, entry))
        return shards

    def _listed_shards(self, globs: tuple[str, ...] | None) -> list[ShardInfo]:
        """Every shard (``is_shard_name``) under the root that one of ``globs`` (if any) matches."""
        found = self.call(self.config.url, lambda: self._find())
        self._listed = len(found)
        matchers = [glob_regex(g) for g in globs or ()]
        picked: dict[str, dict[str, Any]] = {}
        self._compressed = []
        for path, info in found.items():
            # With --format, a glob's every match is a shard of that format.
            is_shard = is_shard_name(path, self.config.shard_format) or bool(
                matchers and self.config.shard_format != "auto"
            )
            if info.get("type", "file") != "file" or not (is_shard or compressed_suffix(path)):
                continue
            name = self.name(path)
            if matchers and not any(m.fullmatch(name) for m in matchers):
                continue
            if is_shard:
                picked[name] = info
            else:
                self._compressed.append(name)
        self._compressed.sort()
        if self.is_http:  # an HTML listing gives no size or version
            names = sorted(picked)
            objects = self.call(self.config.url, lambda: self.head_many(names))
            return [
                ShardInfo(n, o.size, o.version)
                for n, o in zip(names, objects, strict=True)
                if o is not None
            ]
        return [self._shard_of(name, info) for name, info in picked.items()]

    def _shard_of(self, name: str, info: dict[str, Any]) -> ShardInfo:
        if info.get("size") is None:  # a listing without sizes: ask for this one
            info = self.call(name, lambda: self.fs.info(self.path(name)))
        return ShardInfo(name=name, size=int(info["size"]), etag=version_of(info))

    def info_or_none(self, path: str) -> dict[str, Any] | None:
        try:
            return cast(dict[str, Any], self.fs.info(path))
        except FileNotFoundError:
            return None

    def head_many(self, names: list[str]) -> list[http_ranges.HttpObject | None]:
        urls = [self.path(n) for n in names]
        return http_ranges.head_many(self.fs, urls, timeout=self.config.read_timeout)

    def _find(self) -> dict[str, dict[str, Any]]:
        try:
            return cast(dict[str, dict[str, Any]], self.fs.find(self.root, detail=True))
        except FileNotFoundError:
            return {}

    def _compressed_summary(self) -> str:
        """``2 compressed tars (first: a.tar.zst): compressed tars are not supported...``"""
        count, first = len(self._compressed), self._compressed[0]
        which = (
            f"1 compressed tar ({first})"
            if count == 1
            else f"{count} compressed tars (first: {first})"
        )
        return f"{which}: {compressed_advice(first, count)}"

    def _probe_folder(self) -> None:
        """Why an HTTP folder URL listed nothing: fsspec's listing swallows a refused
        connection and a 404, so ask once more for the folder itself and say what happened."""
        url = self.config.url
        try:
            self.fs.ls(self.root, detail=False)
        except FileNotFoundError as exc:  # fsspec's word for a 404
            raise SourceNotFoundError(
                f"{url}: the folder URL answered 404 Not Found (where a server lists no "
                "folders, as the Hugging Face hub, name the shards with a brace pattern: "
                ".../shard-{000000..000099}.tar)"
            ) from exc
        except Exception as exc:
            raise translate_errors(url, exc) from exc

    def _raise_nothing_found(self) -> None:
        url = self.config.url
        what = "match the pattern" if self.selection.globs else "found"
        if self._compressed:
            summary = self._compressed_summary()
            raise SourceNotFoundError(f"{url}: no {shard_patterns()} shards {what}, only {summary}")
        if self.is_http and not self._listed:
            self._probe_folder()
        if self.is_http:
            text = f"{url}: no {shard_patterns()} links {what} in the server's folder listing"
            if not self._listed:
                text += (
                    " (where a server lists no folders, as the Hugging Face hub, name the "
                    "shards with a brace pattern: .../shard-{000000..000099}.tar)"
                )
            raise SourceNotFoundError(text)
        bucket = self.root.split("/", 1)[0]
        if self.protocol in ("s3", "s3a", "gs", "gcs") and bucket:
            exists = self.call(url, lambda: self.fs.exists(bucket))
            if not exists:
                raise SourceNotFoundError(f"{url}: bucket {bucket!r} does not exist")
        exists = self.call(url, lambda: self.fs.exists(self.root))
        if not exists:
            raise SourceNotFoundError(f"{url}: no such folder or prefix")
        raise SourceNotFoundError(f"{url}: no {shard_patterns()} shards {what}")

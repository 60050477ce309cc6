"""Which shards a source URL names: a folder, one ``.tar``, a brace pattern
(``shard-{000..009}.tar``) or a glob (``shard-*.tar``); and how the mount table names the
sources. Pure text: nothing here talks to the store. Shard names are relative to the part
of the URL before the first wildcard.
"""

from __future__ import annotations

import os
import posixpath
import re
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import UsageError

SHARD_SUFFIX = ".tar"
# Every name suffix a listing takes for a shard; which parser reads each is the formats
# package's business (``shardfs.formats.registry``).
FORMAT_SUFFIXES: dict[str, tuple[str, ...]] = {
    "tar": (SHARD_SUFFIX, ".tar.gz", ".tgz"),
    "zip": (".zip",),
    "parquet": (".parquet",),
    "mds": (".mds", ".mds.zstd"),
}
SHARD_SUFFIXES: tuple[str, ...] = tuple(s for group in FORMAT_SUFFIXES.values() for s in group)
# ``--format``: auto picks each shard's parser by its suffix; a format name reads every
# shard the source names with that parser (see ``is_shard_name``).
SHARD_FORMATS: tuple[str, ...] = ("auto", *FORMAT_SUFFIXES)
# A brace pattern naming more shards than this is a typo, not a dataset.
MAX_PATTERN_SHARDS = 1_000_000
HTTP_PROTOCOLS = ("http", "https")
# Compressed tars that cannot be shards yet (no seek points: gzip's are, ``formats.tar_gz``),
# and the command that turns each into a plain .tar next to it.
COMPRESSED_SUFFIXES = {
    ".tar.zst": "zstd -d", ".tzst": "zstd -d",
    ".tar.bz2": "bunzip2", ".tbz2": "bunzip2", ".tar.xz": "unxz", ".txz": "unxz",
}  # fmt: skip
# Characters that make a source URL a glob; ``{`` starts a brace pattern.
_GLOB_CHARS = "*?["


def shard_patterns() -> str:
    """The shard names a listing takes, for messages: ``*.tar or *.zip``."""
    patterns = [f"*{suffix}" for suffix in SHARD_SUFFIXES]
    return " or ".join([", ".join(patterns[:-1]), patterns[-1]] if len(patterns) > 1 else patterns)


def is_shard_name(name: str, shard_format: str = "auto") -> bool:
    """Whether a listed name ends in one of the shard suffixes (of ``shard_format`` alone,
    when one is given)."""
    return name.endswith(
        SHARD_SUFFIXES if shard_format == "auto" else FORMAT_SUFFIXES[shard_format]
    )


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


@dataclass(frozen=True, slots=True)
class Selection:
    """Which shards a source URL names: ``root`` is the URL up to the last ``/`` before the
    first wildcard (the whole URL for a folder); ``names`` are exact shard names relative to
    it (a brace pattern or one ``.tar``); ``globs`` match names relative to it."""

    root: str
    names: tuple[str, ...] | None = None
    globs: tuple[str, ...] | None = None
    single: bool = False


def compressed_suffix(name: str) -> str | None:
    """The compressed-tar suffix ``name`` ends with (``.tar.zst``, ``.txz``, ...), or None."""
    lowered = name.lower()
    return next((s for s in COMPRESSED_SUFFIXES if lowered.endswith(s)), None)


def compressed_advice(name: str, count: int = 1) -> str:
    """Why a compressed tar is not mounted and how to make it mountable, for ``count`` of
    them of which ``name`` is one."""
    base = name.rstrip("/").rsplit("/", 1)[-1]
    tool = COMPRESSED_SUFFIXES[compressed_suffix(base) or ".tar.zst"]
    how = f"it ({tool} {base})" if count == 1 else f"them ({tool} ...)"
    return (
        f"compressed tars are not supported yet; decompress {how} or repack the files "
        "with shardfs pack"
    )


def _refuse_compressed(url: str, names: tuple[str, ...]) -> None:
    """A source that names a compressed tar (one URL, a brace pattern, a glob ending in
    ``.tar.zst``, ...) fails before the store is asked."""
    compressed = [n for n in names if compressed_suffix(n)]
    if compressed:
        first = compressed[0]
        raise UsageError(f"{url}: {compressed_advice(first, len(compressed))}")


MAX_TABLE_NAME = 1024
"""Characters of the mount table's source field at most (the kernel takes under 4096)."""
_PASSWORD = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://[^/@:]*):[^/@]*@")


def table_name(urls: Sequence[str]) -> str:
    """The sources as the mount table shows them (FUSE's fsname, in ``findmnt``, ``df``
    and ``mount``): the URLs joined by commas, local paths made absolute. The table is
    readable by every user, so a password in a URL is left out; control characters become
    ``?``, and a long text is cut to MAX_TABLE_NAME characters, ending in ``...``."""
    names = []
    for url in urls:
        if "://" not in url:
            url = os.path.abspath(url)
        names.append(_PASSWORD.sub(r"\1@", url))
    text = "".join(c if c.isprintable() else "?" for c in ",".join(names))
    return text if len(text) <= MAX_TABLE_NAME else text[: MAX_TABLE_NAME - 3] + "..."


_LOCAL_SCHEMES = ("file", "local")
_SAME_STORE = {"s3a": "s3", "gcs": "gs"}  # two spellings of one store


def _place(url: str) -> tuple[str, str]:
    """(store, path) of a URL or local path: a local one absolute with its symlinks
    resolved (as far as it exists), any other normalised, without a trailing ``/``."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme in _LOCAL_SCHEMES:
        return "file", os.path.realpath(rest if sep else url)
    return _SAME_STORE.get(scheme, scheme), posixpath.normpath(rest).rstrip("/")


def is_within(inner: str, outer: str) -> bool:
    """Whether ``inner`` is ``outer`` or lies below it, on the same store: local paths
    compared resolved (symlinks included), URLs by their path (``s3://b/x/out`` lies in
    ``s3://b/x``, ``s3://b/xy`` does not)."""
    inner_store, inner_path = _place(inner)
    outer_store, outer_path = _place(outer)
    if inner_store != outer_store:
        return False
    return inner_path == outer_path or inner_path.startswith(outer_path.rstrip("/") + "/")


def _path_start(url: str) -> int:
    """Where the path begins: after ``scheme://`` (and an http host), else 0."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return 0
    if scheme in HTTP_PROTOCOLS:
        slash = rest.find("/")
        return len(scheme) + 3 + (slash if slash >= 0 else len(rest))
    return len(scheme) + 3


def select(url: str) -> Selection:
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
            if is_shard_name(url):
                root, _, name = url.rpartition("/")
                return Selection(root=root or ".", names=(name,), single=True)
            _refuse_compressed(url, (url,))
            return Selection(root=url.rstrip("/") or url)
        cut = url.rfind("/", 0, min(magic))
    if cut < start:
        if start:  # a wildcard in the bucket or host name
            raise UsageError(f"{url}: a pattern must not reach into the bucket or host name")
        root, cut = ".", -1  # a relative local pattern such as shard-*.tar
    else:
        root = url[:cut] or "/"
    relative = [e[cut + 1 :] for e in expanded]
    _refuse_compressed(url, tuple(relative))  # a glob ending .tar.gz matches nothing else
    if any(c in e for e in relative for c in _GLOB_CHARS):
        return Selection(root=root, globs=tuple(relative))
    return Selection(root=root, names=tuple(relative))


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

"""What an index row may hold: member paths made relative and safe to present, symlink
targets, webdataset sample keys, and the integer labels of ``.cls`` / ``.json`` members.
Shards are untrusted input: a path the mount cannot present makes the shard bad. And a
tar stream's rows (``tar_rows``), for every format that holds a tar (plain or decoded)."""

from __future__ import annotations

import json
import posixpath

from ..errors import UnsafeMemberError
from ..store.shards import Readable
from .tar import MemberKind, TarMember, iter_members

LABEL_EXTENSIONS = frozenset({"cls", "json"})
IMAGE_EXTENSIONS = frozenset({"jpg", "jpeg", "png", "ppm", "bmp", "pgm", "tif", "tiff", "webp"})
MAX_LABEL_BYTES = 64 << 10

MemberRow = tuple[str, int, int, int, int, int, str, "int | None"]
"""(path, data offset, size, mode, mtime, kind, link target, label)."""


def split_key(path: str) -> tuple[str, str] | None:
    """webdataset's sample key and extension (its ``base_plus_ext``): the member path up to
    the first dot of its basename, and the rest (``a.b/s3.v2.png`` -> ``a.b/s3``,
    ``v2.png``). None for a name the rule cannot split: a basename without a dot, or one
    that starts with a dot (webdataset gives those no key, or their folder's path)."""
    directory, base = posixpath.split(path)
    stem, dot, ext = base.partition(".")
    if not dot or not stem:
        return None
    return (posixpath.join(directory, stem) if directory else stem), ext


def last_extension(ext: str) -> str:
    """The part of an extension that names the type, lower-cased: ``v2.PNG`` -> ``png``."""
    return ext.rpartition(".")[2].lower()


def is_image_name(path: str) -> bool:
    """Whether a member is an image by its name: its last extension is an image one."""
    base = posixpath.basename(path)
    return "." in base and last_extension(base) in IMAGE_EXTENSIONS


def label_extension(path: str) -> str | None:
    """``cls`` or ``json`` for a label member (``KEY.cls``, ``KEY.v2.json``), else None."""
    split = split_key(path)
    if split is None:
        return None
    last = last_extension(split[1])
    return last if last in LABEL_EXTENSIONS else None


# What a member path may be. Linux limits, which FUSE could not serve beyond anyway: a
# component of at most NAME_MAX bytes, a path of at most PATH_MAX - 1 bytes. The depth bound
# is ours: no real dataset nests 256 folders, and a bound keeps every walk over a path short.
MAX_NAME_BYTES = 255
MAX_PATH_BYTES = 4095
MAX_PATH_DEPTH = 256
# Labels are class indices: non-negative and small enough for a C int everywhere downstream.
MAX_LABEL = 2**31 - 1
_LABEL_FIELDS = ("label", "cls", "class", "target")


def _shown(text: str) -> str:
    """A member path for an error message: repr'd, and cut short if it is huge."""
    return repr(text) if len(text) <= 200 else repr(text[:200]) + "..."


def _check_name(raw: str, what: str, shard: str, offset: int) -> bytes:
    """The UTF-8 bytes of a name the filesystem can present, or UnsafeMemberError.

    The tar parser decodes names with ``surrogateescape``, so a name that was not valid
    UTF-8 arrives holding lone surrogates and fails to encode here. A NUL would cut the
    name short in every C interface (the kernel would list a name that cannot be opened).
    """
    try:
        encoded = raw.encode("utf-8")
    except UnicodeEncodeError:
        raise UnsafeMemberError(shard, offset, f"{what} {_shown(raw)} is not valid UTF-8") from None
    if b"\0" in encoded:
        raise UnsafeMemberError(shard, offset, f"{what} {_shown(raw)} contains a NUL byte")
    if len(encoded) > MAX_PATH_BYTES:
        raise UnsafeMemberError(
            shard, offset, f"{what} {_shown(raw)} is longer than {MAX_PATH_BYTES} bytes"
        )
    return encoded


def normalize_member_path(raw: str, shard: str, offset: int) -> str:
    """A member path made relative and clean; anything the mount cannot present is refused.

    Refused with UnsafeMemberError (the shard is bad): absolute paths, '..' components,
    names that are not valid UTF-8 or hold a NUL, a path over ``MAX_PATH_BYTES`` bytes, a
    component over ``MAX_NAME_BYTES`` bytes, and more than ``MAX_PATH_DEPTH`` components.
    """
    _check_name(raw, "member path", shard, offset)
    if raw.startswith("/"):
        raise UnsafeMemberError(shard, offset, f"member path {_shown(raw)} is absolute")
    parts = []
    for part in raw.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            raise UnsafeMemberError(shard, offset, f"member path {_shown(raw)} escapes the mount")
        if len(part.encode()) > MAX_NAME_BYTES:
            raise UnsafeMemberError(
                shard,
                offset,
                f"member path {_shown(raw)} has a name longer than {MAX_NAME_BYTES} bytes",
            )
        parts.append(part)
    if len(parts) > MAX_PATH_DEPTH:
        raise UnsafeMemberError(
            shard, offset, f"member path {_shown(raw)} is deeper than {MAX_PATH_DEPTH} folders"
        )
    return "/".join(parts)


def check_symlink_target(target: str, shard: str, offset: int) -> str:
    """A symlink target as stored: it may point anywhere (the view drops those that leave
    the mount), but it must be valid UTF-8 without NUL and at most ``MAX_PATH_BYTES``."""
    _check_name(target, "symlink target", shard, offset)
    return target


def _label_value(value: object) -> int | None:
    """A label is an int (not a bool) with ``0 <= label <= MAX_LABEL``; else there is none."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_LABEL:
        return value
    return None


def parse_label(ext: str, content: bytes) -> int | None:
    """The integer label of a ``.cls`` or ``.json`` member, or None if it has none.

    A ``.cls`` holds ASCII digits; a ``.json`` holds an int or an object with one of the
    ``_LABEL_FIELDS``. Anything else, including a negative or huge number, is no label:
    the view reports the sample as unlabelled instead of the shard being refused. JSON
    nested deeper than the interpreter's recursion limit is no label either.
    """
    try:
        text = content.decode("utf-8").strip()
    except UnicodeDecodeError:
        return None
    if ext == "cls":
        digits = text.lstrip("0")
        if not (text.isascii() and text.isdigit()) or len(digits) > len(str(MAX_LABEL)):
            return None
        return _label_value(int(digits or "0"))
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):  # ValueError covers ints of over 4,300 digits too
        return None
    if isinstance(value, dict):
        for field in _LABEL_FIELDS:
            label = _label_value(value.get(field))
            if label is not None:
                return label
        return None
    return _label_value(value)


def _wants_content(member: TarMember) -> bool:
    return (
        member.kind == MemberKind.FILE
        and member.size <= MAX_LABEL_BYTES
        and label_extension(member.path) is not None
    )


def tar_rows(stream: Readable, shard: str, shard_dir: str = "", base: int = 0) -> list[MemberRow]:
    """The index rows of the tar ``stream`` (parsed front to back by ``tar.iter_members``):
    paths made safe and placed under ``shard_dir``, small label members read on the way,
    data offsets shifted by ``base`` (a decoded tar's start in its shard's decoded space)."""
    rows: list[MemberRow] = []
    for member, content in iter_members(stream, shard, capture=_wants_content):
        if member.kind == MemberKind.OTHER:
            continue
        path = normalize_member_path(member.path, shard, member.header_offset)
        link = member.linkname
        if member.kind == MemberKind.HARDLINK:
            link = normalize_member_path(link, shard, member.header_offset)
        elif member.kind == MemberKind.SYMLINK:
            link = check_symlink_target(link, shard, member.header_offset)
        if member.folder:  # a member of an inner tar, presented in its folder
            folder = normalize_member_path(member.folder, shard, member.header_offset)
            path = posixpath.join(folder, path) if path else folder
            if member.kind == MemberKind.HARDLINK:
                link = posixpath.join(folder, link)
        if shard_dir:
            path = posixpath.join(shard_dir, path) if path else shard_dir
            if member.kind == MemberKind.HARDLINK:
                link = posixpath.join(shard_dir, link)
        if not path:
            continue  # the archive's own "./" entry
        ext = label_extension(path) if content is not None else None
        label = parse_label(ext, content) if content is not None and ext is not None else None
        offset = base + member.data_offset
        rows.append(
            (path, offset, member.size, member.mode, member.mtime, int(member.kind), link, label)
        )
    return rows

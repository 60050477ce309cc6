"""``shardfs pack``: turn a folder tree into tar shards plus an index sidecar, dropping nothing.

Every file of the source lands in exactly one shard: shards hold any number of samples and
the last one may be small. The plan (which file goes where) is computed up front from the
tree and the options, so it is deterministic, and a pack interrupted at any point resumes
(``--resume``) by writing only the shards that are missing. Each shard is uploaded whole:
a local destination gets a temp name and a rename, an object store one PUT (or a completed
multipart upload), so a shard either exists complete or not at all.

Tar headers are made by ``tarfile.TarInfo.tobuf`` (pax format: long and non-ASCII names
survive), but data is copied by us, so every member's data offset is known before a byte
is written. That is what lets the index sidecar be written for shards packed by an earlier,
interrupted run without reading them back.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import stat
import tarfile
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Literal

from ..config import SourceConfig
from ..errors import ShardfsError, SourceNotFoundError, UsageError
from ..formats.tar import MemberKind
from ..index.db import (
    MAX_LABEL_BYTES,
    SIDECAR_NAME,
    MemberRow,
    create_index,
    insert_members,
    label_extension,
    parse_label,
)
from ..store.remote import SHARD_SUFFIX, Store
from ..store.shards import ShardInfo
from ..store.urls import is_within
from ..views.view import CLASSES_FILE, IMAGE_EXTENSIONS

log = logging.getLogger(__name__)

PackFormat = Literal["tree", "webdataset"]
MANIFEST_NAME = ".shardfs-pack.json"
BLOCK = 512
RECORD = 20 * BLOCK
_COPY_CHUNK = 1 << 20


class PackError(ShardfsError):
    """The source tree cannot be packed as asked (unreadable files, wrong layout)."""

    exit_code = 4


@dataclass(frozen=True)
class PackConfig:
    """How ``shardfs pack`` lays out shards.

    format: ``tree`` writes members as ``class/file`` (raw view); ``webdataset`` writes
        ``class/KEY.ext`` + ``class/KEY.cls`` and a ``classes.txt``. Default: ``tree``.
    shard_size: a shard is closed before it would exceed this many bytes (a single larger
        file gets a shard of its own). Default: 256 MiB.
    max_count: at most this many files per shard. Default: None (no limit).
    shuffle_seed: shuffle files across shards with this seed; None keeps sorted order.
    resume: continue an interrupted pack into the same destination. Default: False.
    skip_errors: leave out unreadable files and list them instead of failing. Default: False.
    workers: shards written and uploaded in parallel. Default: 4.
    prefix: shard file names are ``PREFIX-000000.tar``. Default: ``shard``.
    """

    format: PackFormat = "tree"
    shard_size: int = 256 << 20
    max_count: int | None = None
    shuffle_seed: int | None = None
    resume: bool = False
    skip_errors: bool = False
    workers: int = 4
    prefix: str = "shard"


@dataclass(frozen=True, slots=True)
class SourceFile:
    rel: str
    size: int
    mode: int
    mtime: int


@dataclass(frozen=True, slots=True)
class PlannedMember:
    """One tar member: a file's bytes (``source``), a label text, or a folder."""

    name: str
    kind: MemberKind
    source: SourceFile | None = None
    payload: bytes = b""
    label: int | None = None

    @property
    def size(self) -> int:
        if self.kind == MemberKind.DIRECTORY:
            return 0
        return self.source.size if self.source is not None else len(self.payload)


@dataclass
class PlannedShard:
    name: str
    members: list[PlannedMember] = field(default_factory=list)

    @property
    def data_bytes(self) -> int:
        return sum(m.source.size for m in self.members if m.source is not None)


@dataclass
class PackReport:
    files: int = 0
    bytes: int = 0
    shards: int = 0
    written: int = 0
    skipped_existing: int = 0
    errors: list[str] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)  # shardfs's own files (``scan_tree``)


def _header(member: PlannedMember) -> bytes:
    info = tarfile.TarInfo(member.name)
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    if member.kind == MemberKind.DIRECTORY:
        info.type = tarfile.DIRTYPE
        info.mode = 0o755
        info.mtime = 0
    else:
        info.size = member.size
        info.mode = member.source.mode & 0o777 if member.source else 0o644
        info.mtime = member.source.mtime if member.source else 0
    return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


def layout(shard: PlannedShard) -> tuple[list[tuple[PlannedMember, bytes, int]], int]:
    """Each member with its header and data offset, and the total shard size."""
    placed = []
    offset = 0
    for member in shard.members:
        header = _header(member)
        offset += len(header)
        placed.append((member, header, offset))
        offset += -(-member.size // BLOCK) * BLOCK
    offset += 2 * BLOCK
    total = -(-offset // RECORD) * RECORD
    return placed, total


def index_rows(shard: PlannedShard, root: Path | None = None) -> list[MemberRow]:
    """The index rows a scan of this shard would produce. With ``root``, label files of a
    tree pack (``KEY.cls``/``KEY.json``) are read for their label, as a scan would."""
    rows: list[MemberRow] = []
    for member, _header_bytes, offset in layout(shard)[0]:
        mode = 0o755 if member.kind == MemberKind.DIRECTORY else 0o644
        mtime = 0
        label = member.label
        if member.source is not None:
            mode, mtime = member.source.mode & 0o777, member.source.mtime
            ext = label_extension(member.name)
            if root is not None and ext is not None and member.size <= MAX_LABEL_BYTES:
                label = parse_label(ext, (root / member.source.rel).read_bytes())
        rows.append((member.name, offset, member.size, mode, mtime, int(member.kind), "", label))
    return rows


def scan_tree(
    root: Path, left_out: list[str] | None = None
) -> tuple[list[SourceFile], list[str], list[str]]:
    """Every regular file under ``root`` (sorted), every folder, and what cannot be read.

    shardfs's own files are no data: a folder holding a pack's manifest (an earlier pack's
    output: shards and sidecar) and any index sidecar or manifest elsewhere are left out,
    each with why in ``left_out``, so that packing a tree twice never packs the first
    output."""
    files: list[SourceFile] = []
    folders: list[str] = []
    errors: list[str] = []
    seen: set[tuple[int, int]] = set()
    # Folder links are followed, as torchvision's ImageFolder does; a loop is an error.
    walk = os.walk(root, onerror=lambda e: errors.append(str(e)), followlinks=True)
    for dirpath, dirnames, filenames in walk:
        dirnames.sort()
        rel_dir = os.path.relpath(dirpath, root)
        folder_info = os.stat(dirpath)
        if (folder_info.st_dev, folder_info.st_ino) in seen:
            errors.append(f"{rel_dir}: a link to a folder that is already packed (a loop?)")
            dirnames.clear()
            continue
        seen.add((folder_info.st_dev, folder_info.st_ino))
        if rel_dir != "." and MANIFEST_NAME in filenames:
            if left_out is not None:
                left_out.append(f"{rel_dir}/: the output of an earlier pack ({MANIFEST_NAME})")
            dirnames.clear()
            continue
        if rel_dir != ".":
            folders.append(rel_dir.replace(os.sep, "/"))
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            if name in (MANIFEST_NAME, SIDECAR_NAME):
                if left_out is not None:
                    left_out.append(f"{rel}: shardfs's own file, not data")
                continue
            try:
                info = os.stat(path)
                if not stat.S_ISREG(info.st_mode):
                    errors.append(f"{rel}: not a regular file")
                    continue
                with open(path, "rb"):
                    pass
            except FileNotFoundError:
                errors.append(f"{rel}: broken symlink")
                continue
            except OSError as exc:
                errors.append(f"{rel}: {exc.strerror or exc}")
                continue
            files.append(SourceFile(rel, info.st_size, info.st_mode, int(info.st_mtime)))
    return files, folders, errors


def _webdataset_members(
    files: list[SourceFile], classes: list[str], errors: list[str]
) -> list[list[PlannedMember]]:
    """One sample per image: ``class/stem.ext`` + ``class/stem.cls``."""
    label_of = {name: i for i, name in enumerate(classes)}
    keys: dict[str, str] = {}
    samples = []
    for file in files:
        parts = file.rel.split("/")
        if len(parts) != 2:
            errors.append(f"{file.rel}: webdataset format needs SRC/CLASS/FILE (use --format tree)")
            continue
        class_name, name = parts
        stem, dot, ext = name.partition(".")
        if not dot or ext.lower() not in IMAGE_EXTENSIONS:
            errors.append(
                f"{file.rel}: not an image with a one-dot name (KEY.jpg); "
                "the webdataset format packs images only (use --format tree)"
            )
            continue
        key = f"{class_name}/{stem}"
        if key in keys:
            errors.append(f"{file.rel}: shares sample key {key!r} with {keys[key]}")
            continue
        keys[key] = file.rel
        label = label_of[class_name]
        samples.append(
            [
                PlannedMember(file.rel, MemberKind.FILE, source=file),
                PlannedMember(
                    f"{key}.cls", MemberKind.FILE, payload=f"{label}".encode(), label=label
                ),
            ]
        )
    return samples


def make_plan(
    files: list[SourceFile], folders: list[str], config: PackConfig, errors: list[str]
) -> tuple[list[PlannedShard], list[str] | None]:
    """Assign every file to a shard; returns the shards and (webdataset) the class names."""
    classes: list[str] | None = None
    if config.format == "webdataset":
        classes = sorted({f.rel.split("/", 1)[0] for f in files if "/" in f.rel})
        samples = _webdataset_members(files, classes, errors)
    else:
        samples = [[PlannedMember(f.rel, MemberKind.FILE, source=f)] for f in files]
    if config.shuffle_seed is not None:
        random.Random(config.shuffle_seed).shuffle(samples)
    shards: list[PlannedShard] = []
    current: PlannedShard | None = None
    current_bytes = current_count = 0
    for sample in samples:
        size = sum(BLOCK + -(-m.size // BLOCK) * BLOCK for m in sample)
        full = current is not None and (
            current_bytes + size > config.shard_size
            or (config.max_count is not None and current_count >= config.max_count)
        )
        if current is None or full:
            current = PlannedShard(f"{config.prefix}-{len(shards):06d}{SHARD_SUFFIX}")
            shards.append(current)
            current_bytes = current_count = 0
        current.members.extend(sample)
        current_bytes += size
        current_count += 1
    if config.format == "tree" and folders:
        if not shards:
            shards.append(PlannedShard(f"{config.prefix}-000000{SHARD_SUFFIX}"))
        dirs = [PlannedMember(d, MemberKind.DIRECTORY) for d in folders]
        shards[0].members[:0] = dirs  # folders (also empty ones) come first, once
    return shards, classes


def plan_fingerprint(shards: list[PlannedShard], config: PackConfig) -> str:
    digest = hashlib.sha256()
    digest.update(json.dumps([config.format, config.prefix]).encode())
    for shard in shards:
        digest.update(shard.name.encode())
        for m in shard.members:
            source = (m.source.size, m.source.mtime) if m.source else None
            entry = [m.name, int(m.kind), source, m.payload.hex()]
            digest.update(json.dumps(entry).encode("utf-8", "surrogateescape"))
    return digest.hexdigest()


def write_shard(
    shard: PlannedShard, root: Path, out: IO[bytes], on_bytes: Callable[[int], None]
) -> int:
    """Write one shard; returns its size. Fails if a file changed size since planning."""
    placed, total = layout(shard)
    written = 0
    for member, header, _offset in placed:
        out.write(header)
        written += len(header)
        if member.kind == MemberKind.DIRECTORY:
            continue
        if member.source is None:
            out.write(member.payload)
            copied = len(member.payload)
        else:
            copied = 0
            path = root / member.source.rel
            with open(path, "rb") as handle:
                while chunk := handle.read(min(_COPY_CHUNK, member.source.size - copied)):
                    out.write(chunk)
                    copied += len(chunk)
                    on_bytes(len(chunk))
                    if copied >= member.source.size:
                        break
            if copied != member.source.size or os.stat(path).st_size != member.source.size:
                raise PackError(f"{member.source.rel}: changed size while packing")
        padding = -copied % BLOCK
        out.write(b"\0" * padding)
        written += copied + padding
    out.write(b"\0" * (total - written))
    return total


class Packer:
    """Packs one source tree into one destination."""

    def __init__(
        self,
        src: Path,
        dest: SourceConfig,
        config: PackConfig,
        *,
        progress: Callable[[int, int, int, int], None] | None = None,
    ) -> None:
        if not src.is_dir():
            raise UsageError(f"{src}: not a folder")
        if is_within(dest.url, str(src)):
            raise UsageError(
                f"{dest.url}: the destination lies inside the source folder {src}, so the "
                "shards would be packed into the tree they are made from; choose a "
                "destination outside it"
            )
        self.src = src
        self.dest = dest
        self.config = config
        self.progress = progress
        self.store = Store(dest)
        self._lock = threading.Lock()
        self._done_bytes = 0
        self._done_files = 0

    def run(self) -> PackReport:
        left_out: list[str] = []
        files, folders, errors = scan_tree(self.src, left_out)
        shards, classes = make_plan(files, folders, self.config, errors)
        report = PackReport(errors=errors, left_out=left_out)
        if errors and not self.config.skip_errors:
            more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
            raise PackError(f"{errors[0]}{more}; nothing was written (--skip-errors skips them)")
        if not shards:
            raise PackError(f"{self.src}: no files to pack")
        fingerprint = plan_fingerprint(shards, self.config)
        existing = self._check_destination(fingerprint, len(shards))
        report.shards = len(shards)
        report.files = sum(1 for s in shards for m in s.members if m.source is not None)
        report.bytes = sum(s.data_bytes for s in shards)
        todo = [s for s in shards if s.name not in existing]
        report.skipped_existing = len(shards) - len(todo)
        total_files = report.files
        self._done_bytes = sum(s.data_bytes for s in shards if s.name in existing)
        self._done_files = sum(
            1 for s in shards if s.name in existing for m in s.members if m.source
        )
        self._report_progress(total_files, report.bytes)
        with ThreadPoolExecutor(max_workers=max(1, self.config.workers)) as pool:
            for _ in pool.map(lambda s: self._pack_one(s, total_files, report.bytes), todo):
                report.written += 1
        if classes is not None:
            self.store.write_object(CLASSES_FILE, ("\n".join(classes) + "\n").encode())
        self._write_sidecar(shards)
        return report

    def _report_progress(self, total_files: int, total_bytes: int) -> None:
        if self.progress is not None:
            self.progress(self._done_files, total_files, self._done_bytes, total_bytes)

    def _check_destination(self, fingerprint: str, count: int) -> set[str]:
        """Names of shards already complete at the destination (for --resume)."""
        present = self.store.list_names()
        manifest = self.store.read_object(MANIFEST_NAME)
        if present and not self.config.resume:
            raise UsageError(
                f"{self.dest.url}: destination is not empty; use --resume to continue an "
                "interrupted pack, or choose an empty destination"
            )
        if present and manifest is None:
            raise UsageError(f"{self.dest.url}: --resume: no {MANIFEST_NAME} here, not a pack")
        for name in self.store.remove_temp_files(present):  # a killed run's half uploads
            log.info("removed leftover temp file %s", name)
        if manifest is not None:
            try:
                recorded = json.loads(manifest)["fingerprint"]
            except (ValueError, KeyError, TypeError):
                recorded = None
            if recorded != fingerprint:
                raise UsageError(
                    f"{self.dest.url}: --resume: the source tree or the options differ from "
                    "the interrupted pack; use an empty destination"
                )
        else:
            body = {"fingerprint": fingerprint, "shards": count, "format": self.config.format}
            try:
                self.store.write_object(MANIFEST_NAME, json.dumps(body).encode())
            except SourceNotFoundError as exc:  # the first write: name the destination
                reason = str(exc.__cause__ or exc)
                raise SourceNotFoundError(
                    f"{self.dest.url}: destination not found ({reason})"
                ) from exc
        return {name for name in present if name.endswith(SHARD_SUFFIX)}

    def _pack_one(self, shard: PlannedShard, total_files: int, total_bytes: int) -> None:
        def on_bytes(count: int) -> None:
            with self._lock:
                self._done_bytes += count
            self._report_progress(total_files, total_bytes)

        with self.store.atomic_writer(shard.name) as out:
            write_shard(shard, self.src, out, on_bytes)
        with self._lock:
            self._done_files += sum(1 for m in shard.members if m.source is not None)
        self._report_progress(total_files, total_bytes)

    def _write_sidecar(self, shards: list[PlannedShard]) -> None:
        listed = {s.name: s for s in self.store.list_shards()}
        infos: list[ShardInfo] = []
        for shard in shards:
            info = listed.get(shard.name)
            expected = layout(shard)[1]
            if info is None or info.size != expected:
                raise PackError(f"{shard.name}: missing or wrong size at the destination")
            infos.append(info)
        with tempfile.TemporaryDirectory(prefix="shardfs-sidecar-") as folder:
            path = Path(folder) / "index.sqlite"
            conn = create_index(path, self.dest.url, infos)
            for sid, shard in enumerate(shards, start=1):
                insert_members(conn, sid, index_rows(shard, self.src))
            conn.commit()
            conn.close()
            self.store.write_object(SIDECAR_NAME, path.read_bytes())

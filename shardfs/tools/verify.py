"""``shardfs verify``: compare a packed dataset with its source tree, by hash, without mounting.

The packed side is read through the index and the view a mount would show: each shard is
streamed once and every member hashed at its indexed offset. So a pass means a mount of
that source serves exactly the tree's paths and bytes.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from ..config import IndexConfig, SourceConfig, ViewConfig
from ..dataset import open_source
from ..index.db import Progress
from ..store.remote import Store
from ..store.shards import ShardInfo
from ..views.view import Node
from .pack import scan_tree

log = logging.getLogger(__name__)


@dataclass
class VerifyReport:
    files: int = 0
    bytes: int = 0
    missing: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.extra or self.mismatched)

    def summary(self) -> str:
        parts = [f"{self.files} files, {self.bytes} bytes"]
        for name, items in (
            ("missing from the pack", self.missing),
            ("not in the source", self.extra),
            ("with different bytes", self.mismatched),
        ):
            if items:
                parts.append(f"{len(items)} {name} (e.g. {items[0]!r})")
        return "; ".join(parts)


def _hash_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _hash_shard(store: Store, shard: ShardInfo, members: list[tuple[str, Node]]) -> dict[str, str]:
    """Stream one shard and hash each member (members sorted by offset)."""
    hashes: dict[str, str] = {}
    position = 0
    with store.open_stream(shard) as stream:
        for path, node in members:
            if node.offset < position:  # a hard link to bytes already passed: fetch them
                data = store.read_range(shard, node.offset, node.offset + node.size)
                hashes[path] = hashlib.sha256(data).hexdigest()
                continue
            while position < node.offset:
                skipped = len(stream.read(min(1 << 20, node.offset - position)))
                if not skipped:
                    break
                position += skipped
            digest = hashlib.sha256()
            left = node.size
            while left:
                chunk = stream.read(min(1 << 20, left))
                if not chunk:
                    break
                digest.update(chunk)
                left -= len(chunk)
                position += len(chunk)
            hashes[path] = digest.hexdigest() if not left else "truncated"
    return hashes


def verify(
    src: Path,
    source: SourceConfig,
    index_config: IndexConfig,
    view_config: ViewConfig,
    *,
    workers: int = 4,
    progress: Callable[[int, int, int, int], None] | None = None,
    scan_progress: Progress | None = None,
) -> VerifyReport:
    """Compare; ``progress`` gets (shards hashed, shards to hash, 0, 0), ``scan_progress``
    the index scan's progress where the packed shards have no index yet."""
    files, _folders, errors = scan_tree(src)
    for error in errors:
        log.warning("source: %s", error)
    opened = open_source(source, index_config, view_config, progress=scan_progress)
    view, store = opened.view, opened.store
    packed = list(view.files())
    report = VerifyReport(files=len(files), bytes=sum(f.size for f in files))
    source_paths = {f.rel for f in files}
    packed_paths = {path for path, _ in packed}
    report.missing = sorted(source_paths - packed_paths)
    report.extra = sorted(packed_paths - source_paths)
    by_shard: dict[int, list[tuple[str, Node]]] = {}
    for path, node in packed:
        if path in source_paths:
            by_shard.setdefault(node.shard, []).append((path, node))
    done = [0]

    def check(shard_id: int) -> list[str]:
        members = by_shard[shard_id]
        packed_hashes = _hash_shard(store, view.shards[shard_id], members)
        bad = [p for p, _ in members if packed_hashes.get(p) != _hash_file(src / p)]
        done[0] += 1
        if progress is not None:
            progress(done[0], len(by_shard), 0, 0)
        return bad

    try:
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            for bad in pool.map(check, sorted(by_shard)):
                report.mismatched.extend(bad)
    finally:
        view.close()
    report.mismatched.sort()
    return report

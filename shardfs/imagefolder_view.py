"""The ImageFolder layout: webdataset samples (``KEY.jpg`` + ``KEY.cls``) become
``CLASS/KEY.jpg``, the class named by a classes list or by the label's digits."""

from __future__ import annotations

import posixpath
import sqlite3
from collections.abc import Callable

from .errors import UsageError
from .index import LABEL_EXTENSIONS, iter_member_rows, split_key
from .tar import MemberKind
from .view_tree import TreeWriter, ViewReport

IMAGE_EXTENSIONS = frozenset({"jpg", "jpeg", "png", "ppm", "bmp", "pgm", "tif", "tiff", "webp"})


def build_imagefolder(
    conn: sqlite3.Connection,
    tree: TreeWriter,
    report: ViewReport,
    classes_for: Callable[[str], list[str] | None],
    *,
    strict: bool,
) -> bool:
    """Fill the tree and return True; or return False, having written nothing, when no
    member has a label, or when ``strict`` and an image has none (``auto`` then falls back
    to raw). Either way the report counts the labelled and unlabelled images, so that the
    choice can be explained."""
    max_label = conn.execute(
        "SELECT MAX(label) FROM members m JOIN shards s ON s.id = m.shard "
        "WHERE s.error IS NULL AND label IS NOT NULL"
    ).fetchone()[0]
    if max_label is None:
        return False
    width = len(str(max_label))
    shard_dirs = dict(conn.execute("SELECT id, name FROM shards"))

    def class_name(shard: int, label: int) -> str:
        folder = posixpath.dirname(shard_dirs[shard])
        names = classes_for(folder)
        if names is None:
            return f"{label:0{width}d}"
        if not 0 <= label < len(names):
            raise UsageError(
                f"{shard_dirs[shard]}: label {label} has no name in the classes list "
                f"({len(names)} names)"
            )
        return names[label]

    staged: list[tuple[int, str, int, int, int, int]] = []
    samples: dict[str, tuple[int | None, list[tuple[str, int, int, int, int]]]] = {}
    current_shard = -1

    def flush_shard() -> None:
        shard_name = shard_dirs[current_shard]
        folder = posixpath.dirname(shard_name)
        labeled_here = 0
        for key, (label, images) in samples.items():
            if label is None:
                member = key.removeprefix(f"{folder}/") if folder else key  # as in the tar
                example = f"{member}.{images[0][0]} in {shard_name}"
                report.unlabeled += len(images)
                report.note(f"image {example} has no label")
                if strict and not report.auto_example:
                    report.auto_example = example
                    staged.clear()  # nothing will be written: only count from here on
                continue
            labeled_here += len(images)
            name = class_name(current_shard, label)
            if strict and report.unlabeled:
                continue
            base = posixpath.basename(key)
            for ext, offset, size, mode, mtime in images:
                path = posixpath.join(folder, name, f"{base}.{ext}")
                staged.append((current_shard, path, offset, size, mode, mtime))
        report.labeled += labeled_here
        report.labeled_shards += labeled_here > 0
        samples.clear()

    for shard, (path, offset, size, mode, mtime, kind, _link, label) in iter_member_rows(conn):
        if shard != current_shard:
            if current_shard != -1:
                flush_shard()
            current_shard = shard
        if kind != MemberKind.FILE:
            continue
        key, ext = split_key(path)
        lower = ext.lower()
        if lower in IMAGE_EXTENSIONS:
            entry = samples.setdefault(key, (None, []))
            entry[1].append((ext, offset, size, mode, mtime))
        elif lower in LABEL_EXTENSIONS and label is not None:
            images = samples.get(key, (None, []))[1]
            samples[key] = (label, images)
        elif lower not in LABEL_EXTENSIONS:
            report.ignored += 1
    if current_shard != -1:
        flush_shard()
    if strict and (report.unlabeled or not report.labeled):
        return False
    for shard, path, offset, size, mode, mtime in staged:
        tree.entry(path, MemberKind.FILE, shard, offset, size, mode, mtime)
    return True

"""The ImageFolder layout: webdataset samples (``KEY.jpg`` + ``KEY.cls``) become
``CLASS/KEY.jpg``, the class named by a classes list or by the label's digits."""

from __future__ import annotations

import posixpath
import sqlite3
from collections.abc import Callable, Iterator

from .errors import UsageError
from .index import iter_member_rows
from .members import LABEL_EXTENSIONS, split_key
from .tar import MemberKind
from .view_tree import TreeWriter, ViewReport

IMAGE_EXTENSIONS = frozenset({"jpg", "jpeg", "png", "ppm", "bmp", "pgm", "tif", "tiff", "webp"})


Image = tuple[str, int, int, int, int]
"""(extension as stored, data offset, size, mode, mtime) of one image member."""
Samples = dict[str, tuple["int | None", list[Image]]]
"""Sample key -> (its label if a label member gave one, its images)."""
Placed = tuple[int, str, int, int, int, int]
"""(shard, presented path, data offset, size, mode, mtime) of one image in the tree."""


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
    shard_names = dict(conn.execute("SELECT id, name FROM shards"))
    placer = _Placer(shard_names, classes_for, len(str(max_label)), report, strict=strict)
    for shard, samples in _samples_by_shard(conn, report):
        placer.place_shard(shard, samples)
    if strict and (report.unlabeled or not report.labeled):
        return False
    for shard, path, offset, size, mode, mtime in placer.placed:
        tree.entry(path, MemberKind.FILE, shard, offset, size, mode, mtime)
    return True


def _samples_by_shard(
    conn: sqlite3.Connection, report: ViewReport
) -> Iterator[tuple[int, Samples]]:
    """Each good shard's samples (images grouped by key, with the key's label), in shard
    order; members that are neither images nor labels are counted as ignored."""
    samples: Samples = {}
    current_shard = -1
    for shard, (path, offset, size, mode, mtime, kind, _link, label) in iter_member_rows(conn):
        if shard != current_shard:
            if current_shard != -1:
                yield current_shard, samples
                samples = {}
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
        yield current_shard, samples


class _Placer:
    """Places labelled images at ``FOLDER/CLASS/KEY.EXT`` and counts the unlabelled; when
    ``strict``, the first unlabelled image stops the placing (only counting goes on)."""

    def __init__(
        self,
        shard_names: dict[int, str],
        classes_for: Callable[[str], list[str] | None],
        width: int,
        report: ViewReport,
        *,
        strict: bool,
    ) -> None:
        self.shard_names = shard_names
        self.classes_for = classes_for
        self.width = width  # digits of the largest label: class folders sort by number
        self.report = report
        self.strict = strict
        self.placed: list[Placed] = []

    def class_name(self, shard: int, label: int) -> str:
        folder = posixpath.dirname(self.shard_names[shard])
        names = self.classes_for(folder)
        if names is None:
            return f"{label:0{self.width}d}"
        if not 0 <= label < len(names):
            raise UsageError(
                f"{self.shard_names[shard]}: label {label} has no name in the classes list "
                f"({len(names)} names)"
            )
        return names[label]

    def place_shard(self, shard: int, samples: Samples) -> None:
        report = self.report
        shard_name = self.shard_names[shard]
        folder = posixpath.dirname(shard_name)
        labeled_here = 0
        for key, (label, images) in samples.items():
            if label is None:
                self._unlabeled(key, images, folder, shard_name)
                continue
            labeled_here += len(images)
            name = self.class_name(shard, label)
            if self.strict and report.unlabeled:
                continue
            base = posixpath.basename(key)
            for ext, offset, size, mode, mtime in images:
                path = posixpath.join(folder, name, f"{base}.{ext}")
                self.placed.append((shard, path, offset, size, mode, mtime))
        report.labeled += labeled_here
        report.labeled_shards += labeled_here > 0

    def _unlabeled(self, key: str, images: list[Image], folder: str, shard_name: str) -> None:
        report = self.report
        member = key.removeprefix(f"{folder}/") if folder else key  # as in the tar
        example = f"{member}.{images[0][0]} in {shard_name}"
        report.unlabeled += len(images)
        report.note(f"image {example} has no label")
        if self.strict and not report.auto_example:
            report.auto_example = example
            self.placed.clear()  # nothing will be written: only count from here on

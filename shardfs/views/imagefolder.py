"""The ImageFolder layout: each labelled image of a webdataset sample becomes
``CLASS/PATH``, its member path kept (``x/s1.png`` with label 0 is ``0/x/s1.png``), the
class named by a classes list or by the label's digits; what is left out is counted.

Samples are matched by webdataset's key (``members.split_key``): an image is a member
whose last extension is an image one (``s3.v2.png``), a label one whose last extension is
``cls``/``json`` (``s3.v2.cls``), both with the same key in the same shard. A member path
that starts with a folder named as its class does not repeat it (``cat/x.jpg`` labelled
``cat`` is ``cat/x.jpg``), so that trees packed as ``CLASS/KEY.jpg`` mount back as they were.
"""

from __future__ import annotations

import posixpath
import sqlite3
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from ..errors import UsageError
from ..formats.classes import class_folders, numeric_folder
from ..formats.members import (
    IMAGE_EXTENSIONS,
    LABEL_EXTENSIONS,
    is_image_name,
    label_extension,
    last_extension,
    split_key,
)
from ..formats.tar import MemberKind
from ..index.db import iter_member_rows
from .tree import TreeWriter, ViewReport

__all__ = ["IMAGE_EXTENSIONS", "build_imagefolder", "is_image_name"]


Image = tuple[str, int, int, int, int]
"""(member path within its shard's folder, data offset, size, mode, mtime) of an image."""
Placed = tuple[int, str, int, int, int, int]
"""(shard, presented path, data offset, size, mode, mtime) of one image in the tree."""


@dataclass
class _Sample:
    label: int | None = None  # from the first label member of the key that holds one
    images: list[Image] = field(default_factory=list)


def build_imagefolder(
    conn: sqlite3.Connection,
    tree: TreeWriter,
    report: ViewReport,
    classes_for: Callable[[str], list[str] | None],
    *,
    strict: bool,
) -> bool:
    """Fill the tree and return True; or return False, having written nothing, when no
    member has a label, or when ``strict`` and an image would be left out (``auto`` then
    falls back to raw). Either way the report counts the images, labelled or not, so that
    the choice can be explained."""
    max_label = conn.execute(
        "SELECT MAX(label) FROM members m JOIN shards s ON s.id = m.shard "
        "WHERE s.error IS NULL AND label IS NOT NULL"
    ).fetchone()[0]
    if max_label is None:
        return False
    shard_names = dict(conn.execute("SELECT id, name FROM shards"))
    placer = _Placer(shard_names, classes_for, len(str(max_label)), report, strict=strict)
    for shard, samples in _samples_by_shard(conn, placer):
        placer.place_shard(shard, samples)
    if strict and (placer.leaving_out or not report.labeled):
        return False
    for shard, path, offset, size, mode, mtime in placer.placed:
        tree.entry(path, MemberKind.FILE, shard, offset, size, mode, mtime)
    placer.class_folders(tree)
    return True


def _may_be_label(member: str) -> bool:
    """``label_extension(member) is not None``, quick for the million image rows of a
    columnar shard: a label member's last extension is ``cls`` or ``json``."""
    return (
        member.rpartition(".")[2].lower() in LABEL_EXTENSIONS
        and label_extension(member) is not None
    )


def _samples_by_shard(
    conn: sqlite3.Connection, placer: _Placer
) -> Iterator[tuple[int, dict[str, _Sample]]]:
    """Each good shard's samples by key, in shard order. Members that are not part of a
    sample (neither image nor label, a symlink, a name without a key) are counted as they
    are met; a hard link stands for the earlier member it names."""
    samples: dict[str, _Sample] = {}
    by_path: dict[str, tuple[int, int, int, int, int | None]] = {}
    current_shard = -1
    folder = ""
    for shard, (path, offset, size, mode, mtime, kind, link, label) in iter_member_rows(conn):
        if shard != current_shard:
            if current_shard != -1:
                yield current_shard, samples
            samples, current_shard = {}, shard
            by_path.clear()  # hard links refer to earlier members of the same shard
            folder = posixpath.dirname(placer.shard_names[shard])
        member = path[len(folder) + 1 :] if folder else path  # as in the tar
        if label is not None and kind == MemberKind.DIRECTORY:
            placer.declare(shard, member, label)
            continue
        if label is not None and kind == MemberKind.FILE and not _may_be_label(member):
            placer.own(shard, member, (offset, size, mode, mtime), label)
            continue
        if kind == MemberKind.DIRECTORY:
            continue  # folders present nothing of their own
        if kind == MemberKind.SYMLINK:
            placer.other(shard, f"symlink {member}")
            continue
        if kind == MemberKind.HARDLINK:
            target = by_path.get(link)
            if target is None:
                placer.report.dropped_links += 1
                placer.report.note(
                    "link", f"hard link {path!r} -> {link!r}: target not in the same shard"
                )
                continue
            offset, size, mode, mtime, label = target
        else:
            by_path[path] = (offset, size, mode, mtime, label)
        split = split_key(path)
        if split is None:
            if is_image_name(path):
                placer.unsplit(shard, member)
            else:
                placer.other(shard, member)
            continue
        key, ext = split
        kind_of = last_extension(ext)
        if kind_of in IMAGE_EXTENSIONS:
            placer.report.images += 1
            samples.setdefault(key, _Sample()).images.append((member, offset, size, mode, mtime))
        elif kind_of in LABEL_EXTENSIONS:
            sample = samples.setdefault(key, _Sample())
            if sample.label is None:
                sample.label = label
        else:
            placer.other(shard, member)
    if current_shard != -1:
        yield current_shard, samples


def _under_class(member: str, class_name: str) -> str:
    """The member path below its class folder, without a first folder of the class's name."""
    first, _, rest = member.partition("/")
    return rest if rest and first == class_name else member


class _Placer:
    """Places labelled images at ``FOLDER/CLASS/PATH`` and counts what is left out; when
    ``strict``, the first image left out stops the placing (only counting goes on)."""

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
        self.leaving_out = False  # an image is left out: a strict build will not be used
        self.placed: list[Placed] = []
        # Rows that carry their own label (parquet, MDS): class folders by split folder.
        self.declared: dict[str, dict[int, str]] = {}  # the shard's own class folders
        self.splits: dict[str, str] = {}  # split folder -> its shards' folder
        self.max_own: dict[str, int] = {}  # shards' folder -> its largest own label
        self.own_shards: set[int] = set()
        # (shard, folder in it) -> (shard's folder, split, split + "/") of self-labelled rows
        self._own_places: dict[tuple[int, str], tuple[str, str, str]] = {}

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

    def place_shard(self, shard: int, samples: dict[str, _Sample]) -> None:
        report = self.report
        shard_name = self.shard_names[shard]
        folder = posixpath.dirname(shard_name)
        labeled_here = 0
        for sample in samples.values():
            if sample.label is None:
                for member, *_ in sample.images:
                    report.unlabeled += 1
                    report.note("unlabelled", f"image {member} in {shard_name} has no label")
                    self._left_out(f"{member} in {shard_name}")
                continue
            labeled_here += len(sample.images)
            if not sample.images:
                continue
            name = self.class_name(shard, sample.label)
            if self.leaving_out and self.strict:
                continue
            for member, offset, size, mode, mtime in sample.images:
                path = posixpath.join(folder, name, _under_class(member, name))
                self.placed.append((shard, path, offset, size, mode, mtime))
        report.labeled += labeled_here
        report.labeled_shards += labeled_here > 0

    def declare(self, shard: int, member: str, label: int) -> None:
        """A class folder a shard names itself (a parquet ClassLabel): made even if empty."""
        folder = posixpath.dirname(self.shard_names[shard])
        split = posixpath.join(folder, posixpath.dirname(member))
        self.declared.setdefault(split, {})[label] = posixpath.basename(member)
        self.splits.setdefault(split, folder)

    def own(self, shard: int, member: str, data: tuple[int, int, int, int], label: int) -> None:
        """An image row that carries its own label: ``SPLIT/FILE`` goes to
        ``SPLIT/CLASS/FILE``, CLASS the shard's own name for it, else from the classes
        list (``formats.classes.class_folders``), else the label's padded digits."""
        within, _, base = member.rpartition("/")
        place = self._own_places.get((shard, within))
        if place is None:  # once per shard and folder: a million rows share a few
            folder = posixpath.dirname(self.shard_names[shard])
            split = posixpath.join(folder, within)
            place = self._own_places[(shard, within)] = (folder, split, posixpath.join(split, ""))
            self.splits.setdefault(split, folder)
            if shard not in self.own_shards:
                self.own_shards.add(shard)
                self.report.labeled_shards += 1
        folder, split, prefix = place
        self.report.images += 1
        self.report.labeled += 1
        if label > self.max_own.get(folder, -1):
            self.max_own[folder] = label
        name = self.declared.get(split, {}).get(label) or self._own_class(shard, label)
        if not (self.leaving_out and self.strict):
            self.placed.append((shard, f"{prefix}{name}/{base}", *data))

    def _own_class(self, shard: int, label: int) -> str:
        names = self.classes_for(posixpath.dirname(self.shard_names[shard]))
        if names is None:
            return numeric_folder(label, self.width)
        self.class_name(shard, label)  # refuses a label the list does not name
        return class_folders(names)[label]

    def class_folders(self, tree: TreeWriter) -> None:
        """Every class's folder in each split of self-labelled rows, also the empty ones,
        so that ImageFolder's class indices equal the labels."""
        for split, folder in self.splits.items():
            declared = self.declared.get(split)
            names = self.classes_for(folder)
            if declared:
                folders = list(declared.values())
            elif names is not None:
                folders = class_folders(names)
            else:
                top = max(self.max_own.values(), default=-1)  # the mount's largest label
                folders = [numeric_folder(label, self.width) for label in range(top + 1)]
            for name in folders:
                tree.directory(posixpath.join(split, name))

    def unsplit(self, shard: int, member: str) -> None:
        """An image whose name has no key (``.x.png``): it cannot have a label."""
        shard_name = self.shard_names[shard]
        self.report.images += 1
        self.report.unsplit += 1
        self.report.note("unsplit", f"image {member} in {shard_name}")
        self._left_out(f"{member} in {shard_name}")

    def other(self, shard: int, what: str) -> None:
        self.report.ignored += 1
        self.report.note("other", f"{what} in {self.shard_names[shard]}")

    def _left_out(self, example: str) -> None:
        if self.strict and not self.leaving_out:
            self.report.auto_example = example
            self.placed.clear()  # nothing will be written: only count from here on
        self.leaving_out = True

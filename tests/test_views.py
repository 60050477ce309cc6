"""Views: the raw and ImageFolder trees built from an index, and lookups in them."""

from __future__ import annotations

import itertools
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
from support.tarbuild import MTIME, directory, hardlink, make_tar, store_with, symlink

from shardfs.config import IndexConfig, Layout, ViewConfig
from shardfs.errors import NotADirError, NotFoundError, UsageError
from shardfs.formats.tar import MemberKind
from shardfs.index.db import IndexBuilder
from shardfs.store.remote import Store
from shardfs.views import view as view_module
from shardfs.views.view import View, ViewReport, build_view, parse_classes

_counter = itertools.count()


def index_of(tmp_path: Path, shards: dict[str, bytes]) -> tuple[Store, Path]:
    store = store_with(shards)
    builder = IndexBuilder(store, IndexConfig(cache_dir=tmp_path / "cache"))
    return store, builder.build(store.list_shards())


def view_of(
    tmp_path: Path,
    shards: dict[str, bytes],
    layout: Layout = "raw",
    classes: tuple[str, ...] | None = None,
    classes_for: Callable[[str], list[str] | None] = lambda _folder: None,
) -> tuple[View, ViewReport]:
    _, index_path = index_of(tmp_path, shards)
    out = tmp_path / "views" / f"v{next(_counter)}.sqlite"
    report = build_view(index_path, out, ViewConfig(layout=layout, classes=classes), classes_for)
    return View(out), report


def tree(view: View, path: str = "") -> dict[str, str]:
    """Every path below ``path`` -> 'dir', 'link:TARGET' or 'file:SHARD@OFFSET+SIZE'."""
    found: dict[str, str] = {}
    for name, node in view.children(view.lookup(path)):
        full = f"{path}/{name}" if path else name
        if node.is_dir:
            found[full] = "dir"
            found.update(tree(view, full))
        elif node.kind == MemberKind.SYMLINK:
            found[full] = f"link:{node.link}"
        else:
            found[full] = f"file:{view.shards[node.shard].name}+{node.size}"
    return found


def content(view: View, shards: dict[str, bytes], path: str) -> bytes:
    node = view.lookup(path)
    data = shards[view.shards[node.shard].name]
    return data[node.offset : node.offset + node.size]


def files(view: View) -> dict[str, str]:
    return {k: v for k, v in tree(view).items() if v != "dir"}


# --- raw --------------------------------------------------------------------------------------


def test_raw_tree_with_implied_and_explicit_directories(tmp_path: Path) -> None:
    shards = {
        "a.tar": make_tar(
            [directory("explicit", 0o700), ("explicit/x.txt", b"xx"), ("implied/deep/y.txt", b"y")]
        ),
        "b.tar": make_tar([directory("empty"), ("top.txt", b"top")]),
    }
    view, report = view_of(tmp_path, shards)
    assert tree(view) == {
        "empty": "dir",
        "explicit": "dir",
        "explicit/x.txt": "file:a.tar+2",
        "implied": "dir",
        "implied/deep": "dir",
        "implied/deep/y.txt": "file:a.tar+1",
        "top.txt": "file:b.tar+3",
    }
    assert content(view, shards, "implied/deep/y.txt") == b"y"
    assert view.layout == report.layout == "raw"
    assert (report.files, report.directories, report.bytes) == (3, 5, 6)
    assert (report.duplicates, report.dropped_links) == (0, 0)
    explicit = view.lookup("explicit")
    assert explicit.mtime == MTIME
    assert explicit.st_mode == stat.S_IFDIR | 0o555
    assert view.lookup("") == view.root and view.lookup("/") == view.root
    assert view.lookup("/explicit//x.txt") == view.lookup("explicit/x.txt")


def test_view_report_is_persisted(tmp_path: Path) -> None:
    view, report = view_of(tmp_path, {"a.tar": make_tar([("a", b"1"), ("a", b"22")])})
    assert view.report == report
    assert view.report.duplicates == 1


def test_duplicates_later_shard_wins_and_are_counted(tmp_path: Path) -> None:
    shards = {
        "a.tar": make_tar([("same.txt", b"from a"), ("d/dup", b"a"), ("only-a", b"a")]),
        "b.tar": make_tar([("same.txt", b"from b!"), ("d/dup", b"bb")]),
        "c.tar": make_tar([("d/dup", b"ccc"), ("d/dup", b"cccc")]),
    }
    view, report = view_of(tmp_path, shards)
    assert content(view, shards, "same.txt") == b"from b!"
    assert content(view, shards, "d/dup") == b"cccc"  # last shard, last member within it
    assert report.duplicates == 4
    # d/dup: one copy lost to a later member of c.tar, two to c.tar; same.txt: one to b.tar.
    assert (report.same_shard_duplicates, report.later_shard_duplicates) == (1, 3)
    assert report.files == 3
    assert report.examples["same_shard"] == ["'d/dup': 2 copies in c.tar"]
    assert report.examples["later_shard"] == [
        "'same.txt': 2 copies in a.tar and b.tar; the one in b.tar is served",
        "'d/dup': 4 copies in 3 shards, a.tar to c.tar; the one in c.tar is served",
    ]


def test_file_versus_directory_conflict_directory_wins(tmp_path: Path) -> None:
    shards = {
        "a.tar": make_tar([("thing", b"a file"), ("other", b"file too")]),
        "b.tar": make_tar([("thing/inside.txt", b"in"), directory("other")]),
    }
    view, report = view_of(tmp_path, shards)
    assert view.lookup("thing").is_dir
    assert view.lookup("other").is_dir
    assert content(view, shards, "thing/inside.txt") == b"in"
    assert report.files == 1
    assert report.duplicates == 2  # each file that lost to a directory is reported
    with pytest.raises(NotADirError):
        view.lookup("thing/inside.txt/x")


def test_hardlinks_resolve_to_the_target_bytes(tmp_path: Path) -> None:
    shards = {
        "a.tar": make_tar(
            [("d/orig.bin", b"original bytes"), hardlink("d/link.bin", "d/orig.bin")]
        ),
        "b.tar": make_tar([hardlink("cross.bin", "d/orig.bin")]),  # target in another shard
    }
    view, report = view_of(tmp_path, shards)
    link = view.lookup("d/link.bin")
    assert link.kind == MemberKind.FILE
    assert content(view, shards, "d/link.bin") == b"original bytes"
    assert link.offset == view.lookup("d/orig.bin").offset
    with pytest.raises(NotFoundError):
        view.lookup("cross.bin")
    assert report.dropped_links == 1


def test_symlinks_inside_kept_outside_dropped(tmp_path: Path) -> None:
    shards = {
        "a.tar": make_tar(
            [
                ("d/target.txt", b"t"),
                symlink("d/sibling", "target.txt"),
                symlink("d/up", "../top.txt"),
                symlink("d/dot", "./target.txt"),
                symlink("d/escape", "../../etc/passwd"),
                symlink("d/absolute", "/etc/passwd"),
                symlink("top-escape", "../x"),
                ("top.txt", b"top"),
            ]
        )
    }
    view, report = view_of(tmp_path, shards)
    assert files(view) == {
        "d/target.txt": "file:a.tar+1",
        "d/sibling": "link:target.txt",
        "d/up": "link:../top.txt",
        "d/dot": "link:./target.txt",
        "top.txt": "file:a.tar+3",
    }
    node = view.lookup("d/up")
    assert node.st_mode == stat.S_IFLNK | 0o777
    assert node.size == len("../top.txt")
    assert report.dropped_links == 3


# --- imagefolder ------------------------------------------------------------------------------


def sample_shard(samples: list[tuple[str, int | None]], *, ext: str = "jpg") -> bytes:
    entries: list[tuple[str, bytes]] = []
    for key, label in samples:
        entries.append((f"{key}.{ext}", f"image {key}".encode()))
        if label is not None:
            entries.append((f"{key}.cls", f"{label}\n".encode()))
    return make_tar(entries)


def test_imagefolder_with_classes_list(tmp_path: Path) -> None:
    shards = {
        "s0.tar": sample_shard([("k0", 0), ("k1", 1)]),
        "s1.tar": sample_shard([("k2", 1), ("k3", 2)]),
    }
    view, report = view_of(tmp_path, shards, "imagefolder", classes=("cat", "dog", "eel"))
    assert files(view) == {
        "cat/k0.jpg": "file:s0.tar+8",
        "dog/k1.jpg": "file:s0.tar+8",
        "dog/k2.jpg": "file:s1.tar+8",
        "eel/k3.jpg": "file:s1.tar+8",
    }
    assert content(view, shards, "eel/k3.jpg") == b"image k3"
    assert view.layout == report.layout == "imagefolder"
    assert (report.files, report.unlabeled, report.ignored) == (4, 0, 0)


def test_auto_picks_imagefolder_and_uses_classes_lookup(tmp_path: Path) -> None:
    shards = {
        "train/s0.tar": sample_shard([("a", 0)]),
        "val/s0.tar": sample_shard([("b", 0)]),
    }
    lookups: list[str] = []

    def classes_for(folder: str) -> list[str] | None:
        lookups.append(folder)
        return {"train": ["tiger"], "val": ["lion"]}.get(folder)

    view, _ = view_of(tmp_path, shards, "auto", classes_for=classes_for)
    assert view.layout == "imagefolder"
    assert sorted(files(view)) == ["train/tiger/a.jpg", "val/lion/b.jpg"]
    assert set(lookups) == {"train", "val"}


def test_zero_padded_labels_width_from_max_label(tmp_path: Path) -> None:
    shards = {"s.tar": sample_shard([(f"k{i:02d}", i) for i in range(12)])}
    view, _ = view_of(tmp_path, shards, "auto")
    names = [name for name, _ in view.children(view.root)]
    assert names == [f"{i:02d}" for i in range(12)]
    assert sorted(files(view))[:2] == ["00/k00.jpg", "01/k01.jpg"]
    assert "11/k11.jpg" in files(view)


def test_single_digit_labels_are_not_padded(tmp_path: Path) -> None:
    view, _ = view_of(tmp_path, {"s.tar": sample_shard([("a", 0), ("b", 9)])}, "imagefolder")
    assert sorted(files(view)) == ["0/a.jpg", "9/b.jpg"]


def test_json_labels(tmp_path: Path) -> None:
    shards = {
        "s.tar": make_tar(
            [
                ("a.png", b"A"),
                ("a.json", b'{"label": 1, "caption": "x"}'),
                ("b.webp", b"B"),
                ("b.json", b"0"),
            ]
        )
    }
    view, report = view_of(tmp_path, shards, "auto")
    assert view.layout == "imagefolder"
    assert sorted(files(view)) == ["0/b.webp", "1/a.png"]
    assert report.files == 2


def test_label_before_image_and_upper_case_extension(tmp_path: Path) -> None:
    shards = {
        "s.tar": make_tar([("k.cls", b"1"), ("k.JPEG", b"img"), ("j.cls", b"0"), ("j.jpg", b"j")])
    }
    view, _ = view_of(tmp_path, shards, "imagefolder")
    assert sorted(files(view)) == ["0/j.jpg", "1/k.JPEG"]


def test_images_without_labels_auto_falls_back_to_raw(tmp_path: Path) -> None:
    shards = {"s.tar": sample_shard([("a", 0), ("b", None), ("c", 1)])}
    view, report = view_of(tmp_path, shards, "auto")
    assert view.layout == report.layout == "raw"
    assert sorted(files(view)) == ["a.cls", "a.jpg", "b.jpg", "c.cls", "c.jpg"]
    assert report.unlabeled == 0  # raw leaves nothing out
    assert report.examples == {}
    # ... but why auto chose raw is kept, and survives in the stored view.
    for kept in (report, view.report):
        assert (kept.requested, kept.auto_unlabeled, kept.labeled) == ("auto", 1, 2)
        assert kept.auto_example == "b.jpg in s.tar"


def test_auto_counts_every_unlabelled_image_across_shards(tmp_path: Path) -> None:
    """The count is the whole dataset's, not the first one met; the example is the first."""
    shards = {
        "d/s0.tar": sample_shard([("a", 0), ("x/b", None), ("c", 1)]),
        "d/s1.tar": sample_shard([("d", None), ("e", 0), ("f", None)]),
        "d/s2.tar": sample_shard([("g", 1)]),
    }
    view, report = view_of(tmp_path, shards, "auto")
    assert view.layout == "raw"
    assert (report.auto_unlabeled, report.labeled, report.labeled_shards) == (3, 4, 3)
    assert report.auto_example == "x/b.jpg in d/s0.tar"


def test_auto_imagefolder_counts_labelled_images_and_shards(tmp_path: Path) -> None:
    shards = {
        "s0.tar": sample_shard([("a", 0), ("b", 1)]),
        "s1.tar": sample_shard([("c", 1)]),
        "s2.tar": make_tar([("readme.txt", b"no images here")]),
    }
    _, report = view_of(tmp_path, shards, "auto")
    assert report.layout == "imagefolder"
    assert (report.requested, report.labeled, report.labeled_shards) == ("auto", 3, 2)
    assert (report.auto_unlabeled, report.auto_example) == (0, "")


def test_auto_with_labels_but_no_labelled_image_is_raw(tmp_path: Path) -> None:
    """Labels whose images are missing would make an empty imagefolder tree."""
    shards = {"s.tar": make_tar([("a.cls", b"0"), ("b.txt", b"text")])}
    view, report = view_of(tmp_path, shards, "auto")
    assert view.layout == "raw"
    assert sorted(files(view)) == ["a.cls", "b.txt"]
    assert (report.labeled, report.auto_unlabeled) == (0, 0)


def test_images_without_labels_explicit_imagefolder_drops_them(tmp_path: Path) -> None:
    shards = {"s.tar": sample_shard([("a", 0), ("b", None), ("c", 1), ("d", None)])}
    view, report = view_of(tmp_path, shards, "imagefolder")
    assert view.layout == "imagefolder"
    assert sorted(files(view)) == ["0/a.jpg", "1/c.jpg"]
    assert report.unlabeled == 2
    assert report.examples["unlabelled"] == [
        "image b.jpg in s.tar has no label",
        "image d.jpg in s.tar has no label",
    ]


def test_no_labels_at_all(tmp_path: Path) -> None:
    shards = {"s.tar": sample_shard([("a", None)])}
    view, _ = view_of(tmp_path, shards, "auto")
    assert view.layout == "raw"
    with pytest.raises(UsageError, match="no labelled samples"):
        view_of(tmp_path, shards, "imagefolder")


def test_label_out_of_range_of_classes_is_usage_error(tmp_path: Path) -> None:
    shards = {"s.tar": sample_shard([("a", 0), ("b", 2)])}
    with pytest.raises(UsageError, match=r"s\.tar: label 2 has no name.*2 names"):
        view_of(tmp_path, shards, "imagefolder", classes=("cat", "dog"))
    with pytest.raises(UsageError, match="label 2"):
        view_of(tmp_path, shards, "auto", classes_for=lambda _f: ["cat", "dog"])


def test_label_only_and_non_image_members(tmp_path: Path) -> None:
    shards = {
        "s.tar": make_tar(
            [
                ("a.jpg", b"A"),
                ("a.cls", b"0"),
                ("a.txt", b"caption"),
                ("orphan.cls", b"1"),
                ("meta.json", b'{"label": 1}'),
                ("README", b"hello"),
                directory("d"),
                symlink("lnk", "a.jpg"),
            ]
        )
    }
    view, report = view_of(tmp_path, shards, "imagefolder")
    assert files(view) == {"0/a.jpg": "file:s.tar+1"}
    assert report.ignored == 3  # a.txt, README and the symlink
    assert report.examples["other"] == ["a.txt in s.tar", "README in s.tar", "symlink lnk in s.tar"]
    assert report.unlabeled == 0


# The four-sample shard of issue 19: two keys share a basename, one has dotted extensions.
COLLISION_SHARD = [
    ("x/s1.png", b"x-s1"),
    ("x/s1.cls", b"0"),
    ("y/s1.png", b"y-s1"),
    ("y/s1.cls", b"1"),
    ("s3.v2.png", b"s3"),
    ("s3.v2.cls", b"2"),
    ("k4.png", b"k4"),
    ("k4.cls", b"0"),
]


def test_imagefolder_presents_every_sample_of_the_collision_shard(tmp_path: Path) -> None:
    shards = {"s.tar": make_tar(COLLISION_SHARD)}
    view, report = view_of(tmp_path, shards, "auto")
    assert view.layout == "imagefolder"
    assert files(view) == {
        "0/k4.png": "file:s.tar+2",
        "0/x/s1.png": "file:s.tar+4",
        "1/y/s1.png": "file:s.tar+4",
        "2/s3.v2.png": "file:s.tar+2",
    }
    assert content(view, shards, "0/x/s1.png") == b"x-s1"
    assert content(view, shards, "1/y/s1.png") == b"y-s1"
    assert (report.images, report.images_presented, report.labeled) == (4, 4, 4)
    assert (report.duplicates, report.unlabeled, report.unsplit, report.ignored) == (0, 0, 0, 0)
    assert report.examples == {}


def test_imagefolder_keeps_folders_with_dots_and_does_not_repeat_the_class_folder(
    tmp_path: Path,
) -> None:
    """``cat/x.jpg`` labelled ``cat`` (a tree packed as CLASS/KEY.jpg) stays ``cat/x.jpg``;
    a folder of another name is kept under the class."""
    shards = {
        "train/s.tar": make_tar(
            [
                ("cat/x.jpg", b"x"),
                ("cat/x.cls", b"0"),
                ("dog/y.jpg", b"y"),
                ("dog/y.cls", b"0"),
                ("a.b/c.d/e.f.JPG", b"e"),
                ("a.b/c.d/e.f.cls", b"1"),
                ("cat", b"a file named as a class"),
            ]
        )
    }
    view, report = view_of(tmp_path, shards, "imagefolder", classes=("cat", "dog"))
    assert sorted(files(view)) == [
        "train/cat/dog/y.jpg",
        "train/cat/x.jpg",
        "train/dog/a.b/c.d/e.f.JPG",
    ]
    assert content(view, shards, "train/dog/a.b/c.d/e.f.JPG") == b"e"
    assert (report.images, report.images_presented, report.ignored) == (3, 3, 1)
    assert report.examples["other"] == ["cat in train/s.tar"]


def test_imagefolder_serves_hard_linked_images_and_labels(tmp_path: Path) -> None:
    shards = {
        "s.tar": make_tar(
            [
                ("a.png", b"A"),
                ("a.cls", b"1"),
                hardlink("b.png", "a.png"),
                hardlink("b.cls", "a.cls"),
                hardlink("c.png", "elsewhere.png"),
                ("c.cls", b"0"),
            ]
        )
    }
    view, report = view_of(tmp_path, shards, "imagefolder")
    assert sorted(files(view)) == ["1/a.png", "1/b.png"]
    assert content(view, shards, "1/b.png") == b"A"
    assert report.dropped_links == 1
    assert report.examples["link"] == [
        "hard link 'c.png' -> 'elsewhere.png': target not in the same shard"
    ]


def test_imagefolder_counts_and_names_each_kind_left_out(tmp_path: Path) -> None:
    shards = {
        "a.tar": make_tar(
            [
                ("x/s1.png", b"first"),
                ("x/s1.cls", b"0"),
                ("d.png", b"d"),
                ("d.cls", b"0"),
                ("d.png", b"d again"),  # a later member of the same shard wins
                ("nolabel.png", b"n"),
                (".png", b"no key"),
                ("dir/.x.jpg", b"no key either"),
                ("k.txt", b"caption"),
            ]
        ),
        "b.tar": make_tar(
            [
                ("x/s1.png", b"second"),  # the later shard wins
                ("x/s1.cls", b"0"),
                ("f.png", b"a file"),  # loses to the folder 0/f.png/ below
                ("f.cls", b"0"),
                ("f.png/g.png", b"g"),
                ("f.png/g.cls", b"0"),
            ]
        ),
    }
    view, report = view_of(tmp_path, shards, "imagefolder")
    assert sorted(files(view)) == ["0/d.png", "0/f.png/g.png", "0/x/s1.png"]
    assert content(view, shards, "0/x/s1.png") == b"second"
    assert content(view, shards, "0/d.png") == b"d again"
    assert (report.images, report.images_presented) == (9, 3)
    assert (report.unlabeled, report.unsplit, report.ignored) == (1, 2, 1)
    assert (report.same_shard_duplicates, report.later_shard_duplicates) == (1, 1)
    assert report.duplicates == 3  # and f.png, which lost to a folder
    assert report.examples == {
        "same_shard": ["'0/d.png': 2 copies in a.tar"],
        "later_shard": ["'0/x/s1.png': 2 copies in a.tar and b.tar; the one in b.tar is served"],
        "folder": ["file '0/f.png' in b.tar is also a folder"],
        "unlabelled": ["image nolabel.png in a.tar has no label"],
        "unsplit": ["image .png in a.tar", "image dir/.x.jpg in a.tar"],
        "other": ["k.txt in a.tar"],
    }


def test_auto_counts_an_image_without_a_key_as_one_without_a_label(tmp_path: Path) -> None:
    shards = {"s.tar": make_tar([("a.jpg", b"a"), ("a.cls", b"0"), ("d/.b.jpg", b"b")])}
    view, report = view_of(tmp_path, shards, "auto")
    assert view.layout == "raw"
    assert (report.auto_unlabeled, report.auto_example) == (1, "d/.b.jpg in s.tar")
    assert (report.unsplit, report.images, report.images_presented) == (0, 2, 2)


def test_raw_counts_the_images_it_holds_and_presents(tmp_path: Path) -> None:
    shards = {
        "a.tar": make_tar([("p/1.jpg", b"1"), ("p/2.PNG", b"2"), ("notes.txt", b"n")]),
        "b.tar": make_tar([("p/1.jpg", b"1 again"), hardlink("p/3.jpg", "p/1.jpg")]),
    }
    _, report = view_of(tmp_path, shards, "raw")
    assert (report.images, report.images_presented, report.files) == (4, 3, 4)
    assert (report.later_shard_duplicates, report.same_shard_duplicates) == (1, 0)


def test_a_view_cached_under_the_old_key_rule_is_not_reused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Views are files named by ``view_key``: the rule keeping member folders and the
    index schema that reads ``KEY.v2.cls`` labels each give a view a new name."""
    import hashlib
    import json

    from shardfs.views import view as views
    from shardfs.views.view import view_key

    config = ViewConfig()
    text = json.dumps([3, "fingerprint", config.layout, config.classes, {}])
    before = hashlib.sha256(text.encode()).hexdigest()[:20]  # how view 3 named it
    now = view_key("fingerprint", config, {})
    assert now != before
    monkeypatch.setattr(views, "SCHEMA_VERSION", views.SCHEMA_VERSION + 1)
    assert view_key("fingerprint", config, {}) not in (now, before)


def test_inode_numbers_stable_when_rebuilt_from_same_index(tmp_path: Path) -> None:
    shards = {
        "a.tar": make_tar([("z/1", b"1"), ("a/2", b"2"), directory("m"), ("m/n/3", b"3")]),
        "b.tar": make_tar([("a/4", b"4"), ("top", b"5")]),
    }
    _, index_path = index_of(tmp_path, shards)
    inodes = []
    for name in ("one", "two"):
        out = tmp_path / f"{name}.sqlite"
        build_view(index_path, out, ViewConfig(layout="raw"), lambda _f: None)
        view = View(out)
        inodes.append({path: view.lookup(path).ino for path in tree(view)})
        view.close()
    assert inodes[0] == inodes[1]
    assert len(set(inodes[0].values())) == len(inodes[0])
    assert 1 not in inodes[0].values()  # the root's


def test_lookup_errors(tmp_path: Path) -> None:
    view, _ = view_of(tmp_path, {"a.tar": make_tar([("d/f.txt", b"x")])})
    with pytest.raises(NotFoundError) as not_found:
        view.lookup("d/missing")
    assert not_found.value.errno == 2
    with pytest.raises(NotFoundError):
        view.lookup("nope/f.txt")
    with pytest.raises(NotADirError) as not_dir:
        view.lookup("d/f.txt/below")
    assert not_dir.value.errno == 20


def test_parse_classes() -> None:
    assert parse_classes("cat\n dog \nsea lion\n\n\n") == ["cat", "dog", "sea lion"]
    assert parse_classes("") == []
    for bad in ("cat\n\ndog\n", "a/b\n", "..\n", ".\n"):
        with pytest.raises(UsageError, match="invalid class name"):
            parse_classes(bad)
    with pytest.raises(UsageError, match=r"^c\.txt: invalid class name 'a/b' on line 2$"):
        parse_classes("cat\na/b\n", "c.txt")


def test_parse_classes_refuses_duplicate_names_with_their_lines() -> None:
    with pytest.raises(UsageError) as twice:
        parse_classes("cat\ndog\n cat\n", "train/classes.txt")
    assert str(twice.value) == (
        "train/classes.txt: duplicate class name 'cat' on lines 1 and 3 "
        "(each label needs a name of its own)"
    )
    assert twice.value.exit_code == 2
    with pytest.raises(UsageError, match=r"'b' on lines 2, 3 and 5 "):
        parse_classes("a\nb\nb\nc\nb\na\n")
    # Names differing only in case are different folders, so they are allowed.
    assert parse_classes("Cat\ncat\n") == ["Cat", "cat"]


# --- classes.txt next to the shards (through mount.open_source, no FUSE) ----------------------


def test_open_source_uses_classes_txt_next_to_the_shards(tmp_path: Path) -> None:
    from support.tarbuild import memory_url, put

    from shardfs.config import SourceConfig
    from shardfs.dataset import open_source

    url = memory_url()
    put(url, "train/s0.tar", sample_shard([("a", 0), ("b", 1)]))
    put(url, "train/classes.txt", b"cat\ndog\n")
    put(url, "val/s0.tar", sample_shard([("c", 1)]))
    put(url, "classes.txt", b"lion\ntiger\n")
    opened = open_source(SourceConfig(url), IndexConfig(cache_dir=tmp_path), ViewConfig())
    assert opened.view.layout == "imagefolder"
    assert sorted(files(opened.view)) == ["train/cat/a.jpg", "train/dog/b.jpg", "val/tiger/c.jpg"]
    assert opened.scanned_shards == 2
    opened.view.close()


def test_open_source_non_utf8_classes_txt_is_usage_error(tmp_path: Path) -> None:
    from support.tarbuild import memory_url, put

    from shardfs.config import SourceConfig
    from shardfs.dataset import open_source

    url = memory_url()
    put(url, "s0.tar", sample_shard([("a", 0)]))
    put(url, "classes.txt", b"\xff\xfe\n")
    with pytest.raises(UsageError, match=r"classes\.txt: not UTF-8"):
        open_source(SourceConfig(url), IndexConfig(cache_dir=tmp_path), ViewConfig())


def test_a_walk_through_inodes_loads_them_in_batches_and_scattered_misses_load_few(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    members = [(f"d/{n:04d}.bin", b"x") for n in range(2000)]
    view, _ = view_of(tmp_path, {"a.tar": make_tar(members)})
    inos = sorted(node.ino for _, node in view.files())
    queries: list[int] = []
    query = view._query

    def counted(sql: str, args: tuple[object, ...] = ()) -> list[object]:
        rows = query(sql, args)
        queries.append(len(rows))
        return rows

    monkeypatch.setattr(view, "_query", counted)
    # a shuffled epoch's READs: each miss loads a few neighbours, not a batch of 256
    for ino in inos[100:2000:150]:
        assert view.node(ino).ino == ino
    assert queries and max(queries) <= view_module._NODE_FEW
    # a walk (a listing's GETATTRs): after the first few, a batch per query
    queries.clear()
    for ino in inos[:1000]:
        assert view.node(ino).ino == ino
    assert len(queries) <= 1000 // view_module._NODE_BATCH + 3
    assert max(queries) == view_module._NODE_BATCH

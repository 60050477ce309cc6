"""What a mount says about its tree: the layout ``auto`` chose and why, duplicate class names,
a slow view build, and the index sidecar it used."""

from __future__ import annotations

import hashlib
import io
import logging
import os
import tarfile
from pathlib import Path

import pytest
from support.mounts import assert_one_error_line, mount, umount
from support.processes import is_mounted, run_shardfs
from support.tarbuild import make_tar, memory_url, put

from shardfs import dataset as mount_module
from shardfs.config import IndexConfig, SourceConfig, ViewConfig
from shardfs.dataset import images_line, layout_line, open_source, report_warnings
from shardfs.errors import UsageError
from shardfs.index.db import IndexBuilder, write_sidecar
from shardfs.store.remote import Store
from shardfs.views.view import ViewReport

# --- the layout line, from the facts of a report -----------------------------------------------


def test_layout_line_for_imagefolder_chosen_by_auto() -> None:
    report = ViewReport(layout="imagefolder", requested="auto", labeled=200, labeled_shards=2)
    assert layout_line(report) == "layout: imagefolder (auto: 200 labelled images in 2 shards)"
    report = ViewReport(layout="imagefolder", requested="auto", labeled=1, labeled_shards=1)
    assert layout_line(report) == "layout: imagefolder (auto: 1 labelled image in 1 shard)"


def test_layout_line_for_raw_chosen_by_auto_names_count_example_and_way_out() -> None:
    report = ViewReport(
        layout="raw",
        requested="auto",
        labeled=1_280_999,
        auto_unlabeled=1,
        auto_example="train/0001.jpg in shard-000.tar",
    )
    assert layout_line(report) == (
        "layout: raw (auto: 1 of 1,281,000 images has no label, e.g. train/0001.jpg in "
        "shard-000.tar; use --layout imagefolder to mount the 1,280,999 labelled ones)"
    )
    report.auto_unlabeled, report.labeled = 3, 1
    assert "3 of 4 images have no label" in str(layout_line(report))
    assert str(layout_line(report)).endswith("mount the 1 labelled one)")


def test_layout_line_when_nothing_is_labelled_and_for_layouts_asked_by_name() -> None:
    none = ViewReport(layout="raw", requested="auto")
    assert layout_line(none) == (
        "layout: raw (auto: no image has a label, a KEY.cls or KEY.json next to KEY.jpg)"
    )
    assert layout_line(ViewReport(layout="raw", requested="raw")) is None
    assert layout_line(ViewReport(layout="imagefolder", requested="imagefolder")) is None


def test_images_line_says_how_many_images_the_shards_hold_and_the_tree_presents() -> None:
    assert images_line(ViewReport()) == ""  # no image at all: nothing to say
    assert images_line(ViewReport(images=1, images_presented=1)) == (
        "the shards hold 1 image, 1 presented"
    )
    report = ViewReport(images=1_281_167, images_presented=1_281_167)
    assert images_line(report) == "the shards hold 1,281,167 images, 1,281,167 presented"
    report = ViewReport(images=10, images_presented=6, unlabeled=1, unsplit=1)
    assert images_line(report) == (
        "the shards hold 10 images, 6 presented "
        "(1 without a label, 1 without a sample key, 2 under a duplicate path)"
    )


def test_report_warnings_say_whether_a_duplicate_is_in_the_same_or_a_later_shard() -> None:
    report = ViewReport(duplicates=6, same_shard_duplicates=3, later_shard_duplicates=2)
    report.note("same_shard", "'0/s1.png': 2 copies in s.tar")
    report.note("later_shard", "'a': 2 copies in s.tar and t.tar; the one in t.tar is served")
    assert report_warnings(report) == [
        "3 duplicate path(s) within one shard; the later member is served",
        "  e.g. '0/s1.png': 2 copies in s.tar",
        "2 duplicate path(s) across shards; the copy in the later shard is served",
        "  e.g. 'a': 2 copies in s.tar and t.tar; the one in t.tar is served",
        "1 file(s) with the path of a folder; the folder is served",
    ]
    for number in range(5):
        report.note("same_shard", f"more {number}")
    assert len(report.examples["same_shard"]) == 3  # a few of each kind, not all
    assert report_warnings(ViewReport(images=3, images_presented=3)) == []


# --- through open_source (a memory store, no FUSE) ---------------------------------------------


def samples(keys: list[tuple[str, int | None]]) -> bytes:
    entries: list[tuple[str, bytes]] = []
    for key, label in keys:
        entries.append((f"{key}.jpg", f"image {key}".encode()))
        if label is not None:
            entries.append((f"{key}.cls", f"{label}\n".encode()))
    return make_tar(entries)


def opened_notices(url: str, cache: Path, layout: str = "auto") -> list[str]:
    said: list[str] = []
    opened = open_source(
        SourceConfig(url),
        IndexConfig(cache_dir=cache),
        ViewConfig(layout=layout),  # type: ignore[arg-type]
        notice=said.append,
        warn=lambda text: said.append(f"warning: {text}"),
    )
    opened.close()
    # A memory store has no version to check reads against, and open_source says so; these
    # tests are about what it says of the layout.
    return [text for text in said if "offers no version check" not in text]


def test_open_source_says_why_auto_chose_raw_at_every_mount(tmp_path: Path) -> None:
    url = memory_url()
    put(url, "train/s0.tar", samples([("a", 0), ("b", 1)]))
    put(url, "train/s1.tar", samples([("c", 0), ("sub/d", None), ("e", None)]))
    expected = (
        "layout: raw (auto: 2 of 5 images have no label, e.g. sub/d.jpg in train/s1.tar; "
        "use --layout imagefolder to mount the 3 labelled ones)"
    )
    first = opened_notices(url, tmp_path)
    assert first == [expected]  # no "left out" warning: raw shows every image
    second = opened_notices(url, tmp_path)  # the stored view is reused, the reason kept
    assert second == [expected]
    assert not any("building the view" in line for line in first + second)


def test_open_source_says_auto_chose_imagefolder(tmp_path: Path) -> None:
    url = memory_url()
    put(url, "s0.tar", samples([("a", 0), ("b", 1)]))
    put(url, "s1.tar", samples([("c", 1)]))
    assert opened_notices(url, tmp_path) == [
        "layout: imagefolder (auto: 3 labelled images in 2 shards)"
    ]
    # Asked for by name, no layout line; the explicit imagefolder warns what it leaves out.
    put(url, "s2.tar", samples([("d", None)]))
    said = opened_notices(url, tmp_path, layout="imagefolder")
    assert said == [
        "warning: 1 image(s) without a label left out",
        "warning:   e.g. image d.jpg in s2.tar has no label",
    ]


def test_duplicate_names_in_classes_txt_are_refused(tmp_path: Path) -> None:
    url = memory_url()
    put(url, "train/s0.tar", samples([("a", 0), ("b", 1)]))
    put(url, "train/classes.txt", b"cat\ndog\ncat\n")
    with pytest.raises(UsageError) as refused:
        opened_notices(url, tmp_path)
    assert str(refused.value) == (
        "train/classes.txt: duplicate class name 'cat' on lines 1 and 3 "
        "(each label needs a name of its own)"
    )


def test_a_slow_view_build_is_announced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = memory_url()
    put(url, "s0.tar", make_tar([(f"d/{i}.txt", b"x") for i in range(1500)]))
    put(url, "s1.tar", make_tar([(f"e/{i}.txt", b"y") for i in range(500)]))
    monkeypatch.setattr(mount_module, "VIEW_NOTICE_AFTER", 0.0)
    said = opened_notices(url, tmp_path / "slow", layout="raw")
    assert said == ["building the view of 2,000 members (once; later mounts reuse it) ..."]
    # A build that ends before the delay says nothing; a reused view is not built.
    monkeypatch.setattr(mount_module, "VIEW_NOTICE_AFTER", 60.0)
    assert opened_notices(url, tmp_path / "fast", layout="raw") == []
    monkeypatch.setattr(mount_module, "VIEW_NOTICE_AFTER", 0.0)
    assert opened_notices(url, tmp_path / "fast", layout="raw") == []


# --- the index sidecar log line ---------------------------------------------------------------


@pytest.mark.parametrize(("folder", "where"), [("", "the source root"), ("train", "folder train/")])
def test_sidecar_log_line_names_the_folder(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, folder: str, where: str
) -> None:
    url = memory_url()
    shard = f"{folder}/s0.tar" if folder else "s0.tar"
    put(url, shard, make_tar([("a.txt", b"a")]))
    sidecar_url = f"{url}/{folder}" if folder else url
    store = Store(SourceConfig(sidecar_url))
    write_sidecar(
        store, IndexBuilder(store, IndexConfig(tmp_path / "a")).build(store.list_shards())
    )
    root = Store(SourceConfig(url))
    with caplog.at_level(logging.INFO, logger="shardfs.index.db"):
        builder = IndexBuilder(root, IndexConfig(tmp_path / "b"))
        builder.build(root.list_shards())
    assert builder.scanned_shards == 0
    assert f"using the index sidecar in {where} for 1 shard(s)" in caplog.messages


# --- a real mount: what `shardfs mount` prints ------------------------------------------------


def write_webdataset(folder: Path, shards: int, per_shard: int, unlabelled: set[int]) -> None:
    """``shards`` tar files of KEY.jpg (+ KEY.cls unless the sample number is in
    ``unlabelled``), written by Python's tarfile."""
    folder.mkdir(parents=True)
    number = 0
    for index in range(shards):
        with tarfile.open(folder / f"shard-{index:03d}.tar", "w") as tar:
            for _ in range(per_shard):
                members = [(f"train/{number:04d}.jpg", os.urandom(64 + number))]
                if number not in unlabelled:
                    members.append((f"train/{number:04d}.cls", str(number % 2).encode()))
                for name, data in members:
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
                number += 1


@pytest.mark.integration
def test_mount_prints_why_auto_fell_back_to_raw(tmp_path: Path, mountpoint: Path) -> None:
    write_webdataset(tmp_path / "shards", 2, 100, unlabelled={1})
    result = mount(tmp_path / "shards", mountpoint, tmp_path / "cache", env={})
    assert (
        "shardfs: layout: raw (auto: 1 of 200 images has no label, e.g. train/0001.jpg in "
        "shard-000.tar; use --layout imagefolder to mount the 199 labelled ones)"
    ) in result.stderr.splitlines()
    assert "warning" not in result.stderr
    assert result.stdout.rstrip().endswith(
        "(399 files, raw layout): the shards hold 200 images, 200 presented"
    ), result.stdout
    assert sorted(os.listdir(mountpoint / "train"))[:3] == ["0000.cls", "0000.jpg", "0001.jpg"]
    umount(mountpoint)
    # The advice works: imagefolder mounts the 199 labelled images, and names the one left out.
    result = mount(
        tmp_path / "shards", mountpoint, tmp_path / "cache", "--layout", "imagefolder", env={}
    )
    assert "layout:" not in result.stderr
    assert "shardfs: warning: 1 image(s) without a label left out" in result.stderr
    assert result.stdout.rstrip().endswith(
        "(199 files, imagefolder layout): the shards hold 200 images, 199 presented "
        "(1 without a label)"
    ), result.stdout
    counts = {label: len(os.listdir(mountpoint / label / "train")) for label in ("0", "1")}
    assert counts == {"0": 100, "1": 99}  # sample 0001 (label 1) had no .cls
    umount(mountpoint)


@pytest.mark.integration
def test_mount_prints_that_auto_chose_imagefolder(tmp_path: Path, mountpoint: Path) -> None:
    write_webdataset(tmp_path / "shards", 2, 100, unlabelled=set())
    with tarfile.open(tmp_path / "shards" / "shard-000.tar") as tar:
        member = tar.extractfile("train/0000.jpg")
        assert member is not None
        first = hashlib.sha256(member.read()).hexdigest()
    result = mount(tmp_path / "shards", mountpoint, tmp_path / "cache", env={})
    assert "shardfs: layout: imagefolder (auto: 200 labelled images in 2 shards)" in (
        result.stderr.splitlines()
    )
    # The member's folder is kept under its class: train/0000.jpg is 0/train/0000.jpg.
    assert sorted(os.listdir(mountpoint / "0")) == ["train"]
    served = (mountpoint / "0" / "train" / "0000.jpg").read_bytes()
    assert hashlib.sha256(served).hexdigest() == first
    umount(mountpoint)


@pytest.mark.integration
def test_mount_refuses_duplicate_class_names(tmp_path: Path, mountpoint: Path) -> None:
    write_webdataset(tmp_path / "shards", 1, 4, unlabelled=set())
    (tmp_path / "shards" / "classes.txt").write_text("cat\ndog\ncat\n")
    result = run_shardfs("mount", tmp_path / "shards", mountpoint, "--cache-dir", tmp_path / "c")
    line = assert_one_error_line(result)
    assert line == (
        "shardfs: error: classes.txt: duplicate class name 'cat' on lines 1 and 3 "
        "(each label needs a name of its own)"
    )
    assert result.returncode == 2
    assert not is_mounted(mountpoint)
    # The same through --classes FILE (the folder's classes.txt is then not read).
    (tmp_path / "shards" / "classes.txt").unlink()
    names = tmp_path / "names.txt"
    names.write_text("cat\ndog\n\ndog\n")
    result = run_shardfs(
        "mount", tmp_path / "shards", mountpoint, "--classes", names, "--cache-dir", tmp_path / "c"
    )
    line = assert_one_error_line(result)
    assert "invalid class name '' on line 3" in line
    names.write_text("cat\ndog\ndog\n")
    result = run_shardfs(
        "mount", tmp_path / "shards", mountpoint, "--classes", names, "--cache-dir", tmp_path / "c"
    )
    line = assert_one_error_line(result)
    assert "duplicate class name 'dog' on lines 2 and 3" in line
    assert result.returncode == 2
    assert not is_mounted(mountpoint)

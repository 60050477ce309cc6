"""``shardfs pack`` and ``shardfs verify`` without FUSE: the plan, the tar layout, the index
rows, and the command line against a local destination."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from support.datagen import DEFAULT_CLASS_SIZES, make_imagefolder, relative_files

from shardfs.config import SourceConfig
from shardfs.formats.tar import MemberKind
from shardfs.index.db import SIDECAR_NAME
from shardfs.tools.pack import (
    MANIFEST_NAME,
    PackConfig,
    Packer,
    PackError,
    PlannedShard,
    SourceFile,
    index_rows,
    layout,
    make_plan,
    plan_fingerprint,
    scan_tree,
    write_shard,
)

ERROR_LINE = re.compile(r"shardfs: error: \S.*")


def run(tmp_path: Path, *args: str | Path) -> subprocess.CompletedProcess[str]:
    """``python -m shardfs ARGS`` with a cache folder of its own and no terminal."""
    env = {**os.environ, "SHARDFS_CACHE_DIR": str(tmp_path / "cache-env")}
    return subprocess.run(
        [sys.executable, "-m", "shardfs", *map(str, args)],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def one_error_line(result: subprocess.CompletedProcess[str], code: int) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == code, (result.returncode, result.stderr)
    assert len(lines) == 1, result.stderr
    assert ERROR_LINE.fullmatch(lines[0]), lines[0]
    assert "Traceback" not in result.stderr
    return lines[0]


@pytest.fixture(scope="module")
def imagefolder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """19 images in 4 uneven classes, non-ASCII and long names (stems without dots)."""
    root = tmp_path_factory.mktemp("imagefolder") / "src"
    make_imagefolder(root, DEFAULT_CLASS_SIZES)
    return root


def plan(root: Path, **options: object) -> tuple[list[PlannedShard], list[str] | None]:
    files, folders, errors = scan_tree(root)
    assert errors == []
    shards, classes = make_plan(files, folders, PackConfig(**options), errors)  # type: ignore[arg-type]
    assert errors == []
    return shards, classes


def shard_bytes(shard: PlannedShard, root: Path) -> bytes:
    out = io.BytesIO()
    size = write_shard(shard, root, out, lambda _n: None)
    assert size == len(out.getvalue())
    return out.getvalue()


def file_names(shard: PlannedShard) -> list[str]:
    return [m.name for m in shard.members if m.source is not None]


# -- the tar layout ----------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["tree", "webdataset"])
def test_layout_and_index_rows_agree_with_python_tarfile(imagefolder: Path, fmt: str) -> None:
    shards, _ = plan(imagefolder, format=fmt, max_count=7)
    assert len(shards) > 1
    for shard in shards:
        data = shard_bytes(shard, imagefolder)
        placed, total = layout(shard)
        assert total == len(data) and total % (20 * 512) == 0
        rows = index_rows(shard)
        with tarfile.open(fileobj=io.BytesIO(data), encoding="utf-8") as tar:
            members = tar.getmembers()
        assert [m.name for m in members] == [row[0] for row in rows]
        assert [m.offset_data for m in members] == [row[1] for row in rows]
        assert [m.size for m in members] == [row[2] for row in rows]
        assert [offset for _m, _h, offset in placed] == [row[1] for row in rows]
        for member, row in zip(members, rows, strict=True):
            path, offset, size, _mode, mtime, kind, _link, label = row
            assert member.mtime == mtime
            body = data[offset : offset + size]
            if kind == MemberKind.DIRECTORY:
                assert member.isdir()
            elif member.name.endswith(".cls"):
                assert body == str(label).encode()
            else:
                assert label is None
                assert body == (imagefolder / path).read_bytes()


def test_tree_format_packs_any_tree_with_folders_and_odd_files(tmp_path: Path) -> None:
    root = tmp_path / "src"
    (root / "a" / "b").mkdir(parents=True)
    (root / "empty").mkdir()
    (root / "notes.txt").write_text("hello")
    (root / "a" / "b" / "c.bin").write_bytes(os.urandom(1500))
    (root / "a" / "x.tar.gz").write_bytes(b"")
    shards, classes = plan(root, max_count=1)
    assert classes is None
    assert sorted(n for s in shards for n in file_names(s)) == relative_files(root)
    dirs = [m.name for m in shards[0].members if m.kind == MemberKind.DIRECTORY]
    assert dirs == ["a", "a/b", "empty"]  # every folder once, empty ones included
    for shard in shards:
        with tarfile.open(fileobj=io.BytesIO(shard_bytes(shard, root))) as tar:
            for member in tar.getmembers():
                if member.isfile():
                    extracted = tar.extractfile(member)
                    assert extracted is not None
                    assert extracted.read() == (root / member.name).read_bytes()


def test_webdataset_members_are_class_key_ext_and_cls(imagefolder: Path) -> None:
    shards, classes = plan(imagefolder, format="webdataset")
    assert classes == sorted(DEFAULT_CLASS_SIZES)
    names = [m.name for s in shards for m in s.members]
    assert len(names) == 2 * sum(DEFAULT_CLASS_SIZES.values())
    for image, label in zip(names[::2], names[1::2], strict=True):
        assert image.rsplit(".", 1)[0] == label.rsplit(".", 1)[0]
        assert label.endswith(".cls")
        assert image.count("/") == 1


@pytest.mark.parametrize(
    ("rel", "why"),
    [
        ("loose.jpg", "webdataset format needs SRC/CLASS/FILE"),
        ("cat/deeper/x.jpg", "webdataset format needs SRC/CLASS/FILE"),
        ("cat/readme.txt", "packs images only"),
        ("cat/two.dots.jpg", "one-dot name"),
    ],
)
def test_webdataset_format_refuses_what_it_cannot_represent(
    tmp_path: Path, rel: str, why: str
) -> None:
    root = tmp_path / "src"
    (root / "cat").mkdir(parents=True)
    (root / "cat" / "ok.jpg").write_bytes(b"x")
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).write_bytes(b"y")
    files, folders, errors = scan_tree(root)
    make_plan(files, folders, PackConfig(format="webdataset"), errors)
    assert len(errors) == 1
    assert errors[0].startswith(f"{rel}: ") and why in errors[0]
    assert "--format tree" in errors[0]


# -- the plan ------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["tree", "webdataset"])
@pytest.mark.parametrize("sizing", [{"max_count": 1}, {"max_count": 5}, {"shard_size": 20_000}, {}])
@pytest.mark.parametrize("seed", [None, 7])
def test_every_file_lands_in_exactly_one_shard(
    imagefolder: Path, fmt: str, sizing: dict[str, int], seed: int | None
) -> None:
    shards, _ = plan(imagefolder, format=fmt, shuffle_seed=seed, **sizing)
    placed = [n for s in shards for n in file_names(s)]
    assert sorted(placed) == relative_files(imagefolder)
    assert len(placed) == len(set(placed))
    assert all(file_names(s) for s in shards), "an empty shard"
    assert [s.name for s in shards] == [f"shard-{i:06d}.tar" for i in range(len(shards))]
    counts = [len(file_names(s)) for s in shards]
    if "max_count" in sizing:
        assert max(counts) <= sizing["max_count"]
        assert counts[:-1] == [sizing["max_count"]] * (len(counts) - 1)  # only the last is small
    if "shard_size" in sizing:
        for shard in shards:
            assert layout(shard)[1] <= sizing["shard_size"] + 3 * 10240 or len(counts) == 1
        assert len(shards) > 1
    if not sizing:
        assert len(shards) == 1
    if seed is None:
        assert placed == sorted(placed)
    else:
        assert placed != sorted(placed)


def test_a_file_larger_than_the_shard_size_gets_a_shard_of_its_own(tmp_path: Path) -> None:
    root = tmp_path / "src"
    root.mkdir()
    for name, size in [("a", 100), ("b", 50_000), ("c", 100), ("d", 100)]:
        (root / name).write_bytes(b"x" * size)
    shards, _ = plan(root, shard_size=10_000)
    assert [file_names(s) for s in shards] == [["a"], ["b"], ["c", "d"]]


def test_a_seed_spreads_classes_across_shards(imagefolder: Path) -> None:
    def classes_per_shard(seed: int | None) -> list[int]:
        shards, _ = plan(imagefolder, max_count=4, shuffle_seed=seed)
        return [len({n.split("/")[0] for n in file_names(s)}) for s in shards]

    sorted_counts = classes_per_shard(None)
    shuffled = classes_per_shard(7)
    assert sum(c > 1 for c in shuffled) > len(shuffled) / 2, shuffled
    assert sum(c > 1 for c in shuffled) > sum(c > 1 for c in sorted_counts)
    assert (
        plan(imagefolder, shuffle_seed=7, max_count=4)[0]
        == plan(imagefolder, shuffle_seed=7, max_count=4)[0]
    )
    assert (
        plan(imagefolder, shuffle_seed=7, max_count=4)[0]
        != plan(imagefolder, shuffle_seed=8, max_count=4)[0]
    )


def test_plan_fingerprint_is_stable_and_sees_changes(tmp_path: Path) -> None:
    files = [SourceFile("c/a.jpg", 10, 0o100644, 5), SourceFile("c/b.jpg", 20, 0o100644, 5)]
    config = PackConfig(max_count=1)

    def fingerprint(files: list[SourceFile], config: PackConfig) -> str:
        return plan_fingerprint(make_plan(files, ["c"], config, [])[0], config)

    first = fingerprint(files, config)
    assert first == fingerprint(list(files), PackConfig(max_count=1))
    assert re.fullmatch(r"[0-9a-f]{64}", first)
    assert first != fingerprint(files, PackConfig(max_count=2))
    assert first != fingerprint(files, PackConfig(max_count=1, format="webdataset"))
    assert first != fingerprint(files, PackConfig(max_count=1, shuffle_seed=1))
    grown = [files[0], SourceFile("c/b.jpg", 21, 0o100644, 5)]
    touched = [files[0], SourceFile("c/b.jpg", 20, 0o100644, 6)]
    assert first != fingerprint(grown, config)
    assert first != fingerprint(touched, config)


# -- the source tree ------------------------------------------------------------------------


def test_scan_tree_reports_unreadable_entries_by_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "src"
    (root / "cat").mkdir(parents=True)
    (root / "cat" / "good.jpg").write_bytes(b"ok")
    (root / "cat" / "secret.jpg").write_bytes(b"no")
    (root / "cat" / "dangling.jpg").symlink_to(root / "nowhere.jpg")
    os.mkfifo(root / "cat" / "pipe.jpg")
    real_open = open

    def fake_open(path: str, *args: object, **kwargs: object) -> object:
        if str(path).endswith("secret.jpg"):
            raise PermissionError(13, "Permission denied", path)
        return real_open(path, *args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr("builtins.open", fake_open)
    files, folders, errors = scan_tree(root)
    assert [f.rel for f in files] == ["cat/good.jpg"]
    assert folders == ["cat"]
    assert sorted(errors) == [
        "cat/dangling.jpg: broken symlink",
        "cat/pipe.jpg: not a regular file",
        "cat/secret.jpg: Permission denied",
    ]


def test_scan_tree_follows_folder_links_and_reports_loops(tmp_path: Path) -> None:
    """A class folder that is a symlink is packed (ImageFolder follows it), not dropped."""
    elsewhere = tmp_path / "elsewhere" / "dog"
    elsewhere.mkdir(parents=True)
    (elsewhere / "b.jpg").write_bytes(b"b")
    root = tmp_path / "src"
    (root / "cat").mkdir(parents=True)
    (root / "cat" / "a.jpg").write_bytes(b"a")
    (root / "dog").symlink_to(elsewhere)
    files, folders, errors = scan_tree(root)
    assert ([f.rel for f in files], folders, errors) == (
        ["cat/a.jpg", "dog/b.jpg"],
        ["cat", "dog"],
        [],
    )
    (root / "cat" / "loop").symlink_to(root)
    files, _folders, errors = scan_tree(root)
    assert [f.rel for f in files] == ["cat/a.jpg", "dog/b.jpg"]
    assert len(errors) == 1 and errors[0].startswith("cat/loop: ")


def test_packer_fails_before_writing_anything_on_bad_input(tmp_path: Path) -> None:
    root = tmp_path / "src"
    (root / "cat").mkdir(parents=True)
    (root / "cat" / "good.jpg").write_bytes(b"ok")
    (root / "cat" / "dangling.jpg").symlink_to(root / "nowhere.jpg")
    dest = tmp_path / "dest"
    with pytest.raises(PackError, match=r"cat/dangling\.jpg: broken symlink"):
        Packer(root, SourceConfig(str(dest)), PackConfig()).run()
    assert not dest.exists()


# -- the command line, local destination ----------------------------------------------------


def test_pack_without_a_terminal_prints_one_summary_line(imagefolder: Path, tmp_path: Path) -> None:
    dest = tmp_path / "out"
    result = run(tmp_path, "pack", imagefolder, dest, "--max-count", "5")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    lines = result.stdout.splitlines()
    assert len(lines) == 1, result.stdout
    assert re.fullmatch(r"packed 19 files \(.+\) into 4 shards at .+ MB/s\)", lines[0]), lines[0]
    names = sorted(os.listdir(dest))
    assert names == sorted([MANIFEST_NAME, SIDECAR_NAME] + [f"shard-{i:06d}.tar" for i in range(4)])


def test_same_seed_gives_byte_identical_shards(imagefolder: Path, tmp_path: Path) -> None:
    def pack(name: str, *extra: str) -> dict[str, bytes]:
        dest = tmp_path / name
        result = run(tmp_path, "pack", imagefolder, dest, "--max-count", "3", *extra)
        assert result.returncode == 0, result.stderr
        return {p.name: p.read_bytes() for p in sorted(dest.glob("*.tar"))}

    first = pack("a", "--shuffle-seed", "7", "--workers", "1")
    second = pack("b", "--shuffle-seed", "7", "--workers", "4")
    other = pack("c", "--shuffle-seed", "8")
    unshuffled = pack("d")
    assert first == second
    assert first.keys() == other.keys() and first != other
    assert first != unshuffled


def test_pack_refuses_a_non_empty_destination_without_resume(
    imagefolder: Path, tmp_path: Path
) -> None:
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "something").write_text("x")
    line = one_error_line(run(tmp_path, "pack", imagefolder, dest), 2)
    assert "not empty" in line and "--resume" in line
    assert os.listdir(dest) == ["something"]
    # A finished pack is a non-empty destination too.
    again = tmp_path / "again"
    assert run(tmp_path, "pack", imagefolder, again).returncode == 0
    before = {p.name: p.read_bytes() for p in again.iterdir()}
    one_error_line(run(tmp_path, "pack", imagefolder, again), 2)
    assert {p.name: p.read_bytes() for p in again.iterdir()} == before


@pytest.mark.parametrize(
    "spell",
    [
        lambda src, tmp: src / "out",
        lambda src, tmp: src,
        lambda src, tmp: f"file://{src}/sub/out",
        lambda src, tmp: tmp / "link-to-src" / "out",  # a symlink into the source
        lambda src, tmp: src / ".." / src.name / "out",
    ],
    ids=["inside", "itself", "file-url", "through-a-symlink", "dot-dot"],
)
def test_pack_refuses_a_destination_inside_its_source(
    imagefolder: Path, tmp_path: Path, spell: object
) -> None:
    (tmp_path / "link-to-src").symlink_to(imagefolder)
    dest = spell(imagefolder, tmp_path)  # type: ignore[operator]
    before = relative_files(imagefolder)
    line = one_error_line(run(tmp_path, "pack", imagefolder, dest), 2)
    assert line == (
        f"shardfs: error: {dest}: the destination lies inside the source folder "
        f"{imagefolder}, so the shards would be packed into the tree they are made from; "
        "choose a destination outside it"
    )
    assert relative_files(imagefolder) == before  # nothing written


def test_a_url_destination_is_inside_a_source_by_store_and_path() -> None:
    from shardfs.store.urls import is_within

    assert is_within("s3://b/x/out", "s3://b/x")
    assert is_within("s3a://b/x/out/", "s3://b/x/")
    assert is_within("s3://b/x", "s3://b/x/")
    assert not is_within("s3://b/xy", "s3://b/x")
    assert not is_within("s3://c/x/out", "s3://b/x")
    assert not is_within("gs://b/x/out", "s3://b/x")
    assert not is_within("s3://b/x/out", "/b/x")  # a local folder is another store


def test_an_earlier_pack_inside_the_source_is_left_out_and_said(
    imagefolder: Path, tmp_path: Path
) -> None:
    """A pack output that got into the tree (copied in, or made before pack refused it)
    is never packed again: not its shards, sidecar or manifest."""
    src = tmp_path / "src"
    subprocess.run(["cp", "-r", str(imagefolder), str(src)], check=True)
    assert run(tmp_path, "pack", imagefolder, src / "old-pack").returncode == 0
    (src / SIDECAR_NAME).write_bytes(b"a stray sidecar")
    dest = tmp_path / "new"
    result = run(tmp_path, "pack", src, dest)
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [
        f"shardfs: left out {SIDECAR_NAME}: shardfs's own file, not data",
        f"shardfs: left out old-pack/: the output of an earlier pack ({MANIFEST_NAME})",
    ]
    with tarfile.open(dest / "shard-000000.tar") as tar:
        packed = [m.name for m in tar.getmembers() if m.isfile()]
    assert sorted(packed) == relative_files(imagefolder)
    verified = run(tmp_path, "verify", src, dest)  # verify leaves the same files out
    assert verified.returncode == 0, verified.stdout + verified.stderr


def test_resume_refuses_a_destination_packed_from_something_else(
    imagefolder: Path, tmp_path: Path
) -> None:
    dest = tmp_path / "out"
    assert run(tmp_path, "pack", imagefolder, dest, "--max-count", "5").returncode == 0
    line = one_error_line(
        run(tmp_path, "pack", imagefolder, dest, "--max-count", "6", "--resume"), 2
    )
    assert "differ" in line


def test_resume_writes_only_missing_shards_and_cleans_temp_files(
    imagefolder: Path, tmp_path: Path
) -> None:
    """The state a SIGKILL leaves: some shards, a temp name mid-rename, no sidecar."""
    dest = tmp_path / "out"
    assert run(tmp_path, "pack", imagefolder, dest, "--max-count", "3").returncode == 0
    complete = {p.name: p.read_bytes() for p in dest.glob("*.tar")}
    kept = sorted(complete)[:2]
    for name in complete:
        if name not in kept:
            (dest / name).unlink()
    (dest / SIDECAR_NAME).unlink()
    (dest / ".shard-000003.tar.tmp-12345-678").write_bytes(complete["shard-000003.tar"][:1000])
    kept_inodes = {name: (dest / name).stat().st_ino for name in kept}
    result = run(tmp_path, "pack", imagefolder, dest, "--max-count", "3", "--resume", "--verify")
    assert result.returncode == 0, result.stderr
    assert "2 already there" in result.stdout
    assert {p.name: p.read_bytes() for p in dest.glob("*.tar")} == complete
    assert {name: (dest / name).stat().st_ino for name in kept} == kept_inodes  # not rewritten
    assert [p.name for p in dest.iterdir() if ".tmp-" in p.name] == []
    assert (dest / SIDECAR_NAME).exists()


@pytest.mark.parametrize("fmt", ["tree", "webdataset"])
def test_verify_passes_on_a_good_pack_and_names_what_differs(
    imagefolder: Path, tmp_path: Path, fmt: str
) -> None:
    src = tmp_path / "src"
    make_imagefolder(src, DEFAULT_CLASS_SIZES, long_names=False)
    dest = tmp_path / "out"
    cache = tmp_path / "cache"
    result = run(tmp_path, "pack", src, dest, "--format", fmt, "--max-count", "4", "--verify")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1].startswith("verified: 19 files")

    def verify() -> subprocess.CompletedProcess[str]:
        return run(tmp_path, "verify", src, dest, "--cache-dir", cache)

    assert verify().returncode == 0

    changed = src / "dog" / "img_00000.jpg"
    original = changed.read_bytes()
    changed.write_bytes(bytes([original[0] ^ 1]) + original[1:])  # same size, other bytes
    line = one_error_line(verify(), 4)
    assert "1 with different bytes" in line and "dog/img_00000.jpg" in line
    changed.write_bytes(original)
    assert verify().returncode == 0

    added = src / "cat" / "img_99999.jpg"
    added.write_bytes(original)
    line = one_error_line(verify(), 4)
    assert "1 missing from the pack" in line and "cat/img_99999.jpg" in line
    added.unlink()

    removed = src / "sea lion" / "img_00000.jpg"
    kept = removed.read_bytes()
    removed.unlink()
    line = one_error_line(verify(), 4)
    assert "1 not in the source" in line and "sea lion/img_00000.jpg" in line
    removed.write_bytes(kept)
    assert verify().returncode == 0


def test_bad_input_fails_before_uploading_or_is_skipped_and_listed(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "cat").mkdir(parents=True)
    (src / "cat" / "a.jpg").write_bytes(b"a" * 700)
    (src / "cat" / "b.jpg").write_bytes(b"b" * 700)
    (src / "cat" / "gone.jpg").symlink_to(tmp_path / "missing.jpg")
    os.mkfifo(src / "cat" / "fifo.jpg")
    dest = tmp_path / "out"

    line = one_error_line(run(tmp_path, "pack", src, dest), 4)
    assert "cat/fifo.jpg" in line and "(and 1 more)" in line and "--skip-errors" in line
    assert not dest.exists()

    result = run(tmp_path, "pack", src, dest, "--skip-errors", "--verify")
    assert result.returncode == 0, result.stderr
    skipped = sorted(line for line in result.stderr.splitlines() if "skipped" in line)
    assert skipped == [
        "shardfs: skipped: cat/fifo.jpg: not a regular file",
        "shardfs: skipped: cat/gone.jpg: broken symlink",
    ]
    with tarfile.open(dest / "shard-000000.tar") as tar:
        assert [m.name for m in tar.getmembers()] == ["cat", "cat/a.jpg", "cat/b.jpg"]


@pytest.mark.parametrize(
    ("rel", "expected"),
    [
        ("loose.jpg", "loose.jpg: webdataset format needs SRC/CLASS/FILE"),
        ("cat/sub/x.jpg", "cat/sub/x.jpg: webdataset format needs SRC/CLASS/FILE"),
        ("cat/notes.txt", "cat/notes.txt: not an image"),
        ("cat/a.b.jpg", "cat/a.b.jpg: not an image with a one-dot name"),
    ],
)
def test_webdataset_refusal_is_one_clear_line(tmp_path: Path, rel: str, expected: str) -> None:
    src = tmp_path / "src"
    (src / "cat").mkdir(parents=True)
    (src / "cat" / "fine.jpg").write_bytes(b"x")
    (src / rel).parent.mkdir(parents=True, exist_ok=True)
    (src / rel).write_bytes(b"y")
    dest = tmp_path / "out"
    line = one_error_line(run(tmp_path, "pack", src, dest, "--format", "webdataset"), 4)
    assert expected in line and "--format tree" in line
    assert not dest.exists()
    assert run(tmp_path, "pack", src, dest, "--format", "tree", "--verify").returncode == 0


def test_a_tree_pack_sidecar_agrees_with_a_scan_on_labels(tmp_path: Path) -> None:
    """Label files packed as plain tree members (``k.cls``) must get the same label in the
    sidecar as a scan of the shard gives them, or a mount would pick a different view with
    and without the sidecar."""
    from shardfs.index.scan import scan_shard
    from shardfs.store.remote import Store

    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    (src / "a" / "k.jpg").write_bytes(b"\xff\xd8jpeg")
    (src / "a" / "k.cls").write_text("3\n")
    (src / "a" / "m.json").write_text('{"label": 5}')
    dest = tmp_path / "dest"
    Packer(src, SourceConfig(str(dest)), PackConfig()).run()
    store = Store(SourceConfig(str(dest)))
    (info,) = store.list_shards()
    files, folders, _ = scan_tree(src)
    (shard,), _ = make_plan(files, folders, PackConfig(), [])
    assert index_rows(shard, src) == scan_shard(store, info)
    labels = {row[0]: row[7] for row in index_rows(shard, src)}
    assert labels["a/k.cls"] == 3 and labels["a/m.json"] == 5 and labels["a/k.jpg"] is None

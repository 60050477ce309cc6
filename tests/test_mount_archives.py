"""zip shards (stored and deflated) and a tar of tars, written by the real tools, on a real
mount over the S3 server: every file is byte-identical, torchvision's ImageFolder sees the
source's classes, the mount plus one full read downloads at most 1.05x the files' bytes, a
remount downloads no shard at all, and a zip the mount cannot serve (bzip2) fails with one
line."""

from __future__ import annotations

import hashlib
import io
import random
import shutil
import struct
import subprocess
import zipfile
from pathlib import Path

import pytest
from support.datagen import make_imagefolder, relative_files, sha256_tree
from support.mounts import assert_one_error_line, imagefolder_view, mount, new_bucket, umount
from support.processes import is_mounted, run_shardfs
from support.s3 import S3Server, settled_counts

pytestmark = pytest.mark.integration

# ImageNet-sized images (about 100 KB), so that per-member headers stay far below 5 %.
CLASS_SIZES = {"n01440764": 5, "n01443537": 4, "n01484850": 6}
IMAGE_BYTES = 100_000
EGRESS_LIMIT = 1.05


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("archives") / "src"
    make_imagefolder(root, CLASS_SIZES, image_bytes=IMAGE_BYTES, long_names=False)
    return root


@pytest.fixture
def env(s3_server: S3Server) -> dict[str, str]:
    return s3_server.env()


def zip_tool(src: Path, out: Path, *flags: str) -> None:
    subprocess.run(["zip", "-q", *flags, "-r", str(out), "."], cwd=src, check=True)


def python_zip(src: Path, out: Path, *, zip64: bool) -> None:
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as archive:
        for rel in relative_files(src):
            info = zipfile.ZipInfo.from_file(src / rel, rel)
            with archive.open(info, "w", force_zip64=zip64) as handle:
                handle.write((src / rel).read_bytes())


def gnu_tar_of_tars(src: Path, out: Path) -> None:
    """ImageNet's train archive: a GNU tar of ``CLASS.tar``, each a GNU tar of the files."""
    inner = out.parent / "inner"
    inner.mkdir()
    for name in sorted(CLASS_SIZES):
        files = sorted(p.name for p in (src / name).iterdir())
        subprocess.run(["tar", "-cf", str(inner / f"{name}.tar"), "-C", str(src / name), *files])
    tars = sorted(p.name for p in inner.iterdir())
    subprocess.run(["tar", "-cf", str(out), "-C", str(inner), *tars], check=True)
    shutil.rmtree(inner)


def write_archive(how: str, src: Path, out: Path) -> None:
    if how == "zip-tool-stored":
        zip_tool(src, out, "-0")
    elif how == "zip-tool-deflated":  # the zip tool's default: every JPEG deflates a little
        zip_tool(src, out)
        with zipfile.ZipFile(out) as archive:
            methods = {info.compress_type for info in archive.infolist() if not info.is_dir()}
        assert methods == {zipfile.ZIP_DEFLATED}
    elif how in ("zipfile-stored", "zipfile-zip64"):
        python_zip(src, out, zip64=how == "zipfile-zip64")
    else:
        gnu_tar_of_tars(src, out)


ARCHIVES = {
    "zip-tool-stored": "train.zip",
    "zip-tool-deflated": "train.zip",
    "zipfile-stored": "train.zip",
    "zipfile-zip64": "train.zip",
    "gnu-tar-of-tars": "ILSVRC2012_img_train.tar",
}


@pytest.mark.parametrize("how", sorted(ARCHIVES))
def test_archive_mounts_as_the_imagefolder_it_was_made_from(
    how: str,
    src: Path,
    s3_server: S3Server,
    env: dict[str, str],
    mountpoint: Path,
    tmp_path: Path,
) -> None:
    if shutil.which("zip" if how.startswith("zip-tool") else "tar") is None:
        pytest.fail(f"{how} needs its tool installed")
    archive = tmp_path / "shards" / ARCHIVES[how]
    archive.parent.mkdir()
    write_archive(how, src, archive)
    mount_twice_and_check(archive, src, s3_server, env, mountpoint, tmp_path)


def mount_twice_and_check(
    archive: Path,
    src: Path,
    s3_server: S3Server,
    env: dict[str, str],
    mountpoint: Path,
    tmp_path: Path,
    *,
    shuffled: bool = False,
) -> None:
    """Mount the archive from the S3 server: the tree and ImageFolder's view equal the
    source's, the mount and one full read download at most ``EGRESS_LIMIT`` times the files'
    bytes (and the shard's, when it is smaller: a compressed one), a remount downloads none
    (and, ``shuffled``, serves every file read in a random order)."""
    bucket = new_bucket(s3_server, archive.name.replace(".", "-"))
    s3_server.filesystem().put_file(str(archive), f"{bucket}/data/{archive.name}")
    source, key = f"s3://{bucket}/data/", f"{bucket}/data/{archive.name}"
    cache = tmp_path / "cache"
    files_bytes = sum((src / rel).stat().st_size for rel in relative_files(src))
    limit = EGRESS_LIMIT * min(files_bytes, archive.stat().st_size)

    s3_server.reset_counts()
    mount(source, mountpoint, cache, env=env)
    assert sha256_tree(mountpoint) == sha256_tree(src)
    assert imagefolder_view(mountpoint) == imagefolder_view(src)
    counts = settled_counts(s3_server)
    egress = counts["get_object_bytes_by_key"].get(key, 0)
    assert 0 < egress <= limit, (egress, files_bytes, archive.stat().st_size)
    umount(mountpoint)

    s3_server.reset_counts()
    mount(source, mountpoint, cache, env=env)
    assert sorted(relative_files(mountpoint)) == relative_files(src)
    if shuffled:
        order = relative_files(src)
        random.Random(5).shuffle(order)
        for rel in order:
            assert (mountpoint / rel).read_bytes() == (src / rel).read_bytes(), rel
    assert settled_counts(s3_server)["get_object_bytes_by_key"].get(key, 0) == 0
    umount(mountpoint)


@pytest.fixture(scope="module")
def big_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About 10 MB of JPEGs: a gzip stream of several 4 MiB seek points."""
    root = tmp_path_factory.mktemp("archives-big") / "src"
    make_imagefolder(root, {"cat": 40, "dog": 35, "nested/owl": 25}, image_bytes=IMAGE_BYTES)
    return root


@pytest.mark.parametrize(("how", "name"), [("czf", "train.tar.gz"), ("gzip-1", "train.tgz")])
def test_a_gzip_compressed_tar_mounts_and_reads_in_any_order(
    how: str,
    name: str,
    big_src: Path,
    s3_server: S3Server,
    env: dict[str, str],
    mountpoint: Path,
    tmp_path: Path,
) -> None:
    """``tar -czf`` and ``tar -cf - . | gzip -1``: the files of a tar.gz are decoded from
    the nearest seek point, so every file read in a shuffled order is the source's too."""
    archive = tmp_path / "shards" / name
    archive.parent.mkdir()
    if how == "czf":
        subprocess.run(["tar", "-czf", str(archive), "-C", str(big_src), "."], check=True)
    else:
        tar = subprocess.run(["tar", "-cf", "-", "."], cwd=big_src, check=True, capture_output=True)
        gz = subprocess.run(["gzip", "-1"], input=tar.stdout, check=True, capture_output=True)
        archive.write_bytes(gz.stdout)
    mount_twice_and_check(archive, big_src, s3_server, env, mountpoint, tmp_path, shuffled=True)


def test_a_zip_of_labelled_samples_mounts_with_the_imagefolder_layout(
    src: Path, s3_server: S3Server, env: dict[str, str], mountpoint: Path, tmp_path: Path
) -> None:
    """``KEY.jpg`` + ``KEY.cls`` in a zip, as in a webdataset tar: ImageFolder targets are
    the labels."""
    labelled = tmp_path / "labelled"
    labelled.mkdir()
    labels = {}
    for label, name in enumerate(sorted(CLASS_SIZES)):
        for path in sorted((src / name).iterdir()):
            key = f"{name}_{path.stem}"
            shutil.copyfile(path, labelled / f"{key}.jpg")
            (labelled / f"{key}.cls").write_text(str(label))
            labels[key] = label
    archive = tmp_path / "labelled.zip"
    zip_tool(labelled, archive, "-0")
    bucket = new_bucket(s3_server, "zip-labels")
    s3_server.filesystem().put_file(str(archive), f"{bucket}/data/labelled.zip")
    mount(f"s3://{bucket}/data/", mountpoint, tmp_path / "c", "--layout", "imagefolder", env=env)
    _classes, _index, samples = imagefolder_view(mountpoint)
    assert sorted((Path(p).stem, target) for p, target in samples) == sorted(labels.items())
    for path, _target in samples:
        assert (mountpoint / path).read_bytes() == (labelled / Path(path).name).read_bytes()
    umount(mountpoint)


def test_a_bzip2_zip_fails_with_one_line_naming_the_member_and_the_fix(
    s3_server: S3Server, env: dict[str, str], mountpoint: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "src" / "cat"
    folder.mkdir(parents=True)
    (folder / "a.jpg").write_bytes(b"compressible " * 1000)
    archive = tmp_path / "default.zip"
    zip_tool(tmp_path / "src", archive, "-Z", "bzip2")
    bucket = new_bucket(s3_server, "zip-bzip2")
    s3_server.filesystem().put_file(str(archive), f"{bucket}/data/default.zip")
    result = run_shardfs(
        "mount", f"s3://{bucket}/data/", mountpoint, "--cache-dir", tmp_path / "c", env=env
    )
    line = assert_one_error_line(result)
    assert result.returncode == 4 and not is_mounted(mountpoint)
    assert "default.zip: member 'cat/a.jpg' is compressed (bzip2" in line
    assert "zip -0 -r" in line and "at offset" in line and "--skip-bad-shards" in line


def stored_zip(*members: tuple[str, bytes]) -> bytes:
    """A stored zip written by Python's zipfile, names exactly as given."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_STORED) as archive:
        for name, data in members:
            archive.writestr(zipfile.ZipInfo(name, (2024, 1, 1, 0, 0, 0)), data)
    return buffer.getvalue()


def _truncated(data: bytes) -> bytes:
    return data[: len(data) - 30]  # into the end of central directory


def _bogus_offset(data: bytes) -> bytes:
    """The first central directory entry's local header offset moved past the shard."""
    at = data.index(b"PK\x01\x02")
    patched = bytearray(data)
    patched[at + 42 : at + 46] = struct.pack("<I", len(data) + 1000)
    return bytes(patched)


@pytest.mark.parametrize(
    ("case", "expect"),
    [
        ("climbs-out", "../x.jpg"),
        ("absolute", "/etc/x.jpg"),
        ("truncated", "offset"),
        ("bogus-offset", "offset"),
        ("not-a-zip", "not a zip archive"),
    ],
)
def test_a_bad_zip_fails_the_mount_with_one_line_and_is_skipped_on_request(
    case: str,
    expect: str,
    s3_server: S3Server,
    env: dict[str, str],
    mountpoint: Path,
    tmp_path: Path,
) -> None:
    """Exit 4 and one line naming the shard (and an offset); ``--skip-bad-shards`` mounts
    the good shard beside it, byte for byte; never a traceback."""
    good = stored_zip(("cat/a.jpg", b"a" * 5000), ("dog/b.jpg", b"b" * 7000))
    bad = {
        "climbs-out": lambda: stored_zip(("ok/c.jpg", b"c" * 100), ("../x.jpg", b"x" * 100)),
        "absolute": lambda: stored_zip(
            ("/etc/x.jpg", b"x" * 100),
        ),
        "truncated": lambda: _truncated(good),
        "bogus-offset": lambda: _bogus_offset(good),
        "not-a-zip": lambda: b"this is not a zip archive at all\n" * 50,
    }[case]()
    bucket = new_bucket(s3_server, f"badzip-{case}")
    fs = s3_server.filesystem()
    fs.pipe_file(f"{bucket}/data/a-good.zip", good)
    fs.pipe_file(f"{bucket}/data/b-bad.zip", bad)
    source = f"s3://{bucket}/data/"

    result = run_shardfs("mount", source, mountpoint, "--cache-dir", tmp_path / "c", env=env)
    line = assert_one_error_line(result)
    assert result.returncode == 4 and not is_mounted(mountpoint)
    assert "b-bad.zip" in line and expect in line, line
    assert "Traceback" not in result.stderr

    skipped = mount(source, mountpoint, tmp_path / "c2", "--skip-bad-shards", env=env)
    assert "b-bad.zip" in skipped.stderr
    assert sha256_tree(mountpoint) == {
        "cat/a.jpg": hashlib.sha256(b"a" * 5000).hexdigest(),
        "dog/b.jpg": hashlib.sha256(b"b" * 7000).hexdigest(),
    }
    umount(mountpoint)


def test_format_reads_shards_of_any_name_and_picks_one_format_of_a_mixed_folder(
    src: Path, s3_server: S3Server, env: dict[str, str], mountpoint: Path, tmp_path: Path
) -> None:
    """``--format tar`` with a glob reads tar shards named ``*.bin``; in a folder holding a
    tar and a zip, ``-o format=zip`` mounts the zip alone (and auto mounts both)."""
    shards = tmp_path / "shards"
    shards.mkdir()
    gnu_tar_of_tars(src, shards / "train.bin")
    zip_tool(src / "n01440764", shards / "extra.zip", "-0")
    bucket = new_bucket(s3_server, "formats")
    fs = s3_server.filesystem()
    fs.put_file(str(shards / "train.bin"), f"{bucket}/data/train.bin")
    fs.put_file(str(shards / "extra.zip"), f"{bucket}/data/extra.zip")
    fs.put_file(str(shards / "train.bin"), f"{bucket}/data/same.tar")

    failed = run_shardfs(
        "mount", f"s3://{bucket}/data/*.bin", mountpoint, "--cache-dir", tmp_path / "c", env=env
    )
    assert failed.returncode != 0 and "*.bin" in assert_one_error_line(failed)
    mount(f"s3://{bucket}/data/*.bin", mountpoint, tmp_path / "c", "--format", "tar", env=env)
    assert sha256_tree(mountpoint) == sha256_tree(src)
    umount(mountpoint)

    mount(f"s3://{bucket}/data/", mountpoint, tmp_path / "c", "-o", "format=zip", env=env)
    assert sha256_tree(mountpoint) == sha256_tree(src / "n01440764")
    umount(mountpoint)

    mount(f"s3://{bucket}/data/", mountpoint, tmp_path / "c", env=env)
    both = {**sha256_tree(src), **sha256_tree(src / "n01440764")}
    assert sha256_tree(mountpoint) == both
    umount(mountpoint)

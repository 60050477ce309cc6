"""The command line, run as ``python -m shardfs`` (no FUSE needed: every mount here fails
before mounting)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tarbuild import make_tar

import shardfs
from shardfs.index import SIDECAR_NAME

ERROR_LINE = re.compile(r"shardfs: error: \S.*")


def run(
    tmp_path: Path, *args: str | Path, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SHARDFS_CACHE_DIR": str(tmp_path / "cache-env")}
    return subprocess.run(
        [sys.executable, "-m", "shardfs", *map(str, args)],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def assert_one_error(result: subprocess.CompletedProcess[str], code: int, *parts: str) -> str:
    """Exactly one stderr line, 'shardfs: error: ...', the exit code, and no traceback."""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert ERROR_LINE.fullmatch(lines[0]), lines[0]
    assert "Traceback" not in result.stderr + result.stdout
    assert result.returncode == code, (result.returncode, result.stderr)
    for part in parts:
        assert part in lines[0], (part, lines[0])
    return lines[0]


@pytest.fixture
def shards(tmp_path: Path) -> Path:
    folder = tmp_path / "shards"
    (folder / "sub").mkdir(parents=True)
    (folder / "s0.tar").write_bytes(make_tar([("a/one.txt", b"1" * 100), ("a/two.txt", b"2")]))
    (folder / "sub" / "s1.tar").write_bytes(make_tar([("three.txt", b"3" * 10)]))
    return folder


@pytest.fixture
def mnt(tmp_path: Path) -> Path:
    path = tmp_path / "mnt"
    path.mkdir()
    return path


# --- help and version -------------------------------------------------------------------------

COMMON = [
    "-o",
    "--storage-option",
    "--endpoint-url",
    "--cache-dir",
    "--skip-bad-shards",
    "--no-sidecar",
    "--verbose",
]
HELP = {
    (): ["mount", "umount", "index", "--version", "exit codes", "130", "examples:"],
    ("mount",): [
        *COMMON,
        "mountpoint",
        "--layout",
        "imagefolder",
        "--classes",
        "--foreground",
        "--allow-other",
        "--single-threaded",
        "--uid",
        "--gid",
        "--file-mode",
        "--dir-mode",
        "--log-file",
        "allow_root",
        "exit codes",
    ],
    ("umount",): ["mountpoint", "--lazy", "exit codes"],
    ("index",): [*COMMON, "--write-sidecar", "exit codes"],
    ("warm",): [*COMMON, "--cache-size", "exit codes"],
    ("verify",): [*COMMON, "src_dir", "exit codes"],
    ("pack",): ["-o", "--storage-option", "--endpoint-url", "--cache-dir", "--format"],
    ("stats",): ["mountpoint", "--json"],
    ("cache",): ["info", "clear", "--json", "--all"],
}
MOUNT_ONLY = ["--layout", "--allow-other", "--prefetch", "--read-timeout", "--skip-bad-shards"]


@pytest.mark.parametrize("command", list(HELP), ids=lambda c: "-".join(c) or "top")
def test_help(tmp_path: Path, command: tuple[str, ...]) -> None:
    result = run(tmp_path, *command, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert result.stdout.startswith("usage: shardfs")
    for option in HELP[command]:
        assert option in result.stdout, option
    assert "--ready-fd" not in result.stdout  # internal
    # A description of its own (the text between the usage and the arguments) and examples.
    description = result.stdout.split("\n\n")[1]
    assert not description.startswith(("positional", "options")), result.stdout
    assert len(description) > 40, description
    examples = result.stdout.split("examples:\n", 1)[1].split("\n\n")[0].splitlines()
    assert examples and all(line.strip().startswith("shardfs") for line in examples), examples


def test_pack_help_has_no_mount_options(tmp_path: Path) -> None:
    result = run(tmp_path, "pack", "--help")
    assert result.returncode == 0
    for option in MOUNT_ONLY:
        assert option not in result.stdout, option


def test_version(tmp_path: Path) -> None:
    result = run(tmp_path, "--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"shardfs {shardfs.__version__}"


# --- index ------------------------------------------------------------------------------------


def test_index_good_folder_prints_summary(tmp_path: Path, shards: Path) -> None:
    cache = tmp_path / "cache"
    result = run(tmp_path, "index", shards, "--cache-dir", cache)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    match = re.fullmatch(r"indexed 2 shards \(2 scanned\) into (\S+)\n", result.stdout)
    assert match, result.stdout
    index_path = Path(match.group(1))
    assert index_path.is_file() and index_path.parent == cache / "index"

    again = run(tmp_path, "index", shards, "--cache-dir", cache, "--write-sidecar")
    assert again.returncode == 0, again.stderr
    assert "indexed 2 shards (0 scanned)" in again.stdout
    assert f"wrote sidecar {SIDECAR_NAME}" in again.stdout
    assert (shards / SIDECAR_NAME).read_bytes() == index_path.read_bytes()

    other = run(tmp_path, "index", shards, "--cache-dir", tmp_path / "fresh")
    assert "indexed 2 shards (0 scanned)" in other.stdout  # from the sidecar


def test_index_default_cache_dir_from_env(tmp_path: Path, shards: Path) -> None:
    result = run(tmp_path, "index", f"file://{shards}")
    assert result.returncode == 0, result.stderr
    assert str(tmp_path / "cache-env" / "index") in result.stdout


def test_index_missing_folder(tmp_path: Path) -> None:
    result = run(tmp_path, "index", tmp_path / "nope")
    assert_one_error(result, 3, "nope", "no such folder")


def test_index_folder_without_tars(tmp_path: Path) -> None:
    folder = tmp_path / "plain"
    folder.mkdir()
    (folder / "a.txt").write_text("hello")
    result = run(tmp_path, "index", folder)
    assert_one_error(result, 3, "no *.tar shards")


def test_index_truncated_tar_names_shard_and_offset(tmp_path: Path, shards: Path) -> None:
    archive = make_tar([("x.bin", b"x" * 3000)])
    (shards / "sub" / "broken.tar").write_bytes(archive[:2000])
    result = run(tmp_path, "index", shards)
    assert_one_error(result, 4, "sub/broken.tar", "offset 2000", "--skip-bad-shards")


def test_index_skip_bad_shards_warns_and_succeeds(tmp_path: Path, shards: Path) -> None:
    (shards / "broken.tar").write_bytes(make_tar([("x.bin", b"x" * 3000)])[:2000])
    result = run(tmp_path, "index", shards, "--skip-bad-shards")
    assert result.returncode == 0, result.stderr
    warnings = result.stderr.splitlines()
    assert len(warnings) == 1 and warnings[0].startswith("shardfs: warning: skipped bad shard")
    assert "broken.tar" in warnings[0] and "offset 2000" in warnings[0]
    assert "indexed 3 shards" in result.stdout


def test_index_unwritable_cache_dir(tmp_path: Path, shards: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    result = run(tmp_path, "index", shards, "--cache-dir", blocker / "cache")
    assert_one_error(result, 2, "--cache-dir", "not writable")


@pytest.mark.parametrize("option", ["novalue", "=x", "a..b=1"])
def test_bad_storage_option(tmp_path: Path, shards: Path, option: str) -> None:
    result = run(tmp_path, "index", shards, "--storage-option", option)
    assert_one_error(result, 2, "storage option")


def test_endpoint_with_non_mapping_client_kwargs(tmp_path: Path, shards: Path) -> None:
    result = run(
        tmp_path,
        "index",
        shards,
        "--endpoint-url",
        "http://x",
        "--storage-option",
        "client_kwargs=1",
    )
    assert_one_error(result, 2, "client_kwargs")


@pytest.mark.parametrize(
    ("args", "part"),
    [
        (["--storage-option", "bogus=1"], "bogus"),
        (["--storage-option", "config_kwargs={bad"], "config_kwargs must be a mapping"),
        (["--endpoint-url", "not a url"], "not a url"),
        (["--storage-option", "client_kwargs.endpoint_url=ftp://x"], "ftp://x"),
        (["-o", "storage_option=client_kwargs.endpoint_url=ftp://x"], "ftp://x"),
        (["-o", "endpoint_url=not a url"], "not a url"),
    ],
)
def test_options_the_s3_client_rejects_are_usage_errors(
    tmp_path: Path, args: list[str], part: str
) -> None:
    """Refused before any request, as a usage error (exit 2), not as an unreachable store."""
    result = run(tmp_path, "index", "s3://bucket/prefix", *args)
    assert_one_error(result, 2, part)


def test_brace_pattern_without_bound_is_refused(tmp_path: Path) -> None:
    result = run(tmp_path, "index", str(tmp_path / "s-{0..99999999}.tar"))
    assert_one_error(result, 2, "more than 1,000,000 shards")


@pytest.mark.parametrize("value", ["0", "-1", "abc"])
def test_read_timeout_must_be_positive_seconds(tmp_path: Path, shards: Path, value: str) -> None:
    result = run(tmp_path, "index", shards, "--read-timeout", value)
    assert result.returncode == 2
    assert "--read-timeout" in result.stderr and "Traceback" not in result.stderr


def test_unknown_protocol(tmp_path: Path) -> None:
    result = run(tmp_path, "index", "nosuchproto://bucket/x")
    assert_one_error(result, 2, "nosuchproto://bucket/x")


# --- mount: every case fails before FUSE is touched -------------------------------------------


def test_mount_missing_mountpoint(tmp_path: Path, shards: Path) -> None:
    result = run(tmp_path, "mount", shards, tmp_path / "missing")
    assert_one_error(result, 5, "missing", "does not exist")


def test_mount_non_empty_mountpoint(tmp_path: Path, shards: Path, mnt: Path) -> None:
    (mnt / "something").write_text("x")
    result = run(tmp_path, "mount", shards, mnt)
    assert_one_error(result, 5, str(mnt), "not empty")


def test_mount_onto_a_file(tmp_path: Path, shards: Path) -> None:
    target = tmp_path / "regular"
    target.write_text("x")
    result = run(tmp_path, "mount", shards, target)
    assert_one_error(result, 5, "not a folder")


def test_mount_unwritable_cache_dir(tmp_path: Path, shards: Path, mnt: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    result = run(tmp_path, "mount", shards, mnt, "--cache-dir", blocker / "cache")
    assert_one_error(result, 2, "--cache-dir", "not writable")


def test_mount_bad_storage_option(tmp_path: Path, shards: Path, mnt: Path) -> None:
    result = run(tmp_path, "mount", shards, mnt, "--storage-option", "anon")
    assert_one_error(result, 2, "storage option must be key=value", "'anon'")


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, "No such file"),
        (b"\xff\xfe bad\n", "not UTF-8"),
        (b"cat\nsub/dog\n", "invalid class name 'sub/dog'"),
        (b"cat\n\ndog\n", "invalid class name ''"),
    ],
    ids=["missing", "not-utf8", "slash", "blank-line"],
)
def test_mount_bad_classes_file(
    tmp_path: Path, shards: Path, mnt: Path, content: bytes | None, expected: str
) -> None:
    classes = tmp_path / "classes.txt"
    if content is not None:
        classes.write_bytes(content)
    result = run(tmp_path, "mount", shards, mnt, "--classes", classes)
    assert_one_error(result, 2, expected)


def test_umount_not_mounted(tmp_path: Path, mnt: Path) -> None:
    result = run(tmp_path, "umount", mnt)
    assert_one_error(result, 5, "not mounted")

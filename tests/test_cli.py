"""The command line, run as ``python -m shardfs`` (no FUSE needed: every mount here fails
before mounting)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.tarbuild import make_tar

import shardfs
from shardfs.index.db import SIDECAR_NAME
from shardfs.store.urls import shard_patterns

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
    assert_one_error(result, 3, f"no {shard_patterns()} shards")


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


def test_mount_missing_mountpoint_and_parent(tmp_path: Path, shards: Path) -> None:
    result = run(tmp_path, "mount", shards, tmp_path / "missing" / "mnt")
    assert_one_error(result, 5, "missing", "does not exist, nor does its parent folder")


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


def findmnt(path: Path | str) -> tuple[str, str]:
    """The filesystem type and mountpoint of the mount ``path`` lies in, as util-linux's
    findmnt tells them."""
    out = subprocess.run(
        ["findmnt", "--noheadings", "--raw", "--output", "FSTYPE,TARGET", "--target", str(path)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    fstype, target = out.splitlines()[-1].split(" ", 1)
    return fstype, target.encode().decode("unicode_escape")


def test_umount_of_another_filesystem_says_so(tmp_path: Path) -> None:
    fstype, target = findmnt("/")
    assert target == "/"
    line = assert_one_error(run(tmp_path, "umount", "/"), 5)
    assert line == f"shardfs: error: / is not a shardfs mount (it is {fstype})"
    assert "fusermount" not in line


def test_umount_and_stats_of_a_folder_that_is_no_mount_say_so(tmp_path: Path, mnt: Path) -> None:
    fstype, target = findmnt(mnt)
    where = f"it lies in the {fstype} mount at {target}"
    line = assert_one_error(run(tmp_path, "umount", mnt), 5)
    assert line == f"shardfs: error: {mnt}: not mounted (not a mountpoint: {where})"
    line = assert_one_error(run(tmp_path, "stats", mnt), 5)
    assert line == f"shardfs: error: {mnt}: not inside a shardfs mount ({where})"
    missing = tmp_path / "nowhere"
    line = assert_one_error(run(tmp_path, "umount", missing), 5)
    assert line == f"shardfs: error: {missing}: not mounted (no such file or folder)"


# --- -o and storage options -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "line"),
    [
        (
            "anon=true",
            "-o anon=true: not a mount option; fsspec storage options now go with "
            "--storage-option anon=true",
        ),
        (
            "client_kwargs.region_name=x",
            "-o client_kwargs.region_name=x: not a mount option; fsspec storage options now go "
            "with --storage-option client_kwargs.region_name=x",
        ),
        ("allow_other=true", "-o allow_other: takes no value (write -o allow_other)"),
        ("anon", "-o anon: unknown option (see shardfs mount --help)"),
        ("cache_szie=1G", "-o cache_szie=1G: unknown option; did you mean -o cache_size=1G?"),
        ("rw", "-o rw: shardfs is a read-only filesystem (leave rw out; ro is implied)"),
    ],
)
def test_mount_o_refusals_are_one_line(
    tmp_path: Path, shards: Path, mnt: Path, option: str, line: str
) -> None:
    result = run(tmp_path, "mount", shards, mnt, "-o", option)
    assert assert_one_error(result, 2) == f"shardfs: error: {line}"


def test_storage_option_reaches_the_store(tmp_path: Path, shards: Path) -> None:
    """A storage option the local store does not take is passed on, not dropped."""
    result = run(tmp_path, "index", shards, "--storage-option", "auto_mkdir=true")
    assert result.returncode == 0, result.stderr
    result = run(tmp_path, "index", shards, "-o", "storage_option=auto_mkdir=true")
    assert result.returncode == 0, result.stderr


# --- cache bound, cache clear, counts --------------------------------------------------------


@pytest.mark.parametrize(("size", "block"), [("1", "8M"), ("31M", "8M"), ("255K", "64K")])
def test_cache_under_four_blocks_is_refused(
    tmp_path: Path, shards: Path, mnt: Path, size: str, block: str
) -> None:
    result = run(tmp_path, "mount", shards, mnt, "--cache-size", size, "--block-size", block)
    line = assert_one_error(result, 2, f"--cache-size {size}: under 4 blocks", "--no-cache")
    assert "give at least" in line


def test_cache_of_four_blocks_or_none_is_taken(tmp_path: Path, shards: Path) -> None:
    ok = run(tmp_path, "warm", shards, "--cache-size", "256K", "--block-size", "64K")
    assert ok.returncode == 0, ok.stderr
    # The index scan fetched every block (and kept it): the summary counts it.
    summary = (
        r"warmed 2 shards: 2/2 blocks cached \(0 were already\), fetched ([\d.]+) KiB in .* s "
        r"\(\d+ MB/s; \1 KiB by the index scan\)\n"
    )
    assert re.fullmatch(summary, ok.stdout), ok.stdout
    refused = run(tmp_path, "warm", shards, "--cache-size", "1")
    assert_one_error(refused, 2, "--no-cache")


def test_cache_clear_json(tmp_path: Path, shards: Path) -> None:
    cache = tmp_path / "cache"
    assert run(tmp_path, "index", shards, "--cache-dir", cache).returncode == 0
    result = run(tmp_path, "cache", "clear", "--all", "--json", "--cache-dir", cache)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {
        "block_bytes_freed": 0,
        "cache_dir": str(cache),
        "cleared": ["blocks", "indexes", "views"],
    }


def test_one_shard_is_singular(tmp_path: Path) -> None:
    folder = tmp_path / "one"
    folder.mkdir()
    (folder / "s.tar").write_bytes(make_tar([("x.txt", b"x")]))
    result = run(tmp_path, "index", folder)
    assert result.stdout.startswith("indexed 1 shard (1 scanned) into "), result.stdout


# --- a backgrounded mount's daemon: traceback, log files -------------------------------------


def daemon_logs(cache: Path) -> list[Path]:
    return sorted((cache / "logs").glob("mount-*.log"))


def test_failed_daemon_shows_its_traceback_with_v(tmp_path: Path, mnt: Path) -> None:
    cache = tmp_path / "cache"
    quiet = run(tmp_path, "mount", tmp_path / "nope", mnt, "--cache-dir", cache)
    assert_one_error(quiet, 3, "no such folder")

    loud = run(tmp_path, "mount", tmp_path / "nope", mnt, "--cache-dir", cache, "-v")
    assert loud.returncode == 3
    lines = loud.stderr.splitlines()
    assert lines[0] == "Traceback (most recent call last):", loud.stderr
    assert any(line.startswith("shardfs.errors.SourceNotFoundError: ") for line in lines)
    assert lines[-1] == f"shardfs: error: {tmp_path / 'nope'}: no such folder or prefix"
    match = re.fullmatch(r"shardfs: the daemon's log is (\S+)", lines[-2])
    assert match, lines[-2]
    log = Path(match.group(1))
    assert re.fullmatch(r"mount-\d+\.log", log.name) and log.parent == cache / "logs"
    assert "SourceNotFoundError" in log.read_text()
    assert len(daemon_logs(cache)) == 2  # one per daemon, each named by its pid


def test_logs_are_pruned_to_the_last_twenty(tmp_path: Path, mnt: Path) -> None:
    cache = tmp_path / "cache"
    (cache / "logs").mkdir(parents=True)
    old = [cache / "logs" / f"mount-{5_000_000 + n}.log" for n in range(25)]  # no such pids
    for age, path in enumerate(old):
        path.write_text("old")
        os.utime(path, (1_000_000 + age, 1_000_000 + age))
    result = run(tmp_path, "mount", tmp_path / "nope", mnt, "--cache-dir", cache)
    assert result.returncode == 3
    logs = daemon_logs(cache)
    assert len(logs) == 20
    newest = [path for path in logs if path not in old]
    assert len(newest) == 1 and "no such folder" in newest[0].read_text()
    assert set(logs) - set(newest) == set(old[-19:])  # the 19 most recent old ones stay


def test_log_file_option(tmp_path: Path, mnt: Path) -> None:
    cache = tmp_path / "cache"
    chosen = tmp_path / "my.log"
    chosen.write_text("earlier run\n")
    result = run(
        tmp_path, "mount", tmp_path / "nope", mnt, "--cache-dir", cache, "--log-file", chosen,
        "-v",
    )  # fmt: skip
    assert result.returncode == 3
    assert f"shardfs: the daemon's log is {chosen}" in result.stderr
    assert result.stderr.count("Traceback (most recent call last)") == 1
    text = chosen.read_text()
    assert text.startswith("earlier run\n") and "SourceNotFoundError" in text
    assert daemon_logs(cache) == []


# --- the daemon is started with the argv main() was given, not with sys.argv ------------------


def test_daemon_gets_the_argv_main_was_given(
    tmp_path: Path,
    shards: Path,
    mnt: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """In-process: main(argv) with a sys.argv that says something else; the spawn sees argv."""
    import shardfs.mount.daemon
    from shardfs.cli import main, mount_helper

    spawned: list[list[str]] = []

    def spawn_daemon(argv: list[str], *_: object, **__: object) -> tuple[int, str]:
        spawned.append(list(argv))
        return 0, "3 raw"

    monkeypatch.setattr(shardfs.mount.daemon, "spawn_daemon", spawn_daemon)
    monkeypatch.setattr(sys, "argv", ["shardfs", "stats", "/somewhere/else"])
    cache = tmp_path / "cache"
    argv = ["mount", str(shards), str(mnt), "--cache-dir", str(cache), "-o", "cache_size=1G"]
    assert main(argv) == 0
    assert spawned == [argv]
    assert capsys.readouterr().out == f"mounted {shards} at {mnt} (3 files, raw layout)\n"

    # mount.shardfs turns mount(8)'s words into a shardfs command line: that one is spawned.
    assert mount_helper([str(shards), str(mnt), "-o", f"rw,cache_dir={cache}"]) == 0
    assert spawned[1] == ["mount", str(shards), str(mnt), "-o", f"cache_dir={cache}"]


def test_daemon_of_main_called_with_argv_parses_it(tmp_path: Path, mnt: Path) -> None:
    """End to end, no FUSE: main(argv) from a program whose own sys.argv is not a shardfs
    command line. The real daemon must fail on the missing source (exit 3), which it only
    sees if it was given argv."""
    source, cache = tmp_path / "nope", tmp_path / "cache"
    code = (
        "import sys; from shardfs.cli import main; "
        f"sys.exit(main(['mount', {str(source)!r}, {str(mnt)!r}, '--cache-dir', {str(cache)!r}]))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, "--unrelated"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert_one_error(result, 3, str(source), "no such folder")


@pytest.mark.parametrize("where", ["before", "after"])
def test_verbose_before_or_after_the_command_shows_the_traceback(
    tmp_path: Path, where: str
) -> None:
    """``-v`` works on either side of the command word (before, the command's own default
    used to reset it to 0)."""
    args = (
        ["-v", "index", tmp_path / "nope"]
        if where == "before"
        else ["index", "-v", tmp_path / "nope"]
    )
    result = run(tmp_path, *args)
    assert result.returncode == 3, result.stderr
    assert "Traceback" in result.stderr


def test_an_abbreviated_option_is_not_taken_for_another(tmp_path: Path, shards: Path) -> None:
    """argparse's abbreviations are off: ``--ready-f`` must not become the hidden ``--ready-fd``,
    and ``--cache-s`` no prefix of ``--cache-size``."""
    for option in ("--ready-f", "--cache-s"):
        result = run(tmp_path, "mount", option, "3", shards, tmp_path / "mnt")
        assert result.returncode == 2, (option, result.stderr)
        assert f"unknown option {option}" in result.stderr
        assert not (tmp_path / "mnt").exists() or not os.path.ismount(tmp_path / "mnt")

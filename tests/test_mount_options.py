"""``-o`` mount options, ``--uid/--gid/--file-mode/--dir-mode`` and the ``mount.shardfs``
helper: parsed in-process, then through real FUSE mounts (the way mount(8) runs them)."""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from support.mounts import assert_one_error_line, umount
from support.processes import is_mounted
from support.tarbuild import make_tar

from shardfs.cli import build_parser, mount_helper
from shardfs.errors import UsageError
from shardfs.mount.options import apply_options, split_options

REPO = Path(__file__).resolve().parents[1]


def parse(*argv: str) -> argparse.Namespace:
    args = build_parser().parse_args(list(argv))
    if getattr(args, "options", None):
        apply_options(args.command_parser, args, split_options(args.options), command=args.command)
    return args


def refused(*argv: str) -> str:
    with pytest.raises(UsageError) as caught:
        parse(*argv)
    text = str(caught.value)
    assert "\n" not in text
    return text


# -- parsing ----------------------------------------------------------------------------------


def test_fuse_and_long_options_set_what_their_flags_set() -> None:
    args = parse(
        "mount", "src", "mnt",
        "-o", "ro,allow_other,uid=1234,gid=5678,default_permissions",
        "-o", "cache_size=50G,block_size=4M,prefetch=all,cache_dir=/x,read_timeout=5",
        "-o", "endpoint_url=http://h:9000,layout=raw,no_kernel_push,file_mode=0440,dir_mode=550",
        "-o", "storage_option=anon=true,storage_option=client_kwargs.region_name=eu",
    )  # fmt: skip
    assert args.allow_other is True and args.allow_root is False
    assert (args.uid, args.gid) == (1234, 5678)
    assert (args.cache_size, args.block_size, args.prefetch) == ("50G", "4M", "all")
    assert args.cache_dir == Path("/x") and args.read_timeout == 5.0
    assert args.endpoint_url == "http://h:9000" and args.layout == "raw"
    assert args.no_kernel_push is True
    assert (args.file_mode, args.dir_mode) == (0o440, 0o550)
    assert args.storage_option == ["anon=true", "client_kwargs.region_name=eu"]


def test_o_is_applied_after_the_flags() -> None:
    args = parse("mount", "src", "mnt", "--cache-size", "1G", "-o", "cache_size=2G")
    assert args.cache_size == "2G"


def test_fstab_options_are_accepted_and_change_nothing() -> None:
    plain = vars(parse("mount", "src", "mnt"))
    noisy = vars(
        parse(
            "mount", "src", "mnt", "-o",
            "ro,dev,nodev,suid,nosuid,exec,noexec,auto,noauto,user,users,_netdev,nofail,"
            "defaults,noatime,x-systemd.automount,comment=x",
        )
    )  # fmt: skip
    plain.pop("options"), noisy.pop("options")
    plain.pop("command_parser"), noisy.pop("command_parser")
    assert noisy == plain


def test_allow_root_and_nonempty() -> None:
    args = parse("mount", "src", "mnt", "-o", "allow_root,nonempty")
    assert args.allow_root is True and args.nonempty is True


@pytest.mark.parametrize(
    ("option", "part"),
    [
        ("anon=true", "--storage-option anon=true"),
        ("client_kwargs.region_name=x", "--storage-option client_kwargs.region_name=x"),
        ("key=abc", "--storage-option key=abc"),
        ("bogus", "-o bogus: unknown option"),
        ("rw", "read-only"),
        ("allow_other=true", "takes no value"),
        ("no_cache=1", "takes no value"),
        ("layout", "needs a value"),
        ("layout=tree", "invalid choice"),
        ("cache-size=5G", "-o cache_size=5G"),
        ("uid=nosuchuser-xyz", "no such user"),
        ("file_mode=0999", "not an octal mode"),
        ("dir_mode=01777", "between 0 and 0777"),
        ("read_timeout=0", "more than 0"),
        ("verbose", "unknown option"),
        ("ready_fd=3", "unknown option"),
        ("help", "unknown option"),
    ],
)
def test_refused_options_say_why_in_one_line(option: str, part: str) -> None:
    assert part in refused("mount", "src", "mnt", "-o", option)


@pytest.mark.parametrize(
    ("command", "option", "meant"),
    [
        ("mount", "cache_szie=1G", "cache_size=1G"),
        ("mount", "cache-szie=1G", "cache_size=1G"),
        ("mount", "prefetch_stream=8", "prefetch_streams=8"),
        ("mount", "no_cahce", "no_cache"),
        ("mount", "alow_other", "allow_other"),
        ("mount", "nodve", "nodev"),
        ("mount", "endpoint=http://h:9000", "endpoint_url=http://h:9000"),
        ("warm", "prefetch_streem=8", "prefetch_streams=8"),
        ("index", "no_sidcar", "no_sidecar"),
    ],
)
def test_a_mistyped_o_option_names_the_real_one(command: str, option: str, meant: str) -> None:
    line = refused(command, "src", *(["mnt"] if command == "mount" else []), "-o", option)
    assert line == f"-o {option}: unknown option; did you mean -o {meant}?"


@pytest.mark.parametrize(
    ("command", "option"),
    [("index", "cache_szie=1G"), ("mount", "anon=true"), ("mount", "client_kwargs.region=x")],
)
def test_an_o_option_like_none_of_ours_is_not_guessed(command: str, option: str) -> None:
    """``index`` has --cache-dir but no --cache-size: ``cache_szie`` is no typo of it, and a
    storage option is named as one."""
    line = refused(command, "src", *(["mnt"] if command == "mount" else []), "-o", option)
    assert "did you mean" not in line
    assert f"--storage-option {option}" in line


@pytest.mark.parametrize(
    ("argv", "usage", "line"),
    [
        (
            ["mount", "--cache-szie", "1G", "SRC", "MNT"],
            "usage: shardfs mount ",
            "shardfs mount: error: unknown option --cache-szie; did you mean --cache-size?",
        ),
        (
            ["mount", "SRC", "MNT", "--prefech=all"],
            "usage: shardfs mount ",
            "shardfs mount: error: unknown option --prefech; did you mean --prefetch?",
        ),
        (
            ["stats", "--jsno", "MNT"],
            "usage: shardfs stats ",
            "shardfs stats: error: unknown option --jsno; did you mean --json?",
        ),
        (
            ["--verbsoe", "stats", "MNT"],
            "usage: shardfs [-h]",
            "shardfs: error: unknown option --verbsoe; did you mean --verbose?",
        ),
        (
            ["mount", "SRC", "MNT", "--zzz"],
            "usage: shardfs mount ",
            "shardfs mount: error: unknown option --zzz",
        ),
        (
            ["umount", "MNT", "extra"],
            "usage: shardfs umount ",
            "shardfs umount: error: unrecognized arguments: extra",
        ),
    ],
)
def test_an_unknown_long_option_goes_with_its_commands_usage(
    argv: list[str], usage: str, line: str, tmp_path: Path
) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "shardfs", *argv],
        capture_output=True, text=True, cwd=tmp_path, check=False,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.startswith(usage), result.stderr
    assert result.stderr.splitlines()[-1] == line
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("command", ["index", "warm", "verify"])
@pytest.mark.parametrize("option", ["allow_other", "ro", "uid=1", "nodev"])
def test_mount_options_are_refused_by_commands_that_do_not_mount(command: str, option: str) -> None:
    argv = [command, *(["tree"] if command == "verify" else []), "src", "-o", option]
    assert "does not mount" in refused(*argv)


def test_other_commands_take_their_own_long_options() -> None:
    args = parse("warm", "src", "-o", "prefetch_streams=32,cache_size=9G,no_sidecar")
    assert (args.prefetch_streams, args.cache_size, args.no_sidecar) == (32, "9G", True)
    assert "not an option of shardfs index" in refused("index", "src", "-o", "layout=raw")
    assert "not an option of shardfs pack" in refused(
        "pack", "tree", "dest", "-o", "read_timeout=3"
    )


def test_allow_other_and_allow_root_exclude_each_other(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "shardfs", "mount", "src", str(tmp_path), "-o",
         "allow_other,allow_root"],
        capture_output=True, text=True, cwd=REPO, check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "shardfs: error: allow_other and allow_root exclude each other; give one"
    ]


@pytest.mark.parametrize(
    ("argv", "part"),
    [
        (["src"], "usage: mount.shardfs SOURCE MOUNTPOINT"),
        (["src", "mnt", "-x"], "unknown flag -x"),
        (["src", "mnt", "-o"], "-o needs a value"),
    ],
)
def test_helper_refuses_a_bad_command_line(
    argv: list[str], part: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert mount_helper(argv) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and part in lines[0], lines


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_helper_help_says_its_form_and_what_o_takes(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert mount_helper([flag]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert out.startswith("usage: mount.shardfs SOURCE MOUNTPOINT ")
    assert "[-o OPTIONS]" in out.splitlines()[0]
    # Every long option of shardfs mount, as -o spells it, and the FUSE options.
    mount_parser = build_parser().parse_args(["mount", "s", "m"]).command_parser
    longs = [
        s[2:].replace("-", "_")
        for a in mount_parser._actions
        for s in a.option_strings
        if s.startswith("--") and a.help != argparse.SUPPRESS and s not in ("--help", "--verbose")
    ]
    assert len(longs) > 20
    o_text = " ".join(out.split("-o takes", 1)[1].split())
    for name in [*longs, "allow_root", "nonempty", "default_permissions", "_netdev"]:
        assert name in o_text, name
    assert "ready_fd" not in out  # internal
    assert "exit codes" in out
    # As mount(8) or a user runs it: the console script's entry point in its own process.
    result = subprocess.run(helper_command(flag), capture_output=True, text=True, check=False)
    assert (result.returncode, result.stdout, result.stderr) == (0, out, "")


def test_helper_refuses_an_unknown_long_option(capsys: pytest.CaptureFixture[str]) -> None:
    assert mount_helper(["src", "mnt", "--fake"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("mount.shardfs: unknown option --fake;"), lines


def test_helper_fake_mount_checks_options_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """mount -f: nothing is mounted; mount(8)'s own rw is accepted, a bad option is not."""
    assert mount_helper(["src", str(tmp_path), "-f", "-o", "rw,nodev,cache_size=1G"]) == 0
    assert not is_mounted(tmp_path)
    assert mount_helper(["src", str(tmp_path), "-fn", "-o", "anon=true"]) == 2
    assert "--storage-option anon=true" in capsys.readouterr().err


# -- real mounts ------------------------------------------------------------------------------

MEMBERS = {
    "a/one.txt": b"1" * 5000,  # above the READDIRPLUS full-entry size
    "a/b/two.bin": os.urandom(9000),
    "run.sh": b"#!/bin/sh\necho hi\n" * 300,
}


@pytest.fixture
def source(tmp_path: Path) -> Path:
    folder = tmp_path / "shards"
    folder.mkdir()
    (folder / "s0.tar").write_bytes(make_tar(list(MEMBERS.items())))
    return folder


def helper_command(*argv: str | Path) -> list[str]:
    """``mount.shardfs ARGV`` as the console script runs it (this checkout's shardfs)."""
    code = f"import sys; sys.path.insert(0, {str(REPO)!r}); from shardfs.cli import mount_helper; "
    code += "sys.exit(mount_helper())"
    return [sys.executable, "-c", code, *map(str, argv)]


def run_env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "SHARDFS_CACHE_DIR": str(tmp_path / "cache")}


def check_owner_and_modes(mountpoint: Path) -> None:
    """stat and READDIRPLUS listings both show uid 1234, gid 5678, 0440 files, 0550 dirs;
    root still reads every file whole."""
    root = os.stat(mountpoint)
    assert (root.st_uid, root.st_gid, stat.S_IMODE(root.st_mode)) == (1234, 5678, 0o550)
    for name, data in MEMBERS.items():
        info = os.stat(mountpoint / name)
        assert stat.S_ISREG(info.st_mode)
        assert (info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)) == (1234, 5678, 0o440)
        got = hashlib.sha256((mountpoint / name).read_bytes()).hexdigest()
        assert got == hashlib.sha256(data).hexdigest(), name
    with os.scandir(mountpoint / "a") as listing:
        entries = {entry.name: entry.stat(follow_symlinks=False) for entry in listing}
    assert set(entries) == {"one.txt", "b"}
    assert stat.S_IMODE(entries["one.txt"].st_mode) == 0o440
    assert stat.S_IMODE(entries["b"].st_mode) == 0o550 and stat.S_ISDIR(entries["b"].st_mode)
    for info in entries.values():
        assert (info.st_uid, info.st_gid) == (1234, 5678)


@pytest.mark.integration
def test_uid_gid_and_modes_through_flags(source: Path, mountpoint: Path, tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "shardfs", "mount", str(source), str(mountpoint),
         "--uid", "1234", "--gid", "5678", "--file-mode", "0440", "--dir-mode", "0550"],
        capture_output=True, text=True, cwd=REPO, env=run_env(tmp_path), check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    check_owner_and_modes(mountpoint)
    umount(mountpoint)


@pytest.mark.integration
def test_default_modes_are_unchanged(source: Path, mountpoint: Path, tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "shardfs", "mount", str(source), str(mountpoint)],
        cwd=REPO, env=run_env(tmp_path), check=True, capture_output=True,
    )  # fmt: skip
    assert stat.S_IMODE(os.stat(mountpoint / "a").st_mode) == 0o555
    assert stat.S_IMODE(os.stat(mountpoint / "a/one.txt").st_mode) == 0o444
    assert os.stat(mountpoint / "a/one.txt").st_uid == os.getuid()
    umount(mountpoint)


@pytest.mark.integration
def test_helper_mounts_as_mount8_calls_it(source: Path, mountpoint: Path, tmp_path: Path) -> None:
    """``mount.shardfs SOURCE MNT -o OPTS`` with the rw that mount(8) adds, fstab options,
    FUSE options and long options; then the mount is refused on a non-empty folder unless
    nonempty is given."""
    options = "rw,nodev,nosuid,_netdev,uid=1234,gid=5678,file_mode=0440,dir_mode=0550,layout=raw"
    result = subprocess.run(
        helper_command(source, mountpoint, "-o", options),
        capture_output=True, text=True, env=run_env(tmp_path), check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"mounted {source} at {mountpoint}")
    check_owner_and_modes(mountpoint)
    umount(mountpoint)

    (mountpoint / "left.txt").write_text("x")
    refused = subprocess.run(
        helper_command(source, mountpoint, "-o", "ro"),
        capture_output=True, text=True, env=run_env(tmp_path), check=False,
    )  # fmt: skip
    assert "-o nonempty" in assert_one_error_line(refused)
    assert refused.returncode == 5
    result = subprocess.run(
        helper_command(source, mountpoint, "-o", "ro,nonempty"),
        capture_output=True, text=True, env=run_env(tmp_path), check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert (mountpoint / "run.sh").read_bytes() == MEMBERS["run.sh"]
    assert not (mountpoint / "left.txt").exists()  # hidden while mounted
    umount(mountpoint)
    assert (mountpoint / "left.txt").read_text() == "x"


@pytest.mark.integration
def test_mount_t_shardfs_through_mount8(source: Path, mountpoint: Path, tmp_path: Path) -> None:
    """The real ``mount -t shardfs``: mount(8) finds /sbin/mount.shardfs. The helper is
    linked there for this test only, and only when nothing of that name exists yet."""
    link = Path("/sbin/mount.shardfs")
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root and mount(8) to place /sbin/mount.shardfs")
    if os.path.lexists(link):
        pytest.skip(f"{link} exists already; not replacing it")
    script = tmp_path / "mount.shardfs"
    script.write_text(
        f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(REPO)!r})\n"
        "from shardfs.cli import mount_helper\nsys.exit(mount_helper())\n"
    )
    script.chmod(0o755)
    link.symlink_to(script)
    try:
        result = subprocess.run(
            ["mount", "-t", "shardfs", "-o", "uid=1234,gid=5678,file_mode=0440,dir_mode=0550",
             str(source), str(mountpoint)],
            capture_output=True, text=True, env=run_env(tmp_path), check=False,
        )  # fmt: skip
    finally:
        link.unlink()
    assert result.returncode == 0, result.stderr
    assert is_mounted(mountpoint)
    check_owner_and_modes(mountpoint)
    umount(mountpoint)


def test_helper_sloppy_drops_unknown_options(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """mount -s: an option shardfs does not know is named and dropped, the rest kept."""
    assert mount_helper(["src", str(tmp_path), "-sf", "-o", "rw,bogus,cache_size=1G"]) == 0
    assert capsys.readouterr().err.splitlines() == [
        "shardfs: warning: ignored (-o bogus: unknown option (see shardfs mount --help))"
    ]
    assert mount_helper(["src", str(tmp_path), "-f", "-o", "bogus"]) == 2

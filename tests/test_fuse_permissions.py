"""FUSE permission problems: one line that names the cause and the fix.

The integration tests run ``shardfs mount`` as an unprivileged user in a private mount
namespace (see test_nonroot.py) where /dev/fuse, /etc/fuse.conf or fusermount3 are replaced
for that run only. The unit tests drive ``diagnose_fuse_failure`` with files of their own,
for the causes a namespace cannot fake (a missing device, a missing capability)."""

from __future__ import annotations

import grp
import os
import stat
from pathlib import Path

import pytest
from test_nonroot import Place, User, place, run_in_private_namespace, user, write_shards

from shardfs.mount.mountpoints import diagnose_fuse_failure

__all__ = ["place", "user"]  # fixtures shared with test_nonroot

RAW = ("--layout", "raw")  # no layout line before the error: stderr holds one line


def failed_line(report: dict[str, object]) -> str:
    """The mount failed with exit 5 and one line, which is returned."""
    code, stdout, stderr = report["mount"]  # type: ignore[misc]
    assert code == 5, (code, stdout, stderr)
    lines = [line for line in str(stderr).splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert "files" not in report  # nothing was mounted
    return lines[0]


@pytest.mark.integration
def test_dev_fuse_not_accessible_names_the_mode_and_chmod(user: User, place: Place) -> None:
    write_shards(place.shards)
    line = failed_line(run_in_private_namespace(user, place, *RAW, device_mode=0o600))
    assert line == (
        f"shardfs: error: {place.mountpoint}: cannot mount: /dev/fuse cannot be opened by "
        "this user (Permission denied; it is crw------- root:root): make it usable by all as "
        "most systems do (sudo chmod 0666 /dev/fuse)"
    )


@pytest.mark.integration
def test_dev_fuse_of_a_group_names_the_group(user: User, place: Place) -> None:
    group = grp.getgrnam("disk") if "disk" in {g.gr_name for g in grp.getgrall()} else None
    if group is None or user.gid == group.gr_gid or user.name in group.gr_mem:
        pytest.skip("needs a group 'disk' that the test user is not in")
    write_shards(place.shards)
    report = run_in_private_namespace(
        user, place, *RAW, device_mode=0o660, device_group=group.gr_gid
    )
    line = failed_line(report)
    assert "(Permission denied; it is crw-rw---- root:disk)" in line
    assert line.endswith(
        "add this user to the disk group (sudo usermod -aG disk $USER, then log in again), "
        "or make it usable by all as most systems do (sudo chmod 0666 /dev/fuse)"
    )


@pytest.mark.integration
def test_allow_other_without_user_allow_other(user: User, place: Place) -> None:
    expected = write_shards(place.shards)
    report = run_in_private_namespace(
        user, place, *RAW, "--allow-other", fuse_conf="# mount_max = 1000\n#user_allow_other\n"
    )
    assert failed_line(report) == (
        f"shardfs: error: {place.mountpoint}: cannot mount: allow_other needs the line "
        "user_allow_other in /etc/fuse.conf for users other than root: add it (as root), or "
        "mount without allow_other"
    )
    # The fix named works.
    report = run_in_private_namespace(user, place, "--allow-other", fuse_conf="user_allow_other\n")
    assert report["mount"][0] == 0, report["mount"]  # type: ignore[index]
    assert report["files"] == expected


@pytest.mark.integration
def test_fusermount3_that_cannot_run(user: User, place: Place) -> None:
    write_shards(place.shards)
    line = failed_line(run_in_private_namespace(user, place, *RAW, hide_fusermount=True))
    assert line.endswith(
        "cannot mount: fusermount3 is not installed or cannot be run (an unprivileged user "
        "mounts through it): install fuse3 (apt install fuse3, or dnf install fuse3)"
    )


@pytest.mark.integration
def test_mountpoint_the_user_may_not_write(user: User, place: Place) -> None:
    write_shards(place.shards)
    theirs = place.root / "roots-mnt"
    theirs.mkdir(mode=0o755)  # root's, empty: shardfs accepts it, fusermount3 does not
    line = failed_line(run_in_private_namespace(user, place, *RAW, mountpoint=theirs))
    assert line == (
        f"shardfs: error: {theirs}: cannot mount: this user has no write access to the "
        f"mountpoint {theirs}, which fusermount3 requires: mount on a folder you own"
    )


# --- the diagnosis on its own, with files of the test's -----------------------------------------


def fake_status(tmp_path: Path, bounding: int = 0x1FFFEFFFFFF) -> Path:
    path = tmp_path / f"status-{bounding:x}"
    path.write_text(f"Name:\tpython\nCapEff:\t0000000000000000\nCapBnd:\t{bounding:016x}\n")
    return path


def setuid_helper(tmp_path: Path, mode: int = 0o4755) -> Path:
    helper = tmp_path / f"fusermount3-{mode:o}"
    helper.write_bytes(b"#!/bin/sh\n")
    helper.chmod(mode)
    return helper


def diagnose(tmp_path: Path, **overrides: object) -> str | None:
    conf = tmp_path / "fuse.conf"
    if not conf.exists():
        conf.write_text("user_allow_other\n")
    arguments: dict[str, object] = {
        "allow_other": False,
        "device": Path("/dev/null"),  # opens read-write for anyone: the device is fine
        "fuse_conf": conf,
        "fusermount": str(setuid_helper(tmp_path)),
        "euid": 1000,
        "status": fake_status(tmp_path),
    }
    arguments.update(overrides)
    return diagnose_fuse_failure(tmp_path, **arguments)  # type: ignore[arg-type]


def test_no_cause_found_when_everything_is_in_place(tmp_path: Path) -> None:
    assert diagnose(tmp_path) is None
    assert diagnose(tmp_path, allow_other=True) is None
    assert diagnose(tmp_path, euid=0, fusermount="/nonexistent") is None  # root needs none


def test_missing_device(tmp_path: Path) -> None:
    cause = diagnose(tmp_path, device=tmp_path / "fuse")
    assert cause == (
        f"{tmp_path}/fuse does not exist: load the fuse kernel module (sudo modprobe fuse), "
        "or in a container pass the device (--device /dev/fuse)"
    )


def test_device_that_is_no_device(tmp_path: Path) -> None:
    folder = tmp_path / "fuse"
    folder.mkdir()
    cause = diagnose(tmp_path, device=folder)
    assert cause is not None and cause.startswith(f"{folder} cannot be opened (Is a directory)")


def test_no_cap_sys_admin_in_the_bounding_set(tmp_path: Path) -> None:
    cause = diagnose(tmp_path, status=fake_status(tmp_path, bounding=0x1FFFEFFFFFF & ~(1 << 21)))
    assert cause is not None and "CAP_SYS_ADMIN" in cause and "--cap-add SYS_ADMIN" in cause
    # An unreadable status file tells nothing: no cause is made up.
    assert diagnose(tmp_path, status=tmp_path / "missing") is None


def test_fusermount3_missing_or_not_setuid(tmp_path: Path) -> None:
    missing = diagnose(tmp_path, fusermount=str(tmp_path / "none"))
    assert missing is not None and missing.startswith("fusermount3 is not installed")
    plain = setuid_helper(tmp_path, mode=0o755)
    cause = diagnose(tmp_path, fusermount=str(plain))
    assert cause == (
        f"{plain} is not setuid root, so an unprivileged user cannot mount with it: "
        f"reinstall fuse3, or sudo chmod u+s {plain}"
    )
    assert plain.stat().st_mode & stat.S_ISUID == 0


@pytest.mark.parametrize(
    ("conf", "allowed"),
    [
        ("user_allow_other\n", True),
        ("  user_allow_other  # for shardfs\n", True),
        ("#user_allow_other\n", False),
        ("# user_allow_other\nmount_max = 10\n", False),
        ("user_allow_other_not\n", False),
        (None, False),  # no /etc/fuse.conf at all
    ],
)
def test_allow_other_reads_fuse_conf_as_fusermount3_does(
    tmp_path: Path, conf: str | None, allowed: bool
) -> None:
    path = tmp_path / "fuse.conf"
    if conf is None:
        path.mkdir()  # exists (so the helper writes none) but cannot be read as a file
    else:
        path.write_text(conf)
    cause = diagnose(tmp_path, allow_other=True)
    assert (cause is None) == allowed, cause
    if not allowed:
        assert cause is not None and f"user_allow_other in {path}" in cause
        assert diagnose(tmp_path, allow_other=False) is None


def test_unwritable_mountpoint(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("root may write anywhere; the integration test covers this as a user")
    tmp_path.chmod(0o555)
    try:
        cause = diagnose(tmp_path)
    finally:
        tmp_path.chmod(0o755)
    assert cause is not None and "no write access to the mountpoint" in cause

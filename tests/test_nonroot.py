"""shardfs as an unprivileged user: mount, read every file, unmount.

We run as root, so the test makes (or borrows) an unprivileged user and runs everything as
that user inside a private mount namespace (``unshare --mount``). There, ``/dev/fuse`` is a
device node of the mode the test wants, bind-mounted over the real one, so the machine's own
``/dev/fuse`` is never changed, and every mount made inside goes away with the namespace.
Where that cannot be done (not root, no unshare, no usable Python for the user), the test
skips and says why.
"""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import shlex
import shutil
import site
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import shardfs

pytestmark = pytest.mark.integration

TEST_USER = "shardfs-test"
FUSE_MAJOR_MINOR = (10, 229)

# Run by the unprivileged user: mount, hash every file, unmount; report as JSON on stdout.
USER_SCRIPT = r"""
import hashlib, json, os, subprocess, sys
source, mountpoint, cache, *extra = sys.argv[1:]
def shardfs(*args):
    done = subprocess.run([sys.executable, "-m", "shardfs", *args], capture_output=True,
                          text=True, timeout=120)
    return [done.returncode, done.stdout, done.stderr]
report = {"uid": os.getuid()}
report["mount"] = shardfs("mount", source, mountpoint, "--cache-dir", cache, *extra)
if report["mount"][0] == 0:
    from shardfs.mount.table import find_mount
    entry = find_mount(mountpoint)
    report["table"] = [entry.fstype, entry.source] if entry else None
    hashes = {}
    for folder, _, names in os.walk(mountpoint):
        for name in names:
            path = os.path.join(folder, name)
            with open(path, "rb") as handle:
                digest = hashlib.sha256(handle.read()).hexdigest()
            hashes[os.path.relpath(path, mountpoint)] = digest
    report["files"] = hashes
    report["umount"] = shardfs("umount", mountpoint)
    report["mounted_after_umount"] = os.path.ismount(mountpoint)
print(json.dumps(report))
"""


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int
    python: str  # an interpreter this user can run
    env: dict[str, str]  # what it needs to import shardfs and its dependencies


def _run_as(user: str, command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["runuser", "-u", user, "--", "env", "-i", *[f"{k}={v}" for k, v in env.items()], *command],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _user_env() -> dict[str, str]:
    """PYTHONPATH with this checkout's shardfs first, then this interpreter's packages: the
    user may not be able to reach the virtualenv's interpreter (it can live under /root)."""
    package_root = Path(shardfs.__file__).resolve().parents[1]
    paths = [str(package_root), *site.getsitepackages()]
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "PYTHONPATH": os.pathsep.join(paths)}


def unprivileged_user() -> User | str:
    """The user to run as, or why there is none."""
    if os.geteuid() != 0:
        return "needs root, to make a test user and a private /dev/fuse"
    for tool in ("runuser", "unshare", "mknod", "mount"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    name = TEST_USER
    try:
        pwd.getpwnam(name)
    except KeyError:
        made = subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
            capture_output=True,
            text=True,
            check=False,
        )
        if made.returncode != 0:
            name = "nobody"  # no way to make a user: borrow the one every system has
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        return "no unprivileged user: useradd failed and there is no 'nobody'"
    env = _user_env()
    wanted = f"{sys.version_info[0]}.{sys.version_info[1]}"
    probe = "import sys, shardfs.cli, shardfs.fuse.session; print('%d.%d' % sys.version_info[:2])"
    tried = []
    for python in (sys.executable, shutil.which(f"python{wanted}"), "/usr/bin/python3"):
        if python is None or python in tried:
            continue
        tried.append(python)
        found = _run_as(entry.pw_name, [python, "-c", probe], env)
        if found.returncode == 0 and found.stdout.strip() == wanted:
            return User(entry.pw_name, entry.pw_uid, entry.pw_gid, python, env)
    return f"no Python {wanted} that user {entry.pw_name} can run with shardfs ({', '.join(tried)})"


@pytest.fixture(scope="module")
def user() -> User:
    found = unprivileged_user()
    if isinstance(found, str):
        pytest.skip(f"cannot run as an unprivileged user: {found}")
    return found


@dataclass
class Place:
    """Folders the user can use: shards to read, a cache and a mountpoint it owns."""

    root: Path
    shards: Path
    cache: Path
    mountpoint: Path


@pytest.fixture
def place(user: User) -> Iterator[Place]:
    # Not under pytest's tmp_path: /tmp/pytest-of-root is closed to other users.
    root = Path(tempfile.mkdtemp(prefix="shardfs-nonroot-"))
    root.chmod(0o755)
    # A comma and a space in the source: the mount table must show it as it is, through
    # fusermount3's option parsing.
    made = Place(root, root / "shards, v1", root / "cache", root / "mnt")
    for folder in (made.shards, made.cache, made.mountpoint):
        folder.mkdir()
    for folder in (made.cache, made.mountpoint):
        os.chown(folder, user.uid, user.gid)
    try:
        yield made
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(Path(tempfile.gettempdir()) / f"shardfs-{user.uid}", ignore_errors=True)


def write_shards(folder: Path) -> dict[str, str]:
    """Two tar shards of a small tree; returns path -> SHA-256 of the files in them."""
    expected: dict[str, str] = {}
    for shard in range(2):
        with tarfile.open(folder / f"shard-{shard:03d}.tar", "w") as tar:
            for number in range(5):
                name = f"class{number % 2}/s{shard}-{number}.bin"
                data = os.urandom(1000 * (number + 1) + shard)
                path = folder / "staging" / name
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)
                tar.add(path, arcname=name)
                expected[name] = hashlib.sha256(data).hexdigest()
    shutil.rmtree(folder / "staging")
    for path in folder.iterdir():
        path.chmod(0o644)
    return expected


def run_in_private_namespace(
    user: User,
    place: Place,
    *extra: str,
    device_mode: int = 0o666,
    device_group: int = 0,
    fuse_conf: str | None = None,
    hide_fusermount: bool = False,
    mountpoint: Path | None = None,
) -> dict[str, object]:
    """USER_SCRIPT as ``user`` in a private mount namespace whose /dev/fuse has
    ``device_mode`` and ``device_group`` (and optionally a private /etc/fuse.conf, or a
    fusermount3 that cannot be run). A safety unmount runs inside before the namespace ends."""
    private = place.root / "private"
    private.mkdir(exist_ok=True)
    target = mountpoint or place.mountpoint
    steps = [
        f"mount -t tmpfs -o mode=0755 shardfs-test {private}",
        f"mknod -m {device_mode:o} {private}/fuse c {FUSE_MAJOR_MINOR[0]} {FUSE_MAJOR_MINOR[1]}",
        f"chgrp {device_group} {private}/fuse",
        f"mount --bind {private}/fuse /dev/fuse",
    ]
    if fuse_conf is not None:
        steps += [
            f"printf '%s' '{fuse_conf}' > {private}/fuse.conf",
            f"mount --bind {private}/fuse.conf /etc/fuse.conf",
        ]
    if hide_fusermount:
        for tool in ("fusermount3", "fusermount"):
            found = shutil.which(tool)
            if found:
                steps += [
                    f": > {private}/{tool}",
                    f"chmod 0644 {private}/{tool}",
                    f"mount --bind {private}/{tool} {os.path.realpath(found)}",
                ]
    env = " ".join(f"{k}={v}" for k, v in user.env.items())
    steps.append(
        f'runuser -u {user.name} -- env -i {env} {user.python} -c "$USER_SCRIPT" '
        f"{shlex.quote(str(place.shards))} {target} {place.cache} {' '.join(extra)} "
        "|| status=$?"
    )
    steps.append(f"fusermount3 -u -z {target} 2>/dev/null || true")
    steps.append("exit ${status:-0}")
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "--", "sh", "-ec", "\n".join(steps)],
        env={**os.environ, "USER_SCRIPT": USER_SCRIPT},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if done.returncode != 0 or not done.stdout.strip():
        pytest.fail(f"the run as {user.name} failed ({done.returncode}): {done.stderr}")
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_unprivileged_user_mounts_reads_every_file_and_unmounts(user: User, place: Place) -> None:
    expected = write_shards(place.shards)
    report = run_in_private_namespace(user, place)
    assert report["uid"] == user.uid != 0
    code, stdout, stderr = report["mount"]  # type: ignore[misc]
    assert code == 0, stderr
    assert "mounted" in stdout
    assert report["table"] == ["fuse.shardfs", str(place.shards)]
    assert report["files"] == expected
    assert report["umount"][0] == 0, report["umount"]  # type: ignore[index]
    assert report["mounted_after_umount"] is False
    # The cache and index the user's mount wrote belong to the user.
    owners = {path.stat().st_uid for path in place.cache.rglob("*")}
    assert owners == {user.uid}

"""``fuse.session.serve`` on a real mount: a failure in ``on_ready`` (which runs inside FUSE's
init callback, where an exception would be lost in C) stops the mount and is raised to the
caller, instead of leaving a mount that serves while ``shardfs mount`` waits forever."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from shardfs.mount.table import parse_mountinfo

pytestmark = pytest.mark.integration

SCRIPT = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    sys.path.insert(0, "tests")
    from support.tarbuild import make_tar, store_with
    from shardfs.fuse import session
    from shardfs.config import IndexConfig, MountConfig, ReadConfig, ViewConfig
    from shardfs.core.filesystem import ShardFileSystem
    from shardfs.index.db import IndexBuilder
    from shardfs.read.direct import DirectReader
    from shardfs.stats import Stats
    from shardfs.views.view import View, build_view

    work, mountpoint = Path(sys.argv[1]), Path(sys.argv[2])
    store = store_with({"a.tar": make_tar([("f.txt", b"hello")])})
    index = IndexBuilder(store, IndexConfig(cache_dir=work)).build(store.list_shards())
    build_view(index, work / "view.sqlite", ViewConfig(layout="raw"), lambda _folder: None)
    reader = DirectReader(store, Stats())
    core = ShardFileSystem(View(work / "view.sqlite"), reader, ReadConfig(), Stats())

    def on_ready():
        raise PermissionError("cannot write the pid file")

    try:
        session.serve(core, MountConfig(mountpoint=mountpoint), on_ready)
    except PermissionError as exc:
        print("raised:", exc)
        sys.exit(3)
    print("serve returned without raising")
    """
)


def mounted_at(mountpoint: Path) -> bool:
    table = Path("/proc/self/mountinfo").read_bytes()
    return any(entry.mountpoint == str(mountpoint) for entry in parse_mountinfo(table))


def test_a_failing_on_ready_unmounts_and_raises(tmp_path: Path) -> None:
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    try:
        result = subprocess.run(
            [sys.executable, "-c", SCRIPT, str(tmp_path), str(mountpoint)],
            capture_output=True,
            text=True,
            timeout=60,  # before the fix: the mount served on, and this timed out
            cwd=Path(__file__).resolve().parent.parent,
        )
    finally:
        if mounted_at(mountpoint):
            subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], check=False)
    assert result.returncode == 3, result.stdout + result.stderr
    assert "raised: cannot write the pid file" in result.stdout
    assert not mounted_at(mountpoint)

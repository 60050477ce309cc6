"""Claims of the README and of the reference in docs/ that had no test of their own: the
documented defaults, the exit codes of the Commands table, ``cache clear --all``, reads that
do not queue behind prefetches, and hard links whose target lies in another shard. Each test
names the page and passage."""

from __future__ import annotations

import io
import json
import os
import random
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.mounts import assert_one_error_line, mount, new_bucket, umount, wait_for
from support.processes import is_mounted, run_shardfs, spawn_shardfs, stop_process
from support.s3 import S3Server

from shardfs import cli
from shardfs.commands import _configs
from shardfs.config import CacheConfig, ReadaheadConfig, SourceConfig
from shardfs.mount.control import query

MTIME = 1_700_000_000

# -- the documented defaults (unit) -----------------------------------------------------------


def test_the_defaults_are_the_ones_the_readme_documents(tmp_path: Path) -> None:
    """docs/cache.md "The block cache": --cache-size default 50%, --cache-min-free 1G,
    --block-size 8 MiB, 64 KiB checksummed chunks; "Readahead": --prefetch shard on
    --prefetch-streams 8 threads, --miss-fetch block; "Degrades": --read-timeout 30 s.
    Checked both in the configs and in what the CLI builds from a bare ``mount``."""
    assert (CacheConfig.size, CacheConfig.min_free) == ("50%", 1 << 30)
    assert (CacheConfig.block_size, CacheConfig.chunk_size) == (8 << 20, 64 << 10)
    assert (ReadaheadConfig.prefetch, ReadaheadConfig.streams) == ("shard", 8)
    assert ReadaheadConfig.miss_fetch == "block"
    assert SourceConfig.read_timeout == 30.0

    args = cli.build_parser().parse_args(["mount", "s3://bucket/data/", str(tmp_path)])
    cache = _configs.cache_config(args, tmp_path / "cache")
    assert (cache.size, cache.min_free) == ("50%", 1 << 30)
    assert (cache.block_size, cache.chunk_size) == (8 << 20, 64 << 10)
    readahead = _configs.readahead_config(args)
    assert (readahead.prefetch, readahead.streams, readahead.miss_fetch) == ("shard", 8, "block")
    assert _configs.source_config(args).read_timeout == 30.0


# -- exit codes -------------------------------------------------------------------------------


def test_exit_1_for_an_unexpected_error_in_one_line() -> None:
    """docs/commands.md: 1 = unexpected error (run with -v for a traceback). A command that
    fails with a foreign exception goes through the real ``main`` of a real process."""
    program = (
        "import dataclasses, sys, shardfs.cli as c\n"
        "def broken(args): raise KeyError('no such thing')\n"
        "c._BY_NAME['index'] = dataclasses.replace(c._BY_NAME['index'], run=broken)\n"
        "sys.exit(c.main(sys.argv[1:]))\n"
    )
    quiet = subprocess.run(
        [sys.executable, "-c", program, "index", "/nowhere"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert quiet.returncode == 1
    assert quiet.stderr.splitlines() == [
        "shardfs: unexpected error: KeyError: 'no such thing' (run with -v for details)"
    ]
    loud = subprocess.run(
        [sys.executable, "-c", program, "index", "/nowhere", "-v"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert loud.returncode == 1
    assert "Traceback (most recent call last)" in loud.stderr


def _put(s3_server: S3Server, path: str, data: bytes) -> None:
    s3_server.filesystem().pipe_file(path, data)


def _slow_dataset(s3_server: S3Server, tmp_path: Path, stem: str) -> str:
    """One shard of 64 files in a fresh bucket; its GETs are made slow by the caller."""
    bucket = new_bucket(s3_server, stem)
    buf = io.BytesIO()
    rng = random.Random(5)
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for number in range(64):
            data = rng.randbytes(20_000)
            info = tarfile.TarInfo(f"f{number:02d}.bin")
            info.size, info.mtime = len(data), MTIME
            tar.addfile(info, io.BytesIO(data))
    _put(s3_server, f"{bucket}/data/s-000.tar", buf.getvalue())
    return f"s3://{bucket}/data/"


@pytest.mark.s3
def test_exit_130_when_a_command_is_interrupted(s3_server: S3Server, tmp_path: Path) -> None:
    """docs/commands.md: 130 = interrupted. SIGINT while ``shardfs index`` waits on a slow
    store: one line, no traceback, code 130."""
    source = _slow_dataset(s3_server, tmp_path, "interrupt")
    s3_server.reset_counts()
    # Under the client's 10 s read timeout, so no retry warning joins the one line. The
    # scan's worker finishes its GET before the command returns (measured: it exits once
    # the delayed GET ends, not at once).
    s3_server.delay_gets("s-000.tar", 8.0)
    # spawn_shardfs starts it with SIGINT at its default even where the suite ignores it
    proc = spawn_shardfs("index", source, "--cache-dir", tmp_path / "cache", env=s3_server.env())
    try:
        # This shard's GET, not any GET: one from another test's process still running
        # would send the signal before the scan began.
        shard = source.removeprefix("s3://") + "s-000.tar"
        wait_for(
            lambda: (
                s3_server.counts()["get_object_requests_by_key"].get(shard, 0) > 0
                or proc.poll() is not None
            ),
            "the index scan's GET to reach the server",
        )
        assert proc.poll() is None, proc.communicate()[1]
        before = _sigint_state(proc.pid)
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        _stdout, stderr = proc.communicate(timeout=60)
        print(f"exited {time.monotonic() - sent:.1f} s after SIGINT; when sent: {before}")
    finally:
        s3_server.delay_gets()
        stop_process(proc)
    assert proc.returncode == 130, f"{stderr!r}; SIGINT when sent: {before}"
    assert stderr.splitlines() == ["shardfs: interrupted"]


def _sigint_state(pid: int) -> str:
    """Whether SIGINT is blocked, ignored or caught, in each thread of ``pid`` and in this
    process: a child inherits a blocked mask and an ignored SIGINT through exec."""
    bit = 1 << (signal.SIGINT - 1)
    parts = []
    for task in sorted(Path(f"/proc/{pid}/task").iterdir()):
        try:
            fields = dict(
                line.split(":\t", 1) for line in (task / "status").read_text().splitlines()
            )
        except OSError:
            continue
        flags = [
            key for key in ("SigBlk", "SigIgn", "SigCgt", "SigPnd") if int(fields[key], 16) & bit
        ]
        parts.append(f"{fields['Name'].strip()}:{'+'.join(flags) or 'default'}")
    mine = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    parts.append(f"pytest: handler {signal.getsignal(signal.SIGINT)!r}, blocked {sorted(mine)}")
    return ", ".join(parts)


@pytest.fixture
def local_shards(tmp_path: Path) -> Path:
    folder = tmp_path / "shards"
    folder.mkdir()
    with tarfile.open(folder / "a.tar", "w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in {"x.txt": b"x" * 100, "d/y.txt": b"y" * 200}.items():
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), MTIME
            tar.addfile(info, io.BytesIO(data))
    return folder


@pytest.mark.integration
def test_exit_5_when_umount_finds_the_mount_busy(
    local_shards: Path, mountpoint: Path, tmp_path: Path
) -> None:
    """docs/commands.md: 5 = mountpoint problem ... busy. A process whose working folder is
    inside the mount keeps ``shardfs umount`` from unmounting; ``--lazy`` still does."""
    mount(str(local_shards), mountpoint, tmp_path / "cache", env={})
    holder = subprocess.Popen(
        ["sleep", "600"], cwd=mountpoint / "d", stdout=subprocess.DEVNULL
    )  # a shell parked in a folder of the dataset
    try:
        result = run_shardfs("umount", mountpoint)
        line = assert_one_error_line(result)
        assert result.returncode == 5
        assert "busy" in line and str(mountpoint) in line
        assert is_mounted(mountpoint)
        assert (mountpoint / "x.txt").read_bytes() == b"x" * 100  # still serving
    finally:
        holder.kill()
        holder.wait()
    umount(mountpoint)


def _setpriv() -> str:
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        path = Path(folder, "setpriv")
        if path.exists():
            return str(path)
    pytest.fail("setpriv (util-linux) is needed to drop CAP_SYS_ADMIN", pytrace=False)


@pytest.mark.integration
def test_exit_5_when_fuse_cannot_mount_names_the_cause(
    local_shards: Path, mountpoint: Path, tmp_path: Path
) -> None:
    """docs/commands.md: 5 = ... FUSE failed (with the cause and the fix). The mount runs
    without CAP_SYS_ADMIN in its bounding set (as in a container started without
    --cap-add SYS_ADMIN), so the kernel refuses the mount."""
    if os.geteuid() != 0:
        pytest.fail("this test drops a capability root holds; run it as root", pytrace=False)
    command = [
        _setpriv(),
        "--bounding-set",
        "-sys_admin",
        "--inh-caps",
        "-sys_admin",
        sys.executable,
        "-m",
        "shardfs",
        "mount",
        str(local_shards),
        str(mountpoint),
        "--cache-dir",
        str(tmp_path / "cache"),
        "--layout",
        "raw",  # no "layout: auto" notice beside the error line
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    line = assert_one_error_line(result)
    assert result.returncode == 5, result.stderr
    assert "CAP_SYS_ADMIN" in line and "--cap-add SYS_ADMIN" in line
    assert not is_mounted(mountpoint)


# -- cache clear --all ------------------------------------------------------------------------


def _cache_info(cache_dir: Path) -> dict[str, Any]:
    result = run_shardfs("cache", "info", "--cache-dir", cache_dir, "--json")
    assert result.returncode == 0, result.stderr
    info: dict[str, Any] = json.loads(result.stdout)
    return info


@pytest.mark.integration
def test_cache_clear_drops_blocks_and_with_all_the_indexes_and_views(
    s3_server: S3Server, mountpoint: Path, tmp_path: Path
) -> None:
    """docs/cache.md "The block cache": ``shardfs cache clear [--all]`` drops every block (and with
    ``--all`` the indexes and views). Measured at the server: after a plain clear a remount
    reuses the index (no GET), after ``--all`` it scans every shard again."""
    source = _slow_dataset(s3_server, tmp_path, "clear")
    env, cache = s3_server.env(), tmp_path / "cache"
    quiet = ("--prefetch", "none")

    mount(source, mountpoint, cache, *quiet, env=env)
    umount(mountpoint)
    before = _cache_info(cache)
    assert before["blocks"] > 0 and before["index_files"] > 0 and before["views_files"] > 0

    result = run_shardfs("cache", "clear", "--cache-dir", cache)
    assert result.returncode == 0, result.stderr
    after_clear = _cache_info(cache)
    assert (after_clear["blocks"], after_clear["block_bytes"]) == (0, 0)
    assert after_clear["index_files"] == before["index_files"]
    assert after_clear["views_files"] == before["views_files"]
    s3_server.reset_counts()
    mount(source, mountpoint, cache, *quiet, env=env)
    assert s3_server.counts()["get_object_requests"] == 0  # index and view reused
    umount(mountpoint)

    result = run_shardfs("cache", "clear", "--all", "--cache-dir", cache)
    assert result.returncode == 0, result.stderr
    assert "blocks, indexes and views" in result.stdout
    after_all = _cache_info(cache)
    assert (after_all["blocks"], after_all["index_files"], after_all["views_files"]) == (0, 0, 0)
    s3_server.reset_counts()
    mount(source, mountpoint, cache, *quiet, env=env)
    counts = s3_server.counts()
    size = sum(counts["get_object_bytes_by_key"].values())
    assert counts["get_object_requests"] >= 1 and size > 0  # the shard scanned again
    assert size == _shard_size(s3_server, source)
    umount(mountpoint)


def _shard_size(s3_server: S3Server, source: str) -> int:
    fs = s3_server.filesystem()
    return int(fs.info(source.removeprefix("s3://") + "s-000.tar")["size"])


# -- reads never wait behind queued prefetches, prefetch on -------------------------------------

BLOCK = 256 << 10


@pytest.fixture
def two_shards(s3_server: S3Server, tmp_path: Path) -> Iterator[tuple[str, dict[str, bytes]]]:
    """Shards ``slow-000.tar`` and ``zfast-001.tar``, 12 files of 60-80 KB each (3-4 blocks
    of 256 KiB a shard); a sidecar index, so a mount starts with an empty block cache."""
    bucket = new_bucket(s3_server, "queue")
    rng = random.Random(11)
    files: dict[str, bytes] = {}
    for shard in ("slow-000", "zfast-001"):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for number in range(12):
                name = f"{shard}-{number:02d}.bin"
                files[name] = rng.randbytes(rng.randrange(60_000, 80_000))
                info = tarfile.TarInfo(name)
                info.size, info.mtime = len(files[name]), MTIME
                tar.addfile(info, io.BytesIO(files[name]))
        _put(s3_server, f"{bucket}/data/{shard}.tar", buf.getvalue())
    source = f"s3://{bucket}/data/"
    result = run_shardfs(
        "index", source, "--write-sidecar", "--cache-dir", tmp_path / "c0", env=s3_server.env()
    )
    assert result.returncode == 0, result.stderr
    yield source, files
    s3_server.delay_gets()


def _gets(s3_server: S3Server, shard: str) -> int:
    by_key: dict[str, int] = s3_server.counts()["get_object_requests_by_key"]
    return sum(n for key, n in by_key.items() if key.endswith(f"{shard}.tar"))


@pytest.mark.integration
def test_reads_never_wait_behind_queued_prefetches_with_prefetch_on(
    two_shards: tuple[str, dict[str, bytes]],
    s3_server: S3Server,
    mountpoint: Path,
    tmp_path: Path,
) -> None:
    """docs/cache.md "Readahead": a read that misses fetches its whole block in its own thread;
    reads never wait behind queued prefetches. ``--prefetch all`` on one stream queues
    every block of both shards, the slow shard's first (shards go in name order); its GET
    hangs on the only stream, so the fast shard's blocks stay queued behind it. Every file
    of the fast shard must still be read, right, each block by a read's own GET."""
    source, files = two_shards
    s3_server.delay_gets("slow-000.tar", 20.0)
    try:
        mount(
            source,
            mountpoint,
            tmp_path / "cache",
            "--block-size",
            "256K",
            "--prefetch",
            "all",
            "--prefetch-streams",
            "1",
            "--no-kernel-push",
            env=s3_server.env(),
        )
        # The stream's GET (a run of the slow shard's blocks) hangs: the queue is stuck.
        wait_for(lambda: _gets(s3_server, "slow-000") >= 1, "the stream's GET of slow-000")
        names = sorted(os.listdir(mountpoint))
        assert names == sorted(files)
        fast = [n for n in names if n.startswith("zfast-001")]
        before = _gets(s3_server, "zfast-001")  # the mount's own checks, if any
        for name in random.Random(2).sample(fast, len(fast)):
            assert (mountpoint / name).read_bytes() == files[name], name
        values = query(mountpoint)
        assert values["prefetched_blocks"] == 0, "nothing queued behind the stream ran"
        blocks = -(-_shard_bytes(s3_server, source, "zfast-001") // BLOCK)
        assert _gets(s3_server, "zfast-001") - before == values["cache_misses"] == blocks
    finally:
        s3_server.delay_gets()
    umount(mountpoint)


def _shard_bytes(s3_server: S3Server, source: str, shard: str) -> int:
    fs = s3_server.filesystem()
    return int(fs.info(source.removeprefix("s3://") + f"{shard}.tar")["size"])


# -- hard links across shards ------------------------------------------------------------------


@pytest.mark.integration
def test_a_hard_link_to_a_member_of_another_shard_is_left_out_and_reported(
    mountpoint: Path, tmp_path: Path
) -> None:
    """docs/layouts.md "Safety" says hard links are served as the file they point to; that holds in
    one shard only. A tar hard link names an earlier member of its own archive, so one whose
    target is in another shard is left out, counted in the mount's warnings."""
    folder = tmp_path / "shards"
    folder.mkdir()
    target = b"target bytes" * 100
    with tarfile.open(folder / "a.tar", "w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("t.bin")
        info.size, info.mtime = len(target), MTIME
        tar.addfile(info, io.BytesIO(target))
        link = tarfile.TarInfo("same_shard_link.bin")
        link.type, link.linkname, link.mtime = tarfile.LNKTYPE, "t.bin", MTIME
        tar.addfile(link)
    with tarfile.open(folder / "b.tar", "w", format=tarfile.PAX_FORMAT) as tar:
        link = tarfile.TarInfo("other_shard_link.bin")
        link.type, link.linkname, link.mtime = tarfile.LNKTYPE, "t.bin", MTIME
        tar.addfile(link)
    result = mount(str(folder), mountpoint, tmp_path / "cache", "--layout", "raw", env={})
    assert sorted(os.listdir(mountpoint)) == ["same_shard_link.bin", "t.bin"]
    assert (mountpoint / "same_shard_link.bin").read_bytes() == target
    warnings = [line for line in result.stderr.splitlines() if "warning" in line]
    assert any("1 link(s) left out" in line for line in warnings), result.stderr
    assert any(
        "other_shard_link.bin" in line and "not in the same shard" in line for line in warnings
    ), result.stderr
    umount(mountpoint)

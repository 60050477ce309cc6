"""The daemon process: its threads carry their Python names natively (mount/thread_names.py),
and its open files limit is raised (mount/process_limits.py)."""

from __future__ import annotations

import ast
import resource
import subprocess
import sys
import textwrap

import pytest

from shardfs.fuse import hot_path
from shardfs.mount.thread_names import native_name


def test_a_thread_started_after_install_carries_its_name_cut_to_15_bytes() -> None:
    code = textwrap.dedent(
        """
        import threading
        from shardfs.mount import thread_names
        seen = {}
        def look():
            with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
                seen[threading.current_thread().name] = f.read().strip()
        before = threading.Thread(target=look, name="before-install")
        before.start(); before.join()
        assert thread_names.install()
        for name in ("prefetch-3", "shardfs-a-very-long-thread-name"):
            thread = threading.Thread(target=look, name=name)
            thread.start(); thread.join()
        print(seen)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    seen = ast.literal_eval(out.stdout)  # the dict the child printed
    assert seen["prefetch-3"] == "prefetch-3"
    assert seen["shardfs-a-very-long-thread-name"] == "shardfs-a-very-long-thread-name"[:15]
    assert seen["before-install"] != "before-install"  # only threads started after install


def test_native_names_are_at_most_15_bytes_of_utf8() -> None:
    assert native_name("shardfs-fuse") == b"shardfs-fuse"
    assert native_name("x" * 40) == b"x" * 15
    assert len(native_name("é" * 10)) == 15


def test_the_open_files_limit_is_raised_within_the_hard_limit() -> None:
    code = textwrap.dedent(
        """
        import resource
        from shardfs.mount import process_limits
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        now = process_limits.raise_open_files(4096)
        print(now, resource.getrlimit(resource.RLIMIT_NOFILE)[0], hard)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    now, soft, hard = (int(value) for value in out.stdout.split())
    assert now == soft
    assert soft == (4096 if hard < 0 or hard >= 4096 else hard)


def test_published_blocks_take_at_most_half_the_descriptors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(resource, "getrlimit", lambda kind: (1024, 4096))
    assert hot_path.publish_limit(4096) == 256  # two descriptors each: 512 of 1,024
    assert hot_path.publish_limit(100) == 100
    monkeypatch.setattr(resource, "getrlimit", lambda kind: (resource.RLIM_INFINITY,) * 2)
    assert hot_path.publish_limit(4096) == 4096

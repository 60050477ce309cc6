"""The daemon's threads carry their Python names natively (shardfs/mount/thread_names.py)."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap

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

"""Helpers for the FUSE integration tests: mount through the CLI, compare trees, check errors."""

from __future__ import annotations

import itertools
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from support.processes import is_mounted, run_shardfs
from support.s3 import S3Server

_bucket_numbers = itertools.count()


def new_bucket(server: S3Server, stem: str) -> str:
    """A fresh bucket for one test, so tests sharing the session server never collide."""
    name = f"{stem}-{os.getpid()}-{next(_bucket_numbers)}".lower().replace("_", "-")[:63]
    server.create_bucket(name)
    return name


def mount(
    source: str,
    mountpoint: Path,
    cache_dir: Path,
    *extra: str | os.PathLike[str],
    env: dict[str, str],
) -> subprocess.CompletedProcess[str]:
    """``shardfs mount``; asserts that it succeeded and that the tree is mounted on return."""
    result = run_shardfs("mount", source, mountpoint, "--cache-dir", cache_dir, *extra, env=env)
    assert result.returncode == 0, f"mount failed ({result.returncode}): {result.stderr}"
    assert is_mounted(mountpoint), "shardfs mount returned 0 but nothing is mounted"
    return result


def umount(mountpoint: Path, env: dict[str, str] | None = None) -> None:
    """``shardfs umount``; asserts that it succeeded and left no mount behind."""
    result = run_shardfs("umount", mountpoint, env=env)
    assert result.returncode == 0, f"umount failed ({result.returncode}): {result.stderr}"
    assert not is_mounted(mountpoint)


def assert_one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    """The command failed with exactly one clear line on stderr; return that line."""
    assert result.returncode != 0, f"expected a failure, got 0; stdout: {result.stdout}"
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{result.stderr}"
    assert lines[0].startswith("shardfs: error:"), lines[0]
    return lines[0]


def imagefolder_view(root: Path, **kwargs: Any) -> tuple[list[str], dict[str, int], list[Any]]:
    """torchvision ImageFolder's classes, class_to_idx and samples (paths relative to root)."""
    from torchvision.datasets import ImageFolder

    dataset = ImageFolder(str(root), **kwargs)
    samples = [
        (Path(path).relative_to(root).as_posix(), target) for path, target in dataset.samples
    ]
    return dataset.classes, dataset.class_to_idx, samples


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Poll ``condition`` until it holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    delay = 0.01
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 2, 0.2)


def process_gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie nobody reaped counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def shard_keys(counts: dict[str, Any], key_prefix: str) -> dict[str, int]:
    """``{shard key: GetObject bytes}`` under ``bucket/prefix`` for *.tar keys only."""
    by_key: dict[str, int] = counts["get_object_bytes_by_key"]
    requests: dict[str, int] = counts["get_object_requests_by_key"]
    keys = set(by_key) | set(requests)
    return {
        key: by_key.get(key, 0)
        for key in keys
        if key.startswith(key_prefix) and key.endswith(".tar")
    }


def mount_tmpfs(tmpfs: list[Path], path: Path, size: str) -> None:
    """Mount a tmpfs of ``size`` (``4M``) on ``path``, recorded in the ``tmpfs`` fixture."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    tmpfs.append(path)


def drop_page_cache() -> None:
    """Drop the kernel's clean page cache (root only): files read or pushed through a FUSE
    mount must then come from its daemon again, as when the dataset is larger than RAM."""
    Path("/proc/sys/vm/drop_caches").write_text("1\n")


def drop_inodes() -> None:
    """Drop the kernel's unused dentries and inodes (root only), as memory pressure does: a
    FUSE mount is sent FORGET for each of its inodes the kernel let go of, pages and all."""
    Path("/proc/sys/vm/drop_caches").write_text("2\n")

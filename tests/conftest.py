"""Shared fixtures: a moto S3 server, FUSE mountpoints, and a way to run the CLI."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.processes import (
    is_mounted,
    require_fuse,
    spawned_processes,
    stop_process,
    unmount,
)
from support.s3 import S3Server

# Markers. ``make test-unit`` deselects both, so it needs neither FUSE nor moto.
#   integration: does real FUSE mounts (fails, never skips, where FUSE cannot work);
#   s3: talks to the moto S3 server (a subprocess on a local port), no FUSE needed.
# A test is marked from the fixtures it uses, so a new test cannot be filed wrong; a test
# that starts its own server or mount carries the marker by hand.
_FIXTURE_MARKERS = {"mountpoint": "integration", "s3_server": "s3"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        for fixture, marker in _FIXTURE_MARKERS.items():
            if fixture in used and item.get_closest_marker(marker) is None:
                item.add_marker(marker)


@pytest.fixture(autouse=True)
def _integration_requires_fuse(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("integration") is not None:
        require_fuse()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """One moto S3 server for the session; call ``reset_counts()`` before measuring."""
    with S3Server() as server:
        yield server


@pytest.fixture
def mountpoint(tmp_path: Path) -> Iterator[Path]:
    """An empty directory to mount on; unmounted and its processes ended at teardown."""
    require_fuse()
    path = tmp_path / "mnt"
    path.mkdir()
    try:
        yield path
    finally:
        if is_mounted(path):
            unmount(path)
        for proc in list(spawned_processes):
            if isinstance(proc.args, list) and str(path) in proc.args:
                stop_process(proc)
                spawned_processes.remove(proc)


@pytest.fixture(scope="session", autouse=True)
def _stop_leftover_processes() -> Iterator[None]:
    yield
    while spawned_processes:
        stop_process(spawned_processes.pop())


@pytest.fixture
def tmpfs() -> Iterator[list[Path]]:
    """Folders a test mounts a tmpfs on (``support.mounts.mount_tmpfs``); unmounted at
    teardown, lazily, however many times each was mounted."""
    paths: list[Path] = []
    yield paths
    for path in reversed(paths):
        while os.path.ismount(path):
            subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)

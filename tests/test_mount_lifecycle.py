"""``Mount`` starts and stops a mount in one documented order.

The unit tests build real parts (block cache, dataset over a folder of tar shards,
prefetcher, reader, core, control socket) with a stand-in for the FUSE session, and make
each build step fail in turn: what was built so far is closed once, in ``STOP_ORDER``, and
nothing else. The integration test serves a real FUSE mount and records the order in which
the real parts stop."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.mounts import wait_for
from support.tarbuild import make_tar

import shardfs.mount.lifecycle as mount_module
from shardfs.config import (
    CacheConfig,
    IndexConfig,
    MountConfig,
    ReadaheadConfig,
    ReadConfig,
    SourceConfig,
    ViewConfig,
)
from shardfs.mount.control import socket_path
from shardfs.mount.daemon import ReadyChannel
from shardfs.mount.lifecycle import STOP_ORDER, Mount, MountSettings
from shardfs.read.reader import CachedReader
from shardfs.stats import Stats

SHARDS = {
    f"s{n}.tar": make_tar([(f"d{n}/{i}.bin", bytes([n * 10 + i]) * (3000 + i)) for i in range(4)])
    for n in range(3)
}
BUILD_STEPS = ("cache", "dataset", "prefetcher", "reader", "core", "control", "session", "mount")
"""Where start can fail: each part's constructor, then the session's start (the mount)."""
CLOSABLE = ("session", "control", "prefetcher", "cache", "dataset")
"""Parts that hold something to release (the reader and the core hold nothing of their own)."""


class Injected(Exception):
    """The failure a test puts into one build step."""


def settings_for(tmp_path: Path, prefetch: str = "all") -> MountSettings:
    shards = tmp_path / "shards"
    shards.mkdir(exist_ok=True)
    for name, data in SHARDS.items():
        (shards / name).write_bytes(data)
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir(exist_ok=True)
    cache_dir = tmp_path / "cache"
    return MountSettings(
        source=SourceConfig(str(shards)),
        index=IndexConfig(cache_dir=cache_dir),
        view=ViewConfig(layout="raw"),
        mount=MountConfig(mountpoint=mountpoint),
        read=ReadConfig(),
        cache=CacheConfig(
            cache_dir=cache_dir, size="64M", min_free=0, block_size=8192, chunk_size=4096
        ),
        readahead=ReadaheadConfig(prefetch=prefetch, streams=2),  # type: ignore[arg-type]
    )


class Recorder:
    """Wraps the constructors ``shardfs.mount.lifecycle`` uses: records each part built and each
    close, and raises ``Injected`` at the step named by ``fail_at``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail_at: str | None = None) -> None:
        self.events: list[tuple[str, str]] = []
        self.fail_at = fail_at
        for step, name in [
            ("cache", "BlockCache"),
            ("dataset", "open_source"),
            ("prefetcher", "Prefetcher"),
            ("reader", "CachedReader"),
            ("core", "ShardFileSystem"),
            ("control", "ControlServer"),
        ]:
            monkeypatch.setattr(mount_module, name, self.wrap(step, getattr(mount_module, name)))
        monkeypatch.setattr(mount_module, "FuseSession", self.fake_session())

    def wrap(self, step: str, real: Any) -> Any:
        """``real`` (a class, or a function that returns the part) that records and fails."""
        recorder = self
        if not isinstance(real, type):

            def build(*args: Any, **kwargs: Any) -> Any:
                if recorder.fail_at == step:
                    raise Injected(step)
                part = real(*args, **kwargs)
                recorder.events.append(("built", step))
                close = part.close

                def counted() -> None:
                    recorder.events.append(("closed", step))
                    close()

                part.close = counted
                return part

            return build

        class Recorded(real):  # type: ignore[misc, valid-type]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                if recorder.fail_at == step:
                    raise Injected(step)
                super().__init__(*args, **kwargs)
                recorder.events.append(("built", step))

        if hasattr(real, "close"):

            def close(part: Any, *args: Any, **kwargs: Any) -> Any:
                recorder.events.append(("closed", step))
                return real.close(part, *args, **kwargs)

            Recorded.close = close
        return Recorded

    def fake_session(self) -> type:
        recorder = self

        class FakeSession:
            """Stands in for FuseSession: ``start`` calls ``on_ready`` as the kernel's
            init would, ``wait`` returns at once."""

            def __init__(self, core: Any, config: Any, on_ready: Callable[[], None], **_: Any):
                if recorder.fail_at == "session":
                    raise Injected("session")
                recorder.events.append(("built", "session"))
                self.on_ready = on_ready

            def start(self) -> None:
                if recorder.fail_at == "mount":
                    raise Injected("mount")
                recorder.events.append(("built", "mount"))
                self.on_ready()

            def wait(self) -> None:
                pass

            def stop(self) -> None:
                recorder.events.append(("closed", "session"))

        return FakeSession

    def built(self) -> list[str]:
        return [step for kind, step in self.events if kind == "built"]

    def closed(self) -> list[str]:
        return [step for kind, step in self.events if kind == "closed"]


@pytest.fixture
def no_thread_left() -> Iterator[None]:
    """Every thread a test's mount started has ended when the test ends."""
    before = set(threading.enumerate())
    yield
    left = [t.name for t in set(threading.enumerate()) - before if t.is_alive()]
    assert not left, f"threads still running: {left}"


@pytest.mark.parametrize("fail_at", BUILD_STEPS)
def test_a_failed_start_closes_exactly_what_was_built(
    fail_at: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_thread_left: None
) -> None:
    recorder = Recorder(monkeypatch, fail_at)
    mount = Mount(settings_for(tmp_path), Stats(), ReadyChannel(None), None)
    with pytest.raises(Injected, match=fail_at):
        mount.start()
    built = recorder.built()
    assert built == list(BUILD_STEPS[: BUILD_STEPS.index(fail_at)])
    assert recorder.closed() == [step for step in STOP_ORDER if step in built and step in CLOSABLE]
    mount.stop()  # again: nothing is closed twice
    assert sorted(recorder.closed()) == sorted(set(recorder.closed()))
    assert not socket_path(tmp_path / "mnt").exists()


def test_a_whole_mount_stops_in_the_documented_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_thread_left: None
) -> None:
    recorder = Recorder(monkeypatch)
    settings = settings_for(tmp_path)
    mount = Mount(settings, Stats(), ReadyChannel(None), None)
    mount.serve()
    assert recorder.built() == list(BUILD_STEPS)
    assert recorder.closed() == list(CLOSABLE)
    assert list(CLOSABLE) == [step for step in STOP_ORDER if step in CLOSABLE]
    mount.stop()
    assert recorder.closed() == list(CLOSABLE)


def test_stop_cancels_and_joins_the_prefetch_all_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_thread_left: None
) -> None:
    """``--prefetch all`` queues shard after shard on a thread of the mount's: stop ends it
    between shards and joins it, before the prefetcher and the cache close."""
    recorder = Recorder(monkeypatch)
    entered, release = threading.Event(), threading.Event()
    queued: list[str] = []
    real_read_ahead = CachedReader.read_ahead

    def read_ahead(reader: CachedReader, shard: Any, after: int = -1) -> int:
        queued.append(shard.name)
        entered.set()
        release.wait(30)
        return real_read_ahead(reader, shard, after)

    monkeypatch.setattr(CachedReader, "read_ahead", read_ahead)
    mount = Mount(settings_for(tmp_path), Stats(), ReadyChannel(None), None)
    mount.start()
    assert entered.wait(30)
    stopper = threading.Thread(target=mount.stop)
    stopper.start()
    # stop has closed the session and the control socket and now waits for the thread.
    wait_for(lambda: ("closed", "control") in recorder.events, "stop to reach the threads")
    assert ("closed", "prefetcher") not in recorder.events
    release.set()
    stopper.join(30)
    assert not stopper.is_alive()
    assert queued == ["s0.tar"]  # the other two shards were never queued
    assert recorder.closed() == list(CLOSABLE)


def test_stop_waits_for_fills_before_it_closes_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_thread_left: None
) -> None:
    """A fill holds a block claim and open block files: the cache closes after it ends."""
    recorder = Recorder(monkeypatch)
    mount = Mount(settings_for(tmp_path, prefetch="shard"), Stats(), ReadyChannel(None), None)
    mount.start()
    assert mount.prefetcher is not None
    running, release = threading.Event(), threading.Event()

    def fill() -> None:
        running.set()
        release.wait(30)
        recorder.events.append(("fill", "done"))

    mount.prefetcher.run_soon(fill)
    assert running.wait(30)
    stopper = threading.Thread(target=mount.stop)
    stopper.start()
    wait_for(lambda: ("closed", "prefetcher") in recorder.events, "stop to close the prefetcher")
    assert ("closed", "cache") not in recorder.events
    release.set()
    stopper.join(30)
    assert recorder.events[-3:] == [("fill", "done"), ("closed", "cache"), ("closed", "dataset")]


def test_a_fill_that_outlives_the_grace_leaves_the_cache_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Closing the cache under a running fill would let it use closed files: the cache is
    left to the process's exit instead, and the log says so."""
    recorder = Recorder(monkeypatch)
    monkeypatch.setattr(mount_module, "FILLS_GRACE", 0.2)
    mount = Mount(settings_for(tmp_path, prefetch="shard"), Stats(), ReadyChannel(None), None)
    mount.start()
    assert mount.prefetcher is not None
    running, release = threading.Event(), threading.Event()
    mount.prefetcher.run_soon(lambda: (running.set(), release.wait(30)))
    assert running.wait(30)
    try:
        mount.stop()
    finally:
        release.set()
    assert "background fetches still running" in caplog.text
    assert recorder.closed() == ["session", "control", "prefetcher", "dataset"]
    assert mount.cache is not None
    mount.cache.close()  # what the process's exit would release
    wait_for(lambda: mount.prefetcher is not None and mount.prefetcher.pending == 0, "the fill")


def test_mount_takes_stats_from_its_owner(tmp_path: Path) -> None:
    """One Stats per mount, made by whoever runs it: none is made here on the quiet."""
    with pytest.raises(TypeError, match="stats"):
        Mount(settings_for(tmp_path), channel=ReadyChannel(None), progress=None)  # type: ignore[call-arg]


# --- a real FUSE mount ---------------------------------------------------------------------

SCRIPT = textwrap.dedent(
    """
    import hashlib, json, subprocess, sys, threading
    from pathlib import Path
    sys.path.insert(0, "tests")
    from support.mounts import wait_for
    from test_mount_lifecycle import settings_for
    from shardfs.cache import BlockCache
    from shardfs.mount.control import ControlServer
    from shardfs.mount.daemon import ReadyChannel
    from shardfs.dataset import OpenedSource
    from shardfs.fuse import binding, session
    from shardfs.fuse.operations import FuseOperations
    from shardfs.fuse.pushes import KernelPusher
    from shardfs.mount.lifecycle import Mount
    from shardfs.read.readahead import Prefetcher
    from shardfs.stats import Stats

    events = []

    def record(cls, attr, name):
        real = getattr(cls, attr)

        def wrapped(self, *args, **kwargs):
            events.append(name)
            return real(self, *args, **kwargs)

        setattr(cls, attr, wrapped)

    for cls, attr, name in [
        (KernelPusher, "stop", "pusher"),
        (session._LoopThread, "stop", "loop"),
        (FuseOperations, "close", "workers"),
        (binding.Session, "close", "unmount"),
        (ControlServer, "close", "control"),
        (Prefetcher, "close", "prefetcher"),
        (BlockCache, "close", "cache"),
        (OpenedSource, "close", "dataset"),
    ]:
        record(cls, attr, name)

    settings = settings_for(Path(sys.argv[1]))
    mountpoint = settings.mount.mountpoint
    digests = {}

    def use_then_unmount():
        target = mountpoint / "d1" / "2.bin"
        wait_for(target.exists, "the mount")
        digests["d1/2.bin"] = hashlib.sha256(target.read_bytes()).hexdigest()
        subprocess.run(["fusermount3", "-u", str(mountpoint)], check=True)

    user = threading.Thread(target=use_then_unmount)
    user.start()
    Mount(settings, Stats(), ReadyChannel(None), None).serve()
    user.join()
    alive = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    print(json.dumps({"events": events, "digests": digests, "threads": alive}))
    """
)


def mounted_at(mountpoint: Path) -> bool:
    return any(
        line.split()[4] == str(mountpoint)
        for line in Path("/proc/self/mountinfo").read_text().splitlines()
    )


@pytest.mark.integration
def test_a_real_mount_stops_in_the_documented_order(tmp_path: Path) -> None:
    mountpoint = tmp_path / "mnt"
    try:
        result = subprocess.run(
            [sys.executable, "-c", SCRIPT, str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=Path(__file__).resolve().parent.parent,
        )
    finally:
        if mounted_at(mountpoint):
            subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], check=False)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.splitlines()[-1])
    expected = hashlib.sha256(bytes([12]) * 3002).hexdigest()
    assert report["digests"] == {"d1/2.bin": expected}
    assert report["events"] == [
        "pusher",
        "loop",
        "workers",
        "unmount",
        "control",
        "prefetcher",
        "cache",
        "dataset",
    ]
    # No thread of the mount outlives it: prefetch streams, pusher, loop, workers, control.
    assert not [name for name in report["threads"] if "fsspec" not in name], report["threads"]
    assert not mounted_at(mountpoint)

"""Real mounts read through the fault proxy: the store misbehaves, the reader never sees a
wrong byte.

Every case mounts a small dataset (~2.3 MB, 3 GNU tar shards, 256 KiB blocks, fresh cache
folder) with ``--endpoint-url`` pointing at ``support.fault_proxy``, reads every file in
several threads and compares each file's SHA-256 with the source. A fault is scoped to
one request kind:

- ``scan``: the index scan's GETs during ``shardfs mount --no-sidecar`` (phase "scan");
- ``fast``: the presigned GETs of the read path (the mount starts from the sidecar, so
  every file's bytes are fetched after the mount);
- ``fallback``: s3fs's ranged GETs of the read path; presigned GETs are refused with 403
  for the whole case, as by a store that does not take presigned URLs, so shardfs falls
  back to s3fs.

Expected: transient faults cost nothing but time; a shard replaced or deleted after the
mount fails reads of what is not cached with ESTALE or EIO and never returns the other
version's bytes; a store that never answers fails a read with EIO within the read deadline
(``--read-timeout``) plus 5 s; and, without faults, no byte is fetched twice.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import hashlib
import os
import random
import signal
import tarfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from support.datagen import FIXED_MTIME, pack_with_gnu_tar
from support.fault_proxy import FaultProxy, delete_object, other_version, replace_object
from support.mounts import new_bucket, wait_for
from support.processes import is_mounted, run_shardfs, unmount
from support.s3 import S3Server

from shardfs.mount.control import pid_file

pytestmark = pytest.mark.integration

N_FILES = 45
BLOCK_SIZE = "256K"
READ_TIMEOUT = 5.0
THREADS = 4
READ_DEADLINE = 90.0  # a whole tree read; far above what any case needs when it works
CHANGED_ERRNOS = {errno.ESTALE, errno.EIO}


@dataclass(frozen=True)
class Dataset:
    bucket: str
    prefix: str
    sha: dict[str, str]  # member path -> SHA-256 of its bytes
    shard_of: dict[str, str]  # member path -> shard key ("bucket/prefix/shard-....tar")
    shards: dict[str, bytes]  # shard key -> its bytes
    payload: dict[str, list[tuple[int, int]]]  # shard key -> member data spans

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}/"


@pytest.fixture(scope="module")
def dataset(s3_server: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Dataset:
    """45 random files of 30-70 KB in 3 shards, with a sidecar index next to them."""
    base = tmp_path_factory.mktemp("faults")
    src = base / "src"
    rng = random.Random(9)
    sha = {}
    for number in range(N_FILES):
        rel = f"class_{number % 3}/file_{number:03d}.bin"
        path = src / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        data = rng.randbytes(rng.randrange(30_000, 70_000))
        path.write_bytes(data)
        os.utime(path, (FIXED_MTIME, FIXED_MTIME))
        sha[rel] = hashlib.sha256(data).hexdigest()
    shard_paths = pack_with_gnu_tar(src, base / "shards", files_per_shard=15)
    bucket = new_bucket(s3_server, "faults")
    prefix = "train"
    s3_server.upload_dir(base / "shards", f"{bucket}/{prefix}")
    shard_of, shards, payload = {}, {}, {}
    for shard in shard_paths:
        key = f"{bucket}/{prefix}/{shard.name}"
        shards[key] = shard.read_bytes()
        with tarfile.open(shard) as tar:
            members = [m for m in tar.getmembers() if m.isfile()]
        payload[key] = [(m.offset_data, m.offset_data + m.size) for m in members]
        shard_of.update({m.name: key for m in members})
    assert set(shard_of) == set(sha) and len(shards) == 3
    result = run_shardfs(
        "index",
        f"s3://{bucket}/{prefix}/",
        "--write-sidecar",
        "--cache-dir",
        base / "index",
        env=s3_server.env(),
    )
    assert result.returncode == 0, result.stderr
    return Dataset(bucket, prefix, sha, shard_of, shards, payload)


@pytest.fixture
def proxy(s3_server: S3Server) -> Iterator[FaultProxy]:
    with FaultProxy(s3_server) as running:
        yield running


class Mount:
    """One mount through the proxy; ``close()`` unmounts, and kills a daemon that hangs."""

    def __init__(self, mountpoint: Path, cache_dir: Path, proxy: FaultProxy) -> None:
        self.mountpoint = mountpoint
        self.cache_dir = cache_dir
        self.proxy = proxy
        self.result: Any = None

    def mount(self, url: str, *extra: str) -> Any:
        self.result = run_shardfs(
            "mount",
            url,
            self.mountpoint,
            "--cache-dir",
            self.cache_dir,
            "--endpoint-url",
            self.proxy.endpoint,
            "--block-size",
            BLOCK_SIZE,
            *extra,
            env=self.proxy.env(),
        )
        return self.result

    def daemon_pid(self) -> int | None:
        with contextlib.suppress(OSError, ValueError):
            return int(pid_file(self.mountpoint).read_text().split()[0])
        return None

    def close(self) -> None:
        if not is_mounted(self.mountpoint):
            return
        pid = self.daemon_pid()
        self.proxy.remove()  # let black-holed requests go
        result = run_shardfs("umount", self.mountpoint, timeout=30)
        if result.returncode != 0 or is_mounted(self.mountpoint):
            unmount(self.mountpoint)
            if pid is not None:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)


@pytest.fixture
def mounted(tmp_path: Path, proxy: FaultProxy) -> Iterator[Mount]:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    handle = Mount(mnt, tmp_path / "cache", proxy)
    try:
        yield handle
    finally:
        handle.close()


def read_tree(root: Path, files: list[str], seed: int = 0) -> dict[str, str | int]:
    """SHA-256 of every file, or the errno its read failed with; ``THREADS`` readers in a
    random order. Fails (rather than hangs) if the reads do not end in READ_DEADLINE."""
    order = sorted(files)
    random.Random(seed).shuffle(order)

    def one(rel: str) -> str | int:
        try:
            with open(root / rel, "rb") as f:
                return hashlib.sha256(f.read()).hexdigest()
        except OSError as exc:
            return exc.errno or -1

    pool = concurrent.futures.ThreadPoolExecutor(THREADS)
    futures = {rel: pool.submit(one, rel) for rel in order}
    _, pending = concurrent.futures.wait(futures.values(), timeout=READ_DEADLINE)
    pool.shutdown(wait=False, cancel_futures=True)
    assert not pending, f"{len(pending)} of {len(files)} reads hung for {READ_DEADLINE}s"
    return {rel: future.result() for rel, future in futures.items()}


def wrong_bytes(data: Dataset, results: dict[str, str | int]) -> list[str]:
    return sorted(r for r, got in results.items() if isinstance(got, str) and got != data.sha[r])


def failed(results: dict[str, str | int]) -> dict[str, str]:
    return {
        r: errno.errorcode.get(got, str(got)) for r, got in results.items() if isinstance(got, int)
    }


def start(mount: Mount, data: Dataset, scope: str) -> None:
    """Mount for ``scope``: scan mounts scan (faults armed by the caller), the others start
    from the sidecar; fallback refuses presigned GETs for the whole case."""
    proxy = mount.proxy
    if scope == "fallback":
        proxy.add("status", status=403, times=None, on="fast")
    if scope == "scan":
        proxy.set_phase("scan")
        result = mount.mount(data.url, "--no-sidecar")
        proxy.set_phase("read")
    else:
        result = mount.mount(data.url)
    assert result.returncode == 0, f"mount failed ({result.returncode}): {result.stderr}"
    assert is_mounted(mount.mountpoint)


# -- transient faults: every read succeeds with the right bytes -------------------------------

TRANSIENT: dict[str, dict[str, Any]] = {
    "http500": {"fault": "status", "status": 500},
    "http503": {"fault": "status", "status": 503},
    "http429": {"fault": "status", "status": 429},
    "reset": {"fault": "reset", "fraction": 0.5},
    "truncated": {"fault": "truncate", "fraction": 0.5},
    "short206": {"fault": "short_206", "fraction": 0.5},
    "long206": {"fault": "long_206", "shift": 4096},
    "shifted-range": {"fault": "shifted_range", "shift": 4096},
    "wrong-content-range": {"fault": "wrong_content_range", "shift": 4096},
    "stall-headers": {"fault": "stall", "seconds": 1.0, "where": "headers"},
    "stall-body": {"fault": "stall", "seconds": 1.0, "where": "body"},
}
SCOPES = ("scan", "fast", "fallback")


@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("name", sorted(TRANSIENT))
def test_transient_fault_costs_only_time(
    name: str, scope: str, dataset: Dataset, proxy: FaultProxy, mounted: Mount
) -> None:
    spec = dict(TRANSIENT[name])
    if spec["fault"] != "stall":  # every GET meets the fault once; its retry gets through
        spec.update(times=None, per_range=True)
    rule_id = proxy.add(spec.pop("fault"), key=".tar", on=scope, **{"times": 2, **spec})
    start(mounted, dataset, scope)

    results = read_tree(mounted.mountpoint, list(dataset.sha))

    rule = proxy.rule(rule_id)
    assert rule is not None and rule.injected >= 1, f"the {name} fault never hit a {scope} GET"
    assert wrong_bytes(dataset, results) == [], "files read back with wrong bytes"
    assert failed(results) == {}, "reads failed under a transient fault"


# -- faults that look like a changed shard: no wrong bytes, only ESTALE or EIO --------------

SUSPECT: dict[str, dict[str, Any]] = {
    "http404": {"fault": "status", "status": 404},
    "other-etag": {"fault": "etag"},
}


@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("name", sorted(SUSPECT))
def test_fault_that_looks_like_a_change_never_gives_wrong_bytes(
    name: str, scope: str, dataset: Dataset, proxy: FaultProxy, mounted: Mount
) -> None:
    spec = dict(SUSPECT[name])
    rule_id = proxy.add(spec.pop("fault"), key=".tar", on=scope, times=2, **spec)
    if scope == "fallback":
        proxy.add("status", status=403, times=None, on="fast")
    if scope == "scan":
        proxy.set_phase("scan")
        result = mounted.mount(dataset.url, "--no-sidecar")
        proxy.set_phase("read")
        if result.returncode != 0:  # refusing to mount is a fine answer: one clear line
            assert "Traceback" not in result.stderr
            assert result.stderr.strip().startswith("shardfs: error:"), result.stderr
            return
    else:
        result = mounted.mount(dataset.url)
        assert result.returncode == 0, result.stderr

    results = read_tree(mounted.mountpoint, list(dataset.sha))

    rule = proxy.rule(rule_id)
    assert rule is not None and rule.injected >= 1, f"the {name} fault never hit a {scope} GET"
    assert wrong_bytes(dataset, results) == []
    unexpected = {r: e for r, e in failed(results).items() if e not in ("ESTALE", "EIO")}
    assert unexpected == {}, "reads failed with something other than ESTALE or EIO"


# -- the shard changes in the store after the mount --------------------------------------------

CHANGES = ("replaced-same-size", "replaced-grown", "deleted")


@pytest.mark.parametrize("scope", ("fast", "fallback"))
@pytest.mark.parametrize("change", CHANGES)
def test_shard_changed_after_mount_fails_never_mixes_versions(
    change: str,
    scope: str,
    dataset: Dataset,
    s3_server: S3Server,
    proxy: FaultProxy,
    mounted: Mount,
) -> None:
    start(mounted, dataset, scope)
    victim = sorted(dataset.shards)[1]
    original = dataset.shards[victim]
    try:
        if change == "deleted":
            delete_object(s3_server, victim)
        else:
            grow = 0 if change == "replaced-same-size" else 10_240
            replace_object(
                s3_server, victim, other_version(original, dataset.payload[victim], grow)
            )

        results = read_tree(mounted.mountpoint, list(dataset.sha))
    finally:
        replace_object(s3_server, victim, original)  # as it was, for the next cases

    assert wrong_bytes(dataset, results) == [], "bytes of the other version were served"
    in_victim = {r for r in dataset.sha if dataset.shard_of[r] == victim}
    errors = failed(results)
    assert set(errors) == in_victim, "exactly the files of the changed shard fail"
    assert set(errors.values()) <= {"ESTALE", "EIO"}, errors


# -- a store that never answers --------------------------------------------------------------


@pytest.mark.parametrize("scope", ("fast", "fallback"))
def test_black_hole_fails_a_read_within_the_deadline(
    scope: str, dataset: Dataset, proxy: FaultProxy, mounted: Mount
) -> None:
    if scope == "fallback":
        proxy.add("status", status=403, times=None, on="fast")
    result = mounted.mount(dataset.url, "--read-timeout", str(int(READ_TIMEOUT)))
    assert result.returncode == 0, f"mount failed ({result.returncode}): {result.stderr}"
    hole = proxy.add("blackhole", key=".tar", on=scope, times=None)
    target = sorted(dataset.sha)[0]
    outcome: list[int | str] = []

    def read() -> None:
        try:
            outcome.append(hashlib.sha256((mounted.mountpoint / target).read_bytes()).hexdigest())
        except OSError as exc:
            outcome.append(exc.errno or -1)

    began = time.monotonic()
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(READ_TIMEOUT + 5 + 20)
    elapsed = time.monotonic() - began
    assert outcome, f"the read still hangs after {elapsed:.0f}s"
    assert outcome == [errno.EIO], f"expected EIO, got {outcome}"
    assert elapsed <= READ_TIMEOUT + 5, f"EIO came after {elapsed:.1f}s"

    proxy.remove(hole)  # the store answers again: so do the reads (a failed block is held
    # failed for about a second, for the kernel's immediate retry of a failed readahead)
    wait_for(lambda: _reads(mounted.mountpoint / target), "the first read after the outage")
    results = read_tree(mounted.mountpoint, list(dataset.sha))
    assert wrong_bytes(dataset, results) == [] and failed(results) == {}


def _reads(path: Path) -> bool:
    try:
        path.read_bytes()
    except OSError:
        return False
    return True


# -- without faults nothing is fetched twice -----------------------------------------------------


@pytest.mark.parametrize("scope", SCOPES)
def test_without_faults_each_byte_is_fetched_once(
    scope: str, dataset: Dataset, s3_server: S3Server, proxy: FaultProxy, mounted: Mount
) -> None:
    s3_server.reset_counts()
    start(mounted, dataset, scope)
    results = read_tree(mounted.mountpoint, list(dataset.sha))
    assert wrong_bytes(dataset, results) == [] and failed(results) == {}

    sizes = {key: len(data) for key, data in dataset.shards.items()}

    def fetched() -> dict[str, int]:
        by_key: dict[str, int] = s3_server.counts()["get_object_bytes_by_key"]
        return {key: by_key.get(key, 0) for key in sizes}

    # Background readahead may still be completing the last blocks; it must end at one copy.
    deadline = time.monotonic() + 30
    while (
        fetched() != sizes
        and time.monotonic() < deadline
        and all(fetched()[k] <= sizes[k] for k in sizes)
    ):
        time.sleep(0.05)
    assert fetched() == sizes, "each shard's bytes should come from the store exactly once"
    refusals = {"status"} if scope == "fallback" else set()  # the 403s to presigned GETs
    assert set(proxy.counts()["injected"]) <= refusals
    assert proxy.counts()["requests_by_kind"].get(scope, 0) > 0, f"no {scope} GET was made"

"""The newcomer check of issue 19: what a new user meets in a first hour, run as they would run
it, with the installed ``shardfs`` command, real FUSE mounts and real servers.

Each check prints PASS or FAIL with what it saw; the script exits 1 if any fails. The checks:
the seven samples of the collision shards under ImageFolder, byte for byte; ``stats`` against
the server's own byte count after a first mount, on a server that ignores Range
(``python -m http.server``); a folder URL on a dead port; an ``-o`` typo; ``mount.shardfs
--help``; ``pack`` into its own source; a missing mountpoint; the mount table; a
``.tar.bz2`` (of the compressed tars, only gzip's are shards).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

BIN = Path(sys.executable).parent
SHARDFS = str(BIN / "shardfs")
RESULTS: list[tuple[str, bool, str]] = []
# The seven samples: keys that hold a folder, a shared basename, and dots.
SAMPLES = [("x/s1", "png", 0), ("y/s1", "png", 1), ("s3", "v2.png", 2), ("k4", "png", 0)]
SAMPLES += [("a.b/c", "png", 1), ("d.e/f.g/h", "png", 2), ("m", "tar.png", 0)]


def run(*args: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(args), capture_output=True, text=True, timeout=120, check=False, **kwargs
    )  # type: ignore[call-overload]


def check(name: str) -> Callable[[Callable[[Path], str]], Callable[[Path], None]]:
    """Record a check: the function returns what it saw, or raises AssertionError."""

    def wrap(function: Callable[[Path], str]) -> Callable[[Path], None]:
        def runner(work: Path) -> None:
            folder = work / function.__name__
            folder.mkdir()
            try:
                seen = function(folder)
                RESULTS.append((name, True, seen))
            except AssertionError as exc:
                RESULTS.append((name, False, str(exc)))
            finally:
                for mnt in folder.glob("mnt*"):
                    if os.path.ismount(mnt):
                        run(SHARDFS, "umount", str(mnt))

        return runner

    return wrap


def png(seed: str) -> bytes:
    from PIL import Image

    rng = random.Random(seed)
    buf = io.BytesIO()
    Image.frombytes("RGB", (8, 6), rng.randbytes(8 * 6 * 3)).save(buf, "PNG")
    return buf.getvalue()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@check("the 7 samples of the collision shards, all presented, byte-identical, under ImageFolder")
def collision_shards(folder: Path) -> str:
    import webdataset as wds
    from torchvision.datasets import ImageFolder

    shards = folder / "shards"
    shards.mkdir()
    expected: dict[int, list[str]] = {}
    for number, chunk in enumerate((SAMPLES[:4], SAMPLES[4:])):
        with wds.TarWriter(str(shards / f"shard-{number:06d}.tar")) as sink:
            for key, ext, label in chunk:
                data = png(key)
                first = ext.rsplit(".", 1)[0] if "." in ext else None
                label_ext = f"{first}.cls" if first else "cls"
                sink.write({"__key__": key, ext: data, label_ext: str(label)})
                expected.setdefault(label, []).append(sha(data))
    (shards / "classes.txt").write_text("cat\ndog\neel\n")
    mnt = folder / "mnt"
    mnt.mkdir()
    result = run(SHARDFS, "mount", str(shards), str(mnt), "--cache-dir", str(folder / "cache"))
    assert result.returncode == 0, result.stderr
    dataset = ImageFolder(str(mnt))
    got: dict[int, list[str]] = {}
    for path, target in dataset.samples:
        got.setdefault(target, []).append(sha(Path(path).read_bytes()))
    assert len(dataset) == 7, f"ImageFolder found {len(dataset)} samples"
    assert {k: sorted(v) for k, v in got.items()} == {k: sorted(v) for k, v in expected.items()}
    return f"7 of 7 samples, every SHA-256 equal; {result.stdout.strip()}"


class _CountingHandler(SimpleHTTPRequestHandler):
    """``python -m http.server``'s own handler (it ignores Range), counting bytes sent."""

    sent = 0
    lock = threading.Lock()

    def copyfile(self, source, outputfile):  # type: ignore[no-untyped-def]
        data = source.read()
        with self.lock:
            type(self).sent += len(data)
        outputfile.write(data)

    def log_message(self, format: str, *args: object) -> None:
        pass


@contextlib.contextmanager
def http_server(root: Path) -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(_CountingHandler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def stats_bytes(mnt: Path) -> int:
    result = run(SHARDFS, "stats", str(mnt), "--json")
    assert result.returncode == 0, result.stderr
    import json

    return int(json.loads(result.stdout)["bytes_fetched"])


@check("stats within 5 % of the server after a first mount, on a server that ignores Range")
def stats_agree(folder: Path) -> str:
    import tarfile

    shards = folder / "shards"
    shards.mkdir()
    rng = random.Random(0)
    for number in range(3):
        with tarfile.open(shards / f"s-{number}.tar", "w") as tar:
            for index in range(20):
                data = rng.randbytes(20_000)
                info = tarfile.TarInfo(f"d{number}/f{index}.bin")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    lines = []
    for cache in ("--no-cache", "cache"):
        _CountingHandler.sent = 0
        mnt = folder / f"mnt{len(lines)}"
        mnt.mkdir()
        with http_server(shards) as url:
            extra = ["--no-cache"] if cache == "--no-cache" else []
            cache_dir = str(folder / f"cache{len(lines)}")  # fresh: the mount scans
            result = run(SHARDFS, "mount", f"{url}/", str(mnt), *extra, "--cache-dir", cache_dir)
            assert result.returncode == 0, result.stderr
            for path in sorted(mnt.rglob("*.bin")):
                path.read_bytes()
            ours = stats_bytes(mnt)
            theirs = _CountingHandler.sent
            run(SHARDFS, "umount", str(mnt))
        assert theirs > 0
        ratio = ours / theirs
        assert abs(ratio - 1) <= 0.05, f"{cache}: stats {ours} B, server {theirs} B"
        lines.append(f"{cache}: stats {ours:,} B, server {theirs:,} B ({ratio:.3f})")
    return "; ".join(lines)


def one_error_line(result: subprocess.CompletedProcess[str], *parts: str) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode != 0, f"exit 0: {result.stdout}"
    assert "Traceback" not in result.stderr, result.stderr
    error = [line for line in lines if "error:" in line]
    assert error, result.stderr
    for part in parts:
        assert part in result.stderr, f"{part!r} not in {result.stderr!r}"
    return f"exit {result.returncode}: {error[-1]}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@check("a folder URL on a dead port says it cannot connect")
def dead_folder(folder: Path) -> str:
    mnt = folder / "mnt"
    url = f"http://127.0.0.1:{free_port()}/shards/"
    result = run(SHARDFS, "mount", url, str(mnt), "--cache-dir", str(folder / "cache"))
    return one_error_line(result, "cannot connect")


@check("an -o typo gets a did-you-mean")
def o_typo(folder: Path) -> str:
    result = run(SHARDFS, "mount", str(folder), str(folder / "mnt"), "-o", "cache_szie=1G")
    return one_error_line(result, "did you mean", "cache_size")


@check("mount.shardfs --help works")
def helper_help(folder: Path) -> str:
    result = run(str(BIN / "mount.shardfs"), "--help")
    assert result.returncode == 0, result.stderr
    assert "mount.shardfs" in result.stdout and "-o" in result.stdout, result.stdout
    return f"exit 0, {len(result.stdout.splitlines())} lines of usage"


@check("pack refuses a destination inside its source")
def pack_into_source(folder: Path) -> str:
    tree = folder / "tree"
    (tree / "a").mkdir(parents=True)
    (tree / "a" / "one.txt").write_text("1")
    result = run(SHARDFS, "pack", str(tree), str(tree / "out"))
    seen = one_error_line(result, "inside")
    assert not (tree / "out").exists() or not any((tree / "out").iterdir())
    return seen


def tar_of(folder: Path, name: str) -> Path:
    (folder / "src" / "d").mkdir(parents=True, exist_ok=True)
    (folder / "src" / "d" / "hello.txt").write_text("hello\n")
    shards = folder / "shards"
    shards.mkdir(exist_ok=True)
    subprocess.run(["tar", "-cf", str(shards / name), "-C", str(folder / "src"), "d"], check=True)
    return shards / name


@check("a missing mountpoint is created, and removed at unmount")
def missing_mountpoint(folder: Path) -> str:
    shard = tar_of(folder, "s.tar")
    mnt = folder / "mnt-new"
    result = run(SHARDFS, "mount", str(shard), str(mnt), "--cache-dir", str(folder / "cache"))
    assert result.returncode == 0, result.stderr
    assert (mnt / "d" / "hello.txt").read_text() == "hello\n"
    said = (result.stderr + result.stdout).strip().splitlines()
    created = [line for line in said if "created mountpoint" in line]
    assert created, said
    assert run(SHARDFS, "umount", str(mnt)).returncode == 0
    assert not mnt.exists(), "mountpoint left behind"
    return f"{created[0]}; gone after umount"


@check("the mount table shows the source URL and type fuse.shardfs")
def mount_table(folder: Path) -> str:
    shard = tar_of(folder, "s.tar")
    mnt = folder / "mnt"
    mnt.mkdir()
    result = run(SHARDFS, "mount", str(shard), str(mnt), "--cache-dir", str(folder / "cache"))
    assert result.returncode == 0, result.stderr
    seen = run("findmnt", "-n", "-o", "SOURCE,FSTYPE", str(mnt)).stdout.split()
    assert seen == [str(shard), "fuse.shardfs"], seen
    return " ".join(seen)


@check("a .tar.bz2 source is named as unsupported")
def tar_bz2(folder: Path) -> str:
    shard = tar_of(folder, "s.tar")
    subprocess.run(["bzip2", str(shard)], check=True)
    result = run(SHARDFS, "mount", f"{shard}.bz2", str(folder / "mnt"))
    return one_error_line(result, "compressed", "s.tar.bz2")


CHECKS = [
    collision_shards,
    stats_agree,
    dead_folder,
    o_typo,
    helper_help,
    pack_into_source,
    missing_mountpoint,
    mount_table,
    tar_bz2,
]


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="shardfs-newcomer-"))
    started = time.monotonic()
    try:
        for runner in CHECKS:
            runner(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for name, ok, seen in RESULTS:
        flat = re.sub(r"\s+", " ", seen)
        print(f"{'PASS' if ok else 'FAIL'}  {name}\n      {flat}")
    failed = sum(not ok for _, ok, _ in RESULTS)
    print(f"{len(RESULTS) - failed} of {len(RESULTS)} passed in {time.monotonic() - started:.0f} s")
    return 1 if failed or len(RESULTS) != len(CHECKS) else 0


if __name__ == "__main__":
    sys.exit(main())

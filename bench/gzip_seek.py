"""Seek points in a ``tar -czf`` shard: indexed_gzip, rapidgzip and plain zlib compared, to
choose how shardfs serves a member of a ``.tar.gz`` (docs/formats.md, "tar.gz").

A ~100 MB tar of real JPEGs (~100 KB each, ``bench/data.py``) and some compressible text
files is written by ``tar -czf``. For each way of seeking the script measures: the index
build (one sequential pass, wall and CPU), the raw bytes that pass reads, the index's size,
the time and the raw bytes read to fetch one member at a random offset with the index
loaded, and the decode CPU per file over a full sequential pass. Timed: run under
``flock /tmp/shardfs-bench.lock``.

    python bench/gzip_seek.py [--mb 100] [--reads 40] [--json out.json]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data import ensure_tree

CHUNK = 1 << 20
# indexed_gzip's read buffer; its default (4 x spacing) decodes 16 MiB per miss.
BUFFER = 128 << 10


class CountingFile(io.RawIOBase):
    """A file object over bytes that counts what is read through it."""

    def __init__(self, data: bytes) -> None:
        self._data = data
        self._pos = 0
        self.read_bytes = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: len(self._data)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer: Any) -> int:
        chunk = self._data[self._pos : self._pos + len(buffer)]
        buffer[: len(chunk)] = chunk
        self._pos += len(chunk)
        self.read_bytes += len(chunk)
        return len(chunk)


def make_shard(folder: Path, work: Path, megabytes: int) -> tuple[bytes, list[tuple[int, int]]]:
    """A ``tar -czf`` of ~``megabytes`` MB: the bench's real JPEGs (``bench/data.py``, about
    100 KB each) and one compressible text file per 10 images; and each file's (data
    offset, size) in the tar."""
    tree = ensure_tree(work, megabytes * 10, 10)
    rng = random.Random(22)
    words = [bytes(rng.choices(b"abcdefghij", k=rng.randint(3, 9))) for _ in range(500)]
    src = folder / "src"
    shutil.copytree(tree.root, src)
    for index in range(megabytes):
        size = rng.randint(60_000, 140_000)
        text = b" ".join(rng.choices(words, k=size // 6))[:size]
        (src / f"class_{index % 10:03d}" / f"notes_{index:05d}.txt").write_bytes(text)
    shard = folder / "shard.tar.gz"
    subprocess.run(["tar", "-czf", shard, "-C", src, "."], check=True)
    raw = shard.read_bytes()
    with tarfile.open(fileobj=io.BytesIO(raw), mode="r:gz") as tar:
        members = [(m.offset_data, m.size) for m in tar.getmembers() if m.isfile()]
    return raw, members


@dataclass
class Figures:
    method: str
    build_s: float
    build_cpu_s: float
    build_raw_x: float
    index_bytes: int
    open_ms: float
    read_ms_median: float
    read_ms_max: float
    read_cpu_ms_median: float
    read_raw_kb_median: float
    pass_cpu_ms_per_file: float
    note: str = ""


@contextmanager
def timed() -> Iterator[list[float]]:
    out: list[float] = []
    wall, cpu = time.perf_counter(), time.process_time()
    yield out
    out += [time.perf_counter() - wall, time.process_time() - cpu]


class Method:
    """One way to seek: build an index in one pass, open a reader over it, read at offsets."""

    name = ""
    note = ""

    built_from: CountingFile | None = None  # the build's file object, for its read count

    def build(self, raw: bytes) -> bytes:
        raise NotImplementedError

    def open(self, fileobj: CountingFile, index: bytes) -> Any:
        raise NotImplementedError

    def read_at(self, reader: Any, offset: int, length: int) -> bytes:
        reader.seek(offset)
        data: bytes = reader.read(length)
        return data

    def close(self, reader: Any) -> None:
        reader.close()

    def full_pass(self, raw: bytes, index: bytes) -> None:
        """Every file read in tar order with the index loaded."""
        reader = self.open(CountingFile(raw), index)
        while reader.read(CHUNK):
            pass
        self.close(reader)


class IndexedGzip(Method):
    def __init__(self, spacing: int) -> None:
        import indexed_gzip

        self._lib = indexed_gzip
        self.spacing = spacing
        self.name = f"indexed_gzip, {spacing >> 20} MiB"

    def build(self, raw: bytes) -> bytes:
        self.built_from = CountingFile(raw)
        with self._lib.IndexedGzipFile(fileobj=self.built_from, spacing=self.spacing) as f:
            while f.read(CHUNK):
                pass
            f.build_full_index()  # reads leave the last points to build (cheap)
            out = io.BytesIO()
            f.export_index(fileobj=out)
        return out.getvalue()

    def open(self, fileobj: CountingFile, index: bytes) -> Any:
        f = self._lib.IndexedGzipFile(
            fileobj=fileobj, spacing=self.spacing, auto_build=False, buffer_size=BUFFER
        )
        f.import_index(fileobj=io.BytesIO(index))
        return f


class Rapidgzip(Method):
    def __init__(self, chunk: int) -> None:
        import rapidgzip

        self._lib = rapidgzip
        self.chunk = chunk
        self.name = f"rapidgzip, {chunk >> 20} MiB chunks, 1 thread"

    def _file(self, fileobj: CountingFile) -> Any:
        return self._lib.RapidgzipFile(fileobj, parallelization=1, chunk_size=self.chunk)

    def build(self, raw: bytes) -> bytes:
        self.built_from = CountingFile(raw)
        with self._file(self.built_from) as f:
            while f.read(CHUNK):
                pass
            out = io.BytesIO()
            f.export_index(out)
        return out.getvalue()

    def open(self, fileobj: CountingFile, index: bytes) -> Any:
        f = self._file(fileobj)
        f.import_index(io.BytesIO(index))
        return f


class ZlibFromStart(Method):
    name = "zlib, no seek points"
    note = "every read decodes from the stream's start"

    def build(self, raw: bytes) -> bytes:
        return b""

    def open(self, fileobj: CountingFile, index: bytes) -> Any:
        return fileobj

    def read_at(self, reader: Any, offset: int, length: int) -> bytes:
        return _inflate_from(reader, 0, zlib.decompressobj(31), 0, offset, length)

    def close(self, reader: Any) -> None:
        pass

    def full_pass(self, raw: bytes, index: bytes) -> None:
        inflater = zlib.decompressobj(31)
        for at in range(0, len(raw), CHUNK):
            inflater.decompress(raw[at : at + CHUNK])


def _inflate_from(
    fileobj: CountingFile, raw_at: int, inflater: Any, out_at: int, offset: int, length: int
) -> bytes:
    """Decode from raw offset ``raw_at`` (decoded offset ``out_at``) with ``inflater`` until
    ``[offset, offset + length)`` is out; one gzip member only (enough for ``tar -czf``)."""
    fileobj.seek(raw_at)
    pos, parts = out_at, []
    while pos < offset + length:
        chunk = fileobj.read(256 << 10)
        if not chunk:
            break
        out = inflater.decompress(chunk)
        lo, hi = max(offset - pos, 0), min(offset + length - pos, len(out))
        if hi > lo:
            parts.append(out[lo:hi])
        pos += len(out)
    return b"".join(parts)


class ZlibSnapshots(Method):
    """``decompressobj().copy()`` every ``spacing`` decoded bytes: held in memory only
    (a zlib state cannot be written out), so each mount would decode the shard again."""

    def __init__(self, spacing: int) -> None:
        self.spacing = spacing
        self.name = f"zlib copy() snapshots, {spacing >> 20} MiB"
        self.note = "in memory only: not storable with the index"
        self.points: list[tuple[int, int, Any]] = []
        self.memory = 0

    def build(self, raw: bytes) -> bytes:
        inflater = zlib.decompressobj(31)
        self.points = [(0, 0, inflater.copy())]
        out_pos, step = 0, 64 << 10  # snapshots land on input-chunk edges
        for raw_at in range(0, len(raw), step):
            out_pos += len(inflater.decompress(raw[raw_at : raw_at + step]))
            if out_pos - self.points[-1][1] >= self.spacing:
                self.points.append((raw_at + step, out_pos, inflater.copy()))
        # No stored index; what the snapshots hold: the 32 KiB window and zlib's state.
        self.memory = len(self.points) * (39 << 10)
        return b""

    def open(self, fileobj: CountingFile, index: bytes) -> Any:
        return fileobj

    def read_at(self, reader: Any, offset: int, length: int) -> bytes:
        raw_at, out_at, snap = max((p for p in self.points if p[1] <= offset), key=lambda p: p[1])
        return _inflate_from(reader, raw_at, snap.copy(), out_at, offset, length)

    def close(self, reader: Any) -> None:
        pass

    def full_pass(self, raw: bytes, index: bytes) -> None:
        inflater = zlib.decompressobj(31)
        for at in range(0, len(raw), CHUNK):
            inflater.decompress(raw[at : at + CHUNK])


def measure(method: Method, raw: bytes, members: list[tuple[int, int]], reads: int) -> Figures:
    with timed() as build:
        index = method.build(raw)
    decoded = zlib.decompress(raw, 31)
    rng = random.Random(7)
    picked = rng.sample(members, min(reads, len(members)))
    opens, times, cpus, kbs = [], [], [], []
    for offset, size in picked:  # each read on a fresh reader: no buffer or chunk cache helps
        fileobj = CountingFile(raw)
        start = time.perf_counter()
        reader = method.open(fileobj, index)
        opened, cpu = time.perf_counter(), time.process_time()
        data = method.read_at(reader, offset, size)
        times.append((time.perf_counter() - opened) * 1000)
        cpus.append((time.process_time() - cpu) * 1000)
        opens.append((opened - start) * 1000)
        kbs.append(fileobj.read_bytes / 1000)
        method.close(reader)
        assert data == decoded[offset : offset + size], method.name
    with timed() as full:
        method.full_pass(raw, index)
    note = method.note
    if isinstance(method, ZlibSnapshots):
        note += f"; ~{method.memory >> 10} KiB of RAM per shard"
    return Figures(
        method.name,
        round(build[0], 3),
        round(build[1], 3),
        round(method.built_from.read_bytes / len(raw), 2) if method.built_from else 1.0,
        len(index),
        round(statistics.median(opens), 2),
        round(statistics.median(times), 2),
        round(max(times), 2),
        round(statistics.median(cpus), 2),
        round(statistics.median(kbs), 1),
        round(full[1] * 1000 / len(members), 3),
        note,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=100, help="decoded tar size (MB)")
    parser.add_argument("--reads", type=int, default=40, help="random member reads per method")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    parser.add_argument(
        "--work",
        type=Path,
        default=Path(tempfile.gettempdir()) / "gzip-seek-work",
        help="where the JPEG tree is generated and kept between runs",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        raw, members = make_shard(Path(tmp), args.work, args.mb)
    print(f"shard: {len(raw) / 1e6:.1f} MB gzip, {len(members)} files, {os.cpu_count()} cpus")
    methods: list[Callable[[], Method]] = [
        lambda: IndexedGzip(4 << 20),
        lambda: IndexedGzip(1 << 20),
        lambda: Rapidgzip(4 << 20),
        lambda: Rapidgzip(2 << 20),
        lambda: Rapidgzip(1 << 20),
        ZlibFromStart,
        lambda: ZlibSnapshots(4 << 20),
    ]
    rows = [measure(make(), raw, members, args.reads) for make in methods]
    header = (
        "| method | build s (CPU s) | raw bytes read by the build / shard | index KB | open ms "
        "| random read ms median (max) | its CPU ms median | raw KB read per random read "
        "| decode CPU ms per file, full pass |"
    )
    print(header)
    print("|" + "---|" * 9)
    for r in rows:
        print(
            f"| {r.method} | {r.build_s} ({r.build_cpu_s}) | {r.build_raw_x}x "
            f"| {r.index_bytes / 1000:.1f} "
            f"| {r.open_ms} | {r.read_ms_median} ({r.read_ms_max}) | {r.read_cpu_ms_median} "
            f"| {r.read_raw_kb_median} "
            f"| {r.pass_cpu_ms_per_file} |" + (f" {r.note}" if r.note else "")
        )
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")


if __name__ == "__main__":
    main()

"""Coverage-guided fuzzing of the tar and zip parsers, the index's name and label rules and
the views.

``make fuzz`` runs ``python tests/fuzz_target.py`` under atheris (libFuzzer) for
``FUZZ_SECONDS``. The corpus is seeded with valid archives written by ``tarfile`` (and GNU
``tar`` when installed), and zips written by ``zipfile``; every input goes through both
parsers. An input that makes anything but a ShardfsError escape, or breaks
an invariant, is written to ``tests/fuzz_regressions/`` as JSON text (hex), and
``tests/test_hostile_tars.py`` replays every stored finding through ``check``.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import itertools
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import traceback
import zipfile
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shardfs.config import IndexConfig, SourceConfig, ViewConfig
from shardfs.errors import ShardfsError
from shardfs.formats import codecs
from shardfs.formats.members import (
    MemberRow,
    check_symlink_target,
    normalize_member_path,
    parse_label,
)
from shardfs.formats.source import BytesShard
from shardfs.formats.tar import MemberKind, iter_members
from shardfs.formats.units import MAX_EXPANSION, DecodedScan, is_decoded
from shardfs.formats.zip import scan_zip
from shardfs.index.db import IndexBuilder
from shardfs.store.remote import Store
from shardfs.views.view import View, build_view

REGRESSIONS = Path(__file__).resolve().parent / "fuzz_regressions"
SHARD = "fuzz.tar"
MAX_LEN = 32 << 10


def check_members(data: bytes) -> bool:
    """Parse and apply the scan's rules to every member; True if the shard was accepted."""
    try:
        for member, content in iter_members(io.BytesIO(data), SHARD, capture=lambda m: True):
            assert 0 <= member.header_offset < member.data_offset <= len(data)
            assert member.size >= 0 and member.data_offset + member.size <= len(data)
            assert -(2**63) <= member.mtime < 2**63
            if member.kind is MemberKind.OTHER:
                continue
            normalize_member_path(member.path, SHARD, member.header_offset)
            if member.kind is MemberKind.SYMLINK:
                check_symlink_target(member.linkname, SHARD, member.header_offset)
            if member.kind is MemberKind.HARDLINK:
                normalize_member_path(member.linkname, SHARD, member.header_offset)
            if content is not None:
                assert content == data[member.data_offset : member.data_offset + member.size]
                for ext in ("cls", "json"):
                    label = parse_label(ext, content)
                    assert label is None or 0 <= label < 2**31
    except ShardfsError:
        return False
    return True


def check_decoded(data: bytes, scan: list[MemberRow] | DecodedScan) -> list[MemberRow]:
    """A scan's rows; where it has decode units, each lies within the shard, a decoded row
    lies within its unit, and decoding a unit gives its bytes or ``DecodeError`` only."""
    if not isinstance(scan, DecodedScan):
        return scan
    for unit in scan.space.units:
        assert 0 <= unit.offset <= unit.end <= len(data) and unit.size >= 0
        assert unit.size <= max(MAX_EXPANSION * unit.length, 64 << 10)
        with contextlib.suppress(codecs.DecodeError):
            assert len(codecs.decode(unit, data[unit.offset : unit.end])) == unit.size
    for _path, offset, size, *_ in scan.rows:
        if is_decoded(offset):
            _, unit, within = scan.space.locate(offset)
            assert within + size <= unit.size
            if unit.codec in codecs.SEEKABLE:  # read where the file is, from a seek point
                opened = codecs.SEEKABLE[unit.codec](unit, io.BytesIO(data))
                try:
                    with contextlib.suppress(codecs.DecodeError):
                        assert len(opened.read_at(within, size)) == size
                finally:
                    opened.close()
    return scan.rows


def check_zip(data: bytes) -> bool:
    """The zip scanner's rows lie within the shard (or its decode units) and are paths the
    index accepts, or it raises the project's error; True if the shard was accepted."""
    shard = BytesShard("fuzz.zip", data)
    try:
        rows = check_decoded(data, scan_zip(shard))
    except ShardfsError:
        return False
    for path, offset, size, _mode, _mtime, kind, link, label in rows:
        assert path and normalize_member_path(path, SHARD, 0) == path
        assert size >= 0 and (is_decoded(offset) or (offset >= 0 and offset + size <= len(data)))
        assert kind in (MemberKind.FILE, MemberKind.DIRECTORY, MemberKind.SYMLINK)
        assert label is None or 0 <= label < 2**31
        if kind == MemberKind.SYMLINK:
            check_symlink_target(link, SHARD, 0)
    return True


def check_columnar(data: bytes) -> None:
    """The parquet, MDS and tar.gz scanners over the same bytes (as a file, with parquet's
    magic at its end, and gzipped for tar.gz): rows lie within the file or their decode
    units, or the shard is refused."""
    from shardfs.formats.mds import scan_mds, scan_mds_zstd
    from shardfs.formats.parquet import scan_parquet
    from shardfs.formats.source import BytesShard
    from shardfs.formats.tar_gz import scan_tar_gz

    for name, scanner, blob in (
        ("fuzz.parquet", scan_parquet, data + b"PAR1"),
        ("fuzz.mds", scan_mds, data),
        ("fuzz.mds.zstd", scan_mds_zstd, data),
        ("fuzz.tar.gz", scan_tar_gz, gzip.compress(data, 1)),
        ("fuzz.tgz", scan_tar_gz, data),
    ):
        try:
            rows = check_decoded(blob, scanner(BytesShard(name, blob)))
        except ShardfsError:
            continue
        for path, offset, size, *_ in rows:
            assert path and size >= 0
            assert is_decoded(offset) or (offset >= 0 and offset + size <= len(blob))


def check_views(data: bytes, root: Path) -> None:
    """The real scan over a local folder, then both views; every file lies in the shard."""
    shutil.rmtree(root, ignore_errors=True)
    (root / "data").mkdir(parents=True)
    (root / "data" / SHARD).write_bytes(data)
    store = Store(SourceConfig(str(root / "data")))
    config = IndexConfig(cache_dir=root / "cache", skip_bad_shards=True, scan_workers=1)
    try:
        index_path = IndexBuilder(store, config).build(store.list_shards())
        for layout in ("raw", "imagefolder"):
            out = root / f"{layout}.sqlite"
            with contextlib.suppress(ShardfsError):
                build_view(index_path, out, ViewConfig(layout=layout), lambda _folder: None)
                view = View(out)
                try:
                    for _path, node in view.files():
                        assert node.offset + node.size <= len(data)
                finally:
                    view.close()
    except ShardfsError:
        pass


def check(data: bytes, root: Path | None = None) -> None:
    """Everything the fuzzer asserts about one input; ``root`` enables the view pass."""
    check_zip(data)
    check_columnar(data)
    if check_members(data) and root is not None:
        check_views(data, root)


def record(data: bytes, error: BaseException) -> Path:
    """Store a finding as text, named by its digest, for the suite to replay."""
    REGRESSIONS.mkdir(exist_ok=True)
    digest = hashlib.sha256(data).hexdigest()[:16]
    path = REGRESSIONS / f"finding-{digest}.json"
    entry = {
        "input_hex": data.hex(),
        "error": f"{type(error).__name__}: {str(error)[:300]}",
        "traceback": traceback.format_exc().splitlines()[-6:],
    }
    path.write_text(json.dumps(entry, indent=1) + "\n")
    return path


def seed_corpus(folder: Path) -> None:
    """Valid archives in every format: the fuzzer mutates from these."""
    folder.mkdir(parents=True, exist_ok=True)
    long_name = "d/" + "l" * 120 + "/" + "n" * 110 + ".jpg"
    for fmt in (tarfile.GNU_FORMAT, tarfile.PAX_FORMAT, tarfile.USTAR_FORMAT):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
            members: list[tuple[str, bytes | str, bytes]] = [
                ("s/k0.jpg", b"0", b"jpeg" * 100),
                ("s/k0.cls", b"0", b"3\n"),
                ("s/k1.jpg", b"0", b""),
                ("s/k1.json", b"0", b'{"label": 4}'),
                ("s/dir", b"5", b""),
                ("s/link", b"2", "k0.jpg"),
                ("s/hard", b"1", "s/k0.jpg"),
            ]
            if fmt != tarfile.USTAR_FORMAT:
                members.append((long_name, b"0", b"x" * 600))
            for name, kind, payload in members:
                info = tarfile.TarInfo(name)
                info.type = kind
                info.mtime = 1_700_000_000.5 if fmt == tarfile.PAX_FORMAT else 1_700_000_000
                if isinstance(payload, str):
                    info.linkname = payload
                    tar.addfile(info)
                else:
                    info.size = len(payload)
                    tar.addfile(info, io.BytesIO(payload))
        data = buf.getvalue().rstrip(b"\0")
        data += bytes(-len(data) % 512) + bytes(1024)
        (folder / f"py-{fmt}.tar").write_bytes(data)
    if shutil.which("tar"):
        src = folder.parent / "src"
        (src / "t").mkdir(parents=True, exist_ok=True)
        (src / "t" / "a.jpg").write_bytes(b"A" * 700)
        (src / "t" / "a.cls").write_bytes(b"1")
        for fmt in ("gnu", "pax", "v7"):
            out = folder / f"gnutar-{fmt}.tar"
            subprocess.run(
                ["tar", f"--format={fmt}", "-cf", str(out), "-C", str(src), "t"], check=True
            )
            out.write_bytes(out.read_bytes()[:4096])


def seed_zips(folder: Path) -> None:
    """Stored and deflated zips, zip64 records included, for the zip scanner."""
    for zip64, method in itertools.product(
        (False, True), (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED)
    ):
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", compression=method) as archive:
            archive.writestr("c/k0.jpg", b"jpeg" * 50)
            archive.writestr("c/k0.cls", b"2")
            archive.mkdir("d")
            with archive.open("c/k1.jpg", "w", force_zip64=zip64) as handle:
                handle.write(b"x" * 300)
        (folder / f"py-zip64-{zip64}-{method}.zip").write_bytes(buf.getvalue())


def main() -> None:
    import atheris  # only `make fuzz` needs it

    work = Path(tempfile.mkdtemp(prefix="shardfs-fuzz-"))
    corpus = work / "corpus"
    seed_corpus(corpus)
    seed_zips(corpus)
    views_root = work / "views"

    def one_input(data: bytes) -> None:
        try:
            # The view pass costs milliseconds: run it for an eighth of the inputs, chosen
            # by content. (The replay test runs it for every stored finding.)
            check(data, views_root if zlib.crc32(data) % 8 == 0 else None)
        except BaseException as error:
            if isinstance(error, KeyboardInterrupt):
                raise
            path = record(data, error)
            print(f"\nfinding stored in {path}", file=sys.stderr)
            raise

    seconds = os.environ.get("FUZZ_SECONDS", "600")
    args = [sys.argv[0], f"-max_total_time={seconds}", f"-max_len={MAX_LEN}", "-timeout=10"]
    args += ["-rss_limit_mb=2048", *sys.argv[1:], str(corpus)]
    atheris.instrument_all()  # shardfs is imported already: instrument what is loaded
    atheris.Setup(args, one_input)
    try:
        atheris.Fuzz()
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

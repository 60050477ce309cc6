"""Hundreds of hostile tar shards through the real index scan and both views (issue 9).

Every case is generated at test time with a fixed seed: mutations of valid archives written
by Python ``tarfile`` and by GNU ``tar`` (bit flips in headers, huge and negative numbers in
every numeric field in octal, base-256 and pax, truncations at every interesting offset),
plus hand-built abuse (bogus pax records, GNU long-name and long-link headers, sparse
headers, odd type flags, deep, long, NUL and non-UTF-8 names, hostile labels).

Each shard sits in a local folder next to a good shard and is indexed with
``skip_bad_shards``; then the raw and imagefolder views are built. The only exceptions
allowed to escape are ``ShardfsError``s. A hostile shard is either refused as a bad shard
(named, with an offset inside it) or accepted; for an accepted one every file of the raw
view must hold the bytes ``tarfile`` extracts for that path.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import random
import shutil
import subprocess
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from fuzz_target import check
from support.tarbuild import hardlink, make_tar, symlink

from shardfs.config import IndexConfig, SourceConfig, ViewConfig
from shardfs.errors import CorruptShardError, ShardfsError
from shardfs.formats.tar import iter_members
from shardfs.index.db import IndexBuilder
from shardfs.store.remote import Store
from shardfs.views.view import View, build_view

MTIME = 1_700_000_000
GOOD = make_tar([("good/g.jpg", b"good image"), ("good/g.cls", b"0")])
# (offset, length) of every numeric ustar header field except the checksum.
NUMERIC_FIELDS = {
    "mode": (100, 8),
    "uid": (108, 8),
    "gid": (116, 8),
    "size": (124, 12),
    "mtime": (136, 12),
    "devmajor": (329, 8),
    "devminor": (337, 8),
}


def hostile_numbers(length: int) -> list[bytes]:
    """Values for a numeric field of ``length`` bytes: huge, negative, malformed."""
    return [
        b"7" * (length - 1) + b"\0",  # largest octal
        b"7" * length,  # no terminator
        b"\x80" + b"\xff" * (length - 1),  # largest base-256
        b"\x80" + (2**63 % 256 ** (length - 1)).to_bytes(length - 1, "big"),
        b"\x80" + ((2**63 - 1) % 256 ** (length - 1)).to_bytes(length - 1, "big"),
        b"\xff" * length,  # base-256 -1
        b"\xff\x80" + bytes(length - 2),  # most negative base-256
        b"\x81" + bytes(length - 1),  # neither base-256 marker
        b"9" * (length - 1) + b"\0",
        b" " * length,
        b"\0" * length,
        b"-1".ljust(length, b"\0"),
        "٣".encode().ljust(length, b"\0"),
    ]


# --- archives to mutate -----------------------------------------------------------------------


def python_tar(fmt: int) -> bytes:
    long_name = "data/" + "d" * 90 + "/" + "n" * 120 + ".jpg" if fmt != tarfile.USTAR_FORMAT else ""
    entries: list[tuple[str, bytes] | tarfile.TarInfo] = [
        ("data/k0.jpg", b"jpeg zero" * 70),
        ("data/k0.cls", b"3\n"),
        ("data/k1.jpg", b""),
        ("data/k1.json", b'{"label": 12}'),
        ("data/ünï.txt", bytes(range(256)) * 2),
        symlink("data/link", "k0.jpg"),
        hardlink("data/hard", "data/k0.jpg"),
    ]
    if long_name:
        entries.append((long_name, b"long" * 300))
    return make_tar(entries, fmt)


def gnu_tar(tmp: Path, fmt: str, *, sparse: bool = False) -> bytes | None:
    if shutil.which("tar") is None:
        return None
    src = tmp / f"src-{fmt}-{sparse}"
    (src / "data" / "sub").mkdir(parents=True)
    (src / "data" / "a.jpg").write_bytes(b"A" * 700)
    (src / "data" / "a.cls").write_bytes(b"1")
    long = "x" * 120 if fmt in ("gnu", "oldgnu", "pax") else "x"  # v7 and ustar cannot
    (src / "data" / "sub" / (long + ".bin")).write_bytes(b"X" * 513)
    os.symlink("a.jpg", src / "data" / "s")
    if sparse:
        with open(src / "data" / "holes.bin", "wb") as handle:
            handle.seek(64 * 1024)
            handle.write(b"end")
            handle.seek(200 * 1024)
            handle.write(b"tail")
    for dirpath, dirnames, filenames in os.walk(src):
        for entry in [*dirnames, *filenames]:
            os.utime(Path(dirpath, entry), (MTIME, MTIME), follow_symlinks=False)
    out = tmp / f"gnu-{fmt}-{sparse}.tar"
    args = ["tar", f"--format={fmt}", "--sort=name", "--owner=0", "--group=0", "--numeric-owner"]
    if sparse:
        args.append("--sparse")
    if fmt == "pax":  # atime and ctime records would change the layout from run to run
        args.append("--pax-option=delete=atime,delete=ctime")
    subprocess.run([*args, "-cf", str(out), "-C", str(src), "data"], check=True)
    return out.read_bytes()


def header_blocks(archive: bytes) -> list[tuple[int, int, int]]:
    """(first header, data offset, size) of every member, according to tarfile."""
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        return [(info.offset, info.offset_data, info.size) for info in tar.getmembers()]


def real_headers(archive: bytes, first: int, data_at: int) -> Iterator[int]:
    """The header blocks from ``first`` to ``data_at``, leaving out the data blocks of
    extension headers (a long name is text, not a header with numeric fields)."""
    at = first
    while at < data_at:
        yield at
        size = 0
        if archive[at + 156 : at + 157] in (b"L", b"K", b"x", b"X", b"g"):
            size = int(archive[at + 124 : at + 136].strip(b"\0 ") or b"0", 8)
        at += 512 + size + (-size % 512)


def fix_checksum(data: bytearray, at: int) -> None:
    block = data[at : at + 512]
    block[148:156] = b" " * 8
    data[at + 148 : at + 156] = b"%06o\0 " % sum(block)


def with_field(archive: bytes, at: int, offset: int, value: bytes) -> bytes:
    data = bytearray(archive)
    data[at + offset : at + offset + len(value)] = value
    fix_checksum(data, at)
    return bytes(data)


def mutations(name: str, archive: bytes, rng: random.Random) -> Iterator[tuple[str, bytes]]:
    yield f"{name}/as-is", archive
    members = header_blocks(archive)
    end = members[-1][1] + members[-1][2] + (-members[-1][2] % 512)
    cuts = {end, end + 1, end + 512}
    for first, data_at, size in members:
        for at in range(first, data_at, 512):
            cuts.update(at + d for d in (1, 100, 124, 156, 257, 511))
        cuts.update({data_at, data_at + 1, data_at + size // 2, data_at + size, data_at + size + 1})
    for cut in sorted(c for c in cuts if c < len(archive)):
        yield f"{name}/cut@{cut}", archive[:cut]
    # Every header block, numeric field and hostile value would be thousands of cases: a
    # seeded sample of them, with the checksum fixed so the parser reads the value.
    headers = [at for first, data_at, _ in members for at in real_headers(archive, first, data_at)]
    for field_name, (offset, length) in NUMERIC_FIELDS.items():
        for value in rng.sample(hostile_numbers(length), 4):
            at = rng.choice(headers)
            yield f"{name}/{field_name}={value.hex()}@{at}", with_field(archive, at, offset, value)
    for i in range(12):
        data = bytearray(archive)
        at = rng.choice(headers)
        bit = rng.randrange(512 * 8)
        data[at + bit // 8] ^= 1 << (bit % 8)
        if i % 2:
            fix_checksum(data, at)
        yield f"{name}/flip{bit}@{at}{'+sum' if i % 2 else ''}", bytes(data)


# --- hand-built abuse -------------------------------------------------------------------------


def header(
    name: bytes,
    *,
    size: int = 0,
    typeflag: bytes = b"0",
    linkname: bytes = b"",
    size_field: bytes | None = None,
    extra: dict[int, bytes] | None = None,
) -> bytes:
    block = bytearray(512)
    block[0 : len(name[:100])] = name[:100]
    block[100:108] = b"0000644\0"
    block[108:124] = b"0000000\0" * 2
    block[124:136] = size_field if size_field is not None else b"%011o\0" % size
    block[136:148] = b"%011o\0" % MTIME
    block[156:157] = typeflag
    block[157 : 157 + len(linkname[:100])] = linkname[:100]
    block[257:265] = b"ustar\x0000"
    for offset, value in (extra or {}).items():
        block[offset : offset + len(value)] = value
    fix_checksum(block, 0)
    return bytes(block)


def padded(data: bytes) -> bytes:
    return data + bytes(-len(data) % 512)


def member(name: bytes, content: bytes, **fields: object) -> bytes:
    return header(name, size=len(content), **fields) + padded(content)  # type: ignore[arg-type]


def pax_record(key: bytes, value: bytes) -> bytes:
    body = b" " + key + b"=" + value + b"\n"
    length = len(body) + 1
    while len(str(length)) + len(body) != length:
        length += 1
    return str(length).encode() + body


def with_pax(records: bytes, name: bytes = b"f.jpg", content: bytes = b"data") -> bytes:
    return member(b"PaxHeaders/f", records, typeflag=b"x") + member(name, content)


END = bytes(1024)


def built_cases() -> Iterator[tuple[str, bytes]]:
    big = b"9" * 5000
    pax_values: dict[str, bytes] = {
        "size-huge": pax_record(b"size", big),
        "size-2^63": pax_record(b"size", str(2**63).encode()),
        "size-negative": pax_record(b"size", b"-4"),
        "size-empty": pax_record(b"size", b""),
        "size-zeros": pax_record(b"size", b"0" * 5000 + b"4"),
        "size-short": pax_record(b"size", b"2"),
        "size-long": pax_record(b"size", b"600"),
        "mtime-huge": pax_record(b"mtime", big),
        "mtime-neg-huge": pax_record(b"mtime", b"-" + big + b"." + big),
        "mtime-float-junk": pax_record(b"mtime", b"1e99"),
        "mtime-2^64": pax_record(b"mtime", str(2**64).encode()),
        "path-nul": pax_record(b"path", b"a\0b.jpg"),
        "path-non-utf8": pax_record(b"path", b"caf\xe9.jpg"),
        "path-deep": pax_record(b"path", b"a/" * 2000 + b"f.jpg"),
        "path-depth-256": pax_record(b"path", b"a/" * 255 + b"f.jpg"),
        "path-long-name": pax_record(b"path", b"n" * 256),
        "path-8k": pax_record(b"path", b"/".join([b"x" * 200] * 40)),
        "path-absolute": pax_record(b"path", b"/etc/passwd"),
        "path-dotdot": pax_record(b"path", b"a/../../x"),
        "path-dot": pax_record(b"path", b"."),
        "path-empty": pax_record(b"path", b""),
        "linkpath-only": pax_record(b"linkpath", b"\xff\0"),
        "sparse-name": pax_record(b"GNU.sparse.name", b"\xff.jpg"),
        "sparse-map": pax_record(b"GNU.sparse.map", b"0,99999999999999999999"),
        "hdrcharset": pax_record(b"hdrcharset", b"BINARY") + pax_record(b"path", b"\xff"),
        "length-too-big": b"99 path=a\n",
        "length-zero": b"0 path=a\n",
        "length-huge": b"9" * 19 + b" path=a\n",
        "length-20-digits": b"9" * 25 + b" path=a\n",
        "no-equals": b"11 pathabc\n",
        "no-newline": b"10 path=ab",
        "nul-padding": pax_record(b"path", b"p.jpg") + bytes(300),
        "nul-then-junk": pax_record(b"path", b"p.jpg") + b"\0\0junk",
        "many-records": b"".join(pax_record(b"k%d" % i, b"v") for i in range(3000)),
        "key-nul": pax_record(b"pa\0th", b"z"),
    }
    for case, records in pax_values.items():
        yield f"pax/{case}", with_pax(records) + END
        yield f"pax-orphan/{case}", member(b"PaxHeaders/f", records, typeflag=b"x") + END
    yield "pax/global-huge", member(b"g", pax_record(b"mtime", big), typeflag=b"g") + END
    yield "pax/size-over-16MiB", header(b"x", size=17 << 20, typeflag=b"x") + END

    long_names: dict[str, bytes] = {
        "L-empty": member(b"././@LongLink", b"", typeflag=b"L") + member(b"short", b"1"),
        "L-no-nul": member(b"././@LongLink", b"n" * 512, typeflag=b"L") + member(b"x", b"1"),
        "L-dotdot": member(b"././@LongLink", b"../../evil\0", typeflag=b"L") + member(b"x", b""),
        "L-non-utf8": member(b"././@LongLink", b"\xc3\x28\0", typeflag=b"L") + member(b"x", b""),
        "L-5000": member(b"././@LongLink", b"n/" * 2500 + b"\0", typeflag=b"L") + member(b"x", b""),
        "L-twice": member(b"././@LongLink", b"one\0", typeflag=b"L")
        + member(b"././@LongLink", b"two\0", typeflag=b"L")
        + member(b"x", b"2"),
        "L-orphan": member(b"././@LongLink", b"orphan\0", typeflag=b"L"),
        "L-huge-size": header(b"././@LongLink", size=1 << 30, typeflag=b"L"),
        "L-base256-size": header(
            b"././@LongLink", typeflag=b"L", size_field=b"\x80" + b"\xff" * 11
        ),
        "L-truncated": header(b"././@LongLink", size=4000, typeflag=b"L") + b"n" * 100,
        "K-on-file": member(b"././@LongLink", b"target\0", typeflag=b"K") + member(b"f", b"3"),
        "K-symlink-non-utf8": member(b"././@LongLink", b"\xfe\xff\0", typeflag=b"K")
        + header(b"s", typeflag=b"2"),
        "K-hardlink-dotdot": member(b"././@LongLink", b"../x\0", typeflag=b"K")
        + header(b"h", typeflag=b"1"),
        "K-symlink-8k": member(b"././@LongLink", b"t" * 8192 + b"\0", typeflag=b"K")
        + header(b"s", typeflag=b"2"),
        "K-symlink-nul": member(b"././@LongLink", b"t\0u", typeflag=b"K")
        + header(b"s", typeflag=b"2"),
    }
    for case, data in long_names.items():
        yield f"gnu-long/{case}", data + END

    sparse_ext = {
        "S-ext-truncated": header(b"sp", typeflag=b"S", extra={482: b"\x01"}),
        "S-ext-chain": header(b"sp", typeflag=b"S", extra={482: b"\x01"})
        + bytes(504)
        + b"\x01"
        + bytes(7)
        + bytes(504)
        + b"\x00"
        + bytes(7),
        "S-huge-realsize": header(b"sp", typeflag=b"S", extra={483: b"\x80" + b"\xff" * 11}),
        "S-ext-endless": header(b"sp", typeflag=b"S", extra={482: b"\x01"})
        + (bytes(504) + b"\x01" + bytes(7)) * 40,
    }
    for case, data in sparse_ext.items():
        yield f"sparse/{case}", data + END

    for flag in [b"\0", *(bytes([c]) for c in b"1234567ADEGIKLMNSVXgx"), b"\xff", b" "]:
        yield f"typeflag/{flag.hex()}", member(b"t.jpg", b"payload", typeflag=flag) + END
        yield f"typeflag-slash/{flag.hex()}", member(b"t/", b"", typeflag=flag) + END

    names: dict[str, bytes] = {
        "non-utf8": b"caf\xe9.jpg",
        "non-utf8-dir": b"\xff/x.jpg",
        "overlong-utf8": b"\xc0\xaf.jpg",
        "surrogate-utf8": b"\xed\xa0\x80.jpg",
        "absolute": b"/abs.jpg",
        "dotdot": b"../up.jpg",
        "dot": b".",
        "empty": b"",
        "slashes": b"////",
        "deep-ustar": b"a/" * 49,
        "newline": b"a\nb.jpg",
        "backslash": b"..\\..\\x.jpg",
        "long-component": b"z" * 100,
    }
    for case, name in names.items():
        yield f"name/{case}", member(name, b"bytes") + END
    yield "name/ustar-prefix-non-utf8", member(b"x.jpg", b"p", extra={345: b"\xff\xfe"}) + END
    yield "name/ustar-prefix-dotdot", member(b"x.jpg", b"p", extra={345: b".."}) + END
    yield "name/file-then-dir", member(b"a", b"file") + member(b"a/b.jpg", b"child") + END
    yield "name/dir-then-file", member(b"a/b.jpg", b"child") + member(b"a", b"file") + END
    yield (
        "name/symlink-then-child",
        header(b"a", typeflag=b"2", linkname=b"b") + member(b"a/c.jpg", b"c") + END,
    )
    yield "name/hardlink-to-self", header(b"h", typeflag=b"1", linkname=b"h") + END
    yield (
        "name/hardlink-to-later",
        header(b"h", typeflag=b"1", linkname=b"f") + member(b"f", b"f") + END,
    )

    labels: dict[str, bytes] = {
        "cls-2^63": str(2**63).encode(),
        "cls-negative": b"-3",
        "cls-5000-digits": b"9" * 5000,
        "cls-unicode-digit": "٣".encode(),
        "cls-2^31": str(2**31).encode(),
        "cls-2^31-1": str(2**31 - 1).encode(),
        "cls-not-utf8": b"\xff",
        "cls-nul": b"1\0",
        "json-deep": b"[" * 60_000 + b"]" * 60_000,
        "json-deep-object": b'{"a":' * 30_000 + b"1" + b"}" * 30_000,
        "json-2^63": str(2**63).encode(),
        "json-negative": b'{"label": -3}',
        "json-huge-int": b'{"label": ' + b"9" * 5000 + b"}",
        "json-float": b'{"label": 1e400}',
        "json-bool": b"true",
        "json-nan": b"NaN",
        "json-64k": b" " * 65_000 + b"1",
    }
    for case, content in labels.items():
        ext = b"json" if case.startswith("json") else b"cls"
        yield (
            f"label/{case}",
            member(b"s/k.jpg", b"image") + member(b"s/k." + ext, content) + END,
        )


# --- running one case -------------------------------------------------------------------------


@dataclass
class Totals:
    cases: int = 0
    refused: int = 0
    accepted: int = 0
    files_checked: int = 0
    no_reference: int = 0
    failures: list[str] = field(default_factory=list)


def tarfile_files(archive: bytes) -> dict[str, bytes] | None:
    """path -> bytes of every regular file and hard link as tarfile extracts them.

    None when tarfile cannot serve as the reference: it fails, or it stops early (it ends
    quietly at a header it finds invalid, say a uid we never parse) and so lists a
    different number of members than our parser."""
    try:
        found: dict[str, bytes] = {}
        with tarfile.open(fileobj=io.BytesIO(archive), encoding="utf-8") as tar:
            infos = tar.getmembers()
            ours = sum(1 for _ in iter_members(io.BytesIO(archive), "hostile.tar"))
            if len(infos) != ours:
                return None
            for info in infos:
                path = "/".join(p for p in info.name.split("/") if p not in ("", "."))
                found.pop(path, None)
                if info.sparse is None and (info.isreg() or info.islnk()):
                    with contextlib.suppress(KeyError):  # a link to a missing member
                        extracted = tar.extractfile(info)
                        if extracted is not None:
                            found[path] = extracted.read()
        return found
    except Exception:  # tarfile's opinion of hostile input is only a reference
        return None


# Where tarfile is not the reference: it disagrees with POSIX or GNU tar, and we do not.
NOT_TARFILE: dict[str, dict[str, bytes]] = {
    # An empty pax value deletes the record (POSIX), so the header's size 4 stands;
    # tarfile reads an unparsable pax number as 0.
    "pax/size-empty": {"f.jpg": b"data"},
    # 5,001 digits whose value is 4; tarfile's int() refuses more than 4,300 digits and
    # takes 0.
    "pax/size-zeros": {"f.jpg": b"data"},
    # An empty pax path deletes the record: the header's name stands; tarfile names it "".
    "pax/path-empty": {"f.jpg": b"data"},
    # Two GNU long names in a row: the later one applies, as later pax records override
    # earlier ones; tarfile keeps the first.
    "gnu-long/L-twice": {"two": b"2"},
}


def run_case(name: str, archive: bytes, root: Path, totals: Totals) -> None:
    totals.cases += 1
    data = root / "data"
    data.mkdir(parents=True)
    (data / "good.tar").write_bytes(GOOD)
    (data / "hostile.tar").write_bytes(archive)
    store = Store(SourceConfig(str(data)))
    config = IndexConfig(cache_dir=root / "cache", skip_bad_shards=True, scan_workers=2)
    try:
        builder = IndexBuilder(store, config)
        index_path = builder.build(store.list_shards())
        bad = builder.bad_shards()
        if bad:
            (shard,) = bad
            if shard.name != "hostile.tar" or not 0 <= shard.offset <= len(archive):
                totals.failures.append(f"{name}: bad shard reported as {shard}")
            totals.refused += 1
        else:
            totals.accepted += 1
        reference = None if bad else NOT_TARFILE.get(name) or tarfile_files(archive)
        if not bad and reference is None:
            totals.no_reference += 1
        for layout in ("raw", "imagefolder"):
            out = root / f"view-{layout}.sqlite"
            try:
                build_view(index_path, out, ViewConfig(layout=layout), lambda _folder: None)
            except ShardfsError:
                if layout == "raw":
                    raise
                continue  # imagefolder with no labelled sample is a UsageError
            check_view(name, out, archive, reference, layout, totals)
    except CorruptShardError as exc:  # skip_bad_shards is on: nothing may fail the build
        totals.failures.append(f"{name}: build failed despite skip_bad_shards: {exc}")
    except ShardfsError:
        pass
    except BaseException as exc:
        totals.failures.append(f"{name}: {type(exc).__name__}: {str(exc)[:200]}")


def check_view(
    name: str,
    out: Path,
    archive: bytes,
    reference: dict[str, bytes] | None,
    layout: str,
    totals: Totals,
) -> None:
    """The good shard's files are always there; an accepted shard's files hold its bytes."""
    view = View(out)
    try:
        shards = {"good.tar": GOOD, "hostile.tar": archive}
        seen_good = False
        for path, node in view.files():
            shard = view.shards[node.shard].name
            content = shards[shard][node.offset : node.offset + node.size]
            if len(content) != node.size:
                totals.failures.append(f"{name}: {layout} {path} lies outside its shard")
            if shard == "good.tar":
                seen_good = seen_good or content == b"good image"
                continue
            if reference is None:
                continue
            expected = reference.get(path) if layout == "raw" else None
            if layout == "imagefolder":
                base = path.rsplit("/", 1)[-1]
                candidates = {k: v for k, v in reference.items() if k.endswith("/" + base)}
                expected = content if content in candidates.values() else None
            if expected is None:
                totals.failures.append(f"{name}: {layout} {path} is not in tarfile's listing")
            elif hashlib.sha256(content).digest() != hashlib.sha256(expected).digest():
                totals.failures.append(f"{name}: {layout} {path} has the wrong bytes")
            else:
                totals.files_checked += 1
        if not seen_good:
            totals.failures.append(f"{name}: {layout} view lost the good shard")
    finally:
        view.close()


def all_cases(tmp: Path) -> list[tuple[str, bytes]]:
    rng = random.Random(9)
    bases: dict[str, bytes | None] = {
        "py-gnu": python_tar(tarfile.GNU_FORMAT),
        "py-pax": python_tar(tarfile.PAX_FORMAT),
        "py-ustar": python_tar(tarfile.USTAR_FORMAT),
        "gnutar-gnu": gnu_tar(tmp, "gnu"),
        "gnutar-pax": gnu_tar(tmp, "pax"),
        "gnutar-ustar": gnu_tar(tmp, "ustar"),
        "gnutar-v7": gnu_tar(tmp, "v7"),
        "gnutar-oldgnu-sparse": gnu_tar(tmp, "oldgnu", sparse=True),
        "gnutar-pax-sparse": gnu_tar(tmp, "pax", sparse=True),
    }
    cases: list[tuple[str, bytes]] = []
    for base_name, archive in bases.items():
        if archive is not None:
            cases.extend(mutations(base_name, archive, rng))
    cases.extend(built_cases())
    return cases


def test_hostile_tars_raise_only_shardfs_errors(tmp_path: Path) -> None:
    cases = all_cases(tmp_path)
    assert len(cases) >= 300
    totals = Totals()
    for i, (name, archive) in enumerate(cases):
        run_case(name, archive, tmp_path / f"case{i}", totals)
    print(
        f"\nhostile tars: {totals.cases}, refused as bad shards: {totals.refused}, "
        f"accepted: {totals.accepted}, view files checked against tarfile: "
        f"{totals.files_checked} (accepted tars tarfile could not list alike: "
        f"{totals.no_reference}), failures: {len(totals.failures)}"
    )
    assert totals.failures == [], "\n".join(totals.failures[:30])
    assert totals.refused > 100 and totals.accepted > 50


# --- stored fuzz findings ---------------------------------------------------------------------

REGRESSIONS = Path(__file__).parent / "fuzz_regressions"
FINDINGS = sorted(path.name for path in REGRESSIONS.glob("*.json"))


def test_there_are_stored_findings() -> None:
    assert len(FINDINGS) >= 12


@pytest.mark.parametrize("finding", FINDINGS)
def test_stored_fuzz_finding_replays_cleanly(finding: str, tmp_path: Path) -> None:
    """Every input the fuzzer (or an earlier bug) made crash, through the parser, the name
    and label rules, the scan and both views: only ShardfsErrors, every invariant kept."""
    entry = json.loads((REGRESSIONS / finding).read_text())
    check(bytes.fromhex(entry["input_hex"]), tmp_path / "views")

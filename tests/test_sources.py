"""Every kind of source URL on every scheme, against real local servers.

One set of GNU tar shards is served as: S3 (moto), an HTTP server with folder listings,
ETag and Last-Modified, an HTTP "hub" that lists nothing and redirects every file to a second
server (as the Hugging Face hub sends downloads to its CDN), ``file://``, a plain path and
fsspec's memory filesystem. For each, ``shardfs index`` takes a folder, a brace pattern, a
single ``.tar`` URL and globs where the store lists; s3, http and file are also mounted and
read through FUSE, compared by SHA-256.
"""

from __future__ import annotations

import bz2
import errno
import gzip
import hashlib
import io
import lzma
import os
import re
import shutil
import subprocess
import tarfile
from collections.abc import Iterator
from contextlib import redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import fsspec
import pytest
from support.datagen import make_imagefolder, pack_with_gnu_tar, sha256_tree
from support.http_servers import FakeHub, FileServer
from support.mounts import assert_one_error_line, mount, new_bucket, umount
from support.processes import is_mounted, run_shardfs
from support.s3 import S3Server, free_port

from shardfs import cli
from shardfs.index.db import SIDECAR_NAME
from shardfs.store.urls import shard_patterns

# data/shard-000000..2.tar and data/more/shard-000003.tar: a folder holds 4 shards, a glob
# without ** only the 3 at its own level.
FOLDER_SHARDS = 4


@dataclass(frozen=True)
class Site:
    """The source tree, the folder holding ``data/``, and the servers that serve it."""

    src: Path
    root: Path
    listing: FileServer
    hub: FileServer
    cdn: FileServer
    bucket: str

    def shard(self, number: int) -> Path:
        folder = self.root / "data" / ("more" if number == 3 else "")
        return folder / f"shard-{number:06d}.tar"


@pytest.fixture(scope="module")
def site(s3_server: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    base = tmp_path_factory.mktemp("sources")
    src = base / "src"
    make_imagefolder(src, {"cat": 5, "dog": 4, "ελάφι": 3})
    shards = pack_with_gnu_tar(src, base / "packed", files_per_shard=[4, 3, 3, 2])
    assert len(shards) == FOLDER_SHARDS
    data = base / "site" / "data"
    (data / "more").mkdir(parents=True)
    for number, shard in enumerate(shards):
        shutil.copy(shard, data / ("more" if number == 3 else "") / shard.name)
    (data / "notes.txt").write_text("not a shard\n")
    bucket = new_bucket(s3_server, "sources")
    s3_server.upload_dir(base / "site", bucket)
    with (
        FileServer(base / "site") as listing,
        FileServer(base / "site", listing=False) as cdn,
        FileServer(base / "site", listing=False, redirect_to=cdn.url) as hub,
    ):
        yield Site(src, base / "site", listing, hub, cdn, bucket)


def data_url(site: Site, scheme: str) -> str:
    """The URL of the ``data`` folder on ``scheme``."""
    return {
        "s3": f"s3://{site.bucket}/data",
        "http": f"{site.listing.url}/data",
        "http-hub": f"{site.hub.url}/data",
        "file": f"file://{site.root}/data",
        "path": f"{site.root}/data",
    }[scheme]


BRACE = "/shard-{000000..000002}.tar"
SINGLE = "/shard-000001.tar"
# (suffix, shards it names)
FORMS: dict[str, tuple[str, int]] = {
    "folder": ("/", FOLDER_SHARDS),
    "brace": (BRACE, 3),
    "nested-brace": ("/{shard-{000000..000001},more/shard-000003}.tar", 3),
    "single": (SINGLE, 1),
    "glob-star": ("/shard-*.tar", 3),
    "glob-class": ("/shard-00000[02].tar", 2),
    "glob-question": ("/shard-00000?.tar", 3),
    "glob-deep": ("/**/*.tar", FOLDER_SHARDS),
}
LISTING_SCHEMES = ("s3", "http", "file", "path")
CASES = [(scheme, form) for scheme in LISTING_SCHEMES for form in FORMS] + [
    ("http-hub", form) for form in ("brace", "nested-brace", "single")
]


def indexed_count(stdout: str) -> int:
    match = re.search(r"indexed (\d+) shards?", stdout)
    assert match is not None, stdout
    return int(match.group(1))


@pytest.mark.parametrize(("scheme", "form"), CASES)
def test_index_every_form_on_every_scheme(
    scheme: str, form: str, site: Site, s3_server: S3Server, tmp_path: Path
) -> None:
    suffix, expected = FORMS[form]
    source = data_url(site, scheme) + suffix
    result = run_shardfs("index", source, "--cache-dir", tmp_path, env=s3_server.env())
    assert result.returncode == 0, f"{source}: {result.stderr}"
    assert indexed_count(result.stdout) == expected
    assert "Traceback" not in result.stderr
    assert "no version check" not in result.stderr  # every one of these stores has versions


@pytest.mark.parametrize("form", sorted(FORMS))
def test_index_every_form_on_memory(form: str, site: Site, tmp_path: Path) -> None:
    """fsspec's memory filesystem lives in one process, so the CLI runs in this one."""
    fs = fsspec.filesystem("memory")
    prefix = f"/sources-{os.getpid()}-{form}"
    for path in site.root.rglob("*"):
        if path.is_file():
            fs.pipe_file(f"{prefix}/{path.relative_to(site.root).as_posix()}", path.read_bytes())
    suffix, expected = FORMS[form]
    out = io.StringIO()
    with redirect_stdout(out):
        code = cli.main(["index", f"memory://{prefix}/data{suffix}", "--cache-dir", str(tmp_path)])
    assert code == 0
    assert indexed_count(out.getvalue()) == expected


# -- real mounts, read through FUSE ---------------------------------------------------------


MOUNTS = {
    "s3": "/",
    "http": "/",
    "http-hub": "/{shard-{000000..000002},more/shard-000003}.tar",
    "file": "/**/shard-*.tar",
    "path": "/",
}


@pytest.mark.integration
@pytest.mark.parametrize("scheme", sorted(MOUNTS))
def test_mount_reads_every_file_by_sha256(
    scheme: str, site: Site, s3_server: S3Server, mountpoint: Path, tmp_path: Path
) -> None:
    site.listing.reset_counts()
    site.hub.reset_counts()
    site.cdn.reset_counts()
    source = data_url(site, scheme) + MOUNTS[scheme]
    mount(source, mountpoint, tmp_path / "cache", env=s3_server.env())
    try:
        assert sha256_tree(mountpoint) == expected_tree(site)
    finally:
        umount(mountpoint)
    if scheme == "http":
        assert site.listing.counts["GET-range"] > 0  # the bytes came over HTTP ranges
    if scheme == "http-hub":
        # Each shard's HEAD and every ranged GET reached the files through a redirect.
        assert site.cdn.counts["HEAD"] == FOLDER_SHARDS
        assert site.cdn.counts["GET-range"] > 0
        assert site.hub.counts["redirect"] == site.cdn.counts["HEAD"] + site.cdn.counts["GET"]


def expected_tree(site: Site) -> dict[str, str]:
    """The raw view of data/: each shard's files under the shard's folder."""
    tree = {}
    for number in range(FOLDER_SHARDS):
        folder = "more/" if number == 3 else ""
        tree.update({folder + n: h for n, h in members(site.shard(number)).items()})
    assert sorted(h for h in tree.values()) == sorted(sha256_tree(site.src).values())
    return tree


def members(shard: Path) -> dict[str, str]:
    with tarfile.open(shard) as tar:
        return {
            m.name: hashlib.sha256(tar.extractfile(m).read()).hexdigest()  # type: ignore[union-attr]
            for m in tar.getmembers()
            if m.isfile()
        }


@pytest.mark.integration
@pytest.mark.parametrize("scheme", ["s3", "http", "http-hub", "file"])
def test_mount_single_tar_url(
    scheme: str, site: Site, s3_server: S3Server, mountpoint: Path, tmp_path: Path
) -> None:
    mount(data_url(site, scheme) + SINGLE, mountpoint, tmp_path / "cache", env=s3_server.env())
    try:
        assert sha256_tree(mountpoint) == members(site.shard(1))
    finally:
        umount(mountpoint)


# -- messages ---------------------------------------------------------------------------------


def test_http_brace_pattern_with_a_missing_shard_is_one_line(site: Site, tmp_path: Path) -> None:
    source = f"{site.hub.url}/data/shard-{{000000..000005}}.tar"
    result = run_shardfs("index", source, "--cache-dir", tmp_path)
    line = assert_one_error_line(result)
    assert result.returncode == 3
    assert "3 of 6 shard(s)" in line  # 000003 lives in more/
    assert line.endswith(f"first: {site.hub.url}/data/shard-000003.tar")


def test_http_folder_on_a_server_without_listings_says_to_use_a_pattern(
    site: Site, tmp_path: Path
) -> None:
    result = run_shardfs("index", f"{site.hub.url}/data/", "--cache-dir", tmp_path)
    line = assert_one_error_line(result)
    assert result.returncode == 3
    assert "the folder URL answered 404 Not Found" in line
    assert "brace pattern" in line


def test_http_folder_on_a_dead_port_says_cannot_connect(tmp_path: Path) -> None:
    """A folder URL, a glob and a single .tar on a port where nothing listens: the same
    line and exit code for each, never "no *.tar links found"."""
    port = free_port()  # bound, then closed: nothing listens there
    base = f"http://127.0.0.1:{port}/shards"
    for source in (f"{base}/", f"{base}/shard-*.tar", f"{base}/shard-000000.tar"):
        result = run_shardfs("index", source, "--cache-dir", tmp_path)
        line = assert_one_error_line(result)
        assert result.returncode == 3, (source, line)
        assert line == (
            f"shardfs: error: {source}: cannot connect to 127.0.0.1:{port} (connection refused)"
        )


@pytest.mark.integration
def test_mount_of_a_folder_url_on_a_dead_port_says_cannot_connect(
    tmp_path: Path, mountpoint: Path
) -> None:
    port = free_port()
    source = f"http://127.0.0.1:{port}/shards/"
    result = run_shardfs("mount", source, mountpoint, "--cache-dir", tmp_path / "cache")
    line = assert_one_error_line(result)
    assert result.returncode == 3
    assert (
        line == f"shardfs: error: {source}: cannot connect to 127.0.0.1:{port} (connection refused)"
    )
    assert not is_mounted(mountpoint)


def test_http_folder_that_answers_404_says_so(site: Site, tmp_path: Path) -> None:
    for source in (f"{site.listing.url}/nothing-here/", f"{site.listing.url}/nothing/*.tar"):
        site.listing.reset_counts()
        result = run_shardfs("index", source, "--cache-dir", tmp_path)
        line = assert_one_error_line(result)
        assert result.returncode == 3
        assert line.startswith(f"shardfs: error: {source}: the folder URL answered 404 Not Found")
        assert "links found" not in line
        assert site.listing.counts["GET"] > 0  # the server was asked, and said 404


# -- writes to a store that only serves files -----------------------------------------------


@pytest.mark.parametrize(
    ("status", "answer"), [(501, "501 Not Implemented"), (405, "405 Method Not Allowed"),
                           (403, "403 Forbidden")],
)  # fmt: skip
def test_pack_and_sidecar_to_an_http_store_are_one_line(
    status: int, answer: str, site: Site, tmp_path: Path
) -> None:
    with FileServer(site.root, put_status=status) as server:
        result = run_shardfs("pack", site.src, f"{server.url}/packed/")
        line = assert_one_error_line(result)
        assert result.returncode == 3
        assert line == (
            f"shardfs: error: cannot write to {server.url}/packed/.shardfs-pack.json: HTTP "
            f"stores are read-only (the server answered {answer} to PUT)"
        )
        puts = server.counts["PUT"]
        assert puts == 1  # the first write fails, and nothing is packed after it

        result = run_shardfs(
            "index", f"{server.url}/data/", "--write-sidecar", "--cache-dir", tmp_path
        )
        line = assert_one_error_line(result)
        assert result.returncode == 3
        assert line == (
            f"shardfs: error: cannot write to {server.url}/data/{SIDECAR_NAME}: HTTP stores "
            f"are read-only (the server answered {answer} to PUT)"
        )
        assert server.counts["PUT"] == puts + 1


@pytest.mark.parametrize(
    ("scheme", "suffix", "expected"),
    [
        ("s3", "/shard-000009.tar", "not found"),
        ("http", "/shard-000009.tar", "not found"),
        ("path", "/shard-000009.tar", "not found"),
        ("s3", "/shard-9*.tar", f"no {shard_patterns()} shards match the pattern"),
        ("path", "/shard-9*.tar", f"no {shard_patterns()} shards match the pattern"),
        (
            "http",
            "/shard-9*.tar",
            f"no {shard_patterns()} links match the pattern in the server's folder listing",
        ),
    ],
)
def test_missing_single_tar_or_empty_glob_is_one_line(
    scheme: str, suffix: str, expected: str, site: Site, s3_server: S3Server, tmp_path: Path
) -> None:
    source = data_url(site, scheme) + suffix
    result = run_shardfs("index", source, "--cache-dir", tmp_path, env=s3_server.env())
    line = assert_one_error_line(result)
    assert result.returncode == 3
    assert line == f"shardfs: error: {source}: {expected}", line


def test_server_without_validators_is_warned_about_once(site: Site, tmp_path: Path) -> None:
    with FileServer(site.root, etag=False, last_modified=False) as bare:
        result = run_shardfs("index", f"{bare.url}/data/", "--cache-dir", tmp_path)
    assert result.returncode == 0, result.stderr
    assert indexed_count(result.stdout) == FOLDER_SHARDS
    warnings = [line for line in result.stderr.splitlines() if "no version check" in line]
    assert len(warnings) == 1, result.stderr
    assert "may be served mixed" in warnings[0]


@pytest.mark.integration
def test_mount_of_a_server_without_validators_says_so(
    site: Site, mountpoint: Path, tmp_path: Path
) -> None:
    """The warning reaches the terminal of a backgrounded mount, not only the daemon's log."""
    with FileServer(site.root, etag=False, last_modified=False) as bare:
        result = mount(f"{bare.url}/data/", mountpoint, tmp_path / "cache", env={})
        try:
            warnings = [line for line in result.stderr.splitlines() if "no version check" in line]
            assert len(warnings) == 1, result.stderr
            assert warnings[0].startswith("shardfs: warning: ")
        finally:
            umount(mountpoint)


# -- compressed tars --------------------------------------------------------------------------


def compress(shard: Path, out: Path) -> Path:
    """``shard``'s bytes compressed as ``out``'s suffix says (zstd's own command for
    .tar.zst, Python's gzip, bz2 and lzma for the others), as ``tar -a`` would write them."""
    if out.name.endswith(".tar.zst"):
        subprocess.run(["zstd", "-q", "-o", out, shard], check=True)
        return out
    opener = gzip.open if out.name.endswith((".tar.gz", ".tgz")) else None
    opener = opener or {".bz2": bz2.open, ".xz": lzma.open}[out.suffix]
    with opener(out, "wb") as handle:
        handle.write(shard.read_bytes())
    return out


@dataclass(frozen=True)
class Compressed:
    """``only/``: one shard compressed each way; ``mixed/``: two .tar and two compressed."""

    root: Path
    server: FileServer
    only: list[str]


@pytest.fixture(scope="module")
def compressed(site: Site, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Compressed]:
    root = tmp_path_factory.mktemp("compressed")
    (root / "only").mkdir()
    suffixes = [".tar.bz2", ".tar.xz"]  # .tar.gz and .tgz are shards (formats.tar_gz)
    if shutil.which("zstd"):
        suffixes.append(".tar.zst")
    only = [compress(site.shard(0), root / "only" / f"s{suffix}").name for suffix in suffixes]
    (root / "mixed").mkdir()
    for number in (0, 1):
        shutil.copy(site.shard(number), root / "mixed")
    compress(site.shard(2), root / "mixed" / "shard-000002.tar.bz2")
    compress(site.shard(3), root / "mixed" / "shard-000003.tar.xz")
    with FileServer(root) as server:
        yield Compressed(root, server, sorted(only))


def test_a_compressed_tar_is_named_as_unsupported(compressed: Compressed, tmp_path: Path) -> None:
    """One .tar.bz2 (local or HTTP), a brace pattern or a glob of them: one line, exit 2,
    before the store is asked."""
    local = compressed.root / "mixed"
    cases = {
        str(local / "shard-000002.tar.bz2"): "it (bunzip2 shard-000002.tar.bz2)",
        f"{compressed.server.url}/mixed/shard-000003.tar.xz": "it (unxz shard-000003.tar.xz)",
        f"{local}/shard-00000{{2,3}}.tar.bz2": "them (bunzip2 ...)",
        f"{local}/*.txz": "it (unxz *.txz)",
    }
    for source, how in cases.items():
        result = run_shardfs("index", source, "--cache-dir", tmp_path)
        line = assert_one_error_line(result)
        assert result.returncode == 2, line
        assert line == (
            f"shardfs: error: {source}: compressed tars are not supported yet; decompress "
            f"{how} or repack the files with shardfs pack"
        )


def test_a_folder_of_compressed_tars_only_names_them(
    compressed: Compressed, tmp_path: Path
) -> None:
    count, first = len(compressed.only), compressed.only[0]
    for source in (str(compressed.root / "only"), f"{compressed.server.url}/only/"):
        result = run_shardfs("index", source, "--cache-dir", tmp_path)
        line = assert_one_error_line(result)
        assert result.returncode == 3
        assert line.startswith(
            f"shardfs: error: {source}: no {shard_patterns()} shards found, only {count} "
            "compressed tars "
            f"(first: {first}): compressed tars are not supported yet; decompress them"
        ), line


def test_a_folder_with_tars_and_compressed_tars_indexes_the_tars_and_warns_once(
    compressed: Compressed, tmp_path: Path
) -> None:
    for source in (str(compressed.root / "mixed"), f"{compressed.server.url}/mixed/"):
        result = run_shardfs("index", source, "--cache-dir", tmp_path)
        assert result.returncode == 0, result.stderr
        assert indexed_count(result.stdout) == 2
        assert result.stderr.splitlines() == [
            f"shardfs: warning: {source}: skipped 2 compressed tars (first: shard-000002.tar.bz2): "
            "compressed tars are not supported yet; decompress them (bunzip2 ...) or repack the "
            "files with shardfs pack"
        ]


@pytest.mark.integration
def test_mount_of_a_folder_with_compressed_tars_serves_the_tars_and_warns_once(
    compressed: Compressed, site: Site, mountpoint: Path, tmp_path: Path
) -> None:
    result = mount(str(compressed.root / "mixed"), mountpoint, tmp_path / "cache", env={})
    try:
        warnings = [line for line in result.stderr.splitlines() if "compressed" in line]
        assert len(warnings) == 1, result.stderr
        assert warnings[0].startswith("shardfs: warning: ")
        assert "skipped 2 compressed tars" in warnings[0]
        assert sha256_tree(mountpoint) == {**members(site.shard(0)), **members(site.shard(1))}
    finally:
        umount(mountpoint)


# -- a shard replaced on the server after the mount -----------------------------------------


def _replace_same_size(path: Path, bump_mtime: bool) -> None:
    """Another version of the same length: only a version check can tell them apart."""
    stat = path.stat()
    data = bytearray(path.read_bytes())
    for i in range(512, len(data) - 1024):  # past the first header, before the end blocks
        data[i] ^= 0xFF
    fresh = path.with_name(path.name + ".new")
    fresh.write_bytes(bytes(data))
    if bump_mtime:  # Last-Modified has one-second steps
        os.utime(fresh, (stat.st_atime + 5, stat.st_mtime + 5))
    else:
        os.utime(fresh, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    os.replace(fresh, path)


@pytest.mark.integration
@pytest.mark.parametrize("validator", ["etag", "last-modified"])
def test_shard_replaced_on_the_http_server_fails_never_mixes(
    validator: str, site: Site, mountpoint: Path, tmp_path: Path
) -> None:
    root = tmp_path / "site"
    shutil.copytree(site.root / "data", root)
    victim = root / "shard-000001.tar"
    before = members(victim)
    with FileServer(root, etag=validator == "etag") as server:
        mount(f"{server.url}/", mountpoint, tmp_path / "cache", "--no-cache", env={})
        try:
            _replace_same_size(victim, bump_mtime=validator == "last-modified")
            outcomes: dict[str, str | int] = {}
            for name in before:
                try:
                    outcomes[name] = hashlib.sha256((mountpoint / name).read_bytes()).hexdigest()
                except OSError as exc:
                    outcomes[name] = exc.errno or -1
            refused = server.counts["412"]
        finally:
            umount(mountpoint)
    served = {n: h for n, h in outcomes.items() if isinstance(h, str)}
    assert served == {}, f"bytes were served after the shard changed: {served}"
    assert set(outcomes.values()) <= {errno.ESTALE, errno.EIO}, outcomes
    assert refused >= 1, "the server never refused a request for the old version"


# -- unit: how a source URL is split -------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "root", "names", "globs"),
    [
        ("s3://b/p/", "s3://b/p", None, None),
        ("s3://b/p/shard-000000.tar", "s3://b/p", ("shard-000000.tar",), None),
        ("s3://b/p/s-{0..1}.tar", "s3://b/p", ("s-0.tar", "s-1.tar"), None),
        ("s3://b/p/{x,y}/s.tar", "s3://b/p", ("x/s.tar", "y/s.tar"), None),
        ("s3://b/p/s-*.tar", "s3://b/p", None, ("s-*.tar",)),
        ("s3://b/p/x*/s-{0..1}.tar", "s3://b/p", None, ("x*/s-0.tar", "x*/s-1.tar")),
        ("https://h/d/s-[0-9].tar", "https://h/d", None, ("s-[0-9].tar",)),
        ("https://h/s.tar", "https://h", ("s.tar",), None),
        ("https://h", "https://h", None, None),
        ("/data/s-?.tar", "/data", None, ("s-?.tar",)),
        ("s-?.tar", ".", None, ("s-?.tar",)),
        ("s.tar", ".", ("s.tar",), None),
        ("file:///d/s.tar", "file:///d", ("s.tar",), None),
    ],
)
def test_select_splits_root_and_names(
    url: str, root: str, names: tuple[str, ...] | None, globs: tuple[str, ...] | None
) -> None:
    from shardfs.store.urls import select

    selection = select(url)
    assert (selection.root, selection.names, selection.globs) == (root, names, globs)


@pytest.mark.parametrize(
    ("pattern", "matches", "misses"),
    [
        ("s-*.tar", ["s-1.tar", "s-.tar"], ["x/s-1.tar", "s-1.tar.gz"]),
        ("s-?.tar", ["s-1.tar"], ["s-10.tar", "s-/.tar"]),
        ("s-[02].tar", ["s-0.tar", "s-2.tar"], ["s-1.tar"]),
        ("s-[!02].tar", ["s-1.tar"], ["s-0.tar"]),
        ("**/s.tar", ["s.tar", "a/s.tar", "a/b/s.tar"], ["as.tar"]),
        ("a/**", ["a/x.tar", "a/b/x.tar"], ["b/x.tar"]),
        ("s+(1).tar", ["s+(1).tar"], ["ss(1).tar"]),
    ],
)
def test_glob_regex(pattern: str, matches: list[str], misses: list[str]) -> None:
    from shardfs.store.urls import glob_regex

    regex = glob_regex(pattern)
    assert [m for m in matches if not regex.fullmatch(m)] == []
    assert [m for m in misses if regex.fullmatch(m)] == []


def test_a_wildcard_in_the_bucket_is_a_usage_error() -> None:
    from shardfs.errors import UsageError
    from shardfs.store.urls import select

    with pytest.raises(UsageError, match="bucket or host"):
        select("s3://b*/x.tar")


# -- hf:// through huggingface_hub's HfFileSystem, against a fake hub ------------------------


@pytest.fixture(scope="module")
def fake_hub(site: Site, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The environment that points huggingface_hub at a fake hub serving ``site.root``."""
    pytest.importorskip("huggingface_hub", reason="the hf extra is not installed")
    home = tmp_path_factory.mktemp("hf-home")
    with FakeHub(site.root) as hub:
        yield {
            "HF_ENDPOINT": hub.url,
            "HF_HOME": str(home),
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_HUB_OFFLINE": "0",
        }


HF_DATA = "hf://datasets/org/shards/data"


@pytest.mark.parametrize("form", ["folder", "brace", "nested-brace", "single", "glob-star"])
def test_index_every_form_on_hf(form: str, fake_hub: dict[str, str], tmp_path: Path) -> None:
    suffix, expected = FORMS[form]
    result = run_shardfs("index", HF_DATA + suffix, "--cache-dir", tmp_path, env=fake_hub)
    assert result.returncode == 0, result.stderr
    assert indexed_count(result.stdout) == expected
    assert "no version check" in result.stderr  # hf reads are checked by length only


@pytest.mark.integration
def test_mount_hf_reads_every_file_by_sha256(
    site: Site, fake_hub: dict[str, str], mountpoint: Path, tmp_path: Path
) -> None:
    mount(HF_DATA + "/", mountpoint, tmp_path / "cache", env=fake_hub)
    try:
        assert sha256_tree(mountpoint) == expected_tree(site)
    finally:
        umount(mountpoint)


# -- several sources on one command line, mounted as one tree ---------------------------------


@dataclass(frozen=True)
class Tars:
    """Two trees packed by GNU tar into one shard each, both named shard-000000.tar; both
    trees hold ``shared/readme.txt``, with different bytes."""

    first: Path
    second: Path
    trees: tuple[Path, Path]


@pytest.fixture(scope="module")
def tars(tmp_path_factory: pytest.TempPathFactory) -> Tars:
    base = tmp_path_factory.mktemp("several")
    shards = []
    for name, classes in (("one", {"ant": 3}), ("two", {"emu": 2})):
        tree = base / name
        make_imagefolder(tree, classes)
        (tree / "shared").mkdir()
        (tree / "shared" / "readme.txt").write_text(f"the {name} tree\n")
        (shard,) = pack_with_gnu_tar(tree, base / f"{name}-shards", files_per_shard=100)
        shards.append(shard)
    return Tars(shards[0], shards[1], (base / "one", base / "two"))


def merged(*trees: Path) -> dict[str, str]:
    """What the mount of ``trees``' shards shows: every file, the later tree's on a clash."""
    out: dict[str, str] = {}
    for tree in trees:
        out.update(sha256_tree(tree))
    return out


@pytest.mark.integration
def test_two_tars_mount_as_one_tree_where_the_later_wins_a_path(
    tars: Tars, mountpoint: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    one, two = tars.trees
    for shards, trees in (
        ((tars.first, tars.second), (one, two)),
        ((tars.second, tars.first), (two, one)),
    ):
        result = run_shardfs("mount", *shards, mountpoint, "--cache-dir", cache)
        assert result.returncode == 0, result.stderr
        try:
            assert result.stdout.startswith(f"mounted {shards[0]}, {shards[1]} at {mountpoint}")
            assert sha256_tree(mountpoint) == merged(*trees)
            readme = (mountpoint / "shared/readme.txt").read_text()
            assert readme == f"the {trees[1].name} tree\n"
            # The duplicate is reported like one across shards, naming the source that wins.
            assert "the one in shard-000000.tar (source 2) is served" in result.stderr
        finally:
            umount(mountpoint)


@pytest.mark.integration
def test_sources_on_different_stores_mount_as_one_tree(
    site: Site, tars: Tars, s3_server: S3Server, mountpoint: Path, tmp_path: Path
) -> None:
    """An S3 prefix and a local tar: every file of both, by SHA-256."""
    source = data_url(site, "s3") + "/"
    result = run_shardfs(
        "mount", source, tars.second, mountpoint, "--cache-dir", tmp_path, env=s3_server.env()
    )
    assert result.returncode == 0, result.stderr
    try:
        assert sha256_tree(mountpoint) == {**expected_tree(site), **sha256_tree(tars.trees[1])}
        from shardfs.mount.table import find_mount

        entry = find_mount(mountpoint)
        assert entry is not None and entry.source == f"{source},{tars.second}"
    finally:
        umount(mountpoint, s3_server.env())


def test_index_warm_and_verify_take_several_sources_as_mount_does(
    tars: Tars, tmp_path: Path
) -> None:
    cache = ("--cache-dir", str(tmp_path / "cache"))
    both = (tars.first, tars.second)
    first = run_shardfs("index", *both, *cache)
    assert first.returncode == 0, first.stderr
    assert "indexed 2 shards (2 scanned)" in first.stdout
    again = run_shardfs("index", *both, *cache)
    assert "indexed 2 shards (0 scanned)" in again.stdout  # the same index, keyed by both
    reordered = run_shardfs("index", *reversed(both), *cache)
    assert "indexed 2 shards (2 scanned)" in reordered.stdout  # another tree: its own index

    warmed = run_shardfs("warm", *both, *cache)
    assert warmed.returncode == 0, warmed.stderr
    assert warmed.stdout.startswith("warmed 2 shards: ")

    tree = tmp_path / "merged"
    for source_tree in tars.trees:
        shutil.copytree(source_tree, tree, dirs_exist_ok=True)
    verified = run_shardfs("verify", tree, *both, *cache)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert verified.stdout.startswith("verified: ")
    wrong = run_shardfs("verify", tree, *reversed(both), *cache)
    assert wrong.returncode == 4  # shared/readme.txt comes from the other tree
    assert "1 with different bytes (e.g. 'shared/readme.txt')" in wrong.stderr

    sidecar = run_shardfs("index", *both, *cache, "--write-sidecar")
    line = assert_one_error_line(sidecar)
    assert sidecar.returncode == 2
    assert "--write-sidecar takes one SOURCE" in line

"""The format registry and the listing agree on which names are shards, and a registered
scanner's rows land under the shard's folder."""

from __future__ import annotations

from shardfs.formats.members import MemberRow
from shardfs.formats.registry import SCANNERS, scanner_for
from shardfs.formats.source import BytesShard, ShardBytes
from shardfs.store.urls import SHARD_SUFFIXES, is_shard_name


def test_every_registered_suffix_is_listed_as_a_shard() -> None:
    assert ".tar" in SHARD_SUFFIXES
    for suffix in SCANNERS:
        assert suffix in SHARD_SUFFIXES, suffix
        assert is_shard_name(f"data/train-00000{suffix}")


def test_a_tar_shard_has_no_scanner_and_other_names_are_not_shards() -> None:
    assert scanner_for("a/b/shard-000001.tar") is None
    assert not is_shard_name("a/readme.txt")
    assert not is_shard_name("a/shard.tar.zst")
    assert is_shard_name("a/shard.tar.gz") and is_shard_name("a/shard.tgz")


def test_bytes_shard_reads_ranges_and_stops_at_the_end() -> None:
    shard = BytesShard("s.bin", b"0123456789")
    assert (shard.name, shard.size) == ("s.bin", 10)
    assert shard.read_at(2, 3) == b"234"
    assert shard.read_at(8, 10) == b"89"
    assert shard.reads == 2


def test_rows_of_a_scanned_shard_go_under_its_folder(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from shardfs.index import scan
    from shardfs.store.shards import ShardInfo

    seen: list[str] = []

    def fake_scanner(source: ShardBytes) -> list[MemberRow]:
        seen.append(source.name)
        return [("cat/1.jpg", 10, 4, 0o644, 0, 0, "", 3)]

    monkeypatch.setitem(SCANNERS, ".fake", fake_scanner)
    from shardfs.config import SourceConfig

    class _NoStore:  # the fake scanner reads nothing
        config = SourceConfig("unused")

    rows = scan.scan_shard(_NoStore(), ShardInfo("part/a.fake", 100, "e"))  # type: ignore[arg-type]
    assert seen == ["part/a.fake"]
    assert rows == [("part/cat/1.jpg", 10, 4, 0o644, 0, 0, "", 3)]


def test_a_format_given_reads_any_name_as_that_format() -> None:
    from shardfs.formats.mds import scan_mds, scan_mds_zstd
    from shardfs.formats.registry import reads_whole_blocks
    from shardfs.formats.zip import scan_zip

    assert scanner_for("x.bin", "zip") is scan_zip and reads_whole_blocks("x.bin", "zip")
    assert scanner_for("x.zip", "tar") is None  # read as a tar, whatever its name
    assert scanner_for("x.mds.zstd", "mds") is scan_mds_zstd
    assert scanner_for("x.data", "mds") is scan_mds and not reads_whole_blocks("x.data", "mds")
    assert is_shard_name("a.zip", "zip") and not is_shard_name("a.tar", "zip")


def test_a_set_of_sources_keeps_each_shards_format(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Several sources name their shards ``NAME (source N)``: the format still comes from
    NAME's suffix."""
    from shardfs.config import SourceConfig
    from shardfs.index import scan
    from shardfs.store.sets import name_in_source
    from shardfs.store.shards import ShardInfo

    assert name_in_source("d/a.zip (source 2)") == "d/a.zip"
    assert name_in_source("d/a (source x).zip") == "d/a (source x).zip"
    seen: list[str] = []
    monkeypatch.setitem(SCANNERS, ".zip", lambda source: seen.append(source.name) or [])

    class _NoStore:
        config = SourceConfig("unused")

    assert scan.scan_shard(_NoStore(), ShardInfo("d/a.zip (source 2)", 10, "e")) == []  # type: ignore[arg-type]
    assert seen == ["d/a.zip (source 2)"]

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
    assert not is_shard_name("a/shard.tar.gz")


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
    rows = scan.scan_shard(None, ShardInfo("part/a.fake", 100, "e"))  # type: ignore[arg-type]
    assert seen == ["part/a.fake"]
    assert rows == [("part/cat/1.jpg", 10, 4, 0o644, 0, 0, "", 3)]

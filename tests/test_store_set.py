"""Several sources as one store (``shardfs mount A B MNT``): shard names that say their
source, reads routed to the source that holds the shard, one index keyed by every source in
order, each source's sidecars and ``classes.txt``, and the duplicate rule: the later source
wins, as the later shard does. Against fsspec's memory filesystem; the mounts are in
``tests/test_sources.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.tarbuild import make_tar, memory_url, put, store_with

from shardfs.config import IndexConfig, SourceConfig, ViewConfig
from shardfs.dataset import open_source
from shardfs.errors import UsageError
from shardfs.index.db import IndexBuilder, write_sidecar
from shardfs.read.seam import shard_key_of
from shardfs.store.remote import Store
from shardfs.store.sets import StoreSet, open_store


def source_of(*urls: str) -> SourceConfig:
    return SourceConfig(url=urls[0], extra_urls=urls[1:])


@pytest.fixture
def two() -> tuple[str, str]:
    """Two sources whose shards share a name (``s.tar``) and one member path."""
    first, second = memory_url(), memory_url()
    put(first, "s.tar", make_tar([("both.txt", b"first"), ("one.txt", b"1")]))
    put(second, "s.tar", make_tar([("both.txt", b"second"), ("sub/two.txt", b"22")]))
    put(second, "sub/t.tar", make_tar([("three.txt", b"333")]))
    return first, second


def test_one_source_is_a_plain_store_several_a_set(two: tuple[str, str]) -> None:
    assert type(open_store(source_of(two[0]))) is Store
    assert isinstance(open_store(source_of(*two)), StoreSet)


def test_names_say_their_source_and_reads_reach_it(two: tuple[str, str]) -> None:
    store = open_store(source_of(*two))
    shards = store.list_shards()
    assert [s.name for s in shards] == [
        "s.tar (source 1)",
        "s.tar (source 2)",
        "sub/t.tar (source 2)",
    ]
    first, second = (Store(SourceConfig(url)) for url in two)
    owners = [(first, first.list_shards()[0])] + [(second, s) for s in second.list_shards()]
    for shard, (part, own) in zip(shards, owners, strict=True):
        assert (shard.size, shard.etag) == (own.size, own.etag)
        data = store.read_range(shard, 0, shard.size)
        assert data == part.read_range(own, 0, own.size)
        # The block cache keys a shard by where it lives: a mount of the source alone
        # shares the blocks.
        assert shard_key_of(store, shard, 1 << 20) == shard_key_of(part, own, 1 << 20)
        with store.open_stream(shard) as stream:
            assert stream.read(shard.size) == data


def test_the_index_is_keyed_by_every_source_in_order(two: tuple[str, str]) -> None:
    identities = {
        open_store(source_of(*urls)).identity
        for urls in (two, tuple(reversed(two)), (two[0],), (two[1],), (*two, two[0]))
    }
    assert len(identities) == 5


def test_a_name_of_no_source_is_a_bug_not_a_read(two: tuple[str, str]) -> None:
    store = open_store(source_of(*two))
    (shard, *_) = store.list_shards()
    for name in ("s.tar", "s.tar (source 3)", "s.tar (source x)"):
        with pytest.raises(ValueError, match="names no shard"):
            store.read_range(type(shard)(name, shard.size, shard.etag), 0, 1)


def test_objects_next_to_the_shards_are_one_sources(two: tuple[str, str]) -> None:
    store = open_store(source_of(*two))
    with pytest.raises(UsageError, match="takes one source"):
        store.write_object("x", b"")
    assert [suffix for _, suffix in store.parts()] == [" (source 1)", " (source 2)"]


def open_tree(source: SourceConfig, cache: Path, **view: object) -> dict[str, bytes]:
    """Every file of the view ``source`` mounts as, by path."""
    opened = open_source(source, IndexConfig(cache_dir=cache), ViewConfig(**view))  # type: ignore[arg-type]
    try:
        return {
            path: opened.store.read_range(
                opened.view.shards[node.shard], node.offset, node.offset + node.size
            )
            for path, node in opened.view.files()
        }
    finally:
        opened.close()


def test_one_tree_where_the_later_source_wins_a_path(two: tuple[str, str], tmp_path: Path) -> None:
    assert open_tree(source_of(*two), tmp_path, layout="raw") == {
        "both.txt": b"second",
        "one.txt": b"1",
        "sub/two.txt": b"22",
        "sub/three.txt": b"333",
    }
    assert open_tree(source_of(*reversed(two)), tmp_path, layout="raw")["both.txt"] == b"first"


def test_each_sources_sidecar_spares_its_scan(two: tuple[str, str], tmp_path: Path) -> None:
    for url in two:
        alone = Store(SourceConfig(url))
        built = IndexBuilder(alone, IndexConfig(cache_dir=tmp_path / "alone"))
        write_sidecar(alone, built.build(alone.list_shards()))
    store = open_store(source_of(*two))
    builder = IndexBuilder(store, IndexConfig(cache_dir=tmp_path / "set"))
    builder.build(store.list_shards())
    assert builder.scanned_shards == 0
    scanned = open_tree(source_of(*two), tmp_path / "scan", layout="raw")
    assert open_tree(source_of(*two), tmp_path / "set", layout="raw") == scanned


def labelled(*names: str) -> bytes:
    return make_tar(
        [(f"{name}.png", name.encode()) for name in names]
        + [(f"{name}.cls", b"0") for name in names]
    )


def test_classes_txt_of_each_source_name_its_labels(tmp_path: Path) -> None:
    first = store_with({"a.tar": labelled("k1"), "classes.txt": b"cat\n"}).config.url
    second = store_with({"b.tar": labelled("k2"), "classes.txt": b"cat\n"}).config.url
    tree = open_tree(source_of(first, second), tmp_path / "same", layout="imagefolder")
    assert sorted(tree) == ["cat/k1.png", "cat/k2.png"]

    put(second, "classes.txt", b"dog\n")
    with pytest.raises(UsageError, match=r"classes\.txt differs from the one of"):
        open_tree(source_of(first, second), tmp_path / "differ", layout="imagefolder")

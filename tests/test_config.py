"""Configuration parsing: sizes and ``-o key=value`` storage options."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from shardfs.config import (
    IndexConfig,
    ReadConfig,
    default_cache_dir,
    parse_size,
    parse_storage_option,
    storage_options_from_pairs,
)
from shardfs.errors import UsageError


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0),
        ("512", 512),
        ("64K", 64 << 10),
        ("64k", 64 << 10),
        ("64KB", 64 << 10),
        ("64KiB", 64 << 10),
        ("256MB", 256 << 20),
        ("256mib", 256 << 20),
        ("500G", 500 << 30),
        ("2T", 2 << 40),
        ("1.5TiB", 3 << 39),
        ("0.5M", 512 << 10),
        ("10B", 10),
        (" 8M ", 8 << 20),
    ],
)
def test_parse_size_units(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "   ", "B", "K", "abc", "12X", "1.2.3", "-1", "-2K"])
def test_parse_size_rejects_garbage(text: str) -> None:
    with pytest.raises(UsageError) as info:
        parse_size(text)
    assert repr(text) in str(info.value)


@pytest.mark.parametrize("text", ["inf", "nan", "infK", "-inf"])
def test_parse_size_rejects_non_finite(text: str) -> None:
    # float() accepts these; they must still be a UsageError, not an OverflowError/ValueError.
    with pytest.raises(UsageError):
        parse_size(text)


def test_storage_option_values_decode_as_json_else_stay_strings() -> None:
    options = storage_options_from_pairs(
        [
            "anon=true",
            "use_ssl=False",
            "max_attempts=5",
            "ratio=0.25",
            "nothing=null",
            "profile=default",
            "token=a=b=c",
            "empty=",
            'headers={"x-a": "1"}',
            "ids=[1, 2]",
            "version_aware=TRUE",
        ]
    )
    assert options == {
        "anon": True,
        "use_ssl": False,
        "max_attempts": 5,
        "ratio": 0.25,
        "nothing": None,
        "profile": "default",
        "token": "a=b=c",
        "empty": "",
        "headers": {"x-a": "1"},
        "ids": [1, 2],
        "version_aware": True,
    }


def test_storage_option_dotted_keys_nest() -> None:
    options = storage_options_from_pairs(
        [
            "client_kwargs.region_name=eu-west-1",
            "client_kwargs.endpoint_url=http://localhost:9000",
            "config_kwargs.s3.addressing_style=path",
            "anon=false",
        ]
    )
    assert options == {
        "client_kwargs": {"region_name": "eu-west-1", "endpoint_url": "http://localhost:9000"},
        "config_kwargs": {"s3": {"addressing_style": "path"}},
        "anon": False,
    }


def test_storage_option_later_flag_overrides_earlier() -> None:
    assert storage_options_from_pairs(["anon=true", "anon=false"]) == {"anon": False}


@pytest.mark.parametrize("text", ["anon", "=true", "", "=", ".=x"])
def test_storage_option_must_be_key_value(text: str) -> None:
    with pytest.raises(UsageError):
        storage_options_from_pairs([text])


def test_parse_storage_option_names_the_bad_text() -> None:
    with pytest.raises(UsageError, match="'anon'"):
        parse_storage_option("anon")


@pytest.mark.parametrize(
    "pairs",
    [
        ["client_kwargs=1", "client_kwargs.region_name=x"],
        ["a.b=1", "a.b.c=2"],
        # The other order must not silently throw away the nested options either.
        ["client_kwargs.region_name=x", "client_kwargs=1"],
    ],
)
def test_storage_option_conflicts(pairs: list[str]) -> None:
    with pytest.raises(UsageError, match="conflicts"):
        storage_options_from_pairs(pairs)


def test_default_cache_dir_prefers_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SHARDFS_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("SHARDFS_CACHE_DIR")
    assert default_cache_dir() == tmp_path / "xdg" / "shardfs"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "shardfs"


def test_configs_are_frozen_with_documented_defaults(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("SHARDFS_CACHE_DIR", str(tmp_path))
    read = ReadConfig()
    assert (read.whole_file_limit, read.window, read.retries) == (8 << 20, 8 << 20, 4)
    index = IndexConfig()
    assert index.cache_dir == tmp_path
    assert (index.skip_bad_shards, index.scan_workers, index.use_sidecar) == (False, 8, True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        read.window = 1  # type: ignore[misc]

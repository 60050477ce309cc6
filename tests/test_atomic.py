"""A file replaced through ``atomic.replacing`` is whole or untouched, and no temp file stays."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardfs.atomic import replacing


def test_the_new_file_replaces_the_old_one_whole(tmp_path: Path) -> None:
    final = tmp_path / "index.sqlite"
    final.write_bytes(b"old")
    with replacing(final, prefix=".build-", suffix=".sqlite") as temp:
        assert temp.parent == tmp_path and temp != final
        temp.write_bytes(b"new contents")
        assert final.read_bytes() == b"old"  # not before the block ends
    assert final.read_bytes() == b"new contents"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index.sqlite"]


def test_a_failure_keeps_the_old_file_and_leaves_no_temp_file(tmp_path: Path) -> None:
    final = tmp_path / "view.sqlite"
    final.write_bytes(b"old")
    with pytest.raises(RuntimeError), replacing(final, prefix=".view-") as temp:
        temp.write_bytes(b"half")
        raise RuntimeError("the build failed")
    assert final.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["view.sqlite"]

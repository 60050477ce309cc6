"""The index scan's progress bar."""

from __future__ import annotations

from shardfs.daemon import update_progress_bar


def test_index_progress_reaches_the_bar_as_numbers() -> None:
    """The scan's progress travels as numbers to the bar (parsed once where it arrives as
    text from the daemon's pipe)."""
    bar = update_progress_bar(None, 1, 4, 1000, 8000)
    bar = update_progress_bar(bar, 3, 4, 5000, 8000)
    assert (bar.n, bar.total) == (5000, 8000)  # type: ignore[attr-defined]
    assert bar.postfix == "3/4 shards"  # type: ignore[attr-defined]
    bar.close()  # type: ignore[attr-defined]

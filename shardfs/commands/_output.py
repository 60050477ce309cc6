"""What several commands print on stderr besides errors: notices and the index-scan bar."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # index loads fsspec; the CLI starts without it
    from ..index import Progress


def notice(text: str) -> None:
    print(f"shardfs: {text}", file=sys.stderr)


def progress_printer() -> Progress | None:
    """A tqdm bar for index scans when stderr is a terminal."""
    if not sys.stderr.isatty():
        return None
    from ..daemon import update_progress_bar

    state: dict[str, object] = {}

    def progress(done: int, total: int, done_bytes: int, total_bytes: int) -> None:
        state["bar"] = update_progress_bar(state.get("bar"), done, total, done_bytes, total_bytes)

    return progress

"""What several commands print on stderr besides errors: notices and the index-scan bar."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # index loads fsspec; the CLI starts without it
    from ..index.db import Progress


def notice(text: str) -> None:
    print(f"shardfs: {text}", file=sys.stderr)


def progress_printer() -> Progress | None:
    """A bar for index scans when stderr is a terminal (``progress_bar.scan_progress``)."""
    from ..tools.progress import scan_progress

    return scan_progress()

"""Progress bars on stderr (tqdm) for work that takes a while: index scans, warm, pack and
verify. A bar shows only when stderr is a terminal, only once its work has run for
``SHOW_AFTER`` seconds, and on any terminal: one that reports no size (a pseudo-terminal
nobody sized, as under many remote shells, containers and CI runners) gets 80 columns,
where tqdm would take the zero size for a screen too small to draw on and show nothing.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:  # index loads fsspec; the CLI starts without it
    from ..index.db import Progress

SHOW_AFTER = 1.0
"""Seconds of work before a bar is drawn: a short scan leaves no bar behind."""
TICK = 0.5
"""Seconds between redraws of a bar that gets no news."""
FALLBACK_SIZE = (80, 24)
"""Columns and rows of a terminal that reports none."""


def shows_progress() -> bool:
    """Whether bars are drawn: stderr is a terminal."""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced, or closed
        return False


def _size_if_unreported(stream: IO[str]) -> tuple[int, int] | None:
    """FALLBACK_SIZE (its columns from ``$COLUMNS`` if set) where the terminal reports no
    size, else None: tqdm then follows the terminal's own size, resizes included."""
    try:
        columns = os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, ValueError, OSError):
        columns = 0
    if columns > 0:
        return None
    wanted = os.environ.get("COLUMNS", "")
    columns = int(wanted) if wanted.isdigit() and int(wanted) > 0 else FALLBACK_SIZE[0]
    return columns, FALLBACK_SIZE[1]


def new_bar(desc: str, total: int | None = None, unit: str = "B") -> Any:
    """A tqdm bar on stderr (bytes by default), drawn after SHOW_AFTER seconds and redrawn
    every TICK seconds until it is closed, so that its clock runs while the work sends no
    news (one large shard)."""
    from tqdm import tqdm

    size = _size_if_unreported(sys.stderr)
    bar = tqdm(
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=unit == "B",
        file=sys.stderr,
        delay=SHOW_AFTER,
        ncols=size[0] if size else None,
        nrows=size[1] if size else None,
    )

    def keep_ticking() -> None:
        while not bar.disable:  # closed
            time.sleep(TICK)
            _tick(bar)

    threading.Thread(target=keep_ticking, name="shardfs-progress", daemon=True).start()
    return bar


def _tick(bar: Any) -> None:
    """Redraw ``bar`` if it is open and shows (under tqdm's lock, as its updates are)."""
    with bar.get_lock():
        if not bar.disable and bar._time() >= bar.start_t + bar.delay:
            bar.refresh(nolock=True)


def update_progress_bar(
    bar: Any | None, done: int, total: int, done_bytes: int, total_bytes: int
) -> Any:
    """Show an index scan's progress (shards and bytes done of total) on a bar, made at the
    first call and closed (left on screen, if it showed) at the last; returns the bar for
    the next call. A scan that starts after that one gets a bar of its own."""
    if bar is None or (bar.disable and done < total):
        bar = new_bar("indexing shards", total_bytes)
    bar.set_postfix_str(f"{done}/{total} shards", refresh=False)
    bar.update(done_bytes - bar.n)  # draws, once the bar shows, at most every 0.1 s
    if done == total:
        bar.close()
    return bar


def scan_progress() -> Progress | None:
    """An index scan's progress callback that draws a bar, when stderr is a terminal."""
    if not shows_progress():
        return None
    state: dict[str, Any] = {}

    def progress(done: int, total: int, done_bytes: int, total_bytes: int) -> None:
        state["bar"] = update_progress_bar(state.get("bar"), done, total, done_bytes, total_bytes)

    return progress

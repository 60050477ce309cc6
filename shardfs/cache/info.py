"""``cache info``: what a cache folder holds, read without a mount (a damaged ledger is
rebuilt first)."""

from __future__ import annotations

import contextlib
import os
import sqlite3
from pathlib import Path

from .ledger import LEDGER, heal_cache_folder, ledger_damaged, ledger_totals


def cache_info(cache_dir: Path) -> dict[str, int | str]:
    """What is in a cache folder; a damaged ledger is rebuilt first (one warning)."""
    info: dict[str, int | str] = {"cache_dir": str(cache_dir)}
    db_path = cache_dir / LEDGER
    blocks = used = 0
    if os.path.lexists(db_path):
        try:
            blocks, used = ledger_totals(db_path)
        except sqlite3.Error as exc:
            if ledger_damaged(exc, db_path) or "no such table" in str(exc):
                with contextlib.suppress(OSError, sqlite3.Error):
                    heal_cache_folder(cache_dir)
            with contextlib.suppress(sqlite3.Error):
                blocks, used = ledger_totals(db_path)
    info["blocks"] = blocks
    info["block_bytes"] = used
    for name in ("index", "views"):
        folder = cache_dir / name
        files = list(folder.glob("*.sqlite")) if folder.is_dir() else []
        sizes = []
        for path in files:
            with contextlib.suppress(OSError):
                sizes.append(path.stat().st_size)
        info[f"{name}_files"] = len(sizes)
        info[f"{name}_bytes"] = sum(sizes)
    return info

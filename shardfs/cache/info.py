"""``cache info`` and ``cache clear``: a cache folder as a whole, without a mount (a damaged
ledger is rebuilt first)."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sqlite3
import uuid
from pathlib import Path

from .ledger import (
    LEDGER,
    empty_ledger,
    heal_cache_folder,
    ledger_damaged,
    ledger_totals,
    read_total,
)
from .writer import remove_any

log = logging.getLogger(__name__)


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


def _move_blocks(blocks_dir: Path, trash: Path) -> None:
    """Move every block away in one step, leaving an empty blocks folder."""
    if blocks_dir.exists():
        os.rename(blocks_dir, trash)
    blocks_dir.mkdir(exist_ok=True)


def clear_cache(cache_dir: Path, *, everything: bool = False) -> int:
    """Drop every cached block (and with ``everything`` the indexes and views).

    Safe while mounts use the folder: the blocks folder is renamed away in one step, so a
    reader either still holds an open block (valid until closed) or misses and refetches.
    Returns the number of bytes the bookkeeping said were used. A damaged ledger or lock
    file is repaired first (one warning), so clearing always works.
    """
    blocks_dir = cache_dir / "blocks"
    used = 0
    db_path = cache_dir / LEDGER
    if os.path.lexists(db_path):
        with contextlib.suppress(OSError, sqlite3.OperationalError):  # full disk: see below
            heal_cache_folder(cache_dir)
        trash = cache_dir / f"trash-{uuid.uuid4().hex[:8]}"
        try:
            conn = sqlite3.connect(db_path, timeout=30, isolation_level=None)
            try:
                conn.execute("BEGIN IMMEDIATE")
                used = read_total(conn)
                _move_blocks(blocks_dir, trash)
                try:
                    empty_ledger(conn)
                except sqlite3.OperationalError:
                    # A full disk cannot take the ledger's write: free the blocks, retry.
                    conn.execute("ROLLBACK")
                    shutil.rmtree(trash, ignore_errors=True)
                    conn.execute("BEGIN IMMEDIATE")
                    empty_ledger(conn)
            finally:
                conn.close()
        except sqlite3.OperationalError as exc:
            # Still no room (the disk is full of other files): no block is left, so an
            # absent ledger is the right one; the next mount starts a new one.
            log.warning("cache ledger not writable (%s); removed it", exc)
            _move_blocks(blocks_dir, trash)
            for suffix in ("", "-wal", "-shm"):
                remove_any(Path(f"{db_path}{suffix}"))
        shutil.rmtree(trash, ignore_errors=True)
    elif blocks_dir.exists():
        shutil.rmtree(blocks_dir, ignore_errors=True)
    if everything:
        for name in ("index", "views"):
            remove_any(cache_dir / name)
    return used

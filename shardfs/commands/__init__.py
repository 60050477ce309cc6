"""The ``shardfs`` commands, one module each: its arguments, its help text and its run
function, gathered in a ``Command``. Modules whose names start with ``_`` hold what several
commands share (flags, configuration builders, notices); ``cli`` builds the parser from
``COMMANDS`` and turns errors into one line."""

from __future__ import annotations

from . import cache, index, mount, pack, stats, umount, verify, warm
from ._command import Command

# In the order ``shardfs --help`` lists them.
COMMANDS: tuple[Command, ...] = (
    mount.COMMAND,
    warm.COMMAND,
    pack.COMMAND,
    verify.COMMAND,
    stats.COMMAND,
    cache.COMMAND,
    umount.COMMAND,
    index.COMMAND,
)

__all__ = ["COMMANDS", "Command"]

"""What every command module hands the parser: its name, its help text, how to add its
arguments and how to run it. The parser in ``cli`` is built from these alone."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    """One ``shardfs`` command."""

    name: str
    summary: str  # the line in ``shardfs --help``
    description: str  # the paragraph at the top of ``shardfs NAME --help``
    examples: tuple[str, ...]  # command lines shown at the end of ``shardfs NAME --help``
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]  # returns the exit code

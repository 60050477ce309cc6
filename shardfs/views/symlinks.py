"""Symlinks judged on a finished tree by walking each target as the Linux kernel would:
one whose walk could leave the mount, or loops, is unsafe (the view leaves it out)."""

from __future__ import annotations

import collections
import enum
import sqlite3
from dataclasses import dataclass
from typing import NamedTuple

from ..formats.tar import MemberKind
from .nodes import ROOT_INO

MAX_LINK_HOPS = 40
"""Linux's MAXSYMLINKS: a path walk that would follow a 41st symlink fails with ELOOP."""


class End(enum.Enum):
    """How the kernel's walk of a symlink's target ends."""

    DIRECTORY = "directory"  # at a folder (``Resolved.folder``)
    OTHER = "other"  # at a file
    FAILS = "fails"  # ENOENT or ENOTDIR inside the mount: harmless
    ESCAPES = "escapes"  # '..' above the mount root, or an absolute target
    LOOPS = "loops"  # a cycle, or more than MAX_LINK_HOPS links: ELOOP


HARMLESS = frozenset({End.DIRECTORY, End.OTHER, End.FAILS})


class Resolved(NamedTuple):
    end: End
    folder: int  # the folder reached, for DIRECTORY
    hops: int  # symlinks followed, the link itself included; 0 only marks a cycle found


class UnsafeLink(NamedTuple):
    ino: int
    parent: int
    name: str
    target: str
    end: End


@dataclass
class Walk:
    """Where the walk of one symlink's target stands."""

    link: int
    parts: list[str]
    folder: int
    step: int = 0
    hops: int = 1


class LinkJudge:
    """Resolves the symlinks of a finished tree the way the Linux path walk would.

    A walk starts in the link's folder and takes the target one component at a time; every
    symlink met (in the middle or at the end) is followed, '..' moves to the folder's real
    parent and, at the mount root, out of the mount. Each link is resolved once, from a
    fresh start; its result and the number of links it followed are reused by every walk
    that meets it, so the work is one lookup per target component. Walks nest on an explicit
    stack of at most MAX_LINK_HOPS frames, never on Python's.

    A link is unsafe if its walk, in the tree before anything is dropped, leaves the mount at
    any moment or loops. Dropping a link only turns walks that meet it into ENOENT there; a
    walk that meets an unsafe link is itself unsafe, so every kept link walks exactly as
    judged and no second pass is needed.
    """

    def __init__(self, conn: sqlite3.Connection, parents: list[int]) -> None:
        self.conn = conn
        self.parents = parents  # folder inode -> its parent's inode
        self.results: dict[int, Resolved] = {}

    def unsafe_links(self) -> list[UnsafeLink]:
        unsafe = []
        rows = self.conn.execute(
            "SELECT ino, parent, name, link FROM nodes WHERE kind = ? ORDER BY ino",
            (int(MemberKind.SYMLINK),),
        ).fetchall()
        for ino, parent, name, target in rows:
            end = self.resolve(ino, parent, target).end
            if end not in HARMLESS:
                unsafe.append(UnsafeLink(ino, parent, name, target, end))
        return unsafe

    def resolve(self, link: int, folder: int, target: str) -> Resolved:
        """What following symlink ``link`` (in ``folder``) from a fresh start comes to."""
        done = self.results.get(link)
        if done is not None:
            return done
        stack = collections.deque([_start(link, folder, target)])
        walking = {link}
        while stack:
            walk = stack[-1]
            outcome = self._advance(walk, walking)
            if isinstance(outcome, Walk):  # a symlink met whose result is unknown: resolve it
                stack.append(outcome)
                walking.add(outcome.link)
                if len(stack) > MAX_LINK_HOPS:
                    # The bottom walk follows at least one link per walk above it: ELOOP.
                    # Those above are still resolved, each from its own fresh start.
                    bottom = stack.popleft()
                    walking.discard(bottom.link)
                    self.results[bottom.link] = Resolved(End.LOOPS, 0, MAX_LINK_HOPS + 1)
                continue
            if outcome.hops == 0:
                # A cycle: each walk on the stack waits for one that waits for itself.
                for waiting in stack:
                    self.results[waiting.link] = Resolved(End.LOOPS, 0, MAX_LINK_HOPS + 1)
                break
            stack.pop()
            walking.discard(walk.link)
            self.results[walk.link] = outcome
        return self.results[link]

    def _advance(self, walk: Walk, walking: set[int]) -> Resolved | Walk:
        """Walk on to the end, or to a symlink that has to be resolved first."""
        parts = walk.parts
        if not parts:
            return Resolved(End.FAILS, 0, walk.hops)  # an empty target: ENOENT
        while True:
            part = parts[walk.step]
            if part == "/":
                return Resolved(End.ESCAPES, 0, walk.hops)
            if part == ".":
                end, folder = End.DIRECTORY, walk.folder
            elif part == "..":
                if walk.folder == ROOT_INO:
                    return Resolved(End.ESCAPES, 0, walk.hops)
                end, folder = End.DIRECTORY, self.parents[walk.folder]
            else:
                row = self.conn.execute(
                    "SELECT ino, kind, link FROM nodes WHERE parent = ? AND name = ?",
                    (walk.folder, part),
                ).fetchone()
                if row is None:
                    return Resolved(End.FAILS, 0, walk.hops)
                ino, kind, target = row
                if kind == MemberKind.DIRECTORY:
                    end, folder = End.DIRECTORY, ino
                elif kind != MemberKind.SYMLINK:
                    end, folder = End.OTHER, 0
                elif ino in walking:
                    return Resolved(End.LOOPS, 0, 0)
                else:
                    known = self.results.get(ino)
                    if known is None:
                        return _start(ino, walk.folder, target)
                    walk.hops += known.hops
                    if known.end not in HARMLESS:
                        return Resolved(known.end, 0, walk.hops)
                    if walk.hops > MAX_LINK_HOPS:
                        return Resolved(End.LOOPS, 0, walk.hops)
                    end, folder = known.end, known.folder
            if walk.step == len(parts) - 1:
                return Resolved(end, folder, walk.hops)
            if end != End.DIRECTORY:
                return Resolved(End.FAILS, 0, walk.hops)  # ENOTDIR, or ENOENT below
            walk.folder = folder
            walk.step += 1


def _start(link: int, folder: int, target: str) -> Walk:
    """The walk of ``target`` from ``folder``; an absolute target is the single part '/'."""
    if target.startswith("/"):
        return Walk(link, ["/"], folder)
    parts = [part for part in target.split("/") if part]
    if parts and target.endswith("/"):
        parts.append(".")  # 'name/' has to be a folder
    return Walk(link, parts, folder)

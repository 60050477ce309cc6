"""Symlinks in the raw view: each is judged by walking its target through the finished tree
the way the Linux kernel would, and left out if that walk leaves the mount or loops.

The random trees at the end are also built on the local disk, where the kernel's own
answer (open with O_PATH, then /proc/self/fd) checks the model these tests rely on.
"""

from __future__ import annotations

import errno
import itertools
import os
import random
import sys
import time
from pathlib import Path

import pytest
from support.tarbuild import Entry, directory, make_tar, store_with, symlink

import shardfs.formats.members
from shardfs.config import IndexConfig, ViewConfig
from shardfs.errors import NotFoundError
from shardfs.formats.tar import MemberKind
from shardfs.index.db import IndexBuilder
from shardfs.views.symlinks import MAX_LINK_HOPS
from shardfs.views.view import View, ViewReport, build_view

_counter = itertools.count()


def build(tmp_path: Path, *shards: list[Entry]) -> tuple[View, ViewReport]:
    """The raw view of shards s0.tar, s1.tar, ... holding ``shards`` in that order."""
    store = store_with({f"s{i}.tar": make_tar(entries) for i, entries in enumerate(shards)})
    index = IndexBuilder(store, IndexConfig(cache_dir=tmp_path / "cache")).build(
        store.list_shards()
    )
    out = tmp_path / "views" / f"v{next(_counter)}.sqlite"
    report = build_view(index, out, ViewConfig(layout="raw"), lambda _folder: None)
    return View(out), report


def exists(view: View, path: str) -> bool:
    try:
        view.lookup(path)
    except NotFoundError:
        return False
    return True


def links(view: View) -> dict[str, str]:
    """Every symlink of the view with its target, found without recursion."""
    found: dict[str, str] = {}
    folders = [("", view.root)]
    while folders:
        path, folder = folders.pop()
        for name, node in view.children(folder):
            full = f"{path}/{name}" if path else name
            if node.is_dir:
                folders.append((full, node))
            elif node.kind == MemberKind.SYMLINK:
                found[full] = node.link
    return found


def chain(prefix: str, count: int, end: str) -> list[Entry]:
    """``prefix0 -> prefix1 -> ... -> prefix{count-1} -> end``, names zero-padded."""
    names = [f"{prefix}{i:05d}" for i in range(count)]
    return [symlink(name, nxt) for name, nxt in zip(names, [*names[1:], end], strict=True)]


# --- the reported attack and its relatives ------------------------------------------------------


def test_reported_attack_chain_is_left_out_and_named(tmp_path: Path) -> None:
    view, report = build(
        tmp_path,
        [
            ("h/file.txt", b"inside"),
            symlink("h/up", "../../../../../../../.."),
            symlink("h/passwd", "up/../../../../../../../../etc/passwd"),
        ],
    )
    assert links(view) == {}
    assert exists(view, "h/file.txt")
    assert report.dropped_links == 2
    assert any("'h/up'" in e and "outside the mount" in e for e in report.examples["link"])
    assert any("'h/passwd'" in e and "outside the mount" in e for e in report.examples["link"])


def test_ladder_that_a_textual_check_accepts_is_left_out(tmp_path: Path) -> None:
    # Each 'up' is one level down in the text but one level up in the kernel's walk, so
    # the text of 'passwd' stays inside while its walk climbs 16 levels above the mount.
    depth = 16
    folder = "/".join(["h"] * depth)
    entries: list[Entry] = [("top.txt", b"top")]
    entries += [symlink("/".join(["h"] * level + ["up"]), "..") for level in range(1, depth + 1)]
    entries.append(symlink(f"{folder}/passwd", "up/" * depth + "../" * 2 * depth + "etc/passwd"))
    entries.append(symlink(f"{folder}/home", "up/" * depth + "top.txt"))
    view, report = build(tmp_path, entries)
    kept = links(view)
    assert f"{folder}/passwd" not in kept
    assert kept[f"{folder}/home"] == "up/" * depth + "top.txt"
    assert len(kept) == depth + 1  # every 'up' (each reaches a folder inside) and 'home'
    assert report.dropped_links == 1


def test_escape_then_return_counts_as_an_escape(tmp_path: Path) -> None:
    view, report = build(
        tmp_path,
        [("d/f", b"f"), symlink("d/back", "../../mnt/d/f"), symlink("d/ok", "../d/f")],
    )
    assert links(view) == {"d/ok": "../d/f"}
    assert report.dropped_links == 1


@pytest.mark.parametrize("depth", [0, 1, 2, 5, 30])
def test_dotdot_at_every_depth(tmp_path: Path, depth: int) -> None:
    folder = "/".join(f"d{i}" for i in range(depth))
    at = f"{folder}/" if folder else ""
    view, report = build(
        tmp_path,
        [
            ("top.txt", b"top"),
            symlink(f"{at}to_top", "../" * depth + "top.txt"),
            symlink(f"{at}to_root", "../" * depth if depth else "."),
            symlink(f"{at}above", "../" * (depth + 1) + "top.txt"),
            symlink(f"{at}above_slash", "../" * depth + ".."),
        ],
    )
    assert set(links(view)) == {f"{at}to_top", f"{at}to_root"}
    assert report.dropped_links == 2


@pytest.mark.parametrize("target", ["/etc/passwd", "/", "//etc", "/tmp/../etc"])
def test_absolute_targets_are_left_out(tmp_path: Path, target: str) -> None:
    view, report = build(tmp_path, [("f", b"f"), symlink("d/abs", target)])
    assert links(view) == {}
    assert report.dropped_links == 1
    assert exists(view, "d")  # the folder the link was in stays, empty


def test_links_to_files_that_remain_are_kept_with_their_target(tmp_path: Path) -> None:
    view, report = build(
        tmp_path,
        [
            ("d/file.txt", b"inner"),
            ("top.txt", b"top"),
            symlink("d/sibling", "file.txt"),
            symlink("d/up", "../top.txt"),
            symlink("d/dot", "./file.txt"),
            symlink("d/slashes", ".//file.txt"),
            symlink("d/e/deep", "../../d/file.txt"),
            symlink("to_dir", "d"),
            symlink("to_dir_slash", "d/"),
            symlink("through", "to_dir/sibling"),
            symlink("through_up", "to_dir/../top.txt"),
            symlink("dangling", "d/missing.txt"),
        ],
    )
    assert links(view) == {
        "d/sibling": "file.txt",
        "d/up": "../top.txt",
        "d/dot": "./file.txt",
        "d/slashes": ".//file.txt",
        "d/e/deep": "../../d/file.txt",
        "to_dir": "d",
        "to_dir_slash": "d/",
        "through": "to_dir/sibling",
        "through_up": "to_dir/../top.txt",
        "dangling": "d/missing.txt",
    }
    assert report.dropped_links == 0
    node = view.lookup("through")
    assert (node.kind, node.size) == (MemberKind.SYMLINK, len("to_dir/sibling"))


def test_link_to_a_folder_moves_dotdot_to_the_real_parent(tmp_path: Path) -> None:
    # 'a/b/down' reaches the folder 'x/y/z'; '..' from there climbs x/y/z, not a/b.
    view, report = build(
        tmp_path,
        [
            directory("x/y/z"),
            symlink("a/b/down", "../../x/y/z"),
            symlink("a/b/fine", "down/../../../a"),  # z -> y -> x -> root, then 'a'
            symlink("a/b/out", "down/../../../.."),  # one more: above the root
        ],
    )
    assert set(links(view)) == {"a/b/down", "a/b/fine"}
    assert report.dropped_links == 1


# --- missing and non-folder components ------------------------------------------------------


def test_missing_or_file_component_stops_the_walk_before_its_dotdots(tmp_path: Path) -> None:
    # The kernel fails at 'nothere' (ENOENT) or 'file' (ENOTDIR) and never reads the
    # '..' after it: these dangle inside the mount and are harmless.
    view, report = build(
        tmp_path,
        [
            ("file", b"f"),
            symlink("a", "nothere/../../x"),
            symlink("b", "file/../../x"),
            symlink("c", ""),  # ENOENT too
            symlink("d", "file/"),
        ],
    )
    assert set(links(view)) == {"a", "b", "c", "d"}
    assert report.dropped_links == 0


# --- loops and the 40-link limit ------------------------------------------------------------


def test_cycles_and_self_loops_are_left_out(tmp_path: Path) -> None:
    view, report = build(
        tmp_path,
        [
            ("f", b"f"),
            symlink("a", "b"),
            symlink("b", "a"),
            symlink("self", "self"),
            symlink("d/dotself", "./dotself"),
            symlink("d/roundabout", "../d/roundabout"),
            symlink("into_loop", "a"),
            symlink("loop_as_folder", "b/x"),
            symlink("d/ring1", "ring2/f"),  # a loop only through folder components
            symlink("d/ring2", "ring3"),
            symlink("d/ring3", "ring1/.."),
            symlink("fine", "f"),
        ],
    )
    assert links(view) == {"fine": "f"}
    assert report.dropped_links == 10
    assert any("loops" in e for e in report.examples["link"])


@pytest.mark.parametrize("reverse", [False, True])
def test_forty_links_are_followed_forty_one_are_not(tmp_path: Path, reverse: bool) -> None:
    # c00000 -> c00001 -> ... -> c00040 -> f: following c00000 takes 41 links.
    entries: list[Entry] = [("f", b"f"), *chain("c", MAX_LINK_HOPS + 1, "f")]
    if reverse:  # resolved from the far end first: the memo is used, not rebuilt
        entries = [entries[0], *reversed(entries[1:])]
    view, report = build(tmp_path, entries)
    kept = links(view)
    assert "c00000" not in kept
    assert set(kept) == {f"c{i:05d}" for i in range(1, MAX_LINK_HOPS + 1)}
    assert report.dropped_links == 1
    assert any("'c00000'" in e and "more than 40 links" in e for e in report.examples["link"])


def test_forty_links_through_folder_components_count_too(tmp_path: Path) -> None:
    # d00000 -> d00001 -> ... -> d00039 -> real (a folder); 'x' goes through all 40
    # and then one more link inside the folder: 41.
    entries: list[Entry] = [("real/f", b"f"), symlink("real/l", "f")]
    entries += chain("d", MAX_LINK_HOPS, "real")
    entries += [symlink("x40", "d00000/f"), symlink("x41", "d00000/l")]
    view, report = build(tmp_path, entries)
    kept = links(view)
    assert "x40" not in kept  # 40 links in the chain + x40 itself
    assert "x41" not in kept
    assert "d00000" in kept and "d00001" in kept
    assert report.dropped_links == 2


def test_long_chain_is_judged_in_linear_time(tmp_path: Path) -> None:
    count = 20_000
    view, report = build(tmp_path, [("f", b"f"), *chain("c", count, "f")])
    assert report.dropped_links == count - MAX_LINK_HOPS
    assert len(links(view)) == MAX_LINK_HOPS


# --- a dropped link is gone for every walk that meets it ------------------------------------


def test_links_through_a_dropped_link_are_left_out(tmp_path: Path) -> None:
    view, report = build(
        tmp_path,
        [
            ("f", b"f"),
            symlink("up", "../.."),
            symlink("via", "up"),
            symlink("via_folder", "up/etc/passwd"),
            symlink("d/via_up", "../via/x"),
            symlink("loop", "loop"),
            symlink("via_loop", "loop"),
            symlink("fine", "f"),
        ],
    )
    assert links(view) == {"fine": "f"}
    assert report.dropped_links == 6


def test_judged_after_the_duplicate_rule(tmp_path: Path) -> None:
    view, report = build(
        tmp_path,
        [
            ("f", b"f"),
            symlink("x", "f"),  # replaced by the hostile copy in s1: x is left out
            symlink("y", "../../etc"),  # replaced by a benign copy in s1: y is kept
            symlink("z", "../.."),  # a folder of the same name wins: no link to judge
            symlink("w", "../../etc"),  # replaced by a regular file
        ],
        [
            symlink("x", "../../etc/passwd"),
            symlink("y", "f"),
            ("z/inside", b"in"),
            ("w", b"w"),
        ],
    )
    assert links(view) == {"y": "f"}
    assert view.lookup("z").is_dir and view.lookup("w").kind == MemberKind.FILE
    assert report.dropped_links == 1
    assert any("'x'" in e for e in report.examples["link"])


def test_link_folder_component_becomes_a_real_folder_by_the_duplicate_rule(
    tmp_path: Path,
) -> None:
    # 'p' is a symlink in s0 that would lead out, but s1 makes 'p' a folder: 'q' walks
    # through the folder and stays inside.
    view, report = build(
        tmp_path,
        [symlink("p", "../.."), symlink("q", "p/sub/..")],
        [("p/sub/f", b"f")],
    )
    assert links(view) == {"q": "p/sub/.."}
    assert report.dropped_links == 0


# --- deep trees -----------------------------------------------------------------------------


def test_member_path_of_2000_components(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scan refuses paths deeper than MAX_PATH_DEPTH; the view must not rely on that."""
    depth = 2000
    assert depth > sys.getrecursionlimit()
    monkeypatch.setattr(shardfs.formats.members, "MAX_PATH_DEPTH", depth + 1)
    folder = "/".join(["d"] * depth)
    mid = "/".join(["d"] * 1000)
    view, report = build(
        tmp_path,
        [
            ("top.txt", b"top"),
            (f"{folder}/deep.txt", b"deep"),
            symlink(f"{mid}/home", "../" * 1000 + "top.txt"),
            symlink(f"{mid}/out", "../" * 1001 + "x"),
        ],
    )
    node = view.lookup(f"{folder}/deep.txt")
    assert (node.kind, node.size) == (MemberKind.FILE, 4)
    assert report.directories == depth + 1
    assert set(links(view)) == {f"{mid}/home"}
    assert report.dropped_links == 1
    assert not exists(view, f"{mid}/out")


# --- random trees against the kernel --------------------------------------------------------

Tree = dict[str, str]
"""path -> 'dir', 'file' or 'link:TARGET'."""

_FOLDERS = ["a", "a/b", "a/b/c", "e", "e/g"]
_NAMES = ["a", "b", "c", "e", "g", "f", "h", "l0", "l1", "l2", "l3", "zz"]


def random_tree(rng: random.Random) -> Tree:
    tree: Tree = {folder: "dir" for folder in _FOLDERS}
    for _ in range(rng.randint(1, 10)):
        where = rng.choice(["", *_FOLDERS])
        name = rng.choice(["f", "h", "l0", "l1", "l2", "l3", "m"])
        path = f"{where}/{name}" if where else name
        if path in tree:
            continue
        if name in ("f", "h"):
            tree[path] = "file"
            continue
        if rng.random() < 0.05:
            target = "/" + rng.choice(_NAMES)
        else:
            parts = [rng.choice(["..", "..", ".", *_NAMES]) for _ in range(rng.randint(1, 6))]
            target = "/".join(parts) + ("/" if rng.random() < 0.1 else "")
        tree[path] = f"link:{target}"
    return tree


def model(tree: Tree, link: str) -> str:
    """The kernel's walk of ``link``, written plainly: 'ok', 'fails', 'escapes' or 'loops'."""
    hops = 0

    def follow(path: str) -> tuple[str, list[str]]:
        nonlocal hops
        hops += 1
        if hops > MAX_LINK_HOPS:
            return "loops", []
        target = tree[path][len("link:") :]
        if target.startswith("/"):
            return "escapes", []
        where = path.split("/")[:-1]
        parts = [part for part in target.split("/") if part]
        if not parts:
            return "fails", []
        if target.endswith("/"):
            parts.append(".")
        for i, part in enumerate(parts):
            if part == ".":
                kind, reached = "dir", where
            elif part == "..":
                if not where:
                    return "escapes", []
                kind, reached = "dir", where[:-1]
            else:
                child = "/".join([*where, part])
                found = tree.get(child)
                if found is None:
                    return "fails", []
                if found.startswith("link:"):
                    end, reached = follow(child)
                    if end not in ("dir", "file"):
                        return end, []
                    kind = end
                else:
                    kind, reached = found, [*where, part]
            if i == len(parts) - 1:
                return kind, reached
            if kind != "dir":
                return "fails", []
            where = reached
        raise AssertionError("unreachable")

    end, _ = follow(link)
    return "ok" if end in ("dir", "file") else end


def kernel(root: Path, link: str) -> tuple[str, str]:
    """What the kernel makes of opening ``root/link``: (outcome, path reached)."""
    try:
        fd = os.open(root / link, os.O_PATH)
    except OSError as error:
        return errno.errorcode[error.errno or 0], ""
    try:
        reached = os.readlink(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)
    inside = reached == str(root) or reached.startswith(f"{root}/")
    return ("inside" if inside else "outside"), reached


def write_tree(root: Path, tree: Tree) -> list[Entry]:
    """Make ``tree`` on disk under ``root`` and return it as tar entries."""
    entries: list[Entry] = []
    for path, kind in sorted(tree.items()):
        if kind == "dir":
            (root / path).mkdir(parents=True)
            entries.append(directory(path))
        elif kind == "file":
            (root / path).write_bytes(path.encode())
            entries.append((path, path.encode()))
        else:
            if kind == "link:":
                continue  # an empty target cannot exist on disk
            os.symlink(kind[len("link:") :], root / path)
            entries.append(symlink(path, kind[len("link:") :]))
    return entries


def test_random_trees_agree_with_the_model_and_the_kernel(tmp_path: Path) -> None:
    """For 300 random trees: the view keeps exactly the links the model calls harmless, and
    the kernel agrees with the model wherever it can tell (the root is named 'jail', a name
    the trees never use, so a walk that left it cannot come back in)."""
    rng = random.Random(9)
    seen: dict[str, int] = {}
    for number in range(300):
        tree = random_tree(rng)
        root = tmp_path / f"t{number}" / "x" / "y" / "jail"
        root.mkdir(parents=True)
        entries = write_tree(root, tree)
        view, report = build(tmp_path / f"t{number}", entries)
        kept = links(view)
        dropped = 0
        for path, kind in tree.items():
            if not kind.startswith("link:") or kind == "link:":
                continue
            verdict = model(tree, path)
            dropped += verdict in ("loops", "escapes")
            seen[verdict] = seen.get(verdict, 0) + 1
            assert (path in kept) == (verdict in ("ok", "fails")), (path, kind, tree)
            outcome, reached = kernel(root, path)
            expected = {
                "ok": {"inside"},
                "fails": {"ENOENT", "ENOTDIR"},
                "loops": {"ELOOP"},
                "escapes": {"outside", "ENOENT", "ENOTDIR"},
            }[verdict]
            assert outcome in expected, (path, kind, verdict, outcome, reached, tree)
        assert report.dropped_links == dropped
        view.close()
    assert min(seen.values()) >= 20, seen  # every verdict was exercised


def test_kernel_follows_forty_links_and_refuses_forty_one(tmp_path: Path) -> None:
    """The limit the view applies is the one the kernel applies."""
    (tmp_path / "f").write_bytes(b"f")
    for i in range(MAX_LINK_HOPS + 1):
        nxt = f"c{i + 1:05d}" if i < MAX_LINK_HOPS else "f"
        os.symlink(nxt, tmp_path / f"c{i:05d}")
    assert (tmp_path / "c00001").read_bytes() == b"f"
    with pytest.raises(OSError) as too_many:
        (tmp_path / "c00000").read_bytes()
    assert too_many.value.errno == errno.ELOOP


def test_judging_many_links_is_fast(tmp_path: Path) -> None:
    # 2,000 links each walking through a 30-link chain: with results reused, about
    # one lookup per target component.
    entries: list[Entry] = [("f", b"f"), *chain("c", 30, "f")]
    entries += [symlink(f"many/l{i}", f"../c00000/../c{i % 30:05d}") for i in range(2000)]
    started = time.monotonic()
    view, report = build(tmp_path, entries)
    elapsed = time.monotonic() - started
    # '../c00000/..' treats the chain's end, the file 'f', as a folder: ENOTDIR, kept.
    assert report.dropped_links == 0
    assert len(links(view)) == 2030
    assert elapsed < 30, elapsed

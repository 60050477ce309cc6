"""The package tree draws the architecture: few top-level modules, packages by family, small
modules, and imports that form no cycle."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "shardfs"
TOP_LEVEL_LIMIT = 8
PACKAGE_LIMIT = 14
LINE_LIMIT = 500


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    """Every module by name, a compiled one by its stub (``.pyi``: a leaf of the graph)."""
    paths = sorted([*PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.pyi")])
    return {_module_name(p): p for p in paths}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The shardfs modules ``name`` imports, at any depth of its code: a function-level import,
    or one under ``if TYPE_CHECKING``, still ties the two modules together for a reader."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            targets = [module] + [f"{module}.{alias.name}" for alias in node.names]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    graph = {name: _imports(name, path, known) for name, path in modules.items()}
    # A package's __init__ is loaded with each of its modules: importing ``shardfs.x.y`` also
    # runs ``shardfs.x``, but that edge is Python's, not the code's, so it is left out.
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_top_level_holds_few_modules() -> None:
    top = sorted(
        p.stem for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py")
    )
    assert 0 < len(top) <= TOP_LEVEL_LIMIT, top


def test_packages_are_small_and_have_a_front_door() -> None:
    packages = [p for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"]
    assert len(packages) >= 8
    for package in packages:
        init = package / "__init__.py"
        assert init.exists(), package
        assert ast.get_docstring(ast.parse(init.read_text())), f"{package.name}: no docstring"
        modules = [p for p in package.glob("*.py") if p.name != "__init__.py"]
        assert 0 < len(modules) <= PACKAGE_LIMIT, (package.name, len(modules))


@pytest.mark.parametrize("name", sorted(_modules()))
def test_module_is_short(name: str) -> None:
    lines = len(_modules()[name].read_text().splitlines())
    assert lines <= LINE_LIMIT, f"{name}: {lines} lines"


def test_no_import_cycle() -> None:
    assert _cycles(_graph()) == []


def test_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_import_graph_sees_relative_imports() -> None:
    graph = _graph()
    assert "shardfs.errors" in graph["shardfs.cli"]
    assert "shardfs.formats.tar" in graph["shardfs.index.scan"]


# Bottom up: a module may import its own rank or lower ones only (STYLE.md's one-way flow).
LAYERS = [
    ["shardfs", "shardfs.errors", "shardfs.config", "shardfs.stats", "shardfs.atomic"],
    # The kernel's mount table is a leaf that reads /proc; the training process reaches it
    # through the placement table, so it sits at the bottom although it lives with the mount.
    ["shardfs.mount.table"],
    ["shardfs.store"],
    ["shardfs.formats"],
    ["shardfs.index"],
    ["shardfs.views"],
    ["shardfs.cache"],
    ["shardfs.read"],
    ["shardfs.placement", "shardfs.torch", "shardfs.sampling"],
    ["shardfs.core"],
    ["shardfs.fuse"],
    ["shardfs.dataset"],
    ["shardfs.mount", "shardfs.tools"],
    ["shardfs.commands", "shardfs.cli", "shardfs.__main__"],
]


def _rank(module: str) -> int:
    best, best_len = -1, -1
    for rank, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            matches = module == prefix or module.startswith(prefix + ".")
            if matches and len(prefix) > best_len:
                best, best_len = rank, len(prefix)
    assert best >= 0, f"{module} has no layer"
    return best


def _upward(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        for target in targets
        if _rank(target) > _rank(module)
    )


def test_imports_point_down() -> None:
    graph = _graph()
    assert len(graph) > 60
    assert _upward(graph) == []


def test_layer_check_sees_an_upward_import() -> None:
    graph = {"shardfs.store.remote": {"shardfs.fuse.session"}, "shardfs.fuse.session": set()}
    assert _upward(graph) == ["shardfs.store.remote -> shardfs.fuse.session"]


def test_training_side_loads_no_fuse() -> None:
    """``shardfs.torch`` reaches only the placement table and what is below it."""
    graph = _graph()
    seen, todo = set(), ["shardfs.torch"]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        todo.extend(graph[module])
    assert "shardfs.placement" in seen
    assert not [m for m in seen if m.startswith(("shardfs.fuse", "shardfs.cache", "shardfs.store"))]


ROOT = PACKAGE.parent
README_LIMIT = 300
REFERENCE_PAGES = ("sources", "layouts", "mounting", "cache", "commands", "training", "faults")
REFERENCE_PAGES += ("benchmark", "architecture", "development", "design", "packing")


def test_readme_is_a_front_page_and_the_reference_lives_in_docs() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= README_LIMIT
    first = [line.split("#")[0].strip() for line in readme.splitlines()[:6]]
    assert "make demo" in first and "make test" in first, first  # the two commands lead
    for page in REFERENCE_PAGES:
        path = ROOT / "docs" / f"{page}.md"
        assert path.exists(), path
        assert f"docs/{page}.md" in readme, f"the README does not link docs/{page}.md"


def _links(path: Path) -> list[str]:
    text = path.read_text()
    return [
        target
        for target in re.findall(r"\]\(([^)\s]+)\)", text)
        if not target.startswith(("http://", "https://", "mailto:", "#"))
    ]


@pytest.mark.parametrize(
    "page", ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
)
def test_relative_links_resolve(page: str) -> None:
    path = ROOT / page
    for target in _links(path):
        file = target.split("#", 1)[0]
        assert (path.parent / file).exists(), f"{page}: broken link {target}"

"""The public names of the package, and what importing it pulls in."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import shardfs
from shardfs import errors

PACKAGE = Path(shardfs.__file__).parent

EXPECTED = [
    "CorruptShardError",
    "FileSystemError",
    "FuseUnavailableError",
    "IndexConfig",
    "IndexFileError",
    "IsADirError",
    "MountConfig",
    "MountError",
    "NoSuchAttributeError",
    "NotADirError",
    "NotFoundError",
    "ReadConfig",
    "ReadOnlyError",
    "ShardChangedError",
    "ShardfsError",
    "SourceConfig",
    "SourceError",
    "SourceNotFoundError",
    "StoreReadError",
    "UnsafeMemberError",
    "UnsupportedMemberError",
    "UsageError",
    "ViewConfig",
    "__version__",
]


def test_all_is_pinned() -> None:
    assert sorted(shardfs.__all__) == EXPECTED
    assert len(set(shardfs.__all__)) == len(shardfs.__all__)
    for name in shardfs.__all__:
        assert hasattr(shardfs, name), name


def test_every_error_is_exported_and_rooted() -> None:
    classes = [
        value
        for value in vars(errors).values()
        if isinstance(value, type)
        and issubclass(value, Exception)
        and value.__module__ == errors.__name__
    ]
    assert sorted(cls.__name__ for cls in classes) == sorted(
        name for name in EXPECTED if name.endswith(("Error", "Error_"))
    )
    for cls in classes:
        assert issubclass(cls, shardfs.ShardfsError)
        assert cls.__doc__, cls.__name__
        assert getattr(shardfs, cls.__name__) is cls


def test_version_is_a_release_string() -> None:
    parts = shardfs.__version__.split(".")
    assert len(parts) == 3 and all(part.isdigit() for part in parts)


def _python_passes(code: str) -> None:
    """``code`` run by a fresh interpreter exits 0 (its asserts hold)."""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr


def test_importing_the_package_does_not_import_torch() -> None:
    code = (
        "import shardfs, shardfs.cli, shardfs.mount.lifecycle, shardfs.core.filesystem, sys; "
        "import shardfs.fuse.session; "
        "assert 'torch' not in sys.modules, 'torch was imported'; "
        "assert 'torchvision' not in sys.modules, 'torchvision was imported'"
    )
    _python_passes(code)


def test_importing_the_package_does_not_load_fuse_or_fsspec() -> None:
    code = (
        "import shardfs, sys; "
        "loaded = [m for m in ('shardfs.fuse.binding', 'fsspec', 'torch') if m in sys.modules]; "
        "assert not loaded, loaded"
    )
    _python_passes(code)


def test_the_daemon_of_a_local_folder_does_not_load_aiohttp() -> None:
    """aiohttp (with fsspec's HTTP and s3fs's stack, 0.15 s to import) is loaded by the
    stores that use it, not by every mount."""
    code = (
        "import shardfs.mount.lifecycle, shardfs.core.filesystem, shardfs.store.sets, sys; "
        "assert 'aiohttp' not in sys.modules, 'aiohttp was imported'"
    )
    _python_passes(code)


def test_the_mount_command_leaves_the_store_to_its_daemon(tmp_path: Path) -> None:
    """``shardfs mount`` without --classes checks its arguments and starts the daemon
    without importing the view, the index or the store (a quarter of a second)."""
    code = (
        "import sys; from shardfs.cli import build_parser; "
        "from shardfs.commands import mount; "
        f"args = build_parser().parse_args(['mount', {str(tmp_path)!r}, {str(tmp_path)!r}]); "
        "mount._view_config(args); mount._mount_config(args, mount.source_config(args)); "
        "loaded = [m for m in ('shardfs.views.view', 'shardfs.index.db', "
        "'shardfs.store.remote', 'fsspec') if m in sys.modules]; "
        "assert not loaded, loaded"
    )
    _python_passes(code)


def _imported_modules(path: Path) -> set[str]:
    """Absolute names of the shardfs modules a source file imports."""
    package = "shardfs." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts[:-1])
    package = package.rstrip(".")
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            names.add(prefix)
            names.update(f"{prefix}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_only_the_fuse_package_imports_the_binding_and_the_core_imports_no_fuse() -> None:
    outside = [p for p in PACKAGE.rglob("*.py") if "fuse" not in p.relative_to(PACKAGE).parts]
    assert len(outside) > 20
    below_fuse = ("core", "views", "read", "store", "cache", "index", "formats")
    checked = 0
    for path in outside:
        imported = _imported_modules(path)
        assert "shardfs.fuse.binding" not in imported, path
        # By package, not by file name, so that a renamed module is still checked.
        if path.relative_to(PACKAGE).parts[0] in below_fuse:
            checked += 1
            assert not any(name.startswith("shardfs.fuse") for name in imported), path
    assert checked > 30, checked  # every module of the families below the FUSE side
    inside = _imported_modules(PACKAGE / "fuse" / "operations.py")
    assert "shardfs.fuse.binding" in inside  # the check above sees relative imports

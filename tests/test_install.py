"""The core install, without extras, works for local, file:// and http:// sources.

A fresh venv gets ``pip install CHECKOUT`` (core dependencies only: no s3fs, no urllib3
unless something else pulls it in), then indexes and mounts real shards through it. It needs
the package index; where pip cannot reach it, the test skips and says so.
"""

from __future__ import annotations

import os
import subprocess
import venv
from pathlib import Path

import pytest
from support.datagen import make_imagefolder, pack_with_gnu_tar, sha256_tree
from support.http_servers import FileServer
from support.processes import is_mounted, unmount

pytestmark = pytest.mark.integration

CHECKOUT = Path(__file__).resolve().parents[1]


def _run(
    args: list[str],
    *,
    timeout: float = 300,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args, capture_output=True, text=True, timeout=timeout, check=False, env=env, cwd=cwd
    )


@pytest.fixture(scope="module")
def core_install(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The python of a fresh venv holding shardfs with its core dependencies only, and what
    the install printed (verbose, so the build backend's own warnings are in it)."""
    where = tmp_path_factory.mktemp("core-venv")
    venv.EnvBuilder(with_pip=True).create(where)
    python = where / "bin" / "python"
    result = _run(
        [str(python), "-m", "pip", "install", "-v", "--disable-pip-version-check", str(CHECKOUT)],
        timeout=600,
    )
    if result.returncode != 0:
        text = result.stderr + result.stdout
        if any(
            word in text
            for word in ("Could not find a version", "NewConnectionError", "Temporary failure")
        ):
            pytest.skip(f"pip cannot reach the package index: {text.strip().splitlines()[-1]}")
        raise AssertionError(f"core install failed:\n{text}")
    return python, result.stdout + result.stderr


@pytest.fixture(scope="module")
def core_python(core_install: tuple[Path, str]) -> Path:
    return core_install[0]


def test_core_install_builds_without_setuptools_warnings(core_install: tuple[Path, str]) -> None:
    """The build (setuptools in pip's isolated build env) warns about nothing: no
    ``project.license`` deprecation, no other SetuptoolsDeprecationWarning."""
    log = core_install[1]
    assert "running bdist_wheel" in log, "the build backend's output is not in the log"
    warnings = [line for line in log.splitlines() if "DeprecationWarning" in line]
    assert not warnings, "\n".join(warnings)


def test_core_install_has_no_s3_or_torch_packages(core_python: Path) -> None:
    code = (
        "import importlib.util as u; "
        "print([m for m in ('s3fs', 'botocore', 'torch', 'huggingface_hub') if u.find_spec(m)])"
    )
    result = _run([str(core_python), "-c", code])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_core_install_indexes_and_mounts_local_file_and_http(
    core_python: Path, tmp_path: Path, mountpoint: Path
) -> None:
    src = tmp_path / "src"
    make_imagefolder(src, {"cat": 3, "dog": 2}, long_names=False)
    shard_dir = tmp_path / "shards"
    pack_with_gnu_tar(src, shard_dir, files_per_shard=3)
    cache = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": "", "SHARDFS_CACHE_DIR": str(cache)}
    shardfs = [str(core_python), "-m", "shardfs"]
    cwd = tmp_path  # never the checkout, so the venv's installed copy is the one imported

    with FileServer(shard_dir) as server:
        for source in (str(shard_dir), f"file://{shard_dir}", f"{server.url}/"):
            result = _run([*shardfs, "index", source, "--cache-dir", str(cache)], env=env, cwd=cwd)
            assert result.returncode == 0, f"{source}: {result.stderr}"
            assert "indexed 2 shards" in result.stdout, result.stdout
            assert "Traceback" not in result.stderr

        result = _run(
            [*shardfs, "mount", f"{server.url}/", str(mountpoint), "--cache-dir", str(cache)],
            env=env,
            cwd=cwd,
        )
        try:
            assert result.returncode == 0, result.stderr
            assert sha256_tree(mountpoint) == sha256_tree(src)
        finally:
            _run([*shardfs, "umount", str(mountpoint)], env=env, cwd=cwd)
            if is_mounted(mountpoint):
                unmount(mountpoint)
    where = _run(
        [str(core_python), "-c", "import shardfs; print(shardfs.__file__)"], env=env, cwd=cwd
    )
    assert not where.stdout.startswith(str(CHECKOUT)), where.stdout

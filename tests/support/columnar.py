"""Parquet and MDS fixtures written by the real tools: a manifest of noise JPEGs with
labels, turned into files by the scripts in tests/support/writers/ run under the writers
venv (``make writers``), which holds ``datasets``, pyarrow and mosaicml-streaming apart
from the project's venv. A missing writers venv fails the test naming the fix."""

from __future__ import annotations

import json
import os
import random
import subprocess
from dataclasses import dataclass
from pathlib import Path

from support.datagen import noise_jpeg

ROOT = Path(__file__).resolve().parents[2]
WRITERS = ROOT / "tests" / "support" / "writers"
# Not alphabetical, so that a class's index in ImageFolder equals its label only if the
# mount names the folders for it.
CLASSES = ["zebra", "apple", "mango"]


def writers_python() -> Path:
    """The writers venv's python; raises (the test fails) naming ``make writers``."""
    venv = Path(os.environ.get("SHARDFS_WRITERS_VENV", ROOT / ".venv-writers"))
    python = venv / "bin" / "python"
    if not (venv / ".installed").exists() or not python.exists():
        raise AssertionError(
            f"the writers venv {venv} is missing: run `make writers` (the parquet and MDS "
            "tests write their fixtures with datasets, pyarrow and MDSWriter from it)"
        )
    return python


@dataclass(frozen=True)
class Item:
    file: Path
    name: str
    split: str
    label: int  # -1: unlabelled

    def data(self) -> bytes:
        return self.file.read_bytes()


def make_manifest(
    root: Path, counts: dict[str, int], *, seed: int = 0, image_bytes: int = 3000
) -> list[Item]:
    """Noise JPEGs per split, labels cycling over the classes; in ``validation`` the last
    class is left empty and the last image is unlabelled (-1). Writes root/manifest.json."""
    rng = random.Random(seed)
    (root / "img").mkdir(parents=True, exist_ok=True)
    items: list[Item] = []
    for split, count in counts.items():
        for index in range(count):
            path = root / "img" / f"{split}{index}.jpg"
            path.write_bytes(noise_jpeg(rng, image_bytes=image_bytes))
            if split == "validation":
                label = -1 if index == count - 1 else index % (len(CLASSES) - 1)
            else:
                label = index % len(CLASSES)
            items.append(Item(path, f"{split}_{index:03d}.jpg", split, label))
    splits: dict[str, list[dict[str, object]]] = {}
    for item in items:
        splits.setdefault(item.split, []).append(
            {"file": str(item.file), "name": item.name, "label": item.label}
        )
    (root / "manifest.json").write_text(json.dumps({"classes": CLASSES, "splits": splits}))
    return items


def write(script: str, root: Path, out: Path, *args: str) -> str:
    """Run a writer script on root/manifest.json into ``out``; its stdout (a version)."""
    result = subprocess.run(
        [
            str(writers_python()),
            str(WRITERS / script),
            str(root / "manifest.json"),
            str(out),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, f"{script} failed:\n{result.stderr[-3000:]}"
    return result.stdout.strip()

"""The bench dataset: an ImageFolder tree of real, ImageNet-sized JPEGs, cached between runs.

Each image is a 320x320 blend of a class-tinted gradient and noise; the JPEG quality is
chosen once so that images average about ``TARGET_BYTES``. The tree is written under
``WORK/tree-<images>x<classes>/train`` and reused while its ``.complete`` marker matches.
"""

from __future__ import annotations

import io
import json
import random
import shutil
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

SIDE = 320
NOISE = 0.7
TARGET_BYTES = 100_000
SEED = 1234


@dataclass(frozen=True)
class Tree:
    root: Path  # the ImageFolder root (``.../train``)
    images: int
    classes: int
    image_bytes: int
    quality: int


def _image(seed: int, label: int, quality: int) -> bytes:
    rng = random.Random(seed)
    noise = Image.frombytes("RGB", (SIDE, SIDE), rng.randbytes(SIDE * SIDE * 3))
    gradient = Image.linear_gradient("L").rotate(rng.randrange(360)).resize((SIDE, SIDE))
    tint = Image.new("RGB", (SIDE, SIDE), (37 * label % 256, 90, 255 - 23 * label % 256))
    base = Image.blend(gradient.convert("RGB"), tint, 0.5)
    out = io.BytesIO()
    Image.blend(base, noise, NOISE).save(out, "JPEG", quality=quality)
    return out.getvalue()


def choose_quality(target: int = TARGET_BYTES) -> int:
    """The JPEG quality whose images come closest to ``target`` bytes on average."""
    best, best_gap = 90, float("inf")
    for quality in range(80, 99):
        mean = sum(len(_image(i, i % 10, quality)) for i in range(8)) / 8
        if abs(mean - target) < best_gap:
            best, best_gap = quality, abs(mean - target)
    return best


def _write_class(args: tuple[Path, int, int, list[int], int]) -> int:
    folder, label, quality, seeds, _ = args
    folder.mkdir(parents=True, exist_ok=True)
    total = 0
    for seed in seeds:
        data = _image(seed, label, quality)
        (folder / f"img_{seed:07d}.jpg").write_bytes(data)
        total += len(data)
    return total


def ensure_tree(work: Path, images: int, classes: int, log: object = print) -> Tree:
    base = work / f"tree-{images}x{classes}"
    marker = base / ".complete"
    if marker.exists():
        meta = json.loads(marker.read_text())
        return Tree(base / "train", images, classes, meta["image_bytes"], meta["quality"])
    shutil.rmtree(base, ignore_errors=True)
    quality = choose_quality()
    jobs = []
    for label in range(classes):
        seeds = [SEED + i for i in range(label, images, classes)]
        jobs.append((base / "train" / f"class_{label:03d}", label, quality, seeds, 0))
    with ProcessPoolExecutor(2) as pool:
        image_bytes = sum(pool.map(_write_class, jobs))
    marker.write_text(json.dumps({"image_bytes": image_bytes, "quality": quality}))
    if callable(log):
        log(f"generated {images} JPEGs ({image_bytes / 1e6:.0f} MB, quality {quality}) in {base}")
    return Tree(base / "train", images, classes, image_bytes, quality)

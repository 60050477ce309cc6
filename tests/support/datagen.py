"""Generate ImageFolder trees and pack them into tar shards with real third-party tools.

Nothing here is committed as a binary: tests build their data from a seed.
"""

from __future__ import annotations

import functools
import hashlib
import io
import os
import random
import re
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from PIL import Image

# A fixed mtime keeps generated trees (and tars made from them) reproducible.
FIXED_MTIME = 1_700_000_000

# Class names worth testing against: plain, non-ASCII, and one with a space.
DEFAULT_CLASS_SIZES: dict[str, int] = {"cat": 7, "dog": 5, "ελάφι": 4, "sea lion": 3}

NAME_MAX = 255  # bytes in one path component on Linux

SHARD_NAME = "shard-{:06d}.tar"


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8"))


def _padded_name(head: str, tail: str, filler: str, target_bytes: int) -> str:
    """``head + filler* + tail`` grown to at most ``target_bytes`` UTF-8 bytes."""
    middle = ""
    i = 0
    while _utf8_len(head + middle + filler[i % len(filler)] + tail) <= target_bytes:
        middle += filler[i % len(filler)]
        i += 1
    return head + middle + tail


def image_file_name(class_name: str, index: int, *, long_names: bool) -> str:
    """The file name for image ``index`` of a class.

    The names cycle through plain ASCII, Greek, CJK with a space and accents, and
    (with ``long_names``) names over 100 bytes (too long for a ustar name field)
    and names that make the relative path ``class/name`` longer than 255 bytes
    while the name itself stays within NAME_MAX.
    """
    tag = f"{index:05d}"
    kind = index % 5 if long_names else index % 3
    if kind == 0:
        return f"img_{tag}.jpg"
    if kind == 1:
        return f"εικόνα_{tag}.jpg"
    if kind == 2:
        return f"写真 café_{tag}.jpg"
    if kind == 3:
        return _padded_name(f"long_{tag}_", ".jpg", "abcdéfghij", 150)
    # The longest allowed component; class + "/" then pushes the path past 255.
    name = _padded_name(f"very_long_{tag}_", ".jpg", "κλμ-xyz-日本_", NAME_MAX - 1)
    assert _utf8_len(f"{class_name}/{name}") > 255
    return name


@functools.lru_cache(maxsize=32)
def _side_for(image_bytes: int, quality: int) -> int:
    """Side of a square noise image whose JPEG is closest to ``image_bytes``."""
    rng = random.Random(12345)

    def size(side: int) -> int:
        image = Image.frombytes("RGB", (side, side), rng.randbytes(side * side * 3))
        buf = io.BytesIO()
        image.save(buf, "JPEG", quality=quality)
        return len(buf.getvalue())

    lo, hi = 1, 4096
    while lo < hi:
        mid = (lo + hi) // 2
        if size(mid) < image_bytes:
            lo = mid + 1
        else:
            hi = mid
    return lo


def noise_jpeg(rng: random.Random, *, image_bytes: int = 4000, quality: int = 85) -> bytes:
    """A random-noise JPEG of roughly ``image_bytes`` (within about 25%)."""
    side = _side_for(image_bytes, quality)
    width = max(1, round(side * rng.uniform(0.85, 1.15)))
    height = max(1, round(side * side / width))
    image = Image.frombytes("RGB", (width, height), rng.randbytes(width * height * 3))
    buf = io.BytesIO()
    image.save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def make_imagefolder(
    root: Path,
    class_sizes: dict[str, int],
    *,
    seed: int = 0,
    image_bytes: int = 4000,
    long_names: bool = True,
) -> list[Path]:
    """Write ``root/<class>/<name>.jpg`` JPEGs; return the files, sorted.

    Contents depend only on ``seed``, the class name and the image index.
    """
    files = []
    for class_name in sorted(class_sizes):
        class_dir = root / class_name
        class_dir.mkdir(parents=True, exist_ok=True)
        for index in range(class_sizes[class_name]):
            rng = random.Random(f"{seed}/{class_name}/{index}")
            path = class_dir / image_file_name(class_name, index, long_names=long_names)
            path.write_bytes(noise_jpeg(rng, image_bytes=image_bytes))
            os.utime(path, (FIXED_MTIME, FIXED_MTIME))
            files.append(path)
        os.utime(class_dir, (FIXED_MTIME, FIXED_MTIME))
    return sorted(files)


def relative_files(root: Path) -> list[str]:
    """Every regular file under ``root`` as a POSIX relative path, sorted by code point."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def split_sizes(total: int, files_per_shard: int | Sequence[int]) -> list[int]:
    """Shard sizes covering ``total`` items; a sequence of sizes is cycled."""
    pattern = [files_per_shard] if isinstance(files_per_shard, int) else list(files_per_shard)
    if not pattern or any(n <= 0 for n in pattern):
        raise ValueError(f"shard sizes must be positive: {files_per_shard!r}")
    sizes: list[int] = []
    remaining = total
    while remaining > 0:
        n = min(pattern[len(sizes) % len(pattern)], remaining)
        sizes.append(n)
        remaining -= n
    return sizes


def pack_with_gnu_tar(
    root: Path,
    out_dir: Path,
    *,
    files_per_shard: int | Sequence[int],
    fmt: str = "pax",
) -> list[Path]:
    """Pack the tree under ``root`` into ``out_dir/shard-NNNNNN.tar`` with GNU tar.

    Files go to shards in sorted order, ``files_per_shard`` at a time (a list is
    cycled, so ``[3, 7, 5]`` gives uneven shards). Each shard also holds an entry
    for every directory above its files, written before them.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    files = relative_files(root)
    shards = []
    start = 0
    for number, size in enumerate(split_sizes(len(files), files_per_shard)):
        members: list[str] = []
        seen_dirs: set[str] = set()
        for rel in files[start : start + size]:
            parts = rel.split("/")
            for depth in range(1, len(parts)):
                directory = "/".join(parts[:depth])
                if directory not in seen_dirs:
                    seen_dirs.add(directory)
                    members.append(directory)
            members.append(rel)
        start += size
        shard = out_dir / SHARD_NAME.format(number)
        _run_tar(root, shard, members, fmt)
        shards.append(shard)
    return shards


def _run_tar(root: Path, shard: Path, members: list[str], fmt: str) -> None:
    with tempfile.NamedTemporaryFile("wb", suffix=".list") as listing:
        listing.write(b"".join(m.encode("utf-8") + b"\0" for m in members))
        listing.flush()
        # A UTF-8 locale so tar records non-ASCII names as UTF-8 in pax headers.
        env = {**os.environ, "LC_ALL": "C.UTF-8"}
        subprocess.run(
            [
                "tar",
                f"--format={fmt}",
                "-cf",
                str(shard),
                "-C",
                str(root),
                "--no-recursion",
                "--null",
                "-T",
                listing.name,
            ],
            check=True,
            env=env,
            capture_output=True,
        )


def webdataset_key(label: int, index: int, stem: str) -> str:
    """A ShardWriter key: unique, and free of '.' and '/'.

    webdataset splits a member name at the first '.' of its basename into key
    and extension, and a '/' would become a directory. The key is cut so that
    ``key + ".jpg"`` stays within NAME_MAX bytes.
    """
    safe = re.sub(r"[./\\]", "_", stem)
    key = f"{label:03d}_{index:06d}_{safe}"
    encoded = key.encode("utf-8")[: NAME_MAX - 8]
    return encoded.decode("utf-8", errors="ignore")


def pack_with_webdataset(
    root: Path,
    out_dir: Path,
    *,
    maxcount: int,
    key: Literal["generated", "stem"] = "generated",
    classes_file: bool = True,
) -> tuple[list[Path], list[str]]:
    """Write ImageFolder ``root`` as webdataset shards of ``maxcount`` samples.

    Each sample is ``{"__key__", "jpg": bytes, "cls": label}``, where the label
    is the class's position in the sorted class list. ``key="generated"`` (default)
    builds keys with ``webdataset_key``; ``key="stem"`` uses each file's stem as is,
    so a mount presenting ``CLASS/KEY.jpg`` reproduces ``root`` exactly (the stems
    must then be valid, unique keys). Also writes ``out_dir/classes.txt`` (line i
    names label i) unless ``classes_file`` is False. Returns the shards and classes.
    """
    import webdataset

    out_dir.mkdir(parents=True, exist_ok=True)
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    if classes_file:
        text = "".join(f"{c}\n" for c in classes)
        (out_dir / "classes.txt").write_text(text, encoding="utf-8")
    pattern = str(out_dir / "shard-%06d.tar")
    index = 0
    writer = webdataset.ShardWriter(pattern, maxcount=maxcount, verbose=0, mtime=FIXED_MTIME)
    try:
        for label, class_name in enumerate(classes):
            for path in sorted((root / class_name).iterdir()):
                if not path.is_file():
                    continue
                writer.write(
                    {
                        "__key__": (
                            path.stem if key == "stem" else webdataset_key(label, index, path.stem)
                        ),
                        "jpg": path.read_bytes(),
                        "cls": label,
                    }
                )
                index += 1
    finally:
        writer.close()
    shards = sorted(out_dir.glob("shard-*.tar"))
    return shards, classes


def sha256_tree(root: Path) -> dict[str, str]:
    """``{relative POSIX path: sha256 hex}`` for every regular file under ``root``."""
    return {
        rel: hashlib.sha256((root / rel).read_bytes()).hexdigest() for rel in relative_files(root)
    }

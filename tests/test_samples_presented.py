"""Every labelled sample is presented, exactly once: shards written by webdataset's
``ShardWriter`` and by GNU tar, with keys that hold ``/`` and dots, mounted with real FUSE
and read through torchvision's ``ImageFolder`` byte for byte; what is left out is counted,
named, and summed up in the line ``shardfs mount`` prints."""

from __future__ import annotations

import hashlib
import io
import os
import random
import subprocess
import warnings
from pathlib import Path

import pytest
from PIL import Image
from support.datagen import noise_jpeg
from support.mounts import imagefolder_view, mount, umount

pytestmark = pytest.mark.integration

CLASSES = ["cat", "dog", "eel"]

# The collision shards of issue 19: (webdataset key, image extension, label). x/s1 and y/s1
# share a basename, s3's extensions hold a dot, a.b/c and d.e/f.g/h have dots in folders.
COLLISION_SAMPLES = [
    ("x/s1", "png", 0),
    ("y/s1", "png", 1),
    ("s3", "v2.png", 2),
    ("k4", "png", 0),
    ("a.b/c", "png", 1),
    ("d.e/f.g/h", "jpg", 2),
    ("m", "tar.jpeg", 0),
]
PER_SHARD = 4  # 4 + 3 samples: the first shard is the four-sample one of the issue


def png(seed: str) -> bytes:
    rng = random.Random(seed)
    image = Image.frombytes("RGB", (8, 6), rng.randbytes(8 * 6 * 3))
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


def image_bytes(key: str, ext: str) -> bytes:
    if ext.endswith("png"):
        return png(key)
    return noise_jpeg(random.Random(key), image_bytes=600)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_collision_shards(folder: Path) -> list[Path]:
    """The seven samples through webdataset's own ShardWriter (a TarWriter per shard),
    each image with a label member of the same key and the same first extension part
    (``s3.v2.png`` + ``s3.v2.cls``, ``m.tar.jpeg`` + ``m.cls``), and a classes.txt."""
    import webdataset

    folder.mkdir(parents=True)
    (folder / "classes.txt").write_text("".join(f"{name}\n" for name in CLASSES))
    pattern = str(folder / "shard-%06d.tar")
    with webdataset.ShardWriter(pattern, maxcount=PER_SHARD, verbose=0) as writer:
        for key, ext, label in COLLISION_SAMPLES:
            label_ext = ext.rsplit(".", 1)[0] + ".cls" if ext == "v2.png" else "cls"
            writer.write({"__key__": key, ext: image_bytes(key, ext), label_ext: label})
    return sorted(folder.glob("shard-*.tar"))


def webdataset_samples(shards: list[Path]) -> dict[str, tuple[int, str]]:
    """What webdataset's own reader yields: ``{KEY.EXT: (label, sha256)}`` per image."""
    import webdataset

    found: dict[str, tuple[int, str]] = {}
    urls = [str(s) for s in shards]
    for sample in webdataset.WebDataset(urls, shardshuffle=False, empty_check=False):
        images = [k for k in sample if k.rsplit(".", 1)[-1] in ("png", "jpg", "jpeg")]
        labels = [k for k in sample if k.rsplit(".", 1)[-1] == "cls"]
        assert len(images) == len(labels) == 1, sample.keys()
        name = f"{sample['__key__']}.{images[0]}"
        assert name not in found
        found[name] = (int(sample[labels[0]]), sha(sample[images[0]]))
    return found


def presented(mountpoint: Path) -> dict[str, tuple[int, str]]:
    """What ImageFolder over the mount sees: ``{path: (class index, sha256)}``, each image
    also decoded by ImageFolder's loader."""
    from torchvision.datasets import ImageFolder

    dataset = ImageFolder(str(mountpoint))
    assert dataset.classes == sorted(dataset.classes)
    seen: dict[str, tuple[int, str]] = {}
    for index, (path, target) in enumerate(dataset.samples):
        image, label = dataset[index]
        assert label == target and image.size[0] > 0
        rel = Path(path).relative_to(mountpoint).as_posix()
        assert rel not in seen
        seen[rel] = (target, sha(Path(path).read_bytes()))
    return seen


def test_collision_shards_present_all_seven_samples_under_imagefolder(
    tmp_path: Path, mountpoint: Path
) -> None:
    shards = write_collision_shards(tmp_path / "shards")
    assert len(shards) == 2
    expected_by_webdataset = webdataset_samples(shards)
    assert len(expected_by_webdataset) == len(COLLISION_SAMPLES)
    result = mount(tmp_path / "shards", mountpoint, tmp_path / "cache", env={})
    assert "warning" not in result.stderr, result.stderr
    assert "layout: imagefolder (auto: 7 labelled images in 2 shards)" in result.stderr
    assert result.stdout.rstrip().endswith(
        "(7 files, imagefolder layout): the shards hold 7 images, 7 presented"
    ), result.stdout
    try:
        seen = presented(mountpoint)
        # Each image is CLASS/KEY.EXT: its member path, under the class its label names.
        by_class_path = {
            f"{CLASSES[label]}/{name}": (label, digest)
            for name, (label, digest) in expected_by_webdataset.items()
        }
        assert seen == by_class_path
        assert sorted(seen) == [
            "cat/k4.png",
            "cat/m.tar.jpeg",
            "cat/x/s1.png",
            "dog/a.b/c.png",
            "dog/y/s1.png",
            "eel/d.e/f.g/h.jpg",
            "eel/s3.v2.png",
        ]
        # ShardSampler finds every presented path in the mount's placement table.
        from torchvision.datasets import ImageFolder

        from shardfs.torch import ShardSampler

        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a fallback to DistributedSampler would warn
            sampler = ShardSampler(ImageFolder(str(mountpoint)), num_replicas=1, rank=0)
        assert sorted(sampler) == list(range(len(COLLISION_SAMPLES)))
    finally:
        umount(mountpoint)


# --- GNU tar trees, with everything that is not presented --------------------------------------


def gnu_tar(shard: Path, root: Path, *members: str, append: bool = False) -> None:
    subprocess.run(
        ["tar", "-rf" if append else "-cf", str(shard), "-C", str(root), *members],
        check=True,
        capture_output=True,
    )


def write_tree(root: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def test_gnu_tar_trees_present_every_labelled_sample_and_count_the_rest(
    tmp_path: Path, mountpoint: Path
) -> None:
    """``tar -cf`` of folder trees (``./`` names, folder members, a hard link): every
    labelled image is served once; the unlabelled one, the one without a key, the other
    member, the duplicate within a shard and the one across shards are each counted,
    named with where they are, and summed up in the mount's line."""
    # member path -> (its label member, the label)
    labelled = {
        "x/s1.png": ("x/s1.cls", 0),
        "y/s1.png": ("y/s1.cls", 1),
        "s3.v2.png": ("s3.v2.cls", 2),
        "k4.png": ("k4.cls", 0),
        "v1.0/a.b/c.jpeg": ("v1.0/a.b/c.cls", 1),
    }
    first = tmp_path / "one"
    files = {name: image_bytes(name, name) for name in labelled}
    files.update({cls: f"{label}\n".encode() for cls, label in labelled.values()})
    files.update({"nolabel.png": png("nolabel"), ".hidden.png": png("hidden")})
    files["README"] = b"not a sample\n"
    write_tree(first, files)
    os.link(first / "k4.png", first / "k4copy.png")  # GNU tar writes a hard link member
    (first / "k4copy.cls").write_text("2\n")
    shards = tmp_path / "shards"
    shards.mkdir()
    gnu_tar(shards / "shard-0.tar", first, ".")
    gnu_tar(shards / "shard-0.tar", first, "./y/s1.png", append=True)  # again, same shard
    second = tmp_path / "two"
    write_tree(second, {"x/s1.png": png("x/s1 again"), "x/s1.cls": b"0\n"})
    gnu_tar(shards / "shard-1.tar", second, "x")

    result = mount(shards, mountpoint, tmp_path / "cache", "--layout", "imagefolder", env={})
    try:
        warned = [
            line.removeprefix("shardfs: warning: ")
            for line in result.stderr.splitlines()
            if line.startswith("shardfs: warning: ")
        ]
        assert warned == [
            "1 duplicate path(s) within one shard; the later member is served",
            "  e.g. '1/y/s1.png': 2 copies in shard-0.tar",
            "1 duplicate path(s) across shards; the copy in the later shard is served",
            "  e.g. '0/x/s1.png': 2 copies in shard-0.tar and shard-1.tar; "
            "the one in shard-1.tar is served",
            "1 image(s) without a label left out",
            "  e.g. image nolabel.png in shard-0.tar has no label",
            "1 image(s) left out: no sample key in the name (it starts with a dot)",
            "  e.g. image .hidden.png in shard-0.tar",
            "1 member(s) neither image nor label left out",
            "  e.g. README in shard-0.tar",
        ]
        # 5 labelled + the hard link + nolabel + .hidden + the two copies = 10 image members.
        assert result.stdout.rstrip().endswith(
            "(6 files, imagefolder layout): the shards hold 10 images, 6 presented "
            "(1 without a label, 1 without a sample key, 2 under a duplicate path)"
        ), result.stdout
        seen = presented(mountpoint)
        sources = {f"{label}/{name}": first / name for name, (_, label) in labelled.items()}
        sources["2/k4copy.png"] = first / "k4.png"
        sources["0/x/s1.png"] = second / "x/s1.png"  # the later shard's copy is served
        assert seen == {
            path: (int(path.split("/")[0]), sha(source.read_bytes()))
            for path, source in sources.items()
        }
        assert imagefolder_view(mountpoint)[0] == ["0", "1", "2"]
    finally:
        umount(mountpoint)

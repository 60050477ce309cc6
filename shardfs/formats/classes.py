"""Class folder names for formats whose rows carry their own labels (parquet, MDS), chosen
so that ImageFolder's class indices, which count the folders in sorted order, equal the
labels: names that already sort in label order are kept (``cat``, ``dog``); otherwise every
folder is ``{label:0Nd}_{name}`` (``0_zebra``, ``1_apple``); with no names, the label's
digits, zero-padded to one width so that they sort as numbers. And a generated file
name's extension, from the image's first bytes."""

from __future__ import annotations

MAX_CLASS_NAME_BYTES = 200  # leaves room for a prefix within a 255-byte folder name
_IMAGE_MAGIC = [
    (b"\xff\xd8\xff", "jpg"),
    (b"\x89PNG", "png"),
    (b"BM", "bmp"),
    (b"II*\x00", "tiff"),
    (b"MM\x00*", "tiff"),
]


def _usable(name: str) -> bool:
    try:
        encoded = name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return (
        bool(name)
        and name not in (".", "..")
        and "/" not in name
        and "\0" not in name
        and len(encoded) <= MAX_CLASS_NAME_BYTES
    )


def _cleaned(name: str) -> str:
    """A name made usable inside a prefixed folder name: no '/', no NUL, valid UTF-8, short."""
    text = name.replace("/", "_").replace("\0", "_")
    encoded = text.encode("utf-8", "replace")[:MAX_CLASS_NAME_BYTES]
    return encoded.decode("utf-8", "ignore")


def class_folders(names: list[str]) -> list[str]:
    """The folder of each label, by index: the names themselves when they are usable
    folder names, unique, and already in sorted order; else ``{label:0Nd}_{name}``."""
    if all(_usable(n) for n in names) and len(set(names)) == len(names) and names == sorted(names):
        return list(names)
    width = len(str(max(len(names) - 1, 0)))
    return [f"{label:0{width}d}_{_cleaned(name)}" for label, name in enumerate(names)]


def numeric_folder(label: int, width: int) -> str:
    """A label's folder when no names are known: its digits, zero-padded to ``width``."""
    return f"{label:0{width}d}"


def image_extension(head: bytes) -> str:
    """An image's file extension from its first bytes (``bin`` when unknown)."""
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    return next((ext for magic, ext in _IMAGE_MAGIC if head.startswith(magic)), "bin")

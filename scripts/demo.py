"""The README's first command: a local S3 server, a generated dataset, a mount, one epoch.

Steps: start moto's S3 server on loopback; generate a small ImageFolder tree of real JPEGs;
``shardfs pack`` it into webdataset-style tar shards in the server; ``shardfs mount`` it;
read one epoch with torchvision's ImageFolder and a shuffled DataLoader with 2 workers;
unmount; stop the server.
"""

from __future__ import annotations

import argparse
import io
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

BUCKET = "shardfs-demo"
PREFIX = "imagenet-mini"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_s3(port: int) -> subprocess.Popen[bytes]:
    moto = Path(sys.executable).with_name("moto_server")
    server = subprocess.Popen(
        [str(moto), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=1).close()
            return server
        except OSError:
            if server.poll() is not None:
                raise SystemExit("demo: moto_server exited; is moto[server] installed?") from None
            time.sleep(0.1)
    server.kill()
    raise SystemExit("demo: moto_server did not come up within 30 s")


def jpeg(rng: random.Random, label: int, side: int) -> bytes:
    from PIL import Image

    noise = Image.frombytes("RGB", (side, side), rng.randbytes(side * side * 3))
    tint = Image.new("RGB", (side, side), (40 * label % 256, 90, 255 - 25 * label % 256))
    image = Image.blend(noise, tint, 0.5)
    out = io.BytesIO()
    image.save(out, format="JPEG", quality=90)
    return out.getvalue()


def write_tree(root: Path, classes: list[str], per_class: int, side: int) -> int:
    """An ImageFolder tree of real JPEGs with uneven class sizes; returns the image count."""
    rng = random.Random(0)
    count = 0
    for label, name in enumerate(classes):
        folder = root / name
        folder.mkdir(parents=True)
        for index in range(per_class + label % 3):
            (folder / f"{name}_{index:05d}.jpg").write_bytes(jpeg(rng, label, side))
            count += 1
    return count


def make_bucket(endpoint: str) -> None:
    import s3fs

    fs = s3fs.S3FileSystem(key="demo", secret="demo", endpoint_url=endpoint)
    fs.call_s3("create_bucket", Bucket=BUCKET)


def epoch(root: Path) -> tuple[int, float]:
    import torch
    from torchvision import datasets, transforms

    transform = transforms.Compose([transforms.RandomResizedCrop(224), transforms.ToTensor()])
    dataset = datasets.ImageFolder(str(root), transform=transform)
    loader = torch.utils.data.DataLoader(dataset, batch_size=32, shuffle=True, num_workers=2)
    seen, started = 0, time.perf_counter()
    for images, _targets in loader:
        seen += images.shape[0]
    return seen, time.perf_counter() - started


def shardfs(*args: str, env: dict[str, str]) -> None:
    subprocess.run([sys.executable, "-m", "shardfs", *args], env=env, check=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--classes", type=int, default=10, help="number of classes (10)")
    parser.add_argument("--per-class", type=int, default=50, help="images per class (50)")
    parser.add_argument("--side", type=int, default=160, help="image side in pixels (160)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="shardfs-demo-"))
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "demo",
        "AWS_SECRET_ACCESS_KEY": "demo",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    os.environ.update(env)
    mountpoint = work / "mnt"
    mountpoint.mkdir()
    server = start_s3(port)
    mounted = False
    try:
        classes = [f"class_{i:02d}" for i in range(args.classes)]
        count = write_tree(work / "train", classes, args.per_class, args.side)
        make_bucket(endpoint)
        source = f"s3://{BUCKET}/{PREFIX}"
        shardfs(
            "pack",
            str(work / "train"),
            f"{source}/train",
            "--format",
            "webdataset",
            "--shard-size",
            "2M",
            "--shuffle-seed",
            "0",
            env=env,
        )
        print(f"demo: {count} JPEGs packed into tar shards at {source}/train/ ({endpoint})")
        shardfs("mount", source, str(mountpoint), "--cache-dir", str(work / "cache"), env=env)
        mounted = True
        seen, seconds = epoch(mountpoint / "train")
        print(f"demo: ImageFolder + DataLoader(shuffle=True, num_workers=2) read {seen} images")
        print(f"demo: {seen / seconds:.0f} images/s (decode + RandomResizedCrop(224) + ToTensor)")
        if seen != count:
            print(f"demo: FAILED: expected {count} images, got {seen}", file=sys.stderr)
            return 1
    finally:
        if mounted:
            shardfs("umount", str(mountpoint), env=env)
        server.terminate()
        server.wait(timeout=10)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print("demo: unmounted and stopped the S3 server")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A small process beside each daemon that aborts the mount's FUSE connection if the daemon
dies with a thread stuck in the kernel.

A kernel push (FUSE_NOTIFY_STORE) waits, uninterruptibly, for the lock of a page that a
READ holds, and only the daemon can answer that READ. If the daemon is killed (SIGKILL,
the OOM killer) at that moment, its other threads exit but the pushing one stays stuck, so
the process never finishes exiting, ``/dev/fuse`` is never closed, the kernel never aborts
the connection, and every reader of the mount hangs until someone aborts it through
fusectl. This process watches the daemon: once its main thread is gone while the
connection still exists, it aborts the connection (mounting fusectl first where that is
needed and allowed), which fails the READ, releases the page, and lets the daemon exit.

Run as ``python -m shardfs.mount.watchdog PID MOUNTPOINT``; it exits when the daemon does.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)

CONNECTIONS = Path("/sys/fs/fuse/connections")
POLL_S = 0.2
_ESCAPES = {" ": "\\040", "\t": "\\011", "\n": "\\012", "\\": "\\134"}  # mountinfo's


def device_of(mountpoint: str) -> int | None:
    """The device number of the filesystem mounted at ``mountpoint`` (from mountinfo, so
    no request reaches the daemon), or None."""
    escaped = "".join(_ESCAPES.get(char, char) for char in mountpoint)
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            fields = line.split()
            if len(fields) > 4 and fields[4] == escaped:
                major, minor = fields[2].split(":")
                return os.makedev(int(major), int(minor))
    return None


def daemon_dead(pid: int) -> bool:
    """Whether ``pid``'s main thread has exited (gone, or a zombie whose other threads may
    still be stuck)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def abort_connection(device: int) -> bool:
    """Abort the FUSE connection of ``device`` if it still exists; whether it did."""
    name = str(os.major(device) << 20 | os.minor(device))  # the kernel's dev_t, as fusectl names it
    if not (CONNECTIONS / name).exists() and not any(CONNECTIONS.iterdir()):
        # fusectl is not mounted: mount it (root only; otherwise nothing can be done here)
        subprocess.run(
            ["mount", "-t", "fusectl", "fusectl", str(CONNECTIONS)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            check=False,
        )
    abort = CONNECTIONS / name / "abort"
    try:
        abort.write_text("1")
    except OSError:
        return False
    return True


def start_watchdog(pid: int, mountpoint: str) -> None:
    """Start the watchdog of daemon ``pid`` (call once the mount is up; it sends no FUSE
    request, so the request loop's own thread may call it). A failure only logs."""
    try:
        subprocess.Popen(
            [sys.executable, "-m", "shardfs.mount.watchdog", str(pid), mountpoint],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd="/",
            start_new_session=True,
        )
    except OSError as exc:
        log.warning("no watchdog for the mount at %s: %s", mountpoint, exc)


def watch(pid: int, mountpoint: str) -> int:
    device = device_of(mountpoint)
    if device is None:
        return 0
    while not daemon_dead(pid):
        time.sleep(POLL_S)
    if device_of(mountpoint) == device:  # still mounted by the dead daemon
        abort_connection(device)
    return 0


def main(argv: list[str]) -> int:
    if len(argv) != 2 or not argv[0].isdigit():
        print("usage: python -m shardfs.mount.watchdog PID MOUNTPOINT", file=sys.stderr)
        return 2
    return watch(int(argv[0]), argv[1])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

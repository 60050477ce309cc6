#!/usr/bin/env bash
# Installs what pip cannot: FUSE 3 (fusermount3 and libfuse3) from Debian's packages.
set -euo pipefail
# A C compiler and libxxhash's header build the FUSE hot path (shardfs/fuse/_hot.c); without
# them pip skips it.
if command -v fusermount3 >/dev/null 2>&1 && ldconfig -p | grep -q 'libfuse3\.so' \
    && command -v cc >/dev/null 2>&1 && [ -f /usr/include/xxhash.h ]; then
    exit 0
fi
sudo=""
if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null 2>&1 || { echo "install fuse3 as root: apt-get install fuse3" >&2; exit 1; }
    sudo="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq fuse3 gcc libc6-dev libxxhash-dev >/dev/null

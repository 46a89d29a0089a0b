#!/usr/bin/env bash
# Copy an executable into an image's root filesystem with the shared
# libraries `ldd` says it loads, each at the path it has on this host (the
# dynamic loader looks there):
#
#   copy-with-libs.sh ROOT FILE DEST     FILE ends up at ROOT/DEST
#
# Used by rootfs.sh (the driver image) and e2e/images.sh (the sidecars).
set -euo pipefail
root=${1:?usage: copy-with-libs.sh ROOT FILE DEST}
file=${2:?usage: copy-with-libs.sh ROOT FILE DEST}
dest=${3:?usage: copy-with-libs.sh ROOT FILE DEST}
install -D -m 0755 "$file" "$root$dest"
# `ldd` prints "name => /path (addr)" and "/lib64/ld-linux... (addr)".
ldd "$file" 2>/dev/null | grep -o '/[^ ]*' | while read -r lib; do
    [[ -e $root$lib ]] || install -D -m 0755 "$(readlink -f "$lib")" "$root$lib"
done

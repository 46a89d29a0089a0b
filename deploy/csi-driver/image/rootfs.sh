#!/usr/bin/env bash
# Assemble the driver image's root filesystem from a built binary and the
# build host's Debian packages (xfsprogs, coreutils, ca-certificates):
#
#   rootfs.sh OUT_DIR MODELCACHE_CSI_BINARY
#
# OUT_DIR gets the driver at /usr/local/bin/modelcache-csi, the tools it runs
# (mkfs.xfs, xfs_growfs, xfs_db and the xfs_admin script, GNU cp for reflink
# copies of images, a POSIX sh for xfs_admin), each with the shared libraries
# `ldd` says it loads, and the CA bundle for https:// sources. Nothing else:
# no package manager, no shell tools an attacker in the container could use
# beyond those.
#
# One assembly, two callers: the Containerfile next to this script runs it in
# its build stage, and the e2e suite (e2e/images.sh driver) runs it on the
# test host, so the image the e2e cluster runs is the image users build.
set -euo pipefail

out=${1:?usage: rootfs.sh OUT_DIR MODELCACHE_CSI_BINARY}
bin=${2:?usage: rootfs.sh OUT_DIR MODELCACHE_CSI_BINARY}

die() { echo "rootfs.sh: $*" >&2; exit 1; }
[[ -x $bin ]] || die "$bin is not an executable"
for t in mkfs.xfs xfs_growfs xfs_db xfs_admin; do
    command -v "$t" >/dev/null || [[ -x /usr/sbin/$t ]] || die "no $t on this host: apt-get install xfsprogs"
done
[[ -s /etc/ssl/certs/ca-certificates.crt ]] || die "no CA bundle: apt-get install ca-certificates"

# copy_with_libs FILE DEST: FILE at DEST inside OUT, with its libraries.
copy_with_libs() { "$(dirname "${BASH_SOURCE[0]}")/copy-with-libs.sh" "$out" "$1" "$2"; }
tool() { local p; p=$(command -v "$1" || echo "/usr/sbin/$1"); readlink -f "$p"; }

mkdir -p "$out"/{etc/ssl/certs,tmp,proc,sys,dev,run,var/lib/modelcache-csi,csi}
chmod 1777 "$out/tmp"
copy_with_libs "$bin" /usr/local/bin/modelcache-csi
for t in mkfs.xfs xfs_growfs xfs_db; do
    copy_with_libs "$(tool "$t")" "/usr/sbin/$t"
done
# xfs_admin is a shell script that runs xfs_db (and xfs_repair for options
# the driver never passes).
install -D -m 0755 "$(tool xfs_admin)" "$out/usr/sbin/xfs_admin"
copy_with_libs "$(readlink -f "$(command -v cp)")" /usr/bin/cp
copy_with_libs "$(readlink -f /bin/dash)" /bin/sh
install -m 0644 /etc/ssl/certs/ca-certificates.crt "$out/etc/ssl/certs/ca-certificates.crt"
printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/usr/sbin/nologin\n' > "$out/etc/passwd"
printf 'root:x:0:\nnogroup:x:65534:\n' > "$out/etc/group"
# A smoke test of the result: the binary starts and every tool resolves its
# libraries inside OUT alone.
chroot "$out" /usr/local/bin/modelcache-csi --version >/dev/null 2>&1 \
    || [[ $(id -u) != 0 ]] || die "the driver does not start inside $out"

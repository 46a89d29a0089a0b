#!/usr/bin/env bash
# Build the two images the e2e node needs, with no registry, as OCI image-layout
# tarballs (oci-layout, index.json with the io.containerd.image.name annotation,
# one uncompressed layer, a config whose diff_ids carry the layer's sha256):
#
#   pause    e2e/lib/pause.c built with `gcc -static`       -> $PAUSE_IMAGE
#   busybox  Debian busybox-static, one symlink per applet   -> $BUSYBOX_IMAGE
#
#   e2e/images.sh            build what is missing; print NAME=VALUE lines:
#                            PAUSE_TAR, BUSYBOX_TAR, PAUSE_IMAGE, BUSYBOX_IMAGE
#   e2e/images.sh s5cmd BIN  also a storage-initializer image: busybox plus the
#                            s5cmd binary BIN at /usr/local/bin/s5cmd (the
#                            copy-per-pod peer of the time-to-Ready benchmark);
#                            prints S5CMD_TAR, S5CMD_IMAGE as well
#   e2e/images.sh deploy DRIVER_BIN PROVISIONER_BIN RESIZER_BIN
#                            also the images deploy/csi-driver names, under the
#                            names it uses: modelcache-csi:latest (the root
#                            filesystem deploy/csi-driver/image/rootfs.sh makes,
#                            as its Containerfile does) and the two sidecars
#                            at registry.k8s.io/sig-storage/<name>:<version>
#                            (the binary and its libraries, entrypoint the
#                            binary, as upstream's images), and a second
#                            driver image, modelcache-csi:e2e-upgrade (the
#                            rolling-upgrade flow); prints DEPLOY_TARS
#   e2e/images.sh suite AGNHOST_BIN NAME
#                            also agnhost for Kubernetes' storage suite
#                            (e2e.test): busybox plus the binary at /agnhost
#                            and its libraries, entrypoint /agnhost, as
#                            upstream's image; NAME is the name
#                            e2e.test --list-images gives it; prints SUITE_TARS
#
# The tarballs are reproducible (sorted entries, owner 0, mtime 0) and cached in
# <tools>/e2e-images-<key>/, where the key hashes this script, pause.c and the
# busybox binary: a change to any of them gives a new folder.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
TOOLS=${MODELCACHE_TOOLS:-${XDG_CACHE_HOME:-$HOME/.cache}/modelcache-csi/tools}
PAUSE_IMAGE=localhost/modelcache-e2e/pause:1
BUSYBOX_IMAGE=docker.io/library/busybox:latest
BUSYBOX=/bin/busybox   # from busybox-static (statically linked)

log() { echo "images.sh: $*" >&2; }

if [[ ! -x $BUSYBOX ]] || ! dpkg-query -W -f '${Status}' busybox-static 2>/dev/null | grep -q ' installed'; then
    log "$BUSYBOX is missing or not the static one: apt-get install busybox-static"; exit 1
fi
command -v gcc >/dev/null || { log "no gcc: apt-get install gcc libc6-dev"; exit 1; }

key=$(cat "$0" "$HERE/lib/pause.c" "$BUSYBOX" | sha256sum | cut -c1-12)
OUT=$TOOLS/e2e-images-$key

sha() { sha256sum "$1" | cut -d' ' -f1; }
size() { stat -c %s "$1"; }

# oci_tar ROOTFS_DIR CONFIG_JSON_BODY NAME OUT_TAR
# CONFIG_JSON_BODY is the value of the config's "config" key.
oci_tar() {
    local rootfs=$1 cfg=$2 name=$3 out=$4 lay d_layer d_cfg d_man
    lay=$(mktemp -d)
    mkdir -p "$lay/blobs/sha256"
    tar --create --file "$lay/layer.tar" --directory "$rootfs" --sort=name \
        --owner=0 --group=0 --numeric-owner --mtime=@0 --format=posix \
        --pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime .
    d_layer=$(sha "$lay/layer.tar")
    mv "$lay/layer.tar" "$lay/blobs/sha256/$d_layer"
    printf '{"architecture":"amd64","os":"linux","config":%s,"rootfs":{"type":"layers","diff_ids":["sha256:%s"]},"history":[{"created_by":"modelcache-csi e2e/images.sh"}]}' \
        "$cfg" "$d_layer" > "$lay/config.json"
    d_cfg=$(sha "$lay/config.json")
    printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"sha256:%s","size":%s},"layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar","digest":"sha256:%s","size":%s}]}' \
        "$d_cfg" "$(size "$lay/config.json")" "$d_layer" "$(size "$lay/blobs/sha256/$d_layer")" > "$lay/manifest.json"
    d_man=$(sha "$lay/manifest.json")
    printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json","manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:%s","size":%s,"platform":{"architecture":"amd64","os":"linux"},"annotations":{"io.containerd.image.name":"%s","org.opencontainers.image.ref.name":"%s"}}]}' \
        "$d_man" "$(size "$lay/manifest.json")" "$name" "${name##*:}" > "$lay/index.json"
    mv "$lay/config.json" "$lay/blobs/sha256/$d_cfg"
    mv "$lay/manifest.json" "$lay/blobs/sha256/$d_man"
    printf '{"imageLayoutVersion":"1.0.0"}' > "$lay/oci-layout"
    tar --create --file "$out.tmp" --directory "$lay" --sort=name \
        --owner=0 --group=0 --numeric-owner --mtime=@0 oci-layout index.json blobs
    mv -f "$out.tmp" "$out"
    rm -rf "$lay"
}

SH_CONFIG='{"Env":["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],"Cmd":["sh"]}'

# busybox_root DIR: the static binary, a symlink per applet, and the few
# files programs expect.
busybox_root() {
    local r=$1 a
    mkdir -p "$r/bin" "$r/etc" "$r/tmp" "$r/root" "$r/proc" "$r/sys" "$r/dev" "$r/usr/bin" "$r/sbin" "$r/var"
    chmod 1777 "$r/tmp"
    cp "$BUSYBOX" "$r/bin/busybox"
    for a in $("$BUSYBOX" --list); do
        [[ $a == busybox ]] || ln -s busybox "$r/bin/$a"
    done
    printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n' > "$r/etc/passwd"
    printf 'root:x:0:\nnogroup:x:65534:\n' > "$r/etc/group"
}

if [[ ! -s $OUT/pause.tar || ! -s $OUT/busybox.tar ]]; then
    mkdir -p "$OUT"
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT

    # pause: one static binary.
    mkdir -p "$work/pause"
    gcc -static -O2 -s -o "$work/pause/pause" "$HERE/lib/pause.c"
    oci_tar "$work/pause" '{"Entrypoint":["/pause"],"User":"65535:65535"}' "$PAUSE_IMAGE" "$OUT/pause.tar"

    busybox_root "$work/busybox"
    oci_tar "$work/busybox" "$SH_CONFIG" "$BUSYBOX_IMAGE" "$OUT/busybox.tar"
    log "built $OUT/{pause,busybox}.tar"
    rm -rf "$work"
    trap - EXIT
fi

# image NAME TAR_KEY ROOTFS_BUILDER CONFIG ARGS...: build the tarball unless
# cached; append it to tars.
image() {
    local name=$1 tar=$OUT/$2.tar builder=$3 cfg=$4
    shift 4
    if [[ ! -s $tar ]]; then
        local work
        work=$(mktemp -d)
        "$builder" "$work/r" "$@"
        oci_tar "$work/r" "$cfg" "$name" "$tar"
        rm -rf "$work"
        log "built $tar ($name)"
    fi
    tars+=("$tar")
}

if [[ ${1:-} == s5cmd ]]; then
    bin=${2:?usage: e2e/images.sh s5cmd BIN}
    ver=$("$bin" version | grep -o 'v[0-9][0-9.]*' | head -n 1)
    S5CMD_IMAGE=localhost/modelcache-e2e/storage-initializer:s5cmd-${ver:-unknown}
    S5CMD_TAR=$OUT/s5cmd-$(sha "$bin" | cut -c1-12).tar
    if [[ ! -s $S5CMD_TAR ]]; then
        work=$(mktemp -d)
        trap 'rm -rf "$work"' EXIT
        busybox_root "$work/r"
        mkdir -p "$work/r/usr/local/bin"
        cp "$bin" "$work/r/usr/local/bin/s5cmd"
        oci_tar "$work/r" "$SH_CONFIG" "$S5CMD_IMAGE" "$S5CMD_TAR"
        log "built $S5CMD_TAR"
    fi
    echo "S5CMD_TAR=$S5CMD_TAR"
    echo "S5CMD_IMAGE=$S5CMD_IMAGE"
fi
if [[ ${1:-} == deploy ]]; then
    driver=${2:?usage: e2e/images.sh deploy DRIVER_BIN PROVISIONER_BIN RESIZER_BIN}
    provisioner=${3:?usage: e2e/images.sh deploy DRIVER_BIN PROVISIONER_BIN RESIZER_BIN}
    resizer=${4:?usage: e2e/images.sh deploy DRIVER_BIN PROVISIONER_BIN RESIZER_BIN}
    tars=()
    sidecar_root() {
        "$HERE/../deploy/csi-driver/image/copy-with-libs.sh" "$1" "$2" "/$(basename "$2")"
        mkdir -p "$1/tmp" && chmod 1777 "$1/tmp"
    }
    key=$(cat "$driver" "$HERE/../deploy/csi-driver/image/"{rootfs,copy-with-libs}.sh | sha256sum | cut -c1-12)
    # One driver tarball at a time: a debug build changes with every commit.
    find "$OUT" -maxdepth 1 -name 'driver-*.tar' ! -name "driver-$key*.tar" -delete
    image docker.io/library/modelcache-csi:latest "driver-$key" "$HERE/../deploy/csi-driver/image/rootfs.sh" \
        '{"Entrypoint":["/usr/local/bin/modelcache-csi"],"Env":["PATH=/usr/local/bin:/usr/sbin:/usr/bin:/bin"]}' "$driver"
    # A second image of the driver, for the rolling-upgrade flow: same root
    # filesystem, its own config, so its own image id.
    image docker.io/library/modelcache-csi:e2e-upgrade "driver-$key-upgrade" "$HERE/../deploy/csi-driver/image/rootfs.sh" \
        '{"Entrypoint":["/usr/local/bin/modelcache-csi"],"Env":["PATH=/usr/local/bin:/usr/sbin:/usr/bin:/bin","MODELCACHE_IMAGE=e2e-upgrade"]}' "$driver"
    for bin in "$provisioner" "$resizer"; do
        n=$(basename "$bin")
        v=$(basename "$(dirname "$bin")")
        v=${v#"$n"-}
        image "registry.k8s.io/sig-storage/$n:$v" "$n-$v" sidecar_root \
            "{\"Entrypoint\":[\"/$n\"]}" "$bin"
    done
    echo "DEPLOY_TARS=\"${tars[*]}\""
fi
if [[ ${1:-} == suite ]]; then
    agnhost=${2:?usage: e2e/images.sh suite AGNHOST_BIN NAME}
    name=${3:?usage: e2e/images.sh suite AGNHOST_BIN NAME}
    tars=()
    # The binary and the libraries it loads (glibc), as for the sidecars.
    agnhost_root() {
        busybox_root "$1" && "$HERE/../deploy/csi-driver/image/copy-with-libs.sh" "$1" "$2" /agnhost
    }
    image "$name" "agnhost-$(cat "$agnhost" <(echo "$name") | sha256sum | cut -c1-12)" agnhost_root \
        '{"Entrypoint":["/agnhost"],"Cmd":["pause"],"Env":["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]}' "$agnhost"
    echo "SUITE_TARS=\"${tars[*]}\""
fi
echo "PAUSE_TAR=$OUT/pause.tar"
echo "BUSYBOX_TAR=$OUT/busybox.tar"
echo "PAUSE_IMAGE=$PAUSE_IMAGE"
echo "BUSYBOX_IMAGE=$BUSYBOX_IMAGE"

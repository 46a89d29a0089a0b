#!/usr/bin/env bash
# Build the real CSI sidecars from source, cached by version, for the e2e cluster.
#
#   e2e/build-sidecars.sh            build what is missing; print NAME=PATH lines
#   e2e/build-sidecars.sh --list     print NAME=PATH lines, build nothing (exit 1 if any missing)
#
# stdout (shell-sourceable, one line per sidecar):
#   CSI_PROVISIONER=<tools>/csi-provisioner-v6.4.0/csi-provisioner
#   CSI_RESIZER=...
#
# Sources:
#   - external-provisioner and external-resizer: their Go modules from the module
#     proxy (`go mod download -json module@version`, copy its Dir, build with
#     GOFLAGS=-mod=mod, since their go.mod carries replace directives and the
#     module zip has no vendor/).
#   - node-driver-registrar and livenessprobe are NOT built: their module
#     paths have no /v2, and the module proxy here refuses every version of
#     them (403 "not available"). Their source may not be vendored into this
#     repository either. The driver registers with kubelet itself (the
#     plugin-registration API, --registration-dir) and serves its own
#     /healthz, so neither is needed; see docs/kubernetes.md.
#
# Cache: ${MODELCACHE_TOOLS:-${XDG_CACHE_HOME:-~/.cache}/modelcache-csi/tools}/<name>-<version>/<name>
# Builds run under `nice -n 19` with `-p 2` and share e2e/k8s/build.sh's lock.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
TOOLS=${MODELCACHE_TOOLS:-${XDG_CACHE_HOME:-$HOME/.cache}/modelcache-csi/tools}

# var  binary  source(module path or third_party dir)  version  package
SIDECARS=(
    "CSI_PROVISIONER csi-provisioner github.com/kubernetes-csi/external-provisioner/v6 v6.4.0 ./cmd/csi-provisioner"
    "CSI_RESIZER csi-resizer github.com/kubernetes-csi/external-resizer/v2 v2.3.0 ./cmd/csi-resizer"
)

log() { echo "build-sidecars.sh: $*" >&2; }

list_only=false
case ${1:-} in
    --list) list_only=true ;;
    -h|--help) sed -n '2,26p' "$0" >&2; exit 0 ;;
    "") ;;
    *) log "unknown argument '$1'"; exit 2 ;;
esac

if ! command -v go >/dev/null 2>&1 && [[ -x /usr/local/go/bin/go ]]; then
    PATH=/usr/local/go/bin:$PATH
fi

target() { echo "$TOOLS/$2-$4/$2"; }   # fields of a SIDECARS line

missing=()
for s in "${SIDECARS[@]}"; do
    # shellcheck disable=SC2086
    set -- $s
    [[ -x $(target "$@") ]] || missing+=("$s")
done

if $list_only; then
    for s in "${SIDECARS[@]}"; do
        # shellcheck disable=SC2086
        set -- $s
        echo "$1=$(target "$@")"
    done
    ((${#missing[@]} == 0))
    exit
fi

if ((${#missing[@]})); then
    command -v go >/dev/null 2>&1 || { log "no 'go' in PATH"; exit 1; }
    mkdir -p "$TOOLS"
    exec 9>"$TOOLS/.build.lock"
    if ! flock -n 9; then
        log "another build is running; waiting for $TOOLS/.build.lock"
        flock 9
    fi
    export GOFLAGS="-mod=mod -buildvcs=false"
    for s in "${missing[@]}"; do
        # shellcheck disable=SC2086
        set -- $s
        var=$1 name=$2 src=$3 version=$4 pkg=$5
        out=$(target "$@")
        [[ -x $out ]] && continue   # built by a concurrent caller while we waited
        mkdir -p "$(dirname "$out")"
        work=$(mktemp -d "${TMPDIR:-/tmp}/sidecar-$name.XXXXXX")
        trap 'chmod -R u+w "$work" 2>/dev/null; rm -rf "$work"' EXIT
        start=$(date +%s)
        if [[ $src == third_party/* ]]; then
            cp -a "$HERE/$src/." "$work/"
        else
            log "downloading $src@$version"
            dir=$(cd "$work" && go mod download -json "$src@$version" | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')
            [[ -n $dir && -d $dir ]] || { log "go mod download $src@$version gave no Dir"; exit 1; }
            cp -a "$dir/." "$work/"
        fi
        chmod -R u+w "$work"
        log "building $name $version (cold builds take minutes)"
        (cd "$work" && nice -n 19 go build -p 2 -trimpath \
            -ldflags "-s -w -X main.version=$version" -o "$out.tmp.$$" "$pkg") >&2
        mv -f "$out.tmp.$$" "$out"
        chmod -R u+w "$work"; rm -rf "$work"; trap - EXIT
        secs=$(( $(date +%s) - start ))
        printf '%s\t%s\t%s\t%ss\tgo=%s\tload=%s\n' "$(date -u +%FT%TZ)" "$name" "$version" "$secs" \
            "$(go env GOVERSION)" "$(cut -d' ' -f1-3 /proc/loadavg)" >> "$(dirname "$out")/build-times.log"
        log "built $name $version in ${secs}s"
        : "$var"
    done
fi

for s in "${SIDECARS[@]}"; do
    # shellcheck disable=SC2086
    set -- $s
    echo "$1=$(target "$@")"
done

#!/usr/bin/env bash
# Build the real CSI sidecars from source, cached by version, for the e2e cluster.
#
#   e2e/build-sidecars.sh               build what is missing; print NAME=PATH lines
#   e2e/build-sidecars.sh --list        print NAME=PATH lines, build nothing (exit 1 if any missing)
#   e2e/build-sidecars.sh --regenerate  rewrite e2e/sidecars/go.{mod,sum} from SIDECARS
#                                       (by hand, when a version is bumped; commit both)
#
# stdout (shell-sourceable, one line per sidecar):
#   CSI_PROVISIONER=<tools>/csi-provisioner-v6.4.0/csi-provisioner
#   CSI_RESIZER=...
#
# Sources: external-provisioner and external-resizer from the Go module proxy,
# both tools of one wrapper module (e2e/sidecars), so one `go build` compiles
# their shared dependencies (client-go, gRPC, ...) once: built apart they
# took 247 s and 183 s of a cold run, together 232 s. A dependency's replace
# directives are ignored, so the wrapper restates external-provisioner's
# (Kubernetes' staging modules at the version it was released against), and
# external-resizer is built against the same ones.
#
# node-driver-registrar and livenessprobe are NOT built: their module paths
# have no /v2, and the module proxy here refuses every version of them (403
# "not available"). Their source may not be vendored into this repository
# either. The driver registers with kubelet itself (the plugin-registration
# API, --registration-dir) and serves its own /healthz, so neither is needed;
# see docs/kubernetes.md.
#
# Cache: ${MODELCACHE_TOOLS:-${XDG_CACHE_HOME:-~/.cache}/modelcache-csi/tools}/<name>-<version>/<name>
# Builds run under `nice -n 19` with `-p 2` and share e2e/k8s/build.sh's lock.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
MODULE=$HERE/sidecars
TOOLS=${MODELCACHE_TOOLS:-${XDG_CACHE_HOME:-$HOME/.cache}/modelcache-csi/tools}

# var  binary  module  version  package
SIDECARS=(
    "CSI_PROVISIONER csi-provisioner github.com/kubernetes-csi/external-provisioner/v6 v6.4.0 github.com/kubernetes-csi/external-provisioner/v6/cmd/csi-provisioner"
    "CSI_RESIZER csi-resizer github.com/kubernetes-csi/external-resizer/v2 v2.3.0 github.com/kubernetes-csi/external-resizer/v2/cmd/csi-resizer"
)

log() { echo "build-sidecars.sh: $*" >&2; }

mode=build
case ${1:-} in
    --list) mode=list ;;
    --regenerate) mode=regenerate ;;
    -h|--help) sed -n '2,29p' "$0" >&2; exit 0 ;;
    "") ;;
    *) log "unknown argument '$1'"; exit 2 ;;
esac

if ! command -v go >/dev/null 2>&1 && [[ -x /usr/local/go/bin/go ]]; then
    PATH=/usr/local/go/bin:$PATH
fi

target() { echo "$TOOLS/$2-$4/$2"; }   # fields of a SIDECARS line

if [[ $mode == regenerate ]]; then
    export GOFLAGS="-mod=mod -buildvcs=false"
    # shellcheck disable=SC2086
    set -- ${SIDECARS[0]}
    up=$(go mod download -json "$3@$4" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
    [[ -f $up/go.mod ]] || { log "no go.mod for $3@$4"; exit 1; }
    mkdir -p "$MODULE"
    {
        echo "// Wrapper module: builds the CSI sidecars the e2e cluster runs, from the"
        echo "// Go module proxy, in one build. The replace directives are $3's own"
        echo "// (a dependency's are ignored). Regenerate with e2e/build-sidecars.sh --regenerate."
        echo
        echo "module local/modelcache-sidecars"
        echo
        grep '^go ' "$up/go.mod"
        echo
        echo "require ("
        for s in "${SIDECARS[@]}"; do
            # shellcheck disable=SC2086
            set -- $s
            echo "	$3 $4"
        done
        echo ")"
        echo
        echo "tool ("
        for s in "${SIDECARS[@]}"; do
            # shellcheck disable=SC2086
            set -- $s
            echo "	$5"
        done
        echo ")"
        echo
        grep '^replace ' "$up/go.mod"
    } > "$MODULE/go.mod"
    rm -f "$MODULE/go.sum"
    (cd "$MODULE" && nice -n 19 go mod tidy)
    log "regenerated $MODULE/go.mod and go.sum"
    exit 0
fi

missing=()
for s in "${SIDECARS[@]}"; do
    # shellcheck disable=SC2086
    set -- $s
    [[ -x $(target "$@") ]] || missing+=("$s")
done

if [[ $mode == list ]]; then
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
    # The committed go.sum covers everything: a build never rewrites the module.
    export GOFLAGS="-mod=readonly -buildvcs=false"
    out=$(mktemp -d "$TOOLS/.sidecars.XXXXXX")
    trap 'rm -rf "$out"' EXIT
    pkgs=()
    for s in "${missing[@]}"; do
        # shellcheck disable=SC2086
        set -- $s
        pkgs+=("$5")
    done
    start=$(date +%s)
    log "building ${pkgs[*]##*/} (cold builds take minutes)"
    # No -X main.version: one link flag would stamp both binaries alike, so
    # each reports "unknown" (the cache directory names its version).
    (cd "$MODULE" && nice -n 19 go build -p 2 -trimpath -ldflags "-s -w" -o "$out/" "${pkgs[@]}") >&2
    secs=$(( $(date +%s) - start ))
    for s in "${missing[@]}"; do
        # shellcheck disable=SC2086
        set -- $s
        dest=$(target "$@")
        mkdir -p "$(dirname "$dest")"
        mv -f "$out/$2" "$dest"
        printf '%s\t%s\t%s\t%ss (with %s)\tgo=%s\tload=%s\n' "$(date -u +%FT%TZ)" "$2" "$4" "$secs" \
            "${#missing[@]} sidecars" "$(go env GOVERSION)" "$(cut -d' ' -f1-3 /proc/loadavg)" \
            >> "$(dirname "$dest")/build-times.log"
    done
    log "built ${#missing[@]} sidecars in ${secs}s"
fi

for s in "${SIDECARS[@]}"; do
    # shellcheck disable=SC2086
    set -- $s
    echo "$1=$(target "$@")"
done

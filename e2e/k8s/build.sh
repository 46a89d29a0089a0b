#!/usr/bin/env bash
# Build real Kubernetes and etcd binaries from the Go module proxy, cached by
# version, for the integration and e2e tests.
#
#   e2e/k8s/build.sh [component...]     components: etcd kube-apiserver
#                                        kube-controller-manager kube-scheduler
#                                        kubelet kube-proxy kubectl
#                                        e2e.test agnhost ginkgo | all
#                                        | one-node (what a single-node
#                                        cluster runs: all but kube-proxy and
#                                        the storage suite's three)
#                                        (default: etcd kube-apiserver kubectl)
#
# Cache layout (MODELCACHE_TOOLS overrides the root):
#   ${XDG_CACHE_HOME:-~/.cache}/modelcache-csi/tools/
#     k8s-v1.36.3/{kube-apiserver,kubectl,...}   built from e2e/k8s/wrapper
#     k8s-v1.36.3/e2e.test                       `go test -c` of wrapper/storagee2e
#     k8s-v1.36.3/agnhost                        test/images/agnhost (for its image)
#     k8s-v1.36.3/ginkgo                         the ginkgo CLI e2e.test runs under
#     k8s-v1.36.3/etcd -> ../etcd-v3.6.8/etcd   (symlink, so one bin dir)
#     etcd-v3.6.8/etcd                           built from e2e/k8s/wrapper too
#     k8s-v1.36.3/build-times.log, etcd-v3.6.8/build-times.log
#     .build.lock                                serialises concurrent callers
#
# A binary already present is never rebuilt (a warm run takes well under a
# second). Build logs go to stderr; the last line on stdout is the bin
# directory (the k8s-<version> directory, which also holds the etcd symlink).
#
# Versions come from the wrapper modules' go.mod files (single source of truth).
# Builds run under `nice -n 19` with `go build -p 2`: this is a shared 2-core
# machine. A flock keeps parallel callers from running two big builds at once;
# it is held per component, so a caller waits only for what it needs.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
K8S_WRAPPER=$HERE/wrapper

if ! command -v go >/dev/null 2>&1; then
    if [[ -x /usr/local/go/bin/go ]]; then
        PATH=/usr/local/go/bin:$PATH
    else
        echo "build.sh: no 'go' in PATH (need Go >= 1.26)" >&2
        exit 1
    fi
fi

# Versions, read from the committed wrapper go.mod files.
K8S_VERSION=$(awk '$1=="require" && $2=="k8s.io/kubernetes" {print $3} $1=="k8s.io/kubernetes" && $2 ~ /^v/ {print $2}' \
    "$K8S_WRAPPER/go.mod" | head -n1)
# etcd is a tool of the same module, at the version of the etcd client
# kube-apiserver links, so the two share their dependencies' compiles.
ETCD_VERSION=$(awk '$1=="go.etcd.io/etcd/server/v3" && $2 ~ /^v/ {print $2} $1=="require" && $2=="go.etcd.io/etcd/server/v3" {print $3}' \
    "$K8S_WRAPPER/go.mod" | head -n1)
[[ -n $K8S_VERSION && -n $ETCD_VERSION ]] || { echo "build.sh: cannot read versions from wrapper go.mod" >&2; exit 1; }
K8S_MINOR=$(echo "$K8S_VERSION" | cut -d. -f2)
K8S_MAJOR=$(echo "$K8S_VERSION" | cut -d. -f1 | tr -d v)

TOOLS=${MODELCACHE_TOOLS:-${XDG_CACHE_HOME:-$HOME/.cache}/modelcache-csi/tools}
K8S_DIR=$TOOLS/k8s-$K8S_VERSION
ETCD_DIR=$TOOLS/etcd-$ETCD_VERSION

ALL=(etcd kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy kubectl e2e.test agnhost ginkgo)
DEFAULT=(etcd kube-apiserver kubectl)
# The test tools (etcd, kube-apiserver, kubectl) first: integration tests wait for them.
ONE_NODE=(etcd kube-apiserver kubectl kube-controller-manager kube-scheduler kubelet)

components=()
if [[ $# -eq 0 ]]; then
    components=("${DEFAULT[@]}")
else
    for c in "$@"; do
        case $c in
            all) components+=("${ALL[@]}") ;;
            one-node) components+=("${ONE_NODE[@]}") ;;
            etcd|kube-apiserver|kube-controller-manager|kube-scheduler|kubelet|kube-proxy|kubectl|e2e.test|agnhost|ginkgo) components+=("$c") ;;
            -h|--help) sed -n '2,24p' "$0" >&2; exit 0 ;;
            *) echo "build.sh: unknown component '$c' (one of: ${ALL[*]} all one-node)" >&2; exit 2 ;;
        esac
    done
fi

target_of() {
    if [[ $1 == etcd ]]; then echo "$ETCD_DIR/etcd"; else echo "$K8S_DIR/$1"; fi
}

link_etcd() {
    # One bin directory for callers: k8s-<v>/etcd points at the cached etcd.
    if [[ -x $ETCD_DIR/etcd && ! -e $K8S_DIR/etcd ]] || \
       [[ -L $K8S_DIR/etcd && $(readlink "$K8S_DIR/etcd") != "../etcd-$ETCD_VERSION/etcd" ]]; then
        ln -sfn "../etcd-$ETCD_VERSION/etcd" "$K8S_DIR/etcd"
    fi
}

missing() {
    local c
    for c in "${components[@]}"; do
        [[ -x $(target_of "$c") ]] || echo "$c"
    done
}

mkdir -p "$K8S_DIR" "$ETCD_DIR"

if [[ -n $(missing) ]]; then
    # Serialise builds across processes (parallel tests all call this script),
    # one component at a time: a caller that needs only what another has
    # built already goes on while that one builds the rest.
    exec 9>"$TOOLS/.build.lock"

    # A full, committed go.sum lets the builds run with -mod=readonly: a build
    # never rewrites the wrapper modules. (GOFLAGS from the environment replaces
    # `go env -w GOFLAGS`, so -buildvcs=false is restated: the wrappers live in
    # a git work tree whose state is irrelevant to these binaries.)
    export GOFLAGS="-mod=readonly -buildvcs=false"

    for c in $(missing); do
        out=$(target_of "$c")
        if ! flock -n 9; then
            echo "build.sh: another build is running; waiting for $TOOLS/.build.lock" >&2
            flock 9
        fi
        if [[ -x $out ]]; then
            flock -u 9   # built by the caller that held the lock
            continue
        fi
        tmp="$out.tmp.$$"
        trap 'rm -f "$tmp"' EXIT
        start=$(date +%s)
        echo "build.sh: building $c -> $out (cold builds take many minutes)" >&2
        if [[ $c == etcd ]]; then
            (cd "$K8S_WRAPPER" && nice -n 19 go build -p 2 -trimpath -ldflags "-s -w" \
                -o "$tmp" go.etcd.io/etcd/server/v3) >&2
            dir=$ETCD_DIR
        else
            ldflags="-s -w \
                -X k8s.io/component-base/version.gitVersion=$K8S_VERSION \
                -X k8s.io/component-base/version.gitMajor=$K8S_MAJOR \
                -X k8s.io/component-base/version.gitMinor=$K8S_MINOR \
                -X k8s.io/component-base/version.gitTreeState=clean"
            # agnhost is built like the rest (CGO_ENABLED=0 would compile
            # every package again, 277 s cold); its image carries its libc.
            case $c in
                e2e.test) cmd=(test -c) pkg=./storagee2e ;;
                agnhost) cmd=(build) pkg=k8s.io/kubernetes/test/images/agnhost ;;
                ginkgo) cmd=(build) pkg=github.com/onsi/ginkgo/v2/ginkgo ;;
                *) cmd=(build) pkg=k8s.io/kubernetes/cmd/$c ;;
            esac
            (cd "$K8S_WRAPPER" && nice -n 19 go "${cmd[@]}" -p 2 -trimpath -ldflags "$ldflags" \
                -o "$tmp" "$pkg") >&2
            dir=$K8S_DIR
        fi
        mv -f "$tmp" "$out"
        trap - EXIT
        secs=$(( $(date +%s) - start ))
        printf '%s\t%s\t%ss\tgo=%s\tload=%s\n' "$(date -u +%FT%TZ)" "$c" "$secs" \
            "$(go env GOVERSION)" "$(cut -d' ' -f1-3 /proc/loadavg)" >> "$dir/build-times.log"
        echo "build.sh: built $c in ${secs}s" >&2
        flock -u 9
    done
fi

link_etcd
echo "$K8S_DIR"

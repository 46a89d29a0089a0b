#!/usr/bin/env bash
# Regenerate the wrapper modules that build.sh compiles (run by hand when
# bumping versions; commit the resulting go.mod and go.sum files).
#
#   e2e/k8s/gen-wrapper.sh k8s v1.36.3      -> e2e/k8s/wrapper/go.{mod,sum}
#
# k8s.io/kubernetes replaces its ~33 staging modules (k8s.io/api, client-go,
# ...) with ./staging/src/k8s.io/X, and a dependency's replace directives are
# ignored, so `go install k8s.io/kubernetes/cmd/...@v1.x.y` fails. The wrapper
# requires k8s.io/kubernetes and replaces each staging module with its
# published v0.x.y; the list, and the `go` and `godebug` lines, are taken from
# upstream's go.mod. The commands are listed as `tool` directives so that
# `go mod tidy` keeps (and go.sum covers) everything they import; the package
# in wrapper/storagee2e (the External Storage suite, built as e2e.test) is
# part of the module, so tidy covers its imports too. etcd's server is a tool
# of the same module, at the version of the etcd client kube-apiserver links:
# it then shares every dependency (gRPC, protobuf, OpenTelemetry, ...) with
# the Kubernetes binaries, compiled once.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export GOFLAGS="-mod=mod -buildvcs=false"

[[ $# -eq 2 ]] || { echo "usage: $0 k8s v1.X.Y" >&2; exit 2; }
what=$1 version=$2

moddir() { go mod download -json "$1" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p'; }

case $what in
k8s)
    [[ $version =~ ^v1\.([0-9]+)\.([0-9]+)$ ]] || { echo "want v1.X.Y" >&2; exit 2; }
    staging=v0.${BASH_REMATCH[1]}.${BASH_REMATCH[2]}
    up=$(moddir "k8s.io/kubernetes@$version")
    [[ -f $up/go.mod ]] || { echo "no go.mod in $up" >&2; exit 1; }
    out=$HERE/wrapper
    mkdir -p "$out"
    {
        echo "// Wrapper module: builds k8s.io/kubernetes $version commands from the Go module"
        echo "// proxy. Upstream's go.mod replaces every staging module with ./staging/...;"
        echo "// replace directives of a dependency are ignored, so each one is replaced here"
        echo "// with its published $staging. Regenerate with e2e/k8s/gen-wrapper.sh."
        echo
        echo "module local/modelcache-k8s-wrapper"
        echo
        grep '^go ' "$up/go.mod"
        if grep -q '^godebug' "$up/go.mod"; then
            echo
            grep '^godebug' "$up/go.mod"
        fi
        echo
        etcd=$(awk '$1=="go.etcd.io/etcd/client/v3" && $2 ~ /^v3/ {print $2}' "$up/go.mod" | head -n1)
        [[ -n $etcd ]] || { echo "no go.etcd.io/etcd/client/v3 in upstream's go.mod" >&2; exit 1; }
        echo "require ("
        echo "	go.etcd.io/etcd/server/v3 $etcd"
        echo "	k8s.io/kubernetes $version"
        echo ")"
        echo
        echo "tool ("
        for c in kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy kubectl; do
            echo "	k8s.io/kubernetes/cmd/$c"
        done
        echo "	go.etcd.io/etcd/server/v3"
        # The storage suite's pods run it (hostexec, pause).
        echo "	k8s.io/kubernetes/test/images/agnhost"
        # The storage suite's runner (parallel specs), at the version
        # e2e.test links.
        echo "	github.com/onsi/ginkgo/v2/ginkgo"
        echo ")"
        echo
        echo "replace ("
        grep '=> ./staging/src/' "$up/go.mod" | awk -v v="$staging" '{print "\t" $1 " => " $1 " " v}'
        echo ")"
    } > "$out/go.mod"
    rm -f "$out/go.sum"
    (cd "$out" && nice -n 19 go mod tidy)
    # Every non-staging requirement must resolve to upstream's own version.
    (cd "$out" && go list -m all) | sort > "$out/.selected.tmp"
    awk '/^require \(/{f=1;next} f&&/^\)/{f=0} f&&$2!="v0.0.0"{print $1, $2}' "$up/go.mod" | sort \
        | join - "$out/.selected.tmp" | awk '$2 != $3 {print "version drift: " $0; bad=1} END {exit bad}'
    rm -f "$out/.selected.tmp"
    ;;
*)
    echo "usage: $0 k8s v1.X.Y" >&2
    exit 2
    ;;
esac
echo "regenerated $out/go.mod and go.sum" >&2

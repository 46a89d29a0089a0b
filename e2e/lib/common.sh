# shellcheck shell=bash disable=SC2034 # layout variables: used by the scripts that source this
# Shared by e2e/up, e2e/down, e2e/driver-up, e2e/driver-down and e2e/smoke.
#
# Layout of ${E2E_DIR:-/tmp/modelcache-e2e} (every path the cluster writes,
# except kubelet's fixed /var/lib/kubelet and the cgroups):
#   .modelcache-e2e   marker: only a folder carrying it is ever wiped
#   env               KEY=VALUE lines for tests (KUBECONFIG, NODE_NAME, ...)
#   api/              e2e/k8s/apiserver.sh's DIR: etcd, kube-apiserver, pki, kubeconfig
#   pki/              node PKI: kubelet client cert, apiserver->kubelet client CA + cert
#   pids/NAME.pid     one per host process started by up/driver-up
#   logs/NAME.log     their logs
#   containerd/       config.toml, root, state (with the pods' netns), runc state, socket
#   cni/              net.d conflist, host-local IPAM data
#   kubelet/          config.yaml, kubeconfig, volume-plugins, pod-logs
#   driver/           driver socket dir, state dir (loop images), registration
#   saved-sysctls     kernel tunables as they were before kubelet changed them

E2E_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
REPO_ROOT=$(cd "$E2E_ROOT/.." && pwd)
KUBELET_ROOT=/var/lib/kubelet
CNI_BRIDGE=mce2e0
CNI_NET_NAME=modelcache-e2e
POD_CIDR=10.88.0.0/16

log() { echo "$(date +%T) ${0##*/}: $*" >&2; }
die() { log "error: $*"; exit 1; }
# `producer | grep -q` is a coin toss under pipefail: grep leaves at its first
# match and a producer still writing dies of SIGPIPE (141), so the pipeline
# fails although it matched (3.5% of runs of one storage-suite check).
# `matches` takes grep's arguments and reads all of its input first.
matches() { local input; input=$(cat); grep -q "$@" <<<"$input"; }

[[ $(id -u) == 0 ]] || die "run as root"

E2E_DIR=${E2E_DIR:-/tmp/modelcache-e2e}
[[ $E2E_DIR == /* ]] || die "E2E_DIR must be absolute (got '$E2E_DIR')"
[[ $E2E_DIR != *[[:space:]]* ]] || die "E2E_DIR must not contain spaces"
E2E_DIR=${E2E_DIR%/}
case $E2E_DIR in
    ""|/|/tmp|/var|/var/lib|/var/tmp|/root|/home|/work|/usr|/etc|/run|/dev|/proc|/sys|"$HOME"|"$KUBELET_ROOT")
        die "E2E_DIR=$E2E_DIR is not a dedicated folder" ;;
esac
export E2E_DIR

TOOLS=${MODELCACHE_TOOLS:-${XDG_CACHE_HOME:-$HOME/.cache}/modelcache-csi/tools}
if ! command -v go >/dev/null 2>&1 && [[ -x /usr/local/go/bin/go ]]; then
    PATH=/usr/local/go/bin:$PATH
fi
PATH=$PATH:/usr/sbin:/sbin

PIDS=$E2E_DIR/pids
LOGS=$E2E_DIR/logs
CTRD_DIR=$E2E_DIR/containerd
CTRD_SOCK=$CTRD_DIR/containerd.sock

# --- processes -----------------------------------------------------------------

# proc_state PID: one letter (R, S, Z, ...) or nothing
proc_state() { sed 's/^.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1; }

# Every process that launch starts (and so containerd's shims) carries
# MODELCACHE_E2E=E2E_DIR/ in its environment.
TAG="MODELCACHE_E2E=$E2E_DIR/"

# ours PID: its command line names a path in E2E_DIR, or it carries TAG.
ours() {
    { tr '\0' ' ' < "/proc/$1/cmdline"; } 2>/dev/null | grep -qF -- "$E2E_DIR/" && return 0
    { tr '\0' '\n' < "/proc/$1/environ"; } 2>/dev/null | grep -qxF -- "$TAG"
}

# alive PID: runs (not a zombie) and is ours, so a recycled PID is never
# taken for ours.
alive() {
    local pid=$1 st
    [[ $pid =~ ^[0-9]+$ ]] || return 1
    st=$(proc_state "$pid")
    [[ -n $st && $st != Z && $st != X ]] || return 1
    ours "$pid"
}

# launch NAME CMD...: detached (own session, stdin closed), log LOGS/NAME.log,
# pid in PIDS/NAME.pid, TAG in its environment.
launch() {
    local name=$1
    shift
    mkdir -p "$PIDS" "$LOGS"
    env "$TAG" setsid "$@" </dev/null >>"$LOGS/$name.log" 2>&1 &
    echo $! > "$PIDS/$name.pid"
}

pid_of() { cat "$PIDS/$1.pid" 2>/dev/null || true; }

# stop NAME [SECONDS]: SIGTERM the recorded PID, SIGKILL after SECONDS (default 15).
stop() {
    local name=$1 secs=${2:-15} pid i
    pid=$(pid_of "$name")
    if alive "$pid"; then
        kill -TERM "$pid" 2>/dev/null || true
        for ((i = 0; i < secs * 10; i++)); do
            alive "$pid" || break
            sleep 0.1
        done
        if alive "$pid"; then
            log "$name (pid $pid) ignored SIGTERM for ${secs}s; SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
            for ((i = 0; i < 50; i++)); do alive "$pid" || break; sleep 0.1; done
        fi
    fi
    rm -f "$PIDS/$name.pid"
}

# wait_until SECONDS WHAT CMD...: poll CMD every 0.5s.
wait_until() {
    local secs=$1 what=$2 deadline
    shift 2
    deadline=$(($(date +%s) + secs))
    until "$@" >/dev/null 2>&1; do
        if (($(date +%s) >= deadline)); then
            log "timed out after ${secs}s waiting for $what"
            return 1
        fi
        sleep 0.5
    done
}

# require_alive NAME: fail with the log tail if NAME died.
require_alive() {
    local name=$1
    alive "$(pid_of "$name")" && return 0
    log "$name exited; last lines of $LOGS/$name.log:"
    tail -n 30 "$LOGS/$name.log" 2>/dev/null | sed 's/^/    /' >&2
    return 1
}

kctl() { "$BIN/kubectl" --kubeconfig "$E2E_DIR/api/kubeconfig" "$@"; }

load_env() {
    [[ -s $E2E_DIR/env ]] || die "no cluster in $E2E_DIR (run e2e/up)"
    # shellcheck disable=SC1091
    . "$E2E_DIR/env"
    BIN=$BIN_DIR
}

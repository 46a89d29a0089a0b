#!/usr/bin/env bash
# A real etcd + kube-apiserver on loopback for integration tests (envtest style).
#
#   e2e/k8s/apiserver.sh start DIR    start both, wait for /readyz, write DIR/env
#   e2e/k8s/apiserver.sh stop DIR     stop both (PIDs from DIR), wait until gone
#   e2e/k8s/apiserver.sh status DIR   exit 0 if both run and /readyz answers ok
#
# start:
#   - etcd on 127.0.0.1 with two free ports, data in DIR/etcd-data (wiped at start);
#   - kube-apiserver on https://127.0.0.1:<free port>, serving cert signed by a
#     throwaway CA (DIR/pki/ca.crt) with IP SAN 127.0.0.1, --token-auth-file,
#     --authorization-mode=RBAC, service-account keys (RSA),
#     --service-cluster-ip-range=10.0.0.0/24, --disable-admission-plugins=ServiceAccount;
#   - identities (the token file is read only at start, so all are made here):
#       admin         group system:masters                       ADMIN_TOKEN
#       rescheduler   no groups (only system:authenticated)      RESCHEDULER_TOKEN
#       csi-controller, csi-node: likewise, no groups            CSI_CONTROLLER_TOKEN, CSI_NODE_TOKEN
#       tenant        likewise: a namespace user once a test binds it  TENANT_TOKEN
#     Grant them what they need with RBAC objects in the test itself.
#   - DIR/kubeconfig: one cluster, a user and a context per identity,
#     current-context admin (`kubectl --context rescheduler ...` for the others);
#   - DIR/env: KEY=VALUE lines (shell-sourceable): KUBECONFIG, APISERVER_URL,
#     CA_FILE, ADMIN_TOKEN, RESCHEDULER_TOKEN, CSI_CONTROLLER_TOKEN, CSI_NODE_TOKEN,
#     ETCD_URL, ETCD_PID, APISERVER_PID, WATCHDOG_PID, BIN_DIR, DIR.
#   - logs: DIR/etcd.log, DIR/kube-apiserver.log.
#
# Environment:
#   MODELCACHE_K8S_BIN         bin dir with etcd + kube-apiserver (default: run
#                              build.sh, which builds only what is missing)
#   MODELCACHE_APISERVER_OWNER_PID  if set, a watchdog stops the servers when that
#                              process exits (a test binary killed before Drop ran)
#                              and removes DIR/etcd-data (logs are kept)
#   MODELCACHE_APISERVER_ARGS  extra kube-apiserver flags (space-separated)
#   MODELCACHE_APISERVER_TIMEOUT  seconds to wait for /readyz (default 180)
#   MODELCACHE_APISERVER_ADDRESS  bind and advertise this address instead of
#                              127.0.0.1 (it must be up; it joins the cert's SANs)
#   MODELCACHE_APISERVER_IN_CLUSTER=1  serve pods too: the ServiceAccount
#                              admission plugin (token volumes) and the lease
#                              endpoint reconciler (the kubernetes Service's
#                              endpoints) are on; needs a non-loopback ADDRESS
#
# A previous crashed run in the same DIR is cleaned up first: its processes are
# killed (only if their command line still names DIR, so a recycled PID is never
# hit), and new ports are chosen on every start.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

usage() {
    echo "usage: $0 start DIR | stop DIR | status DIR" >&2
    exit 2
}

log() { echo "apiserver.sh: $*" >&2; }

# --- process helpers ---------------------------------------------------------

# alive PID DIR: the PID runs (not a zombie) and its command line names a
# path inside DIR ("DIR/", so /tmp/a never matches a process of /tmp/ab).
alive() {
    local pid=$1 dir=$2 state
    [[ -n $pid && -r /proc/$pid/stat ]] || return 1
    state=$(sed 's/^.*) //' "/proc/$pid/stat" 2>/dev/null | cut -d' ' -f1) || return 1
    [[ $state != Z && $state != X ]] || return 1
    tr '\0' ' ' 2>/dev/null < "/proc/$pid/cmdline" | grep -qF -- "$dir/"
}

# running PID: the process exists and is not a zombie.
running() {
    local state
    state=$(sed 's/^.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1)
    [[ -n $state && $state != Z && $state != X ]]
}

# reap_wait PID: our servers are reparented to PID 1, which reaps them about
# a second after they exit; wait (at most 5s) so that callers checking with
# pgrep right after `stop` see nothing.
reap_wait() {
    local pid=$1 i
    for ((i = 0; i < 50; i++)); do
        [[ $(sed 's/^.*) //' "/proc/$pid/stat" 2>/dev/null | cut -d' ' -f1) == Z ]] || return 0
        sleep 0.1
    done
}

# kill_wait PID DIR NAME: SIGTERM, wait up to 20s, then SIGKILL and wait.
kill_wait() {
    local pid=$1 dir=$2 name=$3 i
    alive "$pid" "$dir" || return 0
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 200; i++)); do
        alive "$pid" "$dir" || return 0
        sleep 0.1
    done
    log "$name (pid $pid) ignored SIGTERM for 20s; sending SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
    for ((i = 0; i < 100; i++)); do
        alive "$pid" "$dir" || return 0
        sleep 0.1
    done
    log "$name (pid $pid) still present after SIGKILL"
    return 1
}

stop_dir() {
    local dir=$1 rc=0 f
    # The watchdog first, so it does not race us; then the apiserver, then etcd.
    local pids=()
    for f in watchdog kube-apiserver etcd; do
        if [[ -s $dir/$f.pid ]]; then
            pids+=("$(cat "$dir/$f.pid")")
            kill_wait "${pids[-1]}" "$dir" "$f" || rc=1
        fi
    done
    # A start that died between launching a process and writing its pid file:
    # anything whose command line names DIR's files is ours.
    local pid re
    re=$(printf '%s' "$dir" | sed 's/[][\.*^$+?(){}|]/\\&/g')
    for pid in $(pgrep -f -- "$re/(etcd-data|pki/sa\.key|tokens\.csv)" 2>/dev/null || true); do
        [[ $pid == "$$" ]] && continue
        kill_wait "$pid" "$dir" "stray" || rc=1
        pids+=("$pid")
    done
    for pid in "${pids[@]}"; do reap_wait "$pid"; done
    rm -f "$dir/watchdog.pid" "$dir/kube-apiserver.pid" "$dir/etcd.pid"
    return $rc
}

# --- ports ---------------------------------------------------------------------

# N distinct free TCP ports on 127.0.0.1, below the ephemeral range (so
# outgoing connections never take one between our check and the server's bind).
free_ports() {
    local n=$1 used picked="" p i
    used=$(ss -Htan 2>/dev/null | awk '{n=split($4,a,":"); print a[n]}' | sort -u)
    for ((i = 0; i < 500 && n > 0; i++)); do
        p=$((20000 + RANDOM % 12000))
        grep -qx -- "$p" <<<"$used$picked" && continue
        picked+=$'\n'"$p"
        echo "$p"
        n=$((n - 1))
    done
    ((n == 0)) || { log "no free port found"; return 1; }
}

# --- certificates and tokens ----------------------------------------------------

make_pki() {
    local pki=$1
    mkdir -p "$pki"
    (
        cd "$pki"
        openssl req -x509 -newkey rsa:2048 -nodes -sha256 -days 3650 \
            -keyout ca.key -out ca.crt -subj "/CN=modelcache-test-ca" \
            -addext "basicConstraints=critical,CA:TRUE" \
            -addext "keyUsage=critical,keyCertSign,cRLSign,digitalSignature" 2>/dev/null
        openssl req -newkey rsa:2048 -nodes -sha256 \
            -keyout apiserver.key -out apiserver.csr -subj "/CN=kube-apiserver" 2>/dev/null
        cat > apiserver.ext <<EOF
basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=IP:127.0.0.1,${EXTRA_SAN}IP:10.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local
EOF
        openssl x509 -req -sha256 -days 3650 -in apiserver.csr -CA ca.crt -CAkey ca.key \
            -CAcreateserial -extfile apiserver.ext -out apiserver.crt 2>/dev/null
        # Service-account token signing key (RSA) and its public half.
        openssl genrsa -out sa.key 2048 2>/dev/null
        openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
        chmod 600 ca.key apiserver.key sa.key
    )
}

token() { openssl rand -hex 24; }

# --- start -------------------------------------------------------------------------

write_kubeconfig() {
    local dir=$1 url=$2 ca_b64 name
    ca_b64=$(base64 -w0 < "$dir/pki/ca.crt")
    {
        echo "apiVersion: v1"
        echo "kind: Config"
        echo "clusters:"
        echo "- name: modelcache-test"
        echo "  cluster:"
        echo "    server: $url"
        echo "    certificate-authority-data: $ca_b64"
        echo "users:"
        for name in "${!TOKENS[@]}"; do
            echo "- name: $name"
            echo "  user:"
            echo "    token: ${TOKENS[$name]}"
        done
        echo "contexts:"
        for name in "${!TOKENS[@]}"; do
            echo "- name: $name"
            echo "  context:"
            echo "    cluster: modelcache-test"
            echo "    user: $name"
            echo "    namespace: default"
        done
        echo "current-context: admin"
    } > "$dir/kubeconfig.tmp"
    chmod 600 "$dir/kubeconfig.tmp"
    mv -f "$dir/kubeconfig.tmp" "$dir/kubeconfig"
}

tail_log() {
    local f=$1
    [[ -s $f ]] || return 0
    log "last lines of $f:"
    tail -n 25 "$f" | sed 's/^/    /' >&2
}

# launch NAME LOG CMD...: detached (own session, no inherited stdio), pid file DIR/NAME.pid
launch() {
    local name=$1 logf=$2
    shift 2
    setsid "$@" </dev/null >>"$logf" 2>&1 &
    echo $! > "$DIR/$name.pid"
}

wait_http() { # wait_http DEADLINE PID NAME CURL_ARGS...
    local deadline=$1 pid=$2 name=$3
    shift 3
    while :; do
        if curl -fsS --max-time 5 "$@" >/dev/null 2>&1; then
            # Still ours? (If our server lost its port to another one, the
            # answer came from that one; our process has exited by now.)
            sleep 0.2
            if alive "$pid" "$DIR"; then return 0; fi
        fi
        # Our own fresh child: only "gone" counts here. (alive would also fail
        # in the instant between fork and exec, while the child's command
        # line is still this script's, which names DIR without a slash.)
        if ! running "$pid"; then
            log "$name exited during startup"
            return 1
        fi
        if (($(date +%s) >= deadline)); then
            log "$name not ready in time"
            return 1
        fi
        sleep 0.3
    done
}

API_ADDRESS=${MODELCACHE_APISERVER_ADDRESS:-127.0.0.1}
EXTRA_SAN=
[[ $API_ADDRESS == 127.0.0.1 ]] || EXTRA_SAN="IP:$API_ADDRESS,"

start_once() {
    local in_cluster=(--disable-admission-plugins ServiceAccount --endpoint-reconciler-type none)
    if [[ ${MODELCACHE_APISERVER_IN_CLUSTER:-0} == 1 ]]; then
        [[ $API_ADDRESS != 127.* ]] || { log "MODELCACHE_APISERVER_IN_CLUSTER needs a non-loopback MODELCACHE_APISERVER_ADDRESS"; return 1; }
        in_cluster=(--endpoint-reconciler-type lease)
    fi
    local etcd_port etcd_peer api_port
    read -r etcd_port etcd_peer api_port <<<"$(free_ports 3 | tr '\n' ' ')"
    local etcd_url=http://127.0.0.1:$etcd_port
    local url=https://$API_ADDRESS:$api_port
    local timeout=${MODELCACHE_APISERVER_TIMEOUT:-180}
    local deadline=$(($(date +%s) + timeout))

    rm -rf "$DIR/etcd-data"
    : > "$DIR/etcd.log"
    : > "$DIR/kube-apiserver.log"

    launch etcd "$DIR/etcd.log" "$BIN/etcd" \
        --name modelcache \
        --data-dir "$DIR/etcd-data" \
        --listen-client-urls "$etcd_url" \
        --advertise-client-urls "$etcd_url" \
        --listen-peer-urls "http://127.0.0.1:$etcd_peer" \
        --initial-advertise-peer-urls "http://127.0.0.1:$etcd_peer" \
        --initial-cluster "modelcache=http://127.0.0.1:$etcd_peer" \
        --initial-cluster-state new \
        --unsafe-no-fsync \
        --log-level warn
    local etcd_pid
    etcd_pid=$(cat "$DIR/etcd.pid")
    if ! wait_http "$deadline" "$etcd_pid" etcd "$etcd_url/health"; then
        tail_log "$DIR/etcd.log"
        return 1
    fi

    # shellcheck disable=SC2086 # extra args are meant to be split
    launch kube-apiserver "$DIR/kube-apiserver.log" "$BIN/kube-apiserver" \
        --etcd-servers "$etcd_url" \
        --bind-address "$API_ADDRESS" \
        --advertise-address "$API_ADDRESS" \
        --secure-port "$api_port" \
        --cert-dir "$DIR/pki" \
        --tls-cert-file "$DIR/pki/apiserver.crt" \
        --tls-private-key-file "$DIR/pki/apiserver.key" \
        --client-ca-file "$DIR/pki/ca.crt" \
        --token-auth-file "$DIR/tokens.csv" \
        --authorization-mode RBAC \
        --service-account-issuer https://kubernetes.default.svc.cluster.local \
        --service-account-key-file "$DIR/pki/sa.pub" \
        --service-account-signing-key-file "$DIR/pki/sa.key" \
        --service-cluster-ip-range 10.0.0.0/24 \
        "${in_cluster[@]}" \
        --allow-privileged=true \
        --profiling=false \
        ${MODELCACHE_APISERVER_ARGS:-}
    local api_pid
    api_pid=$(cat "$DIR/kube-apiserver.pid")
    if ! wait_http "$deadline" "$api_pid" kube-apiserver --cacert "$DIR/pki/ca.crt" \
        -H "Authorization: Bearer ${TOKENS[admin]}" "$url/readyz"; then
        tail_log "$DIR/kube-apiserver.log"
        return 1
    fi

    write_kubeconfig "$DIR" "$url"

    local watchdog_pid=""
    if [[ -n ${MODELCACHE_APISERVER_OWNER_PID:-} ]]; then
        # Stops the servers once the owner (a test process) is gone, even if it
        # was killed before it could run `stop`. Its command line names "DIR/".
        # shellcheck disable=SC2016 # expanded by the inner bash
        setsid bash -c '
            owner=$1 script=$2 dir=$3
            while kill -0 "$owner" 2>/dev/null; do sleep 1; done
            rm -f "$dir/watchdog.pid"
            "$script" stop "$dir"
            # Nobody will remove DIR now: drop the bulk (etcd preallocates a
            # 64 MB WAL) and keep the logs for a post-mortem.
            rm -rf "$dir/etcd-data"
        ' modelcache-apiserver-watchdog "$MODELCACHE_APISERVER_OWNER_PID" "$HERE/apiserver.sh" "$DIR/" \
            </dev/null >>"$DIR/watchdog.log" 2>&1 &
        watchdog_pid=$!
        echo "$watchdog_pid" > "$DIR/watchdog.pid"
    fi

    {
        echo "DIR=$DIR"
        echo "BIN_DIR=$BIN"
        echo "KUBECONFIG=$DIR/kubeconfig"
        echo "APISERVER_URL=$url"
        echo "CA_FILE=$DIR/pki/ca.crt"
        echo "ADMIN_TOKEN=${TOKENS[admin]}"
        echo "RESCHEDULER_TOKEN=${TOKENS[rescheduler]}"
        echo "CSI_CONTROLLER_TOKEN=${TOKENS[csi-controller]}"
        echo "CSI_NODE_TOKEN=${TOKENS[csi-node]}"
        echo "TENANT_TOKEN=${TOKENS[tenant]}"
        echo "ETCD_URL=$etcd_url"
        echo "ETCD_PID=$etcd_pid"
        echo "APISERVER_PID=$api_pid"
        echo "WATCHDOG_PID=$watchdog_pid"
    } > "$DIR/env.tmp"
    mv -f "$DIR/env.tmp" "$DIR/env"
    log "ready: $url (kubeconfig $DIR/kubeconfig)"
}

start() {
    mkdir -p "$DIR"
    DIR=$(cd "$DIR" && pwd -P)

    # Clean up after a previous (possibly crashed) run in this DIR.
    stop_dir "$DIR" || { log "cannot stop a previous run in $DIR"; exit 1; }
    rm -f "$DIR/env"

    if [[ -n ${MODELCACHE_K8S_BIN:-} ]]; then
        BIN=$MODELCACHE_K8S_BIN
    else
        BIN=$("$HERE/build.sh" etcd kube-apiserver | tail -n1)
    fi
    local b
    for b in etcd kube-apiserver; do
        [[ -x $BIN/$b ]] || { log "missing $BIN/$b (run e2e/k8s/build.sh)"; exit 1; }
    done

    make_pki "$DIR/pki"
    declare -gA TOKENS=()
    TOKENS[admin]=$(token)
    TOKENS[rescheduler]=$(token)
    TOKENS[csi-controller]=$(token)
    TOKENS[csi-node]=$(token)
    TOKENS[tenant]=$(token)
    # token,user,uid[,"group1,group2"]; users without groups get only
    # system:authenticated (discovery), so RBAC tests start from nothing.
    {
        echo "${TOKENS[admin]},admin,admin,\"system:masters\""
        echo "${TOKENS[rescheduler]},rescheduler,rescheduler"
        echo "${TOKENS[csi-controller]},csi-controller,csi-controller"
        echo "${TOKENS[csi-node]},csi-node,csi-node"
        echo "${TOKENS[tenant]},tenant,tenant"
    } > "$DIR/tokens.csv"
    chmod 600 "$DIR/tokens.csv"

    local attempt
    for attempt in 1 2 3; do
        if start_once; then
            return 0
        fi
        stop_dir "$DIR" || true
        if grep -qiE "address already in use" "$DIR/etcd.log" "$DIR/kube-apiserver.log" 2>/dev/null; then
            log "port clash; retrying with new ports (attempt $attempt)"
            continue
        fi
        break
    done
    log "failed to start (logs in $DIR)"
    exit 1
}

status() {
    DIR=$(cd "$DIR" && pwd -P)
    [[ -s $DIR/env ]] || return 1
    local url ca tok
    url=$(sed -n 's/^APISERVER_URL=//p' "$DIR/env")
    ca=$(sed -n 's/^CA_FILE=//p' "$DIR/env")
    tok=$(sed -n 's/^ADMIN_TOKEN=//p' "$DIR/env")
    alive "$(cat "$DIR/etcd.pid" 2>/dev/null)" "$DIR" || { log "etcd not running"; return 1; }
    alive "$(cat "$DIR/kube-apiserver.pid" 2>/dev/null)" "$DIR" || { log "kube-apiserver not running"; return 1; }
    curl -fsS --max-time 5 --cacert "$ca" -H "Authorization: Bearer $tok" "$url/readyz" >/dev/null
}

[[ $# -eq 2 ]] || usage
cmd=$1
DIR=$2
case $cmd in
    start) start ;;
    stop)
        [[ -d $DIR ]] || exit 0
        DIR=$(cd "$DIR" && pwd -P)
        stop_dir "$DIR"
        rm -f "$DIR/env"
        ;;
    status) status ;;
    *) usage ;;
esac

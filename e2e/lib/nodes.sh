# shellcheck shell=bash
# Nodes of the multi-node e2e cluster (e2e/up with E2E_NODES=N): each node is
# a network, mount, UTS and PID namespace on this host,
# running its own containerd, kubelet and kube-proxy, so a driver installed
# from deploy/csi-driver as pods sees what it sees on a real machine:
#
#   host                       node k (k = 1..N)
#   mce2enodes0 10.213.0.1/24  eth0 10.213.0.(10+k)/24, default via 10.213.0.1
#     kube-apiserver :port     cni0 10.214.k.1/24 (pods: bridge, masquerade;
#                              10.214.j.0/24 via node j: pods reach pods)
#     MinIO, test origins      kube-proxy (iptables, in the node's netns only)
#                              /var/lib/kubelet        <- nodes/NAME/kubelet (rshared)
#                              /var/lib/modelcache-csi <- nodes/NAME/state   (rshared)
#                              /mnt/models             <- the shared filesystem: a
#                                                         GlusterFS volume served by the
#                                                         host (gluster.sh), or shared/
#                              cgroups under /<NAME>/ in every hierarchy
#
# The host's own iptables, routes, forwarding and /var/lib/kubelet are not
# touched: every rule kube-proxy and the CNI plugins write lives in a node's
# netns, every mount kubelet and the driver make lives in a node's mount
# namespace (a slave of the host's: host mounts show inside, nothing leaks
# out). Loop devices are global, as on a real machine's kernel. The node's
# PID 1 is its namespace holder, and its /proc is its own, as in a kind node:
# tools that enter "the host" through /proc/1/ns/mnt (Kubernetes' storage
# suite's hostexec pods) land in the node, not on this machine.
#
# Sourced by e2e/up, e2e/down and the multi-node flows after common.sh.
. "$E2E_ROOT/lib/configs.sh"

PKI=${PKI:-$E2E_DIR/pki}   # e2e/up's: the CA kubelets trust for the apiserver's client cert
NODES_BRIDGE=mce2enodes0
NODES_HOST_IP=10.213.0.1
NODES_CLUSTER_CIDR=10.214.0.0/16
NODES_DIR=$E2E_DIR/nodes
SHARED_DIR=$E2E_DIR/shared
. "$E2E_ROOT/lib/gluster.sh"

node_name() { echo "e2e-node-$1"; }
node_ip() { echo "10.213.0.$((10 + $1))"; }
node_netns() { echo "mce2e-n$1"; }
node_dir() { echo "$NODES_DIR/$(node_name "$1")"; }

# child_of PID: PID's first child, waiting up to 5 s for it to appear.
child_of() {
    local i child
    for ((i = 0; i < 100; i++)); do
        child=$(pgrep -P "$1" | head -n1 || true)
        [[ -z $child ]] || { echo "$child"; return 0; }
        sleep 0.05
    done
    return 1
}

# node_holder K: the host PID of node K's PID 1.
node_holder() {
    local holder
    holder=$(pid_of "$(node_name "$1")-ns")
    alive "$holder" || die "node $(node_name "$1") has no namespace holder"
    echo "$holder"
}

# node_exec K CMD...: run CMD inside node K's namespaces (net, mount, UTS,
# PID: the node's /proc only knows its own processes).
node_exec() {
    local k=$1 holder
    shift
    holder=$(node_holder "$k") || return 1
    nsenter -t "$holder" --mount --uts --net --pid -- "$@"
}

# node_launch K NAME CMD...: launch (common.sh) inside node K's namespaces.
# nsenter forks into the PID namespace and passes no signal on, so the pid
# recorded is its child's: the one stop() must signal.
node_launch() {
    local k=$1 name=$2 holder child
    shift 2
    holder=$(node_holder "$k") || return 1
    launch "$name" nsenter -t "$holder" --mount --uts --net --pid -- "$@"
    child=$(child_of "$(pid_of "$name")") || { log "$name: nsenter started nothing"; return 1; }
    echo "$child" > "$PIDS/$name.pid"
}

# The host side: one bridge every node's veth joins, with the address the
# apiserver binds to. Must exist before the apiserver starts.
nodes_bridge_up() {
    ip link show "$NODES_BRIDGE" >/dev/null 2>&1 || ip link add "$NODES_BRIDGE" type bridge
    ip addr replace "$NODES_HOST_IP/24" dev "$NODES_BRIDGE"
    ip link set "$NODES_BRIDGE" up
}

# node_namespaces_up K: the netns with its veth and address, and a holder
# process that owns the node's mount and UTS namespaces (the node's "init").
node_namespaces_up() {
    local k=$1 name ns nd ip shared_mount
    name=$(node_name "$k") ns=$(node_netns "$k") nd=$(node_dir "$k") ip=$(node_ip "$k")
    shared_mount=$(shared_fs_mount_cmd /mnt/models "$nd/shared-fs-client.log")
    mkdir -p "$nd"/{kubelet,state,pki,containerd/{root,state,runc,opt},cni/{net.d,ipam},pod-logs,volume-plugins} "$SHARED_DIR"
    # A node that comes back (nodedeath) finds its old netns name and host
    # veth, which the kernel drops only once the last process left.
    ip netns del "$ns" 2>/dev/null || true
    ip link del "$ns" 2>/dev/null || true
    wait_until 10 "the old veth $ns to go" bash -c "! ip link show $ns" || return 1
    ip netns add "$ns"
    ip link add "$ns" type veth peer name eth0 netns "$ns"
    ip link set "$ns" master "$NODES_BRIDGE" up
    ip -n "$ns" link set lo up
    ip -n "$ns" addr add "$ip/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" route add default via "$NODES_HOST_IP"
    # Pods reach pods on other nodes (peer fill between the node plugins),
    # as a CNI's routes let them: each node's pod subnet through its address.
    local j
    for ((j = 1; j <= ${E2E_NODES:-1}; j++)); do
        ((j == k)) || ip -n "$ns" route add "10.214.$j.0/24" via "$(node_ip "$j")"
    done
    ip netns exec "$ns" sysctl -q -w net.ipv4.ip_forward=1
    # The mount points exist on the host, empty; only the node's namespace
    # mounts anything on them.
    mkdir -p "$KUBELET_ROOT" /var/lib/modelcache-csi /mnt/models
    rm -f "$nd/ns-ready"
    # --propagation slave: the host's mounts (E2E_DIR, /dev, ...) show
    # inside; the node's own never reach the host or another node. kubelet
    # and the driver's Bidirectional mounts need their roots rshared.
    launch "$name-ns" nsenter --net="/run/netns/$ns" -- \
        unshare --mount --uts --pid --fork --mount-proc --propagation slave -- /bin/sh -ec "
            hostname $name
            mount --bind $nd/kubelet $KUBELET_ROOT && mount --make-rshared $KUBELET_ROOT
            mount --bind $nd/state /var/lib/modelcache-csi && mount --make-rshared /var/lib/modelcache-csi
            $shared_mount && mount --make-rshared /mnt/models
            touch $nd/ns-ready
            exec sleep infinity"
    wait_until 10 "node $name's namespaces" test -e "$nd/ns-ready" || { require_alive "$name-ns"; return 1; }
    # unshare forked the node's PID 1; that is the process every node_exec
    # enters, and the one whose death (SIGKILL: a namespace's init ignores
    # the rest) takes every process of the node with it.
    local init
    init=$(child_of "$(pid_of "$name-ns")") || { log "node $name: unshare has no child"; return 1; }
    echo "$init" > "$PIDS/$name-ns.pid"
    # cgroup v1 hierarchies: a root per node, so two kubelets never share
    # /kubepods. A fresh cpuset cgroup has no CPUs or memory nodes until told.
    local h
    for h in /sys/fs/cgroup/*/; do
        [[ -d $h ]] || continue
        mkdir -p "$h$name"
        if [[ -f ${h}cpuset.cpus ]]; then
            cat "${h}cpuset.cpus" > "$h$name/cpuset.cpus"
            cat "${h}cpuset.mems" > "$h$name/cpuset.mems"
        fi
    done
}

# node_pki K: the kubelet's client cert (system:node:NAME) and kube-proxy's
# (system:kube-proxy, bound to system:node-proxier by the apiserver's
# bootstrap RBAC), both signed by the apiserver's client CA.
node_pki() {
    local k=$1 name nd
    name=$(node_name "$k") nd=$(node_dir "$k")
    (
        cd "$nd/pki"
        printf 'basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=clientAuth\n' > client.ext
        for who in "kubelet:/O=system:nodes/CN=system:node:$name" "kube-proxy:/CN=system:kube-proxy"; do
            openssl req -newkey rsa:2048 -nodes -sha256 -keyout "${who%%:*}.key" -out "${who%%:*}.csr" \
                -subj "${who#*:}" 2>/dev/null
            openssl x509 -req -sha256 -days 3650 -in "${who%%:*}.csr" -CA "$E2E_DIR/api/pki/ca.crt" \
                -CAkey "$E2E_DIR/api/pki/ca.key" -CAcreateserial -extfile client.ext -out "${who%%:*}.crt" 2>/dev/null
        done
        chmod 600 ./*.key
    )
    local who
    for who in kubelet kube-proxy; do
        cat > "$nd/$who.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: modelcache-e2e
  cluster: {server: "$APISERVER_URL", certificate-authority: "$E2E_DIR/api/pki/ca.crt"}
users:
- name: $who
  user: {client-certificate: "$nd/pki/$who.crt", client-key: "$nd/pki/$who.key"}
contexts:
- name: $who
  context: {cluster: modelcache-e2e, user: $who}
current-context: $who
EOF
        chmod 600 "$nd/$who.kubeconfig"
    done
}

# node_up K: containerd, kube-proxy and kubelet of node K, images imported.
# Needs PKI (e2e/up's kubelet-ca), APISERVER_URL, BIN, PAUSE_IMAGE, the
# image tarballs named in the remaining arguments and NODE_IMAGE_ALIASES.
node_up() {
    local k=$1 name nd ip sock
    shift
    name=$(node_name "$k") nd=$(node_dir "$k") ip=$(node_ip "$k")
    sock=$nd/containerd/containerd.sock
    node_namespaces_up "$k"
    node_pki "$k"
    write_containerd_config "$nd/containerd" "$nd/cni/net.d"
    write_cni_config "$nd/cni" cni0 "10.214.$k.0/24" true
    node_launch "$k" "$name-containerd" containerd --config "$nd/containerd/config.toml" --log-level warn
    wait_until 30 "$name's containerd" ctr --address "$sock" version || { require_alive "$name-containerd"; return 1; }
    local t
    for t in "$@"; do
        ctr --address "$sock" -n k8s.io images import "$t" >>"$LOGS/ctr.log" 2>&1 \
            || { tail -5 "$LOGS/ctr.log" >&2; die "ctr images import $t on $name failed"; }
    done
    ctr --address "$sock" -n k8s.io images tag --force "$BUSYBOX_IMAGE" docker.io/library/busybox:1.36 >/dev/null
    # NODE_IMAGE_ALIASES: more names, each "SOURCE=NAME" or a busybox "NAME".
    local a
    for a in "${NODE_IMAGE_ALIASES[@]}"; do
        [[ $a == *=* ]] || a="$BUSYBOX_IMAGE=$a"
        ctr --address "$sock" -n k8s.io images tag --force "${a%%=*}" "${a#*=}" >/dev/null
    done
    node_launch "$k" "$name-kube-proxy" "$BIN/kube-proxy" \
        --kubeconfig "$nd/kube-proxy.kubeconfig" \
        --hostname-override "$name" \
        --proxy-mode iptables \
        --cluster-cidr "$NODES_CLUSTER_CIDR" \
        --conntrack-max-per-core 0 \
        --conntrack-tcp-timeout-established 0 \
        --conntrack-tcp-timeout-close-wait 0 \
        --healthz-bind-address 127.0.0.1:10256 \
        --metrics-bind-address 127.0.0.1:10249 \
        --v=1
    write_kubelet_config "$nd/kubelet-config.yaml" "$sock" "$nd/volume-plugins" "$nd/pod-logs" "/$name"
    node_launch "$k" "$name-kubelet" "$BIN/kubelet" \
        --config "$nd/kubelet-config.yaml" \
        --kubeconfig "$nd/kubelet.kubeconfig" \
        --hostname-override "$name" \
        --node-ip "$ip" \
        --root-dir "$KUBELET_ROOT" \
        --cert-dir "$nd/pki/serving" \
        --v=2
    sleep 1
    require_alive "$name-kubelet"
    require_alive "$name-kube-proxy"
}

# node_down K: every process of node K (pods first), its netns and cgroups.
# The mount namespace goes with its last process.
node_down() {
    local k=$1 name f pid
    name=$(node_name "$k")
    shopt -s globstar nullglob
    for f in /sys/fs/cgroup/*/"$name"/kubepods*/cgroup.procs /sys/fs/cgroup/*/"$name"/kubepods*/**/cgroup.procs; do
        [[ -r $f ]] || continue
        # A cgroup can go between the glob and the read.
        { while read -r pid; do [[ -n $pid ]] && kill -KILL "$pid"; done < "$f"; } 2>/dev/null
    done
    stop "$name-kubelet" 15
    stop "$name-kube-proxy" 5
    stop "$name-containerd" 15
    stop "$name-ns" 0
}

# nodes_cleanup: what node_down and a killed run can leave: netns, veths,
# the bridge, per-node cgroups.
nodes_cleanup() {
    local ns d rc=0
    for ns in $(ip netns list 2>/dev/null | awk '$1 ~ /^mce2e-n[0-9]+$/ {print $1}'); do
        ip netns del "$ns" 2>/dev/null || rc=1
    done
    if ip link show "$NODES_BRIDGE" >/dev/null 2>&1; then
        ip link del "$NODES_BRIDGE" || rc=1
    fi
    for d in /sys/fs/cgroup/*/e2e-node-*; do
        [[ -d $d ]] || continue
        find "$d" -depth -type d -exec rmdir {} \; 2>/dev/null
        [[ ! -d $d ]] || { log "cgroup $d could not be removed"; rc=1; }
    done
    return $rc
}

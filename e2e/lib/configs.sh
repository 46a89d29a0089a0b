# shellcheck shell=bash
# Config files of a node's containerd, CNI and kubelet: e2e/up writes them for
# the host node and, through e2e/lib/nodes.sh, for each namespace node.
# Sourced after common.sh; PAUSE_IMAGE and PKI must be set.

# write_containerd_config DIR CNI_CONF_DIR: DIR/config.toml; the socket is
# DIR/containerd.sock, root, state, runc state and opt under DIR.
write_containerd_config() {
    local dir=$1 cni_conf=$2
    mkdir -p "$dir"/{root,state,runc,opt}
    cat > "$dir/config.toml" <<EOF
version = 2
root = "$dir/root"
state = "$dir/state"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs", "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

[grpc]
  address = "$dir/containerd.sock"
[ttrpc]
  address = "$dir/containerd.sock.ttrpc"
[debug]
  address = ""
[metrics]
  address = ""

[plugins."io.containerd.internal.v1.opt"]
  path = "$dir/opt"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$PAUSE_IMAGE"
  netns_mounts_under_state_dir = true
  enable_selinux = false
  # Root here lacks CAP_SYS_RESOURCE, so no process may lower its
  # oom_score_adj (the sandbox asks for -998): clamp to containerd's own.
  restrict_oom_score_adj = true
  disable_apparmor = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "$dir/runc"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$cni_conf"
    max_conf_num = 1
EOF
}

# write_cni_config DIR BRIDGE SUBNET GATEWAY: DIR/net.d's conflist and
# DIR/ipam. GATEWAY=false (the host node): pods get an address and a
# loopback, no route off the bridge, and the host's ip_forward and iptables
# stay untouched. GATEWAY=true (a namespace node, whose iptables are its
# own): the bridge is the pods' gateway and masquerades them to the node's
# address, so pods reach the apiserver and the test origins.
write_cni_config() {
    local dir=$1 bridge=$2 subnet=$3 gw=$4 routes=
    [[ $gw == true ]] && routes=',
        "routes": [{"dst": "0.0.0.0/0"}]'
    mkdir -p "$dir/net.d" "$dir/ipam"
    cat > "$dir/net.d/10-$CNI_NET_NAME.conflist" <<EOF
{
  "cniVersion": "0.4.0",
  "name": "$CNI_NET_NAME",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "$bridge",
      "isGateway": $gw,
      "ipMasq": $gw,
      "hairpinMode": false,
      "ipam": {
        "type": "host-local",
        "dataDir": "$dir/ipam",
        "ranges": [[{"subnet": "$subnet"}]]$routes
      }
    },
    {"type": "loopback"}
  ]
}
EOF
}

# write_kubelet_config FILE CONTAINERD_SOCK VOLUME_PLUGIN_DIR POD_LOGS_DIR CGROUP_ROOT
write_kubelet_config() {
    local file=$1 sock=$2 plugins=$3 podlogs=$4 cgroot=$5
    mkdir -p "$plugins" "$podlogs"
    cat > "$file" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
cgroupDriver: cgroupfs
failCgroupV1: false
failSwapOn: false
containerRuntimeEndpoint: unix://$sock
imageServiceEndpoint: unix://$sock
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard:
  memory.available: "100Mi"
  nodefs.available: "1%"
  nodefs.inodesFree: "1%"
  imagefs.available: "1%"
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: false}
  x509: {clientCAFile: $PKI/kubelet-ca.crt}
authorization:
  mode: AlwaysAllow
volumePluginDir: $plugins
podLogsDir: $podlogs
registerNode: true
serializeImagePulls: false
maxPods: 110
protectKernelDefaults: false
# No CAP_SYS_RESOURCE here: kubelet cannot lower its own oom_score_adj.
oomScoreAdj: 0
cgroupRoot: $cgroot
EOF
}

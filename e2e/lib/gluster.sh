# shellcheck shell=bash
# The multi-node cluster's shared filesystem (issue #25): a GlusterFS volume
# served from this host, mounted by every node with the native FUSE client
# inside the node's own mount and network namespaces (as a node's fstab
# would), and once more on the host at SHARED_DIR so checks can look at it
# as a third client:
#
#   host: glusterd, bricks E2E_DIR/gluster/brick{1,2} (replica 2),
#         NODES_HOST_IP:/mce2e-models mounted at SHARED_DIR
#   node k: NODES_HOST_IP:/mce2e-models mounted at /mnt/models (its client
#           runs in the node's PID namespace and dies with the node)
#
# Both bricks live on this host, so replica 2 buys no safety here; it makes
# every write go through Gluster's replication (AFR), as on a real volume,
# and lets a fault flow take one brick away. The volume keeps Gluster's
# default client caching (entry and attribute timeouts of 1 s): that is
# what the driver must be correct under.
#
# E2E_SHARED_FS=hostdir keeps the old variant: one host directory bind-mounted
# into every node (no client caching at all).
#
# Sourced by nodes.sh.

SHARED_FS=${E2E_SHARED_FS:-gluster}
GLUSTER_VOL=mce2e-models
GLUSTER_DIR=$E2E_DIR/gluster

# shared_fs_mount_cmd TARGET LOGFILE: the command that mounts the shared
# filesystem at TARGET (run inside a node's namespaces).
shared_fs_mount_cmd() {
    local target=$1 logfile=$2
    case $SHARED_FS in
        gluster) echo "mount -t glusterfs -o log-file=$logfile $NODES_HOST_IP:/$GLUSTER_VOL $target" ;;
        hostdir) echo "mount --bind $SHARED_DIR $target" ;;
        *) die "E2E_SHARED_FS must be gluster or hostdir (got '$SHARED_FS')" ;;
    esac
}

gluster_cli() { gluster --mode=script "$@"; }

# shared_fs_up: the server and the host's own client. After nodes_bridge_up
# (the bricks are named by the bridge's address, which must be local).
shared_fs_up() {
    mkdir -p "$SHARED_DIR"
    [[ $SHARED_FS == gluster ]] || return 0
    local p need=()
    for p in glusterfs-server glusterfs-client; do
        dpkg-query -W -f '${Status}' "$p" 2>/dev/null | matches ' installed' || need+=("$p")
    done
    if ((${#need[@]})); then
        log "installing Debian packages: ${need[*]}"
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}"; } \
            >> "$LOGS/apt.log" 2>&1 || { tail -20 "$LOGS/apt.log" >&2; die "apt-get install of GlusterFS failed"; }
    fi
    if ! pgrep -x glusterd >/dev/null; then
        # -N: in the foreground, so it is ours to stop (and e2e/down's).
        launch glusterd glusterd -N --log-file="$LOGS/glusterd.log"
    fi
    wait_until 30 "glusterd to answer" gluster_cli volume list >/dev/null || return 1
    # A volume left by a run that died: its bricks are gone with E2E_DIR.
    if gluster_cli volume info "$GLUSTER_VOL" >/dev/null 2>&1; then
        gluster_cli volume stop "$GLUSTER_VOL" force >/dev/null 2>&1
        gluster_cli volume delete "$GLUSTER_VOL" >/dev/null || return 1
    fi
    mkdir -p "$GLUSTER_DIR/brick1" "$GLUSTER_DIR/brick2"
    # force: both bricks on one host, on the root filesystem.
    gluster_cli volume create "$GLUSTER_VOL" replica 2 \
        "$NODES_HOST_IP:$GLUSTER_DIR/brick1" "$NODES_HOST_IP:$GLUSTER_DIR/brick2" force >/dev/null || return 1
    gluster_cli volume start "$GLUSTER_VOL" >/dev/null || return 1
    mount -t glusterfs -o "log-file=$LOGS/gluster-host-client.log" "$NODES_HOST_IP:/$GLUSTER_VOL" "$SHARED_DIR" || return 1
    log "GlusterFS volume $GLUSTER_VOL (replica 2) mounted at $SHARED_DIR"
}

# shared_fs_down: the host's client, the volume and a glusterd we started.
# After every node is down (their clients die with them).
shared_fs_down() {
    local rc=0
    [[ -d $GLUSTER_DIR ]] || return 0
    while mountpoint -q "$SHARED_DIR" 2>/dev/null; do
        umount "$SHARED_DIR" 2>/dev/null || umount -l "$SHARED_DIR" || { rc=1; break; }
    done
    if command -v gluster >/dev/null && pgrep -x glusterd >/dev/null; then
        if gluster_cli volume info "$GLUSTER_VOL" >/dev/null 2>&1; then
            gluster_cli volume stop "$GLUSTER_VOL" force >/dev/null 2>&1
            gluster_cli volume delete "$GLUSTER_VOL" >/dev/null 2>&1 || rc=1
        fi
    fi
    stop glusterd 15
    return $rc
}

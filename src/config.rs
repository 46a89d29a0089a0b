//! Process-wide settings, taken from flags once at start-up.

use std::path::PathBuf;

use std::time::Duration;

use crate::cache::Backend;
use crate::cache::layout::Reserve;
use crate::puller::engine::EngineConfig;

/// `Default` is for embedding (demo, tests): no node, local backend only.
#[derive(Clone, Debug)]
pub struct Config {
    pub driver_name: String,
    /// Set when this process serves a node (or provisions node-local volumes).
    pub node_id: Option<String>,
    pub state_dir: PathBuf,
    /// Filesystems mounted at the same path on every node; the first is the default.
    pub shared_paths: Vec<PathBuf>,
    pub backends: Vec<Backend>,
    /// Download engine settings, including each backend's cache capacity.
    pub pull: EngineConfig,
    /// Free space left alone on every root's filesystem: pulls and new
    /// sources that would eat into it are refused (`--min-free`).
    pub min_free: Reserve,
    /// Unreferenced pulled models idle this long are evicted.
    pub evict_idle: Option<Duration>,
    /// Kubernetes API access for the controller (per-PVC sources, `pvc://`,
    /// PVC events): a kubeconfig, or in-cluster when None and enabled.
    pub kube_api: bool,
    pub kubeconfig: Option<std::path::PathBuf>,
    /// Networks a tenant's pull may not reach unless its StorageClass names
    /// the host (the cluster's service and pod ranges); loopback and
    /// link-local are always closed to tenants.
    pub tenant_blocked_networks: Vec<ipnet::IpNet>,
    /// How often a running pull reports progress on its PVC.
    pub progress_every: Duration,
    /// Apply VolumeAttributesClass changes to this node's node-local
    /// volumes from the PVCs (`modify_agent`).
    pub modify_node_local: bool,
    /// The StorageClass whose parameters govern inline volumes; none: off.
    pub inline_class: Option<String>,
    /// Pull what ModelPrefetch objects ask of this node (`prefetch`).
    pub prefetch: bool,
}

impl Config {
    /// The topology key NodeGetInfo reports and node-local volumes require.
    pub fn topology_key(&self) -> String {
        format!("topology.{}/node", self.driver_name)
    }

    pub fn backend_enabled(&self, b: Backend) -> bool {
        self.backends.contains(&b)
    }
}

impl Default for Config {
    fn default() -> Self {
        Config {
            driver_name: "modelcache.csi.io".into(),
            node_id: None,
            state_dir: "/var/lib/modelcache-csi".into(),
            shared_paths: Vec::new(),
            backends: vec![Backend::Local],
            pull: EngineConfig::default(),
            min_free: Reserve::default(),
            evict_idle: None,
            kube_api: false,
            kubeconfig: None,
            tenant_blocked_networks: Vec::new(),
            progress_every: Duration::from_secs(10),
            modify_node_local: false,
            inline_class: None,
            prefetch: false,
        }
    }
}

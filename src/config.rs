//! Process-wide settings, taken from flags once at start-up.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use std::fmt;

use serde::{Deserialize, Serialize};

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
    /// Free inodes left alone likewise (`--min-free-inodes`).
    pub min_free_inodes: Reserve,
    /// Distinct pulled models one namespace's volumes may hold in a root
    /// (`--max-models-per-namespace`); 0: no bound.
    pub max_models_per_namespace: usize,
    /// Unreferenced pulled models idle this long are evicted.
    pub evict_idle: Option<Duration>,
    /// Kubernetes API access for the controller (per-PVC sources, `pvc://`,
    /// PVC events): a kubeconfig, or in-cluster when None and enabled.
    pub kube_api: bool,
    pub kubeconfig: Option<std::path::PathBuf>,
    /// What a tenant's pull (or a registry's answer) may reach beyond the
    /// fixed rules (`trust::egress`): networks blocked, private ones opened.
    pub tenant_ranges: crate::trust::egress::Ranges,
    /// How often a running pull reports progress on its PVC.
    pub progress_every: Duration,
    /// Apply VolumeAttributesClass changes to this node's node-local
    /// volumes from the PVCs (`modify_agent`).
    pub modify_node_local: bool,
    /// A central controller provisions shared volumes, and publishes
    /// their capacity (`--shared-by-central-controller`).
    pub shared_central: bool,
    /// The StorageClass whose parameters govern inline volumes; none: off.
    pub inline_class: Option<String>,
    /// The FUSE keeper's socket (`progressive::keeper`), if one runs.
    pub fuse_keeper: Option<PathBuf>,
    /// Pull what ModelPrefetch objects ask of this node (`prefetch`).
    pub prefetch: bool,
    /// Keep each ModelPrefetch's summary and Ready condition (`prefetch::summary`).
    pub summarize_prefetches: bool,
    /// Label this node warm for the classes whose model it holds (`prefetch::labels`).
    pub label_warm_nodes: bool,
    /// Serve sealed models to other nodes and fill from them (`peer`).
    pub peer: Option<PeerConfig>,
    /// What whoever deployed the driver put in its environment for pulls.
    pub admin_env: std::sync::Arc<crate::trust::AdminEnv>,
}

impl Config {
    /// The topology key NodeGetInfo reports and node-local volumes require.
    pub fn topology_key(&self) -> String {
        format!("topology.{}/node", self.driver_name)
    }

    /// The defaults, serving node `node` from `state_dir`: for embedding
    /// and tests, whose first root is then that node's `local` one.
    pub fn for_node(node: &str, state_dir: &std::path::Path) -> Config {
        Config {
            node_id: Some(node.into()),
            state_dir: state_dir.to_path_buf(),
            ..Config::default()
        }
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
            min_free_inodes: Reserve::INODES,
            max_models_per_namespace: 20,
            evict_idle: None,
            kube_api: false,
            kubeconfig: None,
            tenant_ranges: Default::default(),
            progress_every: Duration::from_secs(10),
            modify_node_local: false,
            shared_central: false,
            inline_class: None,
            fuse_keeper: None,
            prefetch: false,
            summarize_prefetches: false,
            label_warm_nodes: false,
            peer: None,
            admin_env: Default::default(),
        }
    }
}

#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Size of one ranged request.
    pub chunk_bytes: u64,
    /// Concurrent ranges per file.
    pub connections: usize,
    /// Concurrent files per model.
    pub files: usize,
    /// Concurrent models.
    pub models: usize,
    /// The stall window: a stream that yields fewer than
    /// `stall_min_bytes_per_sec x stall` bytes in any such window (nothing
    /// at all, or a trickle) is dropped and its range resumed.
    pub stall: Duration,
    pub stall_min_bytes_per_sec: u64,
    /// A pull moving fewer bytes a second than this over a stall window
    /// gives its slot to a waiting pull and goes on without one.
    pub slow_bytes_per_sec: u64,
    /// A pull of a listed size must finish within `deadline_grace` plus its
    /// size at this rate; 0: no deadline.
    pub min_average_bytes_per_sec: u64,
    pub deadline_grace: Duration,
    /// Bounds on every model (`--max-model-bytes`, `--max-model-files`); a
    /// StorageClass may lower them.
    pub limits: PullLimits,
    /// Attempts per request before giving up.
    pub attempts: u32,
    pub backoff: Duration,
    pub backoff_max: Duration,
    pub progress_every: Duration,
    /// Bytes of pulled models a root may hold; None: the filesystem's size.
    pub capacity: BTreeMap<Backend, u64>,
    /// Fetch in listing order, one large file at a time with all its
    /// connections, so the first file is usable after about its share of
    /// the transfer (progressive volumes); otherwise largest first, several
    /// at once, which ends a whole pull soonest.
    pub listing_order: bool,
    /// Memory for write buffers, shared by every stream of every model.
    /// Each file gets `2 x connections` buffers of
    /// `budget / (models x files x connections x 2)` bytes, between 256 KiB
    /// and 4 MiB: one per connection, and as many again to hold bytes that
    /// arrive ahead of the hashed frontier.
    pub buffer_budget: u64,
    /// `--sigstore-trust-root`'s JSON, checked at the start; None:
    /// sigstore's public-good instance.
    pub sigstore_trust_root: Option<std::sync::Arc<str>>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            chunk_bytes: 32 << 20,
            connections: 4,
            files: 4,
            models: 2,
            stall: Duration::from_secs(30),
            stall_min_bytes_per_sec: 1024,
            slow_bytes_per_sec: 1 << 20,
            min_average_bytes_per_sec: 256 << 10,
            deadline_grace: Duration::from_secs(600),
            limits: PullLimits::default(),
            attempts: 8,
            backoff: Duration::from_millis(200),
            backoff_max: Duration::from_secs(30),
            progress_every: Duration::from_secs(10),
            capacity: BTreeMap::new(),
            listing_order: false,
            buffer_budget: 128 << 20,
            sigstore_trust_root: None,
        }
    }
}

/// Bounds on one pull: the driver's flags, lowered by a StorageClass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PullLimits {
    /// Bytes of the model: listed files, and what layers unpack to.
    pub max_bytes: u64,
    /// Files of the model: listed files, and every entry of a layer.
    pub max_files: u64,
}

impl Default for PullLimits {
    fn default() -> Self {
        PullLimits {
            max_bytes: DEFAULT_MAX_MODEL_BYTES,
            max_files: DEFAULT_MAX_MODEL_FILES,
        }
    }
}

impl PullLimits {
    /// The tighter of two sets of limits.
    pub fn lower(self, other: Option<PullLimits>) -> PullLimits {
        match other {
            Some(o) => PullLimits {
                max_bytes: self.max_bytes.min(o.max_bytes),
                max_files: self.max_files.min(o.max_files),
            },
            None => self,
        }
    }
}

/// `--max-model-bytes` by default: 1 TiB, above any model published today.
pub const DEFAULT_MAX_MODEL_BYTES: u64 = 1 << 40;
/// `--max-model-files` by default.
pub const DEFAULT_MAX_MODEL_FILES: u64 = 100_000;

/// Peer fill's settings (`--peer-*`).
#[derive(Clone, Debug)]
pub struct PeerConfig {
    /// Where this node serves peers.
    pub listen: std::net::SocketAddr,
    /// What other nodes dial.
    pub advertise: std::net::SocketAddr,
    /// The cluster's peer credential: one token a line; the first is sent,
    /// any is accepted (rotation: add a line, wait, make it first, drop the
    /// old one).
    pub token: PeerToken,
    /// Uploads served at once; more are refused with 503 at once.
    pub max_uploads: usize,
    /// Upload bandwidth of the whole node, bytes per second; 0: unbounded.
    pub upload_bytes_per_sec: u64,
    /// The namespace of the Leases; None: the client's default.
    pub namespace: Option<String>,
    /// The networks peers' addresses may be in: a Lease naming another
    /// address (the API server, metadata, an outside host) is not dialled.
    pub networks: Vec<ipnet::IpNet>,
}

/// Where the peer tokens are read from.
#[derive(Clone, Debug)]
pub enum PeerToken {
    /// A file (`--peer-token-file`), e.g. a mounted Secret.
    File(PathBuf),
    /// A Secret in the driver's namespace (`--peer-token-secret`), created
    /// with a random token by the first node that finds it missing.
    Secret(String),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    Local,
    Shared,
    Xfs,
}

impl Backend {
    pub const ALL: [Backend; 3] = [Backend::Local, Backend::Shared, Backend::Xfs];

    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Local => "local",
            Backend::Shared => "shared",
            Backend::Xfs => "xfs",
        }
    }

    pub fn parse(s: &str) -> Option<Backend> {
        Backend::ALL.into_iter().find(|b| b.as_str() == s)
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Free space kept on a root's filesystem, below which pulls and new
/// sources are refused: the smaller of a share of the filesystem and a
/// number of bytes, so a small disk keeps a useful margin and a large one
/// does not hold back terabytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reserve {
    pub percent: u8,
    pub bytes: u64,
}

impl Default for Reserve {
    /// 5% of the filesystem, at most 10 GiB.
    fn default() -> Self {
        Reserve {
            percent: 5,
            bytes: 10 << 30,
        }
    }
}

impl Reserve {
    /// The default inode reserve: 5% of the filesystem's inodes, at most
    /// a million (`bytes` counts inodes here).
    pub const INODES: Reserve = Reserve {
        percent: 5,
        bytes: 1_000_000,
    };

    /// No reserve (tests, embedding).
    pub const NONE: Reserve = Reserve {
        percent: 0,
        bytes: 0,
    };

    /// The reserve, in bytes, on a filesystem of `total` bytes.
    pub fn of(self, total: u64) -> u64 {
        (total / 100)
            .saturating_mul(self.percent as u64)
            .min(self.bytes)
    }

    /// Parses `--min-free`: `5%`, `10G`, or both as `5%,10G` (the smaller
    /// wins); a lone percentage or size leaves the other bound out.
    pub fn parse(s: &str, parse_size: impl Fn(&str) -> Option<u64>) -> Option<Reserve> {
        let mut r = Reserve {
            percent: 100,
            bytes: u64::MAX,
        };
        let mut any = false;
        for part in s.split(',').map(str::trim) {
            if let Some(p) = part.strip_suffix('%') {
                r.percent = p.trim().parse().ok().filter(|p| *p <= 100)?;
            } else {
                r.bytes = parse_size(part)?;
            }
            any = true;
        }
        any.then_some(r)
    }
}

impl fmt::Display for Reserve {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.percent, self.bytes) {
            (100, u64::MAX) => f.write_str("none"),
            (p, u64::MAX) => write!(f, "{p}%"),
            (100, b) => write!(f, "{b} bytes"),
            (p, b) => write!(f, "{p}% or {b} bytes, whichever is smaller"),
        }
    }
}

//! modelcache-csi: parse flags, then serve CSI, run the demo, or seal a volume.

use std::path::PathBuf;
use std::sync::Arc;

use clap::{Args, Parser, Subcommand};
use modelcache_csi::cache::Backend;
use modelcache_csi::config::Config;
use modelcache_csi::node::registration::{self, Outcome, RegistrationState};
use modelcache_csi::puller::engine::EngineConfig;
use modelcache_csi::server::{self, Mode};

#[derive(Parser)]
#[command(
    name = "modelcache-csi",
    version,
    about = "CSI driver serving sealed ML models as shared read-only volumes"
)]
#[command(args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    serve: ServeArgs,
}

#[derive(Subcommand)]
enum Command {
    /// Serve CSI (the default when no subcommand is given).
    Serve(Box<ServeArgs>),
    /// Run the driver in-process on a temp dir and show three cache volumes sharing one model.
    Demo(modelcache_csi::demo::DemoArgs),
    /// Clear selected-node from pending PVCs whose node has no running driver.
    Rescheduler(ReschedulerArgs),
    /// What this node caches, and the operator's verbs on it (ls, show, verify, pin, unpin, evict, release-writer, prefetch).
    Cache {
        #[command(flatten)]
        roots: CacheArgs,
        /// table for people, json for scripts.
        #[arg(long, value_enum, default_value = "table", global = true)]
        output: modelcache_csi::admin::Output,
        #[command(subcommand)]
        command: modelcache_csi::admin::CacheCommand,
    },
    /// Hold progressive volumes' FUSE connections across restarts and upgrades of the node plugin (its own DaemonSet, updated OnDelete).
    FuseKeeper {
        #[arg(long, default_value = "/var/lib/modelcache-csi/fuse-keeper.sock")]
        socket: PathBuf,
    },
    /// Seal a source volume through a running controller (ControllerModifyVolume sealed=true).
    Seal {
        #[arg(long, default_value = "unix:///csi/csi.sock")]
        endpoint: String,
        #[arg(long)]
        volume_id: String,
    },
}

/// The flags the `cache` verbs use: where the node plugin keeps its roots
/// and how full it may fill them. Give the node plugin's own values, so
/// that the verbs see the same roots; accepted before or after the verb.
#[derive(Args, Clone)]
struct CacheArgs {
    /// The node plugin's state directory.
    #[arg(long, global = true, default_value = "/var/lib/modelcache-csi")]
    state_dir: PathBuf,
    /// The node's name [default: $NODE_ID, $NODE_NAME (as in the node
    /// plugin's container), the node the state directory's volume records
    /// name, or this host's name].
    #[arg(long, global = true, env = "NODE_ID")]
    node_id: Option<String>,
    /// A shared filesystem the node plugin uses (repeatable).
    #[arg(long, global = true)]
    shared_path: Vec<PathBuf>,
    /// Backends (comma-separated). Default: local and xfs, plus shared when --shared-path is set.
    #[arg(long, global = true, value_delimiter = ',')]
    backends: Vec<String>,
    /// BACKEND=SIZE: what `prefetch` may fill a backend's roots to.
    #[arg(long, global = true)]
    cache_capacity: Vec<String>,
    /// Free space `prefetch` never uses (as the node plugin's flag).
    #[arg(long, global = true, default_value = "5%,10G")]
    min_free: String,
    /// Free inodes `prefetch` never uses (as the node plugin's flag).
    #[arg(long, global = true, default_value = "5%,1000000")]
    min_free_inodes: String,
    /// Log format: text or json.
    #[arg(long, global = true, default_value = "text")]
    log_format: String,
}

impl CacheArgs {
    /// The node plugin's settings with these values, every other flag at
    /// its default; the node id falls back to $NODE_NAME, then the node
    /// the volume records were written for, then the host's name.
    fn serve_args(self) -> anyhow::Result<ServeArgs> {
        #[derive(Parser)]
        struct Defaults {
            #[command(flatten)]
            serve: ServeArgs,
        }
        let mut a = Defaults::try_parse_from(["modelcache-csi"])?.serve;
        a.node_id = self
            .node_id
            .or_else(|| std::env::var("NODE_NAME").ok())
            .filter(|n| !n.is_empty())
            .or_else(|| modelcache_csi::admin::node_from_records(&self.state_dir))
            .or_else(|| {
                std::fs::read_to_string("/proc/sys/kernel/hostname")
                    .ok()
                    .map(|h| h.trim().to_string())
            })
            .filter(|n| !n.is_empty());
        a.state_dir = self.state_dir;
        a.shared_path = self.shared_path;
        a.backends = self.backends;
        a.cache_capacity = self.cache_capacity;
        a.min_free = self.min_free;
        a.min_free_inodes = self.min_free_inodes;
        a.log_format = self.log_format;
        Ok(a)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum KubeApiMode {
    Auto,
    On,
    Off,
}

#[derive(Args, Clone)]
struct ReschedulerArgs {
    /// The CSI driver whose PVCs to watch.
    #[arg(long, default_value = "modelcache.csi.io")]
    driver_name: String,
    /// The node DaemonSet's node selector (key=value,...): nodes outside it never get a driver.
    #[arg(long, default_value = "")]
    node_selector: String,
    /// How long a node that should run the driver may go without it.
    #[arg(long, default_value_t = 300)]
    grace_period_seconds: u64,
    /// How often a PVC waiting out the grace period is looked at again (one
    /// with nothing to do: every ten of these; its node's and its own
    /// changes are seen at once).
    #[arg(long, default_value_t = 30)]
    resync_seconds: u64,
    /// Kubeconfig file; default: $KUBECONFIG, ~/.kube/config, or in-cluster.
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    /// Serve Prometheus /metrics and /healthz here (e.g. 0.0.0.0:9810).
    #[arg(long)]
    metrics_address: Option<std::net::SocketAddr>,
    #[arg(long, default_value = "text")]
    log_format: String,
}

#[derive(Args, Clone)]
struct ServeArgs {
    /// CSI endpoint: unix:///path/to/csi.sock
    #[arg(long, env = "CSI_ENDPOINT", default_value = "unix:///csi/csi.sock")]
    endpoint: String,
    /// Which services this process runs.
    #[arg(long, value_enum, default_value = "all")]
    mode: Mode,
    /// This node's name; required for the node service and node-local backends.
    #[arg(long, env = "NODE_ID")]
    node_id: Option<String>,
    /// CSI driver name.
    #[arg(long, default_value = "modelcache.csi.io")]
    driver_name: String,
    /// Where node-local volumes and state live.
    #[arg(long, default_value = "/var/lib/modelcache-csi")]
    state_dir: PathBuf,
    /// A filesystem mounted at this same path on every node (repeatable; the first is the default).
    #[arg(long)]
    shared_path: Vec<PathBuf>,
    /// Backends to enable (comma-separated). Default: local and xfs, plus shared when --shared-path is set.
    #[arg(long, value_delimiter = ',')]
    backends: Vec<String>,
    /// Cap on the bytes of pulled models per backend, e.g. local=50G (repeatable).
    #[arg(long)]
    cache_capacity: Vec<String>,
    /// Free space never used on a root's filesystem: a percentage, a size,
    /// or both (`5%,10G`: the smaller). Pulls and new sources that would eat
    /// into it are refused with RESOURCE_EXHAUSTED. `0` turns it off.
    #[arg(long, default_value = "5%,10G")]
    min_free: String,
    /// Free inodes never used on a root's filesystem: a percentage, a
    /// count, or both (`5%,1000000`: the smaller). Kubelet and the
    /// container runtime share the node's filesystem and fail without
    /// inodes; a pull that would eat into them is refused with
    /// RESOURCE_EXHAUSTED. `0` turns it off.
    #[arg(long, default_value = "5%,1000000")]
    min_free_inodes: String,
    /// Distinct pulled models the volumes of one namespace (PVCs and
    /// inline volumes) may hold in a root: inline volumes have no
    /// ResourceQuota. `0` turns it off.
    #[arg(long, default_value_t = 20)]
    max_models_per_namespace: usize,
    /// Evict unreferenced, unpinned pulled models idle this many minutes.
    #[arg(long)]
    evict_idle_minutes: Option<u64>,
    /// Parallel ranged requests per file.
    #[arg(long, default_value_t = 4)]
    pull_connections: usize,
    /// Models pulled at once.
    #[arg(long, default_value_t = 2)]
    pull_parallel_models: usize,
    /// Size of one ranged request, MiB.
    #[arg(long, default_value_t = 32)]
    pull_chunk_mib: u64,
    /// The stall window: a download stream sending less than
    /// --pull-stall-min-bytes-per-second over this many seconds (nothing,
    /// or a trickle) is dropped and resumed.
    #[arg(long, default_value_t = 30)]
    pull_stall_seconds: u64,
    /// The least a live download stream sends, averaged over the stall window.
    #[arg(long, default_value_t = 1024)]
    pull_stall_min_bytes_per_second: u64,
    /// A pull moving fewer bytes a second than this over a stall window,
    /// while other pulls wait for a slot, gives its slot
    /// (--pull-parallel-models) to them and goes on without one: slow
    /// origins cannot hold every slot.
    #[arg(long, default_value_t = 1 << 20)]
    pull_slow_bytes_per_second: u64,
    /// A pull of a listed size fails (Unavailable; a retry resumes it) if
    /// it has not finished within --pull-deadline-grace-seconds plus its
    /// size at this rate. `0` turns the deadline off.
    #[arg(long, default_value_t = 256 << 10)]
    pull_min_average_bytes_per_second: u64,
    #[arg(long, default_value_t = 600)]
    pull_deadline_grace_seconds: u64,
    /// The largest model a pull may fetch or unpack to (K/M/G/T suffixes);
    /// a StorageClass may lower it with maxModelBytes.
    #[arg(long, default_value = "1T")]
    max_model_bytes: String,
    /// The most files (layer entries included) a model may have; a
    /// StorageClass may lower it with maxModelFiles.
    #[arg(long, default_value_t = modelcache_csi::puller::source::DEFAULT_MAX_MODEL_FILES)]
    max_model_files: u64,
    /// Serve Prometheus /metrics and /healthz here (e.g. 0.0.0.0:9809).
    #[arg(long)]
    metrics_address: Option<std::net::SocketAddr>,
    /// Kubernetes API access (PVC source annotation, pvc://, PVC events):
    /// auto uses --kubeconfig, $KUBECONFIG or the in-cluster service account when present.
    #[arg(long, value_enum, default_value = "auto")]
    kube_api: KubeApiMode,
    /// Kubeconfig file for --kube-api.
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    /// Register with kubelet: serve its plugin-registration API on a socket
    /// in this directory (kubelet's plugins_registry, as mounted here).
    #[arg(long)]
    registration_dir: Option<PathBuf>,
    /// The CSI socket's path as kubelet sees it on the host, given to
    /// kubelet at registration [default: /var/lib/kubelet/plugins/<driver-name>/csi.sock]
    #[arg(long)]
    kubelet_registration_path: Option<PathBuf>,
    /// Networks a tenant-named source (or a model registry's answer) may
    /// not reach unless its StorageClass names the host, even where
    /// --tenant-open-networks opens them (comma-separated). Loopback,
    /// private, shared (CGNAT), unique-local and reserved ranges are closed
    /// anyway, and metadata services always.
    #[arg(long, value_delimiter = ',')]
    tenant_blocked_networks: Vec<ipnet::IpNet>,
    /// Private or reserved networks tenant-named sources may reach (a model
    /// mirror on the VPC), comma-separated; metadata addresses stay closed.
    #[arg(long, value_delimiter = ',')]
    tenant_open_networks: Vec<ipnet::IpNet>,
    /// How often a running pull reports its progress as an event on its PVC.
    #[arg(long, default_value_t = 10)]
    progress_interval_seconds: u64,
    /// Apply VolumeAttributesClass changes (sealing, pinning) to this
    /// node's node-local volumes, watching their PVCs, and report each
    /// outcome on the PV for the central controller; needs --node-id, the
    /// controller service and Kubernetes API access.
    #[arg(long)]
    modify_node_local_volumes: bool,
    /// A central controller provisions the shared backends' volumes (the
    /// Deployment in deploy/csi-driver): asked for the room for one claim
    /// of a shared class (GetCapacity with csi.storage.k8s.io/pvc/name, as
    /// external-provisioner --node-deployment-immediate-binding
    /// --extra-create-metadata asks before it takes an Immediate claim),
    /// this node's driver answers none, so it never takes one. Capacity
    /// for CSIStorageCapacity (no claim) stays real. Needs --node-id.
    #[arg(long)]
    shared_by_central_controller: bool,
    /// CSI ephemeral inline volumes: the StorageClass (of this driver)
    /// whose parameters govern them, allowedSources above all. Without it
    /// a pod's inline volume is refused.
    #[arg(long)]
    inline_storage_class: Option<String>,
    /// The FUSE keeper's socket (`modelcache-csi fuse-keeper`, a DaemonSet
    /// of its own, updated OnDelete): progressive volumes' connections are
    /// handed to it, so that a restart of this process never breaks a
    /// pod's reads. Without it a restart leaves their mounts dead.
    #[arg(long)]
    fuse_keeper_socket: Option<PathBuf>,
    /// Keep warm on this node the models that ModelPrefetch objects select
    /// it for: a model held is said by the node's warm label (as
    /// --label-warm-nodes, which this turns on), a failed pull by this
    /// node's line of the status; needs --node-id, the controller service
    /// and Kubernetes API access.
    #[arg(long)]
    prefetch: bool,
    /// Keep each ModelPrefetch's status summary up to date: how many of the
    /// nodes it selects (those running this driver) hold the model (their
    /// warm label) and how many failed (their lines), and a Ready
    /// condition for `kubectl wait`; needs the controller
    /// service and Kubernetes API access (on in deploy/'s controller).
    #[arg(long)]
    summarize_prefetches: bool,
    /// Label this node's Node `warm.<driver name>/<class>: "true"` for each
    /// StorageClass of this driver whose model it holds sealed (added at
    /// the seal, removed at eviction), for a preferred node affinity; needs
    /// --node-id, the controller service, Kubernetes API access and
    /// `patch` on nodes (on in deploy/'s node plugin).
    #[arg(long)]
    label_warm_nodes: bool,
    /// Peer fill: serve this node's sealed models to other nodes' drivers
    /// here, and fill models from them before the origin (e.g.
    /// 0.0.0.0:7420); needs --node-id, the controller service, Kubernetes
    /// API access and the peer token (--peer-token-secret or
    /// --peer-token-file).
    #[arg(long)]
    peer_listen: Option<std::net::SocketAddr>,
    /// The address other nodes dial [default: $POD_IP, else --peer-listen's
    /// address, with --peer-listen's port].
    #[arg(long)]
    peer_advertise: Option<std::net::SocketAddr>,
    /// The cluster's peer credential: one token a line, at least 16
    /// characters; the first is presented, any is accepted.
    #[arg(long, conflicts_with = "peer_token_secret")]
    peer_token_file: Option<PathBuf>,
    /// The peer credential from this Secret (key `token`) in the driver's
    /// namespace, created with a random token if missing; read again
    /// every 15 s, so editing it rotates the token.
    #[arg(long)]
    peer_token_secret: Option<String>,
    /// Create this Secret (key `token`) with a random peer token in the
    /// driver's namespace unless it exists: the controller does it once at
    /// install, so that node plugins only read it (--peer-token-secret).
    #[arg(long)]
    create_peer_token_secret: Option<String>,
    /// The networks other nodes' peer addresses may be in (CIDRs, comma
    /// separated): an address a Lease names outside them is never dialled,
    /// nor is link-local (cloud metadata) whatever is listed.
    #[arg(
        long,
        default_value = "10.0.0.0/8,172.16.0.0/12,192.168.0.0/16,100.64.0.0/10,fc00::/7"
    )]
    peer_networks: String,
    /// Uploads to peers served at once; more are told to go elsewhere.
    #[arg(long, default_value_t = 16)]
    peer_max_uploads: usize,
    /// Upload bandwidth to peers, shared by every upload (MiB/s; 0: unbounded).
    #[arg(long, default_value_t = 250)]
    peer_upload_mib_per_second: u64,
    /// The namespace of the peer Leases [default: the kubeconfig's, or the
    /// pod's own namespace].
    #[arg(long)]
    peer_namespace: Option<String>,
    /// Sigstore's trusted root (`trusted_root.json`) for classes that take
    /// keyless model signatures (signatureIdentity, signatureIssuer): the
    /// CAs, transparency logs and CT logs they are checked against,
    /// offline. Default: the public-good instance's root as this build
    /// ships it; keep a current one in a ConfigMap (docs/kubernetes.md).
    #[arg(long, env = "MODELCACHE_SIGSTORE_TRUST_ROOT")]
    sigstore_trust_root: Option<PathBuf>,
    /// Log format: text or json.
    #[arg(long, default_value = "text")]
    log_format: String,
}

/// Peer fill's settings from the flags, or None without --peer-listen.
fn peer_config(a: &ServeArgs) -> anyhow::Result<Option<modelcache_csi::peer::PeerConfig>> {
    let Some(listen) = a.peer_listen else {
        anyhow::ensure!(
            a.peer_advertise.is_none()
                && a.peer_token_file.is_none()
                && a.peer_token_secret.is_none(),
            "--peer-advertise, --peer-token-file and --peer-token-secret need --peer-listen"
        );
        return Ok(None);
    };
    let token = match (&a.peer_token_file, &a.peer_token_secret) {
        (Some(f), _) => Some(modelcache_csi::config::PeerToken::File(f.clone())),
        (None, Some(s)) if !s.is_empty() => {
            Some(modelcache_csi::config::PeerToken::Secret(s.clone()))
        }
        _ => None,
    };
    let token = token.ok_or_else(|| {
        anyhow::anyhow!("--peer-listen needs --peer-token-file or --peer-token-secret (the cluster's peer credential)")
    })?;
    let advertise = match a.peer_advertise {
        Some(a) => a,
        None => {
            let ip = match std::env::var("POD_IP") {
                Ok(ip) => ip.parse().map_err(|e| {
                    anyhow::anyhow!("$POD_IP {ip:?} is not an address ({e}); set --peer-advertise")
                })?,
                Err(_) => listen.ip(),
            };
            anyhow::ensure!(
                !ip.is_unspecified(),
                "--peer-listen {listen} names no address other nodes can dial: set --peer-advertise or $POD_IP"
            );
            std::net::SocketAddr::new(ip, listen.port())
        }
    };
    Ok(Some(modelcache_csi::peer::PeerConfig {
        listen,
        advertise,
        token,
        max_uploads: a.peer_max_uploads.max(1),
        upload_bytes_per_sec: a.peer_upload_mib_per_second.saturating_mul(1 << 20),
        namespace: a.peer_namespace.clone().filter(|n| !n.is_empty()),
        networks: a
            .peer_networks
            .split(',')
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .map(|n| {
                n.parse().map_err(|e| {
                    anyhow::anyhow!("--peer-networks: {n:?} is not a CIDR ({e}); e.g. 10.0.0.0/8")
                })
            })
            .collect::<anyhow::Result<_>>()?,
    }))
}

fn config(a: &ServeArgs) -> anyhow::Result<Config> {
    let backends = if a.backends.is_empty() {
        let mut b = vec![Backend::Local, Backend::Xfs];
        if !a.shared_path.is_empty() {
            b.push(Backend::Shared);
        }
        b
    } else {
        a.backends
            .iter()
            .map(|s| {
                Backend::parse(s.trim()).ok_or_else(|| {
                    anyhow::anyhow!("--backends: {s:?} is not one of local, shared, xfs")
                })
            })
            .collect::<anyhow::Result<_>>()?
    };
    for p in &a.shared_path {
        anyhow::ensure!(
            p.is_absolute(),
            "--shared-path {} must be absolute",
            p.display()
        );
    }
    anyhow::ensure!(!a.driver_name.is_empty(), "--driver-name must not be empty");
    if let Some(node) = a.node_id.as_deref().filter(|n| !n.is_empty()) {
        modelcache_csi::cache::layout::check_node_id(node)
            .map_err(|m| anyhow::anyhow!("--node-id: {m}"))?;
    }
    let min_free =
        modelcache_csi::cache::layout::Reserve::parse(&a.min_free, |s| parse_size(s).ok())
            .ok_or_else(|| {
                anyhow::anyhow!(
                    "--min-free {:?} must be a percentage, a size, or both, like 5%,10G",
                    a.min_free
                )
            })?;
    let min_free_inodes = modelcache_csi::cache::layout::Reserve::parse(&a.min_free_inodes, |s| {
        s.parse().ok()
    })
    .ok_or_else(|| {
        anyhow::anyhow!(
            "--min-free-inodes {:?} must be a percentage, a count, or both, like 5%,1000000",
            a.min_free_inodes
        )
    })?;
    let mut pull = EngineConfig {
        connections: a.pull_connections.max(1),
        models: a.pull_parallel_models.max(1),
        chunk_bytes: a.pull_chunk_mib.max(1) << 20,
        stall: std::time::Duration::from_secs(a.pull_stall_seconds.max(1)),
        stall_min_bytes_per_sec: a.pull_stall_min_bytes_per_second,
        slow_bytes_per_sec: a.pull_slow_bytes_per_second,
        min_average_bytes_per_sec: a.pull_min_average_bytes_per_second,
        deadline_grace: std::time::Duration::from_secs(a.pull_deadline_grace_seconds),
        limits: modelcache_csi::puller::source::PullLimits {
            max_bytes: parse_size(&a.max_model_bytes)
                .map_err(|e| anyhow::anyhow!("--max-model-bytes: {e}"))?
                .max(1),
            max_files: a.max_model_files.max(1),
        },
        ..EngineConfig::default()
    };
    for c in &a.cache_capacity {
        let (b, size) = c
            .split_once('=')
            .ok_or_else(|| anyhow::anyhow!("--cache-capacity {c:?} must look like local=50G"))?;
        let backend = Backend::parse(b).ok_or_else(|| {
            anyhow::anyhow!("--cache-capacity: {b:?} is not one of local, shared, xfs")
        })?;
        pull.capacity.insert(backend, parse_size(size)?);
    }
    Ok(Config {
        driver_name: a.driver_name.clone(),
        node_id: a.node_id.clone().filter(|n| !n.is_empty()),
        state_dir: a.state_dir.clone(),
        shared_paths: a.shared_path.clone(),
        backends,
        pull,
        min_free,
        min_free_inodes,
        max_models_per_namespace: a.max_models_per_namespace,
        kube_api: match a.kube_api {
            KubeApiMode::On => true,
            KubeApiMode::Off => false,
            KubeApiMode::Auto => {
                a.kubeconfig.is_some()
                    || std::env::var_os("KUBECONFIG").is_some()
                    || std::env::var_os("KUBERNETES_SERVICE_HOST").is_some()
            }
        },
        kubeconfig: a.kubeconfig.clone(),
        tenant_ranges: modelcache_csi::trust::egress::Ranges {
            blocked: a.tenant_blocked_networks.clone(),
            open: a.tenant_open_networks.clone(),
        },
        progress_every: std::time::Duration::from_secs(a.progress_interval_seconds.max(1)),
        modify_node_local: a.modify_node_local_volumes,
        shared_central: a.shared_by_central_controller,
        inline_class: a.inline_storage_class.clone().filter(|c| !c.is_empty()),
        fuse_keeper: a.fuse_keeper_socket.clone(),
        prefetch: a.prefetch,
        summarize_prefetches: a.summarize_prefetches,
        label_warm_nodes: a.label_warm_nodes,
        peer: peer_config(a)?,
        admin_env: Arc::new(modelcache_csi::trust::AdminEnv::from_process()),
        evict_idle: a
            .evict_idle_minutes
            .map(|m| std::time::Duration::from_secs(m * 60)),
    })
}

fn parse_size(s: &str) -> anyhow::Result<u64> {
    modelcache_csi::puller::source::parse_size(s).map_err(|m| anyhow::anyhow!(m))
}

/// `default_level` applies unless RUST_LOG is set.
fn init_logging(format: &str, default_level: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| default_level.into());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if format == "json" {
        builder.json().init();
    } else {
        builder.init();
    }
}

async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    tracing::info!("shutting down");
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Some(Command::Demo(args)) => {
            // The demo narrates on stdout; the driver's per-call logs would drown it.
            init_logging("text", "warn");
            modelcache_csi::demo::run(args).await
        }
        Some(Command::Seal {
            endpoint,
            volume_id,
        }) => {
            let mut c =
                modelcache_csi::client::Client::connect(server::socket_path(&endpoint)?).await?;
            c.controller
                .controller_modify_volume(modelcache_csi::csi::ControllerModifyVolumeRequest {
                    volume_id: volume_id.clone(),
                    mutable_parameters: [("sealed".to_string(), "true".to_string())].into(),
                    ..Default::default()
                })
                .await
                .map_err(|s| anyhow::anyhow!("seal {volume_id}: {}: {}", s.code(), s.message()))?;
            println!("sealed {volume_id}");
            Ok(())
        }
        Some(Command::Cache {
            roots,
            output,
            command,
        }) => {
            let serve = roots.serve_args()?;
            init_logging(&serve.log_format, "warn");
            let cfg = config(&serve)?;
            // An operator's command: the reason, without a backtrace.
            if let Err(e) = modelcache_csi::admin::run(cfg, output, command).await {
                eprintln!("error: {e}");
                std::process::exit(1);
            }
            Ok(())
        }
        Some(Command::FuseKeeper { socket }) => {
            init_logging("text", "info");
            tokio::task::spawn_blocking(move || modelcache_csi::progressive::keeper::run(&socket))
                .await??;
            Ok(())
        }
        Some(Command::Serve(a)) => run_serve(*a).await,
        Some(Command::Rescheduler(a)) => run_rescheduler(a).await,
        None => run_serve(cli.serve).await,
    }
}

async fn run_rescheduler(a: ReschedulerArgs) -> anyhow::Result<()> {
    init_logging(&a.log_format, "info");
    let node_selector = modelcache_csi::rescheduler::parse_selector(&a.node_selector)
        .map_err(anyhow::Error::msg)?;
    let client = server::kube_client(a.kubeconfig.as_deref()).await?;
    let cfg = modelcache_csi::rescheduler::Config {
        driver_name: a.driver_name,
        node_selector,
        grace: std::time::Duration::from_secs(a.grace_period_seconds),
        resync: std::time::Duration::from_secs(a.resync_seconds.max(1)),
        instance: std::env::var("POD_NAME").ok(),
    };
    let metrics = Arc::new(modelcache_csi::metrics::Metrics::new());
    if let Some(addr) = a.metrics_address {
        tokio::spawn(modelcache_csi::metrics::serve(
            modelcache_csi::metrics::bind(addr)?,
            metrics.clone(),
            Arc::new(|_| None),
            Arc::new(Vec::new),
        ));
    }
    tokio::select! {
        _ = modelcache_csi::rescheduler::run(client, cfg, metrics) => Ok(()),
        _ = shutdown_signal() => Ok(()),
    }
}

async fn run_serve(a: ServeArgs) -> anyhow::Result<()> {
    init_logging(&a.log_format, "info");
    let mut cfg = config(&a)?;
    if let Some(path) = &a.sigstore_trust_root {
        let json = std::fs::read_to_string(path)
            .map_err(|e| anyhow::anyhow!("--sigstore-trust-root {}: {e}", path.display()))?;
        modelcache_csi::signing::SigstoreRoot::check(&json)
            .map_err(|e| anyhow::anyhow!("--sigstore-trust-root {}: {e}", path.display()))?;
        cfg.pull.sigstore_trust_root = Some(json.into());
    }
    let cfg = Arc::new(cfg);
    let registration = registrar(&a, &cfg)?;
    let reg_state = RegistrationState::default();
    let metrics = Arc::new(modelcache_csi::metrics::Metrics::new());
    if let Some(addr) = a.metrics_address {
        let caps = cfg.pull.capacity.clone();
        let (health_cfg, health_reg) = (cfg.clone(), reg_state.clone());
        let health = move || {
            let mut p = modelcache_csi::provision::health::problems(&health_cfg);
            if let Outcome::Rejected(e) = health_reg.get() {
                p.push(format!("kubelet refused the plugin registration: {e}"));
            }
            p
        };
        let listener = modelcache_csi::metrics::serve(
            modelcache_csi::metrics::bind(addr)?,
            metrics.clone(),
            Arc::new(move |b| caps.get(&b).copied()),
            Arc::new(health),
        );
        tokio::spawn(async move {
            if let Err(e) = listener.await {
                tracing::error!(error = %e, "metrics endpoint failed");
            }
        });
    }
    for p in modelcache_csi::provision::health::problems(&cfg) {
        tracing::warn!(problem = %p, "a backend is not usable; Probe will report not ready");
    }
    if let Some(name) = a.create_peer_token_secret.clone().filter(|n| !n.is_empty()) {
        let client = server::kube_client(a.kubeconfig.as_deref())
            .await
            .map_err(|e| {
                anyhow::anyhow!("--create-peer-token-secret needs Kubernetes API access: {e}")
            })?;
        let namespace = a
            .peer_namespace
            .clone()
            .filter(|n| !n.is_empty())
            .unwrap_or_else(|| client.default_namespace().to_string());
        // Once at start, briefly, so that a process that also reads the
        // token (a node with both flags) finds it; then in the background
        // while the API does not answer.
        let first = tokio::time::timeout(
            PEER_TOKEN_FIRST,
            modelcache_csi::peer::ensure_token_secret(client.clone(), &namespace, &name),
        )
        .await;
        if !matches!(first, Ok(Ok(()))) {
            tokio::spawn(async move {
                let made = modelcache_csi::retry::retry(
                    "the peer token was not created",
                    PEER_TOKEN_CREATE,
                    modelcache_csi::retry::transient,
                    || modelcache_csi::peer::ensure_token_secret(client.clone(), &namespace, &name),
                )
                .await;
                if let Err(e) = made {
                    tracing::error!(error = %e, "could not create the peer token; node plugins have no peers until it exists");
                }
            });
        }
    }
    // The registration socket appears only once the CSI socket answers:
    // kubelet calls NodeGetInfo on it as soon as it sees the registration.
    let (csi_published, csi_in_place) = tokio::sync::oneshot::channel();
    let listener = modelcache_csi::uds::bind_hidden(&server::socket_path(&a.endpoint)?)?
        .on_publish(csi_published);
    // Sidecars hold their connections open, so a graceful shutdown alone
    // would wait for them forever; in-flight calls get SHUTDOWN_GRACE, and
    // an interrupted pull resumes on the provisioner's retry.
    let signalled = Arc::new(tokio::sync::Notify::new());
    let stop = {
        let s = signalled.clone();
        async move {
            shutdown_signal().await;
            s.notify_one();
        }
    };
    let deadline = async move {
        signalled.notified().await;
        tokio::time::sleep(SHUTDOWN_GRACE).await;
        tracing::warn!(grace = ?SHUTDOWN_GRACE, "calls still open after the shutdown grace; exiting");
    };
    let serving = server::serve_on(cfg, metrics, a.mode, listener, stop);
    let socket = registration.as_ref().map(|r| r.socket());
    let registering = async move {
        match registration {
            Some(reg) => {
                // A server that fails before it answers ends the process.
                if csi_in_place.await.is_err() {
                    std::future::pending::<()>().await;
                }
                registration::run(reg, reg_state).await
            }
            None => std::future::pending().await,
        }
    };
    let r = tokio::select! {
        r = serving => r,
        () = deadline => Ok(()),
        r = registering => r,
    };
    if let Some(socket) = socket {
        // Kubelet deregisters a plugin whose socket is gone; a stale
        // socket would leave it calling a dead endpoint instead.
        let _ = std::fs::remove_file(socket);
    }
    r
}

const SHUTDOWN_GRACE: std::time::Duration = std::time::Duration::from_secs(10);

/// How long the first attempt to create the peer token may hold the start.
const PEER_TOKEN_FIRST: std::time::Duration = std::time::Duration::from_secs(5);

/// How long the controller keeps trying to create the peer token while
/// the API does not answer.
const PEER_TOKEN_CREATE: modelcache_csi::retry::Backoff = modelcache_csi::retry::Backoff {
    first: std::time::Duration::from_secs(1),
    max: std::time::Duration::from_secs(30),
    total: Some(std::time::Duration::from_secs(3600)),
    times: None,
};

fn registrar(a: &ServeArgs, cfg: &Config) -> anyhow::Result<Option<registration::Registrar>> {
    let Some(dir) = &a.registration_dir else {
        anyhow::ensure!(
            a.kubelet_registration_path.is_none(),
            "--kubelet-registration-path needs --registration-dir"
        );
        return Ok(None);
    };
    anyhow::ensure!(
        matches!(a.mode, Mode::Node | Mode::All),
        "--registration-dir registers the node service with kubelet: use it with --mode node or all"
    );
    let endpoint = a.kubelet_registration_path.clone().unwrap_or_else(|| {
        PathBuf::from(format!(
            "/var/lib/kubelet/plugins/{}/csi.sock",
            cfg.driver_name
        ))
    });
    anyhow::ensure!(
        endpoint.is_absolute(),
        "--kubelet-registration-path {} must be an absolute path on the host",
        endpoint.display()
    );
    Ok(Some(registration::Registrar {
        driver_name: cfg.driver_name.clone(),
        registration_dir: dir.clone(),
        kubelet_endpoint: endpoint,
    }))
}

//! Peer fill: each node serves the models it holds to the drivers of
//! other nodes, and fills a model it lacks from them before the origin.
//!
//! - `directory`: who holds what, published as one Lease per node in the
//!   driver's namespace (the Kubernetes API is the only shared state).
//! - `server`: the node's peer endpoint, for drivers holding the cluster's
//!   peer token only, with upload caps.
//! - `fill`: a `Source` in front of the origin that takes whole chunks
//!   from peers, checks each against the seal's chunk table and the file
//!   against the origin's sha256, and falls back to the origin per range.

pub mod directory;
pub mod fill;
pub mod server;

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::cache::{Root, Roots, SourceId};
pub use crate::config::PeerConfig;
use crate::error::{Error, Result};

// The protocol between peers, shared by `server` and `fill`.

/// How long a peer still pulling holds a request for a chunk it has not
/// got yet, while its pull moves; under the engine's stall window, so a
/// stream waiting on it is never taken for a stalled one.
pub const WAIT_FOR_CHUNK: Duration = Duration::from_secs(15);
/// The header naming why a request was refused (`busy`, `not_yet`, ...).
pub const REFUSED: &str = "x-modelcache-refused";
/// The header a peer sends its chunk's digest in.
pub const CHUNK_DIGEST: &str = "x-modelcache-chunk-sha256";

/// The roots whose sealed models this node serves to peers and fills from
/// them: node-local directory trees. A shared root is one copy for every
/// node already; an XFS image is read only through a mount.
pub fn servable(roots: &Roots) -> Vec<Root> {
    roots
        .roots
        .iter()
        .filter(|r| r.node.is_some() && r.backend.store().fs_type().is_none())
        .cloned()
        .collect()
}

/// Whether peers may fill `root`: a node-local root of any store.
pub fn fillable(root: &Root) -> bool {
    root.node.is_some()
}

/// Whether `sid` names a pulled model (only those are shared).
pub fn is_model(sid: &str) -> bool {
    SourceId::parse(sid).is_some_and(|s| s.kind() == crate::cache::layout::SourceKind::Model)
}

/// The token file, read again every few seconds so a rotated Secret takes
/// effect without a restart.
pub struct Tokens {
    path: PathBuf,
    cached: Mutex<(Instant, Vec<String>)>,
}

const TOKENS_FRESH_FOR: Duration = Duration::from_secs(5);

impl Tokens {
    /// Reads `path` once: an unreadable or empty file is an error at start.
    pub fn load(path: PathBuf) -> Result<Tokens> {
        let tokens = read_tokens(&path)?;
        Ok(Tokens {
            path,
            cached: Mutex::new((Instant::now(), tokens)),
        })
    }

    fn current(&self) -> Vec<String> {
        let mut c = self.cached.lock().unwrap_or_else(|p| p.into_inner());
        if c.0.elapsed() > TOKENS_FRESH_FOR {
            // A file being rotated may be briefly unreadable: keep the old.
            if let Ok(t) = read_tokens(&self.path) {
                c.1 = t;
            }
            c.0 = Instant::now();
        }
        c.1.clone()
    }

    /// The token this node presents.
    pub fn presented(&self) -> String {
        self.current().into_iter().next().unwrap_or_default()
    }

    /// Whether `given` is one of the tokens, compared in constant time.
    pub fn accepts(&self, given: &str) -> bool {
        self.current().iter().fold(false, |ok, t| {
            ok | constant_time_eq(t.as_bytes(), given.as_bytes())
        })
    }
}

fn read_tokens(path: &std::path::Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        Error::invalid(
            "--peer-token-file",
            format!("cannot read {}: {e}", path.display()),
        )
    })?;
    let tokens: Vec<String> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(str::to_string)
        .collect();
    if tokens.iter().any(|t| t.len() < 16) || tokens.is_empty() {
        return Err(Error::invalid(
            "--peer-token-file",
            format!(
                "{} must hold at least one token of 16 characters or more, one a line (the manifests make one: `head -c 32 /dev/urandom | base64`)",
                path.display()
            ),
        ));
    }
    Ok(tokens)
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Starts serving peers and publishing this node's models; returns the
/// fill the engine uses.
pub async fn start(
    cfg: PeerConfig,
    node: String,
    driver: &str,
    roots: &Roots,
    client: kube::Client,
) -> anyhow::Result<Arc<fill::PeerFill>> {
    let tokens = Arc::new(Tokens::load(cfg.token_file.clone())?);
    let served = servable(roots);
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .map_err(|e| anyhow::anyhow!("--peer-listen {}: {e}", cfg.listen))?;
    let namespace = cfg
        .namespace
        .clone()
        .unwrap_or_else(|| client.default_namespace().to_string());
    let dir = Arc::new(directory::Directory::new(
        client,
        &namespace,
        node.clone(),
        driver,
        cfg.advertise.to_string(),
        served.clone(),
    ));
    tokio::spawn(dir.clone().run());
    let srv = Arc::new(server::PeerServer::new(
        served,
        tokens.clone(),
        cfg.max_uploads,
        cfg.upload_bytes_per_sec,
    ));
    tokio::spawn(srv.serve(listener));
    tracing::info!(listen = %cfg.listen, advertise = %cfg.advertise, %namespace, "serving peers");
    Ok(Arc::new(fill::PeerFill::new(dir, tokens, node)))
}
